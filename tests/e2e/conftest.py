"""What the real-engine test modules share, each started once per test session: the reference they compare against
(vLLM called directly, `workers.direct`, no queue) for every prompt set they use, and a fleet of two float32 vLLM
workers for the modules that run on one (the OpenAI API's and SkyRL's, each with a `serve` of its own over it, the
control plane's and weight sync's).

Starting a vLLM engine is most of what a real-engine test costs (three interpreters importing torch and vLLM: about
40 s alone on a 2-core host without avx512, minutes under make test's load), so these start once, not once per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollout_svc.config import EngineSettings, Settings
from rollout_svc.model import prepare_model
from rollout_svc.tools import dataset
from tests.support import ROOT, WorkerProcs, redis_server, vllm_workers

MiB = 2**20
# float32 and the same settings on every side: bf16 and batching change the numerics, so greedy ids could differ.
# The engines compared with the reference run these (`VLLMEngine(**REFERENCE_SETTINGS)`, `python -m workers`
# with `REFERENCE_ARGS`).
REFERENCE_SETTINGS = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_bytes": 256 * MiB, "max_num_seqs": 8}
REFERENCE_ARGS = [
    arg for name, value in REFERENCE_SETTINGS.items() for arg in (f"--{name.replace('_', '-')}", str(value))
]
REFERENCE_MAX_TOKENS = 32  # greedy, one prompt at a time
REFERENCE_TIMEOUT_S = 600  # startup ~40 s alone on a slow host; make test's load has made it minutes
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three prime numbers.",
]
# Each set's conversations: one user turn each. "sharegpt": the first 2 of the bundled ShareGPT sample (600
# characters at most: ~8 s each to generate here).
PROMPT_SETS: dict[str, Callable[[], list[list[dict[str, str]]]]] = {
    "questions": lambda: [[{"role": "user", "content": q}] for q in QUESTIONS],
    "sharegpt": lambda: dataset.first_turns(2, max_chars=600),
}


def cpu_env() -> dict[str, str]:
    """An engine's environment: on CPU, vLLM's default thread binding leaves a 2-core host half idle."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}-{cpus[-1]}")}


def perturb_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """`weights` (name -> torch tensor) each moved by seeded noise of a tenth of its standard deviation: enough to
    change greedy outputs (what the weight-loading tests need to see), the same every call."""
    import torch  # here, not at import: the modules that only call the fleet do not import torch

    noise = torch.Generator().manual_seed(0)
    return {n: t + 0.1 * t.std() * torch.randn(t.shape, generator=noise) for n, t in weights.items()}


@dataclass(frozen=True)
class Reference:
    """Per prompt set: its conversations, their prompts (token ids under the model's chat template, as Hugging
    Face's `apply_chat_template` renders them), and vLLM's greedy outputs for them (`workers.direct`'s
    `{"completion_token_ids", "logprobs"}`, in order)."""

    conversations: dict[str, list[list[dict[str, str]]]]
    prompts: dict[str, list[list[int]]]
    outputs: dict[str, list[dict[str, Any]]]
    output_tokens: int  # over every set, as workers.direct counted them
    output_tokens_per_s: float


def run_direct(
    model_dir: Path, prompts: list[list[int]], folder: Path, args: list[str], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """`python -m workers.direct --sequential --temperature 0` on `prompts` with engine `args` (and `--max-tokens`),
    its files in `folder`, in `env` (default: this environment with `cpu_env()`); its OUT.json dict. Fails the test
    with the tail of its output if it exits non-zero or runs past `REFERENCE_TIMEOUT_S`."""
    (folder / "prompts.json").write_text(json.dumps(prompts))
    command = [sys.executable, "-m", "workers.direct", "--model", str(model_dir), *args, "--sequential"]
    command += ["--prompts-file", str(folder / "prompts.json"), "--out", str(folder / "out.json"), "--temperature", "0"]
    try:
        run = subprocess.run(
            command,
            cwd=ROOT,
            env=env if env is not None else {**os.environ, **cpu_env()},
            timeout=REFERENCE_TIMEOUT_S,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    except subprocess.TimeoutExpired as exc:
        output = (exc.output or b"").decode(errors="replace")[-4000:]
        pytest.fail(f"workers.direct ran past {REFERENCE_TIMEOUT_S} s:\n{output}")
    assert run.returncode == 0, run.stdout.decode(errors="replace")[-4000:]
    result: dict[str, Any] = json.loads((folder / "out.json").read_text())
    return result


@pytest.fixture(scope="session")
def direct_reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """Every prompt set run once, greedily, one prompt at a time, on vLLM called directly with `REFERENCE_ARGS`."""
    from transformers import AutoTokenizer

    model_dir = prepare_model(Settings().cache_dir)  # Settings reads ROLLOUT_CACHE_DIR (the modules' model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = {name: make() for name, make in PROMPT_SETS.items()}
    prompts = {
        name: [
            # as VLLMEngine.chat_prompt: the template writes every special token, the encoding adds none
            tokenizer.encode(
                tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False
            )
            for c in convs
        ]
        for name, convs in conversations.items()
    }
    every = [p for name in PROMPT_SETS for p in prompts[name]]
    result = run_direct(
        model_dir,
        every,
        tmp_path_factory.mktemp("direct-reference"),
        [*REFERENCE_ARGS, "--max-tokens", str(REFERENCE_MAX_TOKENS)],
    )
    outputs, start = {}, 0
    for name in PROMPT_SETS:
        outputs[name] = result["outputs"][start : start + len(prompts[name])]
        start += len(prompts[name])
    return Reference(conversations, prompts, outputs, result["output_tokens"], result["output_tokens_per_s"])


@dataclass(frozen=True)
class Fleet:
    settings: Settings  # its Redis, key prefix, checkpoint root
    model_dir: Path
    logs: Path  # the workers' logs; a module's serve may log here too
    engine: EngineSettings  # what the workers run (a module that restarts one starts it with these)
    procs: WorkerProcs


@pytest.fixture(scope="session")
def two_vllm_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two float32 vLLM workers (`vllm-0`, `vllm-1`, a core each; 64 sequences, so the control module's 100 requests
    are all in flight, and 256 MiB of KV cache each) on a redis-server of their own (the other tests flush theirs),
    with a checkpoint root for `/fetch_weights` and checkpoint syncs. The OpenAI API's, SkyRL's, the control plane's
    and weight sync's modules run on it; a module that changes the fleet puts it back (weights, pauses, sleep, a
    worker it stopped) before its last test ends, so the others find it serving the model's own outputs."""
    model_dir = prepare_model(Settings().cache_dir)
    folder = tmp_path_factory.mktemp("two-vllm-workers")
    (folder / "redis").mkdir()
    (folder / "checkpoints").mkdir()
    with redis_server(folder / "redis") as url:
        settings = Settings(
            redis_url=url,
            key_prefix="e2e-fleet",
            heartbeat_interval_s=0.5,
            # This shared machine freezes for about a minute at times (a monitor's 5 s-bounded ping took 68 s): every
            # heartbeat lapsed mid-sync at 60 s. The TTL outlasts such a freeze (and the idle wait between modules at
            # make test's lower priority, tests/conftest.py).
            heartbeat_ttl_s=180,
            checkpoint_root=folder / "checkpoints",
            control_timeout_s=120,
        )
        engine = EngineSettings(model=str(model_dir), dtype="float32", max_num_seqs=64, kv_cache_memory_bytes=256 * MiB)
        with vllm_workers(settings, engine, folder) as procs:
            yield Fleet(settings, model_dir, folder, engine, procs)
