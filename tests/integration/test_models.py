"""Several models in one fleet, on echo workers (queue and control behaviour; the model's side is
tests/e2e/test_models_vllm.py): a policy and a reference, each a named model (`Settings.model_name`) with workers,
queues and control state of its own in one Redis. Requests for each go only to its workers, a pause of the policy
leaves the reference serving, `status` groups the workers by model, and `serve` lists and routes both through the
official `openai` client.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from rollout_svc import RolloutClient
from rollout_svc.config import Settings
from tests.support import ROOT, WorkerProcs, free_port, serve, settings_env

# A 2 s heartbeat TTL re-incarnated both policy workers in a CI run under load (`policy-0~1`), and these tests name
# the workers they expect: nothing here waits for a TTL to expire.
pytestmark = pytest.mark.heartbeat_ttl(10.0)
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


@pytest.mark.timeout(150)  # two CLI processes bounded at 60 s each; a loaded CI machine took over 30 s for both
def test_status_groups_workers_by_model(settings, models):
    command = [sys.executable, "-m", "rollout_svc", "status", "--json", "--redis-url", settings.redis_url]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=settings_env(settings), timeout=60)
    report = json.loads(done.stdout)
    assert report["workers"] == [] and sorted(report["named_models"]) == ["policy", "reference"]
    grouped = {name: [w["worker_id"] for w in r["workers"]] for name, r in report["named_models"].items()}
    assert grouped == {"policy": ["policy-0", "policy-1"], "reference": ["reference-0"]}
    text = subprocess.run(
        command[:-3] + command[-2:], capture_output=True, text=True, cwd=ROOT, env=settings_env(settings), timeout=60
    ).stdout
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


def test_up_starts_a_group_of_workers_per_model_and_its_api_routes_each(settings, tmp_path):
    # One `up` for a policy of 2 workers and a reference of 1 (`--model-group`), with the API: SkyRL's generate, the
    # OpenAI completions and /tokenize each reach the workers of the model they name.
    port, log = free_port(), tmp_path / "up.log"
    command = [sys.executable, "-m", "rollout_svc", "up", "--redis-url", settings.redis_url, "--engine", "echo"]
    command += ["--model-group", "policy=2", "--model-group", "reference=1", "--api-port", str(port)]
    with open(log, "wb") as out:
        up = subprocess.Popen(command, cwd=ROOT, env=settings_env(settings), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "up on" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "3 echo worker(s) (policy: 2, reference: 1) up on" in log.read_text()
        ids = asyncio.run(_worker_ids(settings))
        assert [len(ids["policy"]), len(ids["reference"])] == [2, 1]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            while not _healthy(http):  # the API starts beside the workers: it may not listen yet
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            for model in ("policy", "reference", "policy", "reference"):
                body = {"token_ids": PROMPT[:8], "sampling_params": {"max_tokens": 3}, "model": model}
                generated = http.post("/inference/v1/generate", json=body)
                assert generated.status_code == 200 and generated.headers["x-worker-id"] in ids[model], generated.text
                done = http.post("/v1/completions", json={"model": model, "prompt": "hi there", "max_tokens": 2})
                assert done.status_code == 200 and done.headers["x-worker-id"] in ids[model], done.text
            assert http.post("/tokenize", json={"model": "reference", "prompt": "hi"}).json()["count"] > 0
            missing = http.post("/inference/v1/generate", json={"token_ids": [5], "model": "critic"})
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert asyncio.run(_worker_ids(settings)) == {"policy": set(), "reference": set()}  # it left nothing running


def _healthy(http: httpx.Client) -> bool:
    try:
        return http.get("/health").status_code == 200
    except httpx.TransportError:  # not listening yet
        return False


async def _worker_ids(settings: Settings) -> dict[str, set[str]]:
    ids = {}
    for name in ("policy", "reference"):
        async with RolloutClient(settings, model_name=name) as client:
            ids[name] = {w.worker_id for w in await client.workers()}
    return ids


def test_up_refuses_model_groups_it_cannot_start(settings):
    up = [sys.executable, "-m", "rollout_svc", "up", "--redis-url", settings.redis_url, "--engine", "echo"]
    for extra, said in (
        (["--model-group", "policy"], "NAME=N or NAME=N:MODEL"),
        (["--model-group", "policy=0"], "N >= 1"),
        (["--model-group", "policy=1", "--model-group", "policy=2"], "names a model twice"),
        (["--model-group", "policy=1", "--workers", "3"], "leave out --workers"),
    ):
        done = subprocess.run(up + extra, capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 2 and said in done.stderr, (extra, done.stderr)
