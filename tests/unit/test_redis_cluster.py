"""`up --redis-cluster N` without Redis: ports, the nodes' command lines, and which shard each worker joins."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.deploy.redis_cluster import RedisClusterServers, cluster_ports, worker_shard


def test_workers_are_spread_over_the_shards():
    assert [worker_shard(i, 3) for i in range(7)] == ["g0", "g1", "g2", "g0", "g1", "g2", "g0"]
    assert [worker_shard(i, 1) for i in range(3)] == ["g0"] * 3
    with pytest.raises(ValueError):
        worker_shard(0, 0)


def test_each_worker_gets_its_shard_in_its_environment():
    cluster = LocalCluster(Settings(), 5, EngineSettings(engine="echo"), redis_cluster=3)
    children = cluster._worker_children({"ROLLOUT_SHARD": "g0", "OTHER": "x"})
    assert [c.env["ROLLOUT_SHARD"] for c in children] == ["g0", "g1", "g2", "g0", "g1"]
    assert all(c.env["OTHER"] == "x" for c in children)
    assert cluster.worker_shards() == ["g0", "g1", "g2", "g0", "g1"]


def test_without_a_cluster_every_worker_keeps_the_settings_shard():
    children = LocalCluster(Settings(), 3, EngineSettings(engine="echo"))._worker_children({})
    assert [c.env["ROLLOUT_SHARD"] for c in children] == ["g0"] * 3
    named = LocalCluster(Settings(shard="blue"), 2, EngineSettings(engine="echo"))
    assert named.worker_shards() == ["blue", "blue"]


def test_ports_and_node_command_lines(tmp_path: Path):
    assert cluster_ports(23000, 3) == [23000, 23001, 23002]
    with pytest.raises(ValueError, match="below 65536"):
        cluster_ports(55535, 2)  # 55536's bus port would be 65536
    with pytest.raises(ValueError, match="at least 1"):
        cluster_ports(23000, 0)
    servers = RedisClusterServers("127.0.0.1", 23000, 3, tmp_path, password="pw")
    args = servers.args(23001)
    text = " ".join(args)
    assert "--port 23001 --bind 127.0.0.1" in text
    assert "--cluster-enabled yes --cluster-config-file nodes-23001.conf" in text
    assert "--cluster-node-timeout 5000 --cluster-require-full-coverage no" in text
    assert f"--appendonly yes --appendfsync everysec --dir {tmp_path / '23001'}" in text
    assert "--requirepass pw --masterauth pw" in text
    assert "--protected-mode" not in args
    assert servers.url == "redis://:pw@127.0.0.1:23000/0"
    exposed = RedisClusterServers("127.0.0.1", 23000, 3, tmp_path, bind="0.0.0.0").args(23000)
    assert exposed[-2:] == ["--protected-mode", "no"]
