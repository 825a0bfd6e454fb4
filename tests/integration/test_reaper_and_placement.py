"""Reaping and placement driven directly against a real redis-server, without worker processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from rollout_svc.config import Settings
from rollout_svc.control.plane import ControlPlane
from rollout_svc.dataplane.producer_streams import ProducerStreams
from rollout_svc.dataplane.reaper import Reaper
from rollout_svc.dataplane.recovery_streams import RecoveryStreams
from rollout_svc.dataplane.streams import Enqueue
from rollout_svc.dataplane.worker_streams import TakeOptions, WorkerStreams
from rollout_svc.errors import QueueFullError
from rollout_svc.keys import WORKERS_GROUP
from rollout_svc.protocol import RolloutRequest, WorkerStatus, decode, encode
from tests.support import Results, async_wait_until


@pytest_asyncio.fixture
async def plane(settings: Settings, rds) -> AsyncIterator[ControlPlane]:
    redis = Redis.from_url(settings.redis_url)
    plane = ControlPlane(redis, settings)
    await plane.load_scripts()
    for stream in (settings.keys.requests, settings.keys.token_requests):
        await plane.streams.connection.ensure_group(stream)
    yield plane
    await redis.aclose()


async def register(
    plane: ControlPlane, worker_id: str, state: str = "serving", applied_epoch: int = 0, free: int = 8
) -> None:
    """A worker as `workers.liveness` registers one: its free slots said (it is open), then its heartbeat."""
    await WorkerStreams(plane.streams.connection).report_load(worker_id, free)
    await plane.registry.heartbeat(WorkerStatus(worker_id=worker_id, state=state, applied_epoch=applied_epoch))  # type: ignore[arg-type]
    await plane.streams.connection.ensure_group(plane.keys.pinned_requests(worker_id))


def sides(plane: ControlPlane) -> tuple[ProducerStreams, WorkerStreams, RecoveryStreams]:
    """The data plane's three sides, over the control plane's connection."""
    return plane.streams, WorkerStreams(plane.streams.connection), plane.recovery


def request(request_id: str, reply_to: str, session_id: str | None = None, cost: int = 0) -> Enqueue:
    payload = encode(
        RolloutRequest(request_id=request_id, prompt_token_ids=[1], reply_to=reply_to, session_id=session_id)
    )
    return Enqueue(payload, session_id, cost=cost)


async def test_reaper_requeues_what_a_dead_worker_held_and_re_places_its_sessions(plane, settings, rds):
    keys, (producer, worker, _) = settings.keys, sides(plane)
    await register(plane, "w-dead")
    await register(plane, "w-live")
    reply = keys.results("p")
    placed = await producer.enqueue([request("r1", reply), request("r2", reply), request("r3", reply, "s1")], 100)
    assert [p.stream for p in placed] == [
        keys.requests,
        keys.requests,
        keys.pinned_requests("w-dead"),
    ]  # tie: lowest id
    taken = (await worker.take(TakeOptions("w-dead", 60_000), 2)).entries  # takes r3 (pinned) and r1; r2 stays queued
    assert sorted(decode(e.payload).request_id for e in taken) == ["r1", "r3"]
    assert [e.session_id for e in taken if e.stream != keys.requests] == ["s1"]  # a field: no decoding needed
    await producer.enqueue([request("r4", reply, "s1")], 100)  # queued behind in the dead worker's pinned stream
    rds.delete(keys.worker("w-dead"))  # its heartbeat expired

    assert await Reaper(plane.redis, settings).reap_dead("w-live") == {"w-dead": 3}  # r1, r3 pending; r4 backlog
    assert not rds.sismember(keys.workers, "w-dead") and not rds.exists(keys.pinned_requests("w-dead"))
    assert not any(rds.hexists(keys.loads, f"w-dead{s}") for s in ("", ":free", ":pinned"))  # its load forgotten
    assert rds.get(keys.session("s1")) == b"w-live"  # re-placed on the live worker
    requeued = {decode(fields[b"m"]).request_id: fields for _, fields in rds.xrange(keys.pinned_requests("w-live"))}
    assert set(requeued) == {"r3", "r4"}
    assert requeued["r3"][b"d"] == b"1" and b"d" not in requeued["r4"]  # delivery counts carried
    shared = {decode(fields[b"m"]).request_id: fields for _, fields in rds.xrange(keys.requests)}
    assert set(shared) == {"r1", "r2"} and shared["r1"][b"d"] == b"1"
    assert rds.xpending(keys.requests, WORKERS_GROUP)["pending"] == 0


async def test_a_worker_back_under_its_id_is_not_reaped(plane, settings, rds):
    """Found dead, then back under the same id (a restart under the same id) before the reaper took its lock: its
    pinned stream, consumer and registration are its own again (found by the chaos soak: a reaper requeued them
    back into the stream it drained, thousands of times, then deleted it under the live worker)."""
    keys, producer = settings.keys, plane.streams
    await register(plane, "w-back")
    await register(plane, "w-reaper")
    await producer.enqueue([request("r1", keys.results("p"), "s1")], 100)
    rds.delete(keys.worker("w-back"))
    assert await plane.registry.dead_workers() == ["w-back"]
    await register(plane, "w-back")  # its replacement registers
    assert await Reaper(plane.redis, settings).reap("w-back", "w-reaper") is None
    assert rds.xlen(keys.pinned_requests("w-back")) == 1 and rds.sismember(keys.workers, "w-back")
    assert rds.xinfo_stream(keys.pinned_requests("w-back"))["entries-added"] == 1  # nothing requeued into it
    assert not rds.exists(keys.reap_lock("w-back"))  # released: reapable if it dies again


async def test_a_stale_worker_releases_its_pinned_backlog_once_and_placement_skips_it(plane, settings, rds):
    """`Reaper.release_backlog`: the entries waiting in a live worker's pinned stream go back through placement.
    While its heartbeat still says serving they land there again and the call ends (it moves only what was there
    when it started); once it says stale, they go to a worker that serves, their sessions re-pinned."""
    keys, producer = settings.keys, plane.streams
    await register(plane, "a-stale")
    await register(plane, "b-serving")
    reply = keys.results("p")
    placed = await producer.enqueue([request(f"r{i}", reply, f"s{i}") for i in range(3)], 100)
    pinned = keys.pinned_requests("a-stale")
    assert [p.stream for p in placed] == [pinned, keys.pinned_requests("b-serving"), pinned]  # fewest sessions
    reaper = Reaper(plane.redis, settings)
    assert await reaper.release_backlog("a-stale") == 2  # placed back on a-stale (serving): moved once, not again
    assert rds.xlen(pinned) == 2
    await register(plane, "a-stale", state="stale")
    assert await reaper.release_backlog("a-stale") == 2
    assert rds.xlen(pinned) == 0 and rds.xlen(keys.pinned_requests("b-serving")) == 3
    assert {rds.get(keys.session(f"s{i}")) for i in range(3)} == {b"b-serving"}
    assert not await plane.registry.reap_lock_holder("a-stale")  # the lock it took is let go


async def test_a_new_session_goes_to_the_worker_with_the_least_work_not_the_fewest_sessions(plane, settings, rds):
    """Placement by cost for sessions: a new session's worker is the one holding the fewest tokens (taken, plus
    placed in its pinned stream and not taken yet), sessions only breaking a tie."""
    keys, (producer, worker, _) = settings.keys, sides(plane)
    await register(plane, "a")
    await register(plane, "b")
    reply = keys.results("p")
    # One long turn, then three short ones, in one call: the long one's tokens count against its worker at once.
    placed = await producer.enqueue(
        [request("r0", reply, "s0", cost=1000), *(request(f"r{i}", reply, f"s{i}", cost=10) for i in (1, 2, 3))], 100
    )
    a, b = keys.pinned_requests("a"), keys.pinned_requests("b")
    assert [p.stream for p in placed] == [a, b, b, b]  # by sessions it was a, b, a, b
    assert rds.hget(keys.loads, "a:pinned") == b"1000" and rds.hget(keys.loads, "b:pinned") == b"30"
    # Taken: the tokens move from pinned to held; a take that leaves nothing new in the pinned stream sets it to 0.
    taken = (await worker.take(TakeOptions("b", 60_000), 1)).entries
    assert len(taken) == 1 and rds.hget(keys.loads, "b:pinned") == b"20" and rds.hget(keys.loads, "b") == b"10"
    rds.hset(keys.loads, "b:pinned", 5)  # a count short of what is there: never below 0
    # A plan counts a part of the pinned tokens at their mean (2 of 5 for 1 of 2 entries); what its read cost beyond
    # that (10) is counted by the worker's next script call, as a worker carries it (`Woken`).
    short = await worker.take(TakeOptions("b", 60_000), 1)
    assert rds.hget(keys.loads, "b:pinned") == b"3" and short.unplanned == (8, 8)
    last = await worker.take(TakeOptions("b", 60_000), 8, short.unplanned)
    assert rds.hget(keys.loads, "b:pinned") == b"0"
    await worker.plan_take(TakeOptions("b", 60_000), 8, last.unplanned)
    assert rds.hget(keys.loads, "b:pinned") == b"0" and rds.hget(keys.loads, "b") == b"30"
    # b holds 3 sessions and 30 tokens, a 1 session and 1000 (pinned): the next new session goes to b.
    [placed_next] = await producer.enqueue([request("r4", reply, "s4", cost=10)], 100)
    assert placed_next.stream == b
    # A chunk refused for admission adds nothing to a worker's pinned tokens.
    with pytest.raises(QueueFullError):
        await producer.enqueue([request("r5", reply, "s5", cost=500), request("r6", reply, "s6", cost=500)], 1)
    assert rds.hget(keys.loads, "b:pinned") == b"10"
    assert "b:pinned" not in await producer.loads() and (await producer.loads())["b"] == 30


async def test_a_worker_reaped_while_it_takes_more_leaves_nothing_behind(plane, settings, rds, monkeypatch):
    """Redis forgot a live worker's heartbeat: it is reaped while it still reads. What it takes between the reaper's
    requeue and the forgetting of its consumer must not be dropped with the consumer (found by the 10-minute chaos
    soak: XGROUP DELCONSUMER dropped such entries, which then sat before the group's last-delivered id, never
    delivered again)."""
    keys, (producer, worker, recovery) = settings.keys, sides(plane)
    await register(plane, "w-alive")
    await producer.enqueue([request("r1", keys.results("p")), request("r2", keys.results("p"))], 100)
    [first] = await worker._readgroup("w-alive", {keys.requests: ">"}, 1, None)
    rds.delete(keys.worker("w-alive"))  # Redis forgot its heartbeat; it lives on
    reaper = Reaper(plane.redis, settings)
    delete, took = recovery.delete, []

    async def delete_while_the_worker_reads(stream):  # the pinned stream goes after the pending entries are requeued
        took.extend(await worker._readgroup("w-alive", {keys.requests: ">"}, 1, None))
        await delete(stream)

    monkeypatch.setattr(reaper.streams, "delete", delete_while_the_worker_reads)
    assert await reaper.reap("w-alive", "w-reaper") == 2
    assert decode(first.payload).request_id == "r1" and [decode(e.payload).request_id for e in took] == ["r2"]
    again = await worker._readgroup("w-other", {keys.requests: ">"}, 10, None)
    assert sorted(decode(e.payload).request_id for e in again) == ["r1", "r2"]  # both deliverable again
    assert rds.xlen(keys.requests) == 2  # the requeued copies, and nothing stranded


async def test_a_consumer_left_with_pending_entries_and_no_heartbeat_is_reaped(plane, settings, rds):
    """A worker reaped while it lived, that took more and died before it noticed, is no longer registered: its
    consumer (pending entries, idle past the TTL, no heartbeat) is reaped all the same."""
    keys, (producer, worker, _) = settings.keys, sides(plane)
    await producer.enqueue([request("r1", keys.results("p"))], 100)
    await worker._readgroup("ghost", {keys.requests: ">"}, 1, None)
    fast = settings.copy_with(heartbeat_ttl_s=0.05)

    def ghost_idle_past_the_ttl() -> bool:
        return any(c["name"] == b"ghost" and c["idle"] > 50 for c in rds.xinfo_consumers(keys.requests, WORKERS_GROUP))

    await async_wait_until(ghost_idle_past_the_ttl, 5, "the ghost consumer idle past the 50 ms TTL")
    assert await Reaper(plane.redis, fast).reap_dead("w-live") == {"ghost": 1}
    [(_, fields)] = rds.xrange(keys.requests)
    assert decode(fields[b"m"]).request_id == "r1" and rds.xpending(keys.requests, WORKERS_GROUP)["pending"] == 0


async def test_an_entry_over_max_deliveries_becomes_a_dead_letter_and_its_producer_is_told(plane, settings, rds):
    keys = settings.keys
    await register(plane, "w1")
    replies = Results(rds, keys.results("p"))
    await plane.recovery.requeue([Enqueue(request("poison", replies.stream).payload, deliveries=2)], [])
    [entry] = (await WorkerStreams(plane.streams.connection).take(TakeOptions("w1", 60_000), 1)).entries
    assert entry.deliveries == settings.worker.max_deliveries
    rds.delete(keys.worker("w1"))
    assert await Reaper(plane.redis, settings).reap_dead("someone") == {"w1": 0}
    [error] = replies.read(1)
    assert error.request_id == "poison" and error.code == "max_deliveries"
    assert rds.xlen(keys.dead) == 1 and rds.xlen(keys.requests) == 0


async def test_placement_skips_sleeping_draining_and_unconverged_workers(plane, settings, rds):
    keys, producer = settings.keys, plane.streams
    rds.hset(keys.state, "epoch", 3)
    await register(plane, "a-sleeping", "sleeping", 3)
    await register(plane, "b-draining", "draining", 3)
    await register(plane, "c-behind", "serving", 2)  # has not applied epoch 3 yet
    await register(plane, "d-paused", "paused", 3)  # a paused fleet still places: requests wait in the queue
    [placed] = await producer.enqueue([request("r1", "x", "s1")], 100)
    assert placed.stream == keys.pinned_requests("d-paused")
    await register(plane, "d-paused", "sleeping", 3)
    [moved] = await producer.enqueue([request("r2", "x", "s1")], 100)  # its worker fell asleep: unpinned
    assert moved.stream == keys.requests and rds.get(keys.session("s1")) is None
    await register(plane, "c-behind", "serving", 3)  # converged now
    [pinned] = await producer.enqueue([request("r3", "x", "s1")], 100)
    assert pinned.stream == keys.pinned_requests("c-behind")


async def test_a_stale_worker_set_is_noticed_inside_the_script(plane, settings, rds):
    keys, producer = settings.keys, plane.streams
    await register(plane, "w1")
    await producer.enqueue([request("r1", "x", "s1")], 100)  # caches the worker set {w1}
    await register(plane, "w0")  # a new worker the cache does not know: least loaded, lowest id
    [placed] = await producer.enqueue([request("r2", "x", "s2")], 100)
    assert placed.stream == keys.pinned_requests("w0")


async def test_small_batches_share_a_script_call_and_are_still_admitted_one_by_one(plane, rds):
    """Many callers' single requests go in one chunk; refused as one (its sum over the limit), each batch is sent
    again on its own, so each is admitted or refused on its own count, as without sharing."""
    replies = "test:results:p"
    batches = [[request(f"b{b}-{i}", replies) for i in range(size)] for b, size in enumerate((3, 4, 2))]
    outcomes = await plane.streams.enqueue_batches(batches, [5, 5, 5])
    assert [type(o).__name__ for o in outcomes] == ["list", "QueueFullError", "list"], outcomes
    assert rds.xlen(plane.keys.requests) == 5  # the first and the third: 3 + 2, in one round of retries
    shared = await plane.streams.enqueue_batches([[request(f"s{i}", replies)] for i in range(50)], [-1] * 50)
    assert all(len(o) == 1 for o in shared) and rds.xlen(plane.keys.requests) == 55  # type: ignore[arg-type]
    assert len({o[0].entry_id for o in shared}) == 50  # type: ignore[index]


async def test_a_pinned_stream_is_admitted_by_its_workers_tokens_and_refused_by_its_length(plane, settings, rds):
    """The admission check reads a worker's pinned stream's length only where the tokens the worker holds (each entry
    costs at least one, so they bound its entries) pass the limit: 3 one-token sessions fit a limit of 3 without an
    XLEN; a fourth reads the length and is refused, leaving nothing placed."""
    keys, producer = settings.keys, plane.streams
    await register(plane, "w1")
    pinned = keys.pinned_requests("w1")
    rds.config_resetstat()
    for i in range(3):
        [placed] = await producer.enqueue([request(f"r{i}", "x", f"s{i}", cost=1)], 3)
        assert placed.stream == pinned
    assert "cmdstat_xlen" not in rds.info("commandstats")
    with pytest.raises(QueueFullError, match="limit 3"):
        await producer.enqueue([request("r3", "x", "s3", cost=1)], 3)
    assert rds.info("commandstats")["cmdstat_xlen"]["calls"] == 1
    assert rds.xlen(pinned) == 3 and rds.hget(keys.loads, "w1:pinned") == b"3"


async def test_orphans_behind_more_held_entries_than_one_page_are_found(plane, settings, rds):
    """After a Redis restart, entries behind the group's last-delivered id that no consumer holds are orphans (no read
    gets them). 1,200 entries held (pending) ahead of 300 orphans: a page of 1,000 holds only held ones, and the
    orphans past it were once missed (left queued for ever); every page is looked at."""
    stream = settings.keys.requests
    pipe = rds.pipeline(transaction=False)
    for i in range(1500):
        pipe.xadd(stream, {"payload": b"x", "i": str(i)})
    pipe.execute()
    read = rds.xreadgroup(WORKERS_GROUP, "w0", {stream: ">"}, count=1500)  # all delivered: the group is past them
    ids = [entry_id for entry_id, _ in read[0][1]]
    rds.xack(stream, WORKERS_GROUP, *ids[1200:])  # acked but not deleted: what a replayed AOF brings back
    orphans = await plane.recovery.orphans(stream)
    assert [e.entry_id for e in orphans] == ids[1200:]
    assert len(await plane.recovery.orphans(stream, count=100)) == 100  # at most `count`
    rds.xack(stream, WORKERS_GROUP, *ids[:1200])
    rds.xdel(stream, *ids)
    assert await plane.recovery.orphans(stream) == []


# The registered w-back must stay live through the last 1 s wait: at the 2 s default, a stall of CI's loaded host
# (2026-11-30) let its one heartbeat expire first, and its lock was rightly taken over.
@pytest.mark.heartbeat_ttl(30.0)
async def test_a_restart_takes_over_a_reap_lock_its_gone_predecessor_left_but_waits_for_a_reaper(plane, settings, rds):
    """A Redis SIGKILLed just after a worker released its start lock may come back without the release (its
    append-only file syncs every second): the lock, held by a process that is gone, would hold the next process
    under that id for its 60 s TTL (a 10-minute chaos soak saw a replacement miss the fleet check so). A lock
    held by an earlier process of the id, with no live heartbeat under it, is taken over; one held by a reaper
    (another worker's id) is waited for."""
    keys = settings.keys
    reaper = Reaper(plane.redis, settings)
    for gone in ("starting:999999", "w-back"):  # its start lock, or its own backlog hand-off's
        rds.set(keys.reap_lock("w-back"), gone, px=60_000)
        holder = await asyncio.wait_for(reaper.hold_lock_to_start("w-back"), 5)
        assert rds.get(keys.reap_lock("w-back")) == holder.encode() != gone.encode()
        rds.delete(keys.reap_lock("w-back"))
    rds.set(keys.reap_lock("w-back"), "w-reaper", px=60_000)  # a live worker requeueing what w-back left
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reaper.hold_lock_to_start("w-back"), 1)
    assert rds.get(keys.reap_lock("w-back")) == b"w-reaper"
    rds.set(keys.reap_lock("w-back"), "starting:999999", px=60_000)
    await register(plane, "w-back")  # a process lives under the id: its lock is not taken
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reaper.hold_lock_to_start("w-back"), 1)


