"""Ray worker groups without a Ray cluster: bundles, placement, CPU shares, and the actor body's supervision."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rollout_svc.config import EngineSettings
from rollout_svc.deploy.ray import (
    RayWorkerGroup,
    WorkerHost,
    import_ray,
    is_loopback,
    node_shares,
    placement_strategy,
    worker_bundles,
)
from tests.support import ROOT, fresh_python, wait_until


def test_bundles_leave_out_zero_resources():
    assert worker_bundles(2) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert worker_bundles(1, gpus_per_worker=1, cpus_per_worker=0) == [{"GPU": 1.0}]
    assert worker_bundles(1, gpus_per_worker=0.5, cpus_per_worker=2) == [{"CPU": 2.0, "GPU": 0.5}]


def test_all_zero_bundles_and_bad_counts_are_refused():
    with pytest.raises(ValueError, match="Ray refuses all-zero bundles"):
        worker_bundles(2, gpus_per_worker=0, cpus_per_worker=0)
    with pytest.raises(ValueError, match="Ray refuses all-zero bundles"):
        RayWorkerGroup(2, gpus_per_worker=0, cpus_per_worker=0)  # before any Ray call
    with pytest.raises(ValueError, match="at least 1"):
        worker_bundles(0)
    with pytest.raises(ValueError, match="negative"):
        worker_bundles(1, gpus_per_worker=-1)


def test_placement_names_map_to_ray_strategies():
    assert placement_strategy("pack") == "PACK" and placement_strategy("spread") == "SPREAD"
    assert RayWorkerGroup(1, placement="spread").strategy == "SPREAD"
    with pytest.raises(ValueError, match="pack, spread"):
        placement_strategy("scatter")


def test_worker_ids_are_stable_per_slot():
    assert RayWorkerGroup(3, name="gen").worker_ids == ["gen-0", "gen-1", "gen-2"]


def test_cpu_shares_count_the_bundles_on_each_node():
    assert node_shares(["a", "a"]) == [(0, 2, 1), (1, 2, 1)]
    assert node_shares(["a", "b", "a"], ranks=3) == [(0, 2, 3), (0, 1, 3), (1, 2, 3)]


class FakeRay:
    def __init__(self, resources: dict[str, float]) -> None:
        self.resources = resources

    def cluster_resources(self) -> dict[str, float]:
        return self.resources


def test_a_bundle_holds_the_gpus_its_engine_spans_where_the_cluster_has_them():
    tp2 = EngineSettings(tensor_parallel_size=2)
    group = RayWorkerGroup(2, engine=tp2, gpu_resource="fake_gpu")
    assert group._bundles(FakeRay({"CPU": 4, "fake_gpu": 4})) == [{"CPU": 1.0, "fake_gpu": 2.0}] * 2
    assert group._bundles(FakeRay({"CPU": 4})) == [{"CPU": 1.0}] * 2  # no GPUs: engines on CPUs
    dp2 = EngineSettings(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    assert RayWorkerGroup(1, engine=dp2)._bundles(FakeRay({"GPU": 8})) == [{"CPU": 1.0, "GPU": 8.0}]
    assert RayWorkerGroup(1, 3, engine=tp2)._bundles(FakeRay({"GPU": 8})) == [{"CPU": 1.0, "GPU": 3.0}]  # as given
    with pytest.raises(ValueError, match=r"spans 2 GPUs .* gpus_per_worker is 1: give it at least that many"):
        RayWorkerGroup(1, 1, engine=tp2)._bundles(FakeRay({"GPU": 8}))


def test_loopback_redis_urls_are_recognized():
    assert is_loopback("redis://127.0.0.1:6379/0") and is_loopback("redis://localhost/0")
    assert not is_loopback("redis://10.0.0.5:6379/0") and not is_loopback("redis://redis-host:6379/0")


def test_importing_the_package_and_the_cli_does_not_import_ray():
    code = "import sys, rollout_svc, rollout_svc.cli, rollout_svc.deploy.ray; print('ray' in sys.modules)"
    assert fresh_python(code).strip() == "False"


def sleeper(worker_id: str) -> list[str]:
    """A stand-in for `-m workers --worker-id ID` (what follows the interpreter): runs until killed."""
    return ["-c", "import time; time.sleep(60)", "--worker-id", worker_id]


def start_sleeper(worker_id: str) -> subprocess.Popen[bytes]:
    """A running `sleeper(worker_id)` whose command line is readable: Popen returns once exec has closed the
    close-on-exec pipe, a moment before the kernel sets the new command line (until then /proc shows it empty)."""
    process = subprocess.Popen([sys.executable, *sleeper(worker_id)], start_new_session=True)
    wait_until(lambda: worker_id.encode() in Path(f"/proc/{process.pid}/cmdline").read_bytes(), 10, "its exec")
    return process


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def fast_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WorkerHost, "RESTART_DELAY_S", 0.1)
    monkeypatch.setattr(WorkerHost, "PREVIOUS_GRACE_S", 1.0)


def test_the_actor_body_restarts_its_worker_and_stops_it(fast_restarts):
    host = WorkerHost("w-0", sleeper("w-0"), {}, pid_file=f"test-{uuid.uuid4().hex}.pid")
    try:
        first = wait_until(lambda: host.info().worker_pid if host.alive() else None, 10, "the worker to start")
        assert host.pid_path is not None and host.pid_path.read_text() == str(first)
        os.kill(first, signal.SIGKILL)  # the worker crashes: its actor starts it again
        second = wait_until(
            lambda: host.info().worker_pid if host.alive() and host.info().worker_pid != first else None,
            10,
            "a replacement",
        )
        assert host.info().restarts == 1
    finally:
        host.stop(timeout_s=5)
    assert not alive(second) and not host.pid_path.exists()


def write_pid_file(pid: int) -> str:
    """A slot's pid file (in the temp folder, where `WorkerHost` looks) naming `pid`; returns its name."""
    name = f"test-{uuid.uuid4().hex}.pid"
    path = Path(tempfile.gettempdir()) / "rollout-svc" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(pid))
    return name


