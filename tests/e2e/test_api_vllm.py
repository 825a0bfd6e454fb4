"""The OpenAI-compatible API with real vLLM workers on the real model, driven by the official `openai` client:
chat, completions (text and token ids), real streaming, n, a sticky 5-turn session, tool calls (a named
`tool_choice` through structured outputs; `auto` parsing by vLLM's hermes parser on canned model text) and a
`json_schema` answer, and token-in/token-out equal to `RolloutClient.generate`.

The session's two float32 workers (one CPU core each; tests/e2e/conftest.py) behind this module's `rollout-svc serve`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from rollout_svc import SyncRolloutClient
from rollout_svc.config import Settings
from rollout_svc.model import prepare_model
from tests.e2e.conftest import TWO_FLOAT32, Fleet
from tests.integration.test_api import KEY, serve

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_fleet(TWO_FLOAT32)]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return prepare_model(Settings().cache_dir)


@pytest.fixture(scope="module")
def fleet(vllm_fleet: Fleet) -> Iterator[tuple[Settings, OpenAI]]:
    """The session's two float32 vLLM workers (tests/e2e/conftest.py), behind a `serve` of this module's (its data-plane
    key and admin token)."""
    settings = vllm_fleet.settings
    with serve(settings, vllm_fleet.logs / "serve-api.log") as base:
        yield settings, OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=600)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_chat_completions_and_token_ids_equal_generate(fleet, model_dir):
    settings, client = fleet
    [model] = [m.id for m in client.models.list().data]
    assert model == model_dir.name, "the default served name is the model folder's"
    chat = client.chat.completions.create(model=model, messages=user("What is the capital of France?"), max_tokens=24)
    assert chat.choices[0].message.content.strip() and chat.usage.completion_tokens > 0
    batch = client.completions.create(model=model, prompt=["The sky is", "Water is"], max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and all(c.text for c in batch.choices)
    with SyncRolloutClient(settings) as rollout:
        [ids] = rollout.tokenize(["The capital of France is"])
        [want] = rollout.generate([ids], {"temperature": 0.0, "max_tokens": 16})
    got = client.completions.create(
        model=model, prompt=ids, max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
    )
    assert got.choices[0].token_ids == want.completion_token_ids, "token-in/token-out over HTTP equals generate"
    assert got.choices[0].prompt_token_ids == ids
    r = client.chat.completions.create(model=model, messages=user("Name a color."), max_tokens=8, n=4, seed=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]


def test_streaming_arrives_while_the_model_generates(fleet):
    _, client = fleet
    model = client.models.list().data[0].id
    started, arrivals, pieces = time.monotonic(), [], []
    stream = client.chat.completions.create(
        model=model,
        messages=user("Write a long story about a dragon."),
        max_tokens=128,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - started)
            pieces.append(chunk.choices[0].delta.content)
    total = time.monotonic() - started
    assert len(pieces) >= 5 and arrivals[0] < total / 2, f"chunks at {arrivals} of a {total:.1f} s stream"
    assert sum(a < 0.8 * total for a in arrivals) >= 3


def test_a_five_turn_session_is_served_by_one_worker(fleet):
    _, client = fleet
    model = client.models.list().data[0].id
    system = "You are concise. " * 80  # a few KV blocks long (vLLM on CPU caches whole blocks of 128 tokens)
    session, messages, served = uuid.uuid4().hex, [{"role": "system", "content": system}], set()
    cached = []
    for turn in range(5):
        messages += user(f"Give me one word that starts with {'ABCDE'[turn]}.")
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8, temperature=0, extra_headers={"X-Session-ID": session}
        )
        served.add(raw.headers["X-Worker-ID"])
        chat = raw.parse()
        cached.append(chat.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": chat.choices[0].message.content})
    assert len(served) == 1
    assert cached[-1] > 0, cached  # the later turns find the conversation so far in the worker's prefix cache


def test_tool_calls_and_json_schema(fleet):
    _, client = fleet
    model = client.models.list().data[0].id
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                "required": ["city"],
            },
        },
    }
    r = client.chat.completions.create(
        model=model,
        messages=user("What is the weather in Paris?"),
        tools=[weather],
        max_tokens=48,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo")
    r = client.chat.completions.create(
        model=model,
        messages=user("Call a tool."),
        tools=[weather],
        tool_choice="required",
        max_tokens=64,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls) and r.choices[0].finish_reason == "tool_calls"
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["capital", "is_large"],
        "properties": {"capital": {"type": "string", "enum": ["Paris", "Rome"]}, "is_large": {"type": "boolean"}},
    }
    r = client.chat.completions.create(
        model=model,
        messages=user("Give the capital of France as JSON."),
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    answer = json.loads(r.choices[0].message.content)
    assert answer["capital"] in ("Paris", "Rome") and isinstance(answer["is_large"], bool)


def test_auto_tool_calls_are_parsed_by_vllms_parser_on_canned_text(model_dir):
    """A 135M model rarely calls tools on its own: vLLM's hermes parser (the workers' default) on canned output."""
    from transformers import AutoTokenizer

    from workers.tools import parse_tool_calls

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls("hermes", tokenizer, text, tools)
    assert content == "Let me look.\n" or content.strip() == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and calls[0]["type"] == "function"
    assert parse_tool_calls("hermes", tokenizer, "No tool here.", tools) == ("No tool here.", [])
