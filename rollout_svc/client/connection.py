"""A producer's connection: submits requests, routes their results, retries aborted ones token-exact, cancels.

One `Connection` per event loop holds two tasks: the submitter sends whatever batches (and cancels) are
waiting in one pipelined round trip, and the reader routes each result to its call by request id. A call's
request cut by a pause in abort mode (or its worker shutting down) comes back as a partial trajectory; the
reader resubmits it under a new request id with its tokens so far (a `Continuation`) and the remaining deadline,
and the caller only ever sees the merged trajectory. An explicit abort, a cancel and a deadline are final.

Requests go to shards (`rollout_svc.fleet`): a session's by rendezvous hashing of its id over the live shards, the
others round robin over the live shards weighted by their live workers. Each shard has its own results stream for
this producer and its own reader task. One Redis is the one-shard case.

A request's life here (the `Attempt` record of each, one map by request id) is in `rollout_svc.client.lifecycle`,
with the rules deciding a retry, a regeneration and the caller's answer; this module applies them.

A watcher task per shard watches its Redis: a new server `run_id` means Redis restarted or failed over, and may have
come back without its recent writes (a restart without persistence, a replica promoted before it had them). The
connection then asks Redis which of the requests it awaits there it still holds and resubmits the rest under the same
ids, so no caller waits out its timeout for a request Redis forgot; a request both answered and resubmitted is
answered once. A shard whose Redis stays away past `redis_outage_s` fails the requests awaited there
(`ErrorResult` code `shard_unavailable`); the other shards go on, and new requests go to the shards still live.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from rollout_svc.client.calls import Call, ClientStats
from rollout_svc.client.lifecycle import Attempt, cut_fields, final_fields, regeneration_of, retry_of
from rollout_svc.config import Settings, tune_gc
from rollout_svc.connections.urls import retry_while_away, server_run_id
from rollout_svc.dataplane.streams import ENQUEUE_CHUNK, Enqueue, Placed, RequestStreams
from rollout_svc.errors import ProtocolError, QueueFullError
from rollout_svc.fleet import Fleet, FleetControl, FleetRegistry, ShardLink, rendezvous
from rollout_svc.keys import PAYLOAD_FIELD
from rollout_svc.protocol import (
    ErrorResult,
    Request,
    Result,
    RolloutRequest,
    Trajectory,
    TrajectoryChunk,
    decode,
    encode,
    unrun_trajectory,
)

log = logging.getLogger("rollout_svc.client")
REDIS_CHECK_S = 1.0  # how often a connection asks each shard's Redis for its run_id, and whether workers live there
# Loop turns a shard's reader yields after routing results, before it sends its next read: the callers it woke run in
# the first, and what they wrote in it goes out in the second where writes are joined at the end of a turn (`serve`'s
# responses: rollout_svc.api.http). With one turn the next read's write (and Redis's wake-up) came before serve's
# response (a write and a wake-up of Redis in the way of every answer at 1 in flight: docs/benchmarks.md, (i)).
CALLER_TURNS = 2


@dataclass
class _EnqueueOp:
    items: list[Enqueue]
    limit: int  # -1: no admission limit (a retry continues admitted work)
    attempts: list[Attempt]  # the attempt of each item
    shards: list[str]  # the shard of each item
    done: asyncio.Future[None]


@dataclass
class _CancelOp:
    request_ids: list[str] = field(default_factory=list)


@dataclass
class _CutOp:
    request_ids: list[str] = field(default_factory=list)


class Connection:
    """What a client holds while connected, bound to one event loop: a link per shard (its Redis, this producer's
    results stream there, a reader and a watcher task), the submitter task and the shard watcher task.
    `await start()` before the first submit."""

    def __init__(self, settings: Settings, producer_id: str | None = None) -> None:
        """`producer_id`: a stable name whose results stream outlives this connection (a batch job that may be run
        again re-attaches to it): results are read from its start, never deleted by the reader, and the stream is
        left on close (its owner deletes it). Default: a fresh id, its stream consumed and deleted on close."""
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.fleet = Fleet(settings)
        self.redis = self.fleet.router  # the keys outside every shard
        self.registry = FleetRegistry(self.fleet)
        self.control = FleetControl(self.fleet)
        self.named = producer_id is not None
        self.producer_id = producer_id or uuid.uuid4().hex
        # Request ids of a named producer carry a per-connection nonce: a late answer to an earlier connection's
        # retry must not match this one's.
        self._id_prefix = f"{self.producer_id}-{uuid.uuid4().hex[:8]}" if self.named else self.producer_id
        self._results_in: dict[str, str] = {}  # shard -> this producer's results stream there (a `reply_to`)
        self._shard_of_results: dict[str, str] = {}  # the other way round, for the shards asked for so far
        self._rotation: Iterator[str] = iter(())  # unkeyed requests' shards, round robin
        self._rotation_of: tuple[str, ...] = ()  # the live shards (one entry per live worker) it cycles through
        self.attempts: dict[str, Attempt] = {}  # request id -> the attempt awaited (or being cancelled) under it
        self.stats = ClientStats()
        self.committed_version = 0  # the fleet's committed weight version, read with every batch of results
        self.adapters: dict[str, int] = {}  # adapter -> its newest version, read likewise for those requests named
        self._request_numbers = itertools.count()
        self._closing = False
        self._closed = asyncio.Event()
        self._reread: set[str] = set()  # shards whose reader goes back to the start of its stream (see `attach`)
        self.outbox: asyncio.Queue[_EnqueueOp | _CancelOp | _CutOp | None] = asyncio.Queue()
        self._submitting: dict[str, RequestStreams] = {}  # shard -> the submitter's own connection there
        self.tasks: dict[str, list[asyncio.Task[None]]] = {}  # shard -> its reader and watcher
        self.submitter = asyncio.create_task(self._submit_ops())
        self.shard_watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Find the shards and whether workers live in each, start their tasks. Raises the Redis error if no shard
        can be reached."""
        tune_gc(self.settings.client.gc_young_threshold)
        await self.fleet.refresh()
        if not self.fleet.links:
            raise RedisConnectionError(f"no shard of {self.settings.redis_url} could be reached")
        await self._check_shards()
        if self.shard_watcher is None:
            self.shard_watcher = asyncio.create_task(self._watch_shards())

    async def _check_shards(self) -> None:
        for link in list(self.fleet.links.values()):
            if link.name not in self.tasks:
                self.tasks[link.name] = [
                    asyncio.create_task(self._read_results(link)),
                    asyncio.create_task(self._watch_redis(link)),
                ]
            try:
                await self.fleet.check(link)
            except (RedisError, OSError):  # away: no new request goes there; the reader counts the outage
                link.workers = 0

    async def _watch_shards(self) -> None:
        """Every `REDIS_CHECK_S`: shards registered since, and which have live workers."""
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), REDIS_CHECK_S)
            if self._closing:
                return
            await self.fleet.refresh()
            await self._check_shards()

    def shard_for(self, session_id: str | None) -> str:
        """The shard a request goes to: a session's by rendezvous hashing over the live shards (all known shards if
        none is live), an unkeyed one round robin over the live shards, one turn per live worker."""
        live = self.fleet.live() or sorted(self.fleet.links) or [self.settings.shard]
        if len(live) == 1:
            return live[0]
        if session_id:
            return rendezvous(session_id, live)
        weighted = tuple(n for n in live for _ in range(max(1, self.fleet.links[n].workers)))
        if weighted != self._rotation_of:
            self._rotation_of, self._rotation = weighted, itertools.cycle(weighted)
        return next(self._rotation)

    def reply_to(self, session_id: str | None) -> str:
        """The `reply_to` of a new request: this producer's results stream in the shard it goes to (`shard_for`); a
        request is enqueued to the shard its `reply_to` names."""
        return self._results_of(self.shard_for(session_id))

    def _results_of(self, shard: str) -> str:
        results = self._results_in.get(shard)
        if results is None:  # a shard linked since it was last asked for
            results = self.fleet.links[shard].keys.results(self.producer_id)
            self._results_in[shard], self._shard_of_results[results] = results, shard
        return results

    def _new_attempt(self, request: RolloutRequest) -> tuple[str, str]:
        return self.new_id(), self.reply_to(request.session_id)

    def _addressed(self, request: Request) -> Request:
        """`request` to the shard chosen for it now (a copy if that changes its `reply_to`)."""
        reply_to = self.reply_to(request.session_id if isinstance(request, RolloutRequest) else None)
        return request if request.reply_to == reply_to else request.model_copy(update={"reply_to": reply_to})

    def session_streams(self, session_id: str) -> RequestStreams:
        """The data plane of the shard a session's requests go to."""
        return self.fleet.links[self.shard_for(session_id)].streams

    def new_id(self) -> str:
        """A request (or group) id unique across producers: this producer's id and a counter."""
        return f"{self._id_prefix}-{next(self._request_numbers)}"

    def new_call(self, requests: Sequence[Request], chunks: bool = False) -> Call:
        return Call(requests, self.loop, chunks)

    async def submit(self, call: Call) -> None:
        """Await a call's requests' results from now on, and enqueue them (admission-checked, all or nothing).

        Raises `QueueFullError`, or the Redis error if Redis is away. Whatever it raises, `cancel(call)` is safe
        (and needed, if a batch larger than a chunk was refused after its first chunks went in).
        """
        attempts = self._await(call)
        try:
            await self._enqueue(attempts, self.settings.client.max_queued_requests)
        except QueueFullError:
            if len(attempts) <= ENQUEUE_CHUNK and len({a.shard for a in attempts}) == 1:  # nothing was sent
                self.forget(call)
                call.remaining = 0
            raise

    def attach(self, call: Call) -> None:
        """Await a call's requests' results without enqueuing them: they were enqueued by an earlier connection of
        this named producer, and their results come to the same stream, which the reader then reads again from
        its start (a named producer's results are never deleted, so one that arrived before is found)."""
        self._await(call)
        self._reread = set(self.fleet.links)

    def _await(self, call: Call) -> list[Attempt]:
        attempts = [Attempt(call, i, position.request) for i, position in enumerate(call.positions)]
        for attempt in attempts:
            if isinstance(attempt.request, RolloutRequest) and attempt.request.adapter is not None:
                self.adapters.setdefault(attempt.request.adapter, 0)
        self.attempts.update((a.request.request_id, a) for a in attempts)
        return attempts

    def _enqueue(self, attempts: Sequence[Attempt], limit: int) -> asyncio.Future[None]:
        """Hand the attempts' requests to the submitter, each to the shard its `reply_to` names (one of another
        connection's is addressed anew). The future resolves once Redis took them all."""
        done = self.loop.create_future()
        items, shards = [], []
        for attempt in attempts:
            shard = self._shard_of_results.get(attempt.request.reply_to)
            if shard is None:
                attempt.request = self._addressed(attempt.request)
                shard = self._shard_of_results[attempt.request.reply_to]
            attempt.shard = shard
            attempt.sending += 1
            items.append(_enqueue_item(attempt.request))
            shards.append(shard)
        self.outbox.put_nowait(_EnqueueOp(items, limit, list(attempts), shards, done))
        return done

    def cancel(self, call: Call) -> None:
        """Stop awaiting a call's unfinished requests and cancel them on the workers (queued or in flight)."""
        ids = [call.positions[i].attempt_id for i in call.unfinished()]
        for request_id in ids:
            if (attempt := self.attempts.get(request_id)) is not None:
                attempt.cancelling = True  # kept, with its shard and placement, until the cancel is sent
        if ids:
            self.stats.cancelled += len(ids)
            self.outbox.put_nowait(_CancelOp(ids))

    def cut(self, call: Call) -> None:
        """End a call's unfinished positions early, as partial rollouts (its completion target was met): each current
        attempt is cancelled on the workers (in flight: aborted, it answers with its tokens so far; queued: deleted
        and answered here, unrun; taken later: answered unrun by its worker), and whatever answer comes is final,
        `abort_cause="partial"` if it was cut (`cut_fields`). The call's `done` resolves once every answer came."""
        ids = []
        for index in call.unfinished():
            position = call.positions[index]
            if not position.cutting:
                position.cutting = True
                ids.append(position.attempt_id)
        if ids:
            self.outbox.put_nowait(_CutOp(ids))

    def forget(self, call: Call) -> None:
        """Stop awaiting a call's requests (those being cancelled stay until their cancel is sent)."""
        for position in call.positions:
            attempt = self.attempts.get(position.attempt_id)
            if attempt is not None and not attempt.cancelling:
                del self.attempts[position.attempt_id]

    async def _submit_ops(self) -> None:
        """The single submitter: concurrent callers' batches go to Redis together, in one round trip; cancels
        follow, after the enqueues they may refer to.

        This bounds the connections a busy producer (the API, an open-loop benchmark) opens to two.
        """
        while True:
            ops = [await self.outbox.get()]
            while not self.outbox.empty():
                ops.append(self.outbox.get_nowait())
            enqueues = [op for op in ops if isinstance(op, _EnqueueOp)]
            if enqueues:
                await self._run_enqueues(enqueues)
            cancelled = [i for op in ops if isinstance(op, _CancelOp) for i in op.request_ids]
            if cancelled:
                await self._cancel(cancelled)
            cut = [i for op in ops if isinstance(op, _CutOp) for i in op.request_ids]
            if cut:
                await self._cut(cut)
            if None in ops:
                for streams in self._submitting.values():
                    with contextlib.suppress(RedisError, OSError):
                        await streams.aclose()
                return

    def _submit_streams(self, link: ShardLink) -> RequestStreams:
        """The submitter's own connection to a shard (`RequestStreams.on_own_connection`: enqueues are the request's
        hot path), anew for a link opened anew."""
        streams = self._submitting.get(link.name)
        if streams is None or streams.redis is not link.redis:
            streams = self._submitting[link.name] = link.streams.on_own_connection()
        return streams

    async def _cancel(self, request_ids: list[str]) -> None:
        """Cancel in each request's shard (in every shard, for one not yet placed)."""
        by_shard: dict[str, list[tuple[str, Placed | None]]] = {}
        for request_id in request_ids:
            attempt = self.attempts.pop(request_id, None)
            shard, placed = (attempt.shard, attempt.placed) if attempt is not None else (None, None)
            for name in [shard] if shard in self.fleet.links else list(self.fleet.links):
                by_shard.setdefault(name, []).append((request_id, placed))
        try:
            await self.fleet.each(lambda link: link.control.cancel(by_shard[link.name]), by_shard)
        except (RedisError, OSError) as exc:  # the workers' deadlines still stop them
            log.warning("cancelling %d requests failed (%s)", len(request_ids), exc)

    async def _cut(self, request_ids: list[str]) -> None:
        """Cancel the attempts being cut, in their shards (in every shard, for one not yet placed); answer those
        deleted from a queue here, unrun, with `abort_cause="partial"`. Redis away: the rest answer as they finish."""
        by_shard: dict[str, list[tuple[str, Placed | None]]] = {}
        for request_id in request_ids:
            if (attempt := self.attempts.get(request_id)) is None:
                continue  # answered meanwhile
            names = [attempt.shard] if attempt.shard in self.fleet.links else list(self.fleet.links)
            for name in names:
                by_shard.setdefault(name, []).append((request_id, attempt.placed))
        try:
            swept = await self.fleet.each(lambda link: link.control.cancel(by_shard[link.name]), by_shard)
        except (RedisError, OSError) as exc:
            log.warning("cutting %d requests failed (%s); they end as they finish", len(request_ids), exc)
            return
        deleted = set().union(*swept.values())
        for request_id in request_ids:
            attempt = self.attempts.get(request_id)
            if attempt is None or attempt.placed is None or not isinstance(attempt.request, RolloutRequest):
                continue
            if (attempt.placed.stream, attempt.placed.entry_id) in deleted:
                del self.attempts[request_id]
                attempt.call.set(attempt.index, self._answer(attempt, unrun_trajectory(attempt.request, "partial")))

    async def _run_enqueues(self, ops: list[_EnqueueOp]) -> None:
        """Enqueue the ops' batches in one round trip per shard, the shards at once. While a shard's Redis is away
        (restarting, failing over) this retries for `redis_outage_s`; a batch whose reply was lost may then be
        enqueued twice, which delivers it twice (at-least-once) and is answered once (the reader drops the
        duplicate result). An op fails with the first error of any of its shards (the others' part was sent: the
        caller's cancel sweeps it)."""
        parts: dict[str, list[tuple[int, list[int]]]] = {}  # shard -> (op index, positions of its items there)
        for i, op in enumerate(ops):
            positions: dict[str, list[int]] = {}
            for j, shard in enumerate(op.shards):
                positions.setdefault(shard, []).append(j)
            for shard, js in positions.items():
                parts.setdefault(shard, []).append((i, js))
        placed: list[list[Placed | None]] = [[None] * len(op.items) for op in ops]
        errors: list[BaseException | None] = [None] * len(ops)

        async def send(shard: str, shard_parts: list[tuple[int, list[int]]]) -> None:
            link = self.fleet.links[shard]
            batches = [[ops[i].items[j] for j in js] for i, js in shard_parts]
            limits = [ops[i].limit for i, _ in shard_parts]
            outcomes: list[Any]
            try:
                outcomes = await retry_while_away(
                    lambda: self._submit_streams(link).enqueue_batches(batches, limits),
                    self.settings.client.redis_outage_s,
                    f"enqueue (shard {shard})",
                    stop=lambda: self._closing,
                )
            except Exception as exc:  # Redis away past the outage, or refused: every waiting caller hears it
                outcomes = [exc] * len(shard_parts)
            for (i, js), outcome in zip(shard_parts, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    errors[i] = errors[i] or outcome
                    continue
                for j, where in zip(js, outcome, strict=True):
                    placed[i][j] = where

        if len(parts) == 1:  # one shard (one Redis): no task to make
            [(shard, shard_parts)] = parts.items()
            await send(shard, shard_parts)
        else:
            await asyncio.gather(*(send(shard, shard_parts) for shard, shard_parts in parts.items()))
        for op, op_placed, error in zip(ops, placed, errors, strict=True):
            for attempt, where in zip(op.attempts, op_placed, strict=True):
                attempt.sending -= 1
                if where is not None:  # kept on an attempt answered meanwhile too: harmless, it is out of the map
                    attempt.placed = where
            if op.done.done():
                continue
            if error is not None:
                op.done.set_exception(error)
            else:
                op.done.set_result(None)

    async def _read_results(self, link: ShardLink) -> None:
        """A shard's reader: routes each result to its call by request id, ignores duplicates."""
        streams = link.streams.on_own_connection()  # the results' hot path: a connection of its own, used directly
        try:
            await self._read_results_on(link, streams)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await streams.aclose()

    async def _read_results_on(self, link: ShardLink, streams: RequestStreams) -> None:
        last_id, failures = b"0-0", 0
        done_ids: list[bytes] = []
        results = link.keys.results(self.producer_id)
        while not self._closing:
            if link.name in self._reread:
                last_id = b"0-0"
                self._reread.discard(link.name)
            try:
                records, committed, adapters = await streams.read_results(
                    results, last_id, done_ids, self.settings.read_block_ms, link.keys.state, sorted(self.adapters)
                )
                self.adapters.update(adapters)
                done_ids, failures = [], 0
                link.away_since = None
                self.committed_version = max(self.committed_version, committed)
            except (RedisError, OSError) as exc:  # the reader must outlive any Redis trouble
                failures += 1
                if link.away_since is None:
                    link.away_since = time.monotonic()
                if failures == 1:
                    log.warning("reading results from shard %s failed (%s); retrying", link.name, exc)
                if time.monotonic() - link.away_since > self.settings.client.redis_outage_s:
                    self._fail_shard(link, exc)
                await asyncio.sleep(min(2.0, 0.1 * 2**failures))
                continue
            for entry_id, fields in records:
                last_id = entry_id
                if not self.named:  # a named producer's results stay until its owner deletes the stream
                    done_ids.append(entry_id)
                self._route(fields.get(PAYLOAD_FIELD, b""))
            if records:
                for _ in range(CALLER_TURNS):  # the callers just woken run, and answer, before the next read is sent
                    await asyncio.sleep(0)

    def _route(self, payload: bytes) -> None:
        try:
            result: Result | TrajectoryChunk = decode(payload, self.committed_version)
        except ProtocolError as exc:
            log.error("dropped an undecodable result: %s", exc)
            return
        attempt = self.attempts.get(result.request_id)
        if attempt is None or attempt.cancelling:
            if not isinstance(result, TrajectoryChunk):
                self.stats.duplicates += 1  # at-least-once delivery: a requeued request may answer twice
            return
        if isinstance(result, TrajectoryChunk):  # part of a streaming request, before its result
            attempt.call.chunk(attempt.index, result)
            return
        del self.attempts[result.request_id]
        if isinstance(result, Trajectory):
            answer = self._answer(attempt, result)
            if answer is None:
                return
            result = answer
        attempt.call.set(attempt.index, result)

    def _answer(self, attempt: Attempt, result: Trajectory) -> Trajectory | None:
        """What the caller gets of an attempt's trajectory, merged with the attempts before it; None if it was retried
        (cut by a pause or a shutdown) or regenerated (staler than `max_staleness`) instead."""
        call, index, now = attempt.call, attempt.index, time.time()
        position = call.positions[index]
        request = position.request
        if position.cutting:  # cut by a completion target: whatever came is final
            final = self._adapter_staleness(call.merged(index, result, **cut_fields(request, result)))
            if final.staleness is not None:
                self.stats.staleness[final.staleness] += 1
            return final
        retry = retry_of(request, result, self.settings.client, now, self._new_attempt)
        if retry is not None:
            call.renew(index, retry.request_id, result)
            self.stats.retries += 1
            # Not enqueued (Redis away): it ends with what its request had generated.
            self._resubmit(call, index, retry, lambda: call.end_with_partial(index))
            return None
        final = self._adapter_staleness(call.merged(index, result, **final_fields(request, result)))
        if final.staleness is not None:
            self.stats.staleness[final.staleness] += 1
        again = regeneration_of(request, final, self.settings.client, position.regenerations, now, self._new_attempt)
        if again is None:
            return final
        call.renew(index, again.request_id, None)
        self.stats.regenerated += 1
        # Not enqueued (Redis away): the caller gets the stale trajectory, marked.
        self._resubmit(call, index, again, lambda: call.set(index, final))
        return None

    def _adapter_staleness(self, final: Trajectory) -> Trajectory:
        """`final` with its `adapter_staleness`: its adapter's newest version as last read minus its first token's."""
        newest = self.adapters.get(final.adapter or "", 0)
        if not final.adapter_versions or not newest:
            return final
        return final.model_copy(update={"adapter_staleness": max(0, newest - final.adapter_versions[0][0])})

    def _resubmit(self, call: Call, index: int, request: RolloutRequest, failed: Callable[[], None]) -> None:
        """Await position `index` of `call` under `request` from now on (a retry, or a regeneration), and enqueue it
        past admission (it continues admitted work). `failed()` ends the position if it could not be enqueued."""
        attempt = self.attempts[request.request_id] = Attempt(call, index, request)

        def enqueued(future: asyncio.Future[None]) -> None:
            if future.cancelled() or future.exception() is None:
                return
            log.warning("could not resubmit %s (%s)", request.request_id, future.exception())
            if self.attempts.get(request.request_id) is attempt and not attempt.cancelling:
                del self.attempts[request.request_id]
                failed()

        self._enqueue([attempt], -1).add_done_callback(enqueued)

    def _awaited_in(self, link: ShardLink) -> list[Attempt]:
        """The attempts awaited here that were sent to `link`'s shard."""
        return [a for a in self.attempts.values() if a.shard == link.name and not a.cancelling]

    def _fail_shard(self, link: ShardLink, exc: BaseException) -> None:
        """Answer every request awaited in `link`'s shard with a `shard_unavailable` error: its Redis has been away
        for longer than `redis_outage_s`. Those requests may still run if it comes back; their answers are then
        dropped as duplicates."""
        lost = self._awaited_in(link)
        if not lost:
            return
        away_s = time.monotonic() - (link.away_since or time.monotonic())
        message = (
            f"shard {link.name}: its Redis primary has not answered for {away_s:.0f} s ({exc}); the request may be "
            "lost: send it again (new requests go to the shards still live)"
        )
        log.error("failing %d requests awaited in shard %s: %s", len(lost), link.name, message)
        for attempt in lost:
            del self.attempts[attempt.request.request_id]
            call, index = attempt.call, attempt.index
            request_id = call.positions[index].request.request_id
            call.set(
                index, ErrorResult(request_id=request_id, code="shard_unavailable", message=message, recoverable=True)
            )

    async def _watch_redis(self, link: ShardLink) -> None:
        """Ask a shard's Redis for its run_id every `REDIS_CHECK_S`; when it changes, resubmit what it no longer
        holds."""
        known: str | None = None
        while not self._closing:
            try:
                run_id = await server_run_id(link.redis)
                if run_id is None:
                    log.info("Redis does not answer INFO: a restart that loses writes will not be noticed")
                    return
                if known is not None and run_id != known:
                    self.stats.redis_changes += 1
                    log.warning("Redis of shard %s restarted or failed over (run_id %s -> %s)", link.name, known[:8],
                                run_id[:8])  # fmt: skip
                    await self._resubmit_lost(link)
                known = run_id
            except (RedisError, OSError) as exc:  # away: asked again; a change is still seen once it is back
                log.debug("asking Redis for its run_id failed (%s)", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), REDIS_CHECK_S)

    async def _resubmit_lost(self, link: ShardLink) -> None:
        """Resubmit, under the same ids and past admission, the requests awaited in `link`'s shard that its Redis no
        longer holds (each to the shard chosen for it now)."""
        awaited = {a.request.request_id: a for a in self._awaited_in(link)}
        held = await link.streams.held(set(awaited), link.keys.results(self.producer_id))
        # Still awaited after that read, and not being enqueued (an enqueue riding out the outage sends it once back).
        lost = [
            a
            for rid, a in awaited.items()
            if rid not in held and self.attempts.get(rid) is a and not a.cancelling and not a.sending
        ]
        if not lost:
            return
        for attempt in lost:
            attempt.request = self._addressed(attempt.request)
        self.stats.resubmitted += len(lost)
        log.warning("Redis no longer holds %d of the %d requests awaited here: resubmitting them", len(lost),
                    len(awaited))  # fmt: skip
        await self._enqueue(lost, -1)

    async def close(self) -> None:
        # Let the reader finish its blocking read rather than cancel it: a pipeline cancelled mid-read
        # can leave redis-py waiting on a reply that never comes.
        self._closing = True
        self._closed.set()
        await self.control.close()  # leased pauses held here lapse after their lease unless resumed
        self.outbox.put_nowait(None)
        tasks = [self.submitter, *(t for ts in self.tasks.values() for t in ts)]
        if self.shard_watcher is not None:
            tasks.append(self.shard_watcher)
        _, pending = await asyncio.wait(tasks, timeout=self.settings.read_block_ms / 1000 + 5)
        for task in pending:
            task.cancel()
        try:
            if not self.named:
                await self.fleet.each(lambda link: link.redis.delete(link.keys.results(self.producer_id)))
        except (RedisError, OSError) as exc:  # Redis away: the stream expires on its own (results_ttl_s)
            log.warning("could not delete the results streams of %s on close (%s)", self.producer_id, exc)
        finally:
            await self.fleet.close()


def _enqueue_item(request: Request) -> Enqueue:
    if isinstance(request, RolloutRequest):
        return Enqueue(encode(request), request.session_id, cost=request.cost_tokens())
    return Enqueue(encode(request), tokens=True)