async def test_a_reap_cut_short_by_redis_is_finished_by_its_reapers_next_pass(plane, settings, rds):
    """A reaper that took a dead worker's lock and lost Redis mid-reap (restarted; its lock kept by the append-only
    file) finishes the reap at its next pass, not after the lock's 60 s TTL (a 10-minute chaos soak saw 3 requests
    of a killed worker wait 64 s so, past their call's timeout). Another reaper still leaves the lock alone."""
    keys, (producer, worker, _) = settings.keys, sides(plane)
    await register(plane, "w-dead")
    await register(plane, "w-live")
    placed = await producer.enqueue([request("r1", keys.results("p"), "s1")], 100)
    assert placed[0].stream == keys.pinned_requests("w-dead")
    await worker.take(TakeOptions("w-dead", 60_000), 1)
    rds.delete(keys.worker("w-dead"))  # its heartbeat expired
    rds.set(keys.reap_lock("w-dead"), "w-live", px=60_000)  # w-live's reap, cut short by the restart
    assert await Reaper(plane.redis, settings).reap_dead("w-other") == {}, "another reaper waits for the lock"
    assert rds.get(keys.reap_lock("w-dead")) == b"w-live"
    assert await Reaper(plane.redis, settings).reap_dead("w-live") == {"w-dead": 1}  # its next pass
    assert not rds.exists(keys.reap_lock("w-dead")) and not rds.sismember(keys.workers, "w-dead")
    assert rds.get(keys.session("s1")) == b"w-live"
    assert [decode(f[b"m"]).request_id for _, f in rds.xrange(keys.pinned_requests("w-live"))] == ["r1"]


