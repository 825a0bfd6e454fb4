"""What recovery calls on the data plane: pending entries and orphans found, requeued or dead-lettered, consumers
and loads of departed workers forgotten."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from rollout_svc.dataplane.streams import Enqueue, Entry, Placed, StreamSide, entry_id_key, parse_entry
from rollout_svc.keys import WORKERS_GROUP, DeadLetterField
from rollout_svc.protocol import ErrorCode, ErrorResult, encode, reply_address

log = logging.getLogger("rollout_svc.dataplane")


class RecoveryStreams(StreamSide):
    """The recovery side of the data plane (`dataplane.streams` says how the streams work), for the reaper, the dead
    letters, the control plane's sweeps, and a worker moving on what it cannot serve: what a consumer holds pending,
    what no consumer was delivered (undelivered, orphans), entries requeued through placement or dead-lettered, and
    a departed worker's consumer and load forgotten."""

    async def pending_of(self, stream: str, consumer: str, count: int = 1000) -> list[Entry]:
        """Entries delivered to `consumer` and not acked, with their delivery counts (XPENDING + XRANGE)."""
        if await self.connection.group_info(stream) is None:
            return []  # no such stream or group: nothing pending
        pending: Any = await self.redis.xpending_range(stream, WORKERS_GROUP, "-", "+", count, consumername=consumer)
        pipe = self.redis.pipeline(transaction=False)
        for item in pending:
            pipe.xrange(stream, item["message_id"], item["message_id"])
        entries = []
        for item, records in zip(pending, await pipe.execute(), strict=True):
            fields = records[0][1] if records else {}  # no record: deleted under us; requeued as empty
            entries.append(parse_entry(stream, item["message_id"], fields, delivered=item["times_delivered"]))
        return entries

    async def undelivered(self, stream: str, count: int = 1000, after: bytes | None = None) -> list[Entry]:
        """Entries of a stream not yet delivered to any consumer (after the group's last-delivered id, or after
        `after` if that is later: a caller paging through a long backlog passes the last id it saw)."""
        group = await self.connection.group_info(stream)
        if group is None:
            if not await self.redis.exists(stream):
                return []
            start = b"-"  # a stream no worker has read yet: all of it is undelivered
        else:
            start = b"(" + group["last-delivered-id"]
        if after is not None and (start == b"-" or entry_id_key(after) > entry_id_key(start[1:])):
            start = b"(" + after
        records: Any = await self.redis.xrange(stream, min=start, count=count)
        return [parse_entry(stream, entry_id, fields, delivered=0) for entry_id, fields in records]

    async def last_id(self, stream: str) -> bytes | None:
        """The id of a stream's newest entry; None if it has none."""
        records: Any = await self.redis.xrevrange(stream, count=1)
        return records[0][0] if records else None

    async def orphans(self, stream: str, count: int = 1000) -> list[Entry]:
        """Entries at or before the group's last-delivered id that no consumer holds pending: no `>` read will ever
        deliver them. Normally there are none (an answered entry is acked and deleted in one script); a Redis that
        replayed a transaction its append-only file had cut short (killed mid-write, then written to, then
        restarted) brings such entries back behind the group."""
        group = await self.connection.group_info(stream)
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
            found += [parse_entry(stream, i, fields, delivered=0) for i, fields in records if i not in held]
            if len(records) < count or final == last:
                break
            start = b"(" + final  # exclusive, as `undelivered` pages
        return found[:count]

    async def pending_ids(self, stream: str, consumer: str, count: int) -> set[bytes]:
        """The ids of up to `count` entries of `stream` delivered to `consumer` and not acked (XPENDING)."""
        if await self.connection.group_info(stream) is None:
            return set()
        pending: Any = await self.redis.xpending_range(stream, WORKERS_GROUP, "-", "+", count, consumername=consumer)
        return {item["message_id"] for item in pending}

    async def requeue(self, items: Sequence[Enqueue], done: Iterable[Entry]) -> list[Placed]:
        """In one script: enqueue `items` again (no admission limit: nothing is lost), XACK + XDEL `done`."""
        keys, args = self.connection.enqueue_call(items, -1, list(done))
        reply = await self.connection.scripts["enqueue"](keys=keys, args=args)
        return self.connection.placed(items, reply, -1)

    async def delete(self, stream: str) -> None:
        """Delete a stream (a reclaimed worker's pinned stream, once drained)."""
        await self.redis.delete(stream)

    async def forget_consumer(self, stream: str, consumer: str) -> bool:
        """Delete a consumer of the `workers` group if it holds no pending entry (one script). Returns False if it
        holds some: requeue them and ask again (deleting it would drop them, never to be delivered again)."""
        return bool(await self.connection.scripts["forget_consumer"](keys=[stream], args=[WORKERS_GROUP, consumer]))

    async def orphaned_consumers(self, stream: str, idle_ms: int) -> list[str]:
        """Consumers of `stream`'s group holding pending entries and idle for `idle_ms` or longer (XINFO CONSUMERS)."""
        try:
            consumers: Any = await self.redis.xinfo_consumers(stream, WORKERS_GROUP)
        except ResponseError:  # no such stream or group
            return []
        names = [c["name"] for c in consumers if c["pending"] > 0 and c["idle"] >= idle_ms]
        return [n.decode() if isinstance(n, bytes) else n for n in names]

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
        return bool(await self.connection.scripts["dead_letter"](keys=keys, args=args))

    async def delete_dead_letters(self, entry_ids: Sequence[str | bytes]) -> int:
        """Delete dead letters (replayed by an operator) from the dead-letter stream; returns how many were there."""
        return int(await self.redis.xdel(self.keys.dead, *entry_ids)) if entry_ids else 0

    async def forget_load(self, worker_id: str) -> None:
        """Close a departed worker (`dataplane.levels`: out of the open workers and their sums) and delete its fields of
        `Keys.loads` (its load, free slots, pinned tokens and holdings)."""
        await self.connection.scripts["forget_load"](keys=self.keys.load_keys, args=[worker_id])
