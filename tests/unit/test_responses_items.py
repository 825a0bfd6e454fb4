"""Responses API input items as chat messages, and the request body's refusals (`rollout_svc.openai.responses`,
`responses_schemas`): no HTTP, no Redis."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout_svc.openai.errors import APIError
from rollout_svc.openai.responses import Turn, input_messages
from rollout_svc.openai.responses_schemas import ResponsesRequest
from rollout_svc.protocol import Trajectory


def test_items_become_chat_messages_as_vllm_makes_them():
    items = [
        {"type": "message", "role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "clock", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
    ]  # fmt: skip
    assert input_messages(items) == [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}},
                {"id": "c2", "type": "function", "function": {"name": "clock", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input.0.content.0"),
        ([{"type": "item_reference", "id": "msg_1"}], "input.0"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input.0.call_id"),
        ([{"role": "robot", "content": "hi"}], "input.0"),
        ([], "input"),
    ],
)
def test_an_item_we_do_not_serve_is_a_400_naming_it(items, param):
    with pytest.raises(APIError) as caught:
        input_messages(items)
    assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"tools": [{"type": "web_search"}]}, None),  # refused when planned: tools.0
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_the_body_refuses_what_is_not_served_by_name(extra, named):
    if named is None:
        body = ResponsesRequest.model_validate({"input": "hi", **extra})
        with pytest.raises(ValueError, match="not supported"):
            body.function_tools()
        return
    with pytest.raises(ValidationError, match=named):
        ResponsesRequest.model_validate({"input": "hi", **extra})


def test_accepted_and_unused_fields_change_nothing():
    body = ResponsesRequest.model_validate(
        {"input": "hi", "service_tier": "auto", "prompt_cache_key": "k", "include": [], "reasoning": {"effort": None}}
    )
    assert body.store and body.tool_choice == "auto"


def test_a_turn_plans_a_chat_and_carries_its_output_as_the_next_turns_history():
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
    body = ResponsesRequest.model_validate(
        {"input": "Oslo?", "instructions": "Use tools.", "tools": [tool], "tool_choice": "required"}
    )
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    turn = Turn(body, "m", history, input_messages(body.input), "session-1", 64, id="resp_1")
    [prompt] = turn.plan.prompts
    assert prompt[0] == {"role": "system", "content": "Use tools."} and prompt[1:] == [*history, turn.new[0]]
    assert turn.plan.session_id == "session-1" and turn.plan.params[0].max_tokens == 64
    assert turn.plan.params[0].structured_outputs is not None and turn.plan.reply.required_tools
    t = Trajectory(
        request_id="resp_1",
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
        logprobs=[0.0],
        text='[{"name": "weather", "parameters": {"city": "Oslo"}}]',
        finish_reason="stop",
    )
    output = turn.output_items(t)
    [call] = output
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "weather", '{"city": "Oslo"}')
    after = turn.answered(output)
    assert after[:3] == [*history, {"role": "user", "content": "Oslo?"}]
    assert after[3]["role"] == "assistant" and after[3]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert turn.response(t, output, turn.status_of(t))["usage"]["total_tokens"] == 3
