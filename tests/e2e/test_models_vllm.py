"""Two models in one fleet on the real engine: the same SmolLM2-135M weights served under two names, a `policy`
that receives weight syncs and a frozen `reference` (float32, one vLLM worker each, one Redis).

A weight sync of the policy (`WeightSender` of the policy's settings) reaches the policy's worker alone: the
policy's greedy output changes, the reference's stays what it was; a pause of the policy leaves the reference
serving. The policy ends on its own weights again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rollout_svc import RolloutClient
from rollout_svc.client.weight_sender import WeightSender
from rollout_svc.config import Settings
from tests.e2e.conftest import Fleet, WorkerSpec, fleet_spec, perturb_weights

MiB = 2**20
# A worker a model, a core each; float32, 8 sequences, 128 MiB of KV cache each.
POLICY_AND_REFERENCE = fleet_spec(
    WorkerSpec("policy-0", "policy", "0"),
    WorkerSpec("reference-0", "reference", "1"),
    dtype="float32",
    max_num_seqs=8,
    kv_cache_memory_bytes=128 * MiB,
)
GREEDY = {"temperature": 0.0, "max_tokens": 12}

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_fleet(POLICY_AND_REFERENCE)]


@pytest.fixture(scope="module")
def model_dir(vllm_fleet: Fleet) -> Path:
    return vllm_fleet.model_dir


@pytest.fixture(scope="module")
def fleet(vllm_fleet: Fleet) -> Settings:
    """The two workers' Redis and keys (each model's under its name); the clients' pauses outlast a minute's freeze."""
    return vllm_fleet.settings.copy_with(request_timeout_s=300, pause_lease_s=120)


async def test_a_sync_of_the_policy_changes_it_alone_and_a_pause_of_the_policy_leaves_the_reference_serving(
    fleet, model_dir
):
    original = load_file(str(model_dir / "model.safetensors"))
    perturbed = perturb_weights(original)
    policy_settings = fleet.copy_with(model_name="policy")
    async with (
        RolloutClient(policy_settings) as policy,
        RolloutClient(fleet, model_name="reference") as reference,
        WeightSender(settings=policy_settings) as sender,
    ):
        [prompt] = await policy.apply_chat_template([[{"role": "user", "content": "Name three rivers in Europe."}]])
        [policy_before] = await policy.generate([prompt], GREEDY)
        [reference_before] = await reference.generate([prompt], GREEDY)
        assert policy_before.worker_id == "policy-0" and reference_before.worker_id == "reference-0"
        assert policy_before.completion_token_ids == reference_before.completion_token_ids  # the same weights
        report = await sender.update(perturbed.items(), version=await sender.committed_version() + 1)
        assert report.loaded == ["policy-0"], report
        [policy_after] = await policy.generate([prompt], GREEDY)
        [reference_after] = await reference.generate([prompt], GREEDY)
        assert policy_after.weight_versions == [(report.version, 0)]
        assert policy_after.completion_token_ids != policy_before.completion_token_ids, "the sync changed nothing"
        assert reference_after.weight_versions == reference_before.weight_versions, "the sync reached the reference"
        assert reference_after.completion_token_ids == reference_before.completion_token_ids
        await policy.pause("keep")
        try:
            waiting = asyncio.create_task(policy.generate([prompt], GREEDY))
            [served] = await asyncio.wait_for(reference.generate([prompt], GREEDY), 120)
            assert served.completion_token_ids == reference_before.completion_token_ids
            assert not waiting.done(), "the policy generated while paused"
        finally:
            await policy.resume()
        [late] = await waiting
        assert late.completion_token_ids == policy_after.completion_token_ids
        await sender.update(original.items(), version=report.version + 1)  # the model's own, for a module after
        [restored] = await policy.generate([prompt], GREEDY)
        assert restored.completion_token_ids == policy_before.completion_token_ids
