"""SkyRL's own `RemoteInferenceClient` (skyrl 0.3.0, unmodified) against `rollout-svc serve` as both its router and
its one server (`proxy_url` and `server_urls=[it]`), over 2 echo workers and a real redis-server.

The echo engine echoes its prompt (token ids are bytes), so every answer is known exactly. What depends on a real
model (token equality with `RolloutClient`, a generator's episode) is in tests/e2e/test_skyrl_vllm.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from rollout_svc import RolloutClient
from rollout_svc.config import Settings
from rollout_svc.integrations.skyrl import skyrl_module
from tests.support import async_wait_until, free_port, serve, settings_env

ADMIN = "admin-token"
CLIENT = "skyrl.backends.skyrl_train.inference_servers.remote_inference_client"
PROMPT = list(b"The quick brown fox jumps over the lazy dog, twice over")  # 55 tokens: echoes are cut at max_tokens
# SkyRL's own defaults (`skyrl.train.config.SamplingParams` through `get_vllm_sampling_params`), `stop` None.
SKYRL_PARAMS = {
    "min_tokens": 1,
    "skip_special_tokens": True,
    "include_stop_str_in_output": True,
    "max_tokens": 24,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "logprobs": 1,
    "stop": None,
}
TOKEN_DELAY_S = 0.01  # the echo workers' pace (`--echo-token-delay-s`)
# A pause held with 100 requests of HELD_TOKENS in flight lasts HELD_S from its acknowledgment: longer than a whole
# request takes unpaused (2 s), so a pause that did not hold lets every one of them finish inside it.
HELD_TOKENS = 200
HELD_S = HELD_TOKENS * TOKEN_DELAY_S + 0.5


@pytest.fixture
def fleet(settings: Settings, echo_workers, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """2 echo workers (10 ms a token), `serve --open-control`, and SkyRL's client on it."""
    echo_workers(2, "--echo-token-delay-s", str(TOKEN_DELAY_S))
    with serve(settings, tmp_path / "serve.log", "--open-control", env={"ROLLOUT_ADMIN_TOKEN": ADMIN}) as base:
        client = skyrl_module(CLIENT).RemoteInferenceClient(
            proxy_url=base, server_urls=[base], data_parallel_size=1, model_name="echo"
        )
        yield base, client


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _teardown(client: Any, coro: Any) -> Any:
    try:
        return await coro
    finally:
        await client.teardown()


