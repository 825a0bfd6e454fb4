"""Several models in one fleet, on echo workers (queue and control behaviour; the model's side is
tests/e2e/test_models_vllm.py): a policy and a reference, each a named model (`Settings.model_name`) with workers,
queues and control state of its own in one Redis. Requests for each go only to its workers, a pause of the policy
leaves the reference serving, `status` groups the workers by model, and `serve` lists and routes both through the
official `openai` client.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from rollout_svc import RolloutClient
from rollout_svc.config import Settings
from tests.support import ROOT, WorkerProcs, serve, settings_env

DELAY = ["--echo-token-delay-s", "0.02"]
PROMPT = list(range(1, 41))


@pytest.fixture
def models(settings: Settings, tmp_path: Path) -> Iterator[dict[str, WorkerProcs]]:
    """Two echo workers serving `policy` and one serving `reference`."""
    groups = {name: WorkerProcs(settings.copy_with(model_name=name), tmp_path) for name in ("policy", "reference")}
    env = {"ROLLOUT_CHECKPOINT_ROOT": str(tmp_path)}
    try:
        groups["policy"].start_ready(["policy-0", "policy-1"], "--engine", "echo", *DELAY, env=env)
        groups["reference"].start_ready(["reference-0"], "--engine", "echo", *DELAY, env=env)
        yield groups
    finally:
        for procs in groups.values():
            procs.stop_all()


async def test_requests_for_each_model_go_only_to_its_workers_and_a_pause_of_one_leaves_the_other_serving(
    settings, models
):
    async with (
        RolloutClient(settings, model_name="policy") as policy,
        RolloutClient(settings, model_name="reference") as reference,
        RolloutClient(settings) as default,
    ):
        assert {w.worker_id: w.model for w in await policy.workers()} == {"policy-0": "policy", "policy-1": "policy"}
        assert {w.worker_id for w in await reference.workers()} == {"reference-0"}
        assert await default.workers() == [] and await default.named_models() == ["policy", "reference"]
        by_policy = await policy.generate([PROMPT] * 12, {"max_tokens": 4})
        by_reference = await reference.generate([PROMPT] * 12, {"max_tokens": 4})
        assert {t.worker_id for t in by_policy} <= {"policy-0", "policy-1"}
        assert {t.worker_id for t in by_reference} == {"reference-0"}
        await policy.pause("keep")
        try:
            assert [w.state for w in await reference.workers()] == ["serving"]
            waiting = asyncio.create_task(policy.generate([PROMPT], {"max_tokens": 4}))
            served = await asyncio.wait_for(reference.generate([PROMPT] * 4, {"max_tokens": 4}), 30)
            assert {t.worker_id for t in served} == {"reference-0"}
            await asyncio.sleep(0.5)
            assert not waiting.done(), "the policy's request ran while the policy was paused"
        finally:
            await policy.resume()
        [late] = await waiting
        assert late.worker_id.startswith("policy-") and late.finish_reason == "length"


def test_status_groups_workers_by_model(settings, models):
    command = [sys.executable, "-m", "rollout_svc", "status", "--json", "--redis-url", settings.redis_url]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=settings_env(settings), timeout=60)
    report = json.loads(done.stdout)
    assert report["workers"] == [] and sorted(report["named_models"]) == ["policy", "reference"]
    grouped = {name: [w["worker_id"] for w in r["workers"]] for name, r in report["named_models"].items()}
    assert grouped == {"policy": ["policy-0", "policy-1"], "reference": ["reference-0"]}
    text = subprocess.run(command[:-3] + command[-2:], capture_output=True, text=True, cwd=ROOT,
                          env=settings_env(settings), timeout=60).stdout  # fmt: skip
    assert "model policy" in text and "model reference" in text


async def test_the_api_lists_every_model_and_routes_each_to_its_workers(settings, models, tmp_path):
    (tmp_path / "judge").mkdir()
    (tmp_path / "judge" / "adapter_config.json").write_text("{}")
    async with RolloutClient(settings, model_name="reference") as reference:
        await reference.load_adapter("judge", str(tmp_path / "judge"))  # an adapter of the reference model
    with serve(settings, tmp_path / "serve.log") as base, openai.OpenAI(base_url=f"{base}/v1", api_key="-") as api:
        listed = {m.id: m.model_extra.get("parent") for m in api.models.list().data}
        assert listed == {"policy": None, "reference": None, "judge": "reference"}
        for model, workers in (
            ("policy", {"policy-0", "policy-1"}),
            ("reference", {"reference-0"}),
            ("judge", {"reference-0"}),
        ):
            for _ in range(4):
                raw = api.completions.with_raw_response.create(model=model, prompt="hello there", max_tokens=3)
                assert raw.headers["x-worker-id"] in workers and raw.parse().model == model
        with pytest.raises(openai.NotFoundError):
            api.completions.create(model="critic", prompt="hello", max_tokens=3)
