"""The data plane against a real redis-server and real worker processes (echo engine: these are queue tests)."""

from __future__ import annotations

import asyncio
import math
import pickle
import threading
import time
from collections import Counter

import msgpack
import pytest
import redis
from redis.asyncio import Redis

from rollout_svc import InvalidRequestError, QueueFullError, RequestTimeoutError, RolloutClient, SyncRolloutClient
from rollout_svc.config import Settings
from rollout_svc.dataplane.producer_streams import ProducerStreams
from rollout_svc.dataplane.recovery_streams import RecoveryStreams
from rollout_svc.dataplane.streams import Enqueue, StreamConnection
from rollout_svc.keys import COST_FIELD, PAYLOAD_FIELD, WORKERS_GROUP
from rollout_svc.protocol import RolloutRequest, SamplingParams, Trajectory, decode, encode
from tests.support import Results, Streaming, async_wait_until, pending


async def test_batch_comes_back_in_input_order_across_two_workers(settings, echo_workers):
    # Small capacity and a per-token delay, so neither worker can swallow the whole batch: ~2 s of work, so a
    # worker descheduled for a moment on a loaded CI machine still serves (CI saw all of it on echo-1 twice: once at
    # 0.1 s of work, once at 0.4 s, echo-0 not yet past logging that it served while a vLLM fixture started).
    echo_workers(2, "--max-num-seqs", "16", "--echo-token-delay-s", "0.05")
    prompts = [[i + 1, (i * 7) % 250 + 1, 3] for i in range(200)]
    async with RolloutClient(settings) as client:  # the fixture returns once both serve (left `starting`)
        trajectories = await client.generate(prompts, {"max_tokens": 8})
    assert [t.prompt_token_ids for t in trajectories] == prompts
    assert [t.completion_token_ids for t in trajectories] == prompts  # echo: the completion is the prompt
    assert len({t.request_id for t in trajectories}) == 200
    served = Counter(t.worker_id for t in trajectories)
    assert set(served) == {"echo-0", "echo-1"}, served
    assert all(t.finish_reason == "stop" and t.logprobs == [0.0] * 3 for t in trajectories)


@pytest.mark.heartbeat_ttl(30.0)  # a 2 s stall of this shared machine expired both heartbeats mid-call (CI saw it)
async def test_many_concurrent_first_calls_of_a_client_all_see_the_fleet(settings, echo_workers):
    """500 first calls of a fresh client at once (a server's first requests, SkyRL's gathered generates) all wait
    for the one connection start, then for a free connection: none sees a fleet whose shards are not discovered
    yet, or a shard left out because redis-py's pool refused its 101st connection (no worker: a 503)."""
    echo_workers(2)
    client = RolloutClient(settings)
    try:
        seen = await asyncio.gather(*(client.workers() for _ in range(500)))
        assert [[w.worker_id for w in workers] for workers in seen] == [["echo-0", "echo-1"]] * 500
    finally:
        await client.close()


async def test_sessions_are_sticky_and_balanced(settings, echo_workers):
    worker_ids = echo_workers(3)
    sessions = [f"session-{i}" for i in range(10)]
    async with RolloutClient(settings) as client:
        served_by: dict[str, set[str]] = {s: set() for s in sessions}
        for turn in range(3):
            trajectories = await client.generate([[turn + 1, 2]] * len(sessions), {"max_tokens": 4}, sessions)
            for session_id, t in zip(sessions, trajectories, strict=True):
                assert t.session_id == session_id
                served_by[session_id].add(t.worker_id)
    assert all(len(ws) == 1 for ws in served_by.values()), served_by
    per_worker = Counter(next(iter(ws)) for ws in served_by.values())
    assert max(per_worker.values()) <= math.ceil(len(sessions) / len(worker_ids)) + 1, per_worker


async def test_finish_session_lets_it_be_placed_anew(settings, echo_workers):
    echo_workers(2)
    async with RolloutClient(settings) as client:

        async def turn(session_id: str) -> str:
            [t] = await client.generate([[1, 2]], {"max_tokens": 2}, [session_id])
            return t.worker_id

        first = await turn("s")
        other = await turn("b")  # least loaded: the other worker
        assert other != first
        third = await turn("c")  # a tie: lowest id
        assert await client.finish_session("s") is True
        assert await client.session_worker("s") is None
        # Fill the worker "s" left so that the least-loaded worker is now the other one.
        fillers = [await turn("fill")]
        load = Counter([other, third, *fillers])
        again = await turn("s")
        assert again == min(load, key=lambda w: (load[w], w)), (first, load, again)
        assert again != first
        assert await client.session_worker("s") == again


