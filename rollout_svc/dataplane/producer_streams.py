"""What a producer calls on the data plane: enqueue, read its results, find what Redis holds, sessions, depth."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_svc.dataplane.direct import stream_records
from rollout_svc.dataplane.streams import Enqueue, Placed, StreamSide
from rollout_svc.errors import ProtocolError, QueueFullError
from rollout_svc.keys import (
    HOLDS_SUFFIX,
    IN_SUFFIX,
    PAYLOAD_FIELD,
    PINNED_SUFFIX,
    WORKERS_GROUP,
    StateField,
)
from rollout_svc.protocol import decode

ENQUEUE_CHUNK = 1000  # entries per script call: bounds how long one call blocks Redis


@dataclass(frozen=True, slots=True)
class Sweep:
    """An entry to delete if still undelivered, and the answer (results stream, payload) to send its producer."""

    entry_id: bytes
    reply: tuple[str, bytes] | None = None


class ProducerStreams(StreamSide):
    """A producer's side of the data plane (`dataplane.streams` says how the streams work): enqueues placed by the
    enqueue script, its results read with the committed weight version, cancelled entries swept, sessions unpinned,
    and what an operator's status reads (depths, loads).

    `on_own_connection()` gives a copy for one sequential user of its hot paths (a producer's submitter or its
    result reader): its enqueues and result reads then go over a `DirectConnection` of their own."""

    async def enqueue(self, items: Sequence[Enqueue], max_queued: int) -> list[Placed]:
        """XADD items; sessions go to their pinned worker's stream. Returns where each went.

        Raises `QueueFullError` if a target stream would exceed `max_queued` (nothing of a batch of up
        to ENQUEUE_CHUNK items is added then; of a larger batch, the chunks before the full one are).
        """
        [outcome] = await self.enqueue_batches([items], [max_queued])
        if isinstance(outcome, QueueFullError):
            raise outcome
        return outcome

    async def enqueue_batches(
        self, batches: Sequence[Sequence[Enqueue]], limits: Sequence[int], *, share: bool = True
    ) -> list[list[Placed] | QueueFullError]:
        """Enqueue several callers' batches in one round trip (one script call per chunk, pipelined).

        `limits[i]` is batch i's admission limit (-1: none). Each batch succeeds or fails on its own: the
        outcome is where its requests went, or its `QueueFullError`. With `share`, batches of up to ENQUEUE_CHUNK
        requests with the same limit share chunks (many callers' single requests go in one script call, not one
        each); a shared chunk refused for admission is sent again batch by batch, so each batch is admitted or
        refused on its own count.
        """
        chunks: list[tuple[list[Enqueue], int]] = []
        spans: list[list[tuple[int, int, int]]] = []  # per batch: (chunk, first position in it, count)
        filling: dict[int, int] = {}  # limit -> the shared chunk being filled
        for items, limit in zip(batches, limits, strict=True):
            span: list[tuple[int, int, int]] = []
            if share and len(items) <= ENQUEUE_CHUNK:
                at = filling.get(limit)
                if at is None or len(chunks[at][0]) + len(items) > ENQUEUE_CHUNK:
                    at = filling[limit] = len(chunks)
                    chunks.append(([], limit))
                span.append((at, len(chunks[at][0]), len(items)))
                chunks[at][0].extend(items)
            else:
                for start in range(0, len(items), ENQUEUE_CHUNK):
                    part = list(items[start : start + ENQUEUE_CHUNK])
                    span.append((len(chunks), 0, len(part)))
                    chunks.append((part, limit))
            spans.append(span)
        replies = await self._run_enqueue_calls(chunks)
        placed: dict[int, list[Placed]] = {}
        refusals: dict[int, QueueFullError] = {}
        for at, ((items, limit), reply) in enumerate(zip(chunks, replies, strict=True)):
            try:
                placed[at] = self.connection.placed(items, reply, limit)
            except QueueFullError as exc:
                refusals[at] = exc
        outcomes: list[list[Placed] | QueueFullError] = []
        again: list[int] = []  # batches of a shared chunk that was refused: sent again on their own
        for b, span in enumerate(spans):
            refused = next((refusals[at] for at, _, _ in span if at in refusals), None)
            if refused is None:
                outcomes.append([p for at, first, count in span for p in placed[at][first : first + count]])
                continue
            outcomes.append(refused)
            at, _, count = span[0]
            if count < len(chunks[at][0]):  # it shared the chunk: its own count may fit
                again.append(b)
        if again:
            retried = await self.enqueue_batches([batches[b] for b in again], [limits[b] for b in again], share=False)
            for b, outcome in zip(again, retried, strict=True):
                outcomes[b] = outcome
        return outcomes

    async def _run_enqueue_calls(self, chunks: Sequence[tuple[Sequence[Enqueue], int]]) -> list[Any]:
        """EVALSHA each chunk in one pipeline; returns the reply of each. Not through redis-py's script-in-pipeline
        support: that costs a SCRIPT EXISTS round trip per pipeline. NOSCRIPT (Redis restarted) reloads the script
        and sends the calls again (`DirectConnection.scripts`)."""
        script = self.connection.scripts["enqueue"]
        calls = [self.connection.enqueue_call(items, limit, []) for items, limit in chunks]
        async with self.connection.hot_path() as direct:
            return list(await direct.scripts(script, calls))

    async def finish_session(self, session_id: str) -> bool:
        """Unpin a session; its next turn is placed anew. Returns whether it was pinned."""

        keys = [*self.keys.fleet, self.keys.session(session_id)]
        reply = await self.connection.scripts["finish"](keys=keys, args=[*self.keys.worker_stems, session_id])
        return bool(int(reply[1]))

    async def pinned_worker(self, session_id: str) -> str | None:
        """The worker a session is pinned to; None if it is not pinned."""
        value: Any = await self.redis.get(self.keys.session(session_id))
        return value.decode() if value else None

    async def sweep(self, stream: str, entries: Sequence[Sweep], results_ttl_s: float) -> list[bytes]:
        """Delete the entries still undelivered and send each its answer, atomically. Returns the ids of those that
        went (a delivered one is its worker's to answer)."""
        keys: dict[str, int] = {stream: 1, self.keys.loads: 2, self.keys.queued_costs: 3}
        args: list[str | bytes | int] = [WORKERS_GROUP, int(results_ttl_s), int(stream == self.keys.requests)]
        for item in entries:
            reply_index = keys.setdefault(item.reply[0], len(keys) + 1) if item.reply else 0
            args += [item.entry_id, reply_index, item.reply[1] if item.reply else b""]
        swept = await self.connection.scripts["sweep"](keys=list(keys), args=args)
        return [entry_id if isinstance(entry_id, bytes) else str(entry_id).encode() for entry_id in swept]

    async def held(self, request_ids: Collection[str], results: str) -> set[str]:
        """Which of `request_ids` Redis still holds: an entry queued or pending in a requests stream (shared, tokens,
        or a registered worker's pinned stream), or a result in the results stream `results`.

        What a producer asks after Redis restarted or failed over, to resubmit what it lost. The requests streams are
        read before the results stream: a worker's publish script adds a result and deletes its request in one step,
        so a request answered during the scan is still found. One that a reaper moves between streams during the
        scan may be missed and sent again, which delivers it twice (at-least-once; the producer drops the
        duplicate result). Cost: one pass over each stream, 1,000 entries per XRANGE, each entry decoded.
        """
        wanted = set(request_ids)
        if not wanted:
            return set()
        streams = [self.keys.requests, self.keys.token_requests]
        workers: Any = await self.redis.smembers(self.keys.workers)
        streams += [self.keys.pinned_requests(w.decode() if isinstance(w, bytes) else w) for w in workers]
        found: set[str] = set()
        for stream in [*streams, results]:
            start = b"-"
            while True:
                records: Any = await self.redis.xrange(stream, min=start, count=1000)
                for _, fields in records:
                    with contextlib.suppress(ProtocolError):
                        request_id = getattr(decode(fields.get(PAYLOAD_FIELD, b"")), "request_id", None)
                        if request_id in wanted:
                            found.add(request_id)
                if len(records) < 1000:
                    break
                start = b"(" + records[-1][0]
        return found

    async def read_results(
        self,
        stream: str,
        last_id: bytes,
        done_ids: list[bytes],
        block_ms: int,
        state: str,
        adapters: Sequence[str] = (),
    ) -> tuple[list[Any], int, dict[str, int]]:
        """XDEL the results already consumed, XREAD new ones after `last_id`, and read the committed weight version
        (and the newest version of each of `adapters`) from the state hash `state` as it is right after they arrived
        (Redis runs a connection's commands in order, so the HMGET waits behind the blocking read): one round trip.
        Returns (records, committed, {adapter: its newest version, for those loaded})."""
        fields = [StateField.WEIGHT_VERSION, *(StateField.adapter(name) for name in adapters)]
        commands: list[tuple[Any, ...]] = [("XDEL", stream, *done_ids)] if done_ids else []
        commands += [("XREAD", "COUNT", 1000, "BLOCK", block_ms, "STREAMS", stream, last_id), ("HMGET", state, *fields)]
        *_, reply, (committed, *held) = await self.connection.execute(*commands)
        versions = {name: _adapter_version(value) for name, value in zip(adapters, held, strict=True) if value}
        return next((records for _, records in stream_records(reply)), []), int(committed or 0), versions

    async def depth(self, stream: str) -> dict[str, int]:
        """Length (queued + in flight, since acked entries are deleted) and pending count of a requests stream."""
        group = await self.connection.group_info(stream)
        length = await self.redis.xlen(stream)
        pending = group["pending"] if group else 0
        return {"length": length, "pending": pending, "queued": max(0, length - pending)}

    async def loads(self) -> dict[str, int]:
        """Each worker's load: the tokens of work it holds (prompt plus `max_tokens` of each request it took and has
        not answered), as placement counts it. Reads the whole hash: for `status`, not for a hot path."""
        fields: Any = await self.redis.hgetall(self.keys.loads)
        suffixes = tuple(x.encode() for x in (PINNED_SUFFIX, HOLDS_SUFFIX, IN_SUFFIX))
        return {
            k.decode(): max(0, int(v)) for k, v in fields.items() if not k.endswith(suffixes) and not k.startswith(b"*")
        }


def _adapter_version(field: bytes | str) -> int:
    """The version in an `adapter:{name}` field's value (`{version}:{path}`)."""
    return int((field.decode() if isinstance(field, bytes) else field).split(":", 1)[0])
