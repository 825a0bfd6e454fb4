"""A producer's connection: submits requests, routes their results, retries aborted ones token-exact, cancels.

One `Connection` per event loop holds two tasks: the submitter sends whatever batches (and cancels) are
waiting in one pipelined round trip, and the reader routes each result to its call by request id. A call's
request cut by a pause in abort mode (or its worker shutting down) comes back as a partial trajectory; the
reader resubmits it under a new request id with its tokens so far (a `Continuation`) and the remaining deadline,
and the caller only ever sees the merged trajectory. An explicit abort, a cancel and a deadline are final.

Requests go to shards (`rollout_svc.fleet`): a session's by rendezvous hashing of its id over the live shards, the
others round robin over the live shards weighted by their live workers. Each shard has its own results stream for
this producer and its own reader task. One Redis is the one-shard case.

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
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from rollout_svc.config import Settings, tune_gc
from rollout_svc.connect import retry_while_away, server_run_id
from rollout_svc.errors import ProtocolError, QueueFullError
from rollout_svc.fleet import Fleet, FleetControl, FleetRegistry, ShardLink, rendezvous
from rollout_svc.keys import PAYLOAD_FIELD
from rollout_svc.protocol import (
    Continuation,
    ErrorResult,
    Request,
    Result,
    RolloutRequest,
    Trajectory,
    TrajectoryChunk,
    decode,
    encode,
)
from rollout_svc.streams import ENQUEUE_CHUNK, Enqueue, Placed, RequestStreams

log = logging.getLogger("rollout_svc.client")
RETRIED_CAUSES = ("pause", "shutdown", "stale")  # aborts the client hides by retrying
REDIS_CHECK_S = 1.0  # how often a connection asks each shard's Redis for its run_id, and whether workers live there


@dataclass
class ClientStats:
    """What a connection has seen. `duplicates`: results no caller awaited (an at-least-once redelivery, or the
    answer to a cancelled request); `retries`: token-exact resubmissions; `cancelled`: requests cancelled;
    `regenerated`: trajectories dropped as staler than `max_staleness` and generated again; `staleness`: how many
    trajectories arrived at each staleness (committed weight version at receipt minus their first token's);
    `redis_changes`: times Redis restarted or failed over under this connection; `resubmitted`: requests sent again
    because Redis no longer held them then."""

    duplicates: int = 0
    retries: int = 0
    redis_changes: int = 0
    resubmitted: int = 0
    cancelled: int = 0
    regenerated: int = 0
    staleness: Counter[int] = field(default_factory=Counter)


class Call:
    """One caller's batch of requests (a generate / sample / chat / tokenize call): results by position.

    `completed` yields positions as they finish; `done` resolves when all have. `attempts[i]` is the request id
    position i is awaited under (a retry has a new one); `partial[i]` the last aborted attempt being retried.
    With `chunks`, `events` also yields `(position, TrajectoryChunk)` for streaming requests, as they arrive, and
    `(position, None)` when a position finished.
    """

    def __init__(self, requests: Sequence[Request], loop: asyncio.AbstractEventLoop, chunks: bool = False) -> None:
        self.requests = list(requests)
        count = len(self.requests)
        self.results: list[Any] = [None] * count
        self.remaining = count
        self.done: asyncio.Future[None] = loop.create_future()
        if not count:
            self.done.set_result(None)
        self._completed: asyncio.Queue[int] | None = None  # made on first use: most calls never read it
        self.attempts = [r.request_id for r in self.requests]
        self.partial: list[Trajectory | None] = [None] * count
        self.spent_s: list[tuple[float, float]] = [(0.0, 0.0)] * count  # earlier attempts' (queue, generation) s
        self.regenerations: dict[int, int] = {}  # position -> times dropped as stale and generated again
        self.events: asyncio.Queue[tuple[int, TrajectoryChunk | None]] | None = asyncio.Queue() if chunks else None

    @property
    def completed(self) -> asyncio.Queue[int]:
        """The positions, as they finish (those finished before the first look first)."""
        if self._completed is None:
            self._completed = asyncio.Queue()
            for index, result in enumerate(self.results):
                if result is not None:
                    self._completed.put_nowait(index)
        return self._completed

    def chunk(self, index: int, chunk: TrajectoryChunk) -> None:
        if self.events is not None and self.results[index] is None:
            self.events.put_nowait((index, chunk))

    def set(self, index: int, result: Any) -> None:
        if self.results[index] is not None:
            return
        self.results[index] = result
        self.remaining -= 1
        if self._completed is not None:
            self._completed.put_nowait(index)
        if self.events is not None:
            self.events.put_nowait((index, None))
        if self.remaining == 0 and not self.done.done():
            self.done.set_result(None)

    def unfinished(self) -> list[int]:
        return [i for i, r in enumerate(self.results) if r is None]

    def merged(self, index: int, result: Trajectory, **update: Any) -> Trajectory:
        """An attempt's trajectory as the caller sees it: under the original request id, times summed."""
        if not update and self.partial[index] is None:
            return result  # never retried: it is the request's own answer (the common case: no copy)
        queue_s, generation_s = self.spent_s[index]
        update = {
            "request_id": self.requests[index].request_id,
            "queue_time_s": queue_s + result.queue_time_s,
            "generation_time_s": generation_s + result.generation_time_s,
            **update,
        }
        return result.model_copy(update=update)

    def end_with_partial(self, index: int, **update: Any) -> None:
        """Finish a position being retried with the partial trajectory its last attempt returned."""
        partial = self.partial[index]
        assert partial is not None
        queue_s, generation_s = self.spent_s[index]  # the partial's own times are in these already
        update = {
            "request_id": self.requests[index].request_id,
            "queue_time_s": queue_s,
            "generation_time_s": generation_s,
            "interruptions": partial.interruptions + 1,
            **update,
        }
        self.set(index, partial.model_copy(update=update))

    def expire(self) -> None:
        """The caller's deadline passed: a position being retried ends with its partial tokens (abort, deadline)."""
        for index in self.unfinished():
            if self.partial[index] is not None:
                self.end_with_partial(index, abort_cause="deadline")


@dataclass
class _EnqueueOp:
    items: list[Enqueue]
    limit: int  # -1: no admission limit (a retry continues admitted work)
    request_ids: list[str]
    shards: list[str]  # the shard of each item
    done: asyncio.Future[None]


@dataclass
class _CancelOp:
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
        self.results = settings.keys.results(self.producer_id)  # the default shard's; each request gets its shard's
        self.shard_of: dict[str, str] = {}  # request id -> the shard it was sent to (while awaited or cancelling)
        self._rotation: Iterator[str] = iter(())  # unkeyed requests' shards, round robin
        self._rotation_of: tuple[str, ...] = ()  # the live shards (one entry per live worker) it cycles through
        self.waiting: dict[str, tuple[Call, int]] = {}  # request id -> its call and position
        self.placed: dict[str, Placed] = {}  # request id -> where it was enqueued (what a cancel sweeps)
        self._cancelling: set[str] = set()  # cancelled, their cancel not yet sent: their placements are kept
        self._retried: dict[str, Request] = {}  # request id -> a retry or regeneration awaited under it
        self._sending: dict[str, int] = {}  # request id -> its enqueues not yet answered by Redis
        self.stats = ClientStats()
        self.committed_version = 0  # the fleet's committed weight version, read with every batch of results
        self._request_numbers = itertools.count()
        self._closing = False
        self._closed = asyncio.Event()
        self._reread: set[str] = set()  # shards whose reader goes back to the start of its stream (see `attach`)
        self.outbox: asyncio.Queue[_EnqueueOp | _CancelOp | None] = asyncio.Queue()
        self.tasks: dict[str, list[asyncio.Task[None]]] = {}  # shard -> its reader and watcher
        self.submitter = asyncio.create_task(self._submit_ops())
        self.shard_watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Find the shards and whether workers live in each, start their tasks. Raises the Redis error if no shard
        can be reached."""
        tune_gc(self.settings.gc_young_threshold)
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
        self.waiting.update((request.request_id, (call, i)) for i, request in enumerate(call.requests))
        try:
            await self._enqueue(call.requests, self.settings.max_queued_requests)
        except QueueFullError:
            shards = {self.shard_of.get(r.request_id) for r in call.requests}
            if len(call.requests) <= ENQUEUE_CHUNK and len(shards) == 1:  # nothing was sent: nothing to cancel
                self.forget(call)
                call.remaining = 0
            raise

    def attach(self, call: Call) -> None:
        """Await a call's requests' results without enqueuing them: they were enqueued by an earlier connection of
        this named producer, and their results come to the same stream, which the reader then reads again from
        its start (a named producer's results are never deleted, so one that arrived before is found)."""
        self.waiting.update((request.request_id, (call, i)) for i, request in enumerate(call.requests))
        self._reread = set(self.fleet.links)

    def _enqueue(self, requests: Sequence[Request], limit: int) -> asyncio.Future[None]:
        done = self.loop.create_future()
        shards = [self.shard_for(r.session_id if isinstance(r, RolloutRequest) else None) for r in requests]
        items = []
        for request, shard in zip(requests, shards, strict=True):
            # Answered on its shard's results stream (the worker's publish script declares both in one slot). Set in
            # place: the request is this connection's own, and is encoded right here.
            request.__dict__["reply_to"] = self.fleet.links[shard].keys.results(self.producer_id)
            items.append(_enqueue_item(request))
            self.shard_of[request.request_id] = shard
        request_ids = [r.request_id for r in requests]
        for request_id in request_ids:
            self._sending[request_id] = self._sending.get(request_id, 0) + 1
        self.outbox.put_nowait(_EnqueueOp(items, limit, request_ids, shards, done))
        return done

    def cancel(self, call: Call) -> None:
        """Stop awaiting a call's unfinished requests and cancel them on the workers (queued or in flight)."""
        ids = [call.attempts[i] for i in call.unfinished()]
        for request_id in ids:
            self.waiting.pop(request_id, None)
            self._retried.pop(request_id, None)
        self._cancelling.update(ids)
        if ids:
            self.stats.cancelled += len(ids)
            self.outbox.put_nowait(_CancelOp(ids))

    def forget(self, call: Call) -> None:
        for request_id in call.attempts:
            self.waiting.pop(request_id, None)
            self._retried.pop(request_id, None)
            if request_id not in self._cancelling:
                self.placed.pop(request_id, None)
                self.shard_of.pop(request_id, None)

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
                self._cancelling.difference_update(cancelled)
                await self._cancel(cancelled)
            if None in ops:
                return

    async def _cancel(self, request_ids: list[str]) -> None:
        """Cancel in each request's shard (in every shard, for one not yet placed)."""
        by_shard: dict[str, list[tuple[str, Placed | None]]] = {}
        for request_id in request_ids:
            shard = self.shard_of.pop(request_id, None)
            attempt = (request_id, self.placed.pop(request_id, None))
            for name in [shard] if shard in self.fleet.links else list(self.fleet.links):
                by_shard.setdefault(name, []).append(attempt)
        try:
            await self.fleet.each(lambda link: link.control.cancel(by_shard[link.name]), by_shard)
        except (RedisError, OSError) as exc:  # the workers' deadlines still stop them
            log.warning("cancelling %d requests failed (%s)", len(request_ids), exc)

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
                    lambda: link.streams.enqueue_batches(batches, limits),
                    self.settings.redis_outage_s,
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
            for request_id in op.request_ids:
                if (left := self._sending.pop(request_id, 1) - 1) > 0:
                    self._sending[request_id] = left
            for request_id, where in zip(op.request_ids, op_placed, strict=True):
                if where is not None and (request_id in self.waiting or request_id in self._cancelling):
                    self.placed[request_id] = where
            if op.done.done():
                continue
            if error is not None:
                op.done.set_exception(error)
            else:
                op.done.set_result(None)

    async def _read_results(self, link: ShardLink) -> None:
        """A shard's reader: routes each result to its call by request id, ignores duplicates."""
        last_id, failures = b"0-0", 0
        done_ids: list[bytes] = []
        results = link.keys.results(self.producer_id)
        while not self._closing:
            if link.name in self._reread:
                last_id = b"0-0"
                self._reread.discard(link.name)
            try:
                records, committed = await link.streams.read_results(
                    results, last_id, done_ids, self.settings.read_block_ms, link.keys.state
                )
                done_ids, failures = [], 0
                link.away_since = None
                self.committed_version = max(self.committed_version, committed)
            except (RedisError, OSError) as exc:  # the reader must outlive any Redis trouble
                failures += 1
                if link.away_since is None:
                    link.away_since = time.monotonic()
                if failures == 1:
                    log.warning("reading results from shard %s failed (%s); retrying", link.name, exc)
                if time.monotonic() - link.away_since > self.settings.redis_outage_s:
                    self._fail_shard(link, exc)
                await asyncio.sleep(min(2.0, 0.1 * 2**failures))
                continue
            for entry_id, fields in records:
                last_id = entry_id
                if not self.named:  # a named producer's results stay until its owner deletes the stream
                    done_ids.append(entry_id)
                self._route(fields.get(PAYLOAD_FIELD, b""))
            if records:
                await asyncio.sleep(0)  # let the callers just woken run before the next read is sent

    def _route(self, payload: bytes) -> None:
        try:
            result: Result = decode(payload)
        except ProtocolError as exc:
            log.error("dropped an undecodable result: %s", exc)
            return
        if isinstance(result, TrajectoryChunk):  # part of a streaming request, before its result
            waiting = self.waiting.get(result.request_id)
            if waiting is not None:
                waiting[0].chunk(waiting[1], result)
            return
        target = self._answered(result.request_id)
        if target is None:
            self.stats.duplicates += 1  # at-least-once delivery: a requeued request may answer twice
            return
        call, index = target
        if isinstance(result, Trajectory):
            if self._retry(call, index, result):
                return
            result = self._final(call, index, result)
            staleness = max(0, self.committed_version - first_version(result))
            self.stats.staleness[staleness] += 1
            if result.request_id != call.requests[index].request_id:  # regenerated: the caller's id
                result = result.model_copy(update={"request_id": call.requests[index].request_id})
            # Set in place, not copied: this object was decoded here (or copied by `_final`) and nothing else holds
            # it yet; a copy per trajectory cost ~8% of a producer's throughput.
            result.__dict__["staleness"] = staleness
            if self._too_stale(call, index, result):
                return
        call.set(index, result)

    def _answered(self, request_id: str) -> tuple[Call, int] | None:
        """Stop awaiting `request_id` and drop what was kept while it was: its call and position, None if it was not
        awaited (already answered, cancelled, or not this connection's)."""
        target = self.waiting.pop(request_id, None)
        if target is not None:
            self.placed.pop(request_id, None)
            self.shard_of.pop(request_id, None)
            self._retried.pop(request_id, None)
        return target

    def _too_stale(self, call: Call, index: int, result: Trajectory) -> bool:
        """Drop a trajectory staler than `max_staleness` and generate it again (policy `regenerate`, at most
        `max_abort_retries` times per request); False if the caller gets it (fresh enough, or marked)."""
        limit = self.settings.max_staleness
        if limit is None or result.staleness is None or result.staleness <= limit:
            return False
        request = call.requests[index]
        if self.settings.stale_policy != "regenerate" or not isinstance(request, RolloutRequest):
            return False
        if call.regenerations.get(index, 0) >= self.settings.max_abort_retries:
            return False
        if request.deadline is not None and request.deadline <= time.time():
            return False
        call.regenerations[index] = call.regenerations.get(index, 0) + 1
        call.spent_s[index] = (0.0, 0.0)
        self.stats.regenerated += 1
        again = request.model_copy(update={"request_id": self.new_id()})
        # Not enqueued (Redis away): the caller gets the stale trajectory, marked.
        self._resubmit(call, index, again, None, lambda: call.set(index, result))
        return True

    def _final(self, call: Call, index: int, result: Trajectory) -> Trajectory:
        if result.finish_reason != "abort" or result.abort_cause not in RETRIED_CAUSES:
            return call.merged(index, result)
        request = call.requests[index]
        assert isinstance(request, RolloutRequest)
        if len(result.completion_token_ids) >= request.sampling_params.max_tokens:  # cut at its very last token
            return call.merged(index, result, finish_reason="length", abort_cause=None)
        return call.merged(index, result, interruptions=result.interruptions + 1)  # retries exhausted, or deadline

    def _retry(self, call: Call, index: int, result: Trajectory) -> bool:
        """Resubmit a request cut by a pause or a worker's shutdown, token-exact; False if it is final."""
        request = call.requests[index]
        if result.finish_reason != "abort" or result.abort_cause not in RETRIED_CAUSES:
            return False
        if not isinstance(request, RolloutRequest) or not result.prompt_token_ids:
            return False
        if result.interruptions >= self.settings.max_abort_retries:
            return False
        if len(result.completion_token_ids) >= request.sampling_params.max_tokens:
            return False
        if request.deadline is not None and request.deadline <= time.time():
            return False
        continuation = Continuation(
            retry_of=request.request_id,
            token_ids=result.completion_token_ids,
            logprobs=result.logprobs,
            text=result.text,
            interruptions=result.interruptions + 1,
            weight_versions=result.weight_versions,
            top_logprobs=result.top_logprobs,
            tokens=result.tokens,
        )
        # The same request (session, group, streaming, tools, deadline) on the prompt ids it was served with.
        retry = request.model_copy(
            update={
                "request_id": self.new_id(),
                "prompt_token_ids": result.prompt_token_ids,
                "messages": None,
                "prompt": None,
                "reply_to": self.results,
                "submitted_at": time.time(),
                "continuation": continuation,
            }
        )
        queue_s, generation_s = call.spent_s[index]
        call.spent_s[index] = (queue_s + result.queue_time_s, generation_s + result.generation_time_s)
        self.stats.retries += 1
        # Not enqueued (Redis away): it ends with what its request had generated.
        self._resubmit(call, index, retry, result, lambda: call.end_with_partial(index))
        return True

    def _resubmit(
        self, call: Call, index: int, request: RolloutRequest, partial: Trajectory | None, failed: Callable[[], None]
    ) -> None:
        """Await position `index` of `call` under `request` from now on (a retry, or a regeneration), `partial`
        being what its last attempt returned, and enqueue it past admission (it continues admitted work).
        `failed()` ends the position if the request could not be enqueued."""
        call.partial[index], call.attempts[index] = partial, request.request_id
        self.waiting[request.request_id] = (call, index)
        self._retried[request.request_id] = request

        def enqueued(future: asyncio.Future[None]) -> None:
            if future.cancelled() or future.exception() is None:
                return
            log.warning("could not resubmit %s (%s)", request.request_id, future.exception())
            self._retried.pop(request.request_id, None)
            if self.waiting.pop(request.request_id, None) is not None:
                failed()

        self._enqueue([request], -1).add_done_callback(enqueued)

    def _awaited_in(self, link: ShardLink) -> list[str]:
        """The request ids awaited here that were sent to `link`'s shard."""
        return [rid for rid, shard in self.shard_of.items() if shard == link.name and rid in self.waiting]

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
        for request_id in lost:
            if (target := self._answered(request_id)) is None:
                continue
            call, index = target
            call.set(index, ErrorResult(request_id=call.requests[index].request_id, code="shard_unavailable",
                                        message=message, recoverable=True))  # fmt: skip

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
        longer holds."""
        awaited = set(self._awaited_in(link))
        held = await link.streams.held(awaited, link.keys.results(self.producer_id))
        # Not those still being enqueued (an enqueue riding out the outage sends them once it is back).
        lost = [rid for rid in awaited - held if rid in self.waiting and rid not in self._sending]
        if not lost:
            return
        requests = [self._attempt(rid) for rid in lost]
        self.stats.resubmitted += len(requests)
        log.warning("Redis no longer holds %d of the %d requests awaited here: resubmitting them", len(lost),
                    len(awaited))  # fmt: skip
        await self._enqueue(requests, -1)

    def _attempt(self, request_id: str) -> Request:
        """The request awaited under `request_id`: a call's own, or a retry or regeneration of it."""
        call, index = self.waiting[request_id]
        return self._retried.get(request_id) or call.requests[index]

    async def close(self) -> None:
        # Let the reader finish its blocking read rather than cancel it: a pipeline cancelled mid-read
        # can leave redis-py waiting on a reply that never comes.
        self._closing = True
        self._closed.set()
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
        return Enqueue(encode(request), request.session_id)
    return Enqueue(encode(request), tokens=True)


def first_version(trajectory: Trajectory) -> int:
    """The weight version of a trajectory's first token (of its engine, if it has none)."""
    return trajectory.weight_versions[0][0] if trajectory.weight_versions else trajectory.weight_version
