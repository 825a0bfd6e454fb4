"""The data plane on Redis Streams: the only module that spells XADD, XREADGROUP, XACK, XCLAIM and XDEL.

Protocol (DESIGN.md section 3):
- Producers enqueue with one Lua script (`ENQUEUE`) per batch: it places each session on a worker
  (sticky + least-loaded, shared by every producer because it runs in Redis), refuses the batch if
  a target stream is over `max_queued_requests`, and XADDs the entries. Atomic: all or nothing.
- Workers XREADGROUP their pinned stream first, then the shared one, never more than their free capacity.
- A worker publishes a result and XACKs + XDELs its request in one script (atomic), so no result is lost between
  the two and no request is acked without one. Acked entries are deleted, so XLEN is the backlog.
- A dead worker's pending entries are requeued (same payload, delivery count carried in field `d`)
  in the same MULTI that acks them; its pinned stream is drained the same way, sessions re-placed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, ResponseError

from rollout_svc.errors import QueueFullError
from rollout_svc.keys import PAYLOAD_FIELD, WORKERS_GROUP, Keys

DELIVERIES_FIELD = b"d"  # deliveries before this entry was requeued (a dead worker had it)
ENQUEUE_CHUNK = 1000  # entries per script call: bounds how long one call blocks Redis

# Shared by both scripts: place(session_id, preferred) -> worker id or false.
# A live pin is kept (and its TTL refreshed); otherwise the preferred worker, if live, else the live
# worker with the fewest unexpired sessions, takes the session. No live worker: false.
_PLACE_LUA = """
local prefix, ttl_ms = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function alive(w) return redis.call('EXISTS', prefix .. ':worker:' .. w) == 1 end
local function pin(sid, w)
  redis.call('SET', prefix .. ':session:' .. sid, w, 'PX', ttl_ms)
  redis.call('ZADD', prefix .. ':worker-sessions:' .. w, now_ms + ttl_ms, sid)
  return w
end
local function place(sid, preferred)
  local w = redis.call('GET', prefix .. ':session:' .. sid)
  if w and alive(w) then return pin(sid, w) end
  if w then redis.call('ZREM', prefix .. ':worker-sessions:' .. w, sid) end
  if preferred and alive(preferred) then return pin(sid, preferred) end
  local best, best_load = false, 0
  for _, id in ipairs(redis.call('SMEMBERS', prefix .. ':workers')) do
    if alive(id) then
      local zs = prefix .. ':worker-sessions:' .. id
      redis.call('ZREMRANGEBYSCORE', zs, '-inf', now_ms)
      local load = redis.call('ZCARD', zs)
      if not best or load < best_load or (load == best_load and id < best) then best, best_load = id, load end
    end
  end
  if best then return pin(sid, best) end
  return false
end
"""

# KEYS[1]: shared requests stream. ARGV: prefix, session_ttl_ms, limit (-1: none), then triples
# (session_id or '', payload, deliveries). Returns {'ok', worker_or_'' ...} or {'full', stream, length}.
# Placement happens before the admission check, so a refused batch may still have pinned its sessions:
# harmless, the pins expire with the session TTL.
ENQUEUE_LUA = (
    _PLACE_LUA
    + """
