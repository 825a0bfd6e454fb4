"""Redis restarts under load, on a redis-server of each test's own (the shared one cannot be restarted).

With an append-only file, Redis stopped with SIGTERM and started again loses nothing: every request in flight
comes back. Killed and started again *empty* (no persistence: what a replica promoted before it had the recent
writes looks like, at its worst), it forgot every queued request, every pending entry, the workers' heartbeats
and the control state: the producer notices the new run_id and resubmits what it still awaits, the workers
recreate their groups and come back, and every request is answered long before its timeout.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollout_svc import RolloutClient
from rollout_svc.client.calls import ClientStats
from rollout_svc.client.status import fleet_status
from rollout_svc.config import Settings
from tests.support import WorkerProcs, async_wait_until, free_port

pytestmark = pytest.mark.timeout(150)
REQUESTS = 2000
TIMEOUT_S = 120.0  # the requests' own timeout: "none after waiting out a timeout" means far inside it


class RedisServer:
    """A redis-server that a test can kill and start again on the same port (and data dir)."""

    def __init__(self, workdir: Path, appendonly: bool) -> None:
        self.port, self.workdir, self.appendonly = free_port(), workdir, appendonly
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not on PATH"
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "everysec"] if self.appendonly else ["--appendonly", "no"]
        )
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.workdir)]
        self.process = subprocess.Popen([binary, *args, *persistence], stdout=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    assert time.monotonic() < deadline, "redis-server did not start"
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self, sig: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, sig)
        self.process.wait(timeout=30)
        self.process = None


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, appendonly=request.param)
    server.start()
    yield server
    if server.process is not None:
        server.stop(signal.SIGKILL)


@pytest.fixture
def fleet(server: RedisServer, tmp_path: Path) -> Iterator[tuple[Settings, WorkerProcs]]:
    settings = Settings(
        redis_url=server.url, key_prefix="test", heartbeat_interval_s=0.2, heartbeat_ttl_s=2.0, read_block_ms=50
    )
    procs = WorkerProcs(settings, tmp_path)
    for name in ("w1", "w2"):
        procs.start(name, "--engine", "echo", "--echo-token-delay-s", "0.02", "--max-num-seqs", "64")
    procs.wait_live("w1", "w2")
    yield settings, procs
    procs.stop_all()


async def _restart_during(
    settings: Settings, server: RedisServer, sig: int, down_s: float
) -> tuple[list, float, ClientStats]:
    """2,000 requests in flight; Redis stopped with `sig` once the workers are busy, started `down_s` later."""
    async with RolloutClient(settings) as client:
        started = time.monotonic()
        task = asyncio.ensure_future(
            client.generate([_prompt(i) for i in range(REQUESTS)], {"max_tokens": 16}, timeout_s=TIMEOUT_S)
        )

        async def busy() -> bool:
            return sum(w.served for w in await client.workers()) >= 100

        await async_wait_until(busy, 30, "the workers to serve their first requests")
        server.stop(sig)
        await asyncio.sleep(down_s)
        server.start()
        trajectories = await task
        return trajectories, time.monotonic() - started, client.stats


def _prompt(i: int) -> list[int]:
    return [5, 6, 7, i % 50 + 10] * 5  # echoed: 16 tokens at 0.02 s each, cut at max_tokens (finish "length")


def _served_through_restart(
    server: RedisServer, fleet: tuple[Settings, WorkerProcs], sig: int
) -> tuple[float, ClientStats]:
    """`_restart_during` with Redis away for 1 s: asserts that every request was served whole and once, that the
    client saw Redis change once, and that every worker outlived it. Returns (seconds the call took, its stats)."""
    settings, procs = fleet
    trajectories, took, stats = asyncio.run(_restart_during(settings, server, sig, 1.0))
    assert len(trajectories) == REQUESTS
    assert len({t.request_id for t in trajectories}) == REQUESTS, "a request was answered twice"
    bad = [
        t
        for i, t in enumerate(trajectories)
        if t.finish_reason != "length" or t.completion_token_ids != _prompt(i)[:16]
    ]
    assert not bad, f"{len(bad)} of {REQUESTS} not served whole: {bad[:1]}"
    assert stats.redis_changes == 1
    assert all(proc.poll() is None for proc in procs.procs.values()), "a worker died with Redis"
    return took, stats


@pytest.mark.parametrize("server", [True], indirect=True, ids=["appendonly"])
def test_redis_stopped_with_sigterm_and_restarted_loses_no_request(
    server: RedisServer, fleet: tuple[Settings, WorkerProcs]
) -> None:
    took, _ = _served_through_restart(server, fleet, signal.SIGTERM)
    assert took < TIMEOUT_S / 2, f"{took:.0f} s"


@pytest.mark.parametrize("server", [False], indirect=True, ids=["no-persistence"])
def test_redis_restarted_empty_answers_every_request_without_waiting_out_a_timeout(
    server: RedisServer, fleet: tuple[Settings, WorkerProcs]
) -> None:
    took, stats = _served_through_restart(server, fleet, signal.SIGKILL)
    assert took < 60, f"took {took:.0f} s: callers waited for requests Redis had forgotten"
    assert stats.resubmitted > 0, "Redis came back empty, yet nothing was resubmitted"
    settings, _ = fleet
    rds = redis.Redis.from_url(settings.redis_url)
    try:
        live = {w.decode() for w in rds.smembers(settings.keys.workers)}
        assert len(live) == 2, f"workers did not come back: {live}"
    finally:
        rds.close()


@pytest.mark.parametrize("server", [False], indirect=True, ids=["no-persistence"])
def test_a_paused_fleet_stays_paused_when_redis_comes_back_empty(
    server: RedisServer, fleet: tuple[Settings, WorkerProcs]
) -> None:
    """The workers write back the control state they last applied (DESIGN.md section 4): a request queued after the
    restart waits for `resume`, and the epoch goes on from where it was."""
    settings, _ = fleet

    async def main() -> None:
        async with RolloutClient(settings) as client:
            epoch = await client.pause(mode="abort")
            server.stop(signal.SIGKILL)
            server.start()

            async def reseeded() -> bool:
                state = await client.fleet_state()
                return state.epoch >= epoch and state.paused

            await async_wait_until(reseeded, 20, "the workers to write the control state back")
            task = asyncio.ensure_future(client.generate([[1, 2, 3]], {"max_tokens": 4}, timeout_s=30))

            async def queued() -> bool:
                return sum(depth["queued"] for depth in (await fleet_status(settings))["streams"].values()) == 1

            await async_wait_until(queued, 10, "the request queued")
            await asyncio.sleep(1.0)  # time passes: a worker taking work would answer it (at once, echo) meanwhile
            assert not task.done(), "a request ran on a fleet that was paused before Redis forgot it"
            assert await client.resume() > epoch
            [trajectory] = await task
            assert (trajectory.finish_reason, trajectory.completion_token_ids) == ("stop", [1, 2, 3])

    asyncio.run(main())


@pytest.mark.parametrize("server", [True], indirect=True, ids=["appendonly"])
def test_a_control_command_issued_while_redis_is_away_goes_through_once_it_is_back(
    server: RedisServer, fleet: tuple[Settings, WorkerProcs]
) -> None:
    settings, _ = fleet

    async def main() -> None:
        async with RolloutClient(settings) as client:
            assert len(await client.workers()) == 2
            server.stop(signal.SIGTERM)

            async def back_in_a_second() -> None:
                await asyncio.sleep(1.0)
                await asyncio.to_thread(server.start)

            back = asyncio.ensure_future(back_in_a_second())
            epoch = await client.pause(mode="keep")  # issued while Redis is down
            await back
            assert await client.is_paused() is True
            assert await client.resume() > epoch
            assert await client.is_paused() is False

    asyncio.run(main())


@pytest.mark.parametrize("server", [False], indirect=True, ids=["no-persistence"])
def test_a_worker_waits_for_a_redis_that_is_away_without_spinning(
    server: RedisServer, fleet: tuple[Settings, WorkerProcs]
) -> None:
    """Past its heartbeat TTL with Redis away, a worker takes nothing until it can renew; it waits for that rather
    than spinning its take loop (it once burned half a core a worker, stealing from the engine beside it)."""
    settings, procs = fleet
    server.stop(signal.SIGKILL)
    time.sleep(settings.heartbeat_ttl_s + 1.0)  # every heartbeat is stale now: no worker may take
    before = {w: _cpu_ticks(procs.pid(w)) for w in ("w1", "w2")}
    time.sleep(3.0)
    used = {w: (_cpu_ticks(procs.pid(w)) - before[w]) / os.sysconf("SC_CLK_TCK") / 3.0 for w in before}
    assert all(share < 0.15 for share in used.values()), f"CPU share of each worker while Redis was away: {used}"
    server.start()


def _cpu_ticks(pid: int) -> int:
    """User + system CPU ticks of a process (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.parametrize("server", [True], indirect=True, ids=["appendonly"])
async def test_entries_redis_brings_back_behind_the_consumer_group_are_requeued_not_left(
    server: RedisServer, fleet: tuple[Settings, WorkerProcs]
) -> None:
    """Redis killed mid-write of a transaction, written to, then restarted replays the cut-short transaction: its
    entries come back *behind* the group's last-delivered id (chaos found 12 so), where no `>` read gets them. Made
    here with XGROUP SETID: queued entries the group has passed. After the restart the workers requeue them, and the
    streams drain."""
    settings, _ = fleet
    rds = redis.Redis.from_url(settings.redis_url)
    streams = [settings.keys.requests, *(settings.keys.pinned_requests(w) for w in ("w1", "w2"))]
    async with RolloutClient(settings) as client:
        await client.pause("wait", holder="test")  # nothing is taken: the requests stay queued
        task = asyncio.ensure_future(client.generate([_prompt(i) for i in range(8)], {"max_tokens": 16}, timeout_s=60))
        await async_wait_until(lambda: sum(rds.xlen(s) for s in streams) == 8, 10, "8 requests queued")
        for stream in streams:
            if rds.xlen(stream):
                rds.xgroup_setid(stream, "workers", "$")  # the group passed them: orphans
        server.stop(signal.SIGTERM)
        server.start()
        await async_wait_until(lambda: sum(rds.xlen(s) for s in streams) >= 8, 10, "the orphans back after the restart")
        await client.resume(holder="test")
        trajectories = await task
        assert [t.completion_token_ids for t in trajectories] == [_prompt(i)[:16] for i in range(8)]
        await async_wait_until(lambda: sum(rds.xlen(s) for s in streams) == 0, 10, "every request stream drained")
    rds.close()


@pytest.mark.parametrize("server", [True], indirect=True, ids=["appendonly"])
async def test_a_request_pending_on_a_worker_that_no_longer_holds_it_is_served_after_a_restart(
    server: RedisServer, fleet: tuple[Settings, WorkerProcs]
) -> None:
    """A Redis killed within a second of a worker's answer can come back with the answer's ack, delete and result
    all lost: the entry pending on a worker that finished with it, and a producer still waiting. Made here by
    delivering a queued entry to w1's consumer from outside w1. After the restart w1 finds it pending and not in
    flight, twice, and requeues it: the call is answered, and the streams drain (a chaos run's drain once found
    such an entry pending for good)."""
    settings, procs = fleet
    rds = redis.Redis.from_url(settings.redis_url)
    async with RolloutClient(settings) as client:
        await client.pause("wait", holder="test")  # nothing is taken: the request stays queued
        task = asyncio.ensure_future(client.generate([_prompt(1)], {"max_tokens": 16}, timeout_s=60))
        await async_wait_until(lambda: rds.xlen(settings.keys.requests) == 1, 10, "the request queued")
        [(_, [(entry_id, _)])] = rds.xreadgroup("workers", "w1", {settings.keys.requests: ">"}, count=1)
        pending = rds.xpending_range(settings.keys.requests, "workers", "-", "+", 10, consumername="w1")
        assert [p["message_id"] for p in pending] == [entry_id]  # pending on w1, which never read it
        server.stop(signal.SIGTERM)
        server.start()
        await client.resume(holder="test")
        [trajectory] = await task
        assert trajectory.completion_token_ids == _prompt(1)[:16]
        assert "no longer has in flight" in procs.log("w1")
        await async_wait_until(lambda: rds.xlen(settings.keys.requests) == 0, 10, "the requests stream drained")
        assert not rds.xpending_range(settings.keys.requests, "workers", "-", "+", 10, consumername="w1")
    rds.close()