@pytest.mark.timeout(90)  # ~14 s alone; CI's loaded machine took it past the default 30 s
async def test_kill_9_a_worker_mid_batch_loses_nothing_and_duplicates_nothing(settings, workers, echo_workers):
    echo_workers(2, "--max-num-seqs", "32", "--echo-token-delay-s", "0.1")
    prompts = [[i + 1] * 20 for i in range(200)]  # 20 tokens x 100 ms: 2 s each, 32 at a time per worker
    rds = redis.Redis.from_url(settings.redis_url)

    def answered(worker_id: str) -> int:  # what its last heartbeat (every second) says it answered
        return int(rds.hget(settings.keys.worker(worker_id), "served") or 0)

    def busy() -> set[str]:
        return {c["name"].decode() for c in rds.xinfo_consumers(settings.keys.requests, WORKERS_GROUP) if c["pending"]}

    async with RolloutClient(settings) as client:
        task = asyncio.create_task(client.generate(prompts, {"max_tokens": 20}, timeout_s=60))
        # Each worker has answered requests of the batch and is busy with more. Asked of each worker: on a slow host
        # one worker once took its first requests late, and a wait on the stream's totals let the other's answers
        # stand for both (echo-0 answered nothing before its kill).
        await async_wait_until(lambda: answered("echo-0") > 0 and answered("echo-1") > 0, 30, "both workers answered")
        await async_wait_until(lambda: busy() == {"echo-0", "echo-1"}, 10, "both workers busy")
        workers.kill("echo-0")  # SIGKILL: no drain, no deregistration
        trajectories = await task
    assert [t.prompt_token_ids for t in trajectories] == prompts
    assert [t.completion_token_ids for t in trajectories] == prompts  # whole, each once
    assert all(t.finish_reason == "stop" for t in trajectories)
    assert len({t.request_id for t in trajectories}) == 200
    served = Counter(t.worker_id for t in trajectories)
    assert served["echo-1"] > 100 and served["echo-0"] > 0, served  # echo-1 took over echo-0's requests
    assert rds.xlen(settings.keys.requests) == 0
    assert rds.xlen(settings.keys.dead) == 0
    assert not rds.sismember(settings.keys.workers, "echo-0")  # reaped


async def test_a_live_worker_keeps_its_long_generation(settings, echo_workers, rds):
    # 40 tokens x 0.1 s = 4 s: twice the heartbeat TTL. Only dead workers' requests are reclaimed.
    echo_workers(2, "--echo-token-delay-s", "0.1")
    async with RolloutClient(settings) as client:
        task = asyncio.create_task(client.generate([[7] * 40], {"max_tokens": 40}))
        await async_wait_until(lambda: pending(rds, settings.keys.requests) == 1, 5, "the request to be taken")
        await asyncio.sleep(settings.heartbeat_ttl_s * 1.5)  # well past the TTL: a dead worker would be reaped
        taken = rds.xpending_range(settings.keys.requests, WORKERS_GROUP, "-", "+", 10)
        assert len(taken) == 1 and taken[0]["times_delivered"] == 1
        [trajectory] = await task
        assert trajectory.worker_id == taken[0]["consumer"].decode()
        assert trajectory.generation_time_s >= 3.9
        served = await served_since(client, time.time())
    assert sorted(served.values()) == [0, 1], served  # generated once, by one worker


async def served_since(client: RolloutClient, since: float, timeout_s: float = 5) -> dict[str, int]:
    """Per-worker `served` from heartbeats written after `since` (unix s), so they count every generation answered
    before then (a worker counts a generation before it publishes its answer; heartbeats lag by an interval)."""

    async def fresh() -> dict[str, int] | None:
        statuses = await client.workers()
        if statuses and all(w.heartbeat_at > since for w in statuses):
            return {w.worker_id: w.served for w in statuses}
        return None

    return await async_wait_until(fresh, timeout_s, "a heartbeat of every worker written after the last answer")


