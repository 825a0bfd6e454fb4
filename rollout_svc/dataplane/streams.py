"""The data plane on Redis Streams: its records, and the connection its three sides share.

The sides, each in its own module, are what each caller does with the streams: `ProducerStreams` (enqueue, read
results, sessions), `WorkerStreams` (take, publish, chunks, pins, its load) and `RecoveryStreams` (pending entries,
orphans, requeues, dead letters). They, with this module, are the only code that spells XADD, XREADGROUP, XACK and
XDEL.

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

Every script (in `dataplane/scripts.py` and `dataplane/placement.py`) declares the keys it is given in KEYS, built
by `Keys` (Redis Cluster routes by them). The placement scripts declare the fleet's shared keys (`Keys.fleet`) and
build the keys of the one worker they place on from `Keys.worker_stems`: the same hash slot, and no list of every
worker to send or to keep current. What they read of the fleet (the open workers by level, and their sums) is kept
by every change of a load (`dataplane.levels`), so a request costs Redis the same at 4 workers and at 1,024.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Self

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from rollout_svc.dataplane.direct import DirectConnection, borrowed
from rollout_svc.dataplane.placement import ENQUEUE_LUA, FINISH_SESSION_LUA, HAND_OVER_LUA, PIN_LUA
from rollout_svc.dataplane.scripts import (
    DEAD_LETTER_LUA,
    FORGET_CONSUMER_LUA,
    FORGET_LOAD_LUA,
    PUBLISH_LUA,
    REPORT_LOAD_LUA,
    SWEEP_LUA,
)
from rollout_svc.dataplane.take import TAKE_LUA
from rollout_svc.errors import QueueFullError
from rollout_svc.keys import (
    COST_FIELD,
    DELIVERIES_FIELD,
    EPOCH_FIELD,
    MAX_COST,
    PAYLOAD_FIELD,
    SESSION_FIELD,
    WORKERS_GROUP,
    EnqueueKind,
    Keys,
    ScriptReply,
)


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


class StreamConnection:
    """What the three sides of the data plane share on one Redis client: its registered scripts, the hot paths'
    connection, consumer groups, and how an enqueue script call is built and read.

    `on_own_connection()` gives a copy for one sequential user of the hot paths (a worker's take loop or publisher,
    a producer's submitter or result reader) whose scripts and blocking reads go over a `DirectConnection`;
    everything else goes through the client."""

    def __init__(self, redis: Redis, keys: Keys, session_ttl_s: float, direct: DirectConnection | None = None) -> None:
        self.redis, self.keys, self.direct = redis, keys, direct
        self.session_ttl_ms = int(session_ttl_s * 1000)
        self.scripts = {
            name: redis.register_script(lua)
            for name, lua in (
                ("enqueue", ENQUEUE_LUA),
                ("pin", PIN_LUA),
                ("finish", FINISH_SESSION_LUA),
                ("publish", PUBLISH_LUA),
                ("report_load", REPORT_LOAD_LUA),
                ("dead_letter", DEAD_LETTER_LUA),
                ("sweep", SWEEP_LUA),
                ("take", TAKE_LUA),
                ("forget_consumer", FORGET_CONSUMER_LUA),
                ("hand_over", HAND_OVER_LUA),
                ("forget_load", FORGET_LOAD_LUA),
            )
        }

    def on_own_connection(self) -> StreamConnection:
        """A copy whose hot paths go over a connection of its own (`DirectConnection`), for one sequential user;
        `aclose()` gives the connection back."""
        return StreamConnection(self.redis, self.keys, self.session_ttl_ms / 1000, DirectConnection(self.redis))

    async def aclose(self) -> None:
        """Give back the connection of `on_own_connection` (nothing to do for a copy without one)."""
        if self.direct is not None:
            await self.direct.aclose()

    def hot_path(self) -> contextlib.AbstractAsyncContextManager[DirectConnection]:
        """The hot paths' connection (`DirectConnection`, not retried): this copy's own, or one borrowed from the
        pool for the call."""
        return contextlib.nullcontext(self.direct) if self.direct is not None else borrowed(self.redis)

    async def execute(self, *commands: Sequence[Any]) -> list[Any]:
        """`commands` in one round trip on the hot paths' connection; their replies. Raises the first error."""
        async with self.hot_path() as direct:
            replies = await direct.execute(*commands)
        if errors := [reply for reply in replies if isinstance(reply, ResponseError)]:
            raise errors[0]
        return replies

    async def script(self, name: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """One call of the script registered as `name`, on the hot paths' connection; its reply."""
        async with self.hot_path() as direct:
            [reply] = await direct.scripts(self.scripts[name], [(keys, args)])
            return reply

    async def ensure_group(self, stream: str) -> None:
        """Create the `workers` consumer group (and the stream) if missing. From id 0: nothing queued is skipped.

        Checks before creating, and again after a failed create (another process won the race), rather
        than parsing BUSYGROUP out of the error text, which fakeredis' TCP server does not pass on.
        """
        if await self.group_info(stream) is not None:
            return
        try:
            await self.redis.xgroup_create(stream, WORKERS_GROUP, id="0", mkstream=True)
        except ResponseError:
            if await self.group_info(stream) is None:
                raise

    async def group_info(self, stream: str) -> dict[str, Any] | None:
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
        for script in self.scripts.values():
            script.sha = await self.redis.script_load(script.script)

    def enqueue_call(
        self, items: Sequence[Enqueue], limit: int, acks: Iterable[Entry]
    ) -> tuple[list[str], list[str | bytes | int]]:
        """The (keys, args) of one `ENQUEUE_LUA` call: `items` placed, admitted against `limit` (-1: none), and
        `acks` acknowledged and deleted in the same call (a requeue)."""
        keys = [self.keys.requests, self.keys.token_requests, *self.keys.fleet]
        args: list[str | bytes | int] = [self.session_ttl_ms, limit, WORKERS_GROUP, *self.keys.worker_stems, len(items)]
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

    def placed(self, items: Sequence[Enqueue], reply: list, limit: int) -> list[Placed]:
        """Where each of `items` went, from an `ENQUEUE_LUA` call's `reply`. Raises `QueueFullError` if admission
        (`limit`) refused the call."""
        if reply[0] == ScriptReply.FULL:
            raise QueueFullError(reply[1].decode(), int(reply[2]), limit)
        targets = iter(reply[len(items) + 1 :])  # the worker each session item went to ('': the shared stream)
        placed = []
        for item, entry_id in zip(items, reply[1 : len(items) + 1], strict=True):
            if item.tokens:
                stream = self.keys.token_requests
            elif item.session_id and (worker := _text(next(targets))):
                stream = self.keys.pinned_requests(worker)
            else:
                stream = self.keys.requests
            placed.append(Placed(stream, entry_id))
        return placed


class StreamSide:
    """A side of the data plane: its calls over a `StreamConnection` (`connection`, its `redis` client and `keys`)."""

    def __init__(self, connection: StreamConnection) -> None:
        self.connection, self.redis, self.keys = connection, connection.redis, connection.keys

    def on_own_connection(self) -> Self:
        """A copy whose hot paths go over a connection of its own (`StreamConnection.on_own_connection`), for one
        sequential user; `aclose()` gives it back."""
        return type(self)(self.connection.on_own_connection())

    async def aclose(self) -> None:
        """Give back the connection of `on_own_connection` (nothing to do for a copy without one)."""
        await self.connection.aclose()


def parse_entry(stream: str, entry_id: bytes, fields: dict[bytes, bytes], delivered: int) -> Entry:
    """An entry of `stream` from its fields (`keys.py`); `delivered` (1 for a read that delivers it, 0 for a look)
    is added to the deliveries its fields count."""
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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


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


def script_fields(flat: list[bytes]) -> dict[bytes, bytes]:
    """A Lua reply's field list (name, value, name, value, ...) as XREADGROUP's dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def entry_id_key(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id (`b"1700000000000-3"`) as (milliseconds, sequence), ordered as Redis orders ids."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)
