"""TRL's own `VLLMClient` (trl 1.16.0, unmodified) and prime-rl's weight step (its calls replayed as its client
makes them: tests/integration/test_prime_rl.py says which commit) through `rollout-svc serve` to the session's two
real vLLM workers on the real model (float32; tests/e2e/conftest.py).

TRL's `generate` returns the token ids `RolloutClient.generate` does (greedy), and `structured_outputs` constrains
the real engine; prime-rl's step (pause keep, `/update_weights` from a sharded checkpoint, resume) changes the
greedy output and the weight version on both workers, and the original weights, sharded the same way, restore both.
"""

from __future__ import annotations

import asyncio
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file, save_file

from rollout_svc import RolloutClient
from rollout_svc.config import Settings
from rollout_svc.model import prepare_model
from tests.e2e.conftest import TWO_FLOAT32, Fleet, perturb_weights
from tests.integration.test_trl_client import NEWER_VLLM
from tests.support import serve

with warnings.catch_warnings():
    warnings.filterwarnings(*NEWER_VLLM.split(":")[:2], category=UserWarning)
    from trl.generation.vllm_client import VLLMClient

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_fleet(TWO_FLOAT32), pytest.mark.filterwarnings(NEWER_VLLM)]
ADMIN = httpx.Timeout(connect=10.0, read=300.0, write=60.0, pool=10.0)  # prime-rl's per-attempt bounds


@pytest.fixture(scope="module")
def fleet(vllm_fleet: Fleet) -> Iterator[tuple[Settings, str]]:
    """The session's two float32 vLLM workers, behind a `serve --open-control` of this module's (neither TRL's nor
    prime-rl's admin client sends a token)."""
    with serve(vllm_fleet.settings, vllm_fleet.logs / "serve-trainers.log", "--open-control") as base:
        yield vllm_fleet.settings, base


def test_trls_generate_equals_rollout_client_token_for_token(fleet):
    settings, base = fleet
    texts = ["The capital of France is", "Water boils at", "Once upon a time"]

    async def reference() -> tuple[list[list[int]], list[list[int]]]:
        async with RolloutClient(settings) as rollout:
            prompts = await rollout.tokenize(texts)
            want = await rollout.generate(prompts, {"temperature": 0.0, "max_tokens": 16})
            return prompts, [t.completion_token_ids for t in want]

    prompts, want = asyncio.run(reference())
    client = VLLMClient(base_url=base, connection_timeout=60)
    from_ids = client.generate(prompts, temperature=0.0, max_tokens=16, logprobs=0)
    assert from_ids["completion_ids"] == want and from_ids["prompt_ids"] == prompts
    assert [[ids[0] for ids in row] for row in from_ids["logprob_token_ids"]] == want  # the sampled token first
    from_text = client.generate(texts, temperature=0.0, max_tokens=16, logprobs=None)
    assert from_text["prompt_ids"] == prompts and from_text["completion_ids"] == want


def test_structured_outputs_constrain_the_real_engine(fleet):
    """vLLM's `structured_outputs` (TRL's `structured_outputs_regex`, and a choice on the wire) shape the output."""
    _, base = fleet
    client = VLLMClient(base_url=base, connection_timeout=60)
    out = client.generate(
        ["My favourite letters are"], max_tokens=6, temperature=1.0, structured_outputs_regex="[ab]{6}"
    )
    text = httpx.post(f"{base}/detokenize", json={"tokens": out["completion_ids"][0]}).json()["prompt"]
    assert re.fullmatch("[ab]{6}", text), text
    body = {"model": client.model, "prompt": "Is the sky blue? Answer:", "max_tokens": 4, "temperature": 1.0}
    chosen = httpx.post(f"{base}/v1/completions", json=body | {"structured_outputs": {"choice": ["yes", "no"]}})
    assert chosen.json()["choices"][0]["text"] in ("yes", "no"), chosen.text


def _sharded(weights: dict[str, Any], folder: Path) -> Path:
    """`weights` as Hugging Face writes a large model (and prime-rl's trainer a broadcast): two shards, their index,
    then the `STABLE` marker."""
    folder.mkdir(parents=True)
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: weights[k].contiguous() for k in keys}, str(folder / shard))
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "STABLE").touch()
    return folder


def test_prime_rls_weight_step_changes_the_output_and_the_original_weights_restore_it(fleet):
    settings, base = fleet
    root = settings.weight_sync.checkpoint_root
    assert root is not None
    original = load_file(str(prepare_model(Settings().cache_dir) / "model.safetensors"))
    steps = {
        "perturbed": _sharded(perturb_weights(original), root / "broadcasts" / "step_1"),
        "original": _sharded(original, root / "broadcasts" / "step_2"),
    }
    sessions = [f"prime-{i}" for i in range(4)]  # spread over both workers

    def greedy() -> list[list[int]]:
        async def main() -> list[list[int]]:
            async with RolloutClient(settings) as rollout:
                prompts = [list(range(1000, 1010))] * 4
                made = await rollout.generate(prompts, {"temperature": 0.0, "max_tokens": 12}, session_ids=sessions)
                assert len({t.worker_id for t in made}) == 2, "the sessions did not reach both workers"
                return [t.completion_token_ids for t in made]

        return asyncio.run(main())

    def step(name: str) -> dict[str, Any]:
        with httpx.Client(base_url=base, timeout=ADMIN) as admin:
            admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}).raise_for_status()
            try:
                answer = admin.post("/update_weights", json={"weight_dir": steps[name].as_posix(), "stable_wait_s": 5})
            finally:
                admin.post("/resume").raise_for_status()
        assert answer.status_code == 200, answer.text
        return answer.json()

    base_ids = greedy()
    version = int(httpx.get(f"{base}/weight_info").json()["weight_version"])
    perturbed = step("perturbed")
    assert sorted(perturbed["loaded"]) == ["vllm-0", "vllm-1"] and perturbed["weight_version"] == version + 1
    assert all(c != b for c, b in zip(greedy(), base_ids, strict=True)), "the sharded checkpoint did not change both"
    restored = step("original")
    assert restored["weight_version"] == version + 2 and greedy() == base_ids