async def test_a_worker_a_straggler_was_just_moved_to_is_not_idle(plane, settings, rds):
    """`idle_workers` (where a straggler may move): a worker whose pinned stream holds a moved generation it has not
    taken yet holds work. Counted as idle, it drew a second move within the same 0.2 s check, and then moved one of
    the two back (a CI run of test_moves saw a request moved twice)."""
    keys, worker = settings.keys, WorkerStreams(plane.streams.connection)
    for worker_id in ("a", "b"):
        await register(plane, worker_id)
        await worker.report_load(worker_id, 4)
    assert await worker.idle_workers("a", 60_000) == ["b"]
    await worker.hand_over("b", request("moved", keys.results("p"), cost=100))
    assert await worker.idle_workers("a", 60_000) == []
    await worker.take(TakeOptions("b", 60_000), 4)  # taken: its load now, and nothing left pinned
    assert rds.hget(keys.loads, "b") == b"100" and rds.hget(keys.loads, "b:pinned") == b"0"
    assert await worker.idle_workers("a", 60_000) == []


async def test_a_request_forwarded_to_its_session_s_draining_worker_waits_there(plane, settings, rds):
    """Both requests of a turn sat in the shared stream; w-a took one (pinning the session) and began to drain while it
    ran it; w-b took the other. Its pin finds the session on w-a and forwards the request there: a session runs on
    one worker at a time (the chaos soak saw the two run at once when a pin to a draining worker was dropped). What
    is not a forward (a new turn, a drain's backlog requeued) is placed anew, as before."""
    keys, (_, worker, recovery) = settings.keys, sides(plane)
    await register(plane, "w-a")
    await register(plane, "w-b")
    reply = keys.results("p")
    assert await worker.pin_session("s1", "w-a") == "w-a"
    await register(plane, "w-a", state="draining")
    assert await worker.pin_session("s1", "w-b") == "w-a"  # w-a may be running the session's other request
    payload = request("r2", reply, "s1").payload
    [forwarded] = await recovery.requeue([Enqueue(payload, "s1", deliveries=0, epoch=0, forward=True)], [])
    assert forwarded.stream == keys.pinned_requests("w-a")
    [requeued] = await recovery.requeue([Enqueue(payload, "s1", deliveries=1, epoch=0)], [])  # the drain's backlog
    assert requeued.stream == keys.pinned_requests("w-b")
    assert await worker.pin_session("s1", "w-b") == "w-b"  # the session moved with it


