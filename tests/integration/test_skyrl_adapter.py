"""`rollout_svc.integrations.skyrl.RolloutServiceEngine`: SkyRL's own `InferenceEngineInterface` (skyrl 0.3.0)
implemented over `RolloutClient`, in process (no HTTP), on 2 echo workers and a real redis-server; the checks of
tests/integration/test_skyrl_client.py, without the hop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rollout_svc import RolloutClient
from rollout_svc.config import Settings
from rollout_svc.errors import InvalidRequestError, WeightSyncError
from rollout_svc.integrations.skyrl import BASE, skyrl_module
from tests.integration.test_skyrl_client import (
    HELD_TOKENS,
    PROMPT,
    SKYRL_PARAMS,
    TOKEN_DELAY_S,
    assert_held,
    hold_pause,
)
from tests.support import async_wait_until, fresh_python


@pytest.fixture
async def engine(settings: Settings, echo_workers) -> AsyncIterator[Any]:
    from rollout_svc.integrations.skyrl import RolloutServiceEngine

    echo_workers(2, "--echo-token-delay-s", str(TOKEN_DELAY_S))
    engine = RolloutServiceEngine(RolloutClient(settings), model_name="echo")
    yield engine
    await engine.teardown()


def test_the_adapter_imports_without_skyrl_and_says_how_to_install_it():
    code = (
        "import sys; sys.modules['skyrl'] = None\n"
        "import rollout_svc.integrations.skyrl as adapter\n"
        "try:\n    adapter.RolloutServiceEngine\nexcept ImportError as exc:\n    print(exc)"
    )
    said = fresh_python(code)
    assert "SkyRL is not installed: pip install" in said, said


async def test_it_is_skyrls_interface_and_serves_every_call_in_process(engine, settings):
    assert isinstance(engine, skyrl_module(BASE).InferenceEngineInterface)  # instantiated: nothing left abstract
    out = await engine.generate({"prompt_token_ids": [PROMPT, PROMPT[:10]], "sampling_params": SKYRL_PARAMS})
    assert out["response_ids"] == [PROMPT[:24], PROMPT[:10]] and out["stop_reasons"] == ["length", "stop"]
    assert out["responses"] == [bytes(PROMPT[:24]).decode(), bytes(PROMPT[:10]).decode()]
    assert out["response_logprobs"] == [[0.0] * 24, [0.0] * 10]
    chat = await engine.generate({"prompts": [[{"role": "user", "content": "hi"}]], "sampling_params": None})
    assert chat["responses"] == ["<|user|>hi\n<|assistant|>"[:16]]  # the echo's templated prompt, 16 tokens
    with pytest.raises(ValueError, match="n > 1"):
        await engine.generate({"prompt_token_ids": [PROMPT], "sampling_params": {"n": 2}})
    with pytest.raises(ValueError, match="logit_bias"):
        await engine.generate({"prompt_token_ids": [PROMPT], "sampling_params": {"logit_bias": {"1": 1.0}}})
    salted = {"prompt_token_ids": [PROMPT], "sampling_params": SKYRL_PARAMS, "cache_salt": "step-3"}  # use_cache_salt
    assert (await engine.generate(salted))["response_ids"] == [PROMPT[:24]]
    with pytest.raises(ValueError, match="mm_features"):
        await engine.generate({"prompt_token_ids": [PROMPT], "sampling_params": SKYRL_PARAMS, "mm_features": [{}]})
    named = await engine.generate({"prompt_token_ids": [PROMPT], "sampling_params": SKYRL_PARAMS}, model="echo")
    assert named["response_ids"] == [PROMPT[:24]]
    with pytest.raises(ValueError, match="the model `judge` does not exist"):  # neither the model nor an adapter
        await engine.generate({"prompt_token_ids": [PROMPT], "sampling_params": SKYRL_PARAMS}, model="judge")

    reply = await engine.chat_completion({"json": {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}})
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"].startswith("<|user|>")
    text = await engine.completion({"json": {"model": "echo", "prompt": "hello", "max_tokens": 3}})
    assert text["choices"][0]["text"] == "hel"
    wrong = await engine.completion({"json": {"model": "other", "prompt": "x"}})
    assert wrong["error"]["code"] == "model_not_found"
    rendered = await engine.render_chat_completion(
        {"json": {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}}
    )
    assert rendered["token_ids"] == list(b"<|user|>hi\n<|assistant|>")
    await engine.finish_session("episode-1")
    assert await engine.get_world_size() == (2, 2)
    engine.increment_weight_version()  # what SkyRL's trainers call after a sync (FullyAsyncTrainerSim among them)
    assert engine.weight_version == 1

    async with RolloutClient(settings) as rollout:
        await engine.sleep(level=1)
        assert {(w.state, w.sleep_level) for w in await rollout.workers()} == {("sleeping", 1)}
        await engine.wake_up()
        assert {(w.state, w.sleep_level) for w in await rollout.workers()} == {("serving", 0)}
        epoch = max(w.applied_epoch for w in await rollout.workers())
        await engine.reset_prefix_cache()
        assert all(w.applied_epoch > epoch for w in await rollout.workers())
    # vLLM's native weight transfer: both echo workers are asked and refuse by name (they have no vLLM engine)
    info = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}
    with pytest.raises(WeightSyncError, match=r"echo-0.*no vLLM weight transfer engine.*echo-1"):
        await engine.init_weight_update_communicator(info)
    with pytest.raises(InvalidRequestError, match="before init_weight_transfer_engine"):
        await engine.start_weight_update()
    with pytest.raises(TypeError, match="pickled"):
        await engine.update_named_weights(None)


async def test_sessions_stay_on_one_worker(engine, settings):
    sessions = [f"episode-{i % 8}" for i in range(64)]
    out = await engine.generate(
        {"prompt_token_ids": [PROMPT] * 64, "sampling_params": SKYRL_PARAMS, "session_ids": sessions}
    )
    assert out["response_ids"] == [PROMPT[:24]] * 64
    async with RolloutClient(settings) as rollout:
        pinned = {s: await rollout.session_worker(s) for s in set(sessions)}
    assert None not in pinned.values() and len(set(pinned.values())) == 2, pinned


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_a_pause_with_100_generates_in_flight_holds_them_until_the_resume(engine, settings, mode):
    """100 generates in flight, one prompt each (as SkyRL's generators call): no answer arrives between the pause's
    acknowledgment and the resume, though the pause is held longer than a request takes unpaused; each arrives after
    the resume, whole."""
    prompt, params = PROMPT * 4, {**SKYRL_PARAMS, "max_tokens": HELD_TOKENS}
    arrived: list[float] = []  # when each generate returned (monotonic s)

    async def generate() -> dict[str, Any]:
        out = await engine.generate({"prompt_token_ids": [prompt], "sampling_params": params})
        arrived.append(time.monotonic())
        return out

    async with RolloutClient(settings) as rollout:
        batch = asyncio.gather(*(generate() for _ in range(100)))

        async def in_flight() -> bool:
            return sum(w.in_flight for w in await rollout.workers()) >= 100

        await async_wait_until(in_flight, 20, "100 generates in flight on the workers")
        await engine.pause(mode)
        paused_at = time.monotonic()
        assert set((await rollout.is_paused(per_worker=True)).values()) == {True}
        await hold_pause(paused_at)
        resumed_at = time.monotonic()
        await engine.resume_generation()
        outs = await batch
    assert_held(arrived, paused_at, resumed_at, 100)
    assert [out["response_ids"] for out in outs] == [[prompt[:HELD_TOKENS]]] * 100
    assert [out["stop_reasons"] for out in outs] == [["length"]] * 100
