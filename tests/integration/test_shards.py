"""The integration suite's core on shards: order, sessions, a crash, control, weight-sync barriers, each on one Redis
(one shard, the default) and on a local 3-primary Redis Cluster (workers in shards g0, g1 and g2, one per primary);
then killing one shard's primary, which fails only that shard's requests.

Echo workers: what is checked is the queue, placement and the control and weight-sync protocols across shards.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import uvloop

from rollout_svc import RolloutClient
from rollout_svc.client.status import fleet_status
from rollout_svc.client.weight_sender import WeightSender
from rollout_svc.config import Settings
from rollout_svc.connections.topology import close_router, redis_router, shard_url
from rollout_svc.connections.urls import redis_async
from rollout_svc.dataplane.reaper import Reaper
from rollout_svc.deploy.redis_cluster import RedisClusterServers, free_cluster_ports
from rollout_svc.fleet import Fleet
from tests.support import SYNC_ECHO_ARGS, SYNC_HEARTBEAT_TTL_S, WorkerProcs, async_wait_until

PROMPT = list(range(1, 21))


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers("127.0.0.1", free_cluster_ports(3), 3, fresh=True) as servers:
        yield servers


# (where, the shard of each worker): one Redis holds one shard; the cluster one shard per primary, g0 with two workers
# (a crash in g0 is taken over by its sibling: reaping stays within a shard).
LAYOUTS = {"one-redis": ["g0", "g0", "g0"], "cluster": ["g0", "g0", "g1", "g2"]}


@pytest.fixture(params=sorted(LAYOUTS))
def where(request: pytest.FixtureRequest, redis_url: str, rds: redis.Redis) -> tuple[str, str]:
    """(layout name, URL), every node flushed."""
    if request.param == "one-redis":
        return request.param, redis_url
    servers: RedisClusterServers = request.getfixturevalue("redis_cluster")
    for port in servers.ports:
        with servers.client(port) as node:
            node.flushall()
    return request.param, servers.url


@pytest.fixture
def heartbeat_ttl_s() -> float:
    """The workers' heartbeat TTL (a test parametrized with `heartbeat_ttl_s` overrides it)."""
    return 2.0


@pytest.fixture
def shard_settings(where: tuple[str, str], tmp_path: Path, heartbeat_ttl_s: float) -> Settings:
    root = tmp_path / "checkpoints"
    root.mkdir()
    return Settings(
        redis_url=where[1],
        key_prefix="test",
        heartbeat_interval_s=0.2,
        heartbeat_ttl_s=heartbeat_ttl_s,
        read_block_ms=50,
        request_timeout_s=60,
        redis_outage_s=3.0,
        checkpoint_root=root,
        weight_sync_timeout_s=15.0,
        control_timeout_s=15.0,
    )


@pytest.fixture
def echo_args() -> tuple[str, ...]:
    """Options every echo worker of `fleet_procs` gets (a test parametrizes it)."""
    return ()


@pytest.fixture
def fleet_procs(
    shard_settings: Settings, tmp_path: Path, where: tuple[str, str], echo_args: tuple[str, ...]
) -> Iterator[dict[str, str]]:
    """The layout's echo workers, live: worker id -> shard (`fleet_procs.procs`: the `WorkerProcs`)."""
    procs = WorkerProcs(shard_settings, tmp_path)
    layout = Layout({f"w{i}": shard for i, shard in enumerate(LAYOUTS[where[0]])})
    layout.procs = procs
    try:
        for worker_id, shard in layout.items():
            procs.start(
                worker_id, "--engine", "echo", "--echo-token-delay-s", "0.02", *echo_args, env={"ROLLOUT_SHARD": shard}
            )
        asyncio.run(_wait_live(shard_settings, len(layout), procs))
        yield layout
    finally:
        procs.stop_all()


class Layout(dict[str, str]):
    procs: WorkerProcs


async def _wait_live(settings: Settings, count: int, procs: WorkerProcs) -> None:
    async with RolloutClient(settings) as client:

        async def live() -> bool:
            for worker_id, proc in procs.procs.items():
                assert proc.poll() is None, f"worker {worker_id} exited: {procs.log(worker_id)[-3000:]}"
            return len(await client.workers()) == count

        await async_wait_until(live, 60, f"{count} live workers")


