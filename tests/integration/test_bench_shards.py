"""`rollout-svc bench`'s shards section, tiny: 1 and 2 shards of a local Redis Cluster (one echo worker each), then
one plain redis-server; every figure positive, every shard's workers served, every process it started gone."""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from rollout_svc.tools.bench.shards import ROLES, ShardsPlan, render_shards, run_shards_bench

TICKS_S = 0.02  # two 10 ms ticks: how far a difference of two tick-counted CPU readings may be off
READ_S = 0.05  # how long reading every meter may take (Redis INFO, psutil over the worker processes)

pytestmark = [
    pytest.mark.timeout(90),  # a shared 2-CPU machine; alone it takes ~10 s
    pytest.mark.skipif(
        shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
        reason="needs redis-server and redis-cli on PATH",
    ),
]


def test_shards_bench_tiny(tmp_path: Path) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # 2,000 requests: a run of ~0.2 s, long beside the 10 ms ticks that the workers' and the machine's CPU is read in.
    plan = ShardsPlan(shard_counts=(1, 2), workers_per_shard=1, requests=2000, runs=1, producers=2)
    figures = run_shards_bench(Console(quiet=True), tmp_path, plan, command="pytest")
    cpus = psutil.cpu_count()

    assert [(p.where, p.shards, p.workers) for p in figures.cluster] == [("cluster", 1, 1), ("cluster", 2, 2)]
    assert figures.plain is not None and (figures.plain.shards, figures.plain.workers) == (1, 1)
    for point in [*figures.cluster, figures.plain]:
        assert point.requests == 2000 and point.requests_per_s > 0, point
        assert all(point.cpu_us[role] > 0 for role in (*ROLES, "machine")), point  # each one worked
        # Our processes are part of the machine, and the machine has `cpus` cores. The workers' and the machine's CPU
        # (psutil, /proc/stat) count whole ticks, so a difference of two readings is off by up to 2 ticks (20 ms) per
        # process and per CPU; the meters are read just outside the timed window (a few ms).
        ours_s, machine_s = point.cores_busy * point.elapsed_s, point.machine_busy * point.elapsed_s
        assert ours_s <= machine_s + TICKS_S * (cpus + point.workers), (ours_s, machine_s, point)
        assert machine_s <= cpus * (point.elapsed_s + READ_S) + TICKS_S * cpus, (machine_s, point)
        assert point.producers_rate is not None and point.producers_rate > 0, point
        assert point.producers_busy is not None and point.producers_busy > 0, point
        span_s = plan.producers * plan.requests / point.producers_rate
        assert point.producers_busy * span_s <= cpus * span_s + TICKS_S * cpus, (span_s, point)
        # every shard's workers served some of the requests, and every answer came from a known worker
        assert set(point.served) == {f"g{i}" for i in range(point.shards)}, point.served
        assert all(count > 0 for count in point.served.values()) and sum(point.served.values()) == 2000, point

    text = render_shards(figures)
    assert "## (s) Scaling over shards" in text and "`pytest`" in text
    assert "| 2 | 2 |" in text and "(one redis-server)" in text and "N=64:" in text

    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, [(p.pid, p.cmdline()) for p in left]
