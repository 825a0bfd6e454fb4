"""What a worker calls on the data plane: take its share, wait for entries, publish results, pins and its load."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rollout_svc.dataplane.direct import stream_records
from rollout_svc.dataplane.streams import Enqueue, Entry, StreamSide, parse_entry, script_fields
from rollout_svc.keys import COST_FIELD, EPOCH_FIELD, PAYLOAD_FIELD, WORKERS_GROUP, ScriptReply

TAKE_PEEK = 4096  # the most queued entries a take looks at to compute its fair share (TAKE_LUA)


@dataclass(frozen=True, slots=True)
class TakeOptions:
    """How a worker takes (`WorkerStreams.take`): the same for every take of one incarnation.

    `loads_ttl_ms`: how long a worker's reported free slots count as open (its heartbeat TTL). `share`: take its
    fair share of the shared queue (placement `cost`); False (`fifo`): whatever fits its free slots.
    `kv_cache_tokens` and `max_model_len`: what its engine holds (0: not known), by which its share is weighed
    against the other workers' and a request longer than its context is left to one whose context holds it."""

    worker_id: str
    loads_ttl_ms: int
    share: bool = True
    kv_cache_tokens: int = 0
    max_model_len: int = 0

    @property
    def holds(self) -> tuple[int, int]:
        return self.kv_cache_tokens, self.max_model_len


