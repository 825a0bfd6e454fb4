"""The OpenAI-compatible API (`rollout-svc serve`, real uvicorn) driven by the official `openai` client, against a
real redis-server and real echo worker processes: shapes, streaming, n, sessions, errors, auth, disconnects.

The echo engine echoes its prompt (token ids are bytes), so every answer here is known exactly; what depends on a
real model (chat templates, tool calls, structured outputs, token-in/token-out equality) is in
tests/e2e/test_api_vllm.py."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from rollout_svc import SyncRolloutClient
from rollout_svc.config import Settings
from tests.support import ROOT, free_port, settings_env, wait_until
from tests.support import serve as support_serve

KEY, ADMIN = "data-key", "admin-token"
ECHO_DELAY = "0.01"  # seconds per echoed token: long generations stream for a while


def serve(
    settings: Settings, log: Path, *args: str, env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[str]:
    """`rollout-svc serve` with this module's data-plane key and admin token."""
    return support_serve(
        settings, log, *args, env={"ROLLOUT_API_KEYS": f'["{KEY}"]', "ROLLOUT_ADMIN_TOKEN": ADMIN, **(env or {})}
    )


@pytest.fixture
def api(settings: Settings, echo_workers, tmp_path: Path) -> Iterator[tuple[str, OpenAI]]:
    echo_workers(2, "--echo-token-delay-s", ECHO_DELAY)
    with serve(settings, tmp_path / "serve.log") as base:
        yield base, OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_chat_and_completions_in_openai_shapes(api):
    _, client = api
    [model] = client.models.list().data
    assert model.id == "echo" and model.model_extra["max_model_len"] == 2048  # vLLM's field: the workers' context
    chat = client.chat.completions.create(model="echo", messages=user("hello"), max_tokens=8, temperature=0)
    # The echo engine's chat template is "<|role|>content\n...<|assistant|>"; it echoes the first 8 bytes.
    assert chat.choices[0].message.content == "<|user|>" and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens == len("<|user|>hello\n<|assistant|>")
    batch = client.completions.create(model="echo", prompt=["abc", "defg", "hi"], max_tokens=3, temperature=0)
    assert [(c.index, c.text, c.finish_reason) for c in batch.choices] == [
        (0, "abc", "stop"),
        (1, "def", "length"),
        (2, "hi", "stop"),
    ]
    ids = client.completions.create(
        model="echo", prompt=[72, 105, 33], max_tokens=5, extra_body={"return_token_ids": True}, logprobs=1
    )
    choice = ids.choices[0]
    assert choice.text == "Hi!" and choice.token_ids == [72, 105, 33] and choice.prompt_token_ids == [72, 105, 33]
    assert choice.logprobs.tokens == ["H", "i", "!"] and choice.logprobs.token_logprobs == [0.0, 0.0, 0.0]
    chat = client.chat.completions.create(
        model="echo",
        messages=user("x"),
        max_tokens=3,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_token_ids": True},
    )
    assert [lp.token for lp in chat.choices[0].logprobs.content] == ["<", "|", "u"]
    assert (
        chat.choices[0].token_ids == [ord(c) for c in "<|u"] and chat.prompt_token_ids[:3] == chat.choices[0].token_ids
    )


def test_n_samples_are_separate_choices(api):
    _, client = api
    r = client.chat.completions.create(model="echo", messages=user("abc"), max_tokens=4, n=4, seed=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3] and r.usage.completion_tokens == 16
    batch = client.completions.create(model="echo", prompt=["ab", "cd"], max_tokens=2, n=2)
    assert [(c.index, c.text) for c in batch.choices] == [(0, "ab"), (1, "ab"), (2, "cd"), (3, "cd")]


def test_streaming_sends_chunks_while_generating(api):
    _, client = api
    text = "The quick brown fox jumps over the lazy dog. " * 4  # 180 tokens at 10 ms each: ~1.8 s
    started, arrivals, pieces, usage = time.monotonic(), [], [], None
    stream = client.completions.create(
        model="echo", prompt=text, max_tokens=500, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.monotonic() - started)
            pieces.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    total = time.monotonic() - started
    assert "".join(pieces) == text, "the stream's pieces join into the whole completion"
    assert len(pieces) >= 5 and arrivals[0] < total / 2, f"chunks at {arrivals} of {total:.2f} s"
    assert len(pieces) < len(text) / 2, "a chunk carries several tokens, not one entry per token"
    assert usage is not None and usage.completion_tokens == len(text)
    chat = client.chat.completions.create(model="echo", messages=user("streamed"), max_tokens=40, stream=True)
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "<|user|>streamed\n<|assistant|>"


