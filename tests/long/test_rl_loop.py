"""examples/rl_loop.py end to end: two RL steps on two float32 vLLM workers it starts itself, weights synced live.

What the loop guarantees (see its docstring): batch s-1, trained on at step s, is sampled after version s-2 was
committed (s >= 2) and received after at most one more commit. So on a fresh fleet step 1 trains on version 0 only,
step 2 on versions within {0, 1} (1 only if the sync of step 1 caught some of its requests in flight), and no
trajectory is staler than 1.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
STEP_KEYS = {"step", "reward_mean", "versions", "staleness_max", "sync_s"}
TIMEOUT_S = 600


def run_loop(*args: str) -> str:
    """Run the example to completion; its stdout. On timeout it gets SIGTERM (it stops its fleet), then SIGKILL."""
    command = [sys.executable, "examples/rl_loop.py", *args]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(f"rl_loop.py {' '.join(args)} ran past {TIMEOUT_S} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    assert process.returncode == 0, f"rl_loop.py exited with {process.returncode}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return stdout


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_two_steps_train_on_fresh_weights_and_sync_them():
    output = run_loop("--steps", "2")
    lines = json_lines(output)
    steps = [line for line in lines if "step" in line]
    assert [s["step"] for s in steps] == [1, 2], output[-4000:]
    for s in steps:
        assert set(s) == STEP_KEYS
        assert 0.0 <= s["reward_mean"] <= 1.0
        assert s["versions"] and all(isinstance(v, int) for v in s["versions"])
        assert s["versions"] == sorted(set(s["versions"]))
        assert 0 <= s["staleness_max"] <= 1
        assert s["sync_s"] > 0
    assert steps[0]["versions"] == [0]  # sampled before any sync
    assert set(steps[1]["versions"]) <= {0, 1}  # sampled while step 1 trained; its sync may catch it in flight
    assert max(steps[1]["versions"]) >= max(steps[0]["versions"])
    [summary] = [line for line in lines if "step" not in line]
    assert {"first3_reward_mean", "last3_reward_mean"} <= set(summary)


def test_a_trainer_killed_mid_step_resumes_from_its_checkpoint_and_collects_its_batch():
    output = run_loop("--steps", "3", "--kill-at-step", "2", "--batch", "4")
    lines = json_lines(output)
    assert {"trainer_exit": -signal.SIGKILL, "killed_at_step": 2} in lines, output[-4000:]
    # step 1 by the first trainer; the second collected batch 1 (sampled by the first, 4 problems x 4 samples)
    # where it was, without sampling it again, then trained steps 2 and 3
    [attached] = [line for line in lines if "attached" in line]
    assert attached["attached"].endswith("-batch-1") and attached["trajectories"] == 4 * 4
    steps = [line["step"] for line in lines if "step" in line and "reward_mean" in line]
    assert steps == [1, 2, 3], output[-4000:]
