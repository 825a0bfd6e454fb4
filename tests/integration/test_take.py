"""A worker's take: planned by a script that reads no queued entry (`dataplane.take`), read plainly after, weighed by
the queued costs list, which a sweep keeps and a take rebuilds where it stops matching the entries. Driven directly
against a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest_asyncio
import redis
from redis.asyncio import Redis

from rollout_svc.config import Settings
from rollout_svc.control.plane import ControlPlane
from rollout_svc.dataplane.producer_streams import Sweep
from rollout_svc.dataplane.streams import Enqueue
from rollout_svc.dataplane.worker_streams import TakeOptions, WorkerStreams
from rollout_svc.keys import IN_SUFFIX, SUM_FIELD, WEIGHTS_FIELD
from rollout_svc.protocol import RolloutRequest, WorkerStatus, encode


@pytest_asyncio.fixture
async def plane(settings: Settings, rds) -> AsyncIterator[ControlPlane]:
    client = Redis.from_url(settings.redis_url)
    plane = ControlPlane(client, settings)
    await plane.load_scripts()
    await plane.streams.connection.ensure_group(settings.keys.requests)
    for worker_id in ("a", "b"):
        await WorkerStreams(plane.streams.connection).report_load(worker_id, 64)
        await plane.registry.heartbeat(WorkerStatus(worker_id=worker_id, state="serving"))
        await plane.streams.connection.ensure_group(settings.keys.pinned_requests(worker_id))
    yield plane
    await client.aclose()


def _request(n: int, cost: int, prompt_tokens: int = 1) -> Enqueue:
    payload = encode(RolloutRequest(request_id=f"r{n}", prompt_token_ids=[1] * prompt_tokens, reply_to="results"))
    return Enqueue(payload, None, cost=cost)


def _take_us(rds: redis.Redis) -> float:
    return float(rds.info("commandstats")["cmdstat_evalsha"]["usec"])


async def test_a_take_weighs_its_share_by_each_entry_s_cost_without_reading_an_entry(plane, settings, rds) -> None:
    """Two open workers, 4 entries of 300 tokens queued before 12 of 10 (`sample` queues the longest first): a's share
    is half the 1,320 tokens, the first 2 long ones (a count at the mean would take 8); b's brings it to a's 600 and
    half the rest, a the last 6. The plan's Redis time does not grow with the entries' size, as it did when the
    script read them (XRANGE, XREADGROUP)."""
    keys, worker = settings.keys, WorkerStreams(plane.streams.connection)
    await plane.streams.enqueue([_request(i, 300) for i in range(4)] + [_request(i, 10) for i in range(4, 16)], -1)
    assert rds.llen(keys.queued_costs) == 16
    a = await worker.take(TakeOptions("a", 60_000), 64)
    assert [e.cost for e in a.entries] == [300, 300] and a.left and a.unplanned == (0, 0)
    b = await worker.take(TakeOptions("b", 60_000), 64)
    assert [e.cost for e in b.entries] == [300, 300] + [10] * 6 and b.left and b.unplanned == (0, 0)
    assert rds.llen(keys.queued_costs) == 14  # a's two delivered: dropped off its head by b's plan
    a = await worker.take(TakeOptions("a", 60_000), 64)
    assert [e.cost for e in a.entries] == [10] * 6 and a.drained and not a.left
    assert int(rds.hget(keys.loads, "a")) == 660 and int(rds.hget(keys.loads, "b")) == 660

    async def plan_us(prompt_tokens: int) -> float:  # one plan of 16 entries of that size, for a (now the least loaded)
        await plane.streams.enqueue([_request(i, 10, prompt_tokens) for i in range(16)], -1)
        before = _take_us(rds)
        plan = await worker.plan_take(TakeOptions("a", 60_000), 64, idle=True)
        spent = _take_us(rds) - before
        await worker.read_plan(plan)
        await worker.take(TakeOptions("b", 60_000), 64)  # the rest, so the next measure starts empty
        return spent

    small = min([await plan_us(1) for _ in range(3)])
    large = min([await plan_us(16_000) for _ in range(3)])  # ~64 KB an entry: ~1 MB for the script to convert
    assert large <= 3 * small + 50, (small, large)


async def test_a_sweep_keeps_the_costs_list_and_a_take_rebuilds_one_that_stopped_matching(plane, settings, rds) -> None:
    keys, worker = settings.keys, WorkerStreams(plane.streams.connection)
    placed = await plane.streams.enqueue([_request(i, 10 * (i + 1)) for i in range(6)], -1)
    swept = await plane.streams.sweep(keys.requests, [Sweep(placed[1].entry_id)], 60)
    assert len(swept) == 1 and rds.llen(keys.queued_costs) == 5  # its "id cost" went with it
    rds.xdel(keys.requests, placed[2].entry_id)  # behind the scripts' back: the list no longer matches
    taken = await worker.take(TakeOptions("a", 60_000), 64)  # its share of the 190 tokens counted queued: 95
    assert [e.cost for e in taken.entries] == [10, 40, 50]  # weighed by the entries themselves (a list: 20, 30, ...)
    rebuilt = [f"{placed[i].entry_id.decode()} {10 * (i + 1)}".encode() for i in (0, 3, 4, 5)]
    assert rds.lrange(keys.queued_costs, 0, -1) == rebuilt  # from what waited: its head is dropped once delivered
    assert [e.cost for e in (await worker.take(TakeOptions("b", 60_000), 64)).entries] == [60]
    assert rds.lrange(keys.queued_costs, 0, -1) == rebuilt[3:]  # a's three dropped by b's plan; b's one by the next
    await worker.plan_take(TakeOptions("a", 60_000), 64)
    assert rds.llen(keys.queued_costs) == 0


async def test_a_take_reads_the_costs_list_as_far_as_its_share_goes(plane, settings, rds) -> None:
    """Three open workers, 200 entries of 1 token queued before one of 20,000: a's share is a third of the 20,200
    tokens, about 67 entries at the mean cost. Its first read of the costs list is twice that, short of the 201
    waiting, so it reads on as its share goes: the 200 cheap ones, stopping at the dear one (left to the others'
    shares). The plan is the one a read of the whole list gave."""
    keys, worker = settings.keys, WorkerStreams(plane.streams.connection)
    await worker.report_load("c", 64)
    await plane.registry.heartbeat(WorkerStatus(worker_id="c", state="serving"))
    await plane.streams.enqueue([_request(i, 1) for i in range(200)] + [_request(200, 20_000)], -1)
    assert rds.llen(keys.queued_costs) == 201
    rds.config_resetstat()
    plan = await worker.plan_take(TakeOptions("a", 60_000), 4096)
    assert (plan.shared, plan.counted, plan.left, plan.drained) == (200, (200, 0), True, False)
    assert int(rds.info("commandstats")["cmdstat_lrange"]["calls"]) == 2  # a first read, then one on
    taken = await worker.read_plan(plan)
    assert len(taken.entries) == 200 and taken.unplanned == (0, 0)
    b = await worker.take(TakeOptions("b", 60_000), 4096)  # the least loaded: at least the one entry
    assert [e.cost for e in b.entries] == [20_000] and b.drained and not b.left


async def test_a_take_closes_workers_silent_past_the_ttl_once_per_renewal_of_its_stamp(plane, settings, rds) -> None:
    """a and b said they had free slots; 0.3 s later a takes with a TTL of 0.2 s: b, silent since, is closed (out of
    `Keys.levels` and the sums), a stays. A take right after does not look again (its stamp is not due)."""
    keys, worker = settings.keys, WorkerStreams(plane.streams.connection)
    await asyncio.sleep(0.3)
    rds.config_resetstat()
    await worker.plan_take(TakeOptions("a", 200), 64)
    assert rds.zscore(keys.levels, "b") is None and rds.zscore(keys.open_at, "b") is None
    assert rds.zscore(keys.levels, "a") is not None and rds.hget(keys.loads, "b" + IN_SUFFIX) is None
    assert int(rds.hget(keys.loads, WEIGHTS_FIELD)) == 1  # a's alone (neither said its KV cache)
    await worker.plan_take(TakeOptions("a", 200), 64)
    assert int(rds.info("commandstats")["cmdstat_zrangebyscore"]["calls"]) == 1


async def test_a_look_counts_the_shared_entries_no_worker_has_taken(plane, settings, rds) -> None:
    """What a worker that left entries to others' shares looks at before it takes again: the shared stream's length
    less the group's pending entries, by plain commands; None where Redis lost the stream (the take recreates it)."""
    keys, worker = settings.keys, WorkerStreams(plane.streams.connection)
    assert await worker.shared_waiting() == 0
    await plane.streams.enqueue([_request(i, 10) for i in range(5)], -1)
    assert await worker.shared_waiting() == 5
    taken = await worker.take(TakeOptions("a", 60_000), 2)
    assert len(taken.entries) == 2 and await worker.shared_waiting() == 3
    assert await worker.publish([(taken.entries[0], None)], 60) == []  # acked and deleted: not waiting either
    assert rds.xlen(keys.requests) == 4 and await worker.shared_waiting() == 3
    rds.delete(keys.requests)
    assert await worker.shared_waiting() is None