async def test_order_and_sessions_stay_on_one_worker_and_spread_over_every_shard(shard_settings, fleet_procs):
    sessions = [f"session-{i % 60}" for i in range(600)]
    workers_of: dict[str, set[str]] = collections.defaultdict(set)
    async with RolloutClient(shard_settings) as client:
        for part in range(2):
            prompts = [[part + 1, i % 1000 + 1, 7] for i in range(600)]
            trajectories = await client.generate(prompts, {"max_tokens": 3}, session_ids=sessions)
            assert [t.prompt_token_ids for t in trajectories] == prompts, "results out of input order"
            assert all(t.completion_token_ids == p[:3] for t, p in zip(trajectories, prompts, strict=True))
            for session, t in zip(sessions, trajectories, strict=True):
                workers_of[session].add(t.worker_id)
        split = {s: ws for s, ws in workers_of.items() if len(ws) > 1}
        assert not split, f"sessions served by more than one worker: {split}"
        unkeyed = await client.generate([PROMPT] * 400, {"max_tokens": 2})
        served = collections.Counter(fleet_procs[t.worker_id] for t in unkeyed)
        assert set(served) == set(fleet_procs.values()), f"unkeyed requests did not reach every shard: {served}"
        shards = {fleet_procs[w] for ws in workers_of.values() for w in ws}
        assert shards == set(fleet_procs.values()), f"sessions placed on shards {shards} only"
        status = await fleet_status(shard_settings)
        assert sorted(status["shards"]) == sorted(set(fleet_procs.values()))
        assert sum(d["length"] for d in status["streams"].values()) == 0, "something left queued"


# 30 tokens x 0.1 s: 3 s a request, so the victim is found holding some. At 0.02 s (0.6 s a request) a CI run's victim,
# busy at its last heartbeat, had answered all it held before the kill, and the batch ended inside its heartbeat TTL.
@pytest.mark.parametrize("echo_args", [("--echo-token-delay-s", "0.1")])
async def test_a_worker_killed_with_requests_in_flight_loses_none(shard_settings, fleet_procs):
    siblings = {w for w, shard in fleet_procs.items() if list(fleet_procs.values()).count(shard) > 1}
    async with RolloutClient(shard_settings) as client:
        prompts = [[i % 50 + 1] * 30 for i in range(300)]
        calls = asyncio.ensure_future(client.generate(prompts, {"max_tokens": 30}, timeout_s=60))

        async def stopped_holding_requests() -> str | None:
            """A worker whose shard has another worker (to take its requests over), stopped (SIGSTOP) while it
            holds requests it has not answered; None (every one running again) if none does yet."""
            for status in await client.workers():
                if status.worker_id not in siblings or not status.in_flight:
                    continue
                fleet_procs.procs.kill(status.worker_id, signal.SIGSTOP)
                await asyncio.sleep(0.1)  # an answer it sent before it stopped reaches Redis
                if await _holds(shard_settings, fleet_procs[status.worker_id], status.worker_id):
                    return status.worker_id
                fleet_procs.procs.kill(status.worker_id, signal.SIGCONT)
            return None

        victim = await async_wait_until(stopped_holding_requests, 20, "a worker holding requests")
        fleet_procs.procs.kill(victim)  # SIGKILL: what it holds is reclaimed once its heartbeat expires
        trajectories = await asyncio.wait_for(calls, 60)
        assert [t.completion_token_ids for t in trajectories] == [p[:30] for p in prompts]
        assert victim not in {w.worker_id for w in await client.workers()}


async def _holds(settings: Settings, shard: str, worker_id: str) -> bool:
    """Whether `worker_id` of `shard` holds a request it took and has not answered (an entry in the pending entries
    list of the shard's shared, pinned or token request stream), as its reaper would find it."""
    shard_settings = settings.copy_with(shard=shard)
    keys = shard_settings.keys
    client = redis_async(shard_url(settings.redis_url, shard), decode_responses=False)
    try:
        streams = (keys.requests, keys.pinned_requests(worker_id), keys.token_requests)
        return bool(await Reaper(client, shard_settings).pending_keys(worker_id, streams, 1))
    finally:
        await client.aclose()


