"""The data plane on Redis Streams: the only module that spells XADD, XREADGROUP, XACK and XDEL.

Protocol (DESIGN.md section 3):
- Producers enqueue with one Lua script (`ENQUEUE`) per chunk: it places each session on a worker
  (sticky + least-loaded, shared by every producer because it runs in Redis), refuses the chunk if
  a target stream is over `max_queued_requests`, and XADDs the entries. Atomic: all or nothing.
- Workers XREADGROUP their pinned stream and the shared one, never more than their free capacity;
  tokenize requests have a stream of their own, served even while the fleet is paused.
- A worker publishes a result and XACKs + XDELs its request in one script, and only if the XACK returned 1:
  a worker presumed dead whose request was requeued meanwhile publishes nothing for it (fencing).
- A dead worker's pending entries are requeued (same payload, session, epoch; delivery count in field `d`)
  by the same script that acks them; its pinned stream is drained the same way, sessions re-placed.

Every script (in `dataplane/scripts.py`) declares every key it touches in KEYS, built by `Keys` (Redis Cluster needs
exactly this).
The placement scripts take the registered workers' keys (`Keys.fleet`); if the set of workers changed
since this process last read it, the script answers `stale` and the call is rebuilt with the new set.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from rollout_svc.dataplane.direct import DirectConnection, borrowed, stream_records
from rollout_svc.dataplane.scripts import (
    DEAD_LETTER_LUA,
    ENQUEUE_LUA,
    FINISH_SESSION_LUA,
    FORGET_CONSUMER_LUA,
    PIN_LUA,
    PUBLISH_LUA,
    SWEEP_LUA,
    TAKE_LUA,
)
from rollout_svc.errors import ProtocolError, QueueFullError
from rollout_svc.keys import (
    COST_FIELD,
    DELIVERIES_FIELD,
    EPOCH_FIELD,
    FREE_SUFFIX,
    MAX_COST,
    PAYLOAD_FIELD,
    PINNED_SUFFIX,
    SESSION_FIELD,
    WORKERS_GROUP,
    DeadLetterField,
    EnqueueKind,
    Keys,
    ScriptReply,
    StateField,
)
from rollout_svc.protocol import ErrorCode, ErrorResult, decode, encode, reply_address

log = logging.getLogger("rollout_svc.dataplane")

ENQUEUE_CHUNK = 1000  # entries per script call: bounds how long one call blocks Redis
TAKE_PEEK = 4096  # the most queued entries a take looks at to compute its fair share (TAKE_LUA)
STALE_RETRIES = 5  # rebuilds of a placement call whose worker set changed under it


@dataclass(frozen=True, slots=True)
class Entry:
    """One request entry in a requests stream. `deliveries` counts this delivery (1 = first).

    `session_id` and `epoch` are the entry's fields (see `keys.py`), readable without decoding `payload`.
    """

    stream: str
    entry_id: bytes
    payload: bytes
    deliveries: int
    session_id: str | None = None
    epoch: int = 0
    cost: int = 0  # tokens (`RolloutRequest.cost_tokens`); 0: unknown


@dataclass(frozen=True, slots=True)
class Enqueue:
    """A request to add to the queue: its payload and session; for a requeue, deliveries so far and its epoch.

    `tokens`: a tokenize / detokenize / chat-template request (its own stream; no session). `cost`: the work a
    rollout request brings, in tokens (`RolloutRequest.cost_tokens`; 0: unknown), which placement shares out.
    `forward`: a session's request sent on to the worker holding the session (`pin_session`), kept there even if
    that worker drains: it runs a request of the session, and a session runs on one worker at a time (its drain
    requeues what is left in its pinned stream, placed anew).
    """

    payload: bytes
    session_id: str | None = None
    deliveries: int = 0
    epoch: int | None = None  # None: the current control epoch
    tokens: bool = False
    cost: int = 0
    forward: bool = False


@dataclass(frozen=True, slots=True)
class Placed:
    """Where an enqueued request went: its stream and entry id (what a cancel needs to sweep it)."""

    stream: str
    entry_id: bytes


@dataclass(frozen=True, slots=True)
class Sweep:
    """An entry to delete if still undelivered, and the answer (results stream, payload) to send its producer."""

    entry_id: bytes
    reply: tuple[str, bytes] | None = None


class RequestStreams:
    """Data-plane operations on one Redis client; caches the registered worker ids the scripts declare.

    `on_own_connection()` gives a copy for one sequential user of the hot paths (a worker's take loop or publisher,
    a producer's submitter or result reader) whose take, blocking reads, publish, enqueue and result reads go over
    a `DirectConnection`; everything else goes through the client."""

    def __init__(self, redis: Redis, keys: Keys, session_ttl_s: float, direct: DirectConnection | None = None) -> None:
        self.redis, self.keys, self.direct = redis, keys, direct
        self._session_ttl_ms = int(session_ttl_s * 1000)
        self._scripts = {
            name: redis.register_script(lua)
            for name, lua in (
                ("enqueue", ENQUEUE_LUA),
                ("pin", PIN_LUA),
                ("finish", FINISH_SESSION_LUA),
                ("publish", PUBLISH_LUA),
                ("dead_letter", DEAD_LETTER_LUA),
                ("sweep", SWEEP_LUA),
                ("take", TAKE_LUA),
                ("forget_consumer", FORGET_CONSUMER_LUA),
            )
        }
        self._workers: list[str] | None = None  # registered worker ids, as the scripts were last given them

    def on_own_connection(self) -> RequestStreams:
        """A copy whose hot paths go over a connection of its own (`DirectConnection`), for one sequential user;
        `aclose()` gives the connection back."""
        return RequestStreams(self.redis, self.keys, self._session_ttl_ms / 1000, DirectConnection(self.redis))

    async def aclose(self) -> None:
        """Give back the connection of `on_own_connection` (nothing to do for a copy without one)."""
        if self.direct is not None:
            await self.direct.aclose()

    def _connection(self) -> contextlib.AbstractAsyncContextManager[DirectConnection]:
        """The hot paths' connection (`DirectConnection`, not retried): this copy's own, or one borrowed from the
        pool for the call."""
        return contextlib.nullcontext(self.direct) if self.direct is not None else borrowed(self.redis)

    async def _execute(self, *commands: Sequence[Any]) -> list[Any]:
        """`commands` in one round trip on the hot paths' connection; their replies. Raises the first error."""
        async with self._connection() as direct:
            replies = await direct.execute(*commands)
        if errors := [reply for reply in replies if isinstance(reply, ResponseError)]:
            raise errors[0]
        return replies

    async def _script(self, name: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        async with self._connection() as direct:
            [reply] = await direct.scripts(self._scripts[name], [(keys, args)])
            return reply

    async def ensure_group(self, stream: str) -> None:
        """Create the `workers` consumer group (and the stream) if missing. From id 0: nothing queued is skipped.

        Checks before creating, and again after a failed create (another process won the race), rather
        than parsing BUSYGROUP out of the error text, which fakeredis' TCP server does not pass on.
        """
        if await self._group_info(stream) is not None:
            return
        try:
            await self.redis.xgroup_create(stream, WORKERS_GROUP, id="0", mkstream=True)
        except ResponseError:
            if await self._group_info(stream) is None:
                raise

    async def _group_info(self, stream: str) -> dict[str, Any] | None:
        """XINFO GROUPS' entry for the `workers` group, or None. Asks EXISTS first: an error reply
        would make fakeredis' TCP server drop the connection."""
        if not await self.redis.exists(stream):
            return None
        try:
            groups: Any = await self.redis.xinfo_groups(stream)
        except ResponseError:
            # Deleted since EXISTS (a worker that stopped cleaned up its pinned stream while another reaped it).
            if await self.redis.exists(stream):
                raise
            return None
        return next((g for g in groups if g["name"] == WORKERS_GROUP.encode()), None)

    async def load_scripts(self) -> None:
        """Load the Lua scripts once, so that no EVALSHA meets NOSCRIPT in the normal course."""
        for script in self._scripts.values():
            script.sha = await self.redis.script_load(script.script)

    async def _fleet(self, refresh: bool = False) -> list[str]:
        if self._workers is None or refresh:
            members: Any = await self.redis.smembers(self.keys.workers)
            self._workers = sorted(m.decode() for m in members)
        return self._workers

    async def _placement(self, name: str, build: Any) -> tuple[list[str], Any]:
        """Run a placement script; `build(worker_ids)` gives its (keys, args). Rebuilt while the fleet is stale.

        Returns the keys it ran with and its reply.
        """
        for attempt in range(STALE_RETRIES):
            keys, args = build(await self._fleet(refresh=attempt > 0))
            reply = await self._scripts[name](keys=keys, args=args)
            if reply[0] != ScriptReply.STALE:
                return keys, reply
        raise RuntimeError(f"the set of workers kept changing during {name}; retry")

    # --- producers --------------------------------------------------------------------------------------

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
                placed[at] = self._placed(items, *reply, limit)
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

    async def _run_enqueue_calls(self, chunks: Sequence[tuple[Sequence[Enqueue], int]]) -> list[tuple[list[str], Any]]:
        """EVALSHA each chunk in one pipeline; returns (keys, reply) per chunk. Not through redis-py's
        script-in-pipeline support: that costs a SCRIPT EXISTS round trip per pipeline. NOSCRIPT (Redis
        restarted) reloads the script and sends the calls again (`DirectConnection.scripts`); a stale worker set
        is retried for just the chunks that did not run."""
        script = self._scripts["enqueue"]
        done: dict[int, tuple[list[str], Any]] = {}
        todo = list(range(len(chunks)))
        for attempt in range(STALE_RETRIES):
            workers = await self._fleet(refresh=attempt > 0)
            calls = {i: self._enqueue_call(*chunks[i], workers, []) for i in todo}
            async with self._connection() as direct:
                replies = await direct.scripts(script, list(calls.values()))
            for i, reply in zip(todo, replies, strict=True):
                if reply[0] != ScriptReply.STALE:
                    done[i] = (calls[i][0], reply)
            todo = [i for i in todo if i not in done]
            if not todo:
                return [done[i] for i in range(len(chunks))]
        raise RuntimeError("the set of workers kept changing during enqueue; retry")

    def _enqueue_call(
        self, items: Sequence[Enqueue], limit: int, workers: list[str], acks: Iterable[Entry]
    ) -> tuple[list[str], list[str | bytes | int]]:
        keys = [self.keys.requests, self.keys.token_requests, *self.keys.fleet(workers)]
        args: list[str | bytes | int] = [self._session_ttl_ms, limit, WORKERS_GROUP, len(workers), *workers, len(items)]
        for item in items:
            sid = "" if item.tokens else item.session_id or ""
            if sid:
                keys.append(self.keys.session(sid))
            kind = EnqueueKind.TOKENS if item.tokens else EnqueueKind.FORWARD if item.forward else EnqueueKind.ROLLOUT
            if item.epoch is not None or item.deliveries:  # a requeue keeps its epoch and counts its deliveries
                kind = f"{kind} {item.deliveries} {'' if item.epoch is None else item.epoch}"
            args += [kind, sid, item.cost, item.payload]
        index: dict[str, int] = {}
        ack_args: list[str | bytes | int] = []
        for entry in acks:
            if entry.stream not in index:
                keys.append(entry.stream)
                index[entry.stream] = len(keys)
            ack_args += [index[entry.stream], entry.entry_id]
        return keys, [*args, len(ack_args) // 2, *ack_args]

    def _placed(self, items: Sequence[Enqueue], keys: list[str], reply: list, limit: int) -> list[Placed]:
        if reply[0] == ScriptReply.FULL:
            raise QueueFullError(reply[1].decode(), int(reply[2]), limit)
        targets = iter(reply[len(items) + 1 :])  # the target of each session item, in order
        placed = []
        for item, entry_id in zip(items, reply[1 : len(items) + 1], strict=True):
            if item.tokens:
                stream = self.keys.token_requests
            elif item.session_id:
                stream = keys[int(next(targets)) - 1]
            else:
                stream = self.keys.requests
            placed.append(Placed(stream, entry_id))
        return placed

    async def finish_session(self, session_id: str) -> bool:
        """Unpin a session; its next turn is placed anew. Returns whether it was pinned."""

        def build(workers: list[str]) -> tuple[list[str], list[Any]]:
            keys = [*self.keys.fleet(workers), self.keys.session(session_id)]
            return keys, [len(workers), *workers, session_id]

        _, reply = await self._placement("finish", build)
        return bool(int(reply[1]))

    async def pinned_worker(self, session_id: str) -> str | None:
        value: Any = await self.redis.get(self.keys.session(session_id))
        return value.decode() if value else None

    async def sweep(self, stream: str, entries: Sequence[Sweep], results_ttl_s: float) -> list[bytes]:
        """Delete the entries still undelivered and send each its answer, atomically. Returns the ids of those that
        went (a delivered one is its worker's to answer)."""
        keys: dict[str, int] = {stream: 1}
        args: list[str | bytes | int] = [WORKERS_GROUP, int(results_ttl_s)]
        for item in entries:
            reply_index = keys.setdefault(item.reply[0], len(keys) + 1) if item.reply else 0
            args += [item.entry_id, reply_index, item.reply[1] if item.reply else b""]
        swept = await self._scripts["sweep"](keys=list(keys), args=args)
        return [entry_id if isinstance(entry_id, bytes) else str(entry_id).encode() for entry_id in swept]

    # --- workers ----------------------------------------------------------------------------------------

    async def pin_session(self, session_id: str, worker_id: str) -> str | None:
        """Pin a session to `worker_id` unless a live worker already holds it (a draining one included: it may be
        running a request of the session); returns the holder."""

        def build(workers: list[str]) -> tuple[list[str], list[Any]]:
            keys = [*self.keys.fleet(workers), self.keys.session(session_id)]
            return keys, [self._session_ttl_ms, len(workers), *workers, session_id, worker_id]

        _, reply = await self._placement("pin", build)
        return reply[1].decode() or None

    async def wait_for_entries(self, worker_id: str, block_ms: int, count: int = 1) -> list[Entry]:
        """Block up to `block_ms` on the worker's pinned stream and the shared one, taking the next entries of each
        (up to `count`): what wakes an idle worker, whose next `take` shares out the rest (fewer than `count` from
        each: there was no rest)."""
        pinned, shared = self.keys.pinned_requests(worker_id), self.keys.requests
        return await self._readgroup(worker_id, {pinned: ">", shared: ">"}, count, block_ms)

    async def take(
        self,
        worker_id: str,
        free: int,
        loads_ttl_ms: int,
        carried_tokens: int = 0,
        idle: bool = False,
        share: bool = True,
        carried_pinned: int = 0,
    ) -> tuple[list[Entry], bool]:
        """One non-blocking take (`TAKE_LUA`): pinned entries, then the share of the shared queue that brings this
        worker's load (tokens) to the level of the open workers' loads with the queued work spread over them; at
        least one entry if it is the least loaded. Adds what it took, and `carried_tokens` (the cost of what its
        `wait_for_entries` took), to its load in `Keys.loads`, after setting it to 0 if `idle` (it holds nothing,
        every result published); `loads_ttl_ms`: how long a worker's reported free slots count (its heartbeat
        TTL). Without `share` (placement `fifo`) it takes whatever fits its free slots. `carried_pinned`: the part
        of `carried_tokens` read from its pinned stream, taken off its pinned tokens (ID:pinned). Returns the
        entries and whether queued entries were left to other workers' shares."""
        keys = [self.keys.pinned_requests(worker_id), self.keys.requests, self.keys.loads]
        args: list[str | int] = [WORKERS_GROUP, worker_id, free, loads_ttl_ms, TAKE_PEEK, carried_tokens, int(idle)]
        args += [int(share), carried_pinned]
        reply: Any = await self._script("take", keys, args)
        left = bool(reply) and reply[-1] == ScriptReply.LEFT
        entries = []
        for stream, records in reply[:-1] if left else reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            entries += [_entry(name, entry_id, _fields(fields), delivered=1) for entry_id, fields in records]
        return entries, left

    async def report_load(self, worker_id: str, free: int) -> None:
        """Record this worker's free slots (0 while it takes nothing: paused, draining), and when: a publish of
        nothing, so the one script that writes the field stamps it with Redis's clock, as the take script reads it
        (a worker host's clock may be off)."""
        await self.publish([], 0, load=(worker_id, free))

    async def idle_workers(self, worker_id: str, ttl_ms: int) -> list[str]:
        """The other workers that hold no work (load 0 in `Keys.loads`, and nothing placed in their pinned stream
        that they have not taken: a straggler moved there a moment ago counts) and said within `ttl_ms` (Redis's
        clock) that they have a free slot: where a straggler may move. Sorted by id."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.loads)
        pipe.time()
        fields, (seconds, micros) = await pipe.execute()
        now_ms = seconds * 1000 + micros // 1000
        table = {k.decode(): v.decode() for k, v in fields.items()}
        idle = []
        for key, value in table.items():
            if not key.endswith(FREE_SUFFIX) or (other := key[: -len(FREE_SUFFIX)]) == worker_id:
                continue
            slots, _, at_ms = value.partition(" ")
            holds = int(table.get(other, "0")) > 0 or int(table.get(other + PINNED_SUFFIX, "0")) > 0
            if int(slots or 0) > 0 and int(at_ms or 0) + ttl_ms >= now_ms and not holds:
                idle.append(other)
        return sorted(idle)

    async def hand_over(self, worker_id: str, item: Enqueue) -> bytes:
        """Add `item` (a rollout request) to `worker_id`'s pinned stream, past admission: a straggler moved there
        (its old entry is acknowledged after, by the worker that moved it: a move is delivered at least once).
        Returns its entry id."""
        fields: dict[bytes, bytes | int] = {PAYLOAD_FIELD: item.payload, EPOCH_FIELD: item.epoch or 0}
        if item.cost:
            fields[COST_FIELD] = item.cost
        pipe = self.redis.pipeline(transaction=True)  # counted as placement counts it (`Keys.loads` ID:pinned)
        pipe.xadd(self.keys.pinned_requests(worker_id), fields)  # type: ignore[arg-type]
        pipe.hincrby(self.keys.loads, worker_id + PINNED_SUFFIX, min(max(item.cost, 1), MAX_COST))
        entry_id, _ = await pipe.execute()
        return entry_id if isinstance(entry_id, bytes) else entry_id.encode()

    async def loads(self) -> dict[str, int]:
        """Each worker's load: the tokens of work it holds (prompt plus `max_tokens` of each request it took and has
        not answered), as placement counts it."""
        fields: Any = await self.redis.hgetall(self.keys.loads)
        suffixes = (FREE_SUFFIX.encode(), PINNED_SUFFIX.encode())
        return {k.decode(): max(0, int(v)) for k, v in fields.items() if not k.endswith(suffixes)}

    async def forget_load(self, worker_id: str) -> None:
        await self.redis.hdel(self.keys.loads, worker_id, worker_id + FREE_SUFFIX, worker_id + PINNED_SUFFIX)

    async def read_tokens(self, worker_id: str, count: int, block_ms: int) -> list[Entry]:
        """Take at most `count` tokenize / detokenize / chat-template requests."""
        return await self._readgroup(worker_id, {self.keys.token_requests: ">"}, count, block_ms)

    async def _readgroup(self, consumer: str, streams: dict, count: int, block_ms: int | None) -> list[Entry]:
        block = [] if block_ms is None else ["BLOCK", block_ms]
        read = ("XREADGROUP", "GROUP", WORKERS_GROUP, consumer, "COUNT", count, *block, "STREAMS", *streams)
        [reply] = await self._execute((*read, *streams.values()))
        entries = []
        for stream, records in stream_records(reply):
            name = stream.decode() if isinstance(stream, bytes) else stream
            entries += [_entry(name, entry_id, fields, delivered=1) for entry_id, fields in records]
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
        keys: dict[str, int] = {self.keys.loads: 1}  # stream name -> its 1-based index in KEYS
        load_args = ["", ""] if load is None else [load[0], str(max(load[1], 0))]
        args: list[str | bytes | int] = [int(results_ttl_s), WORKERS_GROUP, *load_args, *woken]
        for entry, result in items:
            reply_index = keys.setdefault(result[0], len(keys) + 1) if result else 0
            args += [reply_index, result[1] if result else b"", keys.setdefault(entry.stream, len(keys) + 1)]
            args += [entry.entry_id, entry.cost]
        return int(await self._script("publish", list(keys), args))

    async def send_chunk(self, stream: str, payload: bytes, results_ttl_s: float) -> None:
        """XADD a streaming chunk to a results stream (no ack: the final result is published with its ack), and
        EXPIRE the stream, so chunks for a producer that went away expire with its stream."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(stream, {PAYLOAD_FIELD: payload})
        pipe.expire(stream, int(results_ttl_s))
        await pipe.execute()

    async def dead_letter(
        self, entry: Entry, code: ErrorCode, message: str, worker_id: str, *, maxlen: int, results_ttl_s: float
    ) -> bool:
        """Move an entry to the dead-letter stream (with `code` and `message`, in words, and who dead-lettered it:
        `worker_id`, empty for a reaper), tell its producer if the payload names one (an `ErrorResult`), XACK + XDEL
        it: one script, fenced like a publish. `maxlen`: the stream's approximate cap. Returns False if the entry
        was no longer pending here (requeued meanwhile)."""
        log.warning("dead letter %s %s: %s", entry.stream, entry.entry_id, message)
        reason, reply = code, None
        if (address := reply_address(entry.payload)) is not None:
            error = ErrorResult(request_id=address[0], code=code, message=message, worker_id=worker_id)
            reply = (address[1], encode(error))
        keys = [entry.stream, self.keys.dead, reply[0] if reply else self.keys.dead]
        fields: list[str | bytes | int] = [DeadLetterField.PAYLOAD, entry.payload, DeadLetterField.REASON, reason]
        fields += [DeadLetterField.STREAM, entry.stream, DeadLetterField.ENTRY_ID, entry.entry_id]
        fields += [DeadLetterField.DELIVERIES, entry.deliveries, DeadLetterField.WORKER_ID, worker_id]
        fields += [DeadLetterField.MESSAGE, message]
        args = [WORKERS_GROUP, entry.entry_id, maxlen, int(results_ttl_s), reply[1] if reply else b"", *fields]
        return bool(await self._scripts["dead_letter"](keys=keys, args=args))

    async def delete_dead_letters(self, entry_ids: Sequence[str | bytes]) -> int:
        """Delete dead letters (replayed by an operator) from the dead-letter stream; returns how many were there."""
        return int(await self.redis.xdel(self.keys.dead, *entry_ids)) if entry_ids else 0

    # --- reclaiming a dead worker's requests --------------------------------------------------------------

    async def pending_of(self, stream: str, consumer: str, count: int = 1000) -> list[Entry]:
        """Entries delivered to `consumer` and not acked, with their delivery counts (XPENDING + XRANGE)."""
        if await self._group_info(stream) is None:
            return []  # no such stream or group: nothing pending
        pending: Any = await self.redis.xpending_range(stream, WORKERS_GROUP, "-", "+", count, consumername=consumer)
        pipe = self.redis.pipeline(transaction=False)
        for item in pending:
            pipe.xrange(stream, item["message_id"], item["message_id"])
        entries = []
        for item, records in zip(pending, await pipe.execute(), strict=True):
            fields = records[0][1] if records else {}  # no record: deleted under us; requeued as empty
            entries.append(_entry(stream, item["message_id"], fields, delivered=item["times_delivered"]))
        return entries

    async def undelivered(self, stream: str, count: int = 1000, after: bytes | None = None) -> list[Entry]:
        """Entries of a stream not yet delivered to any consumer (after the group's last-delivered id, or after
        `after` if that is later: a caller paging through a long backlog passes the last id it saw)."""
        group = await self._group_info(stream)
        if group is None:
            if not await self.redis.exists(stream):
                return []
            start = b"-"  # a stream no worker has read yet: all of it is undelivered
        else:
            start = b"(" + group["last-delivered-id"]
        if after is not None and (start == b"-" or entry_id_key(after) > entry_id_key(start[1:])):
            start = b"(" + after
        records: Any = await self.redis.xrange(stream, min=start, count=count)
        return [_entry(stream, entry_id, fields, delivered=0) for entry_id, fields in records]

    async def last_id(self, stream: str) -> bytes | None:
        """The id of a stream's newest entry; None if it has none."""
        records: Any = await self.redis.xrevrange(stream, count=1)
        return records[0][0] if records else None

    async def orphans(self, stream: str, count: int = 1000) -> list[Entry]:
        """Entries at or before the group's last-delivered id that no consumer holds pending: no `>` read will ever
        deliver them. Normally there are none (an answered entry is acked and deleted in one script); a Redis that
        replayed a transaction its append-only file had cut short (killed mid-write, then written to, then
        restarted) brings such entries back behind the group."""
        group = await self._group_info(stream)
        if group is None:
            return []
        last, start = group["last-delivered-id"], b"-"
        found: list[Entry] = []
        while len(found) < count:  # page by page: orphans may lie behind more than `count` held entries
            records: Any = await self.redis.xrange(stream, min=start, max=last, count=count)
            if not records:
                break
            first, final = records[0][0], records[-1][0]
            # as many pending as the page has entries, and more: the pending list may name entries deleted since
            pending: Any = await self.redis.xpending_range(stream, WORKERS_GROUP, first, final, 2 * len(records) + 16)
            held = {item["message_id"] for item in pending}
            found += [_entry(stream, i, fields, delivered=0) for i, fields in records if i not in held]
            if len(records) < count or final == last:
                break
            start = b"(" + final  # exclusive, as `undelivered` pages
        return found[:count]

    async def pending_ids(self, stream: str, consumer: str, count: int) -> set[bytes]:
        """The ids of up to `count` entries of `stream` delivered to `consumer` and not acked (XPENDING)."""
        if await self._group_info(stream) is None:
            return set()
        pending: Any = await self.redis.xpending_range(stream, WORKERS_GROUP, "-", "+", count, consumername=consumer)
        return {item["message_id"] for item in pending}

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

    async def requeue(self, items: Sequence[Enqueue], done: Iterable[Entry]) -> list[Placed]:
        """In one script: enqueue `items` again (no admission limit: nothing is lost), XACK + XDEL `done`."""
        done = list(done)

        def build(workers: list[str]) -> tuple[list[str], list[Any]]:
            return self._enqueue_call(items, -1, workers, done)

        keys, reply = await self._placement("enqueue", build)
        return self._placed(items, keys, reply, -1)

    async def delete(self, stream: str) -> None:
        """Delete a stream (a reclaimed worker's pinned stream, once drained)."""
        await self.redis.delete(stream)

    async def forget_consumer(self, stream: str, consumer: str) -> bool:
        """Delete a consumer of the `workers` group if it holds no pending entry (one script). Returns False if it
        holds some: requeue them and ask again (deleting it would drop them, never to be delivered again)."""
        return bool(await self._scripts["forget_consumer"](keys=[stream], args=[WORKERS_GROUP, consumer]))

    async def orphaned_consumers(self, stream: str, idle_ms: int) -> list[str]:
        """Consumers of `stream`'s group holding pending entries and idle for `idle_ms` or longer (XINFO CONSUMERS)."""
        try:
            consumers: Any = await self.redis.xinfo_consumers(stream, WORKERS_GROUP)
        except ResponseError:  # no such stream or group
            return []
        names = [c["name"] for c in consumers if c["pending"] > 0 and c["idle"] >= idle_ms]
        return [n.decode() if isinstance(n, bytes) else n for n in names]

    # --- results and inspection -------------------------------------------------------------------------

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
        *_, reply, (committed, *held) = await self._execute(*commands)
        versions = {name: _adapter_version(value) for name, value in zip(adapters, held, strict=True) if value}
        return next((records for _, records in stream_records(reply)), []), int(committed or 0), versions

    async def depth(self, stream: str) -> dict[str, int]:
        """Length (queued + in flight, since acked entries are deleted) and pending count of a requests stream."""
        group = await self._group_info(stream)
        length = await self.redis.xlen(stream)
        pending = group["pending"] if group else 0
        return {"length": length, "pending": pending, "queued": max(0, length - pending)}


def _adapter_version(field: bytes | str) -> int:
    """The version in an `adapter:{name}` field's value (`{version}:{path}`)."""
    return int((field.decode() if isinstance(field, bytes) else field).split(":", 1)[0])


def _entry(stream: str, entry_id: bytes, fields: dict[bytes, bytes], delivered: int) -> Entry:
    session = fields.get(SESSION_FIELD)
    return Entry(
        stream,
        entry_id,
        fields.get(PAYLOAD_FIELD, b""),
        int(fields.get(DELIVERIES_FIELD, 0)) + delivered,
        session.decode() if session else None,
        int(fields.get(EPOCH_FIELD, 0)),
        entry_cost(fields.get(COST_FIELD)),
    )


def entry_cost(value: bytes | None) -> int:
    """An entry's cost field as the take script counts it (`cost_of`): at most `MAX_COST`; 0 when absent (1 for
    anything else that is not a positive number: the script's count for it)."""
    if value is None:
        return 0
    try:
        cost = float(value)
    except ValueError:
        return 1
    return int(min(cost, MAX_COST)) if cost >= 1 else 1


def _fields(flat: list[bytes]) -> dict[bytes, bytes]:
    """A Lua reply's field list (name, value, name, value, ...) as XREADGROUP's dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def entry_id_key(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id (`b"1700000000000-3"`) as (milliseconds, sequence), ordered as Redis orders ids."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)
