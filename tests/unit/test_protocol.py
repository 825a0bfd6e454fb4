"""Wire messages: msgpack round trips, schema version checks, validation of user input."""

from __future__ import annotations

import msgpack
import pytest

from rollout_svc.errors import InvalidRequestError, ProtocolError
from rollout_svc.protocol import (
    SCHEMA_VERSION,
    ErrorResult,
    RolloutRequest,
    SamplingParams,
    Trajectory,
    as_sampling_params,
    decode,
    encode,
    reply_address,
)


def test_round_trip_keeps_every_field():
    request = RolloutRequest(
        request_id="r1",
        session_id="s1",
        group_id="g1",
        messages=[{"role": "user", "content": "hi", "name": "bob"}],
        sampling_params=SamplingParams(temperature=0.5, stop=["\n"], seed=3),
        reply_to="rollout:results:p",
        deadline=123.5,
    )
    assert decode(encode(request)) == request
    trajectory = Trajectory(
        request_id="r1", prompt_token_ids=[1], completion_token_ids=[2, 3], logprobs=[-0.5, -1.0], finish_reason="stop"
    )
    assert decode(encode(trajectory)) == trajectory


def test_envelope_carries_schema_version_and_type():
    envelope = msgpack.unpackb(encode(ErrorResult(request_id="r", code="undecodable", message="m")))
    assert envelope["v"] == SCHEMA_VERSION and envelope["t"] == "ErrorResult"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xc1", "not a rollout-svc message"),
        (msgpack.packb({"v": SCHEMA_VERSION + 1, "t": "Trajectory", "b": {}}), "schema version"),
        (msgpack.packb({"v": SCHEMA_VERSION, "t": "os.system", "b": {}}), "unknown message type"),
        (msgpack.packb({"v": SCHEMA_VERSION, "t": "Trajectory", "b": {"request_id": 1}}), "invalid Trajectory"),
    ],
)
def test_decode_refuses_what_it_does_not_understand(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_reply_address_of_a_message_that_did_not_decode():
    data = msgpack.packb({"v": 99, "t": "RolloutRequest", "b": {"request_id": "r", "reply_to": "q"}})
    assert reply_address(data) == ("r", "q")
    assert reply_address(b"junk") is None


def test_request_needs_exactly_one_prompt():
    with pytest.raises(ValueError, match="exactly one"):
        RolloutRequest(request_id="r", reply_to="q")
    with pytest.raises(ValueError, match="exactly one"):
        RolloutRequest(request_id="r", reply_to="q", prompt_token_ids=[1], messages=[{"role": "user", "content": "x"}])


def test_sampling_params_use_vllm_names_and_refuse_unknown_fields():
    assert as_sampling_params({"temperature": 0, "top_k": -1}).top_k == -1
    with pytest.raises(InvalidRequestError, match="temprature"):
        as_sampling_params({"temprature": 0.5})
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        as_sampling_params({"min_tokens": 5, "max_tokens": 2})
    with pytest.raises(InvalidRequestError, match="finite"):
        as_sampling_params({"temperature": float("inf")})


def test_readers_ignore_fields_they_do_not_know_but_user_parameters_refuse_them():
    trajectory = Trajectory(request_id="r", prompt_token_ids=[1], finish_reason="stop")
    body = {**trajectory.model_dump(), "added_in_a_later_release": 7}
    assert decode(msgpack.packb({"v": SCHEMA_VERSION, "t": "Trajectory", "b": body})) == trajectory
    request = {"request_id": "r", "reply_to": "q", "prompt_token_ids": [1], "sampling_params": {"temprature": 1}}
    with pytest.raises(InvalidRequestError, match="temprature"):
        decode(msgpack.packb({"v": SCHEMA_VERSION, "t": "RolloutRequest", "b": request}))


def test_a_continuation_carries_one_logprob_per_token_and_leaves_room_to_generate():
    base = {"request_id": "r2", "reply_to": "q", "prompt_token_ids": [1, 2]}
    ok = RolloutRequest(**base, continuation={"retry_of": "r1", "token_ids": [3], "logprobs": [-0.1]})
    assert ok.original_request_id == "r1" and decode(encode(ok)) == ok
    with pytest.raises(ValueError, match="one logprob per token"):
        RolloutRequest(**base, continuation={"retry_of": "r1", "token_ids": [3], "logprobs": []})
    with pytest.raises(ValueError, match="at least one token"):
        RolloutRequest(
            **base,
            sampling_params={"max_tokens": 1},
            continuation={"retry_of": "r1", "token_ids": [3], "logprobs": [0.0]},
        )


def test_a_workers_answer_decodes_without_pydantic_to_the_same_model_and_is_still_checked():
    from rollout_svc.protocol import ChatMessage, Trajectory

    full = Trajectory(
        request_id="r-1",
        session_id="s",
        group_id="g",
        prompt_token_ids=[1, 2],
        completion_token_ids=[3, 4],
        logprobs=[-0.5, -0.25],
        finish_reason="abort",
        text="ab",
        weight_version=2,
        worker_id="w0",
        queue_time_s=0.5,
        generation_time_s=1.5,
        abort_cause="pause",
        interruptions=1,
        weight_versions=[(1, 0), (2, 1)],
        staleness=None,
        top_logprobs=[[(3, "a", -0.5)], [(4, "b", -0.25)]],
        tokens=["a", "b"],
        tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        content="",
        prompt_logprobs=[[], [(2, "b", -1.5, 3), (7, "x", -0.1, 1)]],
    )
    decoded = decode(encode(full))
    assert decoded == full and type(decoded) is Trajectory
    assert decoded.weight_versions == [(1, 0), (2, 1)] and decoded.top_logprobs == [[(3, "a", -0.5)], [(4, "b", -0.25)]]
    assert decoded.prompt_logprobs == [[], [(2, "b", -1.5, 3), (7, "x", -0.1, 1)]]
    assert decoded.model_copy(update={"staleness": 0}).staleness == 0  # a real model: it copies
    minimal = decode(encode(Trajectory(request_id="r", prompt_token_ids=[1], finish_reason="stop")))
    assert minimal.completion_token_ids == [] and minimal.error is None
    body = msgpack.unpackb(encode(full))
    body["b"]["finish_reason"] = "exploded"
    with pytest.raises(ProtocolError, match="invalid Trajectory"):
        decode(msgpack.packb(body))
    body["b"]["finish_reason"], body["b"]["completion_token_ids"] = "stop", ["x"]
    with pytest.raises(ProtocolError, match="invalid Trajectory"):
        decode(msgpack.packb(body))
    chat = RolloutRequest(
        request_id="c", messages=[ChatMessage(role="tool", content="x", tool_call_id="7")], reply_to="q"
    )
    assert decode(encode(chat)).messages[0].model_extra == {"tool_call_id": "7"}, "a message's extras were not encoded"
