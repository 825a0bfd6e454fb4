"""Dead letters for an operator: read them, and replay them as fresh requests through the producers' enqueue path.

A dead letter is an entry of `Keys.dead`, written by `Reaper.requeue` or a worker (`RecoveryStreams.dead_letter`),
with the fields (`keys.DeadLetterField`) `payload` (the request's msgpack envelope as it was queued), `reason` (an
`ErrorCode`: undecodable or max_deliveries), `stream` and `entry_id` (where it was queued), `deliveries`,
`worker_id` ('' when a reaper wrote it) and `message` (why, in words). Payloads are read with `protocol.decode`
only (msgpack, never pickle); one that does not decode is listed with the reason and never replayed.

Replay is at-least-once. Each batch is enqueued first, exactly as a producer enqueues (`ProducerStreams.enqueue`:
sessions placed, admission checked against `max_queued_requests`, the current control epoch, no delivery count),
and only then XDELed from the dead-letter stream. A crash between the two leaves the request queued and its dead
letter in place: replayed again, it is a duplicate, which producers drop by request id. A full queue refuses the
whole batch, which stays in the dead-letter stream.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from rollout_svc.config import Settings
from rollout_svc.dataplane.producer_streams import ProducerStreams
from rollout_svc.dataplane.recovery_streams import RecoveryStreams
from rollout_svc.dataplane.streams import Enqueue, Placed, StreamConnection
from rollout_svc.errors import InvalidRequestError, ProtocolError, QueueFullError
from rollout_svc.keys import DeadLetterField
from rollout_svc.protocol import (
    DetokenizeRequest,
    Request,
    RolloutRequest,
    TokenizeRequest,
    decode,
    reply_address,
)

REPLAY_BATCH = 100  # dead letters per enqueue script call (all or nothing) and per XDEL
ENTRY_ID = re.compile(r"\d+-\d+")
QUEUE_FULL = "the queue is full"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One dead letter, decoded as far as it goes.

    `entry_id` is its id in the dead-letter stream and `dead_at` the unix time (s) it was written (from that id).
    `request` is the decoded request, or None with `error` saying why it does not decode. `request_id` and
    `reply_to` come from the request, or for an undecodable payload best effort from its envelope (None if even
    that fails).
    """

    entry_id: str
    dead_at: float
    reason: str
    stream: str
    source_entry_id: str
    deliveries: int
    worker_id: str
    payload: bytes
    request: Request | None
    error: str | None
    request_id: str | None
    reply_to: str | None
    text: str = ""  # the message its writer gave (dead letters written before it was kept have none)

    @property
    def session_id(self) -> str | None:
        return self.request.session_id if isinstance(self.request, RolloutRequest) else None

    @property
    def message(self) -> str:
        """Why it is a dead letter, in words."""
        if self.error is not None:
            return self.error
        if self.text:
            return self.text
        if self.reason == "max_deliveries":
            return f"delivered {self.deliveries} times without a result"
        return self.reason

    def unreplayable(self) -> str | None:
        """Why this dead letter cannot be replayed, or None if it can."""
        return None if self.request is not None else f"undecodable: {self.error}"

    def to_json(self) -> dict[str, Any]:
        """JSON-ready fields (the payload as its size only)."""
        return {
            "entry_id": self.entry_id,
            "dead_at": self.dead_at,
            "request_id": self.request_id,
            "reply_to": self.reply_to,
            "session_id": self.session_id,
            "type": type(self.request).__name__ if self.request is not None else None,
            "reason": self.reason,
            "message": self.message,
            "worker_id": self.worker_id,
            "deliveries": self.deliveries,
            "stream": self.stream,
            "source_entry_id": self.source_entry_id,
            "payload_bytes": len(self.payload),
            "replayable": self.unreplayable() is None,
        }


@dataclass(frozen=True, slots=True)
class Replayed:
    """A dead letter requeued: `placed` says where its request went (stream, new entry id)."""

    letter: DeadLetter
    placed: Placed


@dataclass(frozen=True, slots=True)
class Skipped:
    """A dead letter (or a named id) not replayed, and why."""

    entry_id: str
    why: str


@dataclass(slots=True)
class ReplayReport:
    """What a replay did. `queue_full` is set if admission refused a batch; it and what came after it stayed in
    the dead-letter stream (named ids among them are in `skipped`)."""

    replayed: list[Replayed] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    queue_full: QueueFullError | None = None
    kept: bool = False


