"""A step survives its trainer: a client names a step (`generate(..., step_id=)`), is killed -9 mid-step, and a new
client in another process attaches to it (`attach_step`) and collects every result, in order, under the same ids,
none generated twice. Echo workers with their metrics served (the tokens the fleet generated), a real Redis, the
trainer a real process killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
import redis

from rollout_svc import InvalidRequestError, RolloutClient
from rollout_svc.client.status import fleet_status
from rollout_svc.client.step_store import step_producer
from rollout_svc.config import Settings
from tests.integration.test_metrics import fleet_counter
from tests.support import ROOT, async_wait_until, free_port

STEP = 200
MAX_TOKENS = 20
PROMPT_LEN = 24  # the echo engine answers with the prompt: each request makes MAX_TOKENS tokens

TRAINER = textwrap.dedent(
    """
    import asyncio, sys
    from rollout_svc import RolloutClient

    async def main():
        async with RolloutClient() as client:
            prompts = [[1 + (i + j) % 900 for j in range({prompt_len})] for i in range({step})]
            requests = await client.rollout_requests(
                prompts, {{"max_tokens": {max_tokens}}}, request_ids=[f"r{{i}}" for i in range({step})]
            )
            await client.run(requests, step_id=sys.argv[1])
            print("collected", flush=True)

    asyncio.run(main())
    """
).format(prompt_len=PROMPT_LEN, step=STEP, max_tokens=MAX_TOKENS)


@pytest.fixture
def metric_ports(echo_workers) -> list[int]:
    """Two echo workers, 20 ms a token, 16 requests at a time each: a step of 200 takes ~2.5 s."""
    ports = [free_port(), free_port()]
    for port in ports:
        echo_workers(1, "--echo-token-delay-s", "0.02", "--max-num-seqs", "16", "--metrics-port", str(port))
    return ports


def generated_tokens(ports: list[int]) -> float:
    return fleet_counter(ports, "rollout_worker_generated_tokens_total")


def start_trainer(settings: Settings, step_id: str, ttl_s: float | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "ROLLOUT_REDIS_URL": settings.redis_url, "ROLLOUT_KEY_PREFIX": settings.key_prefix}
    if ttl_s is not None:
        env["ROLLOUT_STEP_TTL_S"] = str(ttl_s)
    command = [sys.executable, "-c", TRAINER, step_id]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def kill_when_answered(trainer: subprocess.Popen[str], rds: redis.Redis, settings: Settings, step_id: str) -> int:
    """SIGKILL the trainer once some of its step's results came (its results stream holds them): how many."""
    results = settings.keys.results(step_producer(step_id))
    await async_wait_until(lambda: rds.xlen(results) >= 40 or trainer.poll() is not None, 60, "the step under way")
    assert trainer.poll() is None, trainer.communicate()
    answered = rds.xlen(results)
    trainer.kill()
    trainer.communicate(timeout=10)
    return answered


@pytest.mark.timeout(120)
async def test_attach_collects_a_killed_trainers_step_in_order_none_generated_twice(settings, metric_ports, rds):
    trainer = start_trainer(settings, "step-7")
    answered = await kill_when_answered(trainer, rds, settings, "step-7")
    assert answered < STEP  # killed mid-step
    async with RolloutClient(settings) as client:
        trajectories = await client.attach_step("step-7")
        # kept until the trainer says it used them: a process that dies before that collects them again
        again = await client.attach_step("step-7")
        assert [t.completion_token_ids for t in again] == [t.completion_token_ids for t in trajectories]
        assert await client.finish_step("step-7")
        with pytest.raises(InvalidRequestError, match="no step 'step-7'"):
            await client.attach_step("step-7")
        assert not await client.finish_step("step-7")
    assert [t.request_id for t in trajectories] == [f"r{i}" for i in range(STEP)]
    assert all(t.finish_reason == "length" and len(t.completion_token_ids) == MAX_TOKENS for t in trajectories)
    # one generation of each: the new client sent nothing again
    assert generated_tokens(metric_ports) == STEP * MAX_TOKENS
    assert not rds.exists(settings.keys.step("step-7"), settings.keys.results(step_producer("step-7")))


