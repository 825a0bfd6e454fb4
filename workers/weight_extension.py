"""The receiving end of weight sync inside vLLM's own worker process (`worker_extension_cls`).

vLLM mixes this class into its GPU/CPU worker, so `self` is that worker (`self.rank`, `self.reload_weights`).
The rollout worker process, which has Redis, drives these methods through `AsyncLLM.collective_rpc`: arguments
and results are plain dicts, lists and strings (vLLM's msgpack IPC; tensors never cross it). Weights load with
`reload_weights`, which vLLM's CPU runner needs (a plain `model.load_weights` misses its repacked linear layers).
"""

from __future__ import annotations

import threading
import time
from typing import Any

WORKER_EXTENSION = "workers.weight_extension.WeightSyncExtension"


class WeightSyncExtension:
    """Joins the trainer's transfer group, receives announced buckets, loads them; or loads a checkpoint."""

    _rollout_end: Any = None  # a rollout_svc.weightsync.transfer.ReceivingEnd, made at the first join
    _rollout_receiving: Any = None  # the thread receiving a manifest's buckets (`rollout_receive_start`)
    _rollout_received: Any = None  # {"tensors": [...], "receive_s": s} or {"error": "..."}, once it ended

    def rollout_join_group(self, spec: dict[str, Any], first_rank: int, host: str) -> int:
        """Join the transfer group `spec` (a `TransferGroup`) as `first_rank` + this engine rank; blocks until
        every rank has joined (at most the spec's timeout). Returns the rank taken."""
        from rollout_svc.protocol import TransferGroup
        from rollout_svc.weightsync.transfer import ReceivingEnd

        if self._rollout_end is None:
            self._rollout_end = ReceivingEnd()  # kept: its bucket buffers serve the next sync of this model
        rank = first_rank + int(getattr(self, "rank", 0))
        self._rollout_end.join(TransferGroup.model_validate(spec), rank, host)
        return rank

    def rollout_leave_group(self) -> None:
        if self._rollout_end is not None:
            self._rollout_end.leave()

    def rollout_receive_start(self, manifest: dict[str, Any]) -> None:
        """Start receiving every bucket of `manifest` (a `WeightManifest`) in a thread of this process, and return:
        the engine goes on stepping with the weights it has (gloo's receive releases the GIL). Nothing is loaded
        (`rollout_load_received`); poll with `rollout_receive_poll`."""
        from rollout_svc.protocol import WeightManifest

        if self._rollout_end is None:
            raise RuntimeError("not in a weight transfer group: join one first")
        if self._rollout_receiving is not None and self._rollout_receiving.is_alive():
            raise RuntimeError("a receive is already running here")
        end, parsed = self._rollout_end, WeightManifest.model_validate(manifest)
        self._rollout_received = None

        def receive() -> None:
            started = time.perf_counter()
            try:
                tensors = end.receive(parsed)
            except Exception as exc:  # a peer gone: nothing is kept to load
                self._rollout_received = {"error": f"{type(exc).__name__}: {exc}"}
                return
            self._rollout_received = {"tensors": tensors, "receive_s": time.perf_counter() - started}

        self._rollout_receiving = threading.Thread(target=receive, name="rollout-receive", daemon=True)
        self._rollout_receiving.start()

    def rollout_receive_poll(self) -> dict[str, Any]:
        """Whether the receive ended: `{"done": bool, "error": str or None, "receive_s": seconds}`."""
        outcome = self._rollout_received
        if outcome is None:
            return {"done": False, "error": None, "receive_s": 0.0}
        return {"done": True, "error": outcome.get("error"), "receive_s": outcome.get("receive_s", 0.0)}

    def rollout_load_received(self) -> dict[str, float]:
        """Load what the last receive got, whole (the engine is paused). Returns seconds loading."""
        outcome, self._rollout_received = self._rollout_received, None
        if not outcome or "tensors" not in outcome:
            raise RuntimeError("no weights were received to load")
        started = time.perf_counter()
        self.reload_weights(weights_iterator=iter(outcome["tensors"]))  # type: ignore[attr-defined]
        return {"load_s": time.perf_counter() - started}

    def rollout_load_checkpoint(self, path: str) -> dict[str, float]:
        """Load the safetensors under the directory `path` (already checked against the checkpoint root)."""
        started = time.perf_counter()
        self.reload_weights(weights_path=path)  # type: ignore[attr-defined]
        return {"load_s": time.perf_counter() - started}
