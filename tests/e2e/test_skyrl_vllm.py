"""SkyRL's own `RemoteInferenceClient` (skyrl 0.3.0, unmodified) through `rollout-svc serve` to real vLLM workers on
the real model (float32): its `generate` equals `RolloutClient.generate` token for token, logprobs within 1e-4; its
`sample` scores a prompt (prompt logprobs) with the logprobs the model sampled it with; a
token-in/token-out multi-turn episode as SkyRL's generators run one (render the conversation, generate from its
token ids, append, render the next turn) on the real chat template, one session on one worker; and vLLM's chat
templating fields on that template; `/fetch_weights` from a checkpoint changes SkyRL's greedy output on every worker
and the original checkpoint restores it; and SkyRL's own generator class, `SkyRLGymGenerator` (unmodified, with
skyrl-gym's `gsm8k_multi_turn` env), runs a multi-turn episode through `serve` and through the in-process adapter;
and SkyRL's `FullyAsyncTrainerSim` trains 4 simulated steps on `serve` (examples/skyrl_trainer_sim.py).
The session's two workers (one CPU core each; tests/e2e/conftest.py) behind this module's `serve`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file, save_file

from rollout_svc import RolloutClient
from rollout_svc.config import Settings
from rollout_svc.integrations.skyrl import skyrl_module
from rollout_svc.model import prepare_model
from tests.e2e.conftest import TWO_FLOAT32, Fleet, perturb_weights
from tests.integration.test_metrics import parse
from tests.integration.test_skyrl_client import CLIENT
from tests.support import serve

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_fleet(TWO_FLOAT32)]


@pytest.fixture(scope="module")
def fleet(vllm_fleet: Fleet) -> Iterator[tuple[Settings, str, str]]:
    """The session's two float32 vLLM workers (tests/e2e/conftest.py), behind a `serve` of this module's that serves
    SkyRL's control routes without a token (`--open-control`, as SkyRL's client sends none)."""
    settings = vllm_fleet.settings
    with serve(settings, vllm_fleet.logs / "serve-skyrl.log", "--open-control") as base:
        yield settings, base, vllm_fleet.model_dir.name


def skyrl(base: str, model: str) -> Any:
    return skyrl_module(CLIENT).RemoteInferenceClient(
        proxy_url=base, server_urls=[base], data_parallel_size=1, model_name=model
    )


async def _with(client: Any, coro: Any) -> Any:
    try:
        return await coro
    finally:
        await client.teardown()


def _sample_body(tokens: list[int], **fields: Any) -> dict[str, Any]:
    """The request of SkyRL's `sample` (Tinker's): one sample of a prompt of `tokens`, with `fields` besides."""
    return {"json": {"prompt": {"chunks": [{"tokens": tokens}]}, "num_samples": 1, **fields}}


def test_skyrls_sample_scores_a_prompt_as_the_model_sampled_it(fleet):
    """SkyRL's `sample` with prompt logprobs (Tinker's scoring call): sample a completion at temperature 1, then
    score prompt + completion; the prompt logprobs at the completion's positions are the logprobs it was sampled
    with (the same float32 model; prefill and decode differ in rounding only), and each position's top-k entries
    are ranked, best first, with the prompt token's own rank among them where it is in the top k."""
    settings, base, model = fleet
    k = 3

    async def main() -> tuple[list[int], dict[str, Any], dict[str, Any]]:
        async with RolloutClient(settings) as rollout:
            [prompt] = await rollout.tokenize(["The capital of France is"])
        client = skyrl(base, model)
        params = {"temperature": 1.0, "max_tokens": 8, "seed": 11, "logprobs": 0}
        sampled = await _with(client, client.sample(_sample_body(prompt, sampling_params=params)))
        scored_prompt = prompt + sampled["sequences"][0]["tokens"]
        scoring = {"max_tokens": 1, "temperature": 0.0}
        prompt_logprobs = {"include_prompt_logprobs": True, "topk_prompt_logprobs": k}
        body = _sample_body(scored_prompt, sampling_params=scoring, **prompt_logprobs)
        scored = await _with(client, client.sample(body))
        return prompt, sampled, scored

    prompt, sampled, scored = asyncio.run(main())
    completion = sampled["sequences"][0]
    assert scored["prompt_logprobs"][0] is None and len(scored["prompt_logprobs"]) == len(prompt) + 8
    assert all(lp is not None and lp <= 0.0 for lp in scored["prompt_logprobs"][1:])
    for position, logprob in enumerate(completion["logprobs"]):
        assert math.isclose(scored["prompt_logprobs"][len(prompt) + position], logprob, abs_tol=1e-3), position
    for position, top in enumerate(scored["topk_prompt_logprobs"][1:], start=1):
        assert len(top) == k and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True), position
        own = scored["prompt_logprobs"][position]
        assert top[0][1] >= own - 1e-6  # nothing in the prompt beats the model's best guess