async def test_undecodable_entry_goes_to_dead_letters_and_worker_keeps_serving(settings, echo_workers, rds):
    echo_workers(1)
    keys = settings.keys
    rds.xadd(keys.requests, {PAYLOAD_FIELD: b"\xc1 not msgpack"})
    rds.xadd(keys.requests, {b"other": b"no payload field"})
    # A request from another schema version: dead-lettered, and its producer is told.
    replies = Results(rds, keys.results("test-producer"))
    stale = {"v": 999, "t": "RolloutRequest", "b": {"request_id": "old-1", "reply_to": replies.stream}}
    rds.xadd(keys.requests, {PAYLOAD_FIELD: msgpack.packb(stale)})
    [error] = replies.read(1)
    assert error.request_id == "old-1" and error.code == "undecodable" and "schema version" in error.message
    async with RolloutClient(settings) as client:
        [trajectory] = await client.generate([[1, 2, 3]], {"max_tokens": 3})
    assert trajectory.completion_token_ids == [1, 2, 3]
    dead = rds.xrange(keys.dead)
    assert len(dead) == 3
    assert {fields[b"reason"] for _, fields in dead} == {b"undecodable"}
    assert b"\xc1 not msgpack" in {fields[b"payload"] for _, fields in dead}  # each served concurrently: any order
    assert rds.xlen(keys.requests) == 0


async def test_prompt_longer_than_context_fails_alone(settings, echo_workers):
    echo_workers(1, "--max-model-len", "2048")
    async with RolloutClient(settings) as client:
        trajectories = await client.generate([[1, 2], [5] * 3000, [3, 4]], {"max_tokens": 4})
    assert [t.finish_reason for t in trajectories] == ["stop", "error", "stop"]
    assert trajectories[1].error_code == "invalid_request"
    assert "3000 tokens" in trajectories[1].error
    assert trajectories[2].completion_token_ids == [3, 4]


@pytest.mark.parametrize(
    "params",
    [{"temperature": -1.0}, {"top_p": 0.0}, {"max_tokens": 0}, {"n": 4}, {"min_tokens": 9, "max_tokens": 4}],
)
async def test_invalid_sampling_params_are_refused_before_sending(settings, rds, params):
    async with RolloutClient(settings) as client:
        with pytest.raises(InvalidRequestError, match="sampling params"):
            await client.generate([[1, 2, 3]], params)
    assert rds.xlen(settings.keys.requests) == 0


async def test_bad_prompts_are_refused_before_sending(settings, rds):
    async with RolloutClient(settings) as client:
        for prompts in ([[]], [[1, -2]], [["a"]]):
            with pytest.raises(InvalidRequestError, match="request 0 is invalid"):
                await client.generate(prompts)
        with pytest.raises(InvalidRequestError, match="session_ids has 1 entries for 2 prompts"):
            await client.generate([[1], [2]], session_ids=["s"])
    assert rds.xlen(settings.keys.requests) == 0


async def test_a_timed_out_request_is_cancelled_and_one_past_its_deadline_is_not_generated(settings, echo_workers, rds):
    async with RolloutClient(settings) as client:
        with pytest.raises(RequestTimeoutError, match="rollout-svc status") as info:
            await client.generate([[1, 2, 3]], timeout_s=0.3)  # no worker yet
        assert len(info.value.request_ids) == 1 and info.value.completed == {}
        await async_wait_until(lambda: rds.xlen(settings.keys.requests) == 0, 5, "the late request to be swept")
        # A request whose deadline passed while it was queued (sent by hand: the client would have cancelled it).
        replies = Results(rds, settings.keys.results("test-producer"))
        late = RolloutRequest(request_id="late", prompt_token_ids=[1, 2], reply_to=replies.stream, deadline=time.time())
        rds.xadd(settings.keys.requests, {PAYLOAD_FIELD: encode(late)})
        echo_workers(1)
        [answer] = replies.read(1)
        assert answer.finish_reason == "abort" and answer.abort_cause == "deadline"
        assert answer.completion_token_ids == []
        [trajectory] = await client.generate([[4]])  # a request that is generated, answered after the late one
        served = await served_since(client, time.time())
    assert served == {trajectory.worker_id: 1}  # the late one was never generated


