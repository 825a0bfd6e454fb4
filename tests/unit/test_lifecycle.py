"""The producer's decisions on a trajectory, without Redis: a token-exact retry, the caller's answer, a regeneration of
a stale one."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_svc.client.lifecycle import final_fields, regeneration_of, retry_of
from rollout_svc.config import ClientSettings
from rollout_svc.protocol import RolloutRequest, TokenizeRequest, Trajectory, decode, encode, staleness_at

NOW = 1_000_000.0
SETTINGS = ClientSettings(max_abort_retries=2, max_staleness=1, stale_policy="regenerate")


def request(**fields: Any) -> RolloutRequest:
    values: dict[str, Any] = {
        "request_id": "r-0",
        "session_id": "s",
        "group_id": "g",
        "prompt_token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 4, "temperature": 0.0},
        "reply_to": "results-g0",
        "deadline": NOW + 60,
        "submitted_at": NOW - 5,
    }
    return RolloutRequest(**(values | fields))


def trajectory(**fields: Any) -> Trajectory:
    """An attempt of `request()` cut by a pause after 2 of its 4 tokens."""
    values: dict[str, Any] = {
        "request_id": "r-0",
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [7, 8],
        "logprobs": [-0.5, -0.25],
        "text": "ab",
        "finish_reason": "abort",
        "abort_cause": "pause",
        "weight_versions": [(3, 0)],
        "top_logprobs": [[(7, "a", -0.5)], [(8, "b", -0.25)]],
        "tokens": ["a", "b"],
        "queue_time_s": 0.5,
        "generation_time_s": 1.0,
    }
    return Trajectory(**(values | fields))


class Addresses:
    """`NewAttempt`: numbered ids on one shard's results stream, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, request: RolloutRequest) -> tuple[str, str]:
        self.calls += 1
        return f"r-{self.calls}", "results-g1"


@pytest.mark.parametrize("cause", ["pause", "shutdown", "stale"])
def test_an_abort_by_a_pause_a_shutdown_or_a_stale_worker_is_retried_token_exact(cause):
    address = Addresses()
    retry = retry_of(request(), trajectory(abort_cause=cause, interruptions=1), SETTINGS, NOW, address)

    assert retry is not None and address.calls == 1
    assert (retry.request_id, retry.reply_to, retry.submitted_at) == ("r-1", "results-g1", NOW)
    assert (retry.session_id, retry.group_id, retry.deadline) == ("s", "g", NOW + 60)
    assert retry.sampling_params == request().sampling_params and retry.prompt_token_ids == [1, 2, 3]
    continuation = retry.continuation
    assert continuation is not None and continuation.retry_of == "r-0" and continuation.interruptions == 2
    assert (continuation.token_ids, continuation.logprobs, continuation.text) == ([7, 8], [-0.5, -0.25], "ab")
    assert continuation.weight_versions == [(3, 0)] and continuation.tokens == ["a", "b"]
    assert continuation.top_logprobs == [[(7, "a", -0.5)], [(8, "b", -0.25)]]


def test_a_chat_request_is_retried_on_the_prompt_ids_it_was_served_with():
    chat = request(prompt_token_ids=None, messages=[{"role": "user", "content": "hi"}])
    retry = retry_of(chat, trajectory(prompt_token_ids=[9, 9, 9]), SETTINGS, NOW, Addresses())

    assert retry is not None and retry.messages is None and retry.prompt is None
    assert retry.prompt_token_ids == [9, 9, 9]


@pytest.mark.parametrize(
    ("why", "result", "original"),
    [
        ("finished", trajectory(finish_reason="stop", abort_cause=None), request()),
        ("cut at its length", trajectory(finish_reason="length", abort_cause=None), request()),
        ("aborted by the user", trajectory(abort_cause="user"), request()),
        ("its deadline aborted it", trajectory(abort_cause="deadline"), request()),
        ("retries exhausted", trajectory(interruptions=2), request()),
        ("cut at its last token", trajectory(completion_token_ids=[7, 8, 9, 10], logprobs=[0.0] * 4), request()),
        ("deadline passed", trajectory(), request(deadline=NOW)),
        ("no prompt ids", trajectory(prompt_token_ids=[]), request()),
        ("not a rollout request", trajectory(), TokenizeRequest(request_id="r-0", text="x", reply_to="results-g0")),
    ],
)
def test_an_attempt_is_final_when(why, result, original):
    address = Addresses()
    assert retry_of(original, result, SETTINGS, NOW, address) is None, why
    assert address.calls == 0  # no id is spent on a retry not made


def test_no_deadline_never_stops_a_retry_and_no_retries_allowed_stops_every_one():
    assert retry_of(request(deadline=None), trajectory(), SETTINGS, NOW + 1e9, Addresses()) is not None
    no_retries = SETTINGS.model_copy(update={"max_abort_retries": 0})
    assert retry_of(request(), trajectory(), no_retries, NOW, Addresses()) is None


