"""`InFlight.first_token_version`: which weight version a running request's first token came from, the figure a
weight sync compares with the request's staleness floor before it lets the request generate on."""

from __future__ import annotations

from rollout_svc.dataplane.streams import Entry
from rollout_svc.protocol import Continuation, RolloutRequest
from workers.inflight import InFlight


def record(continuation: Continuation | None = None, start: int = 3, marks=()) -> InFlight:
    entry = Entry(stream="requests", entry_id=b"1-0", payload=b"", session_id=None, deliveries=1)
    fields = {"continuation": continuation} if continuation else {}
    request = RolloutRequest(
        request_id="r", prompt_token_ids=[1, 2], reply_to="results", sampling_params={"max_tokens": 8}, **fields
    )
    return InFlight(entry, True, request=request, start_version=start, version_marks=list(marks))


def test_no_token_yet_has_no_version():
    assert record().first_token_version(0) is None


def test_the_first_token_made_here_comes_from_the_version_it_entered_with():
    assert record(start=3).first_token_version(2) == 3
    assert record(start=3, marks=[(4, 2)]).first_token_version(5) == 3  # a sync after 2 tokens: the first is still 3


def test_a_sync_before_any_token_gives_the_first_token_the_new_version():
    assert record(start=3, marks=[(4, 0)]).first_token_version(1) == 4


def test_a_continuations_first_token_is_its_first_span():
    prior = Continuation(retry_of="r0", token_ids=[5, 6], logprobs=[0.0, 0.0], weight_versions=[(1, 0), (2, 1)])
    assert record(prior, start=3).first_token_version(0) == 1
