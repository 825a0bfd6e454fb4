"""One worker process = one engine replica: takes requests from Redis Streams, runs them, publishes results."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollout_svc.config import Settings
from rollout_svc.errors import EngineDeadError, InvalidRequestError, ProtocolError
from rollout_svc.protocol import (
    DetokenizeRequest,
    ErrorCode,
    ErrorResult,
    Request,
    RolloutRequest,
    TokenizeRequest,
    TokenizeResult,
    Trajectory,
    WorkerStatus,
    decode,
    encode,
    reply_address,
)
from rollout_svc.registry import Registry
from rollout_svc.streams import Entry, RequestStreams, Requeue
from workers.engine import Engine

log = logging.getLogger("rollout_svc.worker")
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
REAP_LOCK_TTL_S = 60.0
RETRY_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)
DEADLINE_SWEEP_S = 0.1


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class Worker:
    """Serves one engine from the queue until `stop()` (or its engine dies).

    Example (what `python -m workers --engine echo` does)::

        worker = Worker(Settings(), EchoEngine())
        await worker.run()
    """

    def __init__(
        self, settings: Settings, engine: Engine, worker_id: str | None = None, drain_timeout_s: float = 5.0
    ) -> None:
        self.settings, self.engine = settings, engine
        self.worker_id = worker_id or default_worker_id()
        self.drain_timeout_s = drain_timeout_s
        self.keys = settings.keys
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._in_flight: dict[tuple[str, bytes], asyncio.Task[None]] = {}
        self._results: asyncio.Queue[tuple[Entry, str, bytes] | None] = asyncio.Queue()  # None: stop
        self._deadlines: dict[tuple[str, bytes], float] = {}  # in-flight request -> its deadline (unix s)
        self._expired: set[tuple[str, bytes]] = set()  # cancelled by the deadline sweeper
        self._fatal: BaseException | None = None
        self._served = 0
        self._started_at = time.time()

    def stop(self) -> None:
        """Ask the worker to drain and exit (signal-safe from the event loop thread)."""
        self._stopping.set()
        self._slot_freed.set()  # a take loop waiting for capacity sees the stop at once

    async def run(self) -> None:
        """Start the engine, serve until stopped, then drain. Raises `EngineDeadError` if the engine died."""
        self.redis = Redis.from_url(self.settings.redis_url, decode_responses=False)
        self.streams = RequestStreams(self.redis, self.keys, self.settings.session_ttl_s)
        self.registry = Registry(self.redis, self.keys, self.settings.heartbeat_ttl_s)
        try:
            await self._wait_for_redis()
            await self.engine.start()
            await self._prepare()
            loops = [self._take_loop(), self._publish_loop(), self._heartbeat_loop(), self._deadline_loop()]
            tasks = [asyncio.create_task(self._guarded(loop)) for loop in loops]
            log.info("worker %s serving %s (capacity %d)", self.worker_id, self.engine.model_name, self.engine.capacity)
            await self._stopping.wait()
            await self._shutdown(tasks)
        finally:
            await self.engine.close()
            await self.redis.aclose()
        if self._fatal is not None:
            raise self._fatal

    async def _guarded(self, loop: Coroutine[Any, Any, None]) -> None:
        """Run one of the worker's loops; if it fails unexpectedly, stop the whole worker (crash-only).

        A worker that heartbeats but no longer takes or publishes would hold its requests forever;
        stopping requeues them, and a process manager starts the worker again.
        """
        try:
            await loop
        except Exception as exc:
            log.exception("a worker loop failed; stopping so that this worker's requests are requeued")
            self._fatal = self._fatal or exc
            self.stop()

    async def _wait_for_redis(self) -> None:
        """Block until Redis answers, saying so every few seconds: a worker may start before its Redis."""
        failures = 0
        while True:
            try:
                await self.redis.ping()
                return
            except REDIS_ERRORS as exc:
                failures += 1
                if failures % 10 == 1:
                    log.warning("waiting for Redis at %s (%s); check --redis-url", self.settings.redis_url, exc)
                await asyncio.sleep(0.5)

    async def _prepare(self) -> None:
        """Create consumer groups and requeue what an earlier process with this worker id left pending."""
        await self.streams.load_scripts()
        await self._ensure_groups()
        await self._reclaim(self.worker_id)
        await self.registry.heartbeat(self._status())

    def _status(self, state: str = "serving") -> WorkerStatus:
        return WorkerStatus(
            worker_id=self.worker_id,
            state=state,  # type: ignore[arg-type]
            engine=type(self.engine).__name__,
            model=self.engine.model_name,
            capacity=self.engine.capacity,
            in_flight=len(self._in_flight),
            served=self._served,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self._started_at,
            heartbeat_at=time.time(),
        )

    # --- taking requests ----------------------------------------------------------------------------------

    async def _take_loop(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            free = self.engine.capacity - len(self._in_flight)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                entries = await self.streams.read(self.worker_id, free, self.settings.read_block_ms)
                failures = 0
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self._ensure_groups()  # Redis lost its data (restart without persistence)
                continue
            except REDIS_ERRORS as exc:
                failures += 1
                log.warning("reading requests failed (%s); retrying", exc)
                await asyncio.sleep(RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1])
                continue
            for entry in entries:
                task = asyncio.create_task(self._serve(entry))
                self._in_flight[(entry.stream, entry.entry_id)] = task
                task.add_done_callback(lambda _t, key=(entry.stream, entry.entry_id): self._done(key))
            if entries:
                await asyncio.sleep(0)  # start the new requests before sending the next read

    async def _ensure_groups(self) -> None:
        await self.streams.ensure_group(self.keys.requests)
        await self.streams.ensure_group(self.keys.pinned_requests(self.worker_id))

    def _done(self, key: tuple[str, bytes]) -> None:
        self._in_flight.pop(key, None)
        self._slot_freed.set()

    # --- serving one request ------------------------------------------------------------------------------

    async def _serve(self, entry: Entry) -> None:
        """Serve one entry; while Redis is away (pinning, dead-lettering), retry rather than drop it.

        Cancelled: the entry stays pending and is requeued at exit.
        """
        taken_at = time.time()
        for failures in itertools.count(1):
            try:
                return await self._serve_once(entry, taken_at)
            except REDIS_ERRORS as exc:
                log.warning("serving %s failed (%s); retrying", entry.entry_id, exc)
                await asyncio.sleep(RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1])

    async def _serve_once(self, entry: Entry, taken_at: float) -> None:
        """Run one entry and queue its result, or dead-letter it."""
        try:
            request = decode(entry.payload)
        except ProtocolError as exc:
            await self._dead_letter(entry, "undecodable", str(exc))
            return
        if entry.deliveries > self.settings.max_deliveries:
            await self._dead_letter(entry, "max_deliveries", f"delivered {entry.deliveries} times without a result")
            return
        if getattr(request, "session_id", None) and entry.stream == self.keys.requests:
            # A session's request in the shared stream (no live worker when it was sent, or requeued from a
            # dead one): pin the session here, unless a live worker holds it already.
            await self.streams.pin_session(request.session_id, self.worker_id)
        key = (entry.stream, entry.entry_id)
        if request.deadline is not None:
            self._deadlines[key] = request.deadline
        try:
            result = await self._run(request, taken_at)
        except asyncio.CancelledError:
            if key not in self._expired:
                raise  # shutdown: the entry stays pending and is requeued
            result = self._error(request, "deadline_exceeded", "the deadline passed during generation")
        except EngineDeadError as exc:
            self._fatal = exc
            self.stop()
            return
        finally:
            self._deadlines.pop(key, None)
            self._expired.discard(key)
        self._results.put_nowait((entry, request.reply_to, encode(result)))

    async def _run(self, request: Request, taken_at: float) -> Trajectory | ErrorResult | TokenizeResult:
        if request.deadline is not None and request.deadline <= time.time():
            return self._error(request, "deadline_exceeded", "the deadline passed before a worker took the request")
        try:
            return await self._dispatch(request, taken_at)
        except InvalidRequestError as exc:
            return self._error(request, "invalid_request", str(exc))
        except EngineDeadError:
            raise
        except Exception as exc:  # one bad request never takes the worker down
            log.exception("request %s failed", request.request_id)
            return self._error(request, "engine_error", f"{type(exc).__name__}: {exc}", recoverable=True)

    async def _dispatch(self, request: Request, taken_at: float) -> Trajectory | TokenizeResult:
        if isinstance(request, TokenizeRequest):
            if request.messages is not None:
                ids = await self.engine.chat_prompt([m.model_dump() for m in request.messages])
            else:
                ids = await self.engine.tokenize(request.text or "", request.add_special_tokens)
            return TokenizeResult(request_id=request.request_id, token_ids=ids, worker_id=self.worker_id)
        if isinstance(request, DetokenizeRequest):
            text = await self.engine.detokenize(request.token_ids, request.skip_special_tokens)
            return TokenizeResult(request_id=request.request_id, text=text, worker_id=self.worker_id)
        return await self._generate(request, taken_at)

    async def _generate(self, request: RolloutRequest, taken_at: float) -> Trajectory:
        if request.prompt_token_ids is not None:
            prompt = request.prompt_token_ids
        else:
            prompt = await self.engine.chat_prompt([m.model_dump() for m in request.messages or []])
        started = time.time()
        completion = await self.engine.generate(request.request_id, prompt, request.sampling_params)
        self._served += 1
        return Trajectory(
            request_id=request.request_id,
            session_id=request.session_id,
            group_id=request.group_id,
            prompt_token_ids=completion.prompt_token_ids,
            completion_token_ids=completion.completion_token_ids,
            logprobs=completion.logprobs,
            finish_reason=completion.finish_reason,  # type: ignore[arg-type]
            text=completion.text,
            worker_id=self.worker_id,
            queue_time_s=max(0.0, taken_at - request.submitted_at),
            generation_time_s=time.time() - started,
        )

    def _error(self, request: Request, code: ErrorCode, message: str, recoverable: bool = False) -> ErrorResult:
        return ErrorResult(
            request_id=request.request_id, code=code, message=message, recoverable=recoverable, worker_id=self.worker_id
        )

    async def _dead_letter(self, entry: Entry, code: ErrorCode, message: str) -> None:
        """Move an entry to the dead-letter stream; its producer, if it can be named, gets an error result."""
        log.warning("dead letter %s %s: %s", entry.stream, entry.entry_id, message)
        address = reply_address(entry.payload)
        reply = None
        if address is not None:
            error = ErrorResult(request_id=address[0], code=code, message=message, worker_id=self.worker_id)
            reply = (address[1], encode(error))
        await self.streams.dead_letter(entry, code, self.worker_id, self.settings.dead_letter_maxlen, reply)

    async def _deadline_loop(self) -> None:
        """Cancel generations whose deadline passed (checked every DEADLINE_SWEEP_S, not a timer per request)."""
        while not self._stopping.is_set():
            now = time.time()
            for key, deadline in list(self._deadlines.items()):
                task = self._in_flight.get(key)
                if deadline <= now and task is not None and key not in self._expired:
                    self._expired.add(key)
                    task.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), DEADLINE_SWEEP_S)

    # --- publishing results ---------------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        """Batch whatever results are ready into one MULTI; under load this amortises the round trip."""
        while True:
            batch = [await self._results.get()]
            while not self._results.empty():
                batch.append(self._results.get_nowait())
            ready = [item for item in batch if item is not None]
            if ready:
                await self._publish(ready, attempts=3 if self._stopping.is_set() else None)
            if len(ready) < len(batch):
                return  # the stop sentinel: everything before it is published

    async def _publish(self, batch: list[tuple[Entry, str, bytes]], attempts: int | None = None) -> None:
        """Publish + ack; retried while Redis is away (the entries stay pending, so a crash loses nothing)."""
        failures = 0
        while True:
            try:
                results = [(reply_to, payload) for _, reply_to, payload in batch]
                await self.streams.publish(results, [entry for entry, _, _ in batch], self.settings.results_ttl_s)
                return
            except REDIS_ERRORS as exc:
                failures += 1
                if attempts is not None and failures >= attempts:
                    raise
                log.warning("publishing %d results failed (%s); retrying", len(batch), exc)
                await asyncio.sleep(RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1])

    # --- heartbeat and reclaiming dead workers' requests ----------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.registry.heartbeat(self._status())
                for dead_worker_id in await self.registry.dead_workers():
                    if await self.registry.try_reap_lock(dead_worker_id, self.worker_id, REAP_LOCK_TTL_S):
                        moved = await self._reclaim(dead_worker_id)
                        await self.registry.forget(dead_worker_id)
                        log.warning("worker %s is dead: requeued %d of its requests", dead_worker_id, moved)
            except REDIS_ERRORS as exc:
                log.warning("heartbeat failed (%s); retrying", exc)
            except ResponseError as exc:
                log.warning("heartbeat: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.settings.heartbeat_interval_s)

    async def _reclaim(self, worker_id: str) -> int:
        """Requeue what `worker_id` holds: its pending entries in both streams and its pinned backlog.

        Sessions are re-placed on live workers. Entries already delivered `max_deliveries` times become
        dead letters. Each batch is requeued and acked in one MULTI, so a crash here loses nothing.
        """
        pinned = self.keys.pinned_requests(worker_id)
        moved = 0
        for stream in (self.keys.requests, pinned):
            while entries := await self.streams.pending_of(stream, worker_id):
                moved += await self._requeue(entries)
        if worker_id != self.worker_id:
            while entries := await self.streams.undelivered(pinned):
                moved += await self._requeue(entries)
            await self.redis.delete(pinned)
            await self.streams.forget_consumer(self.keys.requests, worker_id)
        return moved

    async def _requeue(self, entries: list[Entry]) -> int:
        items, done = [], []
        for entry in entries:
            if entry.deliveries >= self.settings.max_deliveries:
                message = f"delivered {entry.deliveries} times; each worker that took it died"
                await self._dead_letter(entry, "max_deliveries", message)
                continue
            items.append(Requeue(entry.payload, _session_id(entry.payload), entry.deliveries))
            done.append(entry)
        await self.streams.requeue(items, done)
        return len(items)

    # --- shutdown -------------------------------------------------------------------------------------------

    async def _shutdown(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Stop taking; let in-flight requests finish for `drain_timeout_s`; requeue the rest; deregister.

        The loops are not cancelled mid-command (a pipeline cancelled mid-read can leave redis-py
        waiting forever): the take and heartbeat loops see `_stopping`, the publish loop a sentinel.
        """
        take, publish, heartbeat, deadlines = tasks
        await asyncio.wait([take], timeout=self.settings.read_block_ms / 1000 + 5)
        if self._fatal is None and self._in_flight:
            await asyncio.wait(list(self._in_flight.values()), timeout=self.drain_timeout_s)
        for task in list(self._in_flight.values()):
            task.cancel()  # the entry stays pending: requeued below
        if self._in_flight:
            await asyncio.wait(list(self._in_flight.values()), timeout=5)
        self._results.put_nowait(None)
        await asyncio.wait([publish, heartbeat, deadlines], timeout=30)
        try:
            # Deregister before draining the pinned stream: placement then no longer picks this worker.
            await self.registry.deregister(self.worker_id)
            moved = await self._reclaim(self.worker_id) + await self._drain_pinned()
            log.info("worker %s stopped; requeued %d requests", self.worker_id, moved)
        except REDIS_ERRORS as exc:
            log.error("could not deregister (%s): live workers will requeue this worker's requests", exc)

    async def _drain_pinned(self) -> int:
        pinned = self.keys.pinned_requests(self.worker_id)
        moved = 0
        while entries := await self.streams.undelivered(pinned):
            moved += await self._requeue(entries)
        await self.redis.delete(pinned)
        await self.streams.forget_consumer(self.keys.requests, self.worker_id)
        return moved


def _session_id(payload: bytes) -> str | None:
    try:
        request = decode(payload)
    except ProtocolError:
        return None  # requeued as is; the worker that takes it dead-letters it
    return getattr(request, "session_id", None)