async def test_entry_over_max_deliveries_becomes_dead_letter_with_error_result(settings, echo_workers, rds):
    echo_workers(1)
    replies = Results(rds, settings.keys.results("test-producer"))
    request = RolloutRequest(request_id="poison", prompt_token_ids=[1], reply_to=replies.stream)
    redis_async = Redis.from_url(settings.redis_url)
    try:
        recovery = RecoveryStreams(StreamConnection(redis_async, settings.keys, settings.session_ttl_s))
        await recovery.requeue([Enqueue(encode(request), deliveries=settings.worker.max_deliveries)], [])
    finally:
        await redis_async.aclose()
    [error] = replies.read(1)
    assert error.request_id == "poison" and error.code == "max_deliveries"
    [(_, fields)] = rds.xrange(settings.keys.dead)
    assert fields[b"reason"] == b"max_deliveries" and int(fields[b"deliveries"]) == settings.worker.max_deliveries + 1


async def test_a_request_enqueued_twice_on_one_worker_runs_once_and_is_answered_once(
    settings, echo_workers, workers, rds
):
    """Twins (an enqueue sent again after its reply was lost, or resubmitted after Redis restarted) that reach one
    worker: the second is acked without an answer while the first runs (found by the chaos soak: both ran, and the
    engine's per-request-id bookkeeping failed on the second)."""
    [worker] = echo_workers(1, "--echo-token-delay-s", "0.05")
    replies = Results(rds, settings.keys.results("test-producer"))
    request = RolloutRequest(
        request_id="twin", prompt_token_ids=[1, 2, 3, 4], reply_to=replies.stream, sampling_params={"max_tokens": 4}
    )
    redis_async = Redis.from_url(settings.redis_url)
    try:
        producer = ProducerStreams(StreamConnection(redis_async, settings.keys, settings.session_ttl_s))
        await producer.enqueue([Enqueue(encode(request)), Enqueue(encode(request))], 100)
    finally:
        await redis_async.aclose()
    [trajectory] = replies.read(1)
    assert trajectory.request_id == "twin" and trajectory.completion_token_ids == [1, 2, 3, 4]
    await async_wait_until(lambda: rds.xlen(settings.keys.requests) == 0, 5, "both entries to be acked")
    # No wait for an answer that may come later: a result is added by the script that acks its entry, in one step.
    assert rds.xlen(replies.stream) == 1, "the twin was answered too"
    assert "ERROR" not in workers.log(worker) and "Traceback" not in workers.log(worker)


@pytest.mark.timeout(120)  # echo-0 serves a session or more at 4 s a request (see below)
async def test_a_session_queued_in_the_shared_stream_runs_on_one_worker(settings, workers, rds):
    """Sessions enqueued while no worker was live wait in the shared stream, each a request per turn-half; the worker
    that takes a session's request second sends it to the one that holds the session (found by the chaos soak: the
    two requests of one turn ran on two workers at once)."""
    sessions = [f"s{i}" for i in range(8)] * 2  # all first halves, then all second halves
    async with RolloutClient(settings) as client:
        task = asyncio.create_task(
            client.generate([[1, 2, 3, 4]] * len(sessions), {"max_tokens": 4}, session_ids=sessions)
        )
        await async_wait_until(lambda: rds.xlen(settings.keys.requests) == 16, 5, "the requests in the shared stream")
        # The fast one takes the other's halves; the slow one is slow enough (4 tokens at 1 s, one at a time) to hold
        # work still queued while the fast one starts: it takes the 8 first halves over 28 s (a CI run on a busy
        # machine took 7 s to start the fast one, by when a slow one at 0.25 s a token, 2 at a time, had taken all 8
        # and the fast one served nothing). The slow one first, holding sessions whose halves still wait before the
        # fast one starts: live is not enough (in a CI run the slow one was live but not yet taking when the fast one
        # started, and the fast one took all 16).
        echo = ("--engine", "echo", "--echo-token-delay-s")
        workers.start("echo-0", *echo, "1.0", "--max-num-seqs", "1")
        stream = settings.keys.requests

        def taking() -> bool:  # an entry pending on it, or one done (acked entries are deleted)
            groups = {g["name"]: g["pending"] for g in rds.xinfo_groups(stream)}  # the worker makes the group
            return groups.get(WORKERS_GROUP.encode(), 0) > 0 or rds.xlen(stream) < 16

        await async_wait_until(taking, 60, "echo-0 taking")
        workers.start("echo-1", *echo, "0.01", "--max-num-seqs", "2")
        workers.wait_live("echo-1")
        trajectories = await task
    by_session: dict[str, set[str]] = {}
    for session, trajectory in zip(sessions, trajectories, strict=True):
        by_session.setdefault(session, set()).add(trajectory.worker_id)
    assert all(len(ids) == 1 for ids in by_session.values()), by_session
    assert len({w for ids in by_session.values() for w in ids}) == 2  # both workers served


