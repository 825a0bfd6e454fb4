"""The trainer-led weight transfer of vLLM's own API, fleet-wide: `EngineWeightTransfer`.

vLLM 0.32 gives each engine a weight transfer engine (`weight_transfer_config={"backend": "nccl"}`) that a trainer
drives over HTTP: `/init_weight_transfer_engine` (the engine joins the trainer's NCCL group at `rank_offset`),
`/start_weight_update`, `/update_weights` (the engine receives what the trainer broadcasts, as it sends it),
`/finish_weight_update`, `/shutdown_weight_transfer_engine`. SkyRL's trainer speaks this protocol to every server it
knows (`RemoteInferenceClient.init_weight_update_communicator`, `update_named_weights`). Behind one `serve`, the
server's ranks are its live workers' (`GET /get_world_size`): each call becomes a `WeightSyncOrder` with transport
`engine` that every member makes on its own engine, and its `loaded` barrier answers the call. The trainer's NCCL
group is the trainer's (its master address and port are in `init_info`); Redis carries the calls, never tensors.

The version: `finish` commits the committed version plus one (or the one given), as a load does, so every token
generated after it is tagged with the new version. A pause around the update is the trainer's to ask for (SkyRL
pauses with `/pause?mode=keep` first), as in vLLM.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from rollout_svc.config import Settings
from rollout_svc.errors import InvalidRequestError, WeightSyncError
from rollout_svc.fleet import Fleet, FleetControl, FleetWeightPlane
from rollout_svc.keys import LOADED
from rollout_svc.protocol import EngineWeightOp, EngineWeightOpName, WeightSyncOrder

JOIN_GRACE_S = 10.0  # beyond the workers' own bound on a call (the sync timeout): their answer reaches the barrier


class EngineWeightTransfer:
    """vLLM's native weight transfer calls, made on every live worker of the fleet and answered once each made it.

    `init(init_info)` first (vLLM's `NCCLWeightTransferInitInfo` fields: `master_address`, `master_port`,
    `rank_offset`, `world_size`): the fleet's workers, in worker-id order, take the ranks `rank_offset`,
    `rank_offset + ranks of the first worker`, ...; their members stay fixed until the next `init`. Then, per sync,
    `start()`, `update(update_info)` (vLLM's `NCCLWeightTransferUpdateInfo`: `names`, `dtype_names`, `shapes`,
    `packed`, ...), `finish(version)`.

    Raises `InvalidRequestError` for bad `init_info`, a call before `init`, or a version not above the committed
    one; `WeightSyncError` when a member failed the call or died (naming each, with vLLM's error or why the worker
    refused: an engine without a weight transfer backend says so). The trainer then calls `init` again (vLLM's NCCL
    group does not survive a lost member). Each call waits at most `timeout_s` (default
    `Settings.weight_sync.weight_sync_timeout_s`) plus a grace for the workers' answers.
    """

    def __init__(self, settings: Settings, timeout_s: float | None = None) -> None:
        self.settings = settings
        self.timeout_s = (timeout_s or settings.weight_sync.weight_sync_timeout_s) + JOIN_GRACE_S
        self.members: list[str] = []  # the workers of the current init, in rank order
        self.reported: int | None = None  # the ranks GET /get_world_size last answered (None: never asked here)
        self.serve_id = uuid.uuid4().hex[:12]
        self.following = False  # another serve of the fleet leads the current group: its calls are answered here
        self._fleet: Fleet | None = None
        self._lock = asyncio.Lock()  # one call at a time: each is a collective on every member

    async def _connect(self) -> tuple[FleetControl, FleetWeightPlane]:
        if self._fleet is None:
            fleet = Fleet(self.settings)
            await fleet.refresh()
            self._fleet, self._control, self._plane = fleet, FleetControl(fleet), FleetWeightPlane(fleet)
        return self._control, self._plane

    async def close(self) -> None:
        if self._fleet is not None:
            await self._fleet.close()
            self._fleet = None

    async def world_size(self) -> dict[str, int]:
        """The live workers that can take part (not draining), with their weight-transfer ranks (TP x PP)."""
        control, _ = await self._connect()
        statuses = await control.registry.statuses(await control.registry.live_ids())
        return {w: s.weight_ranks for w, s in sorted(statuses.items()) if s is not None and s.state != "draining"}

    async def init(self, init_info: dict[str, Any]) -> dict[str, int]:
        """Every live worker joins the trainer's group (vLLM's `init_weight_transfer_engine`); returns each
        worker's first rank. Blocks until each joined: the trainer joins its side concurrently."""
        ranks = await self.world_size()
        if not ranks:
            raise WeightSyncError(0, "no live worker: start one with `rollout-svc worker`")
        offset, world_size = _int_field(init_info, "rank_offset", 1), _int_field(init_info, "world_size", 2)
        total = sum(ranks.values())
        if offset + total > world_size:
            raise InvalidRequestError(
                f"init_info: rank_offset {offset} + this fleet's {total} ranks now (GET /get_world_size) exceed "
                f"world_size {world_size}: the fleet grew since the trainer counted it (SkyRL caches the world size "
                "at its first call): make the trainer's client anew to count again, or bring the fleet back to its size"
            )
        if self.reported is not None and self.reported != total:
            raise InvalidRequestError(
                f"this fleet has {total} ranks now, {self.reported} when GET /get_world_size was answered: the trainer "
                "counted a fleet that has changed (SkyRL caches the world size at its first call), and NCCL would wait "
                "for ranks that never join: make the trainer's client anew to count again"
            )
        self.following = not await self._claim(init_info, offset)
        offsets, next_rank = {}, offset
        for worker_id, count in ranks.items():
            offsets[worker_id], next_rank = next_rank, next_rank + count
        if self.following:
            self.members = []
            return offsets
        async with self._lock:
            self.members = list(ranks)
            try:
                await self._call(EngineWeightOp(op="init", info=init_info, rank_offsets=offsets))
            except WeightSyncError:
                self.members = []
                raise
        return offsets

    async def _claim(self, init_info: dict[str, Any], offset: int) -> bool:
        """Whether this `serve` leads the fleet's join of the group at `init_info`'s master (recorded for the sync
        timeout): the first `serve` of the fleet asked to does; another asked at the same `rank_offset` follows
        (SkyRL 0.4 given the fleet's replicas as the DP servers of one deployment: it sends each the same init and
        every call after it, which the leader makes and the followers answer without making). Raises
        `InvalidRequestError` for another offset: SkyRL was given two replicas of one fleet as two deployments,
        and counted every GPU twice."""
        control, _ = await self._connect()
        master = f"{init_info.get('master_address')}:{init_info.get('master_port')}"
        link = control.fleet.links[sorted(control.fleet.links)[0]]
        key, ttl, mine = link.keys.engine_group(master), max(1, int(self.timeout_s)), f"{offset} {self.serve_id}"
        if await link.redis.set(key, mine, nx=True, ex=ttl):
            return True
        held = (await link.redis.get(key) or b"").decode().split()
        if held and int(held[0]) != offset:
            raise InvalidRequestError(
                f"this fleet joined the trainer's group at {master} at rank {held[0]} already, through another "
                f"serve; asked again at rank {offset}: list a fleet's serve replicas in SkyRL's server_urls as the "
                "data-parallel servers of one deployment (data_parallel_size = their number), or list one (each "
                "serve answers for the whole fleet, so two deployments count every GPU twice)"
            )
        if held and held[1] != self.serve_id:
            return False
        await link.redis.set(key, mine, ex=ttl)
        return True

    async def start(self) -> None:
        """vLLM's `start_weight_update` on every member."""
        async with self._lock:
            if not self.following:
                await self._call(EngineWeightOp(op="start"))

    async def update(self, update_info: dict[str, Any]) -> None:
        """vLLM's `update_weights`: every member receives the tensors `update_info` names while the trainer
        broadcasts them. Returns once each received and loaded them."""
        async with self._lock:
            if not self.following:
                await self._call(EngineWeightOp(op="update", info=update_info))

    async def finish(self, version: int | None = None) -> int:
        """vLLM's `finish_weight_update` on every member, then the new version committed: `version`, or the
        committed one plus one. Returns the committed version."""
        async with self._lock:
            control, _ = await self._connect()
            if self.following:  # the leader commits
                return (await control.state()).weight_version
            version = await control.next_weight_version(version)
            await self._call(EngineWeightOp(op="finish"), version)
            await control.commit_weights(version, "")
            return version

    async def shutdown(self) -> None:
        """vLLM's `shutdown_weight_transfer_engine` on every member; the next sync needs `init` again."""
        async with self._lock:
            try:
                if not self.following:
                    await self._call(EngineWeightOp(op="shutdown"))
            finally:
                self.members, self.following = [], False

    async def _call(self, op: EngineWeightOp, version: int | None = None) -> None:
        """Publish `op` to the members and wait for each one's answer. Raises WeightSyncError naming failures."""
        if not self.members:
            raise InvalidRequestError(
                f"{_VLLM_NAMES[op.op]} before init_weight_transfer_engine: the workers are in no trainer's group"
            )
        control, plane = await self._connect()
        if version is None:
            version = (await control.state()).weight_version
        sync_id = f"engine-{op.op}-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        await plane.publish(
            WeightSyncOrder(sync_id=sync_id, version=version, transport="engine", members=self.members, engine_op=op)
        )
        outcome = await plane.await_barrier(sync_id, LOADED, self.members, self.timeout_s)
        failures = outcome.failures
        if failures or not outcome.ok:
            raise WeightSyncError(
                version,
                f"{_VLLM_NAMES[op.op]} failed on {len(failures)} of {len(self.members)} workers after "
                f"{time.monotonic() - started:.1f} s (call init_weight_transfer_engine again once they serve)",
                failures,
            )


_VLLM_NAMES: dict[EngineWeightOpName, str] = {
    "init": "init_weight_transfer_engine",
    "start": "start_weight_update",
    "update": "update_weights",
    "finish": "finish_weight_update",
    "shutdown": "shutdown_weight_transfer_engine",
}


def _int_field(info: dict[str, Any], name: str, minimum: int) -> int:
    value = info.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidRequestError(
            f"init_info.{name} must be an integer >= {minimum} (vLLM's NCCL init info), not {value!r}"
        )
    return value
