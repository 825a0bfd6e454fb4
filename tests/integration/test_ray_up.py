"""`rollout-svc up --ray local` with echo workers: Redis here, the workers as Ray actors; SIGTERM stops them all."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.integration.test_cluster import status, wait_for
from tests.support import ROOT, free_port


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(180)
def test_up_with_ray_runs_the_workers_as_ray_actors_and_sigterm_stops_them(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    args = [sys.executable, "-m", "rollout_svc", "up", "--ray", "local", "--redis-url", url, "--engine", "echo"]
    args += ["--workers", "2", "--log-dir", str(tmp_path / "logs")]
    with open(tmp_path / "up.log", "wb") as log:  # the child keeps its own descriptor
        up = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "RAY_TMPDIR": ray_tmp}, stdout=log, stderr=log)
    try:
        workers = wait_for(lambda: len(status(url)["workers"]) == 2 and status(url)["workers"], 120, "2 Ray workers")
        assert sorted(w["worker_id"] for w in workers) == ["ray-worker-0", "ray-worker-1"]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, (tmp_path / "up.log").read_text()
        assert not [w["pid"] for w in workers if running(w["pid"])], "a Ray worker outlived `up`"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