async def test_admission_is_bounded(settings, rds):
    bounded = settings.copy_with(max_queued_requests=10)
    async with RolloutClient(bounded) as client:
        with pytest.raises(QueueFullError, match="limit 10") as info:
            await client.generate([[1]] * 11, timeout_s=1)
        assert info.value.recoverable
        assert rds.xlen(settings.keys.requests) == 0  # all or nothing
        admitted = asyncio.create_task(client.generate([[1]] * 10))  # no worker to serve it
        await async_wait_until(lambda: rds.xlen(settings.keys.requests) == 10, 5, "10 requests admitted")
        with pytest.raises(QueueFullError):
            await client.generate([[2]])
        admitted.cancel()  # a caller that gives up cancels its requests: the queue empties
        await async_wait_until(lambda: rds.xlen(settings.keys.requests) == 0, 5, "the cancelled requests to go")
        assert client.stats.cancelled == 10


async def test_tokenize_chat_and_sample(settings, echo_workers):
    echo_workers(2)
    async with RolloutClient(settings) as client:
        ids = await client.tokenize(["hello", "wörld"])
        assert ids == [list(b"hello"), list("wörld".encode())]
        assert await client.detokenize(ids) == ["hello", "wörld"]
        conversation = [{"role": "user", "content": "hi"}]
        [template_ids] = await client.apply_chat_template([conversation])
        [trajectory] = await client.chat([conversation], {"max_tokens": 100})
        assert trajectory.prompt_token_ids == template_ids
        assert "hi" in trajectory.text
        groups = await client.sample([[1, 2], [3, 4]], n=3, sampling_params={"seed": 5})
        assert [len(g) for g in groups] == [3, 3]
        assert [t.prompt_token_ids for t in groups[1]] == [[3, 4]] * 3
        assert len({t.group_id for t in groups[0]}) == 1 and groups[0][0].group_id != groups[1][0].group_id
        assert await client.world_size() == 2


def test_client_pickles_and_has_a_sync_wrapper(settings, echo_workers):
    echo_workers(1)
    client = pickle.loads(pickle.dumps(SyncRolloutClient(settings)))
    try:
        [trajectory] = client.generate([[4, 5, 6]], SamplingParams(max_tokens=2))
        assert trajectory.completion_token_ids == [4, 5]
        assert client.world_size() == 1
        assert sorted(i for i, _ in client.as_completed([[1], [2], [3]], {"max_tokens": 1})) == [0, 1, 2]
        assert client.pause("keep") >= 1 and client.is_paused() is True
        client.resume()
    finally:
        client.close()
    assert pickle.loads(pickle.dumps(RolloutClient(settings))).settings == settings


async def test_sigterm_cuts_unfinished_requests_which_continue_token_exact_elsewhere(
    settings, workers, echo_workers, rds
):
    echo_workers(1, "--echo-token-delay-s", "0.05", "--drain-timeout-s", "0")
    prompts = [[(7 * i + j) % 250 + 1 for j in range(20)] for i in range(4)]
    async with RolloutClient(settings) as client:
        run = Streaming(client, prompts, {"max_tokens": 20})  # 1 s each
        streamed = await run.streamed(2, 5)  # each generating, a few tokens made
        workers.kill("echo-0", sig=15)  # SIGTERM, no drain time: its 4 requests are cut
        workers.procs["echo-0"].wait(timeout=10)
        echo_workers(1, "--echo-token-delay-s", "0.05")
        trajectories = await run.task
        assert client.stats.retries == 4
    assert all(2 <= n < 20 for n in streamed), streamed
    assert [t.completion_token_ids for t in trajectories] == prompts  # the cut and the continuation, whole
    assert all(t.finish_reason == "stop" and t.interruptions == 1 for t in trajectories)
    assert {t.worker_id for t in trajectories} == {"echo-1"}
    assert all(len(t.logprobs) == 20 for t in trajectories)
    assert "requeued 0 requests" in workers.log("echo-0")


