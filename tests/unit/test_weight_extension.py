"""The vLLM worker extension's transfer jobs, outside vLLM: a job ends with its marker file; while any job runs the
worker loop that called it waits on its notify socket instead of spinning (vLLM's `SpinCondition.busy_loop_s`); a
job's thread runs on any CPU and on the CUDA device of the thread that started it."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_until
from workers.weight_extension import WeightSyncExtension


class Spin:
    """The reader side of vLLM's SpinCondition, as `workers.weight_extension` reads it."""

    is_reader = True
    busy_loop_s = 1.0


class Queue:
    def __init__(self) -> None:
        self._spin_condition = Spin()


class Worker(WeightSyncExtension):
    rank = 0


class WorkerProc:
    """vLLM's `WorkerProc`: its loop reads RPCs on `rpc_broadcast_mq` and calls the worker's methods."""

    def __init__(self) -> None:
        self.rpc_broadcast_mq, self.worker = Queue(), Worker()

    def rpc(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


def job(gate: threading.Event) -> Any:
    return lambda: {"digest": "d"} if gate.wait(30) else {}


def test_the_worker_loop_waits_quietly_while_jobs_run_and_spins_again_after_the_last(tmp_path: Path):
    proc, receive, serve = WorkerProc(), threading.Event(), threading.Event()
    spin = proc.rpc_broadcast_mq._spin_condition
    proc.rpc("_rollout_start", "receive", job(receive), str(tmp_path / "receive"))
    proc.rpc("_rollout_start", "serve", job(serve), str(tmp_path / "serve"))
    assert spin.busy_loop_s == 0
    receive.set()
    wait_until(lambda: (tmp_path / "receive.0").exists(), 10, "the receive's end marker")
    assert spin.busy_loop_s == 0, "a job still runs: the loop stays quiet"
    polled = proc.rpc("rollout_poll", "receive")
    assert (polled["done"], polled["error"], polled["digest"]) == (True, None, "d")
    assert not proc.rpc("rollout_poll", "serve")["done"]
    serve.set()
    wait_until(lambda: (tmp_path / "serve.0").exists(), 10, "the serve's end marker")
    assert spin.busy_loop_s == 1.0, "no job runs: vLLM's own busy loop is back"


def test_a_failed_job_says_why_and_restores_the_spin_too(tmp_path: Path):
    proc = WorkerProc()

    def fail() -> dict[str, Any]:
        raise ConnectionError("peer gone")

    proc.rpc("_rollout_start", "catch-up", fail, str(tmp_path / "catch-up"))
    wait_until(lambda: (tmp_path / "catch-up.0").exists(), 10, "the end marker")
    assert proc.rpc("rollout_poll", "catch-up")["error"] == "ConnectionError: peer gone"
    assert proc.rpc_broadcast_mq._spin_condition.busy_loop_s == 1.0


def test_outside_a_worker_loop_jobs_run_and_nothing_is_changed(tmp_path: Path):
    worker = Worker()  # called directly: no vLLM worker loop up the stack (an in-process executor)
    worker._rollout_start("receive", lambda: {"digest": "x"}, str(tmp_path / "r"))
    wait_until(lambda: (tmp_path / "r.0").exists(), 10, "the end marker")
    assert worker.rollout_poll("receive")["digest"] == "x" and worker._rollout_spin is False


def test_a_job_runs_on_any_cpu_though_the_thread_that_started_it_is_bound_to_one(tmp_path: Path):
    """vLLM's CPU backend binds its worker's main thread to one core; a transfer's threads must not inherit that."""
    everywhere = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    def record() -> dict[str, Any]:
        seen["cpus"] = os.sched_getaffinity(0)
        return {}

    def bound() -> None:
        os.sched_setaffinity(0, {min(everywhere)})  # this thread only, as OpenMP binds vLLM's
        Worker()._rollout_start("receive", record, str(tmp_path / "r"))

    thread = threading.Thread(target=bound)
    thread.start()
    thread.join()
    wait_until(lambda: (tmp_path / "r.0").exists(), 10, "the end marker")
    assert seen["cpus"] == everywhere


@pytest.mark.gpu2
def test_a_job_thread_receives_on_the_gpu_of_the_thread_that_started_it(tmp_path: Path):
    """CUDA's current device is per thread and a new one starts on GPU 0: a GPU rank's receive would have gone
    there (`receive_device`)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs: a new thread starts on GPU 0 anyway where there is one")
    torch.cuda.set_device(1)
    torch.zeros(1, device="cuda")  # CUDA initialized, as in vLLM's GPU worker
    seen: dict[str, int] = {}

    def record() -> dict[str, Any]:
        seen["device"] = torch.cuda.current_device()
        return {}

    Worker()._rollout_start("receive", record, str(tmp_path / "r"))
    wait_until(lambda: (tmp_path / "r.0").exists(), 10, "the end marker")
    assert seen["device"] == 1
