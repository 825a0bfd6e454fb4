"""A producer's submitter: one task sends what the connection's callers queued (batches to enqueue, cancels, cuts) to
the shards, in one pipelined round trip per shard."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from rollout_svc.client.lifecycle import Attempt
from rollout_svc.config import Settings
from rollout_svc.connections.urls import retry_while_away
from rollout_svc.dataplane.producer_streams import ProducerStreams
from rollout_svc.dataplane.streams import Enqueue, Placed
from rollout_svc.fleet import Fleet, ShardLink
from rollout_svc.protocol import RolloutRequest, Trajectory, unrun_trajectory

log = logging.getLogger("rollout_svc.client")
# What the caller gets of an attempt's trajectory (`ResultRouter.answer`): a cut one's is final, never None.
Answer = Callable[[Attempt, Trajectory], Trajectory | None]


@dataclass
class EnqueueOp:
    """Requests to enqueue: `items[i]`, the request of `attempts[i]`, to shard `shards[i]`. `limit`: the admission
    limit (-1: none, for a retry that continues admitted work). `done` resolves once Redis took them all."""

    items: list[Enqueue]
    limit: int
    attempts: list[Attempt]
    shards: list[str]
    done: asyncio.Future[None]


@dataclass
class CancelOp:
    """Attempts to cancel, by request id."""

    request_ids: list[str] = field(default_factory=list)


@dataclass
class CutOp:
    """Attempts to cut (their call's completion target was met), by request id."""

    request_ids: list[str] = field(default_factory=list)


Op = EnqueueOp | CancelOp | CutOp | None  # None: the connection closes


class Submitter:
    """The single submitter of a connection: concurrent callers' batches go to Redis together, in one round trip per
    shard; cancels and cuts follow, after the enqueues they may refer to. This bounds the connections a busy producer
    (the API, an open-loop benchmark) opens to each shard to two (this and its reader).

    Given the connection's `fleet`, its map of `attempts` (request id -> `Attempt`, the connection's), `answer`
    (what the caller gets of an attempt cut unrun) and `closed` (set when the connection closes). Its callers put
    ops in `outbox`; `None` ends it."""

    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        attempts: dict[str, Attempt],
        answer: Answer,
        closed: asyncio.Event,
    ) -> None:
        self.settings, self.fleet, self.attempts = settings, fleet, attempts
        self._answer, self._closed = answer, closed
        self.outbox: asyncio.Queue[Op] = asyncio.Queue()
        self._streams: dict[str, ProducerStreams] = {}  # shard -> the submitter's own connection there
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            ops = [await self.outbox.get()]
            while not self.outbox.empty():
                ops.append(self.outbox.get_nowait())
            enqueues = [op for op in ops if isinstance(op, EnqueueOp)]
            if enqueues:
                await self._enqueue(enqueues)
            cancelled = [i for op in ops if isinstance(op, CancelOp) for i in op.request_ids]
            if cancelled:
                await self._cancel(cancelled)
            cut = [i for op in ops if isinstance(op, CutOp) for i in op.request_ids]
            if cut:
                await self._cut(cut)
            if None in ops:
                for streams in self._streams.values():
                    with contextlib.suppress(RedisError, OSError):
                        await streams.aclose()
                return

    def _streams_of(self, link: ShardLink) -> ProducerStreams:
        """The submitter's own connection to a shard (`ProducerStreams.on_own_connection`: enqueues are the request's
        hot path), anew for a link opened anew."""
        streams = self._streams.get(link.name)
        if streams is None or streams.redis is not link.redis:
            streams = self._streams[link.name] = link.streams.on_own_connection()
        return streams

    def _by_shard(self, attempts: list[tuple[str, Attempt | None]]) -> dict[str, list[tuple[str, Placed | None]]]:
        """(request id, placement) of each attempt to cancel, by shard: its own, or every shard for one whose shard is
        not known (not yet placed, attached, or in a shard no longer linked)."""
        by_shard: dict[str, list[tuple[str, Placed | None]]] = {}
        for request_id, attempt in attempts:
            shard, placed = (attempt.shard, attempt.placed) if attempt is not None else (None, None)
            for name in [shard] if shard in self.fleet.links else list(self.fleet.links):
                by_shard.setdefault(name, []).append((request_id, placed))
        return by_shard

    async def _cancel(self, request_ids: list[str]) -> None:
        """Cancel in each request's shard; the attempts leave the map."""
        by_shard = self._by_shard([(request_id, self.attempts.pop(request_id, None)) for request_id in request_ids])
        try:
            await self.fleet.each(lambda link: link.control.cancel(by_shard[link.name]), by_shard)
        except (RedisError, OSError) as exc:  # the workers' deadlines still stop them
            log.warning("cancelling %d requests failed (%s)", len(request_ids), exc)

    async def _cut(self, request_ids: list[str]) -> None:
        """Cancel the attempts being cut, in their shards; answer those deleted from a queue here, unrun, with
        `abort_cause="partial"`. Redis away: the rest answer as they finish."""
        awaited = [(request_id, self.attempts.get(request_id)) for request_id in request_ids]
        by_shard = self._by_shard([(request_id, a) for request_id, a in awaited if a is not None])  # not answered
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

    async def _enqueue(self, ops: list[EnqueueOp]) -> None:
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
                    lambda: self._streams_of(link).enqueue_batches(batches, limits),
                    self.settings.client.redis_outage_s,
                    f"enqueue (shard {shard})",
                    stop=self._closed.is_set,
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