def test_what_the_caller_gets_of_an_attempt_not_retried():
    assert final_fields(request(), trajectory(finish_reason="stop", abort_cause=None)) == {}
    assert final_fields(request(), trajectory(abort_cause="user")) == {}  # an explicit abort is final as it is
    cut_at_the_end = trajectory(completion_token_ids=[7, 8, 9, 10], logprobs=[0.0] * 4, interruptions=1)
    assert final_fields(request(), cut_at_the_end) == {"finish_reason": "length", "abort_cause": None}
    assert final_fields(request(), trajectory(interruptions=2)) == {"interruptions": 3}  # retries exhausted
    assert final_fields(request(deadline=NOW), trajectory()) == {"interruptions": 1}  # deadline passed


def test_a_trajectory_staler_than_the_limit_is_generated_again_from_scratch():
    address = Addresses()
    stale = trajectory(finish_reason="stop", abort_cause=None, staleness=2)
    again = regeneration_of(request(), stale, SETTINGS, 0, NOW, address)

    assert again is not None and address.calls == 1
    assert again == request().model_copy(update={"request_id": "r-1", "reply_to": "results-g1"})


@pytest.mark.parametrize(
    ("why", "staleness", "settings", "regenerations", "original"),
    [
        ("within the limit", 1, SETTINGS, 0, request()),
        ("not measured", None, SETTINGS, 0, request()),
        ("no limit", 5, SETTINGS.model_copy(update={"max_staleness": None}), 0, request()),
        ("policy mark", 2, SETTINGS.model_copy(update={"stale_policy": "mark"}), 0, request()),
        ("regenerated enough", 2, SETTINGS, 2, request()),
        ("deadline passed", 2, SETTINGS, 0, request(deadline=NOW - 1)),
        ("not a rollout request", 2, SETTINGS, 0, TokenizeRequest(request_id="r-0", text="x", reply_to="results")),
    ],
)
def test_the_caller_gets_a_trajectory_as_it_is_when(why, staleness, settings, regenerations, original):
    address = Addresses()
    result = trajectory(finish_reason="stop", abort_cause=None, staleness=staleness)
    assert regeneration_of(original, result, settings, regenerations, NOW, address) is None, why
    assert address.calls == 0


def test_staleness_is_the_committed_version_minus_the_first_tokens_and_set_when_a_producer_decodes():
    assert staleness_at([(3, 0), (5, 2)], 5, 6) == 3  # the first token's version, not the last's
    assert staleness_at([], 4, 6) == 2  # no token: the engine's version
    assert staleness_at([(7, 0)], 7, 6) == 0  # never below 0 (committed read before the sync finished)
    payload = encode(trajectory(weight_versions=[(3, 0), (5, 1)], weight_version=5))
    assert decode(payload).staleness is None
    received = decode(payload, committed_version=5)
    assert type(received) is Trajectory and received.staleness == 2 and received.weight_versions == [(3, 0), (5, 1)]


def test_a_trajectory_its_worker_cut_as_too_stale_is_generated_again_whatever_its_measured_staleness():
    address = Addresses()
    cut = trajectory(abort_cause="staleness", staleness=0)  # cut at a load: its producer had not read the commit yet
    assert regeneration_of(request(), cut, SETTINGS, 0, NOW, address) is not None
    no_limit = SETTINGS.model_copy(update={"max_staleness": None})  # the bound was the request's min_weight_version
    assert regeneration_of(request(), cut, no_limit, 0, NOW, address) is not None
    mark = SETTINGS.model_copy(update={"stale_policy": "mark"})
    assert regeneration_of(request(), cut, mark, 0, NOW, address) is None
    assert retry_of(request(), cut, SETTINGS, NOW, address) is None  # never continued token-exact: its tokens are stale


def test_a_requests_staleness_floor_is_the_higher_of_its_relative_and_absolute_bounds():
    assert request().staleness_floor(7) is None
    assert request(max_staleness=0).staleness_floor(7) == 7
    assert request(max_staleness=2).staleness_floor(7) == 5
    assert request(min_weight_version=6).staleness_floor(7) == 6
    assert request(max_staleness=2, min_weight_version=6).staleness_floor(7) == 6
    assert request(max_staleness=0, min_weight_version=6).staleness_floor(7) == 7
    with pytest.raises(ValueError):
        request(max_staleness=-1)


def test_a_staleness_cut_is_judged_by_the_version_that_cut_it_when_its_producer_decodes_it():
    cut = trajectory(abort_cause="staleness", weight_versions=[(3, 0)], weight_version=4)
    assert decode(encode(cut), 3).staleness == 1  # the worker's version 4 is not committed as the producer read it
    plain = trajectory(weight_versions=[(3, 0)], weight_version=4)
    assert decode(encode(plain), 3).staleness == 0
