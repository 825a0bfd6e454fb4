"""`rollout-svc bench`'s shards section, tiny: 1 and 2 shards of a local Redis Cluster (one echo worker each), then
one plain redis-server; every figure positive, every shard's workers served, every process it started gone."""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from rollout_svc.bench_shards import ROLES, ShardsPlan, render_shards, run_shards_bench

pytestmark = [
    pytest.mark.timeout(90),  # a shared 2-CPU machine; alone it takes ~10 s
    pytest.mark.skipif(
        shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
        reason="needs redis-server and redis-cli on PATH",
    ),
]


def test_shards_bench_tiny(tmp_path: Path) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    plan = ShardsPlan(shard_counts=(1, 2), workers_per_shard=1, requests=500, runs=1, producers=2)
    figures = run_shards_bench(Console(quiet=True), tmp_path, plan, command="pytest")

    assert [(p.where, p.shards, p.workers) for p in figures.cluster] == [("cluster", 1, 1), ("cluster", 2, 2)]
    assert figures.plain is not None and (figures.plain.shards, figures.plain.workers) == (1, 1)
    for point in [*figures.cluster, figures.plain]:
        assert point.requests == 500 and point.requests_per_s > 0, point
        # Redis' and the client's clocks are precise; the workers' (psutil) tick every 10 ms: summed below
        assert point.cpu_us["redis"] > 0 and point.cpu_us["client"] > 0 and point.cpu_us["machine"] > 0, point
        assert all(point.cpu_us[role] >= 0 for role in ROLES), point
        assert point.producers_rate is not None and point.producers_rate > 0, point
        # every shard's workers served some of the requests, and every answer came from a known worker
        assert set(point.served) == {f"g{i}" for i in range(point.shards)}, point.served
        assert all(count > 0 for count in point.served.values()) and sum(point.served.values()) == 500, point

    assert sum(p.cpu_us["workers"] for p in [*figures.cluster, figures.plain]) > 0

    text = render_shards(figures)
    assert "## (s) Scaling over shards" in text and "`pytest`" in text
    assert "| 2 | 2 |" in text and "(one redis-server)" in text and "N=64:" in text

    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, [(p.pid, p.cmdline()) for p in left]