local limit = tonumber(ARGV[3])
local targets, placed, counts = {}, {}, {}
local n = (#ARGV - 3) / 3
for i = 1, n do
  local sid = ARGV[3 * i + 1]
  local w = false
  if sid ~= '' then w = place(sid, false) end
  local target = KEYS[1]
  if w then target = prefix .. ':requests:' .. w end
  targets[i], placed[i] = target, w or ''
  counts[target] = (counts[target] or 0) + 1
end
if limit >= 0 then
  for target, c in pairs(counts) do
    local len = redis.call('XLEN', target)
    if len + c > limit then return {'full', target, len} end
  end
end
for i = 1, n do
  local d = ARGV[3 * i + 3]
  if d == '0' then
    redis.call('XADD', targets[i], '*', 'm', ARGV[3 * i + 2])
  else
    redis.call('XADD', targets[i], '*', 'm', ARGV[3 * i + 2], 'd', d)
  end
end
return {'ok', unpack(placed)}
"""
)

# ARGV: prefix, session_ttl_ms, session_id, worker_id. A worker that took a session's request from the
# shared stream pins the session to itself unless a live worker holds it. Returns the pinned worker.
PIN_LUA = _PLACE_LUA + "\nreturn place(ARGV[3], ARGV[4])\n"

# KEYS: results streams and requests streams. ARGV: ttl_s, group, n, n pairs (key index, payload), m,
# m pairs (key index, entry id). A script is atomic like MULTI, and one command costs less than five.
PUBLISH_LUA = """
local ttl, group, a = ARGV[1], ARGV[2], 4
local touched = {}
for _ = 1, tonumber(ARGV[3]) do
  local key = KEYS[tonumber(ARGV[a])]
  redis.call('XADD', key, '*', 'm', ARGV[a + 1])
  touched[key] = true
  a = a + 2
end
for key in pairs(touched) do redis.call('EXPIRE', key, ttl) end
local m = tonumber(ARGV[a])
a = a + 1
for _ = 1, m do
  local key = KEYS[tonumber(ARGV[a])]
  redis.call('XACK', key, group, ARGV[a + 1])
  redis.call('XDEL', key, ARGV[a + 1])
  a = a + 2
end
return m
"""

# ARGV: prefix, session_id. Unpins a session so its next turn is placed anew.
FINISH_SESSION_LUA = """
local key = ARGV[1] .. ':session:' .. ARGV[2]
local w = redis.call('GET', key)
if w then redis.call('ZREM', ARGV[1] .. ':worker-sessions:' .. w, ARGV[2]) end
return redis.call('DEL', key)
"""


@dataclass(frozen=True)
class Entry:
    """One request entry taken from a requests stream. `deliveries` counts this delivery (1 = first)."""

    stream: str
    entry_id: bytes
    payload: bytes
    deliveries: int


@dataclass(frozen=True)
class Requeue:
    """A request to put back in the queue: its payload, its session (to re-place) and deliveries so far."""

    payload: bytes
    session_id: str | None
    deliveries: int


class RequestStreams:
    """Data-plane operations on one Redis connection. Cheap to build; holds no state but script handles."""

    def __init__(self, redis: Redis, keys: Keys, session_ttl_s: float) -> None:
        self.redis, self.keys = redis, keys
        self._session_ttl_ms = int(session_ttl_s * 1000)
        self._enqueue = redis.register_script(ENQUEUE_LUA)
        self._pin = redis.register_script(PIN_LUA)
        self._finish = redis.register_script(FINISH_SESSION_LUA)
        self._publish = redis.register_script(PUBLISH_LUA)

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
        groups: Any = await self.redis.xinfo_groups(stream)
        return next((g for g in groups if g["name"] == WORKERS_GROUP.encode()), None)

    async def load_scripts(self) -> None:
        """Load the Lua scripts once, so that no EVALSHA meets NOSCRIPT in the normal course."""
        for script in (self._enqueue, self._pin, self._finish, self._publish):
            script.sha = await self.redis.script_load(script.script)

    # --- producers --------------------------------------------------------------------------------------

    async def enqueue(self, items: Sequence[tuple[str | None, bytes]], max_queued: int) -> list[str | None]:
        """XADD (session_id, payload) items; sessions go to their pinned worker's stream.

        Returns the worker each item was pinned to (None: the shared stream).
        Raises `QueueFullError` if a target stream would exceed `max_queued` (nothing of a batch of up
        to ENQUEUE_CHUNK items is added then; of a larger batch, the chunks before the full one are).
        """
        [outcome] = await self.enqueue_batches([items], max_queued)
        if isinstance(outcome, QueueFullError):
            raise outcome
        return outcome

    async def enqueue_batches(
        self, batches: Sequence[Sequence[tuple[str | None, bytes]]], max_queued: int
    ) -> list[list[str | None] | QueueFullError]:
        """Enqueue several callers' batches in one round trip (one script call per chunk, pipelined).

        Each batch succeeds or fails on its own: the outcome is its placements or its `QueueFullError`.
        """
        calls: list[list[str | bytes | int]] = []
        spans: list[tuple[int, int]] = []
        for items in batches:
            first = len(calls)
            for start in range(0, len(items), ENQUEUE_CHUNK):
                chunk = [Requeue(payload, sid, 0) for sid, payload in items[start : start + ENQUEUE_CHUNK]]
                calls.append(self._enqueue_args(chunk, max_queued))
            spans.append((first, len(calls)))
        replies = await self._run_enqueue_calls(calls)
        outcomes: list[list[str | None] | QueueFullError] = []
        for first, end in spans:
            try:
                outcomes.append([w for reply in replies[first:end] for w in self._placed(reply, max_queued)])
            except QueueFullError as exc:
                outcomes.append(exc)
        return outcomes

    async def _run_enqueue_calls(self, calls: list[list[str | bytes | int]]) -> list:
        """EVALSHA each call in one pipeline. Not through redis-py's script-in-pipeline support: that
        costs a SCRIPT EXISTS round trip per pipeline. NOSCRIPT (Redis restarted) reloads and retries;
        no call ran then, since every call names the same script."""
        if len(calls) == 1:
            return [await self._enqueue(keys=[self.keys.requests], args=calls[0])]
        for attempt in range(2):
            pipe = self.redis.pipeline(transaction=False)
            for args in calls:
                pipe.evalsha(self._enqueue.sha, 1, self.keys.requests, *args)
            try:
                return await pipe.execute()
            except NoScriptError:
                if attempt:
                    raise
                self._enqueue.sha = await self.redis.script_load(ENQUEUE_LUA)
        raise AssertionError("unreachable")

    def _enqueue_args(self, items: Sequence[Requeue], limit: int) -> list[str | bytes | int]:
        args: list[str | bytes | int] = [self.keys.prefix, self._session_ttl_ms, limit]
        for item in items:
            args += [item.session_id or "", item.payload, item.deliveries]
        return args

    @staticmethod
    def _placed(reply: list, limit: int) -> list[str | None]:
        if reply[0] == b"full":
            raise QueueFullError(reply[1].decode(), int(reply[2]), limit)
        return [w.decode() or None for w in reply[1:]]

    async def finish_session(self, session_id: str) -> bool:
        """Unpin a session; its next turn is placed anew. Returns whether it was pinned."""
        return bool(await self._finish(args=[self.keys.prefix, session_id]))

    async def pinned_worker(self, session_id: str) -> str | None:
        value: Any = await self.redis.get(self.keys.session(session_id))
        return value.decode() if value else None

    # --- workers ----------------------------------------------------------------------------------------

    async def pin_session(self, session_id: str, worker_id: str) -> str | None:
        """Pin a session to `worker_id` unless a live worker already holds it; returns the holder."""
        value = await self._pin(args=[self.keys.prefix, self._session_ttl_ms, session_id, worker_id])
        return value.decode() if value else None

    async def read(self, worker_id: str, free: int, block_ms: int) -> list[Entry]:
        """Take at most `free` new entries from the worker's pinned stream and the shared stream.

        One XREADGROUP on both, blocking up to `block_ms` when both are empty. COUNT applies per stream,
        so each gets `free // 2`: pinned requests (sessions) are never starved by a shared backlog.
        With a single free slot, the pinned stream is tried first, then the shared one.
        """
        pinned, shared = self.keys.pinned_requests(worker_id), self.keys.requests
        if free >= 2:
            return await self._readgroup(worker_id, {pinned: ">", shared: ">"}, free // 2, block_ms)
        entries = await self._readgroup(worker_id, {pinned: ">"}, 1, None)
        return entries or await self._readgroup(worker_id, {shared: ">"}, 1, block_ms)

    async def _readgroup(self, consumer: str, streams: dict, count: int, block_ms: int | None) -> list[Entry]:
        reply: Any = await self.redis.xreadgroup(WORKERS_GROUP, consumer, streams, count=count, block=block_ms)
        entries = []
        for stream, records in reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in records:
                previous = int(fields.get(DELIVERIES_FIELD, 0))
                entries.append(Entry(name, entry_id, fields.get(PAYLOAD_FIELD, b""), previous + 1))
        return entries

    async def publish(self, results: Iterable[tuple[str, bytes]], done: Iterable[Entry], results_ttl_s: float) -> None:
        """Atomically (one script): XADD each (results stream, payload), then XACK + XDEL the entries answered."""
        keys: dict[str, int] = {}  # stream name -> its 1-based index in KEYS
        result_args: list[str | bytes | int] = []
        for reply_to, payload in results:
            result_args += [keys.setdefault(reply_to, len(keys) + 1), payload]
        ack_args: list[str | bytes | int] = []
        for entry in done:
            ack_args += [keys.setdefault(entry.stream, len(keys) + 1), entry.entry_id]
        args = [int(results_ttl_s), WORKERS_GROUP, len(result_args) // 2, *result_args, len(ack_args) // 2, *ack_args]
        await self._publish(keys=list(keys), args=args)

    async def dead_letter(
        self, entry: Entry, reason: str, worker_id: str, maxlen: int, reply: tuple[str, bytes] | None = None
    ) -> None:
        """In one MULTI: copy the entry to the dead-letter stream, tell its producer if known, XACK + XDEL it."""
        pipe = self.redis.pipeline(transaction=True)
        fields: dict[Any, Any] = {
            b"payload": entry.payload,
            b"reason": reason,
            b"stream": entry.stream,
            b"entry_id": entry.entry_id,
            b"deliveries": entry.deliveries,
            b"worker_id": worker_id,
        }
        pipe.xadd(self.keys.dead, fields, maxlen=maxlen, approximate=True)
        if reply is not None:
            pipe.xadd(reply[0], {PAYLOAD_FIELD: reply[1]})
        pipe.xack(entry.stream, WORKERS_GROUP, entry.entry_id)
        pipe.xdel(entry.stream, entry.entry_id)
        await pipe.execute()

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
            previous = int(fields.get(DELIVERIES_FIELD, 0))
            delivered = previous + item["times_delivered"]
            entries.append(Entry(stream, item["message_id"], fields.get(PAYLOAD_FIELD, b""), delivered))
        return entries

    async def undelivered(self, stream: str, count: int = 1000) -> list[Entry]:
        """Entries of a stream not yet delivered to any consumer (after the group's last-delivered id)."""
        group = await self._group_info(stream)
        if group is None:
            return []  # no such stream (or group: then nothing was ever delivered from it)
        records: Any = await self.redis.xrange(stream, min=b"(" + group["last-delivered-id"], count=count)
        return [Entry(stream, i, f.get(PAYLOAD_FIELD, b""), int(f.get(DELIVERIES_FIELD, 0))) for i, f in records]

    async def requeue(self, items: Sequence[Requeue], done: Iterable[Entry]) -> list[str | None]:
        """In one MULTI: enqueue `items` again (no admission limit: nothing is lost), XACK + XDEL `done`."""
        pipe = self.redis.pipeline(transaction=True)
        if items:
            await self._enqueue(keys=[self.keys.requests], args=self._enqueue_args(items, -1), client=pipe)
        for stream, ids in _by_stream(done).items():
            pipe.xack(stream, WORKERS_GROUP, *ids)
            pipe.xdel(stream, *ids)
        replies = await pipe.execute()
        return self._placed(replies[0], -1) if items else []

    async def forget_consumer(self, stream: str, consumer: str) -> None:
        with contextlib.suppress(ResponseError):  # no such group: nothing to forget
            await self.redis.xgroup_delconsumer(stream, WORKERS_GROUP, consumer)

    # --- results and inspection -------------------------------------------------------------------------

    async def read_results(self, stream: str, last_id: bytes, done_ids: list[bytes], block_ms: int) -> list[Any]:
        """XDEL the results already consumed, then XREAD new ones after `last_id`: one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        if done_ids:
            pipe.xdel(stream, *done_ids)
        pipe.xread({stream: last_id}, count=1000, block=block_ms)
        replies = await pipe.execute()
        reply = replies[-1]
        return reply[0][1] if reply else []

    async def depth(self, stream: str) -> dict[str, int]:
        """Length (queued + in flight, since acked entries are deleted) and pending count of a requests stream."""
        group = await self._group_info(stream)
        length = await self.redis.xlen(stream)
        pending = group["pending"] if group else 0
        return {"length": length, "pending": pending, "queued": max(0, length - pending)}


def _by_stream(entries: Iterable[Entry]) -> dict[str, list[bytes]]:
    grouped: dict[str, list[bytes]] = {}
    for entry in entries:
        grouped.setdefault(entry.stream, []).append(entry.entry_id)
    return grouped
