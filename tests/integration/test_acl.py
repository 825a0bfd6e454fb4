"""Redis ACL users (`connections.acl`) against a real redis-server: producer, worker and admin each do their job, and
a producer's credentials cannot steer the fleet (they may cancel: tombstones, DESIGN.md section 4).

Each test has a redis-server of its own: creating the users turns its default user off, which the session's Redis,
shared by every other test, must never see.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from rollout_svc import AccessDeniedError, RolloutClient, Settings, SyncRolloutClient
from rollout_svc.client.status import fleet_status
from rollout_svc.connections.acl import Credentials, create_users, permission_denied
from rollout_svc.control.commands import resume
from rollout_svc.control.plane import ControlPlane, FleetState
from rollout_svc.dataplane.reaper import Reaper
from rollout_svc.dataplane.streams import Enqueue
from rollout_svc.dataplane.worker_streams import TakeOptions, WorkerStreams
from rollout_svc.deploy.local import PrivateRedis
from rollout_svc.keys import JOINED, Keys
from rollout_svc.protocol import RolloutRequest, WorkerStatus, encode
from rollout_svc.weightsync.plane import WeightSyncPlane
from tests.integration.test_cluster import ctrl_c, rollout_up
from tests.support import ROOT, WorkerProcs, async_wait_until, free_port, pending, wait_until

PREFIX = "test"


def role_settings(url: str) -> Settings:
    """The conftest's fast settings, connecting as the user in `url`."""
    return Settings(
        redis_url=url,
        key_prefix=PREFIX,
        heartbeat_interval_s=0.2,
        heartbeat_ttl_s=2.0,
        read_block_ms=50,
        request_timeout_s=60,
        control_timeout_s=10,
    )


KEYS = Keys(PREFIX)


