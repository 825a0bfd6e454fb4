"""Placement by cost: an under-capacity batch spreads over idle workers in proportion to the work (tokens)."""

from __future__ import annotations

from collections import Counter

from redis.asyncio import Redis

from rollout_svc import RolloutClient
from rollout_svc.dataplane.producer_streams import ProducerStreams
from rollout_svc.dataplane.streams import Enqueue, StreamConnection
from rollout_svc.dataplane.worker_streams import TakeOptions, WorkerStreams

PARAMS = {"max_tokens": 100, "ignore_eos": True, "temperature": 0.0}


def prompts(count: int) -> list[list[int]]:
    return [[7, 8, 9, i % 50 + 10] * 25 for i in range(count)]  # echo: 100 tokens back, 1 s at 10 ms a token


async def test_an_under_capacity_batch_spreads_over_four_workers(settings, echo_workers):
    # Before: the first worker to read took up to half its free capacity: 60 requests went [32, 28, 0, 0].
    echo_workers(4, "--max-num-seqs", "64", "--echo-token-delay-s", "0.01")
    async with RolloutClient(settings) as client:
        for count, bound in ((60, 17), (96, 26), (128, 35)):  # ideal: 15, 24, 32
            trajectories = await client.generate(prompts(count), PARAMS)
            per_worker = sorted(Counter(t.worker_id for t in trajectories).values(), reverse=True)
            assert len(per_worker) == 4 and per_worker[0] <= bound, (count, per_worker)
            assert all(len(t.completion_token_ids) == 100 for t in trajectories)


async def test_a_sampled_group_batch_spreads_over_four_workers(settings, echo_workers):
    # Before: `sample` of 32 prompts x n=4 went [42, 37, 29, 20].
    echo_workers(4, "--max-num-seqs", "64", "--echo-token-delay-s", "0.01")
    async with RolloutClient(settings) as client:
        groups = await client.sample(prompts(32), 4, PARAMS)
    per_worker = sorted(Counter(t.worker_id for group in groups for t in group).values(), reverse=True)
    assert len(per_worker) == 4 and per_worker[0] <= 35, per_worker  # ideal: 32
    assert all(len(group) == 4 for group in groups)


async def test_a_take_shares_tokens_not_requests(settings):
    # Worker a holds 8 requests of 400 tokens; 40 of 40 tokens wait. Sharing tokens, b takes all 40 (1,600 tokens
    # against a's 3,200); sharing requests, it would take 24 and leave 16 to a.
    redis = Redis.from_url(settings.redis_url)
    connection, keys = StreamConnection(redis, settings.keys, 60), settings.keys
    producer, worker = ProducerStreams(connection), WorkerStreams(connection)
    try:
        for stream in (keys.requests, keys.pinned_requests("a"), keys.pinned_requests("b")):
            await connection.ensure_group(stream)
        await producer.enqueue([Enqueue(b"long", cost=400) for _ in range(8)], 100)
        taken_by_a = (await worker.take(TakeOptions("a", 60_000), 64)).entries  # alone: it takes all 8
        assert len(taken_by_a) == 8 and int(await redis.hget(keys.loads, "a")) == 3200
        await worker.report_load("b", 64)  # b is open now: a live worker with free slots
        await producer.enqueue([Enqueue(b"short", cost=40) for _ in range(40)], 100)
        taken = await worker.take(TakeOptions("b", 60_000), 64)
        taken_by_b, left = taken.entries, taken.left
        assert len(taken_by_b) == 40 and not left
        # a publishes its 8: its load drops to 0 in the same script call
        await worker.publish([(entry, None) for entry in taken_by_a], 60, load=("a", 64))
        assert int(await redis.hget(keys.loads, "a")) == 0
    finally:
        await redis.aclose()


async def test_fifo_placement_takes_whatever_fits(settings, workers):
    # ROLLOUT_PLACEMENT=fifo keeps the rule placement replaced (for the step-time bench): the first worker to read
    # takes what fits its free slots.
    args = ("--engine", "echo", "--max-num-seqs", "64", "--echo-token-delay-s", "0.01")
    workers.start_ready([f"echo-{i}" for i in range(4)], *args, env={"ROLLOUT_PLACEMENT": "fifo"})
    async with RolloutClient(settings) as client:
        trajectories = await client.generate(prompts(60), PARAMS)
    per_worker = sorted(Counter(t.worker_id for t in trajectories).values(), reverse=True)
    assert per_worker[0] > 17, per_worker  # one worker took far more than its share


async def test_a_larger_read_ahead_takes_more_at_each_wake(settings, workers):
    # ROLLOUT_READ_AHEAD=16: a woken worker takes 16 entries before its share is weighed. 16 requests on 4 idle
    # workers go to the first one woken (at the default of 2 no worker takes more than 4: the test above), and a batch
    # of 16 x 4 still spreads evenly.
    args = ("--engine", "echo", "--max-num-seqs", "64", "--echo-token-delay-s", "0.01")
    workers.start_ready([f"echo-{i}" for i in range(4)], *args, env={"ROLLOUT_READ_AHEAD": "16"})
    async with RolloutClient(settings) as client:
        trajectories = await client.generate(prompts(16), PARAMS)
        assert max(Counter(t.worker_id for t in trajectories).values()) > 4
        trajectories = await client.generate(prompts(64), PARAMS)
        per_worker = sorted(Counter(t.worker_id for t in trajectories).values(), reverse=True)
        assert len(per_worker) == 4 and per_worker[0] <= 19, per_worker  # ideal: 16