async def test_the_sums_stay_those_of_the_open_workers_through_takes_publishes_and_placements(
    plane, settings, rds
) -> None:
    """The sums of the open workers' loads and weights (`dataplane.levels`) change with every take, publish,
    placement and load report. After a mixed run (sessions placed, shares taken, some answered, a third worker with a
    KV cache joining, one closing, opening again and closing) each sum is still what the open workers' ID:in records
    add up to, and each record's load is its worker's tokens held plus placed."""
    keys, worker = settings.keys, WorkerStreams(plane.streams.connection)
    await worker.report_load("c", 64, kv_cache_tokens=5_000, max_model_len=4_096)
    await plane.registry.heartbeat(WorkerStatus(worker_id="c", state="serving"))
    await plane.streams.connection.ensure_group(keys.pinned_requests("c"))
    held: dict[str, list] = {"a": [], "b": [], "c": []}
    for round_ in range(4):
        sessions = [
            Enqueue(_request(100 * round_ + i, 7 * i + 3).payload, f"s{round_}-{i}", cost=7 * i + 3) for i in range(6)
        ]
        await plane.streams.enqueue(sessions + [_request(100 * round_ + 50 + i, 11 * i + 5) for i in range(9)], -1)
        for worker_id in ("a", "b", "c", "a"):
            kv = 5_000 if worker_id == "c" else 0
            held[worker_id] += (await worker.take(TakeOptions(worker_id, 60_000, kv_cache_tokens=kv), 8)).entries
        for worker_id, entries in held.items():  # half of what each holds answered
            answered, held[worker_id] = entries[: len(entries) // 2], entries[len(entries) // 2 :]
            await worker.publish([(e, None) for e in answered], 60, load=(worker_id, 8), woken=(0, 0))
        if round_ in (1, 3):
            await worker.report_load("b", 0)  # closed: out of the sums (its takes of round 2 open it again)
    loads = {k.decode(): v.decode() for k, v in rds.hgetall(keys.loads).items()}
    records = {field[: -len(IN_SUFFIX)]: value.split() for field, value in loads.items() if field.endswith(IN_SUFFIX)}
    assert set(records) == {"a", "c"}, records
    for worker_id, (load, _weight, _kv, _at) in records.items():
        placed = int(loads.get(worker_id + ":pinned", 0))
        assert int(load) == int(loads.get(worker_id, 0)) + placed, (worker_id, loads)
    assert int(loads[SUM_FIELD]) == sum(int(r[0]) for r in records.values()) > 0, loads
    assert int(loads[WEIGHTS_FIELD]) == sum(int(r[1]) for r in records.values()), loads
