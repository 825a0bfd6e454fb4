"""The control plane against a real redis-server and real worker processes (echo engine: queue behaviour).

The echo engine generates one token per `--echo-token-delay-s` and implements vLLM's three pause modes, so
a generation in flight can be frozen, cut and continued here without a model. Its completion is the prompt
itself (cut at max_tokens), so a merged retry is checked token for token against the prompt.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from rollout_svc import ControlTimeoutError, RolloutClient
from rollout_svc.dataplane.reaper import Reaper
from rollout_svc.keys import PAYLOAD_FIELD, WORKERS_GROUP
from rollout_svc.protocol import RolloutRequest, encode
from tests.support import ROOT, Results, Streaming, async_wait_until, pending, queued, wait_until

T = 30  # max_tokens: 30 tokens x 50 ms = 1.5 s per generation
DELAY = ["--echo-token-delay-s", "0.05"]
PARAMS = {"max_tokens": T}
# Generations an abort is meant to cut: 200 tokens (10 s). With T's 1.5 s, a CI machine that left a process waiting
# 3-4 s for a core let some finish before the abort.
LONG = 200


def prompts(count: int, salt: int = 0, length: int = T + 10) -> list[list[int]]:
    """Distinct prompts; the echo completion of each is its first T tokens."""
    return [[(7 * (salt + i) + j) % 250 + 1 for j in range(length)] for i in range(count)]


def whole(trajectory, prompt) -> bool:
    """Complete and uncut: the echo of its prompt, a logprob per token."""
    return (
        trajectory.finish_reason in ("stop", "length")
        and trajectory.completion_token_ids == prompt[:T]
        and len(trajectory.logprobs) == len(trajectory.completion_token_ids)
    )


async def in_flight(client: RolloutClient) -> int:
    return sum(w.in_flight for w in await client.workers())


def nothing_in_flight(client: RolloutClient) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await in_flight(client) == 0

    return check


def cli(settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROLLOUT_KEY_PREFIX": settings.key_prefix, "ROLLOUT_HEARTBEAT_TTL_S": "2"}
    command = [sys.executable, "-m", "rollout_svc", *args, "--redis-url", settings.redis_url]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)


async def test_keep_pause_freezes_in_flight_requests_and_resume_continues_them(settings, echo_workers, rds):
    echo_workers(2, "--max-num-seqs", "16", *DELAY)
    batch = prompts(20)
    async with RolloutClient(settings) as client:
        task = asyncio.create_task(client.generate(batch, PARAMS))
        await async_wait_until(lambda: pending(rds, settings.keys.requests) == 20, 5, "20 requests in flight")
        await client.pause("keep")
        paused_at = time.monotonic()
        assert await client.is_paused() is True
        assert await client.is_paused(per_worker=True) == {"echo-0": True, "echo-1": True}
        assert {w.state for w in await client.workers()} == {"paused"}
        probe = asyncio.create_task(client.generate(prompts(4, salt=50), {"max_tokens": 2}))
        await asyncio.sleep(T * 0.05)  # longer than a whole generation: frozen ones do not finish meanwhile
        assert not task.done() and not probe.done()
        assert queued(rds, settings.keys.requests) == 4  # the probe waits in the queue: nothing new started
        await client.resume()
        resumed_at = time.monotonic()
        trajectories = await task
        assert all(t.finish_reason == "length" for t in await probe)
    assert all(whole(t, p) for t, p in zip(trajectories, batch, strict=True))
    assert {t.interruptions for t in trajectories} == {0} and client.stats.retries == 0
    frozen_s = resumed_at - paused_at
    assert min(t.generation_time_s for t in trajectories) > frozen_s  # each stood still through the pause


async def test_abort_pause_cuts_in_flight_requests_which_come_back_whole(settings, echo_workers, rds):
    # 100 ms a token (3 s a generation): on a loaded CI machine the pause must land before the first one finishes.
    echo_workers(2, "--max-num-seqs", "16", "--echo-token-delay-s", "0.1")
    batch = prompts(20, salt=1)
    async with RolloutClient(settings) as client:
        run = Streaming(client, batch, PARAMS)
        streamed = await run.streamed(2, 5)  # each one generating: the pause cuts it mid-generation
        await client.pause("abort")
        assert not run.arrived, f"{len(run.arrived)} requests finished before the pause landed: too slow a machine"
        # Acknowledged once every cut request returned its partial output: nothing runs, nothing is taken.
        assert await in_flight(client) == 0
        assert pending(rds, settings.keys.requests) == 0
        # Their retries wait in the queue, without polling: they flow on resume.
        await async_wait_until(lambda: queued(rds, settings.keys.requests) == 20, 5, "20 retries queued")
        await client.resume()
        trajectories = await run.task
        assert client.stats.retries == 20
    assert all(2 <= n < T for n in streamed)
    assert all(whole(t, p) for t, p in zip(trajectories, batch, strict=True))  # the cut, then the continuation
    assert all(t.interruptions == 1 and t.abort_cause is None for t in trajectories)
    assert len({t.request_id for t in trajectories}) == 20  # under the ids the caller submitted


@pytest.mark.heartbeat_ttl(5)
async def test_a_retry_taken_as_an_abort_pause_lands_goes_back_to_the_queue_not_cut_twice(settings, workers, rds):
    # Found in CI (26 retries for 20 cuts): the pause cut echo-0's requests, their retries were enqueued at once, and
    # echo-1's read delivered some of them before echo-1 applied the pause, which then cut them with nothing made: a
    # second interruption each. Stopping echo-1 with a long blocking read open at Redis makes that order certain.
    slow = {"ROLLOUT_READ_BLOCK_MS": "5000"}
    workers.start_ready(
        ["echo-0", "echo-1"], "--engine", "echo", "--max-num-seqs", "16", "--echo-token-delay-s", "0.1", env=slow
    )
    batch = prompts(20, salt=3)
    stream = settings.keys.requests

    def pending_on(worker_id: str) -> int:
        consumers = rds.xpending(stream, WORKERS_GROUP)["consumers"]
        return sum(c["pending"] for c in consumers if c["name"] in (worker_id, worker_id.encode()))

    async with RolloutClient(settings) as client:
        run = Streaming(client, batch, PARAMS)
        await run.streamed(2, 5)
        held = pending_on("echo-1")
        assert 0 < held < 20, "both workers run some of the batch"
        workers.kill("echo-1", signal.SIGSTOP)
        try:
            pause = asyncio.create_task(client.pause("abort"))
            # echo-0's requests come back cut and are retried; echo-1's open read takes the first retries
            await async_wait_until(lambda: pending_on("echo-1") > held, 10, "echo-1's open read to take a retry")
        finally:
            workers.kill("echo-1", signal.SIGCONT)
        await pause
        assert await in_flight(client) == 0 and pending(rds, stream) == 0
        await async_wait_until(lambda: queued(rds, stream) == 20, 5, "20 requests queued")  # the taken retries too
        await client.resume()
        trajectories = await run.task
        assert client.stats.retries == 20  # one a request: a retry taken as the pause landed went back unanswered
    assert all(whole(t, p) for t, p in zip(trajectories, batch, strict=True))
    assert all(t.interruptions == 1 for t in trajectories)


async def test_wait_pause_returns_once_in_flight_requests_finished(settings, echo_workers, rds):
    echo_workers(2, "--max-num-seqs", "16", *DELAY)
    batch = prompts(20, salt=2)
    async with RolloutClient(settings) as client:
        task = asyncio.create_task(client.generate(batch, PARAMS))
        await async_wait_until(lambda: pending(rds, settings.keys.requests) == 20, 5, "20 requests in flight")
        started = time.monotonic()
        await client.pause("wait")
        took = time.monotonic() - started
        assert pending(rds, settings.keys.requests) == 0  # every one answered before the ack
        trajectories = await asyncio.wait_for(task, 1.0)
        assert took > 0.5
        probe = asyncio.create_task(client.generate(prompts(2, salt=60), {"max_tokens": 2}))
        await async_wait_until(lambda: queued(rds, settings.keys.requests) == 2, 5, "the probe queued")
        await asyncio.sleep(0.5)  # time passes: a worker taking work while paused would answer it (0.1 s) meanwhile
        assert not probe.done() and queued(rds, settings.keys.requests) == 2  # paused after the wait: nothing runs
        await client.resume()
        await probe
    assert all(whole(t, p) and t.interruptions == 0 for t, p in zip(trajectories, batch, strict=True))


async def test_a_worker_started_while_paused_stays_paused(settings, echo_workers, rds):
    echo_workers(1)
    async with RolloutClient(settings) as client:
        epoch = await client.pause("keep")
        echo_workers(1)  # echo-1 starts into a paused fleet

        async def newcomer_paused() -> bool:  # live first ("starting"), then it applies the fleet's state
            [newcomer] = [w for w in await client.workers() if w.worker_id == "echo-1"]
            assert newcomer.state in ("starting", "paused"), newcomer  # never serving on the way
            return newcomer.state == "paused" and newcomer.applied_epoch == epoch

        await async_wait_until(newcomer_paused, 10, "the newcomer paused at the fleet's epoch")
        task = asyncio.create_task(client.generate(prompts(10), {"max_tokens": 4}))
        await async_wait_until(lambda: queued(rds, settings.keys.requests) == 10, 5, "10 requests queued")
        await asyncio.sleep(0.5)  # time passes: a worker taking work while paused would answer them meanwhile
        assert queued(rds, settings.keys.requests) == 10 and not task.done()
        await client.resume()
        assert len(await task) == 10


async def test_workers_converge_without_nudges_within_a_heartbeat(settings, echo_workers, rds):
    echo_workers(2)
    async with RolloutClient(settings) as client:
        # Nudges lost: the subscribers' connections are killed, then the state is written without any nudge.
        wait_until(lambda: len(rds.client_list(_type="pubsub")) == 2, 5, "both workers to subscribe")
        assert rds.execute_command("CLIENT", "KILL", "TYPE", "pubsub") == 2
        epoch = rds.hincrby(settings.keys.state, "epoch", 1)
        rds.hset(settings.keys.state, "pause:operator", "keep")
        started = time.monotonic()

        async def converged() -> bool:
            return all(w.applied_epoch == epoch and w.state == "paused" for w in await client.workers())

        await async_wait_until(converged, 5, "both workers to converge")
        assert time.monotonic() - started < settings.worker.heartbeat_interval_s + 0.5
        # A command after the kill is acknowledged promptly: the subscriptions came back.
        started = time.monotonic()
        await client.resume()
        assert time.monotonic() - started < settings.worker.heartbeat_interval_s + 0.5


async def test_a_stalled_worker_is_named_then_reaped_then_fenced_and_comes_back(settings, workers, echo_workers, rds):
    echo_workers(2, "--max-num-seqs", "8", *DELAY)
    batch = prompts(24, salt=3)
    async with RolloutClient(settings) as client:
        task = asyncio.create_task(client.generate(batch, PARAMS))
        await async_wait_until(lambda: pending(rds, settings.keys.requests) == 16, 5, "16 requests in flight")
        # Its id now: a CI host loaded at its start once stalled it past the 2 s TTL already (`echo-0~1`).
        [stalled] = [w.worker_id for w in await client.workers() if w.worker_id.split("~")[0] == "echo-0"]
        base, _, incarnation = stalled.partition("~")
        after = f"{base}~{int(incarnation or 0) + 1}"  # the incarnation it comes back as
        workers.kill("echo-0", signal.SIGSTOP)  # stalled, not dead: its heartbeat stops
        try:
            with pytest.raises(ControlTimeoutError, match="echo-0") as info:
                await client.pause("keep", timeout_s=0.5)  # shorter than the heartbeat TTL
            assert info.value.workers == [stalled]
            await async_wait_until(lambda: not rds.sismember(settings.keys.workers, stalled), 10, "echo-0 reaped")
            await client.pause("keep")  # the retry converges: echo-0 was dropped, echo-1 acks
            await client.resume()
        finally:
            workers.kill("echo-0", signal.SIGCONT)

        async def back() -> bool:
            statuses = {w.worker_id: w for w in await client.workers()}
            return after in statuses and statuses[after].state == "serving"

        await async_wait_until(back, 10, "echo-0 to come back as a new incarnation")
        trajectories = await task
        statuses = {w.worker_id: w for w in await client.workers()}
        [other] = [w for w in statuses.values() if w.worker_id.split("~")[0] == "echo-1"]
        assert statuses[after].applied_epoch == other.applied_epoch
        assert statuses[after].fenced_results > 0  # its answers to requeued requests were dropped
        assert client.stats.duplicates == 0  # and none reached the caller
    assert all(whole(t, p) for t, p in zip(trajectories, batch, strict=True))
    assert "outlived its heartbeat TTL" in workers.log("echo-0")


async def test_a_request_requeued_while_its_worker_runs_it_is_answered_by_its_second_delivery(
    settings, echo_workers, rds
):
    # A worker reaped while it lived (a stall past the TTL) may take the requeued copy of a request it still runs.
    # That copy was acked unanswered ("the copy in flight answers"), and the copy in flight's answer was fenced: the
    # request was lost (a chaos run in CI, 2026-11-29: a batch request and a step's, both in flight on a stalled w2).
    [worker_id] = echo_workers(1, *DELAY)
    [prompt] = prompts(1, salt=11)
    async with RolloutClient(settings) as client:
        task = asyncio.create_task(client.generate([prompt], PARAMS, timeout_s=20))
        await async_wait_until(lambda: pending(rds, settings.keys.requests) == 1, 5, "the request taken")
        redis = Redis.from_url(settings.redis_url)
        try:  # as a reaper does to a worker presumed dead (once: this one lives, and takes the copy)
            reaper = Reaper(redis, settings)
            assert await reaper.requeue(await reaper.streams.pending_of(settings.keys.requests, worker_id)) == 1
        finally:
            await redis.aclose()
        [t] = await task

        async def fenced() -> bool:
            return [w.fenced_results for w in await client.workers()] == [1]  # the running copy's answer

        await async_wait_until(fenced, 5, "the running copy's answer to be fenced")
        assert client.stats.duplicates == 0  # answered once: by the copy
    assert whole(t, prompt)
    assert pending(rds, settings.keys.requests) == 0 and rds.xlen(settings.keys.requests) == 0


async def test_a_retried_request_keeps_each_tokens_text_and_top_logprobs(settings, echo_workers, rds):
    echo_workers(1, *DELAY)
    [prompt] = prompts(1, salt=9)
    async with RolloutClient(settings) as client:
        run = Streaming(client, [prompt], {**PARAMS, "logprobs": 1})
        [streamed] = await run.streamed(2, 5)  # cut after a few tokens: some before the cut, the rest after
        await client.pause("abort")
        await client.resume()
        [t] = await run.task
    assert 2 <= streamed < T and t.interruptions == 1 and whole(t, prompt)
    # The echo's vocabulary is bytes: each token's text is its byte, before the cut and after it.
    assert t.tokens == [bytes([i]).decode() for i in t.completion_token_ids]
    assert t.top_logprobs == [[(i, bytes([i]).decode(), 0.0)] for i in t.completion_token_ids]


async def test_abort_session_hits_that_session_only_queued_and_in_flight(settings, echo_workers, rds):
    echo_workers(2, "--max-num-seqs", "8", *DELAY)
    a, b = prompts(12, salt=4, length=LONG), prompts(4, salt=5)
    async with RolloutClient(settings) as client:
        # s-a: 8 run on one worker, 4 queue in its pinned stream; s-b runs on the other.
        run_a = Streaming(client, a, {"max_tokens": LONG}, session_ids=["s-a"] * 12)
        task_b = asyncio.create_task(client.generate(b, PARAMS, session_ids=["s-b"] * 4))
        await run_a.streamed(1, 5, count=8)  # 8 generating (some tokens made), 4 queued behind them
        await async_wait_until(lambda: len(rds.keys(settings.keys.session("s-*"))) == 2, 5, "both sessions placed")
        assert await client.session_worker("s-a") != await client.session_worker("s-b")
        await client.abort(session_id="s-a")
        hit, spared = await run_a.task, await task_b
        later = await client.generate(a[:1], {"max_tokens": 2}, session_ids=["s-a"])  # after the abort: runs
    assert all(t.finish_reason == "abort" and t.abort_cause == "user" for t in hit)
    assert all(len(t.completion_token_ids) < LONG and t.interruptions == 0 for t in hit)  # not retried
    assert sum(bool(t.completion_token_ids) for t in hit) == 8  # the in-flight ones: partial
    assert sum(not t.completion_token_ids for t in hit) == 4  # the queued ones: answered unrun
    assert all(whole(t, p) for t, p in zip(spared, b, strict=True))
    assert later[0].finish_reason == "length"


async def test_abort_all_empties_the_queue_and_answers_every_caller(settings, echo_workers, rds):
    echo_workers(2, "--max-num-seqs", "16", *DELAY)
    async with RolloutClient(settings) as client:
        task = asyncio.create_task(client.generate(prompts(100, salt=6, length=LONG), {"max_tokens": LONG}))
        await async_wait_until(lambda: pending(rds, settings.keys.requests) == 32, 5, "32 in flight, 68 queued")
        await client.abort(all=True)
        assert queued(rds, settings.keys.requests) == 0  # swept before the abort returned
        trajectories = await asyncio.wait_for(task, 5)
        await async_wait_until(nothing_in_flight(client), 2, "nothing in flight by the next heartbeat")
        assert all(t.finish_reason == "abort" and t.abort_cause == "user" for t in trajectories)
        [after] = await client.generate(prompts(1, salt=7), {"max_tokens": 3})  # enqueued after: runs
        assert after.finish_reason == "length"


async def test_abort_by_request_id_answers_a_queued_request_unrun(settings, echo_workers, rds):
    async with RolloutClient(settings) as client:
        replies = Results(rds, settings.keys.results("test-producer"))
        request = RolloutRequest(request_id="r-1", prompt_token_ids=[1, 2, 3], reply_to=replies.stream)
        rds.xadd(settings.keys.requests, {PAYLOAD_FIELD: encode(request)})
        await client.abort(["r-1"])  # no worker yet: nothing acknowledges, and it returns at once
        echo_workers(1)
        [answer] = replies.read(1)
    assert answer.finish_reason == "abort" and answer.abort_cause == "user" and answer.completion_token_ids == []


async def test_cancelling_a_generate_leaves_nothing_running_or_queued(settings, echo_workers, rds):
    echo_workers(2, "--max-num-seqs", "32", "--echo-token-delay-s", "0.08")
    async with RolloutClient(settings) as client:
        task = asyncio.create_task(client.generate(prompts(200, salt=8), {"max_tokens": 100}))
        await async_wait_until(lambda: pending(rds, settings.keys.requests) == 64, 5, "64 in flight")
        task.cancel()

        async def idle() -> bool:
            return await in_flight(client) == 0 and rds.xlen(settings.keys.requests) == 0

        await async_wait_until(idle, 5, "nothing running or queued")
        assert client.stats.cancelled == 200


async def test_as_completed_yields_short_generations_first_and_leaving_early_cancels(settings, echo_workers, rds):
    echo_workers(2, "--max-num-seqs", "16", *DELAY)
    mixed = [[98] * (3 if i % 2 else T) for i in range(10)]
    async with RolloutClient(settings) as client:
        order = [i async for i, t in client.as_completed(mixed, PARAMS)]
        assert set(order[:5]) == {1, 3, 5, 7, 9} and sorted(order) == list(range(10))
        iterator = client.as_completed(mixed, PARAMS)
        async for index, trajectory in iterator:
            assert index % 2 == 1 and trajectory.completion_token_ids == [98] * 3
            break
        await iterator.aclose()

        async def idle() -> bool:
            return await in_flight(client) == 0 and rds.xlen(settings.keys.requests) == 0

        await async_wait_until(idle, 5, "the unread requests to be cancelled")
        assert 5 <= client.stats.cancelled <= 9  # the long ones at least; short ones may have finished


async def test_deadline_runs_through_a_pause_and_a_retry_returns_its_partial_tokens(settings, echo_workers, rds):
    echo_workers(1, *DELAY)
    batch = prompts(4, salt=9)
    async with RolloutClient(settings) as client:
        run = Streaming(client, batch, PARAMS, timeout_s=1.5)
        await run.streamed(2, 1.0)  # each generating, well before its deadline
        await client.pause("abort")  # cut; their retries wait in the queue past the deadline
        trajectories = await run.task
        await client.resume()
    for t, p in zip(trajectories, batch, strict=True):
        assert t.finish_reason == "abort" and t.abort_cause == "deadline" and t.interruptions == 1
        assert 0 < len(t.completion_token_ids) < T and t.completion_token_ids == p[: len(t.completion_token_ids)]


async def test_sleep_and_wake_up_restore_the_pause_state_from_before(settings, echo_workers, rds):
    echo_workers(2)
    async with RolloutClient(settings) as client:
        await client.pause("keep")
        await client.sleep(level=1)
        workers = await client.workers()
        assert {w.state for w in workers} == {"sleeping"}
        assert {w.memory_released for w in workers} == {False}  # the echo engine, like vLLM on CPU, frees nothing
        assert await client.tokenize(["still served"]) == [list(b"still served")]
        await client.wake_up(["weights"])  # partial: still asleep
        assert {w.state for w in await client.workers()} == {"sleeping"}
        await client.wake_up()
        assert {w.state for w in await client.workers()} == {"paused"}  # as before the sleep
        await client.resume()
        await client.reset_prefix_cache()
        [t] = await client.generate([[1, 2]], {"max_tokens": 2})
        assert t.finish_reason == "stop"


async def test_the_control_state_survives_a_redis_that_forgets_it(settings, echo_workers, rds):
    echo_workers(2)
    async with RolloutClient(settings) as client:
        epoch = await client.pause("keep")
        rds.delete(settings.keys.state, settings.keys.commands)  # the state is lost, not the workers
        await async_wait_until(lambda: rds.exists(settings.keys.state), 5, "a worker to write the state back")
        state = await client.fleet_state()
        assert state.paused and state.pause_mode == "keep" and state.epoch == epoch
        assert await client.resume() == epoch + 1


async def test_a_leased_pause_lapses_once_its_holder_stops_renewing_and_says_so(settings, echo_workers, rds):
    """A leased pause is renewed while its client lives; once the client is gone (closed here; a trainer killed with
    -9 in the weight-sync tests) it lapses within its lease plus a heartbeat, nobody resuming it, and the state and
    `rollout-svc status` say whose pause lapsed. A timed pause (`renew=False`) lapses after its lease alone."""
    echo_workers(2)
    lease_s = 1.0
    holder = RolloutClient(settings)
    async with RolloutClient(settings) as client:
        await holder.pause("keep", holder="trainer", lease_s=lease_s)
        await asyncio.sleep(3 * lease_s)  # renewed meanwhile
        state = await client.fleet_state()
        assert state.holders == {"trainer": "keep"} and set(state.leases) == {"trainer"}
        assert {w.state for w in await client.workers()} == {"paused"}
        probe = asyncio.create_task(client.generate(prompts(2), {"max_tokens": 2}))
        await asyncio.sleep(0.5)
        assert not probe.done()
        await holder.close()  # renewals stop; nobody resumes
        bound_s = lease_s + settings.worker.heartbeat_interval_s + 1.0
        await async_wait_until(lambda: _serving(client), bound_s, "every worker serving once the lease lapsed")
        assert all(t.finish_reason == "length" for t in await asyncio.wait_for(probe, 5))
        state = await client.fleet_state()
        assert not state.paused and set(state.lapsed) == {"trainer"} and not state.leases
        status = cli(settings, "status")
        assert status.returncode == 0 and "the pause of trainer lapsed" in status.stdout, status.stdout
        await client.pause("abort", holder="timed", lease_s=lease_s, renew=False)
        assert (await client.fleet_state()).holders == {"timed": "abort"}
        await async_wait_until(lambda: _serving(client), lease_s + 2.0, "the timed pause to lapse")
        epoch = await client.resume(holder="timed")  # harmless after the lapse
        assert (await client.fleet_state()).epoch == epoch and not (await client.fleet_state()).paused


async def _serving(client: RolloutClient) -> bool:
    return not (await client.fleet_state()).paused and {w.state for w in await client.workers()} == {"serving"}


# A stopped worker must stay live through the CLI's start (seconds of imports on a busy machine), not die at 2 s
# and leave every *live* worker acknowledging. Ten CLI processes, each a second or more of imports when the other
# xdist worker runs vLLM: 30 s is too tight.
@pytest.mark.heartbeat_ttl(30.0)
@pytest.mark.timeout(120)
def test_cli_control_commands_and_status(settings, echo_workers, workers):
    echo_workers(2)
    paused = cli(settings, "pause", "--mode", "wait", "--timeout-s", "10")
    assert paused.returncode == 0, paused.stderr
    report = json.loads(cli(settings, "status", "--json").stdout)
    assert report["paused"] is True and report["pause_mode"] == "wait" and report["epoch"] >= 1
    assert {w["state"] for w in report["workers"]} == {"paused"}
    assert all(w["applied_epoch"] == report["epoch"] and w["weight_version"] == 0 for w in report["workers"])
    assert report["loads"] == {"echo-0": 0, "echo-1": 0}  # the tokens of work each holds (placement's load)
    # what each engine holds: 1,024 sequences (echo's default) of 2,048 tokens
    assert {(w["max_num_seqs"], w["max_model_len"], w["kv_cache_tokens"]) for w in report["workers"]} == {
        (1024, 2048, 1024 * 2048)
    }
    workers.kill("echo-1", signal.SIGSTOP)
    try:
        stalled = cli(settings, "resume", "--timeout-s", "0.5")
    finally:
        workers.kill("echo-1", signal.SIGCONT)
    assert stalled.returncode == 1 and "echo-1" in stalled.stderr and "retry" in stalled.stderr
    assert cli(settings, "resume").returncode == 0  # the retry converges
    for args in (["abort", "--all"], ["sleep", "--level", "1"], ["wake-up"], ["reset-prefix-cache"]):
        done = cli(settings, *args, "--timeout-s", "10")
        assert done.returncode == 0 and "acknowledged by every live worker" in done.stdout, (args, done.stderr)
    refused = cli(settings, "abort")
    assert refused.returncode == 2 and "exactly one of" in refused.stderr
    assert json.loads(cli(settings, "status", "--json").stdout)["paused"] is False
