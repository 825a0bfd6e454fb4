"""A worker's in-flight index and abort rules (workers/inflight.py): lookups, deadlines, the one cancel path against a
recording engine, and which aborts hit which requests by epoch scope. No Redis, no process."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rollout_svc.dataplane.streams import Entry
from rollout_svc.protocol import Continuation, ControlCommand, RolloutRequest, TokenizeRequest
from workers.inflight import REABORT_AFTER_S, RULE_TTL_S, AbortRules, InFlight, InFlightIndex, Woken, abort_hits


class Engine:
    """Records the request ids it is told to abort."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.fixture
def engine() -> Engine:
    return Engine()


@pytest.fixture
def index(engine: Engine) -> InFlightIndex:
    return InFlightIndex(engine)  # type: ignore[arg-type]


def entry(entry_id: str, session_id: str | None = None, epoch: int = 0, stream: str = "requests") -> Entry:
    return Entry(stream, entry_id.encode(), b"", 1, session_id, epoch)


def request(request_id: str, retry_of: str | None = None, deadline: float | None = None) -> RolloutRequest:
    continuation = Continuation(retry_of=retry_of, token_ids=[5], logprobs=[0.0]) if retry_of else None
    return RolloutRequest(
        request_id=request_id, prompt_token_ids=[1, 2], reply_to="results", continuation=continuation, deadline=deadline
    )


def take(
    index: InFlightIndex,
    request_id: str,
    session_id: str | None = None,
    epoch: int = 0,
    retry_of: str | None = None,
    deadline: float | None = None,
    in_engine: bool = True,
) -> InFlight:
    """A rollout request taken, decoded and (by default) running in the engine."""
    record = index.add(entry(f"e-{request_id}", session_id, epoch), generation=True)
    index.decoded(record, request(request_id, retry_of, deadline))
    record.in_engine = in_engine
    return record


def abort(epoch: int, **args: Any) -> ControlCommand:
    return ControlCommand(command_id=f"c-{epoch}", kind="abort", args=args, epoch=epoch)


def test_records_are_found_by_entry_request_id_retry_and_session(index: InFlightIndex):
    first = take(index, "r-1", session_id="s")
    retry = take(index, "r-2.1", session_id="s", retry_of="r-2")
    other = take(index, "r-3")
    assert len(index) == 3 and first in index and retry in index
    assert index.running("r-1") is first and index.running("r-2.1") is retry and index.running("r-2") is retry
    assert index.running("r-9") is None
    assert set(index.by_session("s")) == {first, retry} and index.by_session("t") == []
    assert index.by_request_ids(["r-2", "r-2.1", "r-3", "nope"]) in ([retry, other], [other, retry])  # each once
    index.remove(retry)
    assert retry not in index and retry.removed and len(index) == 2
    assert index.running("r-2") is None and index.running("r-2.1") is None and index.by_session("s") == [first]
    index.remove(first)
    assert index.by_session("s") == [] and index.records() == [other]


def test_a_record_is_known_by_its_stream_and_entry_id_together(index: InFlightIndex):
    record = index.add(entry("1-0", stream="pinned"), generation=True)
    twin = InFlight(entry("1-0", stream="requests"), True)  # the same entry id in another stream
    assert record in index and twin not in index and "1-0" not in index
    index.remove(twin)  # not in flight: a no-op
    assert len(index) == 1 and index.generating == 1


def test_generating_counts_rollout_requests_only_and_removing_twice_counts_once(index: InFlightIndex):
    rollout = take(index, "r-1")
    tokens = index.add(entry("t-1"), generation=False)
    index.decoded(tokens, TokenizeRequest(request_id="t-1", text="hi", reply_to="results"))
    assert (len(index), index.generating) == (2, 1)
    index.remove(rollout)
    index.remove(rollout)
    assert (len(index), index.generating) == (1, 0)
    index.remove(tokens)
    assert (len(index), index.generating) == (0, 0)