class WorkerStreams(StreamSide):
    """A worker's side of the data plane (`dataplane.streams` says how the streams work): its takes and blocking
    reads, its results published (acked, fenced), streaming chunks, session pins, straggler hand-overs, and its
    load in `Keys.loads`.

    `on_own_connection()` gives a copy for one sequential user of its hot paths (the take loop, the publisher):
    its takes, blocking reads and publishes then go over a `DirectConnection` of their own."""

    async def ensure_groups(self, worker_id: str) -> None:
        """Create the consumer groups of the streams `worker_id` reads, if missing: the shared and token requests
        streams and its pinned stream (`StreamConnection.ensure_group`)."""
        for stream in (self.keys.requests, self.keys.pinned_requests(worker_id), self.keys.token_requests):
            await self.connection.ensure_group(stream)

    async def take(
        self, options: TakeOptions, free: int, carried: tuple[int, int] = (0, 0), *, idle: bool = False
    ) -> tuple[list[Entry], bool]:
        """One non-blocking take (`TAKE_LUA`) of up to `free` entries: pinned entries, then the share of the shared
        queue that brings this worker's load (tokens) to the level of the open workers' loads with the queued work
        spread over them; at least one entry if it is the least loaded (without `options.share`: whatever fits).
        Adds what it took to its load in `Keys.loads`, and `carried`: (tokens, pinned tokens) that its
        `wait_for_entries` took (`workers.inflight.Woken`), the pinned ones also taken off its pinned tokens
        (ID:pinned); `idle` (it holds nothing, every result published) sets its load to 0 first. Returns the entries
        and whether queued entries were left to other workers' shares."""
        worker_id = options.worker_id
        keys = [self.keys.pinned_requests(worker_id), self.keys.requests, *self.keys.load_keys]
        args: list[str | int] = [WORKERS_GROUP, worker_id, free, options.loads_ttl_ms, TAKE_PEEK, carried[0], int(idle)]
        args += [int(options.share), carried[1], options.kv_cache_tokens, options.max_model_len]
        reply: Any = await self.connection.script("take", keys, args)
        left = bool(reply) and reply[-1] == ScriptReply.LEFT
        entries = []
        for stream, records in reply[:-1] if left else reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            entries += [parse_entry(name, entry_id, script_fields(fields), delivered=1) for entry_id, fields in records]
        return entries, left

    async def wait_for_entries(self, worker_id: str, block_ms: int, count: int = 1, shared: bool = True) -> list[Entry]:
        """Block up to `block_ms` on the worker's pinned stream and the shared one (`shared` False: its pinned one
        alone), taking the next entries of each (up to `count`): what wakes an idle worker, whose next `take` shares
        out the rest (fewer than `count` from each: there was no rest)."""
        streams = {self.keys.pinned_requests(worker_id): ">"} | ({self.keys.requests: ">"} if shared else {})
        return await self._readgroup(worker_id, streams, count, block_ms)

    async def read_tokens(self, worker_id: str, count: int, block_ms: int) -> list[Entry]:
        """Take at most `count` tokenize / detokenize / chat-template requests."""
        return await self._readgroup(worker_id, {self.keys.token_requests: ">"}, count, block_ms)

    async def _readgroup(self, consumer: str, streams: dict, count: int, block_ms: int | None) -> list[Entry]:
        block = [] if block_ms is None else ["BLOCK", block_ms]
        read = ("XREADGROUP", "GROUP", WORKERS_GROUP, consumer, "COUNT", count, *block, "STREAMS", *streams)
        [reply] = await self.connection.execute((*read, *streams.values()))
        entries = []
        for stream, records in stream_records(reply):
            name = stream.decode() if isinstance(stream, bytes) else stream
            entries += [parse_entry(name, entry_id, fields, delivered=1) for entry_id, fields in records]
        return entries

    async def publish(
        self,
        items: Iterable[tuple[Entry, tuple[str, bytes] | None]],
        results_ttl_s: float,
        load: tuple[str, int] | None = None,
        woken: tuple[int, int] = (0, 0),
    ) -> int:
        """Atomically (one script): for each (entry, (results stream, payload) or None), XACK + XDEL the entry
        and XADD its result, but only where the XACK returned 1. Returns how many were fenced (not published).
        `load`: (worker id, free slots after this publish): the entries' costs are taken off its load in
        `Keys.loads` in the same call, so a take's fair share never counts work already answered; `woken`:
        (tokens, pinned tokens) its blocking reads took that no take counted yet (`workers.inflight.Woken`): added
        to its load, and taken off its pinned tokens, first. Neither goes below 0."""
        keys = {key: i for i, key in enumerate(self.keys.load_keys, 1)}  # stream name -> its 1-based index in KEYS
        load_args = ["", ""] if load is None else [load[0], str(max(load[1], 0))]
        args: list[str | bytes | int] = [int(results_ttl_s), WORKERS_GROUP, *load_args, *woken]
        for entry, result in items:
            reply_index = keys.setdefault(result[0], len(keys) + 1) if result else 0
            args += [reply_index, result[1] if result else b"", keys.setdefault(entry.stream, len(keys) + 1)]
            args += [entry.entry_id, entry.cost]
        return int(await self.connection.script("publish", list(keys), args))

    async def send_chunk(self, stream: str, payload: bytes, results_ttl_s: float) -> None:
        """XADD a streaming chunk to a results stream (no ack: the final result is published with its ack), and
        EXPIRE the stream, so chunks for a producer that went away expire with its stream."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(stream, {PAYLOAD_FIELD: payload})
        pipe.expire(stream, int(results_ttl_s))
        await pipe.execute()

    async def report_load(self, worker_id: str, free: int, kv_cache_tokens: int = 0, max_model_len: int = 0) -> int:
        """Record this worker's free slots (0 while it takes nothing: paused, draining): open while it has one, stamped
        with Redis's clock (`dataplane.levels`; a worker host's clock may be off), and what its engine
        holds (its KV cache and context in tokens; 0: not known yet), by which takes weigh and fit work. Its load is
        left as it is. Returns the widest context any worker has said (0: none)."""
        holds = f"{kv_cache_tokens} {max_model_len}" if kv_cache_tokens > 0 and max_model_len > 0 else ""
        return int(await self.connection.script("report_load", self.keys.load_keys, [worker_id, max(free, 0), holds]))

    async def pin_session(self, session_id: str, worker_id: str) -> str | None:
        """Pin a session to `worker_id` unless a live worker already holds it (a draining one included: it may be
        running a request of the session); returns the holder."""
        keys = [*self.keys.fleet, self.keys.session(session_id)]
        args: list[str | int] = [self.connection.session_ttl_ms, *self.keys.worker_stems, session_id, worker_id]
        reply = await self.connection.scripts["pin"](keys=keys, args=args)
        return reply[1].decode() or None

    async def hand_over(self, worker_id: str, item: Enqueue) -> bytes:
        """Add `item` (a rollout request) to `worker_id`'s pinned stream, past admission: a straggler moved there
        (its old entry is acknowledged after, by the worker that moved it: a move is delivered at least once).
        Returns its entry id."""
        fields: list[bytes | int] = [PAYLOAD_FIELD, item.payload, EPOCH_FIELD, item.epoch or 0]
        if item.cost:
            fields += [COST_FIELD, item.cost]
        keys = [self.keys.pinned_requests(worker_id), *self.keys.load_keys]  # counted as placement counts it
        entry_id = await self.connection.scripts["hand_over"](keys=keys, args=[worker_id, item.cost, *fields])
        return entry_id if isinstance(entry_id, bytes) else entry_id.encode()

    async def idle_workers(self, worker_id: str, ttl_ms: int, limit: int = 64) -> list[str]:
        """Up to `limit` other open workers that hold no work (level 0 in `Keys.levels`: no load, and nothing placed
        in their pinned stream that they have not taken: a straggler moved there a moment ago counts) and said
        within `ttl_ms` (Redis's clock) that they have a free slot: where a straggler may move. Sorted by id."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrangebyscore(self.keys.levels, 0, 0, start=0, num=limit + 1)
        pipe.time()
        members, (seconds, micros) = await pipe.execute()
        others = [m.decode() for m in members if m.decode() != worker_id][:limit]
        if not others:
            return []
        said: Any = await self.redis.zmscore(self.keys.open_at, others)
        now_ms = seconds * 1000 + micros // 1000
        fresh = (w for w, at_ms in zip(others, said, strict=True) if at_ms is not None and at_ms + ttl_ms >= now_ms)
        return sorted(fresh)
