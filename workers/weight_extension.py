"""The receiving end of weight sync inside vLLM's own worker process (`worker_extension_cls`).

vLLM mixes this class into its GPU/CPU worker, so `self` is that worker (`self.rank`, `self.reload_weights`).
The rollout worker process, which has Redis, drives these methods through `AsyncLLM.collective_rpc`: arguments
and results are plain dicts, lists and strings (vLLM's msgpack IPC; tensors never cross it). Weights load with
`reload_weights`, which vLLM's CPU runner needs (a plain `model.load_weights` misses its repacked linear layers).
"""

from __future__ import annotations

import time
from typing import Any

WORKER_EXTENSION = "workers.weight_extension.WeightSyncExtension"


class WeightSyncExtension:
    """Joins the trainer's transfer group, receives announced buckets, loads them; or loads a checkpoint."""

    _rollout_end: Any = None  # a rollout_svc.weightsync.transfer.ReceivingEnd, made at the first join

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

    def rollout_receive(self, manifest: dict[str, Any]) -> dict[str, float]:
        """Receive every bucket of `manifest` (a `WeightManifest`), then load them all. Nothing is loaded unless
        everything arrived. Returns seconds spent receiving and loading."""
        from rollout_svc.protocol import WeightManifest

        if self._rollout_end is None:
            raise RuntimeError("not in a weight transfer group: join one first")
        started = time.perf_counter()
        tensors = self._rollout_end.receive(WeightManifest.model_validate(manifest))
        received = time.perf_counter()
        self.reload_weights(weights_iterator=iter(tensors))  # type: ignore[attr-defined]
        return {"receive_s": received - started, "load_s": time.perf_counter() - received}

    def rollout_load_checkpoint(self, path: str) -> dict[str, float]:
        """Load the safetensors under the directory `path` (already checked against the checkpoint root)."""
        started = time.perf_counter()
        self.reload_weights(weights_path=path)  # type: ignore[attr-defined]
        return {"load_s": time.perf_counter() - started}