def test_expired_returns_each_due_request_once_and_skips_finished_ones(index: InFlightIndex):
    now = 1_000.0
    late = take(index, "late", deadline=now - 5)
    due = take(index, "due", deadline=now)
    finished = take(index, "finished", deadline=now - 1)
    take(index, "later", deadline=now + 5)
    take(index, "no-deadline")
    index.remove(finished)
    assert index.expired(now) == [late, due]  # earliest deadline first
    assert index.expired(now) == []
    assert [r.request.request_id for r in index.expired(now + 5)] == ["later"]  # type: ignore[union-attr]


async def test_cancel_tells_the_engine_only_about_requests_in_it_and_the_first_cause_sticks(
    index: InFlightIndex, engine: Engine
):
    running, waiting = take(index, "r-1"), take(index, "r-2", in_engine=False)
    await index.cancel_all([running, waiting], "pause")
    assert engine.aborted == ["r-1"]  # r-2 never enters the engine: its serve path sees the cause
    assert (running.abort_cause, waiting.abort_cause) == ("pause", "pause")
    await index.cancel(running, "user")
    assert running.abort_cause == "pause" and engine.aborted == ["r-1"]


async def test_reabort_repeats_an_abort_that_may_have_missed_once_it_is_old_enough(
    index: InFlightIndex, engine: Engine
):
    running, finished, left_engine = take(index, "r-1"), take(index, "r-2"), take(index, "r-3")
    await index.cancel_all([running, finished, left_engine], "user")
    await index.reabort()
    assert engine.aborted == ["r-1", "r-2", "r-3"]  # not yet: each abort was just sent
    for record in (running, finished, left_engine):
        record.aborted_at -= REABORT_AFTER_S + 0.01
    index.remove(finished)
    left_engine.in_engine = False
    await index.reabort()
    assert engine.aborted == ["r-1", "r-2", "r-3", "r-1"]
    assert running.aborted_at > time.monotonic() - REABORT_AFTER_S  # and not again at once
    await index.reabort()
    assert engine.aborted.count("r-1") == 2


def test_abort_commands_hit_in_flight_requests_by_scope_and_epoch(index: InFlightIndex):
    old = take(index, "old", session_id="s", epoch=4)
    new = take(index, "new", session_id="s", epoch=5)
    elsewhere = take(index, "elsewhere", session_id="t", epoch=1)
    retry = take(index, "x.1", retry_of="x", epoch=9)
    tokens = index.add(entry("tok", session_id="s", epoch=0), generation=False)
    index.decoded(tokens, TokenizeRequest(request_id="tok", text="hi", reply_to="results"))
    assert set(index.hit_by(abort(5, all=True))) == {old, elsewhere}  # enqueued before epoch 5; rollouts only
    assert index.hit_by(abort(5, session_id="s")) == [old]
    assert index.hit_by(abort(6, session_id="s")) in ([old, new], [new, old])
    assert index.hit_by(abort(5, request_ids=["x"])) == [retry]  # an abort of a request hits its retry, any epoch
    assert index.hit_by(abort(5, request_ids=["nope"])) == []
    assert abort_hits(abort(5, session_id="t"), elsewhere) and not abort_hits(abort(1, session_id="t"), elsewhere)


def test_rules_hit_queued_requests_taken_later_by_epoch_scope():
    rules, index = AbortRules(), InFlightIndex(Engine())  # type: ignore[arg-type]
    assert not rules.hits(take(index, "any", epoch=0))  # no rule: nothing is hit
    rules.add(abort(5, all=True))
    assert rules.hits(take(index, "before-all", epoch=4)) and not rules.hits(take(index, "after-all", epoch=5))
    rules.add(abort(8, session_id="s"))
    assert rules.hits(take(index, "s-before", session_id="s", epoch=7))
    assert not rules.hits(take(index, "s-after", session_id="s", epoch=8))
    assert not rules.hits(take(index, "t-before", session_id="t", epoch=7))
    rules.add(abort(6, session_id="s"))  # an older abort of the session does not lower its bar
    assert rules.hits(take(index, "s-again", session_id="s", epoch=7))
    rules.add(abort(9, request_ids=["r"]))
    assert rules.hits(take(index, "r", epoch=100)) and rules.hits(take(index, "r.2", retry_of="r", epoch=100))
    assert not rules.hits(take(index, "q", epoch=100))


