"""What a worker calls on the data plane: take its share, wait for entries, publish results, pins and its load."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from rollout_svc.dataplane.direct import stream_records
from rollout_svc.dataplane.streams import Enqueue, Entry, StreamSide, parse_entry
from rollout_svc.keys import COST_FIELD, EPOCH_FIELD, PAYLOAD_FIELD, WORKERS_GROUP

TAKE_PEEK = 4096  # the most queued entries a take weighs to compute its fair share (TAKE_LUA)


@dataclass(frozen=True, slots=True)
class TakePlan:
    """A take's plan (`WorkerStreams.plan_take`): entries to read from `worker_id`'s pinned stream and from the
    shared one, the (tokens, pinned tokens) it `counted` for them, whether it `left` waiting entries to other workers'
    shares, and whether nothing is left waiting for it (`drained`)."""

    worker_id: str
    pinned: int
    shared: int
    counted: tuple[int, int]
    left: bool
    drained: bool


@dataclass(frozen=True, slots=True)
class Taken:
    """What one take read (`WorkerStreams.take`): its `entries`; `left`: waiting entries were left to other workers'
    shares; `drained`: nothing was left waiting for it (its next read may block); `unplanned`: (tokens, pinned
    tokens) its reads cost beyond the plan (negative: short of it), for its next script call to count."""

    entries: list[Entry]
    left: bool
    drained: bool
    unplanned: tuple[int, int]


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
    ) -> Taken:
        """One non-blocking take of up to `free` entries: `plan_take`, then `read_plan` (two round trips)."""
        return await self.read_plan(await self.plan_take(options, free, carried, idle=idle))

    async def plan_take(
        self, options: TakeOptions, free: int, carried: tuple[int, int] = (0, 0), *, idle: bool = False
    ) -> TakePlan:
        """How many entries of its pinned stream and of the shared one this worker takes, of up to `free`
        (`TAKE_LUA`, one script call, which reads no entry): its pinned entries, then the share of the shared queue
        that brings its load (tokens) to the level of the open workers' loads with the queued work spread over them;
        at least one entry if it is the least loaded (without `options.share`: whatever fits). The plan counts what
        it takes in `Keys.loads` at once, with `carried`: (tokens, pinned tokens) that earlier reads took and no
        script counted yet (`workers.inflight.Woken`); `idle` (it holds nothing, every result published) sets its
        load to 0 first."""
        worker_id = options.worker_id
        pinned = self.keys.pinned_requests(worker_id)
        args: list[str | int] = [WORKERS_GROUP, worker_id, free, options.loads_ttl_ms, TAKE_PEEK, carried[0], int(idle)]
        args += [int(options.share), carried[1], options.kv_cache_tokens, options.max_model_len]
        reply: Any = await self.connection.script("take", [pinned, self.keys.requests, *self.keys.load_keys], args)
        pinned_count, shared_count, tokens, pinned_tokens, left, drained = (int(v) for v in reply)
        return TakePlan(worker_id, pinned_count, shared_count, (tokens, pinned_tokens), bool(left), bool(drained))

    async def read_plan(self, plan: TakePlan) -> Taken:
        """Read what `plan` counted, plainly (one round trip: XREADGROUP from a script costs Redis several times
        more, `dataplane.take`). Returns the entries and what they cost beyond (or short of) the plan: another
        worker's read may have come between, taking entries of other costs."""
        pinned = self.keys.pinned_requests(plan.worker_id)
        reads = [(pinned, plan.pinned), (self.keys.requests, plan.shared)]
        commands = [self._readgroup_command(plan.worker_id, {s: ">"}, count, None) for s, count in reads if count]
        entries = self._entries(await self.connection.execute(*commands)) if commands else []
        tokens = sum(e.cost for e in entries)
        pinned_tokens = sum(e.cost for e in entries if e.stream == pinned)
        unplanned = (tokens - plan.counted[0], pinned_tokens - plan.counted[1])
        return Taken(entries, plan.left, plan.drained, unplanned)

    async def shared_waiting(self) -> int | None:
        """Entries of the shared stream delivered to no worker yet: its length less the `workers` group's pending
        entries (an answered entry is deleted), from two plain commands in one round trip (XLEN, XINFO GROUPS). What a
        worker that left queued entries to other workers' shares looks at before it takes again: most such takes
        found the others had taken them, and a take script costs Redis several times as much (BENCHMARKS.md (p)).
        None where it cannot tell (the stream or its group is missing: Redis lost them): take, which recreates them."""
        stream = self.keys.requests
        try:
            length, groups = await self.connection.execute(("XLEN", stream), ("XINFO", "GROUPS", stream))
        except ResponseError:
            return None
        for group in groups:
            info = group if isinstance(group, dict) else dict(zip(group[::2], group[1::2], strict=False))
            if info.get(b"name") == WORKERS_GROUP.encode():
                return int(length) - int(info.get(b"pending") or 0)
        return None

    async def wait_for_entries(self, worker_id: str, block_ms: int, count: int = 1, shared: bool = True) -> list[Entry]:
        """Block up to `block_ms` on the worker's pinned stream and the shared one (`shared` False: its pinned one
        alone), taking the next entries of each (up to `count`): what wakes an idle worker, whose next `take` shares
        out the rest (fewer than `count` from each: there was no rest)."""
        streams = {self.keys.pinned_requests(worker_id): ">"} | ({self.keys.requests: ">"} if shared else {})
        return await self._readgroup(worker_id, streams, count, block_ms)

    async def read_pinned(self, worker_id: str, count: int) -> list[Entry]:
        """Take up to `count` entries of the worker's pinned stream (its sessions'), without blocking: they are its own,
        no share to weigh. What they cost is for its next script call to count (`workers.inflight.Woken`)."""
        return await self._readgroup(worker_id, {self.keys.pinned_requests(worker_id): ">"}, count, None)

    async def read_tokens(self, worker_id: str, count: int, block_ms: int) -> list[Entry]:
        """Take at most `count` tokenize / detokenize / chat-template requests."""
        return await self._readgroup(worker_id, {self.keys.token_requests: ">"}, count, block_ms)

    async def _readgroup(self, consumer: str, streams: dict, count: int, block_ms: int | None) -> list[Entry]:
        return self._entries(await self.connection.execute(self._readgroup_command(consumer, streams, count, block_ms)))

    @staticmethod
    def _readgroup_command(consumer: str, streams: dict, count: int, block_ms: int | None) -> tuple[Any, ...]:
        block = [] if block_ms is None else ["BLOCK", block_ms]
        read = ("XREADGROUP", "GROUP", WORKERS_GROUP, consumer, "COUNT", count, *block, "STREAMS", *streams)
        return (*read, *streams.values())

    @staticmethod
    def _entries(replies: list[Any]) -> list[Entry]:
        entries = []
        for reply in replies:
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
    ) -> list[int]:
        """Atomically (one script): for each (entry, (results stream, payload) or None), XACK + XDEL the entry
        and XADD its result, but only where the XACK returned 1. Returns the positions in `items` (0-based) of those
        fenced (not published: the entry was no longer pending on this worker).
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
        return [int(position) - 1 for position in await self.connection.script("publish", list(keys), args)]

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
