"""The worker's side of weight sync: follow the trainer's sync orders, and catch up to the committed version.

The rollout worker process has Redis; its engine does not. So this side does the rendezvous and the barriers
(`rollout_svc.weightsync.plane`), and drives the engine's receiving end (for vLLM, `workers.weight_extension` through
`collective_rpc`). After a load it resets the prefix cache, running requests included (a failed reset fails the
sync here), and records the switch in every in-flight request, at the token it had reached: the requests' weight
spans are exact across a keep-pause.

A worker whose version differs from the committed one takes no work (the converger labels it `stale`). If the
committed version came from a checkpoint, it loads that checkpoint on its own; if from a broadcast, it catches up
from a live peer that holds it (`workers.catch_up`); from vLLM's own transfer engine, it waits for the next sync,
which includes it (the trainer sends to every live worker). A version it loaded for a sync that then ended without
a commit (the sync's pause released or lapsed: its trainer died between the load and the commit) counts as behind
too: if the engine still holds the committed version as received (the other came from a checkpoint or vLLM's
transfer, or from a broadcast into the other set of bucket buffers, which CPU engines keep), it loads that again, with
no peer and no trainer. Loads are one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from rollout_svc.config import Settings
from rollout_svc.connections.urls import REDIS_AWAY
from rollout_svc.control.plane import ControlPlane
from rollout_svc.errors import EngineDeadError, InvalidRequestError
from rollout_svc.keys import JOINED, LOADED, OK, RECEIVED
from rollout_svc.protocol import RolloutRequest, WeightManifest, WeightSyncOrder
from rollout_svc.weightsync.plane import (
    SYNC_HOLDER,
    WeightSyncPlane,
    advertise_address,
    await_stable,
    checkpoint_dir,
    checkpoint_folder,
)
from workers.catch_up import PeerCatchUp
from workers.engine import Engine, ReceivedFrom
from workers.inflight import InFlight, InFlightIndex
from workers.state import WorkerState

log = logging.getLogger("rollout_svc.worker")
JOIN_GRACE_S = 5.0  # beyond the group's own timeout, before a join that never returns counts as failed


class WeightReceiver:
    """Follows sync orders for one worker; `step()` runs on every nudge and every heartbeat interval.

    A sync is followed in a task of its own, so that the steps meanwhile still answer peers' catch-up orders: a sync
    whose trainer died before announcing its tensors holds this worker until a newer order replaces it or its timeout
    passes, and a late worker should not wait that long for a peer. `wake` is called when a followed sync ends (the
    next step looks for a newer order at once).
    """

    def __init__(
        self,
        settings: Settings,
        plane: WeightSyncPlane,
        control: ControlPlane,
        engine: Engine,
        state: WorkerState,
        index: InFlightIndex,
        on_version: Callable[[], None],
        wake: Callable[[], None] = lambda: None,
        discarded: Callable[[int], None] = lambda tokens: None,
    ) -> None:
        self.settings, self.plane, self.control, self.engine = settings, plane, control, engine
        self.state, self.index, self._on_version, self._wake = state, index, on_version, wake
        self.discarded = discarded  # tokens generated, then cut as too stale for their request's bound
        self._following: asyncio.Task[None] | None = None  # the sync order being followed
        self._failure: Exception | None = None  # met while following (an engine that died, a bug): raised by `step`
        self.host = advertise_address(settings)
        self._handled: str | None = None  # the last sync order followed
        self._group_id: str | None = None  # the transfer group the engine is in
        self._refused: tuple[int, str] | None = None  # a committed checkpoint that failed to load here
        self._loading = asyncio.Lock()  # one load at a time: a sync's, a checkpoint catch-up's, a peer catch-up's
        # The version the engine still holds as received (its manifest, its digest, and the engine's name for it)
        # after it loaded another one over it (a checkpoint, vLLM's own transfer: "held"; a sync's broadcast:
        # "previous"): loaded again if that other one is never committed.
        self._shelved: tuple[WeightManifest, str, ReceivedFrom] | None = None
        self._abandoned: str | None = None  # the last sync order found ended without a commit (logged once)
        self.peers = PeerCatchUp(settings, plane, engine, state, self.host, self._load_from_peer)

    async def step(self) -> None:
        """Follow a new sync order naming this worker; answer peers' catch-up orders; then, if still behind the
        committed version, catch up (from its checkpoint, or in the background from a peer). While it follows a sync,
        a worker behind a committed broadcast version goes on catching up from a peer (whichever loads first wins:
        `_load_from_peer`): the sync's group may wait up to the heartbeat TTL for a member that died, or longer."""
        self.peers.check()
        if self._failure is not None:
            raise self._failure
        order = await self.plane.order()
        following = self._following is not None and not self._following.done()
        named = order is not None and order.sync_id != self._handled and self.state.worker_id in order.members
        if named and not following and order is not None:
            self._handled, following = order.sync_id, True
            self._following = asyncio.create_task(self._follow_guarded(order), name=f"sync {order.sync_id}")
        await self.peers.serve_orders()
        desired = await self.control.state()
        if following:  # the sync decides this worker's version; behind the committed one, it asks a peer meanwhile
            behind = self.state.weight_version < desired.weight_version and not desired.weight_checkpoint
            if behind and desired.weight_digest:
                self.peers.learn(desired.weight_version, desired.weight_digest)
            return
        self.state.committed_version = desired.weight_version
        syncing = order is not None and order.version > desired.weight_version  # loaded, not yet committed
        if syncing and order is not None and order.version == self.state.weight_version:
            if order.transport == "engine" or SYNC_HOLDER in desired.holders:
                return  # its trainer holds the fleet paused for it: it commits, or gives up and resumes
            if self._abandoned != order.sync_id:  # resumed (or its lease lapsed) without a commit: abandoned
                self._abandoned = order.sync_id
                log.warning(
                    "weight sync %s loaded version %d here but ended without committing it (its trainer died or gave "
                    "up): back to the committed version %d",
                    order.sync_id,
                    order.version,
                    desired.weight_version,
                )
        if self.state.weight_version == desired.weight_version:
            return
        if desired.weight_checkpoint:
            await self._catch_up(desired.weight_version, desired.weight_checkpoint)
        elif desired.weight_digest and not await self._reload_shelved(desired.weight_version, desired.weight_digest):
            self.peers.learn(desired.weight_version, desired.weight_digest)

    async def close(self) -> None:
        if self._following is not None:
            self._following.cancel()
            with contextlib.suppress(BaseException):
                await self._following
        await self.peers.close()

    async def _follow_guarded(self, order: WeightSyncOrder) -> None:
        """`_follow` as a task: Redis away fails this sync here (the trainer's barrier names this worker) and the steps
        go on; anything else (an engine that died) is raised by the next step, which stops the worker."""
        try:
            await self._follow(order)
        except REDIS_AWAY as exc:
            log.warning("weight sync %s: Redis failed (%s); this sync is lost here", order.sync_id, exc)
        except Exception as exc:
            self._failure = exc
        finally:
            self._wake()

    async def _follow(self, order: WeightSyncOrder) -> None:
        worker_id = self.state.worker_id
        log.info("weight sync %s: version %d by %s", order.sync_id, order.version, order.transport)
        if order.transport == "checkpoint":
            outcome = await self._load_checkpoint(order.path or "", order.version, order.stable_wait_s)
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
        # What the engine holds as received stays whole through this receive (other buffers), so peers may go on
        # catching up from it, a failed receive too; a shelved copy is not kept past a receive.
        self._shelved = None
        try:
            received = await self.engine.receive_weights(manifest)  # generating on, unless the trainer paused first
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
                    "nothing loaded, version %d kept",
                    order.sync_id,
                    self.state.weight_version,
                )
                return
        before: tuple[WeightManifest, str, ReceivedFrom] | None = None
        if self.peers.held is not None:
            before = (self.peers.held, self.state.weight_digest, "previous")
        outcome = await self._load_received(order.version, str(received.get("digest", "")))
        if outcome == OK:
            self.peers.held = manifest
            self._shelved = before  # the version before, if this one is never committed (the trainer died)
        await self.plane.arrive(order.sync_id, LOADED, worker_id, outcome)

    async def _load_received(self, version: int, digest: str, source: ReceivedFrom = "trainer") -> str:
        """Load what was received (the fleet is paused, or this worker is stale; `digest`: of what arrived), then
        reset and switch (`_loaded`): "ok", or why not."""
        async with self._loading:
            try:
                await self.engine.load_received(source)
            except EngineDeadError:
                raise
            except Exception as exc:
                log.exception("loading weight version %d failed", version)
                return f"loading failed: {type(exc).__name__}: {exc}"
            return await self._loaded(version, digest)

    def _shelve(self) -> None:
        """The engine is about to load weights that are not a received version: what it holds as received (if
        anything) is no longer what it serves peers, but stays, to load again if what replaces it is never
        committed (`_reload_shelved`)."""
        if self.peers.held is not None:
            self._shelved = (self.peers.held, self.state.weight_digest, "held")
        self.peers.held = None

    async def _reload_shelved(self, version: int, digest: str) -> bool:
        """If the engine still holds the committed `version` (digest `digest`) as received, load it again: no peer
        and no trainer needed. Whether it did (False: it holds no such copy, or the load failed)."""
        shelved, self._shelved = self._shelved, None
        if shelved is None or shelved[0].version != version or shelved[1] != digest:
            self._shelved = shelved
            return False
        outcome = await self._load_received(version, digest, shelved[2])
        if outcome != OK:
            log.warning("weight version %d: loading the copy held here again failed (%s)", version, outcome)
            return False
        self.peers.held = shelved[0]
        log.info("weight version %d: loaded again from the copy this worker received", version)
        return True

    async def _load_from_peer(self, version: int) -> str:
        """Load the committed `version` a peer sent (`PeerCatchUp`): "ok", why not, or "" if it is no longer
        wanted (a sync brought this worker to it, or further, meanwhile; another version was committed)."""
        desired = await self.control.state()
        if desired.weight_version != version:
            return f"version {desired.weight_version} was committed meanwhile"
        order = await self.plane.order()
        if self.state.weight_version == version:
            return ""
        if order is not None and order.version > version and self.state.weight_version == order.version:
            return ""  # loaded by the sync in progress: the trainer's sync wins
        return await self._load_received(version, desired.weight_digest, "peer")

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
        if op.op != "finish":
            return OK
        self._shelve()  # vLLM's transfer engine loaded it: nothing is held to send
        return await self._loaded(order.version)

    async def _load_checkpoint(self, path: str, version: int, stable_wait_s: float | None = None) -> str:
        """Load a checkpoint under the checkpoint root as `version` (once its `STABLE` marker is there, if
        `stable_wait_s`): "ok", or why not."""
        try:
            root = self.settings.weight_sync.checkpoint_root
            if stable_wait_s is not None:  # a folder still being written may hold no weights yet: its marker first
                await await_stable(str(checkpoint_folder(root, path)), stable_wait_s)
            resolved = checkpoint_dir(root, path)
            self._shelve()
            async with self._loading:
                await self.engine.load_checkpoint(str(resolved))
                return await self._loaded(version)
        except EngineDeadError:
            raise
        except InvalidRequestError as exc:
            log.error("weight version %d: %s", version, exc)
            return str(exc)
        except Exception as exc:
            log.exception("loading checkpoint %s failed", path)
            return f"loading the checkpoint failed: {type(exc).__name__}: {exc}"

    async def _loaded(self, version: int, digest: str = "") -> str:
        """After a load: reset the prefix cache (running requests too: their KV was computed by the old
        weights) and switch to `version` (`digest`: of what was received, "" for a checkpoint). "ok", or why not
        (then this worker stays at its old version: stale)."""
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
        too_stale = self._switch(version, digest)
        if too_stale:
            self.discarded(sum(tokens for _, tokens in too_stale))
            log.info("weight version %d: %d held requests too stale for their bound, cut", version, len(too_stale))
            await self.index.cancel_all((record for record, _ in too_stale), "staleness")
        return OK

    def _switch(self, version: int, digest: str) -> list[tuple[InFlight, int]]:
        """From now on this engine generates with `version`: every request in it records the token it reached.
        Returns those whose first token `version` makes staler than their bound (`RolloutRequest.staleness_floor`),
        with the tokens each made: they are cut before the engine resumes, not generated on.

        The engine is paused (a sync pauses first), so what it generated before is all it has reported: vLLM's
        engine core sends each step's output before the pause's reply. A request not yet in the engine has 0."""
        too_stale: list[tuple[InFlight, int]] = []
        for record in self.index.records():
            request = record.request
            if not (record.generation and record.in_engine) or not isinstance(request, RolloutRequest):
                continue
            continuation = request.continuation
            kept = len(continuation.token_ids) if continuation else 0
            made = self.engine.output_tokens(request.request_id) or 0
            first, floor = record.first_token_version(made), request.staleness_floor(version)
            whole = kept + made >= request.sampling_params.max_tokens  # made before the load: answered as it is
            stopping = record.abort_cause is not None  # cut already, for another cause: answered as that
            if first is not None and floor is not None and first < floor and not whole and not stopping:
                too_stale.append((record, kept + made))
            record.version_marks.append((version, kept + made))
        self.state.weight_version, self.state.weight_digest = version, digest
        self._on_version()
        return too_stale

    async def _catch_up(self, version: int, path: str) -> None:
        """Load the committed checkpoint this worker lacks (once per version: a refusal is not retried)."""
        if self._refused == (version, path):
            return
        log.info("weight version %d is committed from checkpoint %s: loading it", version, path)
        outcome = await self._load_checkpoint(path, version)
        if outcome != OK:
            self._refused = (version, path)
            log.error("could not catch up to weight version %d (%s): stale until the next sync", version, outcome)
