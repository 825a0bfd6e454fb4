"""Ray worker groups on a local Ray cluster (CPU): two vLLM workers as Ray actors serve `RolloutClient`; killing one
actor's process brings a replacement that rejoins under the same worker id and serves."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from rollout_svc import RolloutClient
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy.ray import RayWorkerGroup, WorkerInfo
from rollout_svc.model import prepare_model
from rollout_svc.tools import dataset
from tests.support import async_wait_until, wait_until

pytestmark = pytest.mark.vllm

MiB = 2**20
PARAMS = {"temperature": 0.0, "max_tokens": 16}
LONG_PARAMS = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}  # still running when the actor dies


@pytest.fixture
def local_ray() -> Iterator[None]:
    """A Ray instance of this test's own (2 CPUs: one per worker), torn down afterwards."""
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=100 * MiB, _temp_dir=temp_dir, log_to_driver=False
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def running(pid: int | None) -> bool:
    """Whether `pid` runs (a zombie nobody reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def replaced(group: RayWorkerGroup, victim: WorkerInfo) -> WorkerInfo | None:
    """The victim's slot once a new actor runs a new worker process in it."""
    info = group.info(timeout_s=2)[0]
    return info if info and info.actor_pid != victim.actor_pid and info.alive else None


async def test_ray_worker_group_serves_and_a_killed_actor_is_replaced(local_ray, settings, rds, tmp_path):
    settings = settings.copy_with(heartbeat_interval_s=0.5, heartbeat_ttl_s=10.0, request_timeout_s=300.0)
    model = str(prepare_model(Settings().cache_dir))
    engine = EngineSettings(model=model, dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=256 * MiB)
    started = time.monotonic()
    with RayWorkerGroup(2, cpus_per_worker=1, settings=settings, engine=engine, log_dir=tmp_path) as group:
        await asyncio.to_thread(group.wait_ready, 300)
        ready_s = time.monotonic() - started
        async with RolloutClient(settings) as client:
            prompts = await client.apply_chat_template(dataset.first_turns(8, max_chars=300))
            sessions = [f"first-{i}" for i in range(8)]  # new sessions go to the least-loaded worker: both serve
            first = await client.generate(prompts, PARAMS, session_ids=sessions)
            assert {t.worker_id for t in first} == set(group.worker_ids) == {"ray-worker-0", "ray-worker-1"}

            victim, survivor = await asyncio.to_thread(group.info)
            assert victim is not None and survivor is not None and victim.worker_pid is not None
            sessions = [f"second-{i}" for i in range(8)]
            batch = asyncio.create_task(client.generate(prompts, LONG_PARAMS, session_ids=sessions))

            async def victim_busy() -> bool:
                return any(w.worker_id == victim.worker_id and w.in_flight for w in await client.workers())

            await async_wait_until(victim_busy, 60, "requests in flight on the victim")
            os.kill(victim.actor_pid, signal.SIGKILL)  # the Ray actor's process; its worker gets SIGTERM
            killed_at = time.monotonic()
            second = await batch  # requeued or cut and retried: every request completes, whole
            assert [len(t.completion_token_ids) for t in second] == [LONG_PARAMS["max_tokens"]] * 8
            assert all(t.finish_reason == "length" for t in second)

            replacement = await asyncio.to_thread(wait_until, lambda: replaced(group, victim), 120, "a new actor")
            assert replacement.worker_id == victim.worker_id and replacement.worker_pid != victim.worker_pid

            async def rejoined() -> bool:  # registered (state `starting`), then converged: placement takes it
                key = settings.keys.worker(victim.worker_id)
                pid, state = await asyncio.to_thread(rds.hmget, key, "pid", "state")
                return pid == str(replacement.worker_pid).encode() and state == b"serving"

            await async_wait_until(rejoined, 300, "the replacement to serve under the victim's id")
            rejoin_s = time.monotonic() - killed_at
            assert not running(victim.worker_pid), "the killed actor's worker outlived it"
            third = await client.generate(prompts, PARAMS, session_ids=[f"third-{i}" for i in range(8)])
            assert victim.worker_id in {t.worker_id for t in third}  # the least-loaded: the replacement serves
            assert all(t.finish_reason in ("stop", "length") and t.completion_token_ids for t in third)
        now = await asyncio.to_thread(group.info)
        assert now[1] is not None and (now[1].worker_pid, now[1].restarts) == (survivor.worker_pid, 0)
        pids = [info.worker_pid for info in now if info is not None]
    assert not any(running(pid) for pid in pids), "a worker outlived the group's shutdown"
    assert not rds.smembers(settings.keys.workers), "a worker did not deregister"
    print(f"ready in {ready_s:.1f} s; the killed slot served again {rejoin_s:.1f} s after the kill")
