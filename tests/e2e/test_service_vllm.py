"""The service end to end on the real model: RolloutClient -> Redis Streams -> a vLLM worker -> back.

On the session's `TWO_FLOAT32` fleet (tests/e2e/conftest.py): float32 as the reference is, one request at a time, so
greedy outputs equal vLLM's called directly.
"""

from __future__ import annotations

import time

import pytest

from rollout_svc import RolloutClient
from rollout_svc.config import Settings
from tests.e2e.conftest import REFERENCE_MAX_TOKENS, TWO_FLOAT32, Fleet, Reference

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_fleet(TWO_FLOAT32)]

GREEDY = {"temperature": 0.0, "max_tokens": REFERENCE_MAX_TOKENS}
TWO_FLOAT32_KV_BYTES = dict(TWO_FLOAT32.engine)["kv_cache_memory_bytes"]


@pytest.fixture(scope="module")
def vllm_service(vllm_fleet: Fleet) -> Settings:
    return vllm_fleet.settings


async def test_greedy_generate_is_token_identical_to_direct_vllm(vllm_service, direct_reference: Reference):
    conversations = direct_reference.conversations["sharegpt"]  # one at a time: ~8 s each here
    async with RolloutClient(vllm_service) as client:
        workers = await client.workers()  # another module on the fleet may have synced (and restored) its weights
        [version] = {w.weight_version for w in workers}
        prompts = await client.apply_chat_template(conversations)
        trajectories, elapsed_s = [], []
        for prompt in prompts:  # one at a time
            started = time.time()
            trajectories += await client.generate([prompt], GREEDY)
            elapsed_s.append(time.time() - started)
    assert prompts == direct_reference.prompts["sharegpt"], "the workers' chat template renders as Hugging Face's"
    direct = direct_reference.outputs["sharegpt"]
    for prompt, trajectory, reference, call_s in zip(prompts, trajectories, direct, elapsed_s, strict=True):
        assert trajectory.prompt_token_ids == prompt
        assert trajectory.completion_token_ids == reference["completion_token_ids"]
        assert trajectory.logprobs == pytest.approx(reference["logprobs"], abs=1e-4)
        assert trajectory.finish_reason in ("stop", "length") and trajectory.worker_id in {w.worker_id for w in workers}
        assert trajectory.text.strip() and trajectory.weight_version == version
        # Both within the call: queued after it was submitted, generated before it returned (one host's clock).
        assert trajectory.generation_time_s > 0 and trajectory.queue_time_s + trajectory.generation_time_s < call_s


async def test_chat_tokens_and_errors_on_the_real_model(vllm_service):
    async with RolloutClient(vllm_service) as client:
        [ids] = await client.tokenize(["The capital of France is"], add_special_tokens=False)
        assert await client.detokenize([ids]) == ["The capital of France is"]
        conversation = [{"role": "user", "content": "What is the capital of France? One word."}]
        [trajectory] = await client.chat([conversation], GREEDY)
        [template_ids] = await client.apply_chat_template([conversation])
        assert trajectory.prompt_token_ids == template_ids
        assert "Paris" in trajectory.text
        # A prompt longer than the 2048-token context fails alone; its neighbours are served.
        batch = await client.generate([ids, ids * 600, ids], {"temperature": 0.0, "max_tokens": 4})
        assert [t.finish_reason for t in batch] == ["length", "error", "length"]
        assert batch[1].error_code == "invalid_request"
        assert batch[0].completion_token_ids == batch[2].completion_token_ids
        # Sampled logprobs are real log-probabilities.
        [sampled] = await client.generate([ids], {"temperature": 1.0, "max_tokens": 16, "seed": 1})
        assert len(sampled.logprobs) == len(sampled.completion_token_ids) and all(lp <= 0 for lp in sampled.logprobs)


async def test_each_worker_advertises_what_its_started_engine_holds(vllm_service):
    async with RolloutClient(vllm_service) as client:
        workers = await client.workers()
    # SmolLM2-135M's KV cache in float32: 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 4 bytes a token
    fits = TWO_FLOAT32_KV_BYTES // (2 * 30 * 3 * 64 * 4)
    for worker in workers:
        assert (worker.capacity, worker.max_num_seqs, worker.max_model_len) == (64, 64, 2048)
        assert 0.9 * fits <= worker.kv_cache_tokens <= fits  # whole blocks of the 256 MiB vLLM was given
        assert worker.engine_config.startswith("dtype=float32 quantization=none cuda_graphs=off"), worker.engine_config
