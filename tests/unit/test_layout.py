"""Project-level guarantees: the import boundary, the CLI contract, no pickle (compose: test_compose.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_rollout_svc_pulls_in_neither_vllm_nor_torch():
    code = "import sys, rollout_svc, rollout_svc.cli; print(sorted({'vllm', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_weight_sender_is_exported_lazily_and_workers_import_torch_only_to_sync():
    code = (
        "import sys, workers.worker, workers.echo, rollout_svc.weight_sync; before = 'torch' in sys.modules; "
        "from rollout_svc import WeightSender; print(before, 'torch' in sys.modules, WeightSender.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "True", "rollout_svc.weights"]


def test_no_pickle_in_service_code():
    pattern = re.compile(r"\bpickle\.(loads?|Unpickler)|cloudpickle")
    sources = [p for d in ("rollout_svc", "workers") for p in (ROOT / d).rglob("*.py")]
    offenders = [p for p in sources if pattern.search(p.read_text())]
    assert offenders == []


def test_every_cli_command_answers_help():
    commands = ("up", "worker", "serve", "status", "demo", "bench", "model")
    commands += ("pause", "resume", "abort", "sleep", "wake-up", "reset-prefix-cache")
    for command in commands:
        out = subprocess.run(
            [sys.executable, "-m", "rollout_svc", command, "--help"], capture_output=True, text=True, cwd=ROOT
        )
        assert out.returncode == 0, (command, out.stderr)
        assert "--redis-url" in out.stdout or command == "model", command