@pytest.mark.heartbeat_ttl(10.0)  # a 2 s stall of this shared machine (CI saw one) re-incarnates a worker: `echo-1~1`
def test_a_session_sticks_to_one_worker_until_finished(api):
    base, client = api
    served = set()
    for turn in range(5):
        raw = client.chat.completions.with_raw_response.create(
            model="echo", messages=user(f"turn {turn}"), max_tokens=2, extra_headers={"X-Session-ID": "episode-1"}
        )
        served.add(raw.headers["X-Worker-ID"])
    assert len(served) == 1
    raw = client.completions.with_raw_response.create(
        model="echo", prompt="x", max_tokens=1, extra_body={"session_id": "episode-2"}
    )
    assert raw.headers["X-Worker-ID"] in ("echo-0", "echo-1")
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{base}/v1/sessions/episode-1/finish", headers=auth).json()["finished"] is True
    assert httpx.post(f"{base}/finish_session", params={"session_id": "episode-2"}, headers=auth).json()["finished"]
    assert httpx.post(f"{base}/v1/sessions/episode-1/finish", headers=auth).json()["finished"] is False


def test_chat_templating_fields_reach_the_template_and_unserved_ones_are_refused(api):
    """vLLM's `add_generation_prompt` and `continue_final_message` reach the worker's template (the echo engine's
    answer is its templated prompt); `logit_bias` is refused, never dropped; `cache_salt` (prime-rl's policy version)
    is accepted: a weight sync resets every prefix cache, so no salt is needed to keep versions apart."""
    _, client = api
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]

    def text(**extra: object) -> str | None:
        reply = client.chat.completions.create(model="echo", messages=turns, max_tokens=100, extra_body=extra)
        return reply.choices[0].message.content

    assert text() == "<|user|>hi\n<|assistant|>Hel\n<|assistant|>"
    assert text(add_generation_prompt=False) == "<|user|>hi\n<|assistant|>Hel\n"
    assert text(add_generation_prompt=False, continue_final_message=True) == "<|user|>hi\n<|assistant|>Hel"
    assert text(cache_salt="policy-3") == text()
    for extra, named in (
        ({"continue_final_message": True}, "add_generation_prompt"),
        ({"logit_bias": {"42": 5.0}}, "logit_bias"),
    ):
        with pytest.raises(openai.BadRequestError, match=named):
            text(**extra)


def test_errors_have_openai_shape_and_status(api):
    base, client = api
    cases = [
        ({"model": "gpt-4"}, openai.NotFoundError),
        ({"max_tokens": -1}, openai.BadRequestError),
        ({"temperature": 9}, openai.BadRequestError),
        ({"messages": []}, openai.BadRequestError),
        ({"tool_choice": "required"}, openai.BadRequestError),  # no tools
    ]
    for bad, error in cases:
        with pytest.raises(error) as caught:
            client.chat.completions.create(**{"model": "echo", "messages": user("hi"), "max_tokens": 4, **bad})
        body = caught.value.response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(body) and body["message"], body
    with pytest.raises(openai.BadRequestError, match="context"):  # longer than the echo engine's 2048 tokens
        client.completions.create(model="echo", prompt="x" * 3000, max_tokens=1)
    response = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200, "health needs no key"
    assert httpx.get(f"{base}/metrics").status_code == 200, "metrics need no key"


def test_admin_routes_need_the_admin_token(api, settings):
    base, _ = api
    route = f"{base}/admin/workers"
    codes = [httpx.get(route, headers=h).status_code for h in ({}, {"Authorization": f"Bearer {KEY}"})]
    assert codes == [401, 403]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    workers = httpx.get(route, headers=admin).json()["workers"]
    assert sorted(w["worker_id"] for w in workers) == ["echo-0", "echo-1"]
    assert (
        httpx.post(f"{base}/admin/pause", json={"mode": "keep"}, headers={"Authorization": f"Bearer {KEY}"}).status_code
        == 403
    )
    assert httpx.post(f"{base}/admin/pause", json={"mode": "abort"}, headers=admin).json()["paused"] is True
    state = httpx.get(f"{base}/admin/state", headers=admin).json()
    assert state["paused"] and state["pause_mode"] == "abort"
    assert httpx.post(f"{base}/admin/resume", headers=admin).json()["paused"] is False
    assert httpx.get(f"{base}/admin/weight_version", headers=admin).json()["weight_version"] == 0
    assert httpx.post(f"{base}/admin/reset_prefix_cache", headers=admin).status_code == 200
    assert httpx.post(f"{base}/admin/abort", json={}, headers=admin).status_code == 400