async def test_sample_packs_each_group_on_one_worker_when_asked(settings, echo_workers):
    echo_workers(4, "--max-num-seqs", "64", "--echo-token-delay-s", "0.01")
    async with RolloutClient(settings) as client:
        packed = await client.sample(prompts(8), 4, PARAMS, group_placement="pack")
        # Spread: one group of 16 one-second samples, a worker's fair share is 4 of them. (8 groups of 4 would not
        # show it: shares of 8 requests in stream order hold whole groups, so a CI run saw every group on one worker.)
        [spread] = await client.sample(prompts(1), 16, PARAMS)
        assert [await client.session_worker(g[0].group_id) for g in packed] == [None] * 8  # unpinned after
    assert all(len({t.worker_id for t in group}) == 1 for group in packed)  # a group's samples share one worker
    assert len({group[0].worker_id for group in packed}) == 4  # and the groups spread over the workers
    assert all(t.session_id is None for t in spread)  # spread: the samples are not a session
    assert len({t.worker_id for t in spread}) > 1, Counter(t.worker_id for t in spread)  # and run on several workers


async def test_sample_places_groups_by_the_lengths_their_prompts_ran_to_before(settings, echo_workers):
    # 8 prompts whose samples run 400 tokens, then 24 whose samples run 10 (echo: the prompt comes back), n=4, all
    # at max_tokens 1000. Unknown lengths cost every request the same, so the stream's first 32 requests (the long
    # ones) are one worker's fair share by count. Once the client has seen each prompt's group, placement counts the
    # expected 400 and 10 tokens and the long groups go first: every worker gets about a quarter of the tokens.
    echo_workers(4, "--max-num-seqs", "64", "--echo-token-delay-s", "0.002")
    batch = [[(i * 7 + k) % 200 + 1 for k in range(400)] for i in range(8)]
    batch += [[(i * 3 + k) % 200 + 1 for k in range(10)] for i in range(24)]
    params = {"max_tokens": 1000, "temperature": 0.0}
    async with RolloutClient(settings) as client:
        await client.sample(batch, 4, params)  # learns each prompt's length
        assert client.expected_lengths.expected(batch[0]) == 400
        assert client.expected_lengths.expected(batch[-1]) == 10
        groups = await client.sample(batch, 4, params)
    assert [[len(t.completion_token_ids) for t in g] for g in groups] == [[len(p)] * 4 for p in batch]  # input order
    tokens: Counter[str] = Counter()
    for group in groups:
        for t in group:
            tokens[t.worker_id] += len(t.completion_token_ids)
    ideal = (8 * 400 + 24 * 10) * 4 / 4
    assert len(tokens) == 4 and max(tokens.values()) <= 1.3 * ideal, (dict(tokens), ideal)


async def test_workers_of_unequal_kv_caches_take_work_in_proportion_and_only_what_fits(settings, echo_workers):
    """Two echo workers of 64 slots each, told contexts of 4,096 and 1,024 tokens: KV caches (64 x context) of
    262,144 and 65,536 tokens, 4:1. An under-capacity batch splits about 4:1 (equal caches split it about evenly,
    the test above); requests longer than the small worker's context all go to the large one; one longer than both
    is still served."""
    [large] = echo_workers(1, "--max-num-seqs", "64", "--max-model-len", "4096", "--echo-token-delay-s", "0.01")
    [small] = echo_workers(1, "--max-num-seqs", "64", "--max-model-len", "1024", "--echo-token-delay-s", "0.01")
    async with RolloutClient(settings) as client:
        assert {w.worker_id: w.kv_cache_tokens for w in await client.workers()} == {large: 262_144, small: 65_536}
        trajectories = await client.generate(prompts(80), PARAMS)  # 200 tokens each: both contexts hold them
        per_worker = Counter(t.worker_id for t in trajectories)
        assert 56 <= per_worker[large] <= 72 and per_worker[small] >= 8, per_worker  # ideal: 64 and 16
        long_context = [[7, 8, 9, i % 50 + 10] * 300 for i in range(12)]  # 1,200 tokens, and 100 more out
        trajectories = await client.generate(long_context, PARAMS)
        assert {t.worker_id for t in trajectories} == {large}  # none where it cannot fit
        assert all(len(t.completion_token_ids) == 100 for t in trajectories)
        [beyond] = await client.generate(prompts(1), {**PARAMS, "max_tokens": 5000})  # fits neither: taken anyway
        assert beyond.worker_id in (large, small) and beyond.finish_reason != "error"
