"""`rollout-svc bench`'s hop section, tiny: vllm-router in front of two trivial backends beside rollout-svc's echo
workers, and Redis memory per queued request; every figure positive, every process it started gone afterwards."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from rich.console import Console

from rollout_svc.tools.bench.hop import HopPlan, render_hop, run_hop_bench

TICKS_S = 0.02  # two 10 ms ticks: how far a difference of two tick-counted CPU readings may be off
TICKED_PROCESSES = 3  # read with psutil: the router and its 2 backends, or our 2 workers
READ_S = 0.05  # how long reading every meter may take (Redis INFO, psutil over the processes)

pytestmark = pytest.mark.timeout(120)  # a shared 2-CPU machine; alone it takes ~10 s


def test_hop_bench_tiny(tmp_path: Path) -> None:
    pytest.importorskip("vllm_router")
    pytest.importorskip("aiohttp")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # Enough requests at each load that every process's CPU is tens of ms: psutil reads it in 10 ms ticks (a 0.5 s
    # window alone held 13 requests when the router stalled for a second on a loaded CI machine).
    plan = HopPlan(
        in_flights=(8,),
        duration_s=0.5,
        min_requests=300,
        single_requests=300,
        batched_requests=1000,
        batched_runs=1,
        memory_levels=(1000,),
        rounds=2,
    )
    figures = run_hop_bench(None, Console(quiet=True), tmp_path, plan, command="pytest")
    cpus = psutil.cpu_count()

    assert [len(r) for r in figures.router_rounds] == [len(r) for r in figures.ours_rounds] == [2]
    assert len(figures.router_single_rounds) == len(figures.ours_single_rounds) == 2
    points = [
        *(p for r in figures.router_rounds for p in r),
        *figures.router_single_rounds,
        figures.batched,
        *(p for r in figures.ours_rounds for p in r),
        *figures.ours_single_rounds,
    ]
    for point in points:
        assert point.requests > 0 and point.requests_per_s > 0 and point.p50_ms > 0, point
        assert set(point.cpu_us) in ({"client", "router", "backends"}, {"client", "workers", "redis"}), point
        assert all(us > 0 for us in point.cpu_us.values()), point  # each process worked for the requests
        # No more than the machine's cores over the window. The router's, backends' and workers' CPU (psutil) counts
        # whole ticks, so a difference of two readings is off by up to 2 ticks (20 ms) per process; the meters are
        # read just outside the timed window (a few ms).
        cpu_s = sum(point.cpu_us.values()) * point.requests / 1e6
        assert cpu_s <= cpus * (point.elapsed_s + READ_S) + TICKS_S * TICKED_PROCESSES, (cpu_s, point)
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
