"""One worker process = one engine replica: takes requests from Redis Streams, runs them, publishes results."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

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
from rollout_svc.dataplane.streams import StreamConnection
from rollout_svc.dataplane.worker_streams import WorkerStreams
from rollout_svc.errors import EngineDeadError
from rollout_svc.keys import Nudge
from rollout_svc.protocol import WorkerStatus
from rollout_svc.weightsync.plane import WeightSyncPlane
from workers.converge import Converger
from workers.engine import Engine
from workers.inflight import AbortRules, InFlight, InFlightIndex, Woken
from workers.liveness import Lease, Liveness
from workers.metrics import WorkerMetrics
from workers.moves import StragglerMover
from workers.publisher import Publisher
from workers.serve import REDIS_ERRORS, RequestServer, backoff_s, idle
from workers.state import Wakes, WorkerState, default_worker_id
from workers.taker import Taker
from workers.weight_receiver import WeightReceiver

log = logging.getLogger("rollout_svc.worker")
SWEEP_INTERVAL_S = 0.1  # deadlines and missed aborts are checked this often (not a timer per request)
WORKER_CONNECTIONS = 256  # a worker's shared connections to Redis at most; more commands at once wait for one


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
        self.wakes = Wakes()
        self._cancel_nudged = False
        self.lease = Lease(settings.heartbeat_ttl_s)  # what its last accepted heartbeat holds
        self._fatal: BaseException | None = None
        self._started_at = time.time()
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._woken = Woken()  # the cost of entries its blocking reads took, not yet counted in Redis

    @property
    def worker_id(self) -> str:
        return self.state.worker_id

    def _stale_discarded(self, tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.stale_tokens.inc(tokens)

    def stop(self) -> None:
        """Ask the worker to drain and exit (signal-safe from the event loop thread)."""
        self.wakes.stop()

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
        # Liveness on a connection of its own: no flood of results or chunks delays a heartbeat.
        self._beat_redis = redis_async(url, decode_responses=False, single_connection_client=True)
        self.registry = Registry(self._beat_redis, self.keys, self.settings.heartbeat_ttl_s)
        self.control = ControlPlane(self.redis, self.settings)
        self.reaper = Reaper(self.redis, self.settings)
        self.weight_plane = WeightSyncPlane(self.redis, self.settings)
        self.receiver = WeightReceiver(
            self.settings,
            self.weight_plane,
            self.control,
            self.engine,
            self.state,
            self.index,
            self.wakes.control.set,
            self.wakes.weights.set,
            self._stale_discarded,
        )
        # The publisher's publishes go over a connection of its own, used directly (`DirectConnection`), as the take
        # loop's takes do: the request's hot path.
        self.publisher = Publisher(
            self.streams.on_own_connection(),
            self.state,
            self.settings.results_ttl_s,
            self._release,
            self._load_after,
            self._woken,
        )
        self.server = RequestServer(
            self.settings,
            self.engine,
            self.state,
            self.index,
            self.rules,
            self.streams,
            self.reaper.streams,
            self.publisher.put,
            self._engine_died,
            self.metrics,
        )
        self.mover = StragglerMover(self.settings, self.worker_id, self.index, self.streams, self.metrics)
        self.taker = Taker(self.server, self.lease, self._woken, self.wakes, self._release)
        self.converger = Converger(
            self.control, self.engine, self.index, self.state, self.rules, self.taker.stop_taking
        )
        self.liveness = Liveness(
            self.settings,
            self.state,
            self.index,
            self.lease,
            self.wakes,
            streams=self.streams,
            reaper=self.reaper,
            registry=self.registry,
            router=self._router,
            converger=self.converger,
            status=self._status,
            load_after=self._load_after,
            holds=lambda: (self.engine.kv_cache_tokens, self.engine.max_model_len),
        )
        try:
            await self.engine.start()
            await self._prepare_while_redis_is_away()
            # What start-up built (the engine, its modules: millions of objects with vLLM) lives as long as the
            # process. Frozen, the collector's full passes skip it and walk only what requests allocate since;
            # and with a young generation of 50k objects, most requests' objects are freed before a pass sees them.
            tune_gc(GC_YOUNG_THRESHOLD)
            self._loops = {name: asyncio.create_task(self._guarded(name, loop())) for name, loop in self._named_loops()}
            log.info("worker %s serving %s (capacity %d)", self.worker_id, self.engine.model_name, self.engine.capacity)
            await self.wakes.stopping.wait()
            await self._shutdown()
        finally:
            await self.receiver.close()
            await self.engine.close()
            await self.taker.aclose()
            await self.publisher.streams.aclose()
            await self._beat_redis.aclose()
            await self.redis.aclose()
            await close_router(self._router)
        if self._fatal is not None:
            raise self._fatal

    def _named_loops(self) -> list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]]:
        return [
            ("take", self.taker.take_loop),
            ("tokens", self.taker.token_loop),
            ("publish", lambda: self.publisher.run(self.wakes.stopping)),
            ("heartbeat", self.liveness.heartbeat_loop),
            ("control", self._control_loop),
            ("listen", self._listen_loop),
            ("reap", self.liveness.reap_loop),
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

    async def _prepare_while_redis_is_away(self) -> None:
        """`_prepare`, again (each step is idempotent) while Redis fails under it: a worker starting just as Redis
        restarts comes up once it is back rather than exit."""
        failures = 0
        while True:
            try:
                return await self._prepare()
            except REDIS_ERRORS as exc:
                if self.wakes.stopping.is_set():
                    raise
                failures += 1
                log.warning("starting: Redis failed (%s); retrying", exc)
                await asyncio.sleep(backoff_s(failures))

    async def _prepare(self) -> None:
        """Create consumer groups, requeue what an earlier process with this worker id left pending, register,
        and converge on the control state before taking the first request (a fleet paused stays paused)."""
        await self.control.load_scripts()  # the same scripts the worker's other handles run
        await warn_if_evicting(self.redis, f"worker {self.worker_id}")
        self.liveness.redis_run_id = await server_run_id(self.redis)
        await self.streams.ensure_groups(self.worker_id)
        holder = await self.reaper.hold_lock_to_start(self.worker_id)
        try:
            await self.reaper.reclaim(self.worker_id, backlog=False)
            await self.liveness.register()
        finally:
            with contextlib.suppress(*REDIS_ERRORS):  # held by this process until it expires; taken again on a retry
                await self.registry.release_reap_lock(self.worker_id, holder)

    def _status(self) -> WorkerStatus:
        engine = self.engine
        return self.state.status(engine, len(self.index), self._started_at, self.server.totals)

    def _load_after(self, released: list[InFlight]) -> tuple[str, int]:
        """(worker id, free slots) once `released` are out of the in-flight index; no slot is free while it
        takes nothing (paused, sleeping, fenced, draining)."""
        generation = sum(1 for r in released if r.generation and not r.removed)
        taking = self.state.resumed.is_set() and not self.state.fenced and not self.wakes.stopping.is_set()
        return self.worker_id, self.engine.capacity - self.index.generating + generation if taking else 0

    def _release(self, record: InFlight) -> None:
        self.index.remove(record)
        self.wakes.slot_freed.set()

    # --- control ----------------------------------------------------------------------------------------------

    async def _listen_loop(self) -> None:
        """Pub/sub nudges wake the control loop (control channel) or the weights loop (weights channel); a
        (re)subscription wakes both, since a nudge may have been lost."""
        pubsub = None
        failures = 0
        while not self.wakes.stopping.is_set():
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
                self.wakes.weights.set()
                continue
            if message["type"] == "message" and message["data"] == Nudge.CANCEL:
                self._cancel_nudged = True
            self.wakes.control.set()
            if message["type"] != "message":  # a (re)subscription: nudges may have been lost on both channels
                self.wakes.weights.set()
        if pubsub is not None:
            await pubsub.aclose()

    async def _control_loop(self) -> None:
        """Converge on every nudge and at every heartbeat interval (level-triggered); while a pause waits for
        in-flight requests, also whenever one finishes. Acknowledge each epoch once applied."""
        pending = False
        while not self.wakes.stopping.is_set():
            waits = [self.wakes.control.wait()] + ([self.index.changed.wait()] if pending else [])
            self.index.changed.clear()
            tasks = [asyncio.ensure_future(w) for w in waits]
            await asyncio.wait(
                tasks, timeout=self.settings.worker.heartbeat_interval_s, return_when=asyncio.FIRST_COMPLETED
            )
            for task in tasks:
                task.cancel()
            self.wakes.control.clear()
            if self.state.fenced or self.wakes.stopping.is_set():
                continue
            try:
                if self._cancel_nudged:
                    self._cancel_nudged = False
                    await self.converger.cancel_tombstoned()
                before = (self.state.applied_epoch, self.state.label)
                pending = not await self.converger.converge()
                if not pending and (self.state.applied_epoch, self.state.label) != before:
                    await self.liveness.beat(announce=True)
                if not pending and self.state.label == "stale":  # its heartbeat says so: placement skips it
                    await self.reaper.release_backlog(self.worker_id)  # its sessions' KV here is of old weights
            except REDIS_ERRORS as exc:
                log.warning("reading the control state failed (%s); retrying", exc)

    async def _weights_loop(self) -> None:
        """Follow weight sync orders and catch up to the committed version: on every nudge on the weights channel
        (the listen loop wakes it), and every heartbeat interval (a nudge may be lost)."""
        failures = 0
        while not self.wakes.stopping.is_set():
            self.wakes.weights.clear()
            try:
                if not self.state.fenced:
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
                await asyncio.wait_for(self.wakes.weights.wait(), self.settings.worker.heartbeat_interval_s)

    async def _sweep_loop(self) -> None:
        """Abort generations whose deadline passed, and repeat aborts that may have missed."""
        while not self.wakes.stopping.is_set():
            await self.index.cancel_all(self.index.expired(time.time()), "deadline")
            await self.index.reabort()
            await self.mover.check()
            await idle(self.wakes.stopping, SWEEP_INTERVAL_S)

    # --- shutdown -------------------------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Stop taking; let in-flight requests finish for `drain_timeout_s`; abort the rest, whose partial
        results go back to their producers (which retry them token-exact elsewhere); deregister.

        The loops are not cancelled mid-command (a pipeline cancelled mid-read can leave redis-py waiting
        forever): they see `wakes.stopping`, the publish loop a sentinel. If the engine died, unfinished requests
        are not aborted but left pending, and requeued here.
        """
        self.state.set_label("draining")
        with contextlib.suppress(*REDIS_ERRORS):
            await self.liveness.beat()  # placement skips a draining worker from now on
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
