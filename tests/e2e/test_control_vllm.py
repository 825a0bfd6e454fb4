"""The control plane on the real engine: pauses with 100 generations in flight, token-exact retries, sleep.

On the session's `TWO_FLOAT32` fleet (tests/e2e/conftest.py): two float32 vLLM workers (one CPU core each, 64
sequences), so greedy outputs are comparable. Every test leaves the fleet serving, unpaused and awake, for the modules
that share it.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
import redis

from rollout_svc import ControlCommandError, RolloutClient
from rollout_svc.client.status import fleet_status
from rollout_svc.config import Settings
from rollout_svc.keys import PAYLOAD_FIELD
from rollout_svc.model import prepare_model
from rollout_svc.protocol import decode
from rollout_svc.tools import dataset
from tests.e2e.conftest import TWO_FLOAT32, Fleet
from tests.support import Streaming, async_wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_fleet(TWO_FLOAT32)]

MiB = 2**20
BATCH = 100
BATCH_PARAMS = {"temperature": 0.0, "max_tokens": 32, "ignore_eos": True}
# All 100 are in flight on the workers, but each engine's KV cache (5,760 tokens in 128-token blocks on CPU) holds at
# most 45 at once: the others wait inside it until the first finish. A pause lands once this many are generating.
GENERATING = BATCH // 4
ONE_PARAMS = {"temperature": 0.0, "max_tokens": 128, "ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(vllm_fleet: Fleet) -> Settings:
    """The session's two float32 vLLM workers (tests/e2e/conftest.py), on a Redis of their own."""
    return vllm_fleet.settings


async def prompts(client: RolloutClient, count: int) -> list[list[int]]:
    return await client.apply_chat_template(dataset.first_turns(count, max_chars=400))


async def in_flight(client: RolloutClient) -> int:
    return sum(w.in_flight for w in await client.workers())


async def queued(settings: Settings, count: int) -> bool:
    """Whether `count` requests wait, untaken, in the request streams."""
    return sum(depth["queued"] for depth in (await fleet_status(settings))["streams"].values()) == count


async def submitted_at(settings: Settings) -> dict[str, float]:
    """The `submitted_at` of every request queued in the request streams, by request id. The client stamps it as it
    builds a request, after awaits of its own (a loaded CI machine put 50 ms between a call and its stamp)."""
    stamps: dict[str, float] = {}
    streams = (await fleet_status(settings))["streams"]
    with redis.Redis.from_url(settings.redis_url) as rds:
        for stream in streams:
            for _, fields in rds.xrange(stream):
                request = decode(fields[PAYLOAD_FIELD])
                stamps[request.request_id] = request.submitted_at
    return stamps


async def test_keep_pause_with_100_in_flight_loses_and_starts_nothing(fleet):
    async with RolloutClient(fleet) as client:
        batch = await prompts(client, BATCH)
        run = Streaming(client, batch, BATCH_PARAMS)
        await async_wait_until(lambda: _all_in_flight(client), 120, "all 100 in flight")
        await run.streamed(1, 120, count=GENERATING)  # generating: their first tokens came back
        await client.pause("keep")
        paused_at = time.monotonic()
        assert not run.arrived and max(run.tokens) < BATCH_PARAMS["max_tokens"]  # none finished before the pause
        probe = asyncio.create_task(client.generate(batch[:4], {"max_tokens": 4}))
        await async_wait_until(lambda: queued(fleet, 4), 30, "the probe queued")
        submitted = await submitted_at(fleet)  # each probe request's, as its queued entry says
        await asyncio.sleep(2.0)  # time passes while paused: a fleet taking work would answer the probe meanwhile
        assert await in_flight(client) == BATCH and not run.arrived  # frozen, kept, not finished
        resume_issued, resumed_at = time.time(), time.monotonic()
        await client.resume()
        got = await run.task
        probed = await probe
    assert len(got) == BATCH
    for index, trajectory in enumerate(got):
        assert trajectory.finish_reason == "length" and trajectory.interruptions == 0
        assert len(trajectory.logprobs) == len(trajectory.completion_token_ids) == BATCH_PARAMS["max_tokens"]
        assert run.arrived[index] > resumed_at > paused_at, "a request finished while the fleet was paused"
    for trajectory in probed:  # sent during the pause: taken (submitted_at + queue_time_s) once the resume was issued
        assert submitted[trajectory.request_id] + trajectory.queue_time_s >= resume_issued


async def test_abort_pause_with_100_in_flight_returns_100_whole_trajectories(fleet):
    async with RolloutClient(fleet) as client:
        batch = await prompts(client, BATCH)
        run = Streaming(client, batch, BATCH_PARAMS)
        await async_wait_until(lambda: _all_in_flight(client), 120, "all 100 in flight")
        await run.streamed(1, 120, count=GENERATING)  # generating: the pause cuts them mid-generation
        await client.pause("abort")
        # Acknowledged once every cut request returned its partial output; their retries wait in the queue.
        assert await in_flight(client) == 0
        await client.resume()
        trajectories = await run.task
        texts = await client.detokenize([t.completion_token_ids for t in trajectories])
        assert client.stats.retries >= 1
    assert len(trajectories) == BATCH
    for prompt, trajectory, text in zip(batch, trajectories, texts, strict=True):
        assert trajectory.prompt_token_ids == prompt and trajectory.finish_reason == "length"
        assert len(trajectory.completion_token_ids) == len(trajectory.logprobs) == BATCH_PARAMS["max_tokens"]
        assert all(lp <= 0 and math.isfinite(lp) for lp in trajectory.logprobs)
        assert trajectory.text == text  # the cut and the continuation, detokenized whole
    cut = [t for t in trajectories if t.interruptions >= 1]
    assert len(cut) > BATCH // 2, f"only {len(cut)} of {BATCH} were cut by the abort"


