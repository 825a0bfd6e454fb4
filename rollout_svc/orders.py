"""The orders that run the fleet, on the wire: control commands, weight-sync orders (their transfer group, a call of
vLLM's own weight transfer, the manifest of the tensors sent), and a stale worker's catch-up from a peer.

Encoded and decoded as every message is (`rollout_svc.protocol.encode`, `decode`), and named from there as well
(`from rollout_svc.protocol import WeightSyncOrder`): this module holds them apart from the requests and their answers.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from rollout_svc.wire import Message


class ControlCommand(Message):
    """A control command as logged in Redis (`Keys.commands`, scored by the epoch it produced).

    `kind` is one of pause, resume, abort, sleep, wake_up, reset_prefix_cache; `args` its arguments;
    `issued_at` unix seconds. `epoch` is filled in from the log's score when read.
    """

    command_id: str
    kind: str
    args: dict[str, Any] = Field(default_factory=dict)
    issued_at: float = Field(default_factory=time.time)
    epoch: int = 0


class TransferGroup(Message):
    """A weight-transfer process group (`torch.distributed`, built from a `TCPStore`): rank 0 is the trainer,
    listening at `master_addr:master_port`; `ranks` maps each member worker to its first rank (it takes
    `weight_ranks` consecutive ones). `token` is a one-time secret, the store's key prefix: only a process that
    read it from Redis finds the rendezvous. `timeout_s` bounds every collective; `join_timeout_s` (default
    `timeout_s`) the rendezvous: the trainer sets its heartbeat TTL there, so a member that died before it joined
    costs a sync no more than that (everyone's join fails, and the group is built again without it).
    `backend`: gloo or nccl."""

    group_id: str
    master_addr: str
    master_port: int
    token: str
    world_size: int
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = 60.0
    join_timeout_s: float | None = None
    ranks: dict[str, int] = Field(default_factory=dict)


EngineWeightOpName = Literal["init", "start", "update", "finish", "shutdown"]


class EngineWeightOp(Message):
    """One call of vLLM's native weight transfer API (vLLM 0.32 `AsyncLLM`: `init_weight_transfer_engine`,
    `start_weight_update`, `update_weights`, `finish_weight_update`, `shutdown_weight_transfer_engine`), the
    trainer-led NCCL broadcast SkyRL's trainers drive. `info` is vLLM's `init_info` or `update_info` as the trainer
    sent it; for `init`, each worker's `rank_offset` (its first rank in the trainer's group) is
    `rank_offsets[worker_id]`."""

    op: EngineWeightOpName
    info: dict[str, Any] = Field(default_factory=dict)
    rank_offsets: dict[str, int] = Field(default_factory=dict)


class WeightSyncOrder(Message):
    """One weight sync, as the trainer publishes it (`Keys.weight_sync`). `transport` broadcast: the members of
    `group` receive the announced tensors from rank 0; checkpoint: every member loads `path` (a directory holding
    `model.safetensors` or a shard index, under its checkpoint root; with `stable_wait_s`, once its `STABLE` marker is
    there, waiting that long for it); engine: every member makes the call `engine_op` on vLLM's own
    weight transfer engine (the trainer sends through vLLM's NCCL group, not ours). `members`: the workers expected
    at the barriers. `staged` (broadcast): the members receive while they go on generating on their old weights,
    keep what they received, reach barrier `received`, and load only once the trainer paused the fleet and wrote
    `Keys.weight_load` (transfer outside the pause); otherwise they load as soon as the transfer ends."""

    sync_id: str
    version: int
    transport: Literal["broadcast", "checkpoint", "engine"]
    members: list[str]
    staged: bool = False
    group: TransferGroup | None = None
    path: str | None = None
    stable_wait_s: float | None = None
    engine_op: EngineWeightOp | None = None
    issued_at: float = Field(default_factory=time.time)


class TensorSpec(Message):
    """One tensor inside a bucket: bytes `[offset, offset + nbytes)` viewed as `dtype` (torch's name, say
    "float32") and reshaped to `shape`."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class WeightManifest(Message):
    """The tensors of one broadcast sync, announced before the transfer: bucket i is one broadcast of
    `bucket_nbytes[i]` bytes (uint8) holding `buckets[i]`."""

    sync_id: str
    version: int
    bucket_nbytes: list[int]
    buckets: list[list[TensorSpec]]

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_nbytes)


class CatchUpOrder(Message):
    """A stale worker (`learner`) asks `peer`, which serves the committed `version`, to send it over the transfer
    group `group` (`Keys.weight_catch_ups`): the peer is rank 0, the learner's engine ranks follow; the learner's
    rollout process listens at the group's rendezvous."""

    catch_up_id: str
    version: int
    learner: str
    peer: str
    group: TransferGroup
    issued_at: float = Field(default_factory=time.time)


class CatchUpAnswer(Message):
    """The peer's answer (`Keys.weight_catch_up_answer`): the manifest of what it sends, or why it refuses."""

    catch_up_id: str
    manifest: WeightManifest | None = None
    refused: str = ""