async def test_pause_resume_and_abort_reach_every_shard(shard_settings, fleet_procs):
    async with RolloutClient(shard_settings) as client:
        epoch = await client.pause("keep", timeout_s=15)
        assert epoch > 0 and await client.is_paused()
        per_shard = await _shard_states(shard_settings)
        assert set(per_shard) == set(fleet_procs.values()) and all(s.paused for s in per_shard.values()), per_shard
        waiting = asyncio.ensure_future(client.generate([PROMPT] * 30, {"max_tokens": 2}, session_ids=None))
        await async_wait_until(lambda: _queued(shard_settings, 30), 10, "30 requests queued over the shards")
        await asyncio.sleep(0.5)  # time passes: a worker taking work while paused would answer (in 0.04 s) meanwhile
        assert not waiting.done(), "a request was served while every shard was paused"
        assert await _queued(shard_settings, 30)
        assert all(w.state == "paused" for w in await client.workers())
        await client.resume(timeout_s=15)
        assert all(t.finish_reason == "length" for t in await asyncio.wait_for(waiting, 30))
        await client.pause("keep", timeout_s=15)
        queued = asyncio.ensure_future(client.generate([PROMPT] * 30, {"max_tokens": 2}))
        await async_wait_until(lambda: _queued(shard_settings, 30), 10, "30 requests queued before the abort")
        await client.abort(all=True, timeout_s=15)
        answered = await asyncio.wait_for(queued, 30)
        assert {t.abort_cause for t in answered} == {"user"}, "abort(all) did not answer every shard's queued requests"
        await client.resume(timeout_s=15)


async def _queued(settings: Settings, count: int) -> bool:
    """Whether `count` requests wait, untaken, in the request streams of every shard together."""
    streams = (await fleet_status(settings))["streams"].values()
    return sum(depth["queued"] for depth in streams) == count


async def _shard_states(settings: Settings) -> dict[str, Any]:
    fleet = Fleet(settings)
    try:
        await fleet.refresh()
        return {name: await link.control.state() for name, link in fleet.links.items()}
    finally:
        await fleet.close()


@pytest.mark.parametrize(("heartbeat_ttl_s", "echo_args"), [(SYNC_HEARTBEAT_TTL_S, SYNC_ECHO_ARGS)])
async def test_weight_sync_barriers_span_every_shard(shard_settings, fleet_procs):
    weights = {"model.embed_tokens.weight": torch.randn(64, 32), "model.norm.weight": torch.randn(32)}
    async with WeightSender(settings=shard_settings) as sender, RolloutClient(shard_settings) as client:
        report = await sender.update(weights.items(), version=1)
        assert report.loaded == sorted(fleet_procs) and not report.stale and not report.dead
        assert {name: s.weight_version for name, s in (await _shard_states(shard_settings)).items()} == dict.fromkeys(
            set(fleet_procs.values()), 1
        ), "the version was not committed in every shard"
        after = await client.generate([PROMPT] * 40, {"max_tokens": 2}, session_ids=[f"s{i}" for i in range(40)])
        assert {t.weight_version for t in after} == {1} and all(t.staleness == 0 for t in after)
        assert {w.weight_version for w in await client.workers()} == {1}


