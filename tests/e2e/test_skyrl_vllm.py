"""SkyRL's own `RemoteInferenceClient` (skyrl 0.3.0, unmodified) through `rollout-svc serve` to real vLLM workers on
the real model (float32): its `generate` equals `RolloutClient.generate` token for token, logprobs within 1e-4; a
token-in/token-out multi-turn episode as SkyRL's generators run one (render the conversation, generate from its
token ids, append, render the next turn) on the real chat template, one session on one worker; and vLLM's chat
templating fields on that template.

Not here (not built yet): a SkyRL generator class itself (`SkyRLGymGenerator` needs skyrl-gym, omegaconf and torch
pins beyond the client's), and `fetch_weights`. One module fixture: two workers (one CPU core each), one `serve`.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rollout_svc import RolloutClient
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.integrations.skyrl import skyrl_module
from rollout_svc.model import prepare_model
from tests.integration.test_skyrl_client import CLIENT
from tests.support import serve, vllm_workers

pytestmark = pytest.mark.vllm
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, str, str]]:
    model_dir = prepare_model(Settings().cache_dir)
    settings = Settings(
        redis_url=redis_url, key_prefix=f"skyrl-{uuid.uuid4().hex[:6]}", heartbeat_interval_s=0.5, heartbeat_ttl_s=10
    )
    engine = EngineSettings(model=str(model_dir), dtype="float32", max_num_seqs=16, kv_cache_memory_bytes=256 * MiB)
    logs = tmp_path_factory.mktemp("skyrl-vllm")
    with vllm_workers(settings, engine, logs), serve(settings, logs / "serve.log", "--open-control") as base:
        yield settings, base, model_dir.name


def skyrl(base: str, model: str) -> Any:
    return skyrl_module(CLIENT).RemoteInferenceClient(
        proxy_url=base, server_urls=[base], data_parallel_size=1, model_name=model
    )


async def _with(client: Any, coro: Any) -> Any:
    try:
        return await coro
    finally:
        await client.teardown()


def test_skyrls_generate_equals_rollout_client_token_for_token(fleet):
    settings, base, model = fleet
    params = {"temperature": 0.0, "max_tokens": 16, "logprobs": 0, "stop": None, "top_k": -1}

    async def main() -> tuple[dict[str, Any], list[Any]]:
        async with RolloutClient(settings) as rollout:
            prompts = await rollout.tokenize(["The capital of France is", "Water boils at", "Once upon a time"])
            want = await rollout.generate(prompts, {"temperature": 0.0, "max_tokens": 16, "logprobs": 0})
        client = skyrl(base, model)
        got = await _with(client, client.generate({"prompt_token_ids": prompts, "sampling_params": params}))
        return got, want

    got, want = asyncio.run(main())
    assert got["response_ids"] == [t.completion_token_ids for t in want]
    for mine, theirs in zip(got["response_logprobs"], [t.logprobs for t in want], strict=True):
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(mine, theirs, strict=True))
    assert got["responses"] == [t.text for t in want]


def test_a_token_in_token_out_episode_keeps_one_session_on_one_worker(fleet):
    settings, base, model = fleet
    session = f"episode-{uuid.uuid4().hex[:6]}"
    questions = ["Name a fruit.", "What color is it?", "Name another one."]

    async def main() -> list[str]:
        client = skyrl(base, model)
        try:
            conversation: list[dict[str, str]] = []
            answers = []
            for question in questions:
                conversation.append({"role": "user", "content": question})
                rendered = await client.render_chat_completion(
                    {"json": {"model": model, "messages": conversation, "max_tokens": 12, "temperature": 0}}
                )
                out = await client.generate(
                    {
                        "prompt_token_ids": [rendered["token_ids"]],
                        "sampling_params": {**rendered["sampling_params"], "stop": None},
                        "session_ids": [session],
                    }
                )
                answers.append(out["responses"][0])
                conversation.append({"role": "assistant", "content": out["responses"][0]})
            await client.finish_session(session)
            return answers
        finally:
            await client.teardown()

    async def pinned() -> str | None:
        async with RolloutClient(settings) as rollout:
            return await rollout.session_worker(session)

    answers = asyncio.run(main())
    assert len(answers) == 3 and all(a.strip() for a in answers), answers
    assert asyncio.run(pinned()) is None, "finish_session released the session"


def test_chat_templating_fields_on_the_real_template(fleet):
    _, base, model = fleet
    turns = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello"}]

    def render(**extra: object) -> list[int]:
        body = {"model": model, "messages": turns, "max_tokens": 4, **extra}
        response = httpx.post(f"{base}/v1/chat/completions/render", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["token_ids"]

    opened = render()  # the assistant's turn closed, a new one opened
    closed = render(add_generation_prompt=False)
    continued = render(add_generation_prompt=False, continue_final_message=True)
    assert len(continued) < len(closed) < len(opened)  # each leaves out more of the template's tail
    assert opened[: len(continued)] == continued, "continuing leaves the final message open, as it was written"
