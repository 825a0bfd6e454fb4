"""Simulated-GPU workers (`--engine sim`) behind the real queue: every queue feature runs on them."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import pytest

from rollout_svc import RolloutClient
from tests.support import Streaming

# Qwen2.5-7B on one H100, in real time: ~6-7 ms a decode step, so 200 tokens take ~1.4 s.
SIM = ["--sim-model", "qwen2.5-7b", "--sim-gpu", "h100", "--max-model-len", "4096"]


def prompts(count: int) -> list[list[int]]:
    return [[(11 * i + j) % 250 + 1 for j in range(300)] for i in range(count)]


async def test_sim_workers_serve_a_batch_and_report_their_model(settings, sim_workers):
    sim_workers(2, *SIM)
    batch = prompts(40)
    async with RolloutClient(settings) as client:
        trajectories = await client.generate(batch, {"max_tokens": 32, "ignore_eos": True})
        workers = await client.workers()
    assert [t.prompt_token_ids for t in trajectories] == batch
    assert all(t.finish_reason == "length" and len(t.completion_token_ids) == 32 for t in trajectories)
    assert set(Counter(t.worker_id for t in trajectories)) <= {"sim-0", "sim-1"}
    assert {w.model for w in workers} == {"qwen2.5-7b"}


# A CI run saw one request cut twice: under make test's load a 2 s heartbeat lapsed and the reaper requeued it too.
@pytest.mark.heartbeat_ttl(10.0)
async def test_an_abort_pause_on_sim_workers_returns_the_same_tokens_as_an_uncut_run(settings, sim_workers):
    # At a fifth of real time the 180 tokens left after the first 20 take ~6 s, not ~1.2 s: under make test's load a
    # process can wait 3-6 s for a core (docs/testing.md), and a request that ended before the pause landed is not cut.
    sim_workers(2, *SIM, "--sim-time-scale", "0.2")
    batch = prompts(8)
    params = [{"max_tokens": 200, "ignore_eos": True, "seed": i} for i in range(len(batch))]  # seeded: reproducible
    async with RolloutClient(settings) as client:
        uncut = await asyncio.gather(*[client.generate([p], q) for p, q in zip(batch, params, strict=True)])
        runs = [Streaming(client, [p], q) for p, q in zip(batch, params, strict=True)]
        for run in runs:
            await run.streamed(20, 30)
        await client.pause("abort")
        await client.resume()
        cut = [await run.task for run in runs]
    assert [t[0].completion_token_ids for t in cut] == [t[0].completion_token_ids for t in uncut]
    causes = [(t[0].interruptions, t[0].abort_cause, t[0].worker_id) for t in cut]
    assert [t[0].interruptions for t in cut] == [1] * len(batch), causes  # each cut once, continued on resume


async def test_one_process_serves_several_simulated_gpus_each_a_worker(settings, sim_workers, workers):
    sim_workers(1, *SIM, "--sim-engines", "4")
    ids = ["sim-0", "sim-0.1", "sim-0.2", "sim-0.3"]
    workers.wait_ready(*ids)
    async with RolloutClient(settings) as client:
        trajectories = await client.generate(prompts(40), {"max_tokens": 64, "ignore_eos": True})
    assert set(Counter(t.worker_id for t in trajectories)) == set(ids)  # placement spreads them over all four
    workers.kill("sim-0", signal.SIGTERM)  # one process: SIGTERM stops every one of them
    workers.procs["sim-0"].wait(30)
    assert workers.procs["sim-0"].returncode == 0