def test_skyrls_generate_equals_rollout_client_token_for_token(fleet):
    settings, base, model = fleet
    params = {"temperature": 0.0, "max_tokens": 16, "logprobs": 0, "stop": None, "top_k": -1}

    async def main() -> tuple[dict[str, Any], list[Any], list[str]]:
        async with RolloutClient(settings) as rollout:
            prompts = await rollout.tokenize(["The capital of France is", "Water boils at", "Once upon a time"])
            want = await rollout.generate(prompts, {"temperature": 0.0, "max_tokens": 16, "logprobs": 0})
            decoded = await rollout.detokenize([t.completion_token_ids for t in want])  # a worker's tokenizer
        client = skyrl(base, model)
        got = await _with(client, client.generate({"prompt_token_ids": prompts, "sampling_params": params}))
        return got, want, decoded

    got, want, decoded = asyncio.run(main())
    assert got["response_ids"] == [t.completion_token_ids for t in want]
    for mine, theirs in zip(got["response_logprobs"], [t.logprobs for t in want], strict=True):
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(mine, theirs, strict=True))
    # SkyRL's /detokenize, answered by serve from what the worker decoded, is what a worker's detokenize gives
    assert got["responses"] == decoded == [t.text for t in want]


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


def test_fetch_weights_from_a_checkpoint_changes_the_output_and_restores_it(fleet):
    settings, base, model = fleet
    root = settings.weight_sync.checkpoint_root
    assert root is not None
    original = load_file(str(prepare_model(Settings().cache_dir) / "model.safetensors"))
    for name, tensors in {"original": original, "perturbed": perturb_weights(original)}.items():
        (root / name).mkdir()
        save_file(tensors, str(root / name / "model.safetensors"))
    params = {"temperature": 0.0, "max_tokens": 12, "stop": None}
    sessions = [f"fetch-{i}" for i in range(4)]  # spread over both workers (checked below)

    def greedy() -> list[list[int]]:
        async def main() -> dict[str, Any]:
            client = skyrl(base, model)
            prompt = list(range(1000, 1010))
            body = {"prompt_token_ids": [prompt] * 4, "sampling_params": params, "session_ids": sessions}
            return await _with(client, client.generate(body))

        return asyncio.run(main())["response_ids"]

    def fetch(name: str) -> dict[str, Any]:
        response = httpx.post(f"{base}/fetch_weights", json={"path": str(root / name)}, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()

    async def workers_of_sessions() -> set[str]:
        async with RolloutClient(settings) as rollout:
            return {w for s in sessions if (w := await rollout.session_worker(s)) is not None}

    base_ids = greedy()
    assert len(asyncio.run(workers_of_sessions())) == 2, "the sessions did not reach both workers"
    version = httpx.get(f"{base}/weight_info").json()["weight_version"]
    perturbed = fetch("perturbed")
    assert sorted(perturbed["loaded"]) == ["vllm-0", "vllm-1"] and perturbed["weight_version"] == int(version) + 1
    changed = greedy()
    assert all(c != b for c, b in zip(changed, base_ids, strict=True)), "the perturbed checkpoint did not change both"
    fetch("original")
    assert greedy() == base_ids, "the original checkpoint did not restore the output"


def test_skyrls_own_generator_runs_a_multi_turn_gsm8k_episode(fleet, vllm_fleet):
    """SkyRL's `SkyRLGymGenerator.agent_loop` (unmodified: skyrl 0.3.0 with skyrl-gym 0.4.0) runs a multi-turn episode
    of skyrl-gym's own `gsm8k_multi_turn` env on the real model, once through `serve` (SkyRL's `RemoteInferenceClient`)
    and once in-process (`RolloutServiceEngine`), with the sampling params SkyRL's trainer builds from its config
    (`get_vllm_sampling_params`: greedy, 20 tokens a turn, logprobs). The episode runs all 3 turns (the 135M model
    does not solve the problem); each trajectory is whole (prompt ids as the chat template renders them, one
    logprob and one loss-mask entry per response token, one run of generated tokens per turn with the env's
    observation between them); its first turn is `RolloutClient.generate`'s greedy answer token for token; the two
    trajectories are the same token for token; `finish_session` released the session."""
    settings, base, model = fleet
    generators = skyrl_module("skyrl.train.generators.skyrl_gym_generator")
    config = skyrl_module("skyrl.train.config")
    engine_utils = skyrl_module("skyrl.backends.skyrl_train.inference_servers.engine_utils")
    from transformers import AutoTokenizer

    from rollout_svc.integrations.skyrl import RolloutServiceEngine

    tokenizer = AutoTokenizer.from_pretrained(vllm_fleet.model_dir)
    sampling = config.SamplingParams(max_generate_length=20, temperature=0.0)
    generator_cfg = config.GeneratorConfig(max_turns=3, sampling_params=sampling)
    prompt = [{"role": "user", "content": "What is 123456 times 789? End with '#### ANSWER'."}]
    extras = {"reward_spec": {"ground_truth": "97406784"}}

    async def episode(engine: Any, instance: str) -> Any:
        generator = generators.SkyRLGymGenerator(generator_cfg, config.SkyRLGymConfig(), engine, tokenizer)
        return await generator.agent_loop(
            prompt,
            "gsm8k_multi_turn",
            dict(extras),
            max_tokens=20,
            max_input_length=2048,
            sampling_params=engine_utils.get_vllm_sampling_params(sampling),
            trajectory_id=generators.TrajectoryID(instance_id=instance, repetition_id=0),
        )

    async def main() -> tuple[Any, Any, Any, str | None]:
        client = skyrl(base, model)
        over_http = await _with(client, episode(client, "http"))
        async with RolloutClient(settings) as rollout:
            in_process = await episode(RolloutServiceEngine(rollout, model, owns_client=False), "inproc")
            greedy = {"temperature": 0.0, "max_tokens": 20, "logprobs": 0}
            [first] = await rollout.generate([over_http.prompt_ids], greedy)
            return over_http, in_process, first, await rollout.session_worker("http_0")

    over_http, in_process, first, pinned = asyncio.run(main())
    template = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert over_http.prompt_ids == list(template)
    assert over_http.env_metrics == {"steps": 3}, over_http.env_metrics
    ids, mask = over_http.response_ids, over_http.loss_mask
    assert len(mask) == len(ids) == len(over_http.rollout_logprobs) == len(over_http.reward)
    runs = [len(list(g)) for bit, g in itertools.groupby(mask) if bit == 1]
    assert len(runs) == 3 and all(0 < n <= 20 for n in runs), mask  # one run of generated tokens per turn
    observations = [i for i, bit in zip(ids, mask, strict=True) if bit == 0]
    assert "step-by-step reasoning" in tokenizer.decode(observations)  # gsm8k_multi_turn's observation, tokenized
    assert ids[: runs[0]] == first.completion_token_ids
    assert all(
        math.isclose(a, b, abs_tol=1e-4) for a, b in zip(over_http.rollout_logprobs, first.logprobs, strict=False)
    )
    assert (in_process.response_ids, in_process.loss_mask) == (ids, mask)
    assert pinned is None, "finish_session released the episode's session"


def _requests_by_route(base: str) -> Counter[tuple[str, str]]:
    """`serve`'s `rollout_api_requests_total`, by (route, status)."""
    samples = parse(httpx.get(f"{base}/metrics", timeout=30).text)
    by_label = ((dict(labels), int(v)) for (name, labels), v in samples.items() if name == "rollout_api_requests_total")
    return Counter({(labels["route"], labels["status"]): v for labels, v in by_label})


def test_skyrls_fully_async_trainer_sim_trains_on_serve(fleet, vllm_fleet):
    """SkyRL's `FullyAsyncTrainerSim` (unmodified) through examples/skyrl_trainer_sim.py: 4 simulated steps of 2 prompts
    x 2 samples from skyrl-gym's `gsm8k` env, `serve` as its external inference layer. SkyRL's calls, counted by
    `serve`'s own request metrics, are exactly those it should make: 16 `generate` and 16 `finish_session` (one per
    trajectory), 5 `pause` and 5 `resume` (one simulated weight sync before the first step and one after each step),
    nothing else and nothing refused; the fleet is serving (not paused) at the end."""
    _, base, model = fleet
    before = _requests_by_route(base)
    example = Path(__file__).parents[2] / "examples" / "skyrl_trainer_sim.py"
    command = [
        sys.executable,
        str(example),
        "--url",
        base,
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--samples-per-prompt",
        "2",
        "--model",
        str(vllm_fleet.model_dir),
        "--served-model-name",
        model,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["prompts"] == 8, summary
    made = _requests_by_route(base) - before
    made.pop(("/metrics", "200"), None)  # the count of this test's own reads
    assert made == Counter(
        {
            ("/inference/v1/generate", "200"): 16,
            ("/finish_session", "200"): 16,
            ("/pause", "200"): 5,
            ("/resume", "200"): 5,
        }
    ), made
    after = httpx.get(f"{base}/is_paused", timeout=30).json()
    assert after["is_paused"] is False and after["holders"] == {}, after  # each of its pauses released by its resume