@pytest.mark.timeout(120)
async def test_attach_awaits_the_retries_a_killed_trainer_made(settings, metric_ports, rds):
    trainer = start_trainer(settings, "step-8")
    await kill_when_answered_after_retries(trainer, rds, settings, "step-8")
    async with RolloutClient(settings) as client:
        trajectories = await client.attach_step("step-8")
    assert [t.request_id for t in trajectories] == [f"r{i}" for i in range(STEP)]
    assert all(len(t.completion_token_ids) == MAX_TOKENS for t in trajectories)
    assert sum(t.interruptions for t in trajectories) > 0  # cut by the abort, continued token-exact
    assert generated_tokens(metric_ports) == STEP * MAX_TOKENS  # a continuation makes only its new tokens


async def kill_when_answered_after_retries(
    trainer: subprocess.Popen[str], rds: redis.Redis, settings: Settings, step_id: str
) -> None:
    """An abort-mode pause cuts what runs; the trainer retries each cut request token-exact (recording the new
    attempts in the step); then it is killed."""
    results = settings.keys.results(step_producer(step_id))
    await async_wait_until(lambda: rds.xlen(results) >= 20 or trainer.poll() is not None, 60, "the step under way")
    async with RolloutClient(settings) as operator:
        await operator.pause("abort", holder="ops")
        await operator.resume(holder="ops")
    # the cut answers reached the trainer and their retries were taken by Redis (and recorded)
    attempts = settings.keys.step(step_id)
    await async_wait_until(
        lambda: any(not v.startswith(b"r") for k, v in rds.hgetall(attempts).items() if k.startswith(b"a:")),
        30,
        "a retry recorded",
    )
    await asyncio.sleep(0.5)
    assert trainer.poll() is None, trainer.communicate()
    trainer.kill()
    trainer.communicate(timeout=10)


@pytest.mark.timeout(60)
async def test_a_step_not_attached_to_within_its_ttl_goes_and_is_counted(settings, echo_workers, rds):
    echo_workers(1, "--echo-token-delay-s", "0.05", "--max-num-seqs", "4")
    trainer = start_trainer(settings, "step-9", ttl_s=1.0)
    await kill_when_answered(trainer, rds, settings, "step-9")
    await asyncio.sleep(1.5)  # past its TTL: its record expired
    short = settings.copy_with(step_ttl_s=1.0)
    async with RolloutClient(short) as client:
        with pytest.raises(InvalidRequestError, match="it expired"):
            await client.attach_step("step-9")
    assert int(rds.get(settings.keys.steps_expired)) == 1
    assert (await fleet_status(settings))["steps"] == {"live": 0, "expired": 1}  # what `rollout-svc status` prints
    assert not rds.zscore(settings.keys.steps, "step-9")


async def test_a_step_id_in_use_is_refused_and_a_bad_one_named(settings, echo_workers):
    echo_workers(1)
    async with RolloutClient(settings) as client:
        with pytest.raises(InvalidRequestError, match="step_id"):
            await client.generate([[1, 2, 3]], step_id="a b")
        [done] = await client.generate([[1, 2, 3]], {"max_tokens": 2}, step_id="once")
        assert done.finish_reason == "length"
        with pytest.raises(InvalidRequestError, match="exists already"):  # kept for a restart, until finished
            await client.generate([[1, 2, 3]], {"max_tokens": 2}, step_id="once")
        assert await client.finish_step("once")
        [again] = await client.generate([[1, 2, 3]], {"max_tokens": 2}, step_id="once")  # finished: the id is free
        assert again.completion_token_ids == [1, 2]
        [group] = await client.sample([[4, 5, 6]], 2, {"max_tokens": 2}, step_id="sampled")
        assert [t.completion_token_ids for t in group] == [[4, 5], [4, 5]] and group[0].group_id == group[1].group_id
