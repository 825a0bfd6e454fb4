"""A producer's results: each shard's reader routes what the workers answered to the caller's call by request id, and
decides what the caller gets of a trajectory: the answer merged over its attempts, or instead a token-exact retry of
an aborted one, or a regeneration of a stale one (the rules are `client.lifecycle`'s); a shard whose Redis stays away
fails what was awaited there."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

from rollout_svc.client.calls import Call, ClientStats
from rollout_svc.client.lifecycle import Attempt, NewAttempt, cut_fields, final_fields, regeneration_of, retry_of
from rollout_svc.config import Settings
from rollout_svc.dataplane.producer_streams import ProducerStreams
from rollout_svc.errors import ProtocolError
from rollout_svc.fleet import ShardLink
from rollout_svc.keys import PAYLOAD_FIELD
from rollout_svc.protocol import ErrorResult, Result, RolloutRequest, Trajectory, TrajectoryChunk, decode

log = logging.getLogger("rollout_svc.client")
# Loop turns a shard's reader yields after routing results, before it sends its next read: the callers it woke run in
# the first, and what they wrote in it goes out in the second where writes are joined at the end of a turn (`serve`'s
# responses: rollout_svc.api.http). With one turn the next read's write (and Redis's wake-up) came before serve's
# response (a write and a wake-up of Redis in the way of every answer at 1 in flight: docs/benchmarks.md, (i)).
CALLER_TURNS = 2
# Enqueue attempts past admission (`Connection.enqueue`); the future resolves once Redis took them.
EnqueueAttempts = Callable[[Sequence[Attempt], int], asyncio.Future[None]]


class ResultRouter:
    """Routes a producer's results to their calls. Given the connection's `producer_id` (`named`: its results stay
    in its streams), its map of `attempts` (request id -> `Attempt`), its `stats`, `new_attempt` (the id and
    `reply_to` of a retry), `enqueue` (for retries and regenerations) and `closed` (set when it closes). Keeps what
    it reads with every batch of results: `committed_version` (the fleet's committed weight version) and `adapters`
    (adapter -> its newest version, for those the producer's requests named); `reread`: shards whose reader goes
    back to the start of its stream (an attached call's results may have come before)."""

    def __init__(
        self,
        settings: Settings,
        producer_id: str,
        named: bool,
        attempts: dict[str, Attempt],
        stats: ClientStats,
        new_attempt: NewAttempt,
        enqueue: EnqueueAttempts,
        closed: asyncio.Event,
    ) -> None:
        self.settings, self.producer_id, self.named = settings, producer_id, named
        self.attempts, self.stats = attempts, stats
        self._new_attempt, self._enqueue, self._closed = new_attempt, enqueue, closed
        self.committed_version = 0
        self.adapters: dict[str, int] = {}
        self.reread: set[str] = set()

    async def read(self, link: ShardLink) -> None:
        """A shard's reader: routes each result to its call by request id, ignores duplicates."""
        streams = link.streams.on_own_connection()  # the results' hot path: a connection of its own, used directly
        try:
            await self._read_on(link, streams)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await streams.aclose()

    async def _read_on(self, link: ShardLink, streams: ProducerStreams) -> None:
        last_id, failures = b"0-0", 0
        done_ids: list[bytes] = []
        results = link.keys.results(self.producer_id)
        while not self._closed.is_set():
            if link.name in self.reread:
                last_id = b"0-0"
                self.reread.discard(link.name)
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
                    self.fail_shard(link, exc)
                await asyncio.sleep(min(2.0, 0.1 * 2**failures))
                continue
            for entry_id, fields in records:
                last_id = entry_id
                if not self.named:  # a named producer's results stay until its owner deletes the stream
                    done_ids.append(entry_id)
                self.route(fields.get(PAYLOAD_FIELD, b""))
            if records:
                for _ in range(CALLER_TURNS):  # the callers just woken run, and answer, before the next read is sent
                    await asyncio.sleep(0)

    def route(self, payload: bytes) -> None:
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
            answer = self.answer(attempt, result)
            if answer is None:
                return
            result = answer
        attempt.call.set(attempt.index, result)

    def answer(self, attempt: Attempt, result: Trajectory) -> Trajectory | None:
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
        call.renew(index, again.request_id, None, discarded=len(final.completion_token_ids))
        self.stats.regenerated += 1
        self.stats.stale_tokens += len(final.completion_token_ids)
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
        attempt = Attempt(call, index, request)

        def enqueued(future: asyncio.Future[None]) -> None:
            if future.cancelled() or future.exception() is None:
                return
            log.warning("could not resubmit %s (%s)", request.request_id, future.exception())
            if self.attempts.get(request.request_id) is attempt and not attempt.cancelling:
                del self.attempts[request.request_id]
                failed()

        self._enqueue([attempt], -1).add_done_callback(enqueued)

    def awaited_in(self, link: ShardLink) -> list[Attempt]:
        """The attempts awaited here that were sent to `link`'s shard."""
        return [a for a in self.attempts.values() if a.shard == link.name and not a.cancelling]

    def fail_shard(self, link: ShardLink, exc: BaseException) -> None:
        """Answer every request awaited in `link`'s shard with a `shard_unavailable` error: its Redis has been away
        for longer than `redis_outage_s`. Those requests may still run if it comes back; their answers are then
        dropped as duplicates."""
        lost = self.awaited_in(link)
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