def test_a_replacement_actor_waits_for_the_last_worker_of_its_slot_then_kills_it(fast_restarts):
    # The slot's last worker, which outlived its dead actor and still serves.
    previous = start_sleeper("w-1")
    started = time.monotonic()
    replacement = WorkerHost("w-1", sleeper("w-1"), {}, pid_file=write_pid_file(previous.pid))
    try:
        wait_until(replacement.alive, 10, "the replacement's worker")
        assert previous.wait(timeout=15) == -signal.SIGKILL  # killed once the grace period ran out (CI load: >5 s once)
        assert time.monotonic() - started >= WorkerHost.PREVIOUS_GRACE_S
    finally:
        replacement.stop(timeout_s=5)
        previous.kill()
        previous.wait()


def test_a_pid_file_naming_another_process_is_ignored(fast_restarts):
    other = start_sleeper("someone-else")
    host = WorkerHost("w-2", sleeper("w-2"), {}, pid_file=write_pid_file(other.pid))
    try:
        wait_until(host.alive, 10, "the worker")
        assert other.poll() is None
    finally:
        host.stop(timeout_s=5)
        other.kill()
        other.wait()


def test_without_ray_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'rollout-svc\[ray\]'"):
        import_ray()


def test_up_refuses_all_zero_ray_workers_before_starting_anything():
    args = [
        "up",
        "--ray",
        "local",
        "--engine",
        "echo",
        "--cpus-per-worker",
        "0",
        "--redis-url",
        "redis://127.0.0.1:1/0",
    ]
    out = subprocess.run([sys.executable, "-m", "rollout_svc", *args], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "Ray refuses all-zero bundles" in out.stderr
