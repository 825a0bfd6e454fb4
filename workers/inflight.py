"""The requests a worker is running, indexed by entry, request id and session, and the one way to cancel them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollout_svc.protocol import AbortCause, ControlCommand, Request, RolloutRequest
from rollout_svc.streams import Entry
from workers.engine import Engine

REABORT_AFTER_S = 0.2  # an abort that raced the request into the engine is sent again after this
RULE_TTL_S = 24 * 3600.0  # how long an explicit abort keeps hitting queued requests enqueued before it


@dataclass(eq=False)
class InFlight:
    """One taken entry, from XREADGROUP until its result is queued for publishing.

    `abort_cause` set means: stop it (the serve path checks it before entering the engine; `in_engine` means
    the engine must be told). `request` is set once the payload is decoded.
    """

    entry: Entry
    generation: bool  # a rollout request stream (not the token stream): counts against capacity
    task: asyncio.Task[None] | None = None
    request: Request | None = None
    abort_cause: AbortCause | None = None
    in_engine: bool = False
    aborted_at: float = 0.0  # monotonic time of the last abort sent to the engine

    @property
    def deadline(self) -> float | None:
        return self.request.deadline if self.request is not None else None

    @property
    def request_ids(self) -> set[str]:
        """Its request id, and the one it retries (an abort of the original also hits its retries)."""
        if self.request is None:
            return set()
        if isinstance(self.request, RolloutRequest):
            return {self.request.request_id, self.request.original_request_id}
        return {self.request.request_id}


class InFlightIndex:
    """Every in-flight request of one worker, with the single cancel path (`cancel`) that says why."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._by_key: dict[tuple[str, bytes], InFlight] = {}
        self._by_request: dict[str, InFlight] = {}
        self.changed = asyncio.Event()  # set whenever one finishes

    def add(self, entry: Entry, generation: bool) -> InFlight:
        record = InFlight(entry, generation)
        self._by_key[(entry.stream, entry.entry_id)] = record
        return record

    def decoded(self, record: InFlight, request: Request) -> None:
        record.request = request
        for request_id in record.request_ids:
            self._by_request[request_id] = record

    def remove(self, record: InFlight) -> None:
        self._by_key.pop((record.entry.stream, record.entry.entry_id), None)
        for request_id in record.request_ids:
            if self._by_request.get(request_id) is record:
                del self._by_request[request_id]
        self.changed.set()

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, record: object) -> bool:
        return isinstance(record, InFlight) and self._by_key.get((record.entry.stream, record.entry.entry_id)) is record

    def records(self) -> list[InFlight]:
        return list(self._by_key.values())

    @property
    def generating(self) -> int:
        """Rollout requests in flight (what counts against the engine's capacity)."""
        return sum(r.generation for r in self._by_key.values())

    def request_ids(self) -> list[str]:
        return list(self._by_request)

    def by_request_ids(self, request_ids: Iterable[str]) -> list[InFlight]:
        found = {id(r): r for i in request_ids if (r := self._by_request.get(i)) is not None}
        return list(found.values())

    async def cancel(self, record: InFlight, cause: AbortCause) -> None:
        """Stop one request, for `cause`: the first cause sticks. One not yet in the engine never enters it
        (its serve path sees the cause); one in the engine is aborted there and returns its partial output."""
        if record.abort_cause is not None:
            return  # already stopping (`reabort` repeats an abort that may have missed)
        record.abort_cause = cause
        if record.in_engine:
            record.aborted_at = time.monotonic()
            await self.engine.abort(_rid(record))

    async def cancel_all(self, records: Iterable[InFlight], cause: AbortCause) -> None:
        for record in records:
            await self.cancel(record, cause)

    async def reabort(self) -> None:
        """Abort again what an abort may have missed: a request that entered the engine just after it."""
        now = time.monotonic()
        for record in self.records():
            if record.abort_cause and record.in_engine and now - record.aborted_at > REABORT_AFTER_S:
                record.aborted_at = now
                await self.engine.abort(_rid(record))

    async def wait_changed(self, timeout_s: float) -> None:
        """Return when an in-flight request finishes, or after `timeout_s`."""
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout_s)


def _rid(record: InFlight) -> str:
    assert record.request is not None
    return record.request.request_id


@dataclass
class AbortRules:
    """The explicit aborts this worker applied, so a request they hit is answered unrun when it is taken later.

    A session or `all` abort with epoch E hits requests enqueued before it (entry epoch < E); a request-id
    abort hits that request and its retries whenever they come.
    """

    all_before: int = 0
    sessions: dict[str, int] = field(default_factory=dict)  # session id -> epoch of the abort
    requests: dict[str, float] = field(default_factory=dict)  # request id -> when the abort was issued
    issued: dict[str, float] = field(default_factory=dict)  # session id -> when its abort was issued

    def add(self, command: ControlCommand) -> None:
        args = command.args
        if args.get("all"):
            self.all_before = max(self.all_before, command.epoch)
        elif args.get("session_id"):
            sid = str(args["session_id"])
            self.sessions[sid] = max(self.sessions.get(sid, 0), command.epoch)
            self.issued[sid] = command.issued_at
        for request_id in args.get("request_ids") or []:
            self.requests[str(request_id)] = command.issued_at
        self._prune()

    def hits(self, record: InFlight) -> bool:
        """Whether an abort this worker applied covers `record` (decoded)."""
        entry = record.entry
        if entry.epoch < self.all_before:
            return True
        if entry.session_id and entry.epoch < self.sessions.get(entry.session_id, 0):
            return True
        return bool(record.request_ids & self.requests.keys())

    def _prune(self) -> None:
        oldest = time.time() - RULE_TTL_S
        self.requests = {k: t for k, t in self.requests.items() if t > oldest}
        for sid in [s for s, t in self.issued.items() if t <= oldest]:
            self.sessions.pop(sid, None)
            self.issued.pop(sid, None)


def abort_hits(command: ControlCommand, record: InFlight) -> bool:
    """Whether the abort `command` covers the in-flight `record` (see `AbortRules`)."""
    args, entry = command.args, record.entry
    if args.get("all"):
        return entry.epoch < command.epoch
    if args.get("session_id"):
        return entry.session_id == args["session_id"] and entry.epoch < command.epoch
    return bool(record.request_ids & set(args.get("request_ids") or []))