@pytest.fixture
def own_redis() -> Iterator[str]:
    """A redis-server of this test's own on a free port (default user on, no users yet); its URL."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    server = PrivateRedis(url)
    server.start()
    yield url
    server.stop()


@pytest.fixture
def users(own_redis: str) -> Credentials:
    """The three users created as `up --acl` does it: the default user is off afterwards."""
    client = redis.Redis.from_url(own_redis)
    try:
        return create_users(client, KEYS, own_redis)
    finally:
        client.close()


@pytest.fixture
def admin(users: Credentials) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(users.admin)
    yield client
    client.close()


@pytest.fixture
def fleet(users: Credentials, tmp_path: Path) -> Iterator[WorkerProcs]:
    """Two echo workers connected as `worker` (50 ms a token), live."""
    procs = WorkerProcs(role_settings(users.worker), tmp_path)
    for worker_id in ("echo-0", "echo-1"):
        procs.start(worker_id, "--engine", "echo", "--echo-token-delay-s", "0.05")
    procs.wait_live("echo-0", "echo-1")
    yield procs
    procs.stop_all()


async def test_a_producer_generates_tokenizes_and_cancels_but_cannot_steer_the_fleet(users, admin, fleet):
    async with RolloutClient(role_settings(users.producer)) as producer:
        [trajectory] = await producer.generate([[1, 2, 3]], {"max_tokens": 3}, session_ids=["s-1"])
        assert trajectory.completion_token_ids == [1, 2, 3]  # the echo of its prompt
        [token_ids] = await producer.tokenize(["hello"])
        assert token_ids and all(isinstance(t, int) for t in token_ids)
        assert await producer.finish_session("s-1")
        assert len(await producer.workers()) == 2

        # A cancelled call writes tombstones, and the workers abort what they were running.
        call = asyncio.create_task(producer.generate([[7] * 40] * 4, {"max_tokens": 40}))
        await async_wait_until(lambda: pending(admin, KEYS.requests) == 4, 5, "4 requests in flight")
        call.cancel()
        await async_wait_until(lambda: admin.zcard(KEYS.cancelled) == 4, 5, "4 tombstones")

        async def idle() -> bool:
            return sum(w.in_flight for w in await producer.workers()) == 0

        await async_wait_until(idle, 5, "the cancelled requests to be aborted on the workers")

        # A completion target cuts the rest with the same rights (tombstones, a sweep of the queue): partial rollouts.
        out = await producer.generate([[5] * 3, [7] * 40, [8] * 40], {"max_tokens": 40}, completion_target=0.3)
        assert out[0].completion_token_ids == [5] * 3
        assert [t.abort_cause for t in out[1:]] == ["partial", "partial"]

        # A named step (its record, the index of steps, its results kept and renewed), attached to and finished.
        [first] = await producer.generate([[4, 5, 6]], {"max_tokens": 2}, step_id="acl-step")
        [again] = await producer.attach_step("acl-step")
        assert again.completion_token_ids == first.completion_token_ids == [4, 5]
        assert await producer.finish_step("acl-step")

        # Steering is refused with a clear error, and the desired state is unchanged.
        state, commands = admin.hgetall(KEYS.state), admin.zcard(KEYS.commands)
        with pytest.raises(AccessDeniedError, match="`admin` user") as denied:
            await producer.pause("keep")
        assert denied.value.action == "pause" and not denied.value.recoverable
        with pytest.raises(AccessDeniedError):
            await producer.abort(all=True)
        assert admin.hgetall(KEYS.state) == state and admin.zcard(KEYS.commands) == commands
        assert not await producer.is_paused()  # reading the state is allowed

    async with RolloutClient(role_settings(users.admin)) as operator:
        await operator.pause("keep")  # both workers, connected as `worker`, acknowledge
        assert await operator.is_paused(per_worker=True) == {"echo-0": True, "echo-1": True}
        await operator.resume()
        assert not await operator.is_paused()
    report = await fleet_status(role_settings(users.admin))  # what `rollout-svc status` reads
    assert [w["worker_id"] for w in report["workers"]] == ["echo-0", "echo-1"] and not report["paused"]


def test_a_producer_cannot_write_control_keys_directly_nor_through_a_script(users, own_redis):
    producer = redis.Redis.from_url(users.producer)
    try:
        refused = {
            "write the state": lambda: producer.hset(KEYS.state, "pause:me", "keep"),
            "log a command": lambda: producer.zadd(KEYS.commands, {b"x": 1}),
            "nudge the control channel": lambda: producer.publish(KEYS.control_channel, "command"),
            "announce an ack": lambda: producer.publish(KEYS.acks_channel, "echo-0 9 0"),
            "read the sync order (its token)": lambda: producer.get(KEYS.weight_sync),
            "write a sync order": lambda: producer.set(KEYS.weight_sync, b"x"),
            "forge a heartbeat": lambda: producer.hset(KEYS.worker("echo-0"), "state", "serving"),
            "flush Redis": lambda: producer.flushall(),
            "touch keys of another prefix": lambda: producer.set("other:key", b"x"),
            "forge a result": lambda: producer.xadd(KEYS.results("p"), {b"m": b"x"}),
            "delete the requests stream": lambda: producer.delete(KEYS.requests),
            "put a string where the tombstones go": lambda: producer.set(KEYS.cancelled, b"x"),
            "run EVAL": lambda: producer.eval("return 1", 0),
        }
        for what, attempt in refused.items():
            with pytest.raises(NoPermissionError):
                attempt()
                pytest.fail(f"a producer could {what}")
        # A script runs under its caller's ACL: each redis.call is checked, so a script cannot escalate.
        forge = producer.register_script("return redis.call('HSET', KEYS[1], 'pause:me', 'keep')")
        with pytest.raises(ResponseError) as denied:
            forge(keys=[KEYS.state])
        assert permission_denied(denied.value)
        assert producer.hget(KEYS.state, "pause:me") is None
        assert producer.zadd(KEYS.cancelled, {b"request-1": 1}) == 1  # tombstones: allowed
    finally:
        producer.close()
    with pytest.raises(AuthenticationError):  # the default user is off: an anonymous connection can do nothing
        redis.Redis.from_url(own_redis).ping()


def request(request_id: str) -> Enqueue:
    return Enqueue(encode(RolloutRequest(request_id=request_id, prompt_token_ids=[1], reply_to=KEYS.results("p"))))


async def test_a_worker_reaps_reseeds_and_reaches_barriers_but_cannot_issue_commands(users, admin):
    settings = role_settings(users.worker)
    connection = AsyncRedis.from_url(users.worker)
    plane = ControlPlane(connection, settings)
    worker = WorkerStreams(plane.streams.connection)
    try:
        await plane.load_scripts()
        for worker_id in ("w-dead", "w-live"):
            await plane.registry.heartbeat(WorkerStatus(worker_id=worker_id))
            await plane.streams.connection.ensure_group(KEYS.pinned_requests(worker_id))
        await plane.streams.connection.ensure_group(KEYS.requests)
        await plane.streams.enqueue([request("r-1"), request("r-2"), request("r-3")], 100)
        assert len((await worker.take(TakeOptions("w-dead", 60_000), 2)).entries) == 2  # the take script, as a worker
        admin.delete(KEYS.worker("w-dead"))  # its heartbeat expired
        reaper = Reaper(connection, settings)
        assert await reaper.reap_dead("w-live") == {"w-dead": 2}  # reap lock, requeue script, forget
        [taken] = (await worker.take(TakeOptions("w-live", 60_000), 1)).entries
        assert await plane.recovery.dead_letter(
            taken, "max_deliveries", "a test", "w-live", maxlen=100, results_ttl_s=60
        )
        assert admin.xlen(KEYS.dead) == 1 and admin.xlen(KEYS.results("p")) == 1

        # A Redis that forgot: the worker re-seeds the state (HSETNX), but cannot change it once it exists.
        assert await plane.reseed(FleetState(epoch=5, holders={"operator": "keep"}))
        assert admin.hgetall(KEYS.state)[b"pause:operator"] == b"keep"
        assert not await plane.reseed(FleetState(epoch=6))
        with pytest.raises(NoPermissionError):
            await connection.hset(KEYS.state, "pause:operator", "")
        with pytest.raises(AccessDeniedError, match="`admin` user"):
            await plane.issue(resume())
        assert admin.hget(KEYS.state, "epoch") == b"5"
        with pytest.raises(NoPermissionError):  # tombstones are the producers'
            await connection.zadd(KEYS.cancelled, {b"r-9": 1})
        assert await plane.tombstones(0) == []

        # Weight sync: a worker reads the order and reaches barriers; it cannot write an order.
        sync = WeightSyncPlane(connection, settings)
        assert await sync.order() is None
        await sync.arrive("sync-1", JOINED, "w-live")
        assert admin.hgetall(KEYS.weight_barrier("sync-1", JOINED)) == {b"w-live": b"ok"}
        with pytest.raises(NoPermissionError):
            await connection.set(KEYS.weight_sync, b"forged")
    finally:
        await plane.close()
        await connection.aclose()


def rollout_svc(*args: str, timeout_s: float = 20) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "rollout_svc", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def test_acl_rules_prints_lines_an_operator_applies_and_up_acl_refuses_a_running_redis(own_redis):
    out = rollout_svc("acl", "rules", "--redis-url", own_redis, "--key-prefix", PREFIX)
    assert out.returncode == 0, out.stderr
    client = redis.Redis.from_url(own_redis)
    try:
        for line in out.stdout.splitlines():
            assert line.startswith("ACL SETUSER ")
            client.execute_command(*shlex.split(line))  # as `redis-cli` would send it
    finally:
        client.close()
    urls = dict(line.split(": ", 1) for line in out.stderr.splitlines())
    assert set(urls) == {"producer", "worker", "admin"}
    producer = redis.Redis.from_url(urls["producer"])
    try:
        assert producer.xadd(KEYS.requests, {b"m": b"x"})
        with pytest.raises(NoPermissionError):
            producer.hset(KEYS.state, "epoch", 9)
    finally:
        producer.close()

    refused = rollout_svc("up", "--redis-url", own_redis, "--workers", "1", "--engine", "echo", "--acl")
    assert refused.returncode == 2
    assert "create the users there yourself" in refused.stderr and "acl rules" in refused.stderr


def test_up_acl_starts_workers_as_worker_and_writes_the_credentials_file(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    acl_file = tmp_path / "acl.json"
    log_path = tmp_path / "up.log"  # rollout_up's
    args = ["--redis-url", url, "--workers", "1", "--engine", "echo", "--acl", "--acl-file", str(acl_file)]
    with rollout_up(tmp_path, *args) as up:
        wait_until(lambda: "Producers connect with" in log_path.read_text(), 25, "`up --acl` to be ready", 0.1)
        assert stat.S_IMODE(os.stat(acl_file).st_mode) == 0o600
        credentials = Credentials.read(acl_file)
        assert credentials.producer.startswith("redis://producer:") and credentials.producer in log_path.read_text()
        assert credentials.worker not in log_path.read_text()
        client = SyncRolloutClient(redis_url=credentials.producer)
        try:
            [trajectory] = client.generate([[4, 5]], {"max_tokens": 2}, timeout_s=10)
            assert trajectory.completion_token_ids == [4, 5]
            assert [w.worker_id for w in client.workers()] and not client.is_paused()
        finally:
            client.close()
        with pytest.raises(AuthenticationError):
            redis.Redis.from_url(url).ping()
        pause = rollout_svc("pause", "--redis-url", credentials.producer, "--timeout-s", "5")
        assert pause.returncode == 1 and "`admin` user" in pause.stderr
        ctrl_c(up, 20)
    assert not acl_file.exists()  # its passwords died with the private Redis


async def test_a_named_models_worker_and_producer_have_the_rights_of_the_default_models(users, tmp_path):
    """`roles` covers `{prefix}:model:{name}:...` as it covers the default model's keys (`Settings.model_name`)."""
    procs = WorkerProcs(role_settings(users.worker).copy_with(model_name="reference"), tmp_path)
    try:
        procs.start("ref-0", "--engine", "echo")
        procs.wait_live("ref-0")
        async with RolloutClient(role_settings(users.producer), model_name="reference") as producer:
            [trajectory] = await producer.generate([[1, 2, 3]], {"max_tokens": 3}, session_ids=["s-1"])
            assert trajectory.worker_id == "ref-0" and trajectory.completion_token_ids == [1, 2, 3]
            assert await producer.named_models() == ["reference"]  # the worker registered it; a producer reads it
            with pytest.raises(AccessDeniedError):
                await producer.pause("keep")
        async with RolloutClient(role_settings(users.admin), model_name="reference") as operator:
            await operator.pause("keep")
            assert await operator.is_paused(per_worker=True) == {"ref-0": True}
            await operator.resume()
        assert "NOPERM" not in procs.log("ref-0") and "could not add" not in procs.log("ref-0")
    finally:
        procs.stop_all()