def test_queue_full_is_429_and_a_deadline_504(settings, echo_workers, tmp_path):
    echo_workers(1)
    env = {"ROLLOUT_MAX_QUEUED_REQUESTS": "1", "ROLLOUT_REQUEST_TIMEOUT_S": "1"}
    with serve(settings, tmp_path / "serve.log", env=env) as base, SyncRolloutClient(settings) as rollout:
        client = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)
        rollout.pause(mode="keep")
        try:  # paused: requests wait in the queue, the first one fills it, its deadline passes
            with pytest.raises(openai.APIStatusError) as late:
                client.completions.create(model="echo", prompt="a", max_tokens=1)
            assert late.value.status_code == 504
            with pytest.raises(openai.RateLimitError) as full:
                client.completions.create(model="echo", prompt=["a", "b"], max_tokens=1)
            assert full.value.response.headers["Retry-After"] == "1"
        finally:
            rollout.resume()


def test_a_request_without_a_live_worker_waits_in_the_queue_for_one(settings, tmp_path, echo_workers):
    """No live worker is a moment, not an error: the request waits (within its deadline) and /health says so."""
    with serve(settings, tmp_path / "serve.log", "--served-model-name", "my-model") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["my-model"]
        assert httpx.get(f"{base}/health").status_code == 503
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.completions.create, model="my-model", prompt="a", max_tokens=1)
            time.sleep(1.0)
            assert not waiting.done()
            echo_workers(1)
            assert waiting.result(timeout=30).choices[0].finish_reason in ("stop", "length")
        assert httpx.get(f"{base}/health").status_code == 200


def test_models_stay_listed_while_no_worker_is_live_and_none_known_is_503(settings, tmp_path, echo_workers, workers):
    """What agents do first (`client.models.list().data[0].id`) keeps working while the fleet restarts; only a server
    that never saw a worker, and has no name configured, knows no model (503, saying how to fix it)."""
    with serve(settings, tmp_path / "serve.log") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model="echo", prompt="a", max_tokens=1)
        assert caught.value.status_code == 503 and "knows no model" in caught.value.message
        assert client.models.list().data == []
        echo_workers(1)
        wait_until(lambda: [m.id for m in client.models.list().data] == ["echo"], 10, "the worker's model listed")
        workers.stop_all()
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 503, 10, "no live worker")
        assert [m.id for m in client.models.list().data] == ["echo"]


def test_a_client_that_goes_away_aborts_its_generation(api, settings):
    _, client = api
    with SyncRolloutClient(settings) as rollout:
        stream = client.chat.completions.create(model="echo", messages=user("x" * 1500), max_tokens=1500, stream=True)
        for _ in zip(range(3), stream, strict=False):
            pass
        # The heartbeat (every 0.2 s here) may not have reported it yet when the first chunks are in.
        wait_until(lambda: sum(w.in_flight for w in rollout.workers()) == 1, 5, "the stream's generation in flight")
        stream.close()
        wait_until(lambda: sum(w.in_flight for w in rollout.workers()) == 0, 5, "the stream's generation aborted")
        short = OpenAI(base_url=client.base_url, api_key=KEY, max_retries=0, timeout=1.0)
        with pytest.raises(openai.APITimeoutError):  # a non-streaming request whose client gives up
            short.completions.create(model="echo", prompt="y" * 1500, max_tokens=1500)
        wait_until(lambda: sum(w.in_flight for w in rollout.workers()) == 0, 5, "the request's generation aborted")


def test_serve_refuses_to_listen_beyond_loopback_without_a_key(settings):
    env = {k: v for k, v in settings_env(settings).items() if k != "ROLLOUT_API_KEYS"}
    command = [sys.executable, "-m", "rollout_svc", "serve", "--host", "0.0.0.0", "--port", str(free_port())]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=20)
    assert done.returncode == 2 and "ROLLOUT_API_KEYS" in done.stderr
