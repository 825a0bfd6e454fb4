"""The Responses API (`POST /v1/responses` and its routes) driven by the official `openai` client against `serve`
processes, a real redis-server and echo workers: shapes and the event stream as the client parses them, input items,
conversations through a second replica and a restart, a worker's death, cancel, delete, and what is refused.

The echo engine answers with its templated prompt ("<|role|>content\\n" per message, then "<|assistant|>"), so what
a turn's prompt held is read off its answer. What needs a real model (a forced call's arguments that parse, a JSON
schema answer, the Agents SDK) is in tests/e2e/test_responses_vllm.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from rollout_svc.config import Settings
from tests.support import serve, wait_until

KEY = "data-key"
ENV = {"ROLLOUT_API_KEYS": f'["{KEY}"]'}


def client_of(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture
def replicas(settings: Settings, echo_workers, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two `serve` processes of one fleet of 2 echo workers (10 ms a token)."""
    echo_workers(2, "--echo-token-delay-s", "0.01")
    with serve(settings, tmp_path / "a.log", env=ENV) as a, serve(settings, tmp_path / "b.log", env=ENV) as b:
        yield a, b


def test_a_turn_and_its_stream_in_openai_shapes(replicas):
    a, _ = replicas
    client = client_of(a)
    raw = client.responses.with_raw_response.create(
        model="echo", input="hello", instructions="Be brief.", max_output_tokens=100, metadata={"run": "7"}
    )
    r = raw.parse()
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == "<|system|>Be brief.\n<|user|>hello\n<|assistant|>"
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens == len(r.output_text) and r.usage.input_tokens == len(r.output_text)
    assert r.metadata == {"run": "7"} and r.instructions == "Be brief." and r.max_output_tokens == 100
    assert r.model_extra["worker_id"] == raw.headers["X-Worker-ID"] and r.model_extra["weight_version"] == 0
    cut = client.responses.create(model="echo", input="hello", max_output_tokens=4)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == "<|us"

    events = list(client.responses.create(model="echo", input="stream " * 30, max_output_tokens=400, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == f"<|user|>{'stream ' * 30}\n<|assistant|>"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "".join(deltas) and final.output[0].id == events[2].item.id
    with client.responses.stream(model="echo", input="hi", max_output_tokens=50) as stream:
        assert stream.get_final_response().output_text == "<|user|>hi\n<|assistant|>"


def test_input_items_become_the_conversation_and_calls_come_out_as_items(replicas):
    """Messages, a function call and its output reach the chat template as chat's messages and tool message; a
    named tool_choice answers with a `function_call` item (its arguments are the forced output), streamed as one."""
    a, _ = replicas
    client = client_of(a)
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = client.responses.create(model="echo", input=items, tools=[tool], max_output_tokens=200)
    assert r.output_text == "<|user|>Weather?\n<|assistant|>\n<|tool|>sunny\n<|assistant|>"
    forced = client.responses.create(
        model="echo", input="Paris?", tools=[tool], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=6,
    )  # fmt: skip
    [call] = forced.output
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == "<|user"
    assert call.call_id.startswith("call_") and call.status == "completed"
    events = list(
        client.responses.create(
            model="echo",
            input="Paris?",
            tools=[tool],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=6,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "<|user"


def test_a_conversation_continues_through_another_replica_and_after_a_restart(settings, echo_workers, tmp_path):
    """Stored in Redis: the second turn, through a second `serve`, sees the first turn and its answer, but not the
    first turn's instructions (OpenAI's rule); the turns stay on one worker (one session); a third turn after the
    first `serve` restarted continues the chain."""
    echo_workers(2, "--echo-token-delay-s", "0.001")
    with serve(settings, tmp_path / "b.log", env=ENV) as b:
        with serve(settings, tmp_path / "a.log", env=ENV) as a:
            first = client_of(a).responses.with_raw_response.create(
                model="echo", input="My name is Ada.", instructions="Be brief.", max_output_tokens=8
            )
        second = client_of(b).responses.with_raw_response.create(
            model="echo", input="What is my name?", previous_response_id=first.parse().id, max_output_tokens=200
        )
        assert second.parse().output_text == (
            "<|user|>My name is Ada.\n<|assistant|><|system\n<|user|>What is my name?\n<|assistant|>"
        )
        assert first.headers["X-Worker-ID"] == second.headers["X-Worker-ID"]
        assert client_of(b).responses.retrieve(first.parse().id).output_text == "<|system"
        with serve(settings, tmp_path / "a2.log", env=ENV) as a:
            third = client_of(a).responses.create(
                model="echo", input="And now?", previous_response_id=second.parse().id, max_output_tokens=400
            )
    assert third.output_text.startswith("<|user|>My name is Ada.\n") and "<|user|>And now?\n" in third.output_text
    assert third.previous_response_id == second.parse().id


def test_a_conversation_whose_worker_died_continues_on_another(settings, echo_workers, workers, tmp_path):
    echo_workers(2, "--echo-token-delay-s", "0.001")
    with serve(settings, tmp_path / "a.log", env=ENV) as a:
        client = client_of(a)
        first = client.responses.with_raw_response.create(model="echo", input="Remember 42.", max_output_tokens=8)
        dead = first.headers["X-Worker-ID"]
        workers.procs[dead].kill()
        workers.procs[dead].wait()
        raw = client.responses.with_raw_response.create(
            model="echo", input="What number?", previous_response_id=first.parse().id, max_output_tokens=200
        )
    assert raw.headers["X-Worker-ID"] not in ("", dead)
    assert raw.parse().output_text.startswith("<|user|>Remember 42.\n<|assistant|><|user|>")


def test_a_cancel_through_another_replica_stops_the_generation(replicas):
    a, b = replicas
    client = client_of(a)
    events: list[object] = []
    stream = client.responses.create(model="echo", input="x" * 500, max_output_tokens=1000, stream=True)
    reader = threading.Thread(target=lambda: events.extend(stream))
    reader.start()
    created = wait_until(lambda: events and events[0], 30, "response.created")
    wait_until(lambda: any(e.type == "response.output_text.delta" for e in list(events)), 30, "a first token")
    cancelled = client_of(b).responses.cancel(created.response.id)
    assert cancelled.status == "cancelled"
    reader.join(timeout=30)
    assert not reader.is_alive()
    final = events[-1]
    assert final.type == "response.completed" and final.response.status == "cancelled"
    assert 0 < final.response.usage.output_tokens < 1000
    assert client_of(b).responses.retrieve(created.response.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client_of(b).responses.cancel(created.response.id)


def test_delete_and_store_false_and_what_is_refused_by_name(replicas):
    a, _ = replicas
    client = client_of(a)
    kept = client.responses.create(model="echo", input="keep", max_output_tokens=2)
    gone = client.responses.create(model="echo", input="drop", max_output_tokens=2, store=False)
    assert client.responses.retrieve(kept.id).id == kept.id
    with pytest.raises(openai.NotFoundError, match="not stored"):
        client.responses.retrieve(gone.id)
    deleted = httpx.delete(f"{a}/v1/responses/{kept.id}", headers={"Authorization": f"Bearer {KEY}"})
    assert deleted.json() == {"id": kept.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="echo", input="on", previous_response_id=kept.id, max_output_tokens=2)
    refused = {
        "tools.0": {"tools": [{"type": "web_search"}]},
        "background": {"background": True},
        "reasoning": {"reasoning": {"effort": "high"}},
        "input.0.content.0": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "truncation": {"truncation": "auto"},
        "include": {"include": ["file_search_call.results"]},
    }
    for name, body in refused.items():
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**{"model": "echo", "input": "hi", **body})
        error = caught.value.body
        assert error["type"] == "invalid_request_error" and name.split(".")[0] in error["message"], (name, error)
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{a}/v1", api_key="wrong", max_retries=0).responses.create(model="echo", input="hi")
