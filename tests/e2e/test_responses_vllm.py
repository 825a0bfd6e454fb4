"""The Responses API on the real model, driven by the official `openai` client and by OpenAI's Agents SDK
(`openai-agents`, unmodified): text, a forced function call whose arguments parse against the tool's schema, a JSON
schema answer that validates, a continuation by `previous_response_id`, streaming, and an agent run to a final output
with its tool called.

The session's two float32 workers (one CPU core each; tests/e2e/conftest.py) behind this module's `rollout-svc serve`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.e2e.conftest import TWO_FLOAT32, Fleet
from tests.integration.test_api import KEY, serve

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_fleet(TWO_FLOAT32)]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def base(vllm_fleet: Fleet) -> Iterator[str]:
    with serve(vllm_fleet.settings, vllm_fleet.logs / "serve-responses.log") as url:
        yield url


def test_text_a_forced_call_a_schema_a_continuation_and_a_stream(base):
    client = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    r = client.responses.create(model=model, input="Name a colour.", max_output_tokens=16, temperature=0)
    assert r.output_text.strip() and r.usage.output_tokens > 0
    r = client.responses.create(
        model=model,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=model,
        input="What is 2+2?",
        max_output_tokens=32,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}},
    )
    assert isinstance(json.loads(r.output_text)["answer"], int), r.output_text
    first = client.responses.create(model=model, input="My name is Ada.", max_output_tokens=16, temperature=0)
    second = client.responses.with_raw_response.create(
        model=model, input="What is my name?", previous_response_id=first.id, max_output_tokens=16, temperature=0
    )
    assert second.parse().usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.parse().model_extra["worker_id"] == second.headers["X-Worker-ID"]
    events = [e.type for e in client.responses.create(model=model, input="Say hi.", max_output_tokens=8, stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert "response.output_text.delta" in events


def test_the_agents_sdk_runs_an_agent_with_a_tool_to_a_final_output(base):
    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=600)
    set_default_openai_client(client)
    set_tracing_disabled(True)
    called: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    async def main() -> object:
        model = (await client.models.list()).data[0].id
        agent = Agent(
            name="weather",
            instructions="Answer with the tool.",
            tools=[get_weather],
            model=model,
            model_settings=ModelSettings(tool_choice="required", max_tokens=64, temperature=0),
            reset_tool_choice=True,
        )
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        await client.close()
        return result.final_output

    final = asyncio.run(main())
    assert called and all(isinstance(city, str) for city in called)
    assert final, "the agent reached no final output"