def test_the_cli_on_a_cluster_status_covers_every_shard_and_batch_jobs_are_refused(redis_cluster, tmp_path):
    import json
    import subprocess
    import sys

    for port in redis_cluster.ports:
        with redis_cluster.client(port) as node:
            node.flushall()
    cli = [str(Path(sys.executable).parent / "rollout-svc")]
    url = redis_cluster.url
    status = subprocess.run([*cli, "status", "--json", "--redis-url", url], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["shards"] == ["g0"] and json.loads(status.stdout)["unreachable_shards"] == []
    worker = subprocess.run([*cli, "batch-worker", "--redis-url", url], capture_output=True, text=True, timeout=60)
    assert worker.returncode == 2 and "not a Redis Cluster" in worker.stderr, worker.stderr
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    submit = subprocess.run([*cli, "batch", "submit", str(lines), "--redis-url", url], capture_output=True, text=True)
    assert submit.returncode != 0 and "not a Redis Cluster" in submit.stderr, submit.stderr


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_the_cluster_client_replaces_node_connections_whose_socket_died(redis_cluster, run):
    """The client of the keys outside every shard (`redis_router`, redis-py's cluster client) after its sockets to
    every primary failed while idle (the loop closed their transports, as it does on a reset): the next commands
    reconnect and go through. On uvloop (serve's loop) they raised `RuntimeError` ("the handler is closed") before."""

    async def main() -> tuple[int, list[bytes | None]]:
        router = redis_router(redis_cluster.url, decode_responses=False)
        try:
            keys = [f"k{i}" for i in range(12)]  # on every primary
            for i, key in enumerate(keys):
                await router.set(key, i)
            died = 0
            for node in router.get_nodes():
                for connection in node._connections:
                    if connection._writer is not None:
                        connection._writer.transport.abort()  # as the loop does with a socket that failed
                        died += 1
            await asyncio.sleep(0.05)
            return died, [await router.get(key) for key in keys]
        finally:
            await close_router(router)

    died, values = run(main())
    assert died >= 3 and values == [str(i).encode() for i in range(12)], (died, values)


# Last in this module: it kills a primary of the module's cluster. 20 tokens x 0.1 s: 2 s a request, so g1's workers
# still hold theirs at the kill (at 0.02 s they were done in 0.4 s, near the age of a heartbeat saying they were busy).
@pytest.mark.timeout(90)
@pytest.mark.parametrize("echo_args", [("--echo-token-delay-s", "0.1")])
async def test_killing_one_shards_primary_fails_only_its_requests(shard_settings, fleet_procs, where, request):
    if where[0] != "cluster":
        pytest.skip("one Redis is one shard: killing it is tests/integration/test_redis_restart.py")
    servers: RedisClusterServers = request.getfixturevalue("redis_cluster")
    g1_workers = [w for w, shard in fleet_procs.items() if shard == "g1"]
    g1_port = int(shard_url(shard_settings.redis_url, "g1").rsplit(":", 1)[1].split("/")[0])
    sessions = [f"s{i}" for i in range(300)]
    async with RolloutClient(shard_settings) as client:
        slow = {"max_tokens": 20}
        calls = asyncio.ensure_future(
            client.generate([[i % 90 + 1] * 20 for i in range(300)], slow, session_ids=sessions, timeout_s=60)
        )

        async def running() -> bool:
            return sum(w.in_flight for w in await client.workers()) > 0

        await async_wait_until(running, 20, "requests in flight")  # enqueued in every shard: the kill loses answers
        try:
            servers.processes[g1_port].send_signal(signal.SIGKILL)
            servers.processes[g1_port].wait(10)
            trajectories = await asyncio.wait_for(calls, 45)
            g1 = {w for w, shard in fleet_procs.items() if shard == "g1"}
            failed = [t for t in trajectories if t.error_code is not None]
            served = [t for t in trajectories if t.error_code is None]
            assert failed, "no request was lost with the shard's primary"
            errors = collections.Counter((t.error_code, (t.error or "")[:60]) for t in failed)
            assert all(t.error_code == "shard_unavailable" and "shard g1" in (t.error or "") for t in failed), errors
            assert served and all(t.worker_id not in g1 and t.finish_reason in ("stop", "length") for t in served)
            # The other shards go on: new sessions and unkeyed requests are placed on the shards still live.
            again = await client.generate([PROMPT] * 60, {"max_tokens": 2}, session_ids=[f"n{i}" for i in range(60)])
            assert all(t.error_code is None and t.worker_id not in g1 for t in again)
        finally:
            for worker_id in g1_workers:  # its Redis is gone: it cannot drain, so it is not asked to
                fleet_procs.procs.kill(worker_id)
            with contextlib.suppress(Exception):
                servers.processes.pop(g1_port, None)