async def test_entries_pending_on_a_live_worker_that_it_no_longer_holds_are_requeued_after_a_second_look(
    plane, settings, rds
):
    """After a Redis restart that lost its last writes, a request the worker answered comes back pending on it (the
    publish script's ack and delete lost; a chaos run's drain found one, pending for good). The worker's reap loop
    requeues such entries: pending on it and not in flight at two looks a moment apart. One that a read had just
    delivered is in flight at the second look, one answered meanwhile is acked: neither moves."""
    keys, (producer, worker, _) = settings.keys, sides(plane)
    await register(plane, "w0")
    reply = keys.results("p")
    await producer.enqueue([request(f"r{i}", reply) for i in range(4)], 100)
    taken = (await worker.take(TakeOptions("w0", 60_000), 4)).entries
    by_id = {decode(e.payload).request_id: e for e in taken}
    assert sorted(by_id) == ["r0", "r1", "r2", "r3"]
    held = {(e.stream, e.entry_id) for e in (by_id["r0"],)}  # r0 in flight throughout
    reaper = Reaper(plane.redis, settings)
    looking = asyncio.ensure_future(reaper.requeue_forgotten("w0", lambda: held, settle_s=0.5))
    await asyncio.sleep(0.2)  # between the looks: r1 put in flight (its read had returned), r2 answered
    held.add((by_id["r1"].stream, by_id["r1"].entry_id))
    rds.xack(keys.requests, WORKERS_GROUP, by_id["r2"].entry_id)
    assert await looking == 1  # r3: pending on w0 at both looks, never in flight
    pending = await reaper.pending_keys("w0", [keys.requests], 100)
    assert pending == {(by_id[r].stream, by_id[r].entry_id) for r in ("r0", "r1")}
    await register(plane, "w1")
    [again] = (await worker.take(TakeOptions("w1", 60_000), 4)).entries
    assert decode(again.payload).request_id == "r3" and again.deliveries == 2  # its first delivery carried
    assert await reaper.requeue_forgotten("w0", lambda: held, settle_s=0.1) == 0  # r0 and r1 held: nothing


async def test_the_fleet_looks_for_dead_workers_about_once_an_interval_not_once_per_worker(plane, settings, rds):
    """Every worker's reap loop runs once a heartbeat interval, and looking reads every worker's heartbeat: with each
    looking, a fleet of W read W^2 heartbeats an interval (1,024 simulated GPUs: a million EXISTS a second). The
    workers take turns (`Keys.reap_turn`): 16 reapers' passes in a row read the 16 heartbeats about once."""
    ids = [f"w{i:02d}" for i in range(16)]
    for worker_id in ids:
        await register(plane, worker_id)
    rds.config_resetstat()
    passes = [await Reaper(plane.redis, settings).reap_dead(worker_id) for worker_id in ids]
    assert passes == [{}] * 16  # nobody is dead
    exists = rds.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
    # One look is 16 EXISTS; a slow pass may outlast the turn (0.18 s here) and let another look. Before: 256.
    assert 16 <= exists <= 64, exists