class DeadLetters:
    """Reads and replays the dead-letter stream of one deployment (`settings.keys`)."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis, self.settings, self.keys = redis, settings, settings.keys
        connection = StreamConnection(redis, settings.keys, settings.session_ttl_s)
        self.producer, self.recovery = ProducerStreams(connection), RecoveryStreams(connection)

    async def count(self) -> int:
        """How many dead letters the stream holds."""
        return int(await self.redis.xlen(self.keys.dead))

    async def newest(self, count: int) -> list[DeadLetter]:
        """The newest `count` dead letters, newest first."""
        records: Any = await self.redis.xrevrange(self.keys.dead, count=count)
        return [_parse(entry_id, fields) for entry_id, fields in records]

    async def get(self, entry_ids: Sequence[str]) -> list[DeadLetter | Skipped]:
        """Each named dead letter, or a `Skipped` saying it is not one (a malformed id, or no such entry)."""
        found: list[DeadLetter | Skipped] = []
        pipe = self.redis.pipeline(transaction=False)
        valid = [entry_id for entry_id in entry_ids if ENTRY_ID.fullmatch(entry_id)]
        for entry_id in valid:
            pipe.xrange(self.keys.dead, entry_id, entry_id)
        records = dict(zip(valid, await pipe.execute(), strict=True)) if valid else {}
        for entry_id in entry_ids:
            if entry_id not in records:
                found.append(Skipped(entry_id, "not a stream entry id (like 1717000000000-0)"))
            elif not records[entry_id]:
                found.append(Skipped(entry_id, f"no such dead letter in {self.keys.dead}"))
            else:
                found.append(_parse(*records[entry_id][0]))
        return found

    async def replay(self, entry_ids: Sequence[str], keep: bool = False) -> ReplayReport:
        """Replay the named dead letters, in the order given (duplicates once); with `keep`, leave them in the stream.

        Ids that name no dead letter and dead letters that cannot be replayed are skipped, with the reason.
        Raises the Redis error if Redis is away (what was replayed before it stays replayed).
        """
        report = ReplayReport(kept=keep)
        named = await self.get(list(dict.fromkeys(entry_ids)))
        report.skipped += [item for item in named if isinstance(item, Skipped)]
        letters = [item for item in named if isinstance(item, DeadLetter)]
        for start in range(0, len(letters), REPLAY_BATCH):
            await self._replay_batch(letters[start : start + REPLAY_BATCH], report)
        return report

    async def replay_all(self, keep: bool = False) -> ReplayReport:
        """Replay every dead letter, oldest first, until the stream's end or a full queue (see `replay`)."""
        report = ReplayReport(kept=keep)
        start = "-"
        while report.queue_full is None:
            records: Any = await self.redis.xrange(self.keys.dead, min=start, count=REPLAY_BATCH)
            if not records:
                break
            await self._replay_batch([_parse(entry_id, fields) for entry_id, fields in records], report)
            start = "(" + records[-1][0].decode()
        return report

    async def _replay_batch(self, letters: list[DeadLetter], report: ReplayReport) -> None:
        """Enqueue the replayable ones as producers do (one script call: all or nothing), then XDEL them. After a
        full queue (this batch's or an earlier one's) nothing is enqueued: the replayable ones are skipped."""
        ready = [letter for letter in letters if letter.unreplayable() is None]
        report.skipped += [Skipped(le.entry_id, why) for le in letters if (why := le.unreplayable()) is not None]
        if not ready:
            return
        placed = await self._enqueue(ready, report) if report.queue_full is None else None
        if placed is None:
            report.skipped += [Skipped(letter.entry_id, QUEUE_FULL) for letter in ready]
            return
        # Requeued first, deleted second: a crash between leaves a duplicate (dropped by request id), never a loss.
        if not report.kept:
            await self.recovery.delete_dead_letters([letter.entry_id for letter in ready])
        report.replayed += [Replayed(letter, where) for letter, where in zip(ready, placed, strict=True)]

    async def _enqueue(self, letters: list[DeadLetter], report: ReplayReport) -> list[Placed] | None:
        """Where each went, or None if admission refused them all (`report.queue_full` says why)."""
        try:
            return await self.producer.enqueue(
                [_enqueue_item(le) for le in letters], self.settings.client.max_queued_requests
            )
        except QueueFullError as exc:
            report.queue_full = exc
            return None


def _enqueue_item(letter: DeadLetter) -> Enqueue:
    """The payload as it was queued, as a new request: no delivery count, the current epoch, its session placed."""
    if isinstance(letter.request, RolloutRequest):
        return Enqueue(letter.payload, letter.request.session_id, cost=letter.request.cost_tokens())
    return Enqueue(letter.payload, tokens=True)


def _parse(entry_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    """A dead-letter stream entry (fields: see the module docstring); missing fields read as empty."""
    payload = fields.get(DeadLetterField.PAYLOAD, b"")
    request: Request | None = None
    error: str | None = None
    try:
        message = decode(payload)
    except (ProtocolError, InvalidRequestError) as exc:
        error = str(exc)
    else:
        if isinstance(message, RolloutRequest | TokenizeRequest | DetokenizeRequest):
            request = message
        else:
            error = f"a {type(message).__name__} message, not a request"
    address = (request.request_id, request.reply_to) if request is not None else reply_address(payload)
    text = entry_id.decode()
    return DeadLetter(
        entry_id=text,
        dead_at=int(text.partition("-")[0]) / 1000,
        reason=fields.get(DeadLetterField.REASON, b"").decode(errors="replace"),
        stream=fields.get(DeadLetterField.STREAM, b"").decode(errors="replace"),
        source_entry_id=fields.get(DeadLetterField.ENTRY_ID, b"").decode(errors="replace"),
        deliveries=_count(fields.get(DeadLetterField.DELIVERIES, b"0")),
        worker_id=fields.get(DeadLetterField.WORKER_ID, b"").decode(errors="replace"),
        payload=payload,
        request=request,
        error=error,
        request_id=address[0] if address else None,
        reply_to=address[1] if address else None,
        text=fields.get(DeadLetterField.MESSAGE, b"").decode(errors="replace"),
    )


def _count(value: bytes) -> int:
    return int(value) if value.isdigit() else 0
