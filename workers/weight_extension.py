"""The receiving end of weight sync inside vLLM's own worker process (`worker_extension_cls`).

vLLM mixes this class into its GPU/CPU worker, so `self` is that worker (`self.rank`, `self.reload_weights`).
The rollout worker process, which has Redis, drives these methods through `AsyncLLM.collective_rpc`: arguments
and results are plain dicts, lists and strings (vLLM's msgpack IPC; tensors never cross it). Weights load with
`reload_weights`, which vLLM's CPU runner needs (a plain `model.load_weights` misses its repacked linear layers).

Transfers run in threads of this process (jobs: `receive` from the trainer, `serve` the loaded version to a late
peer, `catch-up` from a peer), so the engine goes on stepping meanwhile (gloo's collectives release the GIL); the
rollout process polls them (`rollout_poll`), each poll a utility call between two engine steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

WORKER_EXTENSION = "workers.weight_extension.WeightSyncExtension"
JOBS = ("receive", "serve", "catch-up")


class WeightSyncExtension:
    """Joins the trainer's transfer group, receives announced buckets, loads them; loads a checkpoint; sends the
    loaded version to a late peer, or catches up from one."""

    _rollout_end: Any = None  # a rollout_svc.weightsync.transfer.ReceivingEnd for the trainer's syncs
    _rollout_peer_end: Any = None  # ... for catching up from a peer (its own group and buffers)
    _rollout_loaded_end: Any = None  # the end whose receive the engine loaded last (None: a checkpoint)
    _rollout_jobs: dict[str, tuple[threading.Thread, dict[str, Any]]] | None = None

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

        rank = first_rank + self._rollout_rank()
        self._rollout_trainer_end().join(TransferGroup.model_validate(spec), rank, host)
        return rank

    def rollout_leave_group(self) -> None:
        if self._rollout_end is not None:
            self._rollout_end.leave()

    def rollout_receive_start(self, manifest: dict[str, Any]) -> None:
        """Start receiving every bucket of `manifest` (a `WeightManifest`) from the trainer (job `receive`), and
        return. Nothing is loaded (`rollout_load_received`)."""
        from rollout_svc.protocol import WeightManifest

        end, parsed = self._rollout_trainer_end(), WeightManifest.model_validate(manifest)
        if end.group is None:
            raise RuntimeError("not in a weight transfer group: join one first")

        def receive() -> dict[str, Any]:
            tensors = end.receive(parsed)
            return {"tensors": tensors, "digest": end.received.digest}

        self._rollout_start("receive", receive)

    def rollout_serve_start(self, spec: dict[str, Any], host: str) -> bool:
        """Start sending the loaded version to a late peer's ranks, as rank 0 of the group `spec` (job `serve`);
        only this engine's first rank sends (every rank holds the whole version). Returns whether this rank sends.
        Raises `RuntimeError` if no received version is loaded here (one loaded from a checkpoint is not held)."""
        from rollout_svc.protocol import TransferGroup

        if self._rollout_rank() != 0:
            return False
        end, parsed = self._rollout_loaded_end, TransferGroup.model_validate(spec)
        if end is None or end.held is None:
            raise RuntimeError("no loaded weights are held here to send")
        self._rollout_start("serve", lambda: {"send_s": end.serve(parsed, host)})
        return True

    def rollout_catch_up_start(
        self, spec: dict[str, Any], first_rank: int, host: str, manifest: dict[str, Any]
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

        self._rollout_start("catch-up", catch_up)

    def rollout_poll(self, job: str) -> dict[str, Any]:
        """Whether `job` ended: `{"done": bool, "error": str or None, "seconds": s, "digest": str}` (a job never
        started here counts as done)."""
        thread, outcome = (self._rollout_jobs or {}).get(job, (None, {}))
        if thread is not None and thread.is_alive():
            return {"done": False, "error": None, "seconds": 0.0, "digest": ""}
        return {
            "done": True,
            "error": outcome.get("error"),
            "seconds": outcome.get("seconds", 0.0),
            "digest": outcome.get("digest", ""),
        }

    def rollout_load_received(self, job: str = "receive") -> dict[str, float]:
        """Load what job `job` (`receive`, or `catch-up`) received, whole (the engine is paused, or stale: it has
        no work). Returns seconds loading; that end then holds the version, to serve a late peer."""
        thread, outcome = (self._rollout_jobs or {}).pop(job, (None, {}))
        if thread is None or thread.is_alive() or "tensors" not in outcome:
            raise RuntimeError("no weights were received to load")
        started = time.perf_counter()
        self.reload_weights(weights_iterator=iter(outcome["tensors"]))  # type: ignore[attr-defined]
        end = self._rollout_end if job == "receive" else self._rollout_peer_end
        end.hold()
        self._rollout_loaded_end = end
        return {"load_s": time.perf_counter() - started}

    def rollout_load_checkpoint(self, path: str) -> dict[str, float]:
        """Load the safetensors under the directory `path` (already checked against the checkpoint root)."""
        started = time.perf_counter()
        self.reload_weights(weights_path=path)  # type: ignore[attr-defined]
        self._rollout_loaded_end = None  # nothing received is loaded now: nothing to serve
        return {"load_s": time.perf_counter() - started}

    # --- helpers -------------------------------------------------------------------------------------------

    def _rollout_trainer_end(self) -> Any:
        from rollout_svc.weightsync.transfer import ReceivingEnd

        if self._rollout_end is None:
            self._rollout_end = ReceivingEnd()  # kept: its bucket buffers serve the next sync of this model
        return self._rollout_end

    def _rollout_start(self, job: str, run: Callable[[], dict[str, Any]]) -> None:
        """Run `run` in a thread as `job`; its result dict, or {"error": ...}, is kept for `rollout_poll`."""
        jobs = self._rollout_jobs = self._rollout_jobs if self._rollout_jobs is not None else {}
        running = jobs.get(job)
        if running is not None and running[0].is_alive():
            raise RuntimeError(f"a {job} is already running here")
        outcome: dict[str, Any] = {}

        def body() -> None:
            started = time.perf_counter()
            try:
                outcome.update(run())
            except Exception as exc:  # a peer gone: nothing is kept to load
                outcome["error"] = f"{type(exc).__name__}: {exc}"
            outcome["seconds"] = time.perf_counter() - started

        thread = threading.Thread(target=body, name=f"rollout-{job}", daemon=True)
        jobs[job] = (thread, outcome)
        thread.start()
