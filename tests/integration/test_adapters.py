"""LoRA adapters as fleet state, on echo workers (queue and control behaviour; the model's side is
tests/e2e/test_lora_vllm.py): a load acknowledged by every worker, a late worker converging, a failed load naming
its worker, requests naming an adapter and recording its version, a new version while requests run on the old
one (nothing paused or aborted), an unload, and the HTTP routes (OpenAI's `model`, vLLM's and SkyRL's load and
unload routes) through the official `openai` client and httpx.

An echo worker holds an adapter's name and version but generates as without one: what is tested here is which
requests run under which version, not what an adapter does to the output.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from rollout_svc import RolloutClient
from rollout_svc.errors import ControlCommandError, InvalidRequestError, ModelNotFoundError
from tests.support import ROOT, async_wait_until, serve, settings_env

DELAY = ["--echo-token-delay-s", "0.05"]
PROMPT = list(range(1, 41))


def adapter(root: Path, name: str) -> Path:
    """A directory as peft's `save_pretrained` leaves it (what a worker checks for; the echo engine reads nothing)."""
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "checkpoints"


async def test_an_adapter_loads_on_every_worker_and_requests_record_it(settings, echo_workers, workers, root):
    env = {"ROLLOUT_CHECKPOINT_ROOT": str(root)}
    workers.start_ready(["echo-0", "echo-1"], "--engine", "echo", env=env)
    async with RolloutClient(settings) as client:
        assert await client.load_adapter("math", str(adapter(root, "math-v1"))) == 1
        assert {w.worker_id: w.adapter_versions for w in await client.workers()} == {
            "echo-0": {"math": 1},
            "echo-1": {"math": 1},
        }
        trajectories = await client.generate([PROMPT] * 8, {"max_tokens": 4}, adapter="math")
        assert {(t.adapter, t.adapter_version) for t in trajectories} == {("math", 1)}
        assert all(t.completion_token_ids == PROMPT[:4] for t in trajectories)
        [base] = await client.generate([PROMPT], {"max_tokens": 4})
        assert base.adapter is None and base.adapter_versions == []
        # A worker that starts later loads it as it converges, before it serves.
        workers.start_ready(["echo-2"], "--engine", "echo", env=env)
        assert {w.worker_id: w.adapter_versions for w in await client.workers()}["echo-2"] == {"math": 1}
        # A name the fleet does not hold is refused before anything is sent, never served by the base model.
        with pytest.raises(ModelNotFoundError, match=r"the model `physics` does not exist.*served: math"):
            await client.generate([PROMPT], {"max_tokens": 4}, adapter="physics")
        with pytest.raises(InvalidRequestError, match="adapter name"):
            await client.load_adapter("no spaces", str(root / "math-v1"))
        await client.unload_adapter("math")
        assert all(w.adapter_versions == {} for w in await client.workers())
        with pytest.raises(ModelNotFoundError):
            await client.generate([PROMPT], {"max_tokens": 4}, adapter="math")
        with pytest.raises(ModelNotFoundError):
            await client.unload_adapter("math")
        # Versions only go up, across an unload too.
        assert await client.load_adapter("math", str(root / "math-v1")) == 2
        with pytest.raises(InvalidRequestError, match="version 2"):
            await client.load_adapter("math", str(root / "math-v1"), version=2)


async def test_a_failed_load_names_its_worker_and_the_others_hold_the_adapter(settings, workers, root, tmp_path):
    workers.start_ready(["echo-0"], "--engine", "echo", env={"ROLLOUT_CHECKPOINT_ROOT": str(root)})
    workers.start_ready(["echo-1"], "--engine", "echo", env={"ROLLOUT_CHECKPOINT_ROOT": str(tmp_path / "other")})
    async with RolloutClient(settings) as client:
        with pytest.raises(ControlCommandError) as failed:
            await client.load_adapter("math", str(adapter(root, "math-v1")))
        assert list(failed.value.failures) == ["echo-1"]
        assert "outside this worker's checkpoint root" in failed.value.failures["echo-1"]
        held = {w.worker_id: w.adapter_versions for w in await client.workers()}
        assert held == {"echo-0": {"math": 1}, "echo-1": {}}
        # The one that failed answers a request for it with a clear error, never the base model.
        with pytest.raises(ControlCommandError):  # a missing adapter_config.json fails on both
            await client.load_adapter("bad", str(root))


