"""The chaos soak's ledger: what was submitted, how each request was answered, which faults ran, and the checks.

Pure bookkeeping (no Redis, no processes), so a unit test can feed it a history and see each check fire.
Times are unix seconds (`time.time()`), the clock workers stamp `queue_time_s` against: all on one host.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from rollout_svc.protocol import Trajectory

FAULT_WINDOW_BEFORE_S = 3.0  # a violation names the faults from this long before its request was submitted
# A request unanswered within its call's timeout is a violation only if the fleet could take work for at least this
# long of its wait (`Ledger.serviceable_s`); else it is counted `late_excused`: every worker had lost the committed
# version (killed after a broadcast, no peer holding it) while each new trainer's sync failed, or the fleet was paused.
LATE_SERVICE_S = 10.0
BOUND_FIGURES = ("bounded_requests", "cut_for_staleness", "answered_whole", "whole_stale_at_receipt")


@dataclass(frozen=True)
class Submitted:
    """One request as its driver sent it. `label` names the call (`session s2.7 turn 3`, `batch b1.40`).
    `max_staleness`: the staleness bound it carries (weight versions; None: unbounded, see `check_bounds`)."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    submitted_at: float
    session_id: str | None
    label: str
    max_staleness: int | None = None


@dataclass(frozen=True)
class Answer:
    """How the caller heard back about one request: a trajectory; a refusal (the call raised at submission: Redis
    away, queue full); or `late` (no answer within the call's timeout: a lost request or a hang)."""

    received_at: float
    trajectory: Trajectory | None = None
    refused: str = ""
    late: bool = False


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    target: str

    def label(self, started_at: float) -> str:
        return f"{self.at - started_at:.1f} s {self.kind} {self.target}"


