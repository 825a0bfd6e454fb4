"""A local Redis Cluster as `up --redis-cluster N` starts it: it forms, survives a dead primary, stops cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rollout_svc.deploy.redis_cluster import RedisClusterServers, free_cluster_ports
from tests.support import ROOT, wait_until


def owners(servers: RedisClusterServers, tags: list[str]) -> dict[str, int]:
    """The port of the primary that serves each hash tag's slot."""
    client = servers.client(servers.ports[0])
    try:
        ranges = client.execute_command("CLUSTER", "SLOTS")
        result = {}
        for tag in tags:
            slot = client.execute_command("CLUSTER", "KEYSLOT", f"{{{tag}}}x")
            result[tag] = next(int(r[2][1]) for r in ranges if int(r[0]) <= slot <= int(r[1]))
        return result
    finally:
        client.close()


def redis_server_running(port: int) -> bool:
    """Whether some redis-server process serves `port` (its title is `redis-server host:port [cluster]`)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().decode(errors="replace")
            if "redis-server" in args and f":{port} " in args + " ":
                return True
    return False


def marked_failed(servers: RedisClusterServers, observer: int, dead: int) -> bool:
    client = servers.client(observer)
    try:
        try:
            nodes = client.execute_command("CLUSTER", "NODES")
        except (redis.TimeoutError, redis.ConnectionError):
            return False  # a stall of this shared machine (CI saw one): ask again until wait_until's deadline
        text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
        line = next(line for line in text.splitlines() if f":{dead}@" in line)
        return "fail" in line.split()[2].split(",") and "fail?" not in line
    finally:
        client.close()


@pytest.mark.timeout(60)  # about 6 s alone; more on a busy machine
def test_three_primaries_form_a_cluster_that_outlives_one_of_them():
    first = free_cluster_ports(3)
    # `up`'s nodes, but a 2 s node timeout (not 5 s) so that the dead one is flagged failed sooner.
    servers = RedisClusterServers("127.0.0.1", first, 3, node_timeout_ms=2000).start()
    data_dir = servers.data_dir
    try:
        infos = servers.infos()
        assert sorted(infos) == [first, first + 1, first + 2]
        assert all(i["cluster_state"] == "ok" and i["cluster_size"] == "3" for i in infos.values()), infos
        owner = owners(servers, ["g0", "g1", "g2"])
        assert sorted(owner.values()) == servers.ports  # one shard per primary

        dead = owner["g2"]
        os.kill(servers.processes[dead].pid, signal.SIGKILL)
        servers.processes[dead].wait(timeout=5)
        survivors = {tag: port for tag, port in owner.items() if port != dead}
        # Once the others flag it failed, they still serve their own slots: cluster-require-full-coverage no.
        for port in survivors.values():
            wait_until(partial(marked_failed, servers, port, dead), 25, f"{port} flagging {dead} failed")
        for tag, port in survivors.items():
            client = servers.client(port)
            try:
                assert client.set(f"{{{tag}}}x", 1)
                assert client.get(f"{{{tag}}}x") == b"1"
                assert servers.infos()[port]["cluster_state"] == "ok"
            finally:
                client.close()
    finally:
        servers.stop()
    assert not servers.processes
    for port in range(first, first + 3):
        assert not redis_server_running(port), f"a redis-server still serves {port}"
    assert not data_dir.exists()  # the temporary folder it made


def test_a_small_cluster_with_a_password_keeps_its_keys_across_a_restart(tmp_path: Path):
    """Fewer than 3 primaries (which redis-cli refuses) are joined by hand; a folder keeps the cluster."""
    first = free_cluster_ports(2)
    with RedisClusterServers("127.0.0.1", first, 2, data_dir=tmp_path, password="s3cret") as servers:
        assert {i["cluster_size"] for i in servers.infos().values()} == {"2"}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=first, retry=Retry(NoBackoff(), 0)).ping()
        cluster = redis.RedisCluster.from_url(servers.url)
        cluster.set("{g0}k", "a")
        cluster.set("{g1}k", "b")
        cluster.close()
    with RedisClusterServers("127.0.0.1", first, 2, data_dir=tmp_path, password="s3cret") as servers:
        cluster = redis.RedisCluster.from_url(servers.url)
        assert (cluster.get("{g0}k"), cluster.get("{g1}k")) == (b"a", b"b")
        cluster.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [str(first), str(first + 1)]
    assert not any(redis_server_running(p) for p in (first, first + 1))


def test_up_refuses_a_redis_that_is_no_cluster(redis_url: str):
    start = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_svc",
            "up",
            "--redis-url",
            redis_url,
            "--redis-cluster",
            "3",
            "--engine",
            "echo",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=25,
    )
    assert out.returncode == 2, out.stderr
    assert "not a Redis Cluster answers at --redis-url" in out.stderr
    assert time.monotonic() - start < 25