def call(client: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """One call of SkyRL's client on a fresh event loop (its session is made per loop, closed after)."""
    return run(_teardown(client, getattr(client, method)(*args, **kwargs)))


def token_requests_sent(rds: Any, settings: Settings) -> int:
    """Tokenize / detokenize requests ever sent to the workers (the token requests stream's `entries-added`)."""
    try:
        return int(rds.xinfo_stream(settings.keys.token_requests)["entries-added"])
    except redis.ResponseError:  # no such stream yet
        return 0


def test_every_call_skyrl_makes_gets_a_vllm_shaped_answer(fleet, settings, rds):
    base, client = fleet
    sent = token_requests_sent(rds, settings)
    out = call(client, "generate", {"prompt_token_ids": [PROMPT, PROMPT[:10]], "sampling_params": SKYRL_PARAMS})
    assert out["response_ids"] == [PROMPT[:24], PROMPT[:10]]
    assert out["stop_reasons"] == ["length", "stop"]
    assert out["responses"] == [bytes(PROMPT[:24]).decode(), bytes(PROMPT[:10]).decode()]  # through /detokenize
    assert token_requests_sent(rds, settings) == sent  # ... which serve answered: the workers decoded them already
    assert out["response_logprobs"] == [[0.0] * 24, [0.0] * 10]

    sampled = call(
        client,
        "sample",
        {"json": {"prompt": {"chunks": [{"tokens": PROMPT}]}, "num_samples": 3, "sampling_params": {"max_tokens": 5}}},
    )
    assert [s["tokens"] for s in sampled["sequences"]] == [PROMPT[:5]] * 3
    assert all(s["logprobs"] == [0.0] * 5 and s["stop_reason"] == "length" for s in sampled["sequences"])
    assert sampled["prompt_logprobs"] is None  # not asked for
    # SkyRL's prompt logprobs (Tinker's): vLLM's top-level prompt_logprobs, read by SkyRL's own parsing. The echo is
    # certain of each prompt token: logprob 0 at every position but the first, which has nothing before it.
    asked = {"prompt": {"chunks": [{"tokens": PROMPT[:6]}]}, "num_samples": 2, "sampling_params": {"max_tokens": 3}}
    scored = call(client, "sample", {"json": {**asked, "include_prompt_logprobs": True, "topk_prompt_logprobs": 2}})
    assert scored["prompt_logprobs"] == [None] + [0.0] * 5
    assert scored["topk_prompt_logprobs"] == [None] + [[(t, 0.0)] for t in PROMPT[1:6]]
    assert [s["tokens"] for s in scored["sequences"]] == [PROMPT[:3]] * 2

    chat = call(
        client,
        "chat_completion",
        {"json": {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}},
    )
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    completion = call(client, "completion", {"json": {"model": "echo", "prompt": "hello", "max_tokens": 3}})
    assert completion["choices"][0]["text"] == "hel"
    rendered = call(
        client,
        "render_chat_completion",
        {"json": {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "seed": 3}},
    )
    assert rendered["token_ids"] == list(b"<|user|>hi\n<|assistant|>")  # the echo engine's chat template
    assert rendered["sampling_params"]["max_tokens"] == 7 and rendered["sampling_params"]["seed"] == 3
    assert rendered["model"] == "echo" and rendered["features"] is None
    assert call(client, "tokenize", ["hi"]) == [list(b"hi")]
    assert call(client, "detokenize", [list(b"ok")]) == ["ok"]
    call(client, "finish_session", "episode-1")  # best effort: SkyRL logs a failure instead of raising

    assert call(client, "get_world_size") == (2, 2)  # every engine's ranks: one each for an echo engine
    info = httpx.get(f"{base}/get_server_info").json()
    assert info["world_size"] == 2 and len(info["engines"]) == 2 and info["model"] == "echo"
    assert {e["max_model_len"] for e in info["engines"]} == {2048}  # what each engine holds, as on its heartbeat
    assert all(e["kv_cache_tokens"] == e["max_num_seqs"] * 2048 for e in info["engines"])
    assert httpx.get(f"{base}/servers").json() == {"servers": [base]}

    assert call(client, "pause", mode="keep") == {base: {"status": 200, "body": {"status": "paused"}}}
    held = httpx.get(f"{base}/is_paused").json()  # vLLM's field, then who holds the pause and until when (ours)
    assert held["is_paused"] is True and list(held["holders"]) == ["http:127.0.0.1"]  # SkyRL sends no holder
    assert held["holders"]["http:127.0.0.1"]["lease_until"] > time.time() + 500  # serve's 600 s lease
    assert call(client, "resume")[base]["body"] == {"status": "resumed"}
    assert httpx.get(f"{base}/is_paused").json() == {"is_paused": False, "holders": {}, "lapsed": {}}

    async def workers() -> list[Any]:
        async with RolloutClient(settings) as rollout:
            return await rollout.workers()

    assert call(client, "sleep", level=1)[base]["body"] == {"status": "sleeping", "level": 1}
    assert {(w.state, w.sleep_level) for w in run(workers())} == {("sleeping", 1)}  # every worker acknowledged
    assert httpx.get(f"{base}/is_sleeping").json() == {"is_sleeping": True}
    assert call(client, "wake_up")[base]["body"]["status"] == "awake"
    assert {(w.state, w.sleep_level) for w in run(workers())} == {("serving", 0)}
    epoch = max(w.applied_epoch for w in run(workers()))
    assert call(client, "reset_prefix_cache")[base]["body"] == {"success": True}
    assert all(w.applied_epoch > epoch for w in run(workers())), "a worker did not apply the cache reset"


@pytest.mark.skyrl03  # counts the calls on 0.3.0's `_post`, which 0.4.0's generate no longer makes
def test_a_batch_of_generates_keeps_each_session_on_one_worker(fleet):
    _, client = fleet
    sessions = [f"episode-{i % 8}" for i in range(64)]
    served_by: dict[str, set[str]] = {}

    async def main() -> None:
        post = client._post

        async def spy(url: str, json: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
            body = await post(url, json=json, headers=headers)  # SkyRL's own call; only its answer is looked at
            if headers and "X-Session-ID" in headers:
                served_by.setdefault(headers["X-Session-ID"], set()).add(body["choices"][0]["worker_id"])
            return body

        client._post = spy
        out = await _teardown(
            client,
            client.generate(
                {"prompt_token_ids": [PROMPT] * 64, "sampling_params": SKYRL_PARAMS, "session_ids": sessions}
            ),
        )
        assert out["response_ids"] == [PROMPT[:24]] * 64

    run(main())
    assert set(served_by) == set(sessions) and all(len(workers) == 1 for workers in served_by.values()), served_by
    assert len(set().union(*served_by.values())) == 2, "all 8 sessions landed on one worker"


@pytest.mark.skyrl03  # as above
@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_pause_with_100_generates_in_flight_holds_them_until_the_resume(fleet, settings, mode):
    """SkyRL's `pause` with 100 generates in flight: no answer arrives between the pause's acknowledgment and the
    resume, though the pause is held longer than a request takes unpaused; each arrives after the resume, whole."""
    base, client = fleet
    params = {**SKYRL_PARAMS, "max_tokens": HELD_TOKENS}  # 2 s each at 10 ms a token: all 100 are in flight at once
    prompt = PROMPT * 4
    arrived: list[float] = []  # when each generate's answer came back (monotonic s)

    async def main() -> tuple[dict[str, Any], float, float]:
        post = client._post

        async def timed(url: str, json: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
            body = await post(url, json=json, headers=headers)  # SkyRL's own call, timed as its answer arrives
            if url.endswith("/generate"):
                arrived.append(time.monotonic())
            return body

        client._post = timed
        async with RolloutClient(settings) as rollout:
            batch = asyncio.ensure_future(
                client.generate({"prompt_token_ids": [prompt] * 100, "sampling_params": params})
            )
            await async_wait_until(lambda: _in_flight(rollout), 20, "100 generates in flight on the workers")
            paused = await client.pause(mode=mode)
            paused_at = time.monotonic()
            assert paused[base]["body"] == {"status": "paused"}
            assert set((await rollout.is_paused(per_worker=True)).values()) == {True}  # acknowledged by every worker
            await hold_pause(paused_at)
            resumed_at = time.monotonic()
            await client.resume()
            return await _teardown(client, batch), paused_at, resumed_at

    out, paused_at, resumed_at = run(main())
    assert_held(arrived, paused_at, resumed_at, 100)
    assert out["response_ids"] == [prompt[:HELD_TOKENS]] * 100  # whole: a kept one resumed, an aborted one retried
    assert out["stop_reasons"] == ["length"] * 100


async def hold_pause(paused_at: float) -> None:
    """Keep the fleet paused until `HELD_S` after `paused_at` (monotonic s, when the pause was acknowledged)."""
    await asyncio.sleep(max(0.0, paused_at + HELD_S - time.monotonic()))


def assert_held(arrived: list[float], paused_at: float, resumed_at: float, count: int) -> None:
    """The pause held: of `count` requests, none answered (`arrived`, monotonic s) between the pause's acknowledgment
    (`paused_at`) and the resume's issue (`resumed_at`), a window longer than a request takes unpaused; each came
    after the resume but those answered before the pause landed (a few at most, on a machine that stalled)."""
    assert len(arrived) == count and resumed_at - paused_at >= HELD_S
    during = sorted(round(t - paused_at, 3) for t in arrived if paused_at <= t < resumed_at)
    assert not during, f"{len(during)} of {count} answered while paused, at {during[:10]} s into the pause"
    after = sum(t >= resumed_at for t in arrived)
    assert after >= 0.9 * count, f"only {after} of {count} were in flight when the pause landed"


async def _in_flight(rollout: RolloutClient) -> bool:
    return sum(w.in_flight for w in await rollout.workers()) >= 100


def test_sampling_params_are_lenient_where_vllm_is_and_refuse_what_is_not_served(fleet):
    base, _ = fleet
    url = f"{base}/inference/v1/generate"
    ok = httpx.post(url, json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "stop": None, "seed": None}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == PROMPT[:4]
    three = httpx.post(url, json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "n": 3, "seed": 7}})
    assert [c["index"] for c in three.json()["choices"]] == [0, 1, 2]
    at_default = {"max_tokens": 2, "logit_bias": None, "prompt_logprobs": None, "output_kind": 2, "detokenize": True}
    assert httpx.post(url, json={"token_ids": PROMPT, "sampling_params": at_default}).status_code == 200
    for params, named in (
        ({"logit_bias": {"5": 1.0}}, "sampling_params.logit_bias"),
        ({"bad_words": ["x"]}, "sampling_params.bad_words"),
        ({"no_such_field": 1}, "sampling_params.no_such_field"),
        ({"max_tokens": 0}, "sampling_params.max_tokens"),
        ({"prompt_logprobs": 21}, "sampling_params.prompt_logprobs"),
        ({"seed": 2**64}, "sampling_params"),
    ):
        refused = httpx.post(url, json={"token_ids": PROMPT, "sampling_params": params})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == named, refused.text
    for body, named in (({"stream": True}, "stream"), ({"features": {"mm_hashes": {}}}, "features")):
        refused = httpx.post(url, json={"token_ids": PROMPT, **body})
        assert refused.status_code == 400 and named in refused.text, refused.text


def test_control_routes_need_the_admin_token_unless_opened_on_loopback(settings, echo_workers, tmp_path):
    echo_workers(1)
    with serve(settings, tmp_path / "serve.log", env={"ROLLOUT_ADMIN_TOKEN": ADMIN}) as base:
        assert httpx.post(f"{base}/pause", params={"mode": "keep"}).status_code == 401
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert httpx.post(f"{base}/pause", params={"mode": "keep"}, headers=admin).json() == {"status": "paused"}
        assert httpx.post(f"{base}/resume", headers=admin).json() == {"status": "resumed"}
        assert httpx.get(f"{base}/get_world_size").json() == {"world_size": 1}  # a data route: open without keys
    command = [sys.executable, "-m", "rollout_svc", "serve", "--host", "0.0.0.0", "--open-control"]
    env = {**settings_env(settings), "ROLLOUT_API_KEYS": '["k"]'}
    done = subprocess.run([*command, "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--open-control" in done.stderr and "loopback" in done.stderr, done.stderr


def test_skyrls_lora_calls_load_and_unload_an_adapter_fleet_wide(settings, workers, tmp_path):
    """SkyRL's `load_lora_adapter` (its `/skyrl/v1/load_lora_adapter`), `generate(model=<adapter>)` and
    `unload_lora_adapter` (vLLM's `/v1/unload_lora_adapter`), its own client against `serve` (docs/lora.md)."""
    root = tmp_path / "adapters"
    (root / "judge").mkdir(parents=True)
    (root / "judge" / "adapter_config.json").write_text("{}")
    workers.start_ready(["echo-0", "echo-1"], "--engine", "echo", env={"ROLLOUT_CHECKPOINT_ROOT": str(root)})
    with serve(settings, tmp_path / "serve.log", "--open-control", env={"ROLLOUT_ADMIN_TOKEN": ADMIN}) as base:
        client = skyrl_module(CLIENT).RemoteInferenceClient(
            proxy_url=base, server_urls=[base], data_parallel_size=1, model_name="echo"
        )
        loaded = call(client, "load_lora_adapter", "judge", str(root / "judge"))
        assert [answer["status"] for answer in loaded.values()] == [200]

        async def held() -> list[dict[str, int]]:
            async with RolloutClient(settings) as ours:
                return [w.adapter_versions for w in await ours.workers()]

        assert run(held()) == [{"judge": 1}, {"judge": 1}]  # every worker, before the call returned
        batch = {"prompt_token_ids": [PROMPT], "sampling_params": SKYRL_PARAMS}
        assert call(client, "generate", batch, model="judge")["response_ids"] == [PROMPT[:24]]
        call(client, "unload_lora_adapter", "judge")
        assert run(held()) == [{}, {}]
        with pytest.raises(Exception, match="judge"):  # SkyRL's raise_for_status on our 404
            call(client, "generate", batch, model="judge")
