"""The requests a worker is running, indexed by entry, request id and session id, and the one way to cancel them."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from rollout_svc.dataplane.streams import Entry
from rollout_svc.protocol import AbortCause, ControlCommand, Request, RolloutRequest
from workers.engine import Engine


@dataclass(slots=True)
class Woken:
    """The cost of the entries a worker's reads took, not yet counted in Redis: tokens for its load (`Keys.loads`
    ID) and those of them read from its pinned stream (placement's ID:pinned still counts them). Whichever of its
    scripts goes to Redis first counts them, once: the take that follows the read, or a publish sent before it (an
    idle worker's answer goes out ahead of its next take). A blocking read adds what it took; a take (whose plan
    counted what it planned) what it read beyond the plan, or, negative, short of it."""

    tokens: int = 0
    pinned: int = 0
    drained: bool = False  # its last read or take left nothing waiting for it: its next read blocks

    def add(self, entries: list[Entry], pinned_stream: str, asked: int, drained: bool | None = None) -> None:
        """What a read that asked for up to `asked` entries of each stream took outside a take. `drained`: whether
        nothing is left waiting for it, where the caller knows; else it took fewer than it asked of each stream."""
        for entry in entries:
            self.tokens += entry.cost
            self.pinned += entry.cost if entry.stream == pinned_stream else 0
        if drained is None:
            drained = bool(entries) and asked > 1 and max(Counter(e.stream for e in entries).values()) < asked
        self.drained = drained

    def unplanned(self, cost: tuple[int, int], drained: bool) -> None:
        """What a take read beyond its plan (tokens, pinned tokens; negative: short of it), and whether it left
        nothing waiting for this worker."""
        self.tokens, self.pinned = self.tokens + cost[0], self.pinned + cost[1]
        self.drained = drained

    @contextlib.contextmanager
    def claimed(self, claim: bool = True) -> Iterator[tuple[int, int]]:
        """(tokens, pinned tokens) for the script call made inside, no longer counted here; given back if the call
        fails (the next call counts them). `claim` False: (0, 0), claiming nothing."""
        claimed = (self.tokens, self.pinned) if claim else (0, 0)
        self.tokens, self.pinned = self.tokens - claimed[0], self.pinned - claimed[1]
        try:
            yield claimed
        except BaseException:
            self.tokens, self.pinned = self.tokens + claimed[0], self.pinned + claimed[1]
            raise


REABORT_AFTER_S = 0.2  # an abort that raced the request into the engine is sent again after this
RULE_TTL_S = 24 * 3600.0  # how long an explicit abort keeps hitting queued requests enqueued before it


@dataclass(eq=False, slots=True)
class InFlight:
    """One taken entry, from XREADGROUP until its result is published (its entry is pending until then).

    `abort_cause` set means: stop it (the serve path checks it before entering the engine; `in_engine` means
    the engine must be told). `request` is set once the payload is decoded; `reply_to` and `payload` once it
    is answered (`reply_to` None: acknowledge only).
    """

    entry: Entry
    generation: bool  # a rollout request stream (not the token stream): counts against capacity
    task: asyncio.Task[None] | None = None
    request: Request | None = None
    abort_cause: AbortCause | None = None
    in_engine: bool = False
    aborted_at: float = 0.0  # monotonic time of the last abort sent to the engine
    reply_to: str | None = None
    payload: bytes = b""
    publishing: bool = False  # answered, its result queued: released once published
    start_version: int = 0  # the weight version when it entered the engine
    removed: bool = False  # no longer in flight (its deadline's heap entry goes lazily)
    version_marks: list[tuple[int, int]] = field(default_factory=list)  # weight syncs while in it: (version, token)
    entered_at: float = 0.0  # monotonic time it entered the engine
    move_to: str | None = None  # the idle worker a straggler move hands it to (abort cause "migrate")
    answered_at: float = 0.0  # unix time it was answered (its result queued to publish; traced)
    fenced: bool = False  # its publish found its entry no longer pending here (requeued): its result was dropped

    def first_token_version(self, made: int) -> int | None:
        """The weight version of its completion's first token, having made `made` tokens in the engine (after its
        continuation's): the continuation's first, else the version at its first token here (`start_version`, or a
        sync's mark reached before any token); None while it has no token."""
        request = self.request
        prior = request.continuation if isinstance(request, RolloutRequest) else None
        if prior is not None and prior.token_ids:
            return prior.weight_versions[0][0] if prior.weight_versions else self.start_version
        if made <= 0:
            return None
        version = self.start_version
        for marked, token in self.version_marks:
            if token <= 0:
                version = marked  # a sync before its first token: that token came from the new version
        return version

    @property
    def request_ids(self) -> tuple[str, ...]:
        """Its request id, and the one it retries (an abort of that one also hits the retry)."""
        request = self.request
        if request is None:
            return ()
        if isinstance(request, RolloutRequest) and request.continuation is not None:
            return request.request_id, request.continuation.retry_of
        return (request.request_id,)


class InFlightIndex:
    """Every in-flight request of one worker, with the single cancel path (`cancel`) that says why."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._by_key: dict[tuple[str, bytes], InFlight] = {}
        self._by_request: dict[str, InFlight] = {}
        self._by_session: dict[str, set[InFlight]] = {}
        self._generating = 0
        self._aborting: set[InFlight] = set()  # told the engine to abort, not yet returned
        self._deadlines: list[tuple[float, int, InFlight]] = []  # a heap; entries of finished ones go lazily
        self._pushed = itertools.count()
        self.changed = asyncio.Event()  # set whenever one finishes

    def add(self, entry: Entry, generation: bool) -> InFlight:
        record = InFlight(entry, generation)
        self._by_key[(entry.stream, entry.entry_id)] = record
        self._generating += generation
        if entry.session_id:  # an entry field: known before the payload is decoded
            self._by_session.setdefault(entry.session_id, set()).add(record)
        return record

    def decoded(self, record: InFlight, request: Request) -> None:
        """Index a record by its request id and, for a retry, the id it retries (an abort of that hits it too)."""
        record.request = request
        for request_id in record.request_ids:
            self._by_request[request_id] = record
        if record.generation and request.deadline is not None:
            deadlines = self._deadlines
            while deadlines and deadlines[0][2].removed:  # finished ones at the top (the earliest deadlines) go now
                heapq.heappop(deadlines)
            heapq.heappush(deadlines, (request.deadline, next(self._pushed), record))
            if len(deadlines) > 2 * len(self._by_key) + 1024:  # mostly finished ones below the top: rebuild
                self._deadlines = [d for d in deadlines if not d[2].removed]
                heapq.heapify(self._deadlines)

    def running(self, request_id: str) -> InFlight | None:
        """The in-flight record of this request id (or of a request it retries), if any."""
        return self._by_request.get(request_id)

    def remove(self, record: InFlight) -> None:
        if self._by_key.pop((record.entry.stream, record.entry.entry_id), None) is None:
            return
        record.removed = True
        self._generating -= record.generation
        self._aborting.discard(record)
        session_id = record.entry.session_id
        if session_id and (records := self._by_session.get(session_id)) is not None:
            records.discard(record)
            if not records:
                del self._by_session[session_id]
        self.forget_request(record)
        self.changed.set()

    def forget_request(self, record: InFlight) -> None:
        """Stop finding `record` by its request ids (`running`): it no longer runs its request (put back in the
        queue), so a copy of it taken here is served, not taken for a second delivery."""
        for request_id in record.request_ids:
            if self._by_request.get(request_id) is record:
                del self._by_request[request_id]

    def expired(self, now: float) -> list[InFlight]:
        """In-flight rollout requests whose deadline (unix s) is <= `now`, each returned once."""
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            record = heapq.heappop(self._deadlines)[2]
            if record in self:
                due.append(record)
        return due

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, record: object) -> bool:
        return isinstance(record, InFlight) and self._by_key.get((record.entry.stream, record.entry.entry_id)) is record

    def records(self) -> list[InFlight]:
        return list(self._by_key.values())

    def entry_keys(self) -> set[tuple[str, bytes]]:
        """(stream, entry id) of every request in flight."""
        return set(self._by_key)

    @property
    def generating(self) -> int:
        """Rollout requests in flight (what counts against the engine's capacity)."""
        return self._generating

    def by_session(self, session_id: str) -> list[InFlight]:
        return list(self._by_session.get(session_id, ()))

    def by_request_ids(self, request_ids: Iterable[str]) -> list[InFlight]:
        found = {id(r): r for i in request_ids if (r := self._by_request.get(i)) is not None}
        return list(found.values())

    def hit_by(self, command: ControlCommand) -> list[InFlight]:
        """The in-flight rollout requests an abort command covers (looked up by its scope, then checked)."""
        args = command.args
        if args.get("all"):
            candidates = self.records()
        elif args.get("session_id"):
            candidates = self.by_session(str(args["session_id"]))
        else:
            candidates = self.by_request_ids(args.get("request_ids") or [])
        return [r for r in candidates if r.generation and abort_hits(command, r)]

    async def cancel(self, record: InFlight, cause: AbortCause) -> None:
        """Stop one request, for `cause`: the first cause sticks. One not yet in the engine never enters it
        (its serve path sees the cause); one in the engine is aborted there and returns its partial output."""
        if record.abort_cause is not None:
            return  # already stopping (`reabort` repeats an abort that may have missed)
        record.abort_cause = cause
        if record.in_engine:
            record.aborted_at = time.monotonic()
            self._aborting.add(record)
            await self.engine.abort(_rid(record))

    async def cancel_all(self, records: Iterable[InFlight], cause: AbortCause) -> None:
        for record in records:
            await self.cancel(record, cause)

    async def reabort(self) -> None:
        """Abort again what an abort may have missed: a request that entered the engine just after it."""
        now = time.monotonic()
        for record in list(self._aborting):
            if record.in_engine and now - record.aborted_at > REABORT_AFTER_S:
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
    """The explicit aborts this worker applied, and the cancels producers wrote, so a request they hit is answered
    unrun when it is taken later.

    A session or `all` abort with epoch E hits requests enqueued before it (entry epoch < E); a request-id
    abort hits that request and its retries whenever they come; a tombstone hits its request until it expires.
    """

    all_before: int = 0
    sessions: dict[str, int] = field(default_factory=dict)  # session id -> epoch of the abort
    requests: dict[str, float] = field(default_factory=dict)  # request id -> when the abort was issued
    issued: dict[str, float] = field(default_factory=dict)  # session id -> when its abort was issued
    cancelled: dict[str, float] = field(default_factory=dict)  # request id -> its tombstone's expiry (unix ms)
    tombstones_seen: float = 0.0  # the latest tombstone expiry read: the next read starts there

    def add_tombstones(self, tombstones: list[tuple[str, float]]) -> list[str]:
        """Record the tombstones producers wrote (request id, expiry unix ms); returns the ids new here."""
        new = [request_id for request_id, _ in tombstones if request_id not in self.cancelled]
        self.cancelled.update(tombstones)
        self.tombstones_seen = max([self.tombstones_seen, *(expiry for _, expiry in tombstones)])
        now_ms = time.time() * 1000
        if len(self.cancelled) > 1024 and min(self.cancelled.values()) < now_ms:
            self.cancelled = {k: expiry for k, expiry in self.cancelled.items() if expiry >= now_ms}
        return new

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
        if not (self.all_before or self.sessions or self.requests or self.cancelled):
            return False  # the common case: no abort applied, no request cancelled
        if entry.epoch < self.all_before:
            return True
        if entry.session_id and entry.epoch < self.sessions.get(entry.session_id, 0):
            return True
        return not (
            self.requests.keys().isdisjoint(record.request_ids) and self.cancelled.keys().isdisjoint(record.request_ids)
        )

    def _prune(self) -> None:
        oldest = time.time() - RULE_TTL_S
        self.requests = {k: t for k, t in self.requests.items() if t > oldest}
        for sid in [s for s, t in self.issued.items() if t <= oldest]:
            self.sessions.pop(sid, None)
            self.issued.pop(sid, None)


def abort_hits(command: ControlCommand, record: InFlight) -> bool:
    """Whether the abort `command` covers the in-flight `record` (see `AbortRules`, and `InFlightIndex.hit_by`)."""
    args, entry = command.args, record.entry
    if args.get("all"):
        return entry.epoch < command.epoch
    if args.get("session_id"):
        return entry.session_id == args["session_id"] and entry.epoch < command.epoch
    return not set(args.get("request_ids") or []).isdisjoint(record.request_ids)