async def test_greedy_output_through_keep_and_abort_pauses_equals_an_uninterrupted_run(fleet):
    async with RolloutClient(fleet) as client:
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "Tell me a long story."}]])
        [base] = await client.generate([prompt], ONE_PARAMS, session_ids=["story"])
        total = ONE_PARAMS["max_tokens"]
        frozen_s = max(1.0, 48 * base.generation_time_s / total)  # long enough for 48 tokens, unfrozen
        for mode in ("keep", "abort"):
            run = Streaming(client, [prompt], ONE_PARAMS, session_ids=["story"])
            await run.streamed(total // 4, 120)  # a quarter of the way in
            await client.pause(mode)
            [at_pause] = run.tokens
            assert at_pause < total and not run.arrived, f"{mode}: the request was not in flight when paused"
            if mode == "keep":
                paused_at = time.monotonic()
                await asyncio.sleep(frozen_s)  # time passes while frozen: unfrozen, it would make 48 tokens
                [before_resume] = run.tokens
                # Frozen: at most what was gathered but not yet sent when the pause landed (a chunk holds <= 16).
                assert before_resume - at_pause <= 16, (at_pause, before_resume)
                assert await in_flight(client) == 1
            else:
                assert await in_flight(client) == 0  # cut and returned; its retry waits in the queue
            resumed_at = time.monotonic()
            await client.resume()
            [t] = await run.task
            assert t.completion_token_ids == base.completion_token_ids, f"{mode}: differs from an uninterrupted run"
            assert t.logprobs == pytest.approx(base.logprobs, abs=1e-3)
            assert t.interruptions == (1 if mode == "abort" else 0)
            if mode == "keep":  # in the engine from before the pause to after the resume
                assert t.generation_time_s > resumed_at - paused_at


async def test_sleep_wake_up_and_prefix_cache_reset_on_the_real_engine(fleet):
    async with RolloutClient(fleet) as client:
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "Name three rivers."}]])
        params = {"temperature": 0.0, "max_tokens": 24}
        [base] = await client.generate([prompt], params)
        await client.sleep(level=1)
        workers = await client.workers()
        assert {w.state for w in workers} == {"sleeping"} and {w.sleep_level for w in workers} == {1}
        assert {w.memory_released for w in workers} == {False}  # vLLM on CPU frees nothing
        probe = asyncio.create_task(client.generate([prompt], params))
        await async_wait_until(lambda: queued(fleet, 1), 30, "the probe queued")
        await asyncio.sleep(1.0)  # time passes: a worker taking work while asleep would answer it meanwhile
        assert not probe.done() and await queued(fleet, 1)  # a sleeping fleet takes no requests
        await client.wake_up()
        assert {w.state for w in await client.workers()} == {"serving"}
        [after] = await probe
        await client.reset_prefix_cache()  # nothing running: vLLM resets
        long_one = asyncio.create_task(client.generate([prompt], {"max_tokens": 200, "ignore_eos": True}))
        await async_wait_until(lambda: in_flight(client), 30, "a request running")
        with pytest.raises(ControlCommandError, match="refused") as refused:  # requests hold KV blocks
            await client.reset_prefix_cache()
        assert list(refused.value.failures) == [(await long_one_worker(client))]
        await client.reset_prefix_cache(reset_running_requests=True)  # preempts and recomputes them
        assert len((await long_one)[0].completion_token_ids) == 200
        [again] = await client.generate([prompt], params)
    assert after.completion_token_ids == again.completion_token_ids == base.completion_token_ids


async def long_one_worker(client: RolloutClient) -> str:
    [busy] = [w.worker_id for w in await client.workers() if w.in_flight]
    return busy


async def _all_in_flight(client: RolloutClient) -> bool:
    return await in_flight(client) == BATCH


@pytest.mark.gpu
async def test_sleep_frees_gpu_memory(tmp_path: Path) -> None:
    """GPU path: with sleep mode on (the default on CUDA), level 1 frees the weights and the KV cache."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: vLLM sleep mode frees memory only there")
    from rollout_svc.protocol import SamplingParams
    from workers.engine import Generation
    from workers.vllm_engine import VLLMEngine

    engine = VLLMEngine(str(prepare_model(Settings().cache_dir)), dtype="float32", max_num_seqs=8)
    await engine.start()
    try:
        assert engine.memory_released
        params = SamplingParams(temperature=0.0, max_tokens=16)
        before = await engine.generate(Generation("a", [1, 2, 3, 4], params))
        free_awake = torch.cuda.mem_get_info()[0]
        await engine.sleep(1, "abort")
        assert torch.cuda.mem_get_info()[0] > free_awake + 64 * MiB
        assert await engine.wake_up(None)
        after = await engine.generate(Generation("b", [1, 2, 3, 4], params))
        assert after.completion_token_ids == before.completion_token_ids
    finally:
        await engine.close()