async def test_a_new_version_takes_new_requests_while_old_ones_finish_on_the_old_one(settings, workers, root):
    workers.start_ready(["echo-0", "echo-1"], "--engine", "echo", *DELAY, env={"ROLLOUT_CHECKPOINT_ROOT": str(root)})
    async with RolloutClient(settings) as client:
        await client.load_adapter("policy", str(adapter(root, "step-1")))
        old = asyncio.create_task(client.generate([PROMPT] * 20, {"max_tokens": 30}, adapter="policy"))
        await async_wait_until(lambda: _in_flight(client, 20), 10, "20 requests running on version 1")
        epoch_before = (await client.fleet_state()).epoch
        assert await client.load_adapter("policy", str(adapter(root, "step-2"))) == 2
        assert not old.done(), "the load waited for the old version's requests: it must not"
        new = await client.generate([PROMPT] * 4, {"max_tokens": 2}, adapter="policy")
        finished = await old
        assert {(t.adapter_versions[0], t.finish_reason) for t in finished} == {((1, 0), "length")}
        assert all(t.interruptions == 0 and t.completion_token_ids == PROMPT[:30] for t in finished)
        assert {t.adapter_version for t in new} == {2}
        state = await client.fleet_state()
        assert state.epoch == epoch_before + 1 and not state.paused  # one command, no pause


async def _in_flight(client: RolloutClient, count: int) -> bool:
    return sum(w.in_flight for w in await client.workers()) >= count


async def test_the_api_serves_adapters_as_models_and_loads_them_by_vllms_and_skyrls_routes(
    settings, workers, root, tmp_path
):
    workers.start_ready(["echo-0"], "--engine", "echo", env={"ROLLOUT_CHECKPOINT_ROOT": str(root)})
    with (
        serve(settings, tmp_path / "serve.log", env={"ROLLOUT_ADMIN_TOKEN": "admin-secret"}) as base,
        httpx.Client(base_url=base, timeout=30, headers={"Authorization": "Bearer admin-secret"}) as http,
        openai.OpenAI(base_url=f"{base}/v1", api_key="none") as api,
    ):
        assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "judge"}).status_code == 401
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "judge", "lora_path": str(adapter(root, "j"))})
        assert loaded.status_code == 200 and "judge" in loaded.text, loaded.text
        models = {m.id: m for m in api.models.list().data}
        assert set(models) == {"echo", "judge"} and models["judge"].model_extra["parent"] == "echo"
        reply = api.completions.create(model="judge", prompt="hello there", max_tokens=3)
        assert reply.model == "judge" and reply.choices[0].finish_reason == "length"
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            api.completions.create(model="nobody", prompt="hello", max_tokens=3)
        again = http.post("/skyrl/v1/load_lora_adapter", json={"lora_name": "judge", "lora_path": str(root / "j")})
        assert again.json() == {"status": "success", "lora_name": "judge", "lora_int_id": 2}
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "judge"})
        assert gone.status_code == 200, gone.text
        with pytest.raises(openai.NotFoundError):
            api.chat.completions.create(model="judge", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "judge"}).status_code == 404
        outside = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert outside.status_code == 409 and "echo-0" in outside.text


def test_the_cli_loads_lists_and_unloads_adapters_and_status_shows_them(settings, workers, root):
    workers.start_ready(["echo-0"], "--engine", "echo", env={"ROLLOUT_CHECKPOINT_ROOT": str(root)})
    env = {**settings_env(settings)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "rollout_svc", *args, "--redis-url", settings.redis_url]
        return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)

    loaded = cli("adapter", "load", "math", str(adapter(root, "m")))
    assert loaded.returncode == 0 and "adapter math version 1 loaded" in loaded.stdout, loaded.stderr
    assert json.loads(cli("adapter", "list", "--json").stdout) == {"math": {"version": 1, "path": str(root / "m")}}
    status = json.loads(cli("status", "--json").stdout)
    assert status["adapters"]["math"]["version"] == 1 and status["workers"][0]["adapters"] == "math@1"
    failed = cli("adapter", "load", "bad", "/etc")
    assert failed.returncode == 1 and "echo-0" in failed.stderr and "outside" in failed.stderr
    assert cli("adapter", "unload", "math").returncode == 0
    missing = cli("adapter", "unload", "math")
    assert missing.returncode == 1 and "does not exist" in missing.stderr


async def test_adapter_staleness_is_measured_and_bounded_as_weight_staleness_is(settings, workers, root):
    workers.start_ready(["echo-0"], "--engine", "echo", *DELAY, env={"ROLLOUT_CHECKPOINT_ROOT": str(root)})
    async with RolloutClient(settings) as client, RolloutClient(settings, max_staleness=0) as bounded:
        await client.load_adapter("policy", str(adapter(root, "step-1")))
        marked = asyncio.create_task(client.generate([PROMPT] * 4, {"max_tokens": 30}, adapter="policy"))
        fresh = asyncio.create_task(bounded.generate([PROMPT] * 4, {"max_tokens": 30}, adapter="policy"))
        await async_wait_until(lambda: _in_flight(client, 8), 10, "8 requests running on version 1")
        await client.load_adapter("policy", str(adapter(root, "step-2")))
        assert {(tuple(t.adapter_versions), t.adapter_staleness) for t in await marked} == {(((1, 0),), 1)}
        # Staler than max_staleness=0: generated again, on version 2, as a too-stale trajectory's weights would be.
        assert {(tuple(t.adapter_versions), t.adapter_staleness) for t in await fresh} == {(((2, 0),), 0)}
        assert bounded.stats.regenerated == 4
