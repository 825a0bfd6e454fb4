"""A worker's liveness: its heartbeats and the lease they hold on its id, a Redis that restarted noticed and
reconciled with, and a new incarnation after it was presumed dead (fencing)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio
from redis.exceptions import ResponseError

from rollout_svc.config import Settings
from rollout_svc.connections.urls import server_run_id
from rollout_svc.dataplane.reaper import Reaper
from rollout_svc.dataplane.registry import Registry
from rollout_svc.dataplane.worker_streams import WorkerStreams
from rollout_svc.protocol import WorkerStatus
from workers.converge import Converger
from workers.inflight import InFlight, InFlightIndex
from workers.serve import REDIS_ERRORS, idle
from workers.state import Wakes, WorkerState

log = logging.getLogger("rollout_svc.worker")
FENCED_DRAIN_S = 30.0  # how long a fenced worker waits for its aborted requests before coming back


class Lease:
    """What this worker's last accepted heartbeat holds: its id for the heartbeat TTL from when it was sent, and
    whether it said `serving`.

    The take loop takes only while `serving` is set, so that placement, which reads heartbeats, sees a worker that
    takes as one that serves (a worker that took a session's turn while its heartbeat still said `stale` or the last
    epoch's `paused` pinned nothing, and the turn's other request ran on another worker at the same time: found by
    the chaos soak)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.sent_at = time.monotonic()  # when the last accepted heartbeat was sent (the lease's start)
        self.serving = asyncio.Event()

    def ok(self) -> bool:
        """Whether the last accepted heartbeat is younger than its TTL: past it, this worker may have been
        reaped, and it takes nothing until the heartbeat loop has found out."""
        return time.monotonic() - self.sent_at < self.ttl_s

    def renewed(self, sent_at: float, status: WorkerStatus) -> None:
        """A heartbeat sent at `sent_at` (monotonic s) with `status` was accepted."""
        self.sent_at = sent_at
        if status.state == "serving":
            self.serving.set()
        else:
            self.serving.clear()


