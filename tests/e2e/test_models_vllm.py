"""Two models in one fleet on the real engine: the same SmolLM2-135M weights served under two names, a `policy`
that receives weight syncs and a frozen `reference` (float32, one vLLM worker each, one Redis).

A weight sync of the policy (`WeightSender` of the policy's settings) reaches the policy's worker alone: the
policy's greedy output changes, the reference's stays what it was; a pause of the policy leaves the reference
serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout_svc import RolloutClient
from rollout_svc.client.weight_sender import WeightSender
from rollout_svc.config import Settings
from rollout_svc.model import prepare_model
from tests.support import WorkerProcs

pytestmark = pytest.mark.vllm

MiB = 2**20
ENGINE = ["--engine", "vllm", "--dtype", "float32", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(128 * MiB)]
GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return prepare_model(Settings().cache_dir)


@pytest.fixture(scope="module")
def fleet(redis_url: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    settings = Settings(
        redis_url=redis_url, key_prefix="e2e-models", heartbeat_ttl_s=60, request_timeout_s=300,
        control_timeout_s=120, pause_lease_s=120,
    )  # fmt: skip
    log_dir = tmp_path_factory.mktemp("model-workers")
    groups = {name: WorkerProcs(settings.copy_with(model_name=name), log_dir) for name in ("policy", "reference")}
    for i, (name, procs) in enumerate(groups.items()):
        procs.start(f"{name}-0", "--model", str(model_dir), *ENGINE, env={"VLLM_CPU_OMP_THREADS_BIND": str(i)})
    try:
        for name, procs in groups.items():
            procs.wait_live(f"{name}-0", timeout_s=600)
            procs.wait_converged(f"{name}-0", timeout_s=120)
        yield settings
    finally:
        for procs in groups.values():
            procs.stop_all()


async def test_a_sync_of_the_policy_changes_it_alone_and_a_pause_of_the_policy_leaves_the_reference_serving(
    fleet, model_dir
):
    original = load_file(str(model_dir / "model.safetensors"))
    noise = torch.Generator().manual_seed(0)
    perturbed = {n: t + 0.1 * t.std() * torch.randn(t.shape, generator=noise) for n, t in original.items()}
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
        report = await sender.update(perturbed.items(), version=1)
        assert report.loaded == ["policy-0"], report
        [policy_after] = await policy.generate([prompt], GREEDY)
        [reference_after] = await reference.generate([prompt], GREEDY)
        assert policy_after.weight_versions == [(report.version, 0)]
        assert policy_after.completion_token_ids != policy_before.completion_token_ids, "the sync changed nothing"
        assert reference_after.weight_versions == [(0, 0)], "the policy's sync reached the reference"
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
