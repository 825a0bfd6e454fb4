"""One worker process = one engine replica: takes requests from Redis Streams, runs them, publishes results."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from redis.exceptions import ResponseError

from rollout_svc.config import GC_YOUNG_THRESHOLD, Settings, tune_gc
from rollout_svc.connections.topology import close_router, redis_router, shard_url
from rollout_svc.connections.urls import (
    next_message,
    redacted,
    redis_async,
    redis_async_bounded,
    server_run_id,
    wait_for_redis,
    warn_if_evicting,
)
from rollout_svc.control.plane import ControlPlane
from rollout_svc.dataplane.reaper import Reaper
from rollout_svc.dataplane.registry import Registry
from rollout_svc.dataplane.streams import Entry, StreamConnection
from rollout_svc.dataplane.worker_streams import TakeOptions, WorkerStreams
from rollout_svc.errors import EngineDeadError
from rollout_svc.keys import Nudge
from rollout_svc.protocol import WorkerStatus
from rollout_svc.weightsync.plane import WeightSyncPlane
from workers.converge import Converger
from workers.engine import Engine
from workers.inflight import AbortRules, InFlight, InFlightIndex, Woken
from workers.metrics import WorkerMetrics
from workers.moves import StragglerMover
from workers.publisher import Publisher
from workers.serve import REDIS_ERRORS, RequestServer, backoff_s
from workers.state import WorkerState, default_worker_id
from workers.weight_receiver import WeightReceiver

log = logging.getLogger("rollout_svc.worker")
_T = TypeVar("_T")
SWEEP_INTERVAL_S = 0.1  # deadlines and missed aborts are checked this often (not a timer per request)
TOKEN_CONCURRENCY = 256  # tokenize requests served at once
FENCED_DRAIN_S = 30.0  # how long a fenced worker waits for its aborted requests before coming back
WORKER_CONNECTIONS = 256  # a worker's shared connections to Redis at most; more commands at once wait for one
SHARE_WAIT_S = 0.02  # a worker that left queued work to others' shares reads again after this (or a slot freed)


class Worker:
    """Serves one engine from the queue until `stop()` (or its engine dies).

    Example (what `python -m workers --engine echo` does)::

        worker = Worker(Settings(), EchoEngine())
        await worker.run()

    Its loops, by name: `take` (rollout requests, while serving), `tokens` (tokenize requests, always),
    `publish` (results + acks, batched), `heartbeat` (liveness; fencing), `control` (converge on the desired
    state, acknowledge), `listen` (pub/sub nudges), `reap` (requeue dead workers' requests), `sweep`
    (deadlines, missed aborts), `weights` (weight sync orders, catch-up). If one fails unexpectedly, the worker
    exits (crash-only).
    """

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        worker_id: str | None = None,
        drain_timeout_s: float = 5.0,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.settings, self.engine, self.drain_timeout_s = settings, engine, drain_timeout_s
        self.keys = settings.keys
        self.state = WorkerState(worker_id or default_worker_id())
        self.index = InFlightIndex(engine)
        self.rules = AbortRules()
        self.metrics = metrics  # None: nothing is counted
        if metrics is not None:
            metrics.watch(self.state, self.index)
        self._stopping, self._slot_freed = asyncio.Event(), asyncio.Event()
        self._wake = asyncio.Event()  # a nudge, a reconnect, or a stop: the control loop converges
        self._weights_wake = asyncio.Event()  # a weights nudge, a reconnect, or a stop: the weights loop looks
        self._cancel_nudged = False
        self._beat_lock = asyncio.Lock()
        self._beat_sent_at = time.monotonic()  # when the last accepted heartbeat was sent (the lease's start)
        # Set while the last accepted heartbeat says `serving`: the take loop takes only then, so that placement,
        # which reads heartbeats, sees a worker that takes as one that serves (a worker that took a session's turn
        # while its heartbeat still said `stale` or the last epoch's `paused` pinned nothing, and the turn's other
        # request ran on another worker at the same time: found by the chaos soak).
        self._serving_announced = asyncio.Event()
        self._fenced = False
        self._fatal: BaseException | None = None
        self._started_at = time.time()
        self._loops: dict[str, asyncio.Task[None]] = {}
        # The take loop is in a take or a (blocking) read; that read returned.
        self._reading, self._read_returned = False, asyncio.Event()
        self._woken = Woken()  # the cost of entries its blocking reads took, not yet counted in Redis
        self._read_failures: dict[str, int] = {}  # loop name -> reads failed in a row
        self._redis_run_id: str | None = None  # the Redis server's run_id when last asked (a new one: it restarted)
        self._forgotten_check = False  # after a reconcile: requeue what Redis holds pending here that is not in flight

    @property
    def worker_id(self) -> str:
        return self.state.worker_id

    def stop(self) -> None:
        """Ask the worker to drain and exit (signal-safe from the event loop thread)."""
        self._stopping.set()
        self._slot_freed.set()  # a take loop waiting for capacity sees the stop at once
        self._wake.set()
        self._weights_wake.set()

    async def run(self) -> None:
        """Start the engine, serve until stopped, then drain. Raises `EngineDeadError` if the engine died."""
        # Every key of this worker's shard lives on the primary serving its hash tag's slot (the Redis itself, unless
        # it is a cluster): this worker talks to that primary alone, and to the cluster only to announce its shard.
        await wait_for_redis(self.settings.redis_url, log)  # a worker may start before its Redis
        url = await asyncio.to_thread(shard_url, self.settings.redis_url, self.settings.shard)
        if url != self.settings.redis_url:
            log.info("worker %s: shard %s is served by %s", self.worker_id, self.settings.shard, redacted(url))
        # Hundreds of streams sending chunks at once wait for a connection, rather than fail "Too many connections".
        self.redis = redis_async_bounded(url, WORKER_CONNECTIONS, 30.0, decode_responses=False)
        self._router = redis_router(self.settings.redis_url, decode_responses=False)
        self.streams = WorkerStreams(StreamConnection(self.redis, self.keys, self.settings.session_ttl_s))
        # The take loop's takes and blocking reads get a connection of their own, which a pause can unblock at once,
        # and so do the publisher's publishes: both used directly (`DirectConnection`), the request's hot path.
        self._take_streams = self.streams.on_own_connection()
        # Liveness on a connection of its own: no flood of results or chunks delays a heartbeat.
        self._beat_redis = redis_async(url, decode_responses=False, single_connection_client=True)
        self.registry = Registry(self._beat_redis, self.keys, self.settings.heartbeat_ttl_s)
        self.control = ControlPlane(self.redis, self.settings)
        self.reaper = Reaper(self.redis, self.settings)
        self.converger = Converger(self.control, self.engine, self.index, self.state, self.rules, self._stop_taking)
        self.weight_plane = WeightSyncPlane(self.redis, self.settings)
        self.receiver = WeightReceiver(
            self.settings, self.weight_plane, self.control, self.engine, self.state, self.index, self._wake.set,
            self._weights_wake.set,
        )  # fmt: skip
        self.publisher = Publisher(
            self.streams.on_own_connection(), self.state, self.settings.results_ttl_s, self._release,
            self._load_after, self._woken,
        )  # fmt: skip
        self.server = RequestServer(
            self.settings, self.engine, self.state, self.index, self.rules, self.streams, self.reaper.streams,
            self.publisher.put, self._engine_died, self.metrics,
        )  # fmt: skip
        self.mover = StragglerMover(self.settings, self.worker_id, self.index, self.streams, self.metrics)
        try:
            await self.engine.start()
            await self._prepare_while_redis_is_away()
            # What start-up built (the engine, its modules: millions of objects with vLLM) lives as long as the
            # process. Frozen, the collector's full passes skip it and walk only what requests allocate since;
            # and with a young generation of 50k objects, most requests' objects are freed before a pass sees them.
            tune_gc(GC_YOUNG_THRESHOLD)
            self._loops = {name: asyncio.create_task(self._guarded(name, loop())) for name, loop in self._named_loops()}
            log.info("worker %s serving %s (capacity %d)", self.worker_id, self.engine.model_name, self.engine.capacity)
            await self._stopping.wait()
            await self._shutdown()
        finally:
            await self.receiver.close()
            await self.engine.close()
            await self._take_streams.aclose()
            await self.publisher.streams.aclose()
            await self._beat_redis.aclose()
            await self.redis.aclose()
            await close_router(self._router)
        if self._fatal is not None:
            raise self._fatal

    def _named_loops(self) -> list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]]:
        return [
            ("take", self._take_loop),
            ("tokens", self._token_loop),
            ("publish", lambda: self.publisher.run(self._stopping)),
            ("heartbeat", self._heartbeat_loop),
            ("control", self._control_loop),
            ("listen", self._listen_loop),
            ("reap", self._reap_loop),
            ("sweep", self._sweep_loop),
            ("weights", self._weights_loop),
        ]

    async def _guarded(self, name: str, loop: Coroutine[Any, Any, None]) -> None:
        """Run one of the worker's loops; if it fails unexpectedly, stop the whole worker (crash-only).

        A worker that heartbeats but no longer takes or publishes would hold its requests forever;
        stopping requeues them, and a process manager starts the worker again.
        """
        try:
            await loop
        except Exception as exc:
            log.exception("a worker loop failed (%s); stopping so that this worker's requests are requeued", name)
            self._fatal = self._fatal or exc
            self.stop()

    def _engine_died(self, exc: EngineDeadError) -> None:
        self._fatal = self._fatal or exc
        self.stop()

    async def _announce_shard(self) -> None:
        """Add this worker's shard to the deployment's shard set, where producers find it (idempotent). A failure is
        only logged: the shard's own keys are elsewhere, and the next registration or reconcile adds it again."""
        try:
            await self._router.sadd(self.keys.shards, self.keys.shard)
            if self.settings.model_name:  # where `serve` and `status` find the named models
                await self._router.sadd(self.settings.models_key, self.settings.model_name)
        except (*REDIS_ERRORS, ResponseError) as exc:
            log.warning("could not add shard %s to the shard set (%s)", self.keys.shard, exc)

    async def _prepare_while_redis_is_away(self) -> None:
        """`_prepare`, again (each step is idempotent) while Redis fails under it: a worker starting just as Redis
        restarts comes up once it is back rather than exit."""
        failures = 0
        while True:
            try:
                return await self._prepare()
            except REDIS_ERRORS as exc:
                if self._stopping.is_set():
                    raise
                failures += 1
                log.warning("starting: Redis failed (%s); retrying", exc)
                await asyncio.sleep(backoff_s(failures))

    async def _prepare(self) -> None:
        """Create consumer groups, requeue what an earlier process with this worker id left pending, register,
        and converge on the control state before taking the first request (a fleet paused stays paused)."""
        await self.control.load_scripts()  # the same scripts the worker's other handles run
        await warn_if_evicting(self.redis, f"worker {self.worker_id}")
        self._redis_run_id = await server_run_id(self.redis)
        await self._ensure_groups()
        holder = await self.reaper.hold_lock_to_start(self.worker_id)
        try:
            await self.reaper.reclaim(self.worker_id, backlog=False)
            await self._register()
        finally:
            with contextlib.suppress(*REDIS_ERRORS):  # held by this process until it expires; taken again on a retry
                await self.registry.release_reap_lock(self.worker_id, holder)

    async def _register(self) -> None:
        """Register under the current id (state `starting`), then converge, and acknowledge if that completed
        (otherwise the control loop does, once in-flight requests have finished)."""
        await self._announce_shard()
        await self._beat(renew=False)
        if await self.converger.converge():
            await self._beat(announce=True)

    def _status(self) -> WorkerStatus:
        engine = self.engine
        return self.state.status(engine, len(self.index), self.server.served, self._started_at)

    async def _beat(self, *, renew: bool = True, announce: bool = False) -> bool:
        """Write the heartbeat (one writer at a time, so a later write never carries an older state).

        Returns False if a renewal was refused: the heartbeat had expired, this worker was presumed dead.
        """
        async with self._beat_lock:
            # Its free slots first: once a heartbeat says it serves, other workers' takes count it open.
            await self._report_load()
            sent_at = time.monotonic()
            status = self._status()
            accepted = await self.registry.heartbeat(status, renew=renew, announce=announce)
            if accepted:
                self._beat_sent_at = sent_at
                if status.state == "serving":
                    self._serving_announced.set()
                else:
                    self._serving_announced.clear()
            return accepted

    async def _report_load(self) -> None:
        """Its free slots, for the takes' fair shares."""
        await self.streams.report_load(*self._load_after([]))

    def _load_after(self, released: list[InFlight]) -> tuple[str, int]:
        """(worker id, free slots) once `released` are out of the in-flight index; no slot is free while it
        takes nothing (paused, sleeping, fenced, draining)."""
        generation = sum(1 for r in released if r.generation and not r.removed)
        taking = self.state.resumed.is_set() and not self._fenced and not self._stopping.is_set()
        return self.worker_id, self.engine.capacity - self.index.generating + generation if taking else 0

    def _lease_ok(self) -> bool:
        """Whether the last accepted heartbeat is younger than its TTL: past it, this worker may have been
        reaped, and it takes nothing until the heartbeat loop has found out."""
        return time.monotonic() - self._beat_sent_at < self.settings.heartbeat_ttl_s

    async def _ensure_groups(self) -> None:
        for stream in (self.keys.requests, self.keys.pinned_requests(self.worker_id), self.keys.token_requests):
            await self.streams.connection.ensure_group(stream)

    async def _idle(self, seconds: float) -> None:
        """Sleep, but wake at once on stop."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    # --- taking requests ----------------------------------------------------------------------------------

    async def _take_loop(self) -> None:
        while not self._stopping.is_set():
            if not self.state.resumed.is_set() or not self._serving_announced.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._resumed_and_announced(), self.settings.read_block_ms / 1000)
                continue
            if self._fenced or not self._lease_ok():  # until the heartbeat loop renewed (Redis away) or re-registered
                await self._idle(self.settings.read_block_ms / 1000)
                continue
            free = self.engine.capacity - self.index.generating
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            if self._woken.tokens and not self._woken.drained:  # woken: its answers go out before the next take
                await self.publisher.caught_up(self.settings.read_block_ms / 1000)
            if (taken := await self._read("take", self._take(free))) is None:
                continue
            entries, left = taken
            if left and not entries:  # the queued work is other workers' share: until one of ours ends, or a moment
                self.index.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.index.changed.wait(), SHARE_WAIT_S)
                continue
            self._start(entries, generation=True)
            if entries:
                await asyncio.sleep(0)  # start the new requests before sending the next read

    async def _resumed_and_announced(self) -> None:
        """Until it serves and its heartbeat says so (`_serving_announced`)."""
        await self.state.resumed.wait()
        await self._serving_announced.wait()

    async def _take(self, free: int) -> tuple[list[Entry], bool]:
        """A take of its fair share (`WorkerStreams.take`); with nothing to take, one blocking read of the next
        entry, on the connection a pause can unblock. Returns the entries and whether queued ones were left to
        other workers' shares."""
        await self._take_streams.connection.direct.client_id()  # type: ignore[union-attr]  # known to `_stop_taking`
        # No await between the take loop's `resumed` check and here: a pause sees `_reading` and unblocks the read.
        self._reading = True
        try:
            idle, ttl_ms = not (self.index.generating or self._woken.tokens), int(self.settings.heartbeat_ttl_s * 1e3)
            streams, options = (
                self._take_streams,
                TakeOptions(self.worker_id, ttl_ms, self.settings.worker.placement == "cost"),
            )
            if not self._woken.drained:  # else its last read found nothing more queued: to the next read at once
                with self._woken.claimed() as carried:
                    entries, left = await streams.take(options, free, carried, idle=idle)
                if entries or left or free <= 0:
                    return entries, left
            woken = await streams.wait_for_entries(self.worker_id, self.settings.read_block_ms, asked := min(free, 2))
            self._woken.add(woken, self.keys.pinned_requests(self.worker_id), asked)  # counted by a take or publish
            return woken, False
        finally:
            self._reading = False
            self._read_returned.set()

    async def _token_loop(self) -> None:
        """Tokenize, detokenize and chat-template requests: served while paused or asleep too."""
        while not self._stopping.is_set():
            free = TOKEN_CONCURRENCY - (len(self.index) - self.index.generating)
            if self._fenced or not self._lease_ok() or free <= 0:
                await self._idle(self.settings.read_block_ms / 1000)
                continue
            entries = await self._read(
                "tokens", self.streams.read_tokens(self.worker_id, free, self.settings.read_block_ms)
            )
            if entries is not None:
                self._start(entries, generation=False)

    async def _read(self, loop: str, read: Awaitable[_T]) -> _T | None:
        """One read of a take loop. None after an error it recovered from: consumer groups recreated (Redis lost
        its data: a restart without persistence), or Redis away (backed off, longer after each failure)."""
        try:
            entries = await read
        except ResponseError as exc:
            # NOGROUP: Redis lost the group (a restart without persistence). UNBLOCKED ... no longer exists: the
            # stream was deleted under a blocked read (a reaper draining this id's earlier process).
            if "NOGROUP" not in str(exc) and "no longer exists" not in str(exc):
                raise
            await self._ensure_groups()
            return None
        except REDIS_ERRORS as exc:
            self._read_failures[loop] = failures = self._read_failures.get(loop, 0) + 1
            log.warning("%s loop: reading requests failed (%s); retrying", loop, exc)
            await asyncio.sleep(backoff_s(failures))
            return None
        self._read_failures[loop] = 0
        return entries

    async def _stop_taking(self) -> None:
        """Make the take loop stop at once (the state already says not to take): unblock a read in progress and
        wait until what it returned is in the in-flight index, so that a pause applies to it too."""
        deadline = time.monotonic() + self.settings.read_block_ms / 1000 + 1
        while self._reading and time.monotonic() < deadline:
            self._read_returned.clear()
            if (client_id := self._take_streams.connection.direct.known_client_id) is not None:  # type: ignore[union-attr]
                with contextlib.suppress(ResponseError, *REDIS_ERRORS):  # an old Redis, or fakeredis: wait instead
                    await self.redis.client_unblock(client_id)
            with contextlib.suppress(TimeoutError):  # not blocked yet (the command not sent): unblock again
                await asyncio.wait_for(self._read_returned.wait(), 0.005)

    def _start(self, entries: list[Entry], generation: bool) -> None:
        for entry in entries:
            if self.metrics is not None:
                self.metrics.taken(entry)
            record = self.index.add(entry, generation)
            record.task = asyncio.create_task(self.server.serve(record))
            record.task.add_done_callback(lambda _t, r=record: self._finished(r))

    def _finished(self, record: InFlight) -> None:
        """A serve task ended. An answered request stays in flight until its result is published (its entry is
        pending until then), so an acknowledgement that waits for in-flight requests also waits for their answers."""
        if not record.publishing:
            self._release(record)

    def _release(self, record: InFlight) -> None:
        self.index.remove(record)
        self._slot_freed.set()

    # --- liveness -------------------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._check_redis()
                if not self._fenced and not await self._beat():
                    await self._reincarnate()
                await self._cancel_tombstoned()
            except REDIS_ERRORS as exc:
                log.warning("heartbeat failed (%s); retrying", exc)
            except ResponseError as exc:
                log.warning("heartbeat: %s", exc)
            await self._idle(self.settings.worker.heartbeat_interval_s)

    async def _check_redis(self) -> None:
        """Notice a Redis that restarted or failed over (a new run_id), and reconcile with what it holds now."""
        run_id = await server_run_id(self.redis)
        if run_id is None or run_id == self._redis_run_id:
            return
        known, self._redis_run_id = self._redis_run_id, run_id
        if known is not None:
            log.warning("Redis restarted or failed over (run_id %s -> %s): reconciling", known[:8], run_id[:8])
            await self._reconcile()

    async def _reconcile(self) -> None:
        """After Redis came back, perhaps without its recent writes (a restart without persistence, a replica promoted
        before it had them): recreate the consumer groups, abort the requests in flight whose entries Redis no longer
        holds as pending on this worker (their producers send them again, and a result for them would be fenced),
        and converge at once, which re-seeds a missing control state from what this worker last applied. A missing
        heartbeat is refused at the next beat, and the worker comes back as a new incarnation."""
        await self._ensure_groups()
        await self._announce_shard()
        await self.reaper.requeue_orphans(self.worker_id)
        records = self.index.records()
        pending = await self.reaper.pending_keys(self.worker_id, {r.entry.stream for r in records}, len(records) + 1000)
        lost = [record for record in records if (record.entry.stream, record.entry.entry_id) not in pending]
        if lost:
            log.warning(
                "Redis no longer holds %d of the %d requests in flight here: aborting them (their producers resubmit)",
                len(lost), len(records),
            )  # fmt: skip
            await self.index.cancel_all(lost, "shutdown")
        self._forgotten_check = True  # and the other way round, by the reap loop (it waits between two looks)
        self._wake.set()
        self._weights_wake.set()

    async def _reap_loop(self) -> None:
        while not self._stopping.is_set():
            if not self._fenced:
                try:
                    if self._forgotten_check:
                        await self.reaper.requeue_forgotten(self.worker_id, self.index.entry_keys)
                        self._forgotten_check = False
                    await self.reaper.reap_dead(self.worker_id)
                except REDIS_ERRORS as exc:
                    log.warning("reaping dead workers failed (%s); retrying", exc)
            await self._idle(self.settings.worker.heartbeat_interval_s)

    async def _reincarnate(self) -> None:
        """This worker's heartbeat expired while it lived (a stall past the TTL): it was presumed dead, and its
        requests are being requeued. It publishes nothing for those (fencing), aborts what it runs, and comes
        back under a new id, converged, before it takes work again."""
        old_id = self.worker_id
        log.warning("worker %s outlived its heartbeat TTL (stalled?); fencing and registering anew", old_id)
        self._fenced = True
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
            await self._ensure_groups()
            await self._register()
            log.warning("worker %s is back as %s", old_id, self.worker_id)
        finally:
            self._fenced = False
            self._slot_freed.set()

    # --- control ----------------------------------------------------------------------------------------------

    async def _listen_loop(self) -> None:
        """Pub/sub nudges wake the control loop (control channel) or the weights loop (weights channel); a
        (re)subscription wakes both, since a nudge may have been lost."""
        pubsub = None
        failures = 0
        while not self._stopping.is_set():
            try:
                if pubsub is None:
                    pubsub = await self.control.subscribe()
                message = await next_message(pubsub, self.settings.read_block_ms / 1000)
                failures = 0
            except REDIS_ERRORS as exc:
                failures += 1
                log.warning("control subscription failed (%s); reconnecting", exc)
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
                pubsub = None
                await asyncio.sleep(backoff_s(failures))
                continue
            if message is None:
                continue
            weights = message["channel"] == self.keys.weights_channel.encode()
            if message["type"] == "message" and weights:
                self._weights_wake.set()
                continue
            if message["type"] == "message" and message["data"] == Nudge.CANCEL:
                self._cancel_nudged = True
            self._wake.set()
            if message["type"] != "message":  # a (re)subscription: nudges may have been lost on both channels
                self._weights_wake.set()
        if pubsub is not None:
            await pubsub.aclose()

    async def _control_loop(self) -> None:
        """Converge on every nudge and at every heartbeat interval (level-triggered); while a pause waits for
        in-flight requests, also whenever one finishes. Acknowledge each epoch once applied."""
        pending = False
        while not self._stopping.is_set():
            waits = [self._wake.wait()] + ([self.index.changed.wait()] if pending else [])
            self.index.changed.clear()
            tasks = [asyncio.ensure_future(w) for w in waits]
            await asyncio.wait(
                tasks, timeout=self.settings.worker.heartbeat_interval_s, return_when=asyncio.FIRST_COMPLETED
            )
            for task in tasks:
                task.cancel()
            self._wake.clear()
            if self._fenced or self._stopping.is_set():
                continue
            try:
                if self._cancel_nudged:
                    self._cancel_nudged = False
                    await self._cancel_tombstoned()
                before = (self.state.applied_epoch, self.state.label)
                pending = not await self.converger.converge()
                if not pending and (self.state.applied_epoch, self.state.label) != before:
                    await self._beat(announce=True)
                if not pending and self.state.label == "stale":  # its heartbeat says so: placement skips it
                    await self.reaper.release_backlog(self.worker_id)  # its sessions' KV here is of old weights
            except REDIS_ERRORS as exc:
                log.warning("reading the control state failed (%s); retrying", exc)

    async def _weights_loop(self) -> None:
        """Follow weight sync orders and catch up to the committed version: on every nudge on the weights channel
        (the listen loop wakes it), and every heartbeat interval (a nudge may be lost)."""
        failures = 0
        while not self._stopping.is_set():
            self._weights_wake.clear()
            try:
                if not self._fenced:
                    await self.receiver.step()
                failures = 0
            except EngineDeadError as exc:
                self._engine_died(exc)
                return
            except REDIS_ERRORS as exc:
                failures += 1
                log.warning("weight sync: Redis failed (%s); retrying", exc)
                await asyncio.sleep(backoff_s(failures))
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._weights_wake.wait(), self.settings.worker.heartbeat_interval_s)

    async def _cancel_tombstoned(self) -> None:
        """Read the tombstones written since the last read; abort the in-flight requests they name (those taken
        later are answered unrun, see `AbortRules`)."""
        new = self.rules.add_tombstones(await self.control.tombstones(self.rules.tombstones_seen))
        if new:
            await self.index.cancel_all(self.index.by_request_ids(new), "user")

    async def _sweep_loop(self) -> None:
        """Abort generations whose deadline passed, and repeat aborts that may have missed."""
        while not self._stopping.is_set():
            await self.index.cancel_all(self.index.expired(time.time()), "deadline")
            await self.index.reabort()
            await self.mover.check()
            await self._idle(SWEEP_INTERVAL_S)

    # --- shutdown -------------------------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Stop taking; let in-flight requests finish for `drain_timeout_s`; abort the rest, whose partial
        results go back to their producers (which retry them token-exact elsewhere); deregister.

        The loops are not cancelled mid-command (a pipeline cancelled mid-read can leave redis-py waiting
        forever): they see `_stopping`, the publish loop a sentinel. If the engine died, unfinished requests
        are not aborted but left pending, and requeued here.
        """
        self.state.set_label("draining")
        with contextlib.suppress(*REDIS_ERRORS):
            await self._beat()  # placement skips a draining worker from now on
        await asyncio.wait([self._loops["take"], self._loops["tokens"]], timeout=self.settings.read_block_ms / 1000 + 5)
        if self._fatal is None:
            await self._drain(self.drain_timeout_s)
            await self.index.cancel_all(self.index.records(), "shutdown")
            await self._drain(5.0)
        for record in self.index.records():
            if record.task is not None:
                record.task.cancel()  # the entry stays pending: requeued below
        await self._drain(5.0)
        self.publisher.close()
        rest = [task for name, task in self._loops.items() if name not in ("take", "tokens")]
        await asyncio.wait(rest, timeout=30)
        try:
            # Deregister before draining the pinned stream: placement then no longer picks this worker.
            await self.registry.deregister(self.worker_id)
            await self.reaper.streams.forget_load(self.worker_id)
            moved = await self.reaper.reclaim(self.worker_id, backlog=True)
            log.info("worker %s stopped; requeued %d requests", self.worker_id, moved)
        except REDIS_ERRORS as exc:
            log.error("could not deregister (%s): live workers will requeue this worker's requests", exc)

    async def _drain(self, timeout_s: float) -> None:
        tasks = [r.task for r in self.index.records() if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