@dataclass
class Verdict:
    """What the checks found: outcome counts (`ok`, `aborted_by_user`, `cut_for_staleness`, `refused`,
    `dead_letter`, ...), session figures, bounded-request figures (`check_bounds`; empty if none was bounded), and the
    violations, each a dict with `check`, `what` and, where there is one, `request_id`, `session_id` and
    `faults_near` (the faults from shortly before the request was submitted until its answer)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    sessions: dict[str, int] = field(default_factory=dict)
    bounds: dict[str, int] = field(default_factory=dict)
    violations: list[dict[str, Any]] = field(default_factory=list)


class Ledger:
    """Every submitted request by id, every answer, every explicit session abort and every fault, as they happen."""

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self.submitted: dict[str, Submitted] = {}
        self.answers: dict[str, list[Answer]] = defaultdict(list)
        self.session_aborts: dict[str, list[float]] = defaultdict(list)  # session -> when each abort returned
        self.faults: list[Fault] = []
        self.duplicate_submissions: list[str] = []
        self.unserviceable: list[tuple[float, float]] = []  # when no worker could take work (the soak's monitor)

    def submit(self, request: Submitted) -> None:
        if request.request_id in self.submitted:
            self.duplicate_submissions.append(request.request_id)
        self.submitted[request.request_id] = request

    def answer(self, request_id: str, answer: Answer) -> None:
        self.answers[request_id].append(answer)

    def session_aborted(self, session_id: str, at: float) -> None:
        """An explicit `abort(session_id=...)` returned (or failed) at `at`: it may have hit any request of the
        session submitted before then."""
        self.session_aborts[session_id].append(at)

    def fault(self, kind: str, target: str, at: float) -> Fault:
        fault = Fault(at, kind, target)
        self.faults.append(fault)
        return fault

    def could_not_serve(self, since: float, until: float) -> None:
        """From `since` to `until` no worker could take work: Redis away, the fleet paused or asleep, or no worker
        with a fresh heartbeat serving (every one stale, starting, dead or stalled)."""
        self.unserviceable.append((since, until))

    def serviceable_s(self, since: float, until: float) -> float:
        """Seconds of [since, until] in which some worker could take work (the intervals do not overlap)."""
        down = sum(max(0.0, min(b, until) - max(a, since)) for a, b in self.unserviceable)
        return max(0.0, until - since - down)

    @property
    def answered(self) -> int:
        return sum(1 for answers in self.answers.values() if answers)

    def faults_near(self, since: float, until: float) -> list[str]:
        return [f.label(self.started_at) for f in self.faults if since - FAULT_WINDOW_BEFORE_S <= f.at <= until]


def check(ledger: Ledger, extra_violations: list[dict[str, Any]] | None = None) -> Verdict:
    """Run every ledger check (see `check_answers`, `check_sessions`, `check_bounds`); `extra_violations` (the
    fleet's end state) are appended."""
    verdict = Verdict()
    check_answers(ledger, verdict)
    check_sessions(ledger, verdict)
    check_bounds(ledger, verdict)
    verdict.violations += extra_violations or []
    return verdict


def check_answers(ledger: Ledger, verdict: Verdict) -> None:
    """Exactly once: every submitted request has one answer, and every answer is to a submitted request.

    Each answer is judged against the echo engine, which answers `prompt[:max_tokens]` (`length` if the prompt is
    longer, else `stop`), token-exact across retries: a completed trajectory must be exactly that, under the request's
    own id and prompt. An explicit abort (`abort`, cause `user`) is an answer if an abort of its session returned after
    it was submitted; its tokens must be a prefix of the echo. A request that carries a staleness bound may be answered
    cut by its worker as too stale (`abort`, cause `staleness`, with `stale_policy="mark"`): its tokens so far, a prefix
    of the echo (`cut_for_staleness`; `check_bounds` checks their versions). A dead letter (`error`, code
    `max_deliveries`: every worker that took it died) is an answer the service promises, counted apart. A refusal at
    submission is an answer (a clear error), counted apart. Anything else is a violation: no answer, two answers, no
    answer within the timeout while the fleet could serve for `LATE_SERVICE_S` of it, a wrong or unexplained answer.
    (Unanswered within the timeout while the fleet could not serve: `late_excused`. The call raised
    `RequestTimeoutError` at its deadline, as it promises, or returned the worker's answer that the deadline passed
    before it ran the request, `abort` with cause `deadline`, which counts the same; drivers whose call does not return
    at all are caught by the soak.)
    """
    for request_id in ledger.duplicate_submissions:
        verdict.violations.append(
            _violation("exactly_once", "one request id submitted twice (a driver bug)", request_id)
        )
    for request_id, request in ledger.submitted.items():
        answers = ledger.answers.get(request_id, [])
        if len(answers) != 1:
            what = "never answered: its call did not return" if not answers else f"answered {len(answers)} times"
            verdict.violations.append(_violation("exactly_once", what, request_id, request, ledger))
            continue
        outcome, problem = judge(request, answers[0], ledger)
        verdict.outcomes[outcome] += 1
        if problem:
            verdict.violations.append(_violation(outcome, problem, request_id, request, ledger, answers[0]))
    for request_id in ledger.answers.keys() - ledger.submitted.keys():
        verdict.violations.append(_violation("exactly_once", "an answer to a request never submitted", request_id))


def judge(request: Submitted, answer: Answer, ledger: Ledger) -> tuple[str, str]:
    """(outcome, problem): the answer's kind, and what is wrong with it ('' if nothing)."""
    if answer.refused:
        return "refused", ""
    t = answer.trajectory
    deadline = t is not None and t.finish_reason == "abort" and t.abort_cause == "deadline"
    if answer.late or deadline:  # no answer by the deadline, or the worker's answer that it passed (the same)
        serviceable = ledger.serviceable_s(request.submitted_at, answer.received_at)
        if serviceable < LATE_SERVICE_S:
            return "late_excused", ""
        how = "answered abort (deadline)" if deadline else "no answer"
        return "late", f"{how} within the call's timeout, {serviceable:.1f} s of it serviceable (lost, or hung)"
    assert t is not None
    if t.request_id != request.request_id:
        return "wrong_answer", f"answered under another request id, {t.request_id}"
    expected = request.prompt[: request.max_tokens]
    if t.finish_reason in ("stop", "length"):
        reason = "length" if len(request.prompt) > request.max_tokens else "stop"
        if t.prompt_token_ids != request.prompt or t.completion_token_ids != expected or t.finish_reason != reason:
            return "wrong_answer", f"not the echo: {reason} expected, got {_describe(t)}"
        return "ok", ""
    if t.finish_reason == "abort" and t.abort_cause == "user":
        if t.completion_token_ids != expected[: len(t.completion_token_ids)]:
            return "wrong_answer", f"aborted with tokens that are not a prefix of the echo: {_describe(t)}"
        aborts = ledger.session_aborts.get(request.session_id or "", [])
        if not any(at >= request.submitted_at for at in aborts):
            return "unexplained_abort", "aborted by the user, but no abort of its session came after it was sent"
        return "aborted_by_user", ""
    if t.finish_reason == "abort" and t.abort_cause == "staleness" and request.max_staleness is not None:
        if t.completion_token_ids != expected[: len(t.completion_token_ids)]:
            return "wrong_answer", f"cut for staleness with tokens that are not a prefix of the echo: {_describe(t)}"
        return "cut_for_staleness", ""
    if t.finish_reason == "error" and t.error_code == "max_deliveries":
        return "dead_letter", ""
    return "wrong_answer", f"unexpected answer: {_describe(t)}"


@dataclass(frozen=True)
class Service:
    """When a worker served one request, as the trajectory says: it took it `queue_time_s` after submission and
    generated for `generation_time_s`."""

    start: float
    end: float
    worker_id: str
    request_id: str


def service(request: Submitted, t: Trajectory) -> Service | None:
    """The interval a trajectory reports, or None where it reports none honestly: a trajectory retried after an
    abort (`interruptions` > 0) sums the times of attempts that may have run on other workers, with gaps between
    them; one answered unrun (an abort before it started) was never generated."""
    if t.interruptions or not t.worker_id or t.finish_reason == "error" or t.generation_time_s <= 0:
        return None
    start = request.submitted_at + t.queue_time_s
    return Service(start, start + t.generation_time_s, t.worker_id, t.request_id)


def check_sessions(ledger: Ledger, verdict: Verdict) -> None:
    """No session served by two workers at once, as far as the caller can observe it.

    A driver's turns are sequential (a turn is sent once the previous one was answered), and some turns send two
    requests of the session at once: those two must run on one worker (the placement script places a batch's
    session once; a requeue re-places it once). For every answered request we take the interval its trajectory
    reports on its `worker_id` (`service`: submitted_at + queue_time_s, for generation_time_s); two intervals of
    one session on different workers (incarnations `w1` and `w1~1` count as different) must not overlap. What
    this cannot see: a stalled worker that wakes and keeps generating a request already requeued elsewhere
    (fencing drops its result; the fleet's `fenced_results` count it), and trajectories retried after an abort,
    whose times span attempts (counted as `untimed`).
    """
    by_session: dict[str, list[Service]] = defaultdict(list)
    untimed = 0
    for request_id, request in ledger.submitted.items():
        answers = ledger.answers.get(request_id, [])
        t = answers[0].trajectory if len(answers) == 1 else None
        if request.session_id is None or t is None:
            continue
        served = service(request, t)
        if served is None:
            untimed += t.interruptions > 0
            continue
        by_session[request.session_id].append(served)
    moves = 0
    for services in by_session.values():
        services.sort(key=lambda s: s.start)
        moves += sum(a.worker_id != b.worker_id for a, b in itertools.pairwise(services))
        for a, b in _overlapping(services):
            what = (
                f"served by {a.worker_id} and {b.worker_id} at once: {a.request_id} "
                f"[{a.start - ledger.started_at:.3f}, {a.end - ledger.started_at:.3f}] s and {b.request_id} "
                f"[{b.start - ledger.started_at:.3f}, {b.end - ledger.started_at:.3f}] s"
            )
            violation = _violation("sessions", what, b.request_id, ledger.submitted[b.request_id], ledger)
            verdict.violations.append(violation)
    verdict.sessions = {"sessions": len(by_session), "timed_requests": sum(map(len, by_session.values()))}
    verdict.sessions |= {"moves": moves, "untimed": untimed}


def check_bounds(ledger: Ledger, verdict: Verdict) -> None:
    """No token generated for a bounded request once a commit made it too stale (violations `stale_generated`).

    A worker cuts a request whose first token a new weight version makes staler than its `max_staleness` (at the
    load, and when it takes the request) rather than generating on: so every token of an answered bounded
    trajectory comes from a version at most `max_staleness` above its first token's. Its `weight_versions` spans
    (`(version, first_token_index)`; only those that hold a token are read) must all be at or below the first span's
    version plus the bound: with a bound of 0, one version only, whether it came back whole or cut for staleness. A
    span above it (generated on across the sync that should have cut it) is a violation. Figures in
    `verdict.bounds`: `bounded_requests`, `cut_for_staleness`, `answered_whole` (`stop` or `length`) and
    `whole_stale_at_receipt` (whole, staler than the bound when the client received it: finished before the load
    that would have cut it, or on a worker that had not heard of the commit yet; not a violation)."""
    counts: Counter[str] = Counter()
    for request_id, request in ledger.submitted.items():
        if request.max_staleness is None:
            continue
        counts["bounded_requests"] += 1
        answers = ledger.answers.get(request_id, [])
        t = answers[0].trajectory if len(answers) == 1 else None
        if t is None:
            continue
        if t.finish_reason == "abort" and t.abort_cause == "staleness":
            counts["cut_for_staleness"] += 1
        elif t.finish_reason in ("stop", "length"):
            counts["answered_whole"] += 1
            counts["whole_stale_at_receipt"] += (t.staleness or 0) > request.max_staleness
        spans = [(version, first) for version, first in t.weight_versions if first < len(t.completion_token_ids)]
        too_new = [(v, first) for v, first in spans if v > spans[0][0] + request.max_staleness]
        if too_new:
            what = (
                f"tokens generated past its bound (max_staleness {request.max_staleness}): spans {spans} of "
                f"{len(t.completion_token_ids)} tokens, the first under version {spans[0][0]}; {_describe(t)}"
            )
            verdict.violations.append(_violation("stale_generated", what, request_id, request, ledger, answers[0]))
    if counts["bounded_requests"]:
        verdict.bounds = {key: counts[key] for key in BOUND_FIGURES}


def _overlapping(services: list[Service]) -> list[tuple[Service, Service]]:
    """Pairs served by different workers whose intervals overlap (`services` sorted by start)."""
    pairs = []
    for i, a in enumerate(services):
        for b in services[i + 1 :]:
            if b.start >= a.end:
                break
            if b.worker_id != a.worker_id:
                pairs.append((a, b))
    return pairs


def _describe(t: Trajectory) -> str:
    cause = f" ({t.abort_cause})" if t.abort_cause else ""
    error = f" {t.error_code}: {t.error}" if t.finish_reason == "error" else ""
    return (
        f"{t.finish_reason}{cause}{error}, {len(t.completion_token_ids)} tokens, worker {t.worker_id or '-'}, "
        f"interruptions {t.interruptions}"
    )


def _violation(
    check_name: str,
    what: str,
    request_id: str,
    request: Submitted | None = None,
    ledger: Ledger | None = None,
    answer: Answer | None = None,
) -> dict[str, Any]:
    violation: dict[str, Any] = {"check": check_name, "what": what, "request_id": request_id}
    if request is not None:
        violation["session_id"] = request.session_id
        violation["call"] = request.label
    if request is not None and ledger is not None:
        until = answer.received_at if answer is not None else float("inf")
        violation["submitted_s"] = round(request.submitted_at - ledger.started_at, 3)
        violation["faults_near"] = ledger.faults_near(request.submitted_at, until)
    return violation