class Liveness:
    """Registers a worker and keeps it alive: heartbeats (its free slots first, `WorkerStreams.report_load`), a
    Redis that restarted or failed over reconciled with, and a worker presumed dead fenced and registered anew.

    `status()` is the heartbeat to send, `load_after(released)` its (worker id, free slots) and `holds()` what its
    engine holds (KV cache and context, in tokens; 0 while not known)."""

    def __init__(
        self,
        settings: Settings,
        state: WorkerState,
        index: InFlightIndex,
        lease: Lease,
        wakes: Wakes,
        *,
        streams: WorkerStreams,
        reaper: Reaper,
        registry: Registry,
        router: redis.asyncio.Redis | redis.asyncio.RedisCluster,
        converger: Converger,
        status: Callable[[], WorkerStatus],
        load_after: Callable[[list[InFlight]], tuple[str, int]],
        holds: Callable[[], tuple[int, int]],
    ) -> None:
        self.settings, self.keys, self.state, self.index = settings, settings.keys, state, index
        self.lease, self.wakes, self.streams, self.reaper, self.registry = lease, wakes, streams, reaper, registry
        self.router, self.converger, self.status, self.load_after = router, converger, status, load_after
        self.holds = holds
        self.redis_run_id: str | None = None  # the Redis server's run_id when last asked (a new one: it restarted)
        self._beat_lock = asyncio.Lock()
        self._forgotten_check = False  # after a reconcile: requeue what Redis holds pending here that is not in flight

    async def register(self) -> None:
        """Register under the current id (state `starting`), then converge, and acknowledge if that completed
        (otherwise the control loop does, once in-flight requests have finished)."""
        await self._announce_shard()
        await self.beat(renew=False)
        if await self.converger.converge():
            await self.beat(announce=True)

    async def _announce_shard(self) -> None:
        """Add this worker's shard to the deployment's shard set, where producers find it (idempotent). A failure is
        only logged: the shard's own keys are elsewhere, and the next registration or reconcile adds it again."""
        try:
            await self.router.sadd(self.keys.shards, self.keys.shard)
            if self.settings.model_name:  # where `serve` and `status` find the named models
                await self.router.sadd(self.settings.models_key, self.settings.model_name)
        except (*REDIS_ERRORS, ResponseError) as exc:
            log.warning("could not add shard %s to the shard set (%s)", self.keys.shard, exc)

    async def beat(self, *, renew: bool = True, announce: bool = False) -> bool:
        """Write the heartbeat (one writer at a time, so a later write never carries an older state).

        Returns False if a renewal was refused: the heartbeat had expired, this worker was presumed dead.
        """
        async with self._beat_lock:
            # Its free slots first: once a heartbeat says it serves, other workers' takes count it open. What its
            # engine holds (KV cache, context) goes with them: takes weigh the work by it. The heartbeat itself is
            # read after: a state that changed meanwhile (starting to serving) goes out in this beat, not the next.
            widest = await self.streams.report_load(*self.load_after([]), *self.holds())
            self.state.widest_context = widest
            sent_at = time.monotonic()
            status = self.status()
            accepted = await self.registry.heartbeat(status, renew=renew, announce=announce)
            if accepted:
                self.lease.renewed(sent_at, status)
            return accepted

    async def heartbeat_loop(self) -> None:
        """Every heartbeat interval: reconcile first if Redis restarted, then the heartbeat; a renewal refused (presumed
        dead) brings this worker back as a new incarnation. Also reads the tombstones a lost cancel nudge left."""
        while not self.wakes.stopping.is_set():
            try:
                await self.check_redis()
                if not self.state.fenced and not await self.beat():
                    await self.reincarnate()
                await self.converger.cancel_tombstoned()
            except REDIS_ERRORS as exc:
                log.warning("heartbeat failed (%s); retrying", exc)
            except ResponseError as exc:
                log.warning("heartbeat: %s", exc)
            await idle(self.wakes.stopping, self.settings.worker.heartbeat_interval_s)

    async def reap_loop(self) -> None:
        """Every heartbeat interval, unless fenced: reclaim dead workers (`Reaper.reap_dead`), and after a reconcile
        requeue what Redis holds pending on this worker that it does not have in flight (`Reaper.requeue_forgotten`,
        two looks apart)."""
        while not self.wakes.stopping.is_set():
            if not self.state.fenced:
                try:
                    if self._forgotten_check:
                        await self.reaper.requeue_forgotten(self.state.worker_id, self.index.entry_keys)
                        self._forgotten_check = False
                    await self.reaper.reap_dead(self.state.worker_id)
                except REDIS_ERRORS as exc:
                    log.warning("reaping dead workers failed (%s); retrying", exc)
            await idle(self.wakes.stopping, self.settings.worker.heartbeat_interval_s)

    async def check_redis(self) -> None:
        """Notice a Redis that restarted or failed over (a new run_id), and reconcile with what it holds now. The new
        run_id is kept only once the reconcile is done: one cut short (a Redis still loading its append-only file
        answers INFO but refuses the rest, or went away again) is tried again at the next check, or entries pending
        here that the worker no longer holds would wait for good, their producers told Redis still holds them."""
        run_id = await server_run_id(self.streams.redis)
        if run_id is None or run_id == self.redis_run_id:
            return
        known = self.redis_run_id
        if known is not None:
            log.warning("Redis restarted or failed over (run_id %s -> %s): reconciling", known[:8], run_id[:8])
            await self.reconcile()
        self.redis_run_id = run_id

    async def reconcile(self) -> None:
        """After Redis came back, perhaps without its recent writes (a restart without persistence, a replica promoted
        before it had them): recreate the consumer groups, abort the requests in flight whose entries Redis no longer
        holds as pending on this worker (their producers send them again, and a result for them would be fenced),
        and converge at once, which re-seeds a missing control state from what this worker last applied. A missing
        heartbeat is refused at the next beat, and the worker comes back as a new incarnation."""
        worker_id = self.state.worker_id
        await self.streams.ensure_groups(worker_id)
        await self._announce_shard()
        await self.reaper.requeue_orphans(worker_id)
        records = self.index.records()
        pending = await self.reaper.pending_keys(worker_id, {r.entry.stream for r in records}, len(records) + 1000)
        lost = [record for record in records if (record.entry.stream, record.entry.entry_id) not in pending]
        if lost:
            log.warning(
                "Redis no longer holds %d of the %d requests in flight here: aborting them (their producers resubmit)",
                len(lost),
                len(records),
            )
            await self.index.cancel_all(lost, "shutdown")
        self._forgotten_check = True  # and the other way round, by the reap loop (it waits between two looks)
        self.wakes.nudges_lost()

    async def reincarnate(self) -> None:
        """This worker's heartbeat expired while it lived (a stall past the TTL): it was presumed dead, and its
        requests are being requeued. It publishes nothing for those (fencing), aborts what it runs, and comes
        back under a new id, converged, before it takes work again."""
        old_id = self.state.worker_id
        log.warning("worker %s outlived its heartbeat TTL (stalled?); fencing and registering anew", old_id)
        self.state.fenced = True
        try:
            self.state.set_label("starting")
            moved = await self.reaper.reap(old_id, old_id)  # nobody else did yet: requeue its own requests
            if moved:
                log.warning("requeued %d requests of %s", moved, old_id)
            await self.index.cancel_all(self.index.records(), "shutdown")  # their results are fenced anyway
            deadline = time.monotonic() + FENCED_DRAIN_S
            while len(self.index) and time.monotonic() < deadline:
                await self.index.wait_changed(0.1)
            self.state.incarnation += 1
            self.state.applied_epoch = 0
            self.converger.restart()
            await self.streams.ensure_groups(self.state.worker_id)
            await self.register()
            log.warning("worker %s is back as %s", old_id, self.state.worker_id)
        finally:
            self.state.fenced = False
            self.wakes.slot_freed.set()
