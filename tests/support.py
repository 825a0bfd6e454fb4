"""Test support: worker subprocesses and the environment that hands them a test's settings."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

from rollout_svc.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings_env(settings: Settings) -> dict[str, str]:
    env = dict(os.environ)
    for name, value in settings.model_dump().items():
        env[f"ROLLOUT_{name.upper()}"] = str(value)
    return env


class WorkerProcs:
    """Starts `python -m workers` subprocesses and kills whatever is left at teardown."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings, self.log_dir = settings, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, worker_id: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{worker_id}.log", "wb")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers", "--worker-id", worker_id, *args],
            env={**settings_env(self.settings), **(env or {})},
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs[worker_id] = proc
        return proc

    def wait_live(self, *worker_ids: str, timeout_s: float = 60) -> None:
        client = redis.Redis.from_url(self.settings.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while not all(client.exists(self.settings.keys.worker(w)) for w in worker_ids):
                for w in worker_ids:
                    proc = self.procs[w]
                    assert proc.poll() is None, f"worker {w} exited: {self.log(w)[-3000:]}"
                assert time.monotonic() < deadline, f"workers {worker_ids} not live after {timeout_s} s"
                time.sleep(0.05)
        finally:
            client.close()

    def log(self, worker_id: str) -> str:
        return (self.log_dir / f"{worker_id}.log").read_text(errors="replace")

    def kill(self, worker_id: str, sig: int = signal.SIGKILL) -> None:
        os.killpg(self.procs[worker_id].pid, sig)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
