"""vLLM's own engine flags, verbatim: read by the installed vLLM's parser, folded into the fields that stand for them,
on every way a worker starts (`python -m workers -- ...`, `up -- ...`, `--vllm-args`, `ROLLOUT_VLLM_ARGS`,
`--vllm-config`), and refused with vLLM's message and exit status 2 before anything starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollout_svc.config import VLLM_ARGS_ENV, EngineSettings
from tests.support import ROOT
from workers.__main__ import parse_args

pytestmark = pytest.mark.imports_vllm


def test_the_flags_a_user_gives_are_what_vllms_parser_makes_of_them():
    from workers.vllm_flags import given_flags

    given = given_flags(["-tp", "2", "--enforce-eager", "--gpu_memory_utilization=0.85", "--quantization", "fp8"])
    assert given == {
        "tensor_parallel_size": 2,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.85,
        "quantization": "fp8",
    }
    assert given_flags([]) == {}


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--no-such-flag"], "--no-such-flag"),
        (["--max-num-seqs", "many"], "many"),
        (["--dtype", "float8"], "float8"),
        (["--port", "8000"], "--port"),  # a server option of `vllm serve`, not an engine flag
    ],
)
def test_a_flag_or_value_vllm_does_not_take_is_refused_with_its_message(flags, named):
    from workers.vllm_flags import VLLMFlagError, given_flags

    with pytest.raises(VLLMFlagError, match=named):
        given_flags(flags)


def test_flags_that_a_field_stands_for_are_folded_into_it_and_resolving_twice_changes_nothing():
    from workers.vllm_flags import resolve

    engine = resolve(EngineSettings(vllm_args="--max-num-seqs 8 --max-model-len 1024 -tp 2 --enforce-eager"))
    assert (engine.max_num_seqs, engine.max_model_len, engine.tensor_parallel_size) == (8, 1024, 2)
    assert engine.capacity == 8 and engine.gpus == 2
    assert engine.vllm_args == "--max-num-seqs 8 --max-model-len 1024 -tp 2 --enforce-eager"  # kept as given
    assert resolve(engine) == engine
    # what a worker started by `up` receives resolves to the same settings
    assert resolve(EngineSettings.from_args(parse_args(engine.to_args()))) == engine


def test_a_field_and_a_flag_that_disagree_are_refused_naming_both():
    from workers.vllm_flags import resolve

    with pytest.raises(ValueError, match="--max-num-seqs 16 and vLLM's --max-num-seqs 8"):
        resolve(EngineSettings(max_num_seqs=16, vllm_args="--max-num-seqs 8"))
    assert resolve(EngineSettings(max_num_seqs=8, vllm_args="--max-num-seqs 8")).max_num_seqs == 8
    with pytest.raises(ValueError, match="these workers run the echo engine"):
        resolve(EngineSettings(engine="echo", vllm_args="--max-num-seqs 8"))


def test_a_vllm_config_file_is_read_as_vllm_serve_reads_it_and_inlined(tmp_path: Path):
    from workers.vllm_flags import VLLMFlagError, resolve

    config = tmp_path / "engine.yaml"
    config.write_text("max-num-seqs: 8\nenforce-eager: false\nspeculative-config:\n  num_speculative_tokens: 3\n")
    engine = resolve(EngineSettings(vllm_config=str(config), vllm_args="--max-num-seqs 4"))
    assert engine.max_num_seqs == 4  # the command line wins over the file, as with `vllm serve --config`
    assert engine.vllm_config == "" and engine.vllm_args.startswith("--max-num-seqs 8 --no-enforce-eager")
    with pytest.raises(VLLMFlagError, match="yaml"):
        resolve(EngineSettings(vllm_config=str(tmp_path / "engine.json")))


def test_the_flags_reach_vllms_engine_arguments_over_the_services_own():
    from workers.vllm_args import vllm_engine_args

    engine = EngineSettings(vllm_args="--gpu-memory-utilization 0.85 --no-enforce-eager --max-num-seqs 8")
    args = vllm_engine_args("/no/model", **engine.vllm_kwargs())
    assert (args.gpu_memory_utilization, args.enforce_eager, args.max_num_seqs) == (0.85, False, 8)
    assert args.logprobs_mode == "processed_logprobs"  # what the service needs stays
    plain = vllm_engine_args("/no/model", **EngineSettings().vllm_kwargs())
    assert plain.enforce_eager is True and plain.gpu_memory_utilization == 0.92  # vLLM's default where not given


def test_python_m_workers_takes_the_flags_after_a_double_dash_and_from_the_environment(monkeypatch):
    args = parse_args(["--engine", "vllm", "--max-model-len", "1024", "--", "--max-num-seqs", "8", "-tp", "2"])
    assert args.vllm_args == "--max-num-seqs 8 -tp 2" and args.max_model_len == 1024
    monkeypatch.setenv(VLLM_ARGS_ENV, "--enforce-eager")
    assert parse_args(["--", "--seed", "3"]).vllm_args == "--enforce-eager --seed 3"
    assert EngineSettings(vllm_args="--enforce-eager").to_args() == ["--vllm-args=--enforce-eager"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "command",
    [
        ["-m", "rollout_svc", "up", "--workers", "1", "--engine", "vllm"],
        ["-m", "workers", "--engine", "vllm"],
    ],
    ids=["up", "python -m workers"],
)
def test_a_misspelled_flag_exits_2_naming_it_before_anything_starts(command):
    port = _free_port()
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, *command, "--redis-url", f"redis://127.0.0.1:{port}/0", "--", "--no-such-flag"],
        cwd=ROOT,
        env={**os.environ, VLLM_ARGS_ENV: ""},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "unrecognized arguments: --no-such-flag" in run.stderr
    assert time.monotonic() - started < 100
    with socket.socket() as s:  # no private Redis was started on the port, nor left behind
        assert s.connect_ex(("127.0.0.1", port)) != 0
