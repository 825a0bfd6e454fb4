"""SkyRL 0.4.0's own code, unmodified, run by the Python 3.12 venv (`.venv312`, made by `make install`) against a
fleet: `python -m tests.integration.skyrl04_calls client BASE ADAPTER_DIR` drives its `RemoteInferenceClient`
through `serve` at BASE; `... adapter REDIS_URL PREFIX ADAPTER_DIR` drives `RolloutServiceEngine` (SkyRL 0.4's
`InferenceEngineInterface`) over `RolloutClient` in process; `... generator BASE REDIS_URL PREFIX` runs its
`SkyRLGymGenerator` both ways. Each prints one JSON object of what it saw, for tests/integration/test_skyrl04.py to
check (this module asserts nothing itself: a failure is a call that raised, printed with its error).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

CLIENT = "skyrl.backends.skyrl_train.inference_servers.remote_inference_client"
PROMPT = list(b"The quick brown fox jumps over the lazy dog, twice over")
PARAMS = {"max_tokens": 24, "temperature": 1.0, "logprobs": 1, "stop": None, "min_tokens": 1}


async def _client(base: str, adapter_dir: str) -> dict[str, Any]:
    from rollout_svc.integrations.skyrl import skyrl_module

    client = skyrl_module(CLIENT).RemoteInferenceClient(
        proxy_url=base, server_urls=[base], data_parallel_size=1, model_name="echo"
    )
    seen: dict[str, Any] = {}
    try:
        batch = {"prompt_token_ids": [PROMPT, PROMPT[:10]], "sampling_params": PARAMS, "session_ids": ["s1", "s2"]}
        out = await client.generate(batch | {"cache_salt": "policy-3"})  # SkyRL 0.4's use_cache_salt default
        seen["generate"] = {k: out[k] for k in ("response_ids", "stop_reasons", "response_logprobs", "responses")}
        seen["world_size"] = list(await client.get_world_size())
        chat = {"json": {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}}
        seen["chat"] = (await client.chat_completion(chat))["choices"][0]["message"]["content"]
        text = {"json": {"model": "echo", "prompt": "hello", "max_tokens": 3}}
        seen["completion"] = (await client.completion(text))["choices"][0]["text"]
        seen["tokenize"] = await client.tokenize(["hi"])
        seen["detokenize"] = await client.detokenize([[104, 105]])
        await client.pause(mode="keep")
        seen["paused"] = (await client._call_all_servers("/is_paused", method="GET"))[base]["body"]["is_paused"]
        await client.resume()
        await client.reset_prefix_cache()
        await client.sleep(level=1)
        seen["sleeping"] = await client.is_sleeping()
        await client.wake_up()
        await client.load_lora_adapter("judge", adapter_dir)
        await client.load_lora_adapter("judge", adapter_dir)  # in place: a new version
        seen["adapter"] = await client.generate(
            {"prompt_token_ids": [PROMPT[:5]], "sampling_params": PARAMS}, model="judge"
        )
        seen["adapter"] = seen["adapter"]["response_ids"]
        await client.unload_lora_adapter("judge")
        await client.finish_session("s1")
        for name, call in {
            "fetch_delta": client.fetch_weights(2, sync_dir="/tmp/none"),
            "in_memory_lora": client.load_lora_adapter("judge", in_memory=True),
            "sleep_for_sync": client.sleep_for_weight_sync(),
        }.items():
            try:
                await call
                seen[name] = "served"
            except Exception as exc:  # aiohttp's error, with the server's message
                seen[name] = f"{type(exc).__name__}: {exc}"
    finally:
        await client.teardown()
    return seen


async def _adapter(redis_url: str, prefix: str, adapter_dir: str) -> dict[str, Any]:
    from rollout_svc import RolloutClient
    from rollout_svc.config import Settings
    from rollout_svc.integrations.skyrl import BASE, RolloutServiceEngine, skyrl_module

    settings = Settings(redis_url=redis_url, key_prefix=prefix)
    engine = RolloutServiceEngine(RolloutClient(settings), model_name="echo")
    seen: dict[str, Any] = {}
    try:
        seen["is_interface"] = isinstance(engine, skyrl_module(BASE).InferenceEngineInterface)
        out = await engine.generate({"prompt_token_ids": [PROMPT], "sampling_params": PARAMS, "cache_salt": "v1"})
        seen["generate"] = out["response_ids"]
        seen["world_size"] = list(await engine.get_world_size())
        seen["load"] = await engine.load_lora_adapter("judge", adapter_dir)
        seen["adapter"] = (
            await engine.generate({"prompt_token_ids": [PROMPT[:5]], "sampling_params": PARAMS}, "judge")
        )["response_ids"]
        await engine.pause_generation()
        await engine.resume_generation()
        await engine.finish_session("s1")
    finally:
        await engine.teardown()
    return seen


async def _generator(base: str, redis_url: str, prefix: str) -> dict[str, Any]:
    """SkyRL 0.4.0's `SkyRLGymGenerator.agent_loop` (skyrl-gym's `gsm8k_multi_turn`, 3 turns, with the sampling
    params its trainer builds and a cache salt, as its `use_cache_salt` default sends one) through `serve` and in
    process; the trajectories and the chat template's prompt ids."""
    from transformers import AutoTokenizer

    from rollout_svc import RolloutClient
    from rollout_svc.config import Settings
    from rollout_svc.integrations.skyrl import RolloutServiceEngine, skyrl_module
    from rollout_svc.model import prepare_model

    generators = skyrl_module("skyrl.train.generators.skyrl_gym_generator")
    config = skyrl_module("skyrl.train.config")
    engine_utils = skyrl_module("skyrl.backends.skyrl_train.inference_servers.engine_utils")
    tokenizer = AutoTokenizer.from_pretrained(prepare_model(Settings().cache_dir))
    sampling = config.SamplingParams(max_generate_length=20, temperature=0.0)
    generator_cfg = config.GeneratorConfig(max_turns=3, sampling_params=sampling)
    prompt = [{"role": "user", "content": "What is 123456 times 789? End with '#### ANSWER'."}]

    async def episode(engine: Any, instance: str) -> Any:
        generator = generators.SkyRLGymGenerator(generator_cfg, config.SkyRLGymConfig(), engine, tokenizer)
        return await generator.agent_loop(
            prompt,
            "gsm8k_multi_turn",
            {"reward_spec": {"ground_truth": "97406784"}},
            max_tokens=20,
            max_input_length=2048,
            sampling_params=engine_utils.get_vllm_sampling_params(sampling),
            trajectory_id=generators.TrajectoryID(instance_id=instance, repetition_id=0),
            cache_salt="policy-0",
        )

    client = skyrl_module(CLIENT).RemoteInferenceClient(
        proxy_url=base, server_urls=[base], data_parallel_size=1, model_name="echo"
    )
    try:
        over_http = await episode(client, "http")
    finally:
        await client.teardown()
    async with RolloutClient(Settings(redis_url=redis_url, key_prefix=prefix)) as rollout:
        in_process = await episode(RolloutServiceEngine(rollout, "echo", owns_client=False), "inproc")
        pinned = await rollout.session_worker("http_0")
    template = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    observations = [i for i, bit in zip(over_http.response_ids, over_http.loss_mask, strict=True) if bit == 0]
    return {
        "template": list(template),
        "http": {k: getattr(over_http, k) for k in ("prompt_ids", "response_ids", "loss_mask", "env_metrics")},
        "inproc": {k: getattr(in_process, k) for k in ("response_ids", "loss_mask")},
        "logprobs": len(over_http.rollout_logprobs),
        "observation": tokenizer.decode(observations),
        "pinned": pinned,
    }


def main() -> None:
    kind, *args = sys.argv[1:]
    calls = {"client": _client, "adapter": _adapter, "generator": _generator}
    seen = asyncio.run(calls[kind](*args))
    seen["python"] = list(sys.version_info[:2])
    seen["skyrl"] = __import__("importlib.metadata").metadata.version("skyrl")
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