def test_tombstones_hit_their_requests_and_report_what_is_new():
    rules, index = AbortRules(), InFlightIndex(Engine())  # type: ignore[arg-type]
    expiry = time.time() * 1000 + 60_000
    assert rules.add_tombstones([("a", expiry), ("b", expiry + 1)]) == ["a", "b"]
    assert rules.add_tombstones([("b", expiry + 1), ("c", expiry + 2)]) == ["c"]
    assert rules.tombstones_seen == expiry + 2
    assert rules.hits(take(index, "a")) and rules.hits(take(index, "c.1", retry_of="c"))
    assert not rules.hits(take(index, "d"))


def test_rules_older_than_their_ttl_are_dropped():
    rules, index = AbortRules(), InFlightIndex(Engine())  # type: ignore[arg-type]
    stale = time.time() - RULE_TTL_S - 1
    rules.add(ControlCommand(command_id="c-1", kind="abort", args={"session_id": "s"}, epoch=3, issued_at=stale))
    rules.add(ControlCommand(command_id="c-2", kind="abort", args={"request_ids": ["r"]}, epoch=4, issued_at=stale))
    rules.add(abort(5, request_ids=["fresh"]))  # pruning happens as rules are added
    assert not rules.hits(take(index, "r", session_id="s", epoch=1))
    assert rules.hits(take(index, "fresh"))


async def test_wait_changed_returns_when_a_request_finishes(index: InFlightIndex):
    record = take(index, "r-1")
    waiting = asyncio.ensure_future(index.wait_changed(30))
    await asyncio.sleep(0)  # let it start waiting
    assert not waiting.done()
    index.remove(record)
    await asyncio.wait_for(waiting, 5)  # at once, not after its 30 s


async def test_wait_changed_returns_after_its_timeout_when_nothing_finishes(index: InFlightIndex):
    take(index, "r-1")
    index.changed.set()  # a change before the wait started does not count
    started = time.monotonic()
    await index.wait_changed(0.05)
    assert time.monotonic() - started >= 0.05


def test_what_a_blocking_read_took_is_claimed_once_and_says_whether_a_take_is_needed() -> None:
    def entry(stream: str, cost: int) -> Entry:
        return Entry(stream, b"1-0", b"", 1, cost=cost)

    woken = Woken()
    woken.add([entry("pinned", 5), entry("shared", 7)], "pinned", asked=2)
    assert (woken.tokens, woken.pinned, woken.drained) == (12, 5, True)  # one of each where 2 were asked: none left
    with woken.claimed() as claimed:
        assert claimed == (12, 5) and (woken.tokens, woken.pinned) == (0, 0)
    with pytest.raises(ConnectionError), woken.claimed() as claimed:  # nothing left to claim
        assert claimed == (0, 0)
        raise ConnectionError
    woken.add([entry("shared", 3), entry("shared", 4)], "pinned", asked=2)
    assert woken.drained is False  # as many as asked: more may be queued, the next take shares them out
    with pytest.raises(ConnectionError), woken.claimed():
        raise ConnectionError  # the call failed: given back, for the next call to count
    assert (woken.tokens, woken.pinned) == (7, 0)
    with woken.claimed(claim=False) as claimed:
        assert claimed == (0, 0) and woken.tokens == 7
    woken.add([entry("shared", 1)], "pinned", asked=1)
    assert woken.drained is False  # one asked, one taken: nothing known about the rest
    woken.add([], "pinned", asked=2)
    assert woken.drained is False and woken.tokens == 8  # a read that timed out: the next take looks