def test_results_stream_is_removed_on_close(settings, echo_workers, rds):
    echo_workers(1)
    pattern = settings.keys.results("*")

    async def run() -> list[bytes]:
        async with RolloutClient(settings) as client:
            await client.generate([[1]])
            return rds.keys(pattern)

    assert len(asyncio.run(run())) == 1
    assert rds.keys(pattern) == []


def test_settings_come_from_env(monkeypatch):
    monkeypatch.setenv("ROLLOUT_REDIS_URL", "redis://example:1/2")
    monkeypatch.setenv("ROLLOUT_MAX_DELIVERIES", "7")
    settings = Settings()
    assert settings.redis_url == "redis://example:1/2" and settings.worker.max_deliveries == 7


async def test_generation_is_cut_when_its_deadline_passes(settings, echo_workers, rds):
    echo_workers(1, "--echo-token-delay-s", "0.25")  # 40 tokens: 10 s
    replies = Results(rds, settings.keys.results("test-producer"))
    # 2 s: a worker on a loaded CI machine took 0.5 s to take it, and a request unrun at its deadline has no tokens
    request = RolloutRequest(
        request_id="late", prompt_token_ids=[3] * 40, reply_to=replies.stream, deadline=time.time() + 2.0
    )
    rds.xadd(settings.keys.requests, {PAYLOAD_FIELD: encode(request)})
    [trajectory] = replies.read(1, timeout_s=8.0)  # well before the 10 s generation would end
    assert isinstance(trajectory, Trajectory)
    assert trajectory.finish_reason == "abort" and trajectory.abort_cause == "deadline"
    assert 0 < len(trajectory.completion_token_ids) < 40  # its partial output: ~8 tokens
    assert len(trajectory.logprobs) == len(trajectory.completion_token_ids)


async def test_one_result_delivered_twice_is_seen_once(settings, rds):
    async with RolloutClient(settings) as client:
        task = asyncio.create_task(client.generate([[5, 6]], {"max_tokens": 2}))
        # No worker: answer by hand, twice, as an at-least-once redelivery would.
        await async_wait_until(lambda: rds.xlen(settings.keys.requests) == 1, 5, "the request to be enqueued")
        [(_, fields)] = rds.xrange(settings.keys.requests)
        request = decode(fields[PAYLOAD_FIELD])
        answer = Trajectory(
            request_id=request.request_id, prompt_token_ids=[5, 6], completion_token_ids=[5, 6], finish_reason="stop"
        )
        for _ in range(2):
            rds.xadd(request.reply_to, {PAYLOAD_FIELD: encode(answer)})
        [trajectory] = await task
        assert trajectory.completion_token_ids == [5, 6]
        await async_wait_until(lambda: client.stats.duplicates == 1, 5, "the second copy to be read")


async def test_an_unknown_sampling_field_gets_an_error_result_not_a_dead_letter(settings, echo_workers, rds):
    echo_workers(1)
    replies = Results(rds, settings.keys.results("test-producer"))
    body = {"request_id": "new", "reply_to": replies.stream, "prompt_token_ids": [1], "sampling_params": {"beam": 4}}
    rds.xadd(settings.keys.requests, {PAYLOAD_FIELD: msgpack.packb({"v": 1, "t": "RolloutRequest", "b": body})})
    [error] = replies.read(1)
    assert error.request_id == "new" and error.code == "invalid_request" and "beam" in error.message
    assert rds.xlen(settings.keys.dead) == 0 and rds.xlen(settings.keys.requests) == 0


