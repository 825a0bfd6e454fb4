"""SkyRL 0.4.0 (the current SkyRL, Python 3.12) against rollout-svc: its own `RemoteInferenceClient` through `serve`,
and `RolloutServiceEngine` as its `InferenceEngineInterface`, each run unmodified by the Python 3.12 venv
(`.venv312`, made by `make install` where Python 3.12 is found: docs/testing.md) as a subprocess
(tests/integration/skyrl04_calls.py), over 2 echo workers, one started from this venv (3.11) and one from the 3.12
venv. SkyRL 0.3.0 on 3.11 is tests/integration/test_skyrl_client.py and test_skyrl_adapter.py.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollout_svc.config import Settings
from tests.support import ROOT, WorkerProcs, python312, serve

VENV312 = ROOT / ".venv312" / "bin" / "python"
PROMPT = list(b"The quick brown fox jumps over the lazy dog, twice over")

pytestmark = [
    pytest.mark.skipif(
        not VENV312.exists() and python312() is None,
        reason="no Python 3.12 on this machine (make install makes .venv312 where there is one)",
    ),
    # run312's subprocess may take its 240 s (a cold import of the 3.12 venv's torch on a loaded host): the default
    # 30 s cut a CI run's generator test short.
    pytest.mark.timeout(250),
]


def run312(*args: str) -> dict[str, Any]:
    """SkyRL 0.4.0's calls in the 3.12 venv; what they saw, as JSON."""
    assert VENV312.exists(), "Python 3.12 is here but .venv312 is not: run `make install`"
    done = subprocess.run(
        [str(VENV312), "-m", "tests.integration.skyrl04_calls", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["python"] == [3, 12] and seen["skyrl"] == "0.4.0", seen
    return seen


@pytest.fixture
def fleet(settings: Settings, tmp_path: Path) -> Iterator[tuple[str, Settings, Path]]:
    """echo-0 from this venv, echo-1 from the 3.12 venv; `serve --open-control`; an adapter folder."""
    root = tmp_path / "checkpoints"
    (root / "judge").mkdir(parents=True)
    (root / "judge" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    ws = settings.copy_with(checkpoint_root=root)
    procs = WorkerProcs(ws, tmp_path)
    try:
        procs.start("echo-0", "--engine", "echo")
        procs.start("echo-1", "--engine", "echo", python=str(VENV312))
        procs.wait_live("echo-0", "echo-1")
        with serve(ws, tmp_path / "serve.log", "--open-control") as base:
            yield base, ws, root / "judge"
    finally:
        procs.stop_all()


def test_skyrl_04s_own_client_through_serve(fleet):
    base, _, adapter = fleet
    seen = run312("client", base, str(adapter))
    generated = seen["generate"]
    assert generated["response_ids"] == [PROMPT[:24], PROMPT[:10]] and generated["stop_reasons"] == ["length", "stop"]
    assert generated["response_logprobs"] == [[0.0] * 24, [0.0] * 10]
    assert generated["responses"] == [bytes(PROMPT[:24]).decode(), bytes(PROMPT[:10]).decode()]
    assert seen["world_size"] == [2, 2]
    assert seen["chat"] == "<|user|>hi\n<|assistant|>"[:8] and seen["completion"] == "hel"
    assert seen["tokenize"] == [[104, 105]] and seen["detokenize"] == ["hi"]
    assert seen["paused"] is True and seen["sleeping"] is True
    assert seen["adapter"] == [PROMPT[:5]]
    # what 0.4 added that is not served is refused by name, never half-done
    assert "checkpoint-delta fetch" in seen["fetch_delta"]
    assert "in_memory adapters" in seen["in_memory_lora"]
    assert "skyrl_sleep_for_weight_sync" in seen["sleep_for_sync"] and "not served" in seen["sleep_for_sync"]


def test_the_adapter_is_skyrl_04s_engine_interface(fleet):
    _, settings, adapter = fleet
    seen = run312("adapter", settings.redis_url, settings.key_prefix, str(adapter))
    assert seen["is_interface"] is True
    assert seen["generate"] == [PROMPT[:24]] and seen["adapter"] == [PROMPT[:5]]
    assert seen["world_size"] == [2, 2] and seen["load"] == {"lora_name": "judge", "version": 1}


def test_skyrl_04s_own_generator_runs_a_multi_turn_episode_both_ways(fleet):
    """`SkyRLGymGenerator.agent_loop` (0.4.0, with skyrl-gym's `gsm8k_multi_turn`) through `serve` and in process:
    all 3 turns (the echo engine answers each turn's prompt ids, cut at 20 tokens), the prompt as the model's chat
    template renders it, one run of generated tokens per turn with the env's observation between them, a logprob
    per response token, the same trajectory both ways, and the session released at the end."""
    base, settings, _ = fleet
    seen = run312("generator", base, settings.redis_url, settings.key_prefix)
    http = seen["http"]
    assert http["prompt_ids"] == seen["template"] and http["env_metrics"] == {"steps": 3}, http
    mask = http["loss_mask"]
    runs = [len(list(g)) for bit, g in itertools.groupby(mask) if bit == 1]
    assert runs == [20, 20, 20] and http["response_ids"][:20] == seen["template"][:20], mask
    assert seen["logprobs"] == len(http["response_ids"]) and "step-by-step reasoning" in seen["observation"]
    assert (seen["inproc"]["response_ids"], seen["inproc"]["loss_mask"]) == (http["response_ids"], mask)
    assert seen["pinned"] is None, "finish_session released the episode's session"
