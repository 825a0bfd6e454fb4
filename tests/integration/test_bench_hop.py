"""`rollout-svc bench`'s hop section, tiny: vllm-router in front of two trivial backends beside rollout-svc's echo
workers, and Redis memory per queued request; every figure positive, every process it started gone afterwards."""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from rollout_svc.bench_hop import HopPlan, render_hop, run_hop_bench

pytestmark = [
    pytest.mark.timeout(120),  # a shared 2-CPU machine; alone it takes ~10 s
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]


def test_hop_bench_tiny(tmp_path: Path) -> None:
    pytest.importorskip("vllm_router")
    pytest.importorskip("aiohttp")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    plan = HopPlan(
        in_flights=(8,),
        duration_s=0.5,
        single_requests=50,
        batched_requests=200,
        batched_runs=1,
        memory_levels=(1000,),
    )
    figures = run_hop_bench(None, Console(quiet=True), tmp_path, plan, command="pytest")

    points = [*figures.router, figures.router_single, figures.batched, *figures.ours, figures.ours_single]
    for point in points:
        assert point.requests > 0 and point.requests_per_s > 0 and point.p50_ms > 0, point
        assert set(point.cpu_us) in ({"client", "router", "backends"}, {"client", "workers", "redis"}), point
        assert all(us >= 0 for us in point.cpu_us.values()) and point.cpu_us["client"] > 0, point
    assert [p.in_flight for p in figures.router] == [p.in_flight for p in figures.ours] == [8]
    [memory] = figures.memory
    assert memory.queued == 1000 and memory.used_bytes > memory.payload_bytes > 1000 * 1000, memory
    assert all(value > 0 for _, value, _, _ in figures.ratios())
    assert figures.router_command.startswith("vllm-router --worker-urls http://127.0.0.1:")

    text = render_hop(figures)
    assert "## (h) Hop: rollout-svc vs vllm-router" in text and "`pytest`" in text
    assert figures.router_command in text

    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, [(p.pid, p.cmdline()) for p in left]