async def test_a_request_of_absurd_cost_never_takes_a_worker_down(settings, echo_workers, rds):
    """A `max_tokens` of 2^63 - 1 is valid input (the engine stops at its context), and a cost field a producer
    garbled is not the worker's problem: placement counts each at most `MAX_COST` (the API fuzz found a worker's take
    loop dying on HINCRBY with a load beyond what Lua's doubles hold exactly). Beyond int64 it is refused."""
    [worker] = echo_workers(1)
    keys = settings.keys
    replies = Results(rds, keys.results("test-producer"))
    for i, cost in enumerate([b"1e30", b"abc", b"nan", b"-5"]):
        request = RolloutRequest(request_id=f"odd-{i}", prompt_token_ids=[1, 2, 3], reply_to=replies.stream)
        rds.xadd(keys.requests, {PAYLOAD_FIELD: encode(request), COST_FIELD: cost})
    assert sorted(t.request_id for t in replies.read(4)) == ["odd-0", "odd-1", "odd-2", "odd-3"]
    async with RolloutClient(settings) as client:
        [huge] = await client.generate([[1, 2, 3]], {"max_tokens": 2**63 - 1})  # as large as the wire carries
        assert huge.completion_token_ids == [1, 2, 3] and huge.worker_id == worker
        assert [w.worker_id for w in await client.workers()] == [worker]  # still live: its loops never failed
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            await client.generate([[1, 2, 3]], {"max_tokens": 2**63})


async def test_sessions_taken_as_the_fleet_wakes_are_pinned_to_the_worker_that_takes_them(settings, echo_workers, rds):
    """Turns sent while the fleet sleeps wait in the shared stream (no worker takes work); as the fleet wakes, each
    worker takes only once its heartbeat says it serves, so the session pin it writes as it takes one holds (before: it
    took while its heartbeat still said `sleeping`, pinned nothing, and the turn's other request could run on another
    worker at the same time: the chaos soak saw it as a worker caught up from a peer, its heartbeat still `stale`)."""
    echo_workers(2, "--echo-token-delay-s", "0.05")
    sessions = [f"s{i}" for i in range(8)] * 2  # two requests a session, one turn
    async with RolloutClient(settings) as client:
        await client.sleep(1)
        task = asyncio.create_task(
            client.generate([[1, 2, 3, 4]] * len(sessions), {"max_tokens": 4}, session_ids=sessions)
        )
        await async_wait_until(lambda: rds.xlen(settings.keys.requests) == 16, 5, "the requests in the shared stream")
        await client.wake_up()
        trajectories = await task
    by_session: dict[str, set[str]] = {}
    for session, trajectory in zip(sessions, trajectories, strict=True):
        by_session.setdefault(session, set()).add(trajectory.worker_id)
    assert all(len(ids) == 1 for ids in by_session.values()), by_session
    pins = {s: rds.get(settings.keys.session(s)) for s in by_session}
    assert pins == {s: ids.pop().encode() for s, ids in by_session.items()}, pins  # pinned where it ran


async def test_a_waking_worker_takes_work_only_once_its_heartbeat_says_it_serves(settings, echo_workers, rds):
    """What the test above relies on, seen in Redis's own command stream (MONITOR): after the wake, the worker's first
    take comes after a heartbeat that says `serving` (before: its take reached Redis before that heartbeat, and a
    session pinned on a take then found the worker `sleeping`, `stale` or `starting` and pinned nothing)."""
    [worker] = echo_workers(1)
    heartbeat_key, shared = settings.keys.worker(worker).encode(), settings.keys.requests.encode()
    async with RolloutClient(settings) as client:
        await client.sleep(1)
        task = asyncio.create_task(client.generate([[1, 2, 3, 4]] * 4, {"max_tokens": 4}, session_ids=["s"] * 4))
        await async_wait_until(lambda: rds.xlen(settings.keys.requests) == 4, 5, "the requests in the shared stream")
        seen: list[str] = []
        ready = threading.Event()

        def watch() -> None:  # until the worker's first take (a script or read naming the shared stream)
            with rds.monitor() as monitor:
                ready.set()
                for command in monitor.listen():
                    args = command["command"].encode()
                    if heartbeat_key in args and b"serving" in args:
                        seen.append("heartbeat serving")
                    elif shared in args and worker.encode() in args:
                        seen.append("take")
                        return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert ready.wait(5)
        await client.wake_up()
        await task
        watcher.join(10)
    assert seen and seen[-1] == "take" and "heartbeat serving" in seen, seen
