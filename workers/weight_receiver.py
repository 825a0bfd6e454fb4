"""The worker's side of weight sync: follow the trainer's sync orders, and catch up to the committed version.

The rollout worker process has Redis; its engine does not. So this side does the rendezvous and the barriers
(`rollout_svc.weightsync.plane`), and drives the engine's receiving end (for vLLM, `workers.weight_extension` through
`collective_rpc`). After a load it resets the prefix cache, running requests included (a failed reset fails the
sync here), and records the switch in every in-flight request, at the token it had reached: the requests' weight
spans are exact across a keep-pause.

A worker whose version differs from the committed one takes no work (the converger labels it `stale`). If the
committed version came from a checkpoint, it loads that checkpoint on its own; otherwise it waits for the next
broadcast, which includes it (the trainer sends to every live worker).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rollout_svc.config import Settings
from rollout_svc.control.plane import ControlPlane
from rollout_svc.errors import EngineDeadError, InvalidRequestError
from rollout_svc.keys import JOINED, LOADED, OK, RECEIVED
from rollout_svc.protocol import RolloutRequest, WeightSyncOrder
from rollout_svc.weightsync.plane import WeightSyncPlane, advertise_address, checkpoint_dir
from workers.engine import Engine
from workers.inflight import InFlightIndex
from workers.state import WorkerState

log = logging.getLogger("rollout_svc.worker")
JOIN_GRACE_S = 5.0  # beyond the group's own timeout, before a join that never returns counts as failed


class WeightReceiver:
    """Follows sync orders for one worker; `step()` runs on every nudge and every heartbeat interval."""

    def __init__(
        self,
        settings: Settings,
        plane: WeightSyncPlane,
        control: ControlPlane,
        engine: Engine,
        state: WorkerState,
        index: InFlightIndex,
        on_version: Callable[[], None],
    ) -> None:
        self.settings, self.plane, self.control, self.engine = settings, plane, control, engine
        self.state, self.index, self._on_version = state, index, on_version
        self.host = advertise_address(settings)
        self._handled: str | None = None  # the last sync order followed
        self._group_id: str | None = None  # the transfer group the engine is in
        self._refused: tuple[int, str] | None = None  # a committed checkpoint that failed to load here

    async def step(self) -> None:
        """Follow a new sync order naming this worker; then, if still behind the committed version, catch up."""
        order = await self.plane.order()
        if order is not None and order.sync_id != self._handled and self.state.worker_id in order.members:
            self._handled = order.sync_id
            await self._follow(order)
        desired = await self.control.state()
        self.state.committed_version = desired.weight_version
        syncing = order is not None and order.version > desired.weight_version  # loaded, not yet committed
        if syncing and order is not None and order.version == self.state.weight_version:
            return
        if self.state.weight_version != desired.weight_version and desired.weight_checkpoint:
            await self._catch_up(desired.weight_version, desired.weight_checkpoint)

    async def _follow(self, order: WeightSyncOrder) -> None:
        worker_id = self.state.worker_id
        log.info("weight sync %s: version %d by %s", order.sync_id, order.version, order.transport)
        if order.transport == "checkpoint":
            outcome = await self._load_checkpoint(order.path or "", order.version)
            await self.plane.arrive(order.sync_id, LOADED, worker_id, outcome)
            return
        if order.transport == "engine":
            await self.plane.arrive(order.sync_id, LOADED, worker_id, await self._engine_op(order))
            return
        group = order.group
        if group is None or worker_id not in group.ranks:
            await self.plane.arrive(order.sync_id, JOINED, worker_id, "the order assigns this worker no rank")
            return
        if group.group_id != self._group_id:
            try:
                if self._group_id is not None:
                    self._group_id = None
                    await self.engine.leave_weight_group()
                join = self.engine.join_weight_group(group, group.ranks[worker_id], self.host)
                await asyncio.wait_for(join, (group.join_timeout_s or group.timeout_s) + JOIN_GRACE_S)
                self._group_id = group.group_id
            except EngineDeadError:
                raise
            except Exception as exc:
                log.warning("joining weight transfer group %s failed: %s", group.group_id, exc)
                await self.plane.arrive(order.sync_id, JOINED, worker_id, f"joining the group failed: {exc}")
                return
        await self.plane.arrive(order.sync_id, JOINED, worker_id)
        timeout_s = self.settings.weight_sync.weight_sync_timeout_s
        transferred = RECEIVED if order.staged else LOADED  # the barrier the trainer awaits after the transfer
        manifest = await self.plane.manifest(order.sync_id, timeout_s)
        if manifest is None:
            await self.plane.arrive(order.sync_id, transferred, worker_id, "the tensors were never announced")
            return
        try:
            await self.engine.receive_weights(manifest)  # generating on meanwhile, unless the trainer paused first
        except EngineDeadError:
            raise
        except Exception as exc:
            self._group_id = None  # a failed collective: the trainer builds a new group
            log.warning("receiving weight version %d failed: %s; nothing of it is loaded", order.version, exc)
            await self.plane.arrive(order.sync_id, transferred, worker_id, f"receiving failed: {exc}")
            return
        if order.staged:
            await self.plane.arrive(order.sync_id, RECEIVED, worker_id)
            if not await self.plane.load_ordered(order.sync_id, timeout_s + self.settings.client.control_timeout_s):
                log.warning(
                    "weight sync %s: received, but its load was never ordered (the trainer died or gave up): "
                    "nothing loaded, version %d kept", order.sync_id, self.state.weight_version,
                )  # fmt: skip
                return
        await self.plane.arrive(order.sync_id, LOADED, worker_id, await self._load_received(order.version))

    async def _load_received(self, version: int) -> str:
        """Load what was received (the fleet is paused), then reset and switch (`_loaded`): "ok", or why not."""
        try:
            await self.engine.load_received()
        except EngineDeadError:
            raise
        except Exception as exc:
            log.exception("loading weight version %d failed", version)
            return f"loading failed: {type(exc).__name__}: {exc}"
        return await self._loaded(version)

    async def _engine_op(self, order: WeightSyncOrder) -> str:
        """Run the order's `EngineWeightOp` on the engine (for `init`, with this worker's rank offset; `finish` then
        switches to the order's version as a load does): "ok", or why not. Bounded by the sync timeout: an `init`
        waits for the trainer to join its group."""
        op = order.engine_op
        if op is None:
            return "the order names no engine call"
        info = dict(op.info)
        if op.op == "init":
            if self.state.worker_id not in op.rank_offsets:
                return "the order assigns this worker no rank"
            info["rank_offset"] = op.rank_offsets[self.state.worker_id]
        try:
            timeout_s = self.settings.weight_sync.weight_sync_timeout_s + JOIN_GRACE_S
            await asyncio.wait_for(self.engine.engine_weight_op(op.op, info), timeout_s)
        except EngineDeadError:
            raise
        except InvalidRequestError as exc:
            return str(exc)
        except Exception as exc:
            log.warning("vLLM's weight transfer call %s failed: %s", op.op, exc)
            return f"vLLM's {op.op} failed: {type(exc).__name__}: {exc}"
        return await self._loaded(order.version) if op.op == "finish" else OK

    async def _load_checkpoint(self, path: str, version: int) -> str:
        """Load a checkpoint under the checkpoint root as `version`: "ok", or why not."""
        try:
            resolved = checkpoint_dir(self.settings.weight_sync.checkpoint_root, path)
            await self.engine.load_checkpoint(str(resolved))
        except EngineDeadError:
            raise
        except InvalidRequestError as exc:
            log.error("weight version %d: %s", version, exc)
            return str(exc)
        except Exception as exc:
            log.exception("loading checkpoint %s failed", path)
            return f"loading the checkpoint failed: {type(exc).__name__}: {exc}"
        return await self._loaded(version)

    async def _loaded(self, version: int) -> str:
        """After a load: reset the prefix cache (running requests too: their KV was computed by the old
        weights) and switch to `version`. "ok", or why not (then this worker stays at its old version: stale)."""
        try:
            reset = await self.engine.reset_prefix_cache(True)
        except EngineDeadError:
            raise
        except Exception as exc:
            reset, why = False, f"{type(exc).__name__}: {exc}"
        else:
            why = "the engine refused"
        if not reset:
            log.error("weight version %d loaded, but the prefix cache reset failed (%s): stale", version, why)
            return f"the prefix cache reset failed: {why}"
        self._switch(version)
        return OK

    def _switch(self, version: int) -> None:
        """From now on this engine generates with `version`: every request in it records the token it reached.

        The engine is paused (a sync pauses first), so what it generated before is all it has reported: vLLM's
        engine core sends each step's output before the pause's reply. A request not yet in the engine has 0."""
        for record in self.index.records():
            if not (record.generation and record.in_engine) or not isinstance(record.request, RolloutRequest):
                continue
            continuation = record.request.continuation
            kept = len(continuation.token_ids) if continuation else 0
            made = self.engine.output_tokens(record.request.request_id) or 0
            record.version_marks.append((version, kept + made))
        self.state.weight_version = version
        self._on_version()

    async def _catch_up(self, version: int, path: str) -> None:
        """Load the committed checkpoint this worker lacks (once per version: a refusal is not retried)."""
        if self._refused == (version, path):
            return
        log.info("weight version %d is committed from checkpoint %s: loading it", version, path)
        outcome = await self._load_checkpoint(path, version)
        if outcome != OK:
            self._refused = (version, path)
            log.error("could not catch up to weight version %d (%s): stale until the next sync", version, outcome)
