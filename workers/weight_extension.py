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

    _rollout_group: Any = None
    _rollout_backend: str = "gloo"
    _rollout_buffers: Any = None

    def rollout_join_group(self, spec: dict[str, Any], first_rank: int, host: str) -> int:
        """Join the transfer group `spec` (a `TransferGroup`) as `first_rank` + this engine rank; blocks until
        every rank has joined (at most the spec's timeout). Returns the rank taken."""
        from rollout_svc.protocol import TransferGroup
        from rollout_svc.weights import join_group

        group = TransferGroup.model_validate(spec)
        self._rollout_group = None
        rank = first_rank + int(getattr(self, "rank", 0))
        self._rollout_group = join_group(group, rank, host)
        self._rollout_backend = group.backend
        return rank

    def rollout_leave_group(self) -> None:
        self._rollout_group = None

    def rollout_receive(self, manifest: dict[str, Any]) -> dict[str, float]:
        """Receive every bucket of `manifest` (a `WeightManifest`), then load them all. Nothing is loaded unless
        everything arrived. Returns seconds spent receiving and loading."""
        from rollout_svc.protocol import WeightManifest
        from rollout_svc.weights import BucketBuffers, receive_buckets, receive_device

        if self._rollout_group is None:
            raise RuntimeError("not in a weight transfer group: join one first")
        announced = WeightManifest.model_validate(manifest)
        started = time.perf_counter()
        try:
            if self._rollout_buffers is None:
                self._rollout_buffers = BucketBuffers()  # kept: the next sync of this model reuses them
            device = receive_device(self._rollout_backend)
            tensors = receive_buckets(self._rollout_group, announced, device, self._rollout_buffers)
        except Exception:
            self._rollout_group = None  # a failed collective leaves the group unusable: the trainer rebuilds it
            raise
        received = time.perf_counter()
        self.reload_weights(weights_iterator=iter(tensors))  # type: ignore[attr-defined]
        return {"receive_s": received - started, "load_s": time.perf_counter() - received}

    def rollout_load_checkpoint(self, path: str) -> dict[str, float]:
        """Load the safetensors under the directory `path` (already checked against the checkpoint root)."""
        started = time.perf_counter()
        self.reload_weights(weights_path=path)  # type: ignore[attr-defined]
        return {"load_s": time.perf_counter() - started}
