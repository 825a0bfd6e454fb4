"""The receiving end of weight sync inside vLLM's own worker process (`worker_extension_cls`).

vLLM mixes this class into its GPU/CPU worker, so `self` is that worker (`self.rank`, `self.reload_weights`).
The rollout worker process, which has Redis, drives these methods through `AsyncLLM.collective_rpc`: arguments
and results are plain dicts, lists and strings (vLLM's msgpack IPC; tensors never cross it). Weights load with
`reload_weights`, which vLLM's CPU runner needs (a plain `model.load_weights` misses its repacked linear layers).

Transfers run in threads of this process (jobs: `receive` from the trainer, `serve` the loaded version to a late
peer, `catch-up` from a peer), so the engine goes on stepping meanwhile (gloo's collectives release the GIL). A job
that ends creates its marker file (`done_path` + "." + this rank), which the rollout process watches; only then, or
rarely, does it ask for the outcome (`rollout_poll`): each utility call is a message on vLLM's shared-memory queue,
after which the worker's main thread spins (sched_yield) for vLLM's 1 s `busy_loop_s`, taking the CPU a receive
thread beside it needs. While a job runs, that reader waits on its notify socket instead (`busy_loop_s` 0: each
message then costs a socket wake-up, tens of microseconds), and spins again once the last job ended. A job's thread,
and the thread that builds a transfer group (whose gloo threads inherit it), run on the RPC thread's CUDA device and
on any CPU (vLLM's CPU backend binds the worker's main thread to one core, which they would inherit).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

WORKER_EXTENSION = "workers.weight_extension.WeightSyncExtension"
JOBS = ("receive", "serve", "catch-up")


class WeightSyncExtension:
    """Joins the trainer's transfer group, receives announced buckets, loads them; loads a checkpoint; sends the
    loaded version to a late peer, or catches up from one."""

    _rollout_end: Any = None  # a rollout_svc.weightsync.transfer.ReceivingEnd for the trainer's syncs
    _rollout_peer_end: Any = None  # ... for catching up from a peer (its own group and buffers)
    _rollout_loads: Any = None  # a rollout_svc.weightsync.transfer.LoadedFrom: which end's version is loaded
    _rollout_jobs: dict[str, dict[str, Any]] | None = None  # each job's outcome, complete once it ended (`_ended`)
    _rollout_spin: Any = None  # vLLM's SpinCondition this process reads its RPCs on (False: none found)
    _rollout_spin_s: float = 1.0  # its own busy_loop_s, restored once no job runs
    # What vLLM's worker, into which this class is mixed, provides (an annotation only: no attribute of this class).
    reload_weights: Callable[..., None]

    def _rollout_rank(self) -> int:
        """This process's rank among its engine's: data-parallel replica x (tensor x pipeline ranks) + its rank in
        the replica (vLLM's `parallel_config.data_parallel_rank`, `world_size` and the worker's `rank`)."""
        local = int(getattr(self, "rank", 0))
        config = getattr(self, "parallel_config", None)
        if config is None:
            return local
        return int(getattr(config, "data_parallel_rank", 0) or 0) * int(getattr(config, "world_size", 1)) + local

    def rollout_join_group(self, spec: dict[str, Any], first_rank: int, host: str) -> int:
        """Join the transfer group `spec` (a `TransferGroup`) as `first_rank` + this engine rank; blocks until
        every rank has joined (at most the spec's timeout). Returns the rank taken."""
        from rollout_svc.protocol import TransferGroup

        rank, end = first_rank + self._rollout_rank(), self._rollout_trainer_end()
        _unbound(lambda: end.join(TransferGroup.model_validate(spec), rank, host))
        return rank

    def rollout_leave_group(self) -> None:
        if self._rollout_end is not None:
            self._rollout_end.leave()

    def rollout_receive_start(self, manifest: dict[str, Any], done_path: str | None = None) -> None:
        """Start receiving every bucket of `manifest` (a `WeightManifest`) from the trainer (job `receive`), and
        return. Nothing is loaded (`rollout_load_received`)."""
        from rollout_svc.protocol import WeightManifest

        end, parsed = self._rollout_trainer_end(), WeightManifest.model_validate(manifest)
        if end.group is None:
            raise RuntimeError("not in a weight transfer group: join one first")

        def receive() -> dict[str, Any]:
            tensors = end.receive(parsed)
            return {"tensors": tensors, "digest": end.received.digest}

        self._rollout_start("receive", receive, done_path)

    def rollout_serve_start(self, spec: dict[str, Any], host: str, done_path: str | None = None) -> bool:
        """Start sending the loaded version to a late peer's ranks, as rank 0 of the group `spec` (job `serve`);
        only this engine's first rank sends (every rank holds the whole version). Returns whether this rank sends.
        Raises `RuntimeError` if no received version is loaded here (one loaded from a checkpoint is not held)."""
        from rollout_svc.protocol import TransferGroup

        if self._rollout_rank() != 0:
            return False
        end, parsed = self._rollout_loaded().loaded, TransferGroup.model_validate(spec)
        if end is None or end.held is None:
            raise RuntimeError("no loaded weights are held here to send")
        self._rollout_start("serve", lambda: {"send_s": end.serve(parsed, host)}, done_path)
        return True

    def rollout_catch_up_start(
        self, spec: dict[str, Any], first_rank: int, host: str, manifest: dict[str, Any], done_path: str | None = None
    ) -> None:
        """Start receiving `manifest` from a peer, this rank being `first_rank` + its engine rank in `spec` (job
        `catch-up`): join, receive, then the digest of what arrived (`weights_digest`). Nothing is loaded."""
        from rollout_svc.protocol import TransferGroup, WeightManifest
        from rollout_svc.weightsync.transfer import ReceivingEnd

        if self._rollout_peer_end is None:
            self._rollout_peer_end = ReceivingEnd()
        end, group = self._rollout_peer_end, TransferGroup.model_validate(spec)
        parsed, rank = WeightManifest.model_validate(manifest), first_rank + self._rollout_rank()

        def catch_up() -> dict[str, Any]:
            tensors = end.catch_up(group, rank, host, parsed)
            return {"tensors": tensors, "digest": end.received.digest}

        self._rollout_start("catch-up", catch_up, done_path)

    def rollout_poll(self, job: str) -> dict[str, Any]:
        """Whether `job` ended: `{"done": bool, "error": str or None, "seconds": s, "digest": str}` (a job never
        started here counts as done)."""
        outcome = (self._rollout_jobs or {}).get(job)
        if outcome is None:
            outcome = {}  # never started here: done
        elif not _ended(outcome):
            return {"done": False, "error": None, "seconds": 0.0, "digest": ""}
        return {
            "done": True,
            "error": outcome.get("error"),
            "seconds": outcome.get("seconds", 0.0),
            "digest": outcome.get("digest", ""),
        }

    def rollout_load_received(self, job: str = "receive") -> dict[str, float]:
        """Load what job `job` (`receive`, or `catch-up`) received, whole (the engine is paused, or stale: it has
        no work); or again (`held`) the version loaded last from a transfer, or (`previous`) the one loaded before
        it: what was loaded since is not committed. Returns seconds loading; that end then holds the version, to
        serve a late peer. Raises `RuntimeError` if there is nothing to load."""
        loads = self._rollout_loaded()
        if job in ("held", "previous"):
            end, tensors = loads.again(job)
        else:
            outcome = (self._rollout_jobs or {}).pop(job, {})
            if not _ended(outcome) or "tensors" not in outcome:
                raise RuntimeError("no weights were received to load")
            tensors = outcome["tensors"]
            end = self._rollout_end if job == "receive" else self._rollout_peer_end
        started = time.perf_counter()
        self.reload_weights(weights_iterator=iter(tensors))
        loads.switched(end, job)
        return {"load_s": time.perf_counter() - started}

    def rollout_load_checkpoint(self, path: str) -> dict[str, float]:
        """Load the safetensors under the directory `path` (already checked against the checkpoint root)."""
        started = time.perf_counter()
        self.reload_weights(weights_path=path)
        self._rollout_loaded().checkpoint_loaded()  # nothing received is loaded now: nothing to serve
        return {"load_s": time.perf_counter() - started}

    # --- helpers -------------------------------------------------------------------------------------------

    def _rollout_loaded(self) -> Any:
        from rollout_svc.weightsync.transfer import LoadedFrom

        if self._rollout_loads is None:
            self._rollout_loads = LoadedFrom()
        return self._rollout_loads

    def _rollout_trainer_end(self) -> Any:
        from rollout_svc.weightsync.transfer import ReceivingEnd

        if self._rollout_end is None:
            self._rollout_end = ReceivingEnd()  # kept: its bucket buffers serve the next sync of this model
        return self._rollout_end

    def _rollout_start(self, job: str, run: Callable[[], dict[str, Any]], done_path: str | None = None) -> None:
        """Run `run` in a thread as `job`; its result dict, or {"error": ...}, is kept for `rollout_poll`. Once it
        ended, the file `done_path` + "." + this rank is created (if `done_path`)."""
        jobs = self._rollout_jobs = self._rollout_jobs if self._rollout_jobs is not None else {}
        running = jobs.get(job)
        if running is not None and not _ended(running):
            raise RuntimeError(f"a {job} is already running here")
        outcome: dict[str, Any] = {}
        device = _cuda_device()

        def body() -> None:
            started = time.perf_counter()
            try:
                _unbind(device)
                outcome.update(run())
            except BaseException as exc:  # a peer gone: nothing is kept to load (and an outcome, whatever it was)
                outcome["error"] = f"{type(exc).__name__}: {exc}"
            outcome["seconds"] = time.perf_counter() - started
            self._rollout_quiet(False)
            if done_path is not None:
                with contextlib.suppress(OSError), open(f"{done_path}.{self._rollout_rank()}", "wb"):
                    pass  # no marker (its folder gone): the rollout process's periodic ask finds the outcome

        thread = threading.Thread(target=body, name=f"rollout-{job}", daemon=True)
        jobs[job] = outcome
        self._rollout_quiet(True)
        thread.start()

    def _rollout_quiet(self, quiet: bool) -> None:
        """While a job runs (`quiet`), the worker loop waits for its next RPC on vLLM's notify socket instead of
        spinning `busy_loop_s` after each; once no job runs, it spins as vLLM sets it. A vLLM whose worker loop is
        not found (another executor, another release) is left as it is."""
        spin = self._rollout_reader()
        if spin is None:
            return
        if quiet:
            if spin.busy_loop_s:
                self._rollout_spin_s = spin.busy_loop_s
            spin.busy_loop_s = 0
        elif all(_ended(outcome) for outcome in (self._rollout_jobs or {}).values()):
            spin.busy_loop_s = self._rollout_spin_s

    def _rollout_reader(self) -> Any:
        """The reader side of vLLM's `SpinCondition` on which this process's worker loop (`WorkerProc`, the frame
        that called this RPC) reads its RPCs, found once; None if there is none (an in-process executor)."""
        if self._rollout_spin is None:
            self._rollout_spin = False
            frame: FrameType | None = sys._getframe(1)
            while frame is not None:
                queue = getattr(frame.f_locals.get("self"), "rpc_broadcast_mq", None)
                spin = getattr(queue, "_spin_condition", None)
                if spin is not None and getattr(spin, "is_reader", False) and hasattr(spin, "busy_loop_s"):
                    self._rollout_spin = spin
                    break
                frame = frame.f_back
        return self._rollout_spin or None


def _ended(outcome: dict[str, Any]) -> bool:
    """Whether a job's outcome is complete: its thread sets the seconds last, before its marker and before it exits
    (its thread may still be alive a moment after: asked then, a job would count as running for another poll)."""
    return "seconds" in outcome


def _cuda_device() -> int | None:
    """The calling thread's CUDA device where this process uses CUDA (a GPU worker: vLLM set its rank's device on the
    main thread), else None. A new thread starts on device 0 (CUDA's current device is per thread)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def _unbind(device: int | None) -> None:
    """Set up the calling (new) thread of a transfer: on `device` (`_cuda_device` of the thread that started it, so a
    GPU rank receives into its own GPU, not GPU 0), and free to run on any CPU this process may use. vLLM's CPU backend
    binds its worker's main thread (OpenMP's first) to one core, and every thread started from it inherits that core:
    a transfer's threads (gloo's, made when the group is built, and a job's, which checks the digest) then take their
    CPU from the generation on that core even while another core idles. A GPU worker's threads are not bound."""
    if device is not None:
        sys.modules["torch"].cuda.set_device(device)
    with contextlib.suppress(OSError, AttributeError):  # the kernel keeps the cores the cgroup allows
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


def _unbound(call: Callable[[], Any]) -> Any:
    """`call()` in a thread of its own, unbound (`_unbind`), so that the threads it starts are too; its result, or
    what it raised."""
    outcome: dict[str, Any] = {}
    device = _cuda_device()

    def run() -> None:
        _unbind(device)
        try:
            outcome["value"] = call()
        except BaseException as exc:  # raised again in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="rollout-unbound", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")
