"""`rollout-svc bench`'s section (i), tiny: SkyRL's own `RemoteInferenceClient` through vllm-router (two trivial
backends) and through `serve` (2 echo workers); every figure positive, every process it started gone afterwards; and
`--only`'s section replacement keeping the rest of a report."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from rich.console import Console

from rollout_svc.tools.bench.run import replace_section
from rollout_svc.tools.bench.skyrl import SkyRLPlan, render_skyrl, run_skyrl_bench

pytestmark = pytest.mark.timeout(180)  # a shared 2-CPU machine; alone it takes ~15 s


def test_skyrl_bench_tiny(tmp_path: Path) -> None:
    pytest.importorskip("vllm_router")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # At least 100 requests a point: a 0.5 s window alone can hold a dozen where the machine stalls, too few for the
    # processes' CPU readings (10 ms ticks) to be above zero.
    plan = SkyRLPlan(in_flights=(1, 8), duration_s=0.5, min_requests=100, rounds=2)
    figures = run_skyrl_bench(None, Console(quiet=True), tmp_path, plan, "pytest")

    for point in [*figures.router, *figures.ours]:
        assert point.requests > 0 and point.requests_per_s > 0 and point.p50_ms > 0, point
        assert all(us > 0 for us in point.cpu_us.values()), point  # each process worked for the requests
    assert {frozenset(p.cpu_us) for p in figures.router} == {frozenset({"client", "router", "backends"})}
    assert {frozenset(p.cpu_us) for p in figures.ours} == {frozenset({"client", "serve", "workers", "redis"})}
    assert [p.in_flight for p in figures.router] == [p.in_flight for p in figures.ours] == [1, 8]
    assert [len(r) for r in figures.router_rounds] == [len(r) for r in figures.ours_rounds] == [2, 2]
    assert all(len(figures.rate_ratios(i)) == 2 for i in range(2))
    assert all(value > 0 for _, value, _, _ in figures.ratios())

    text = render_skyrl(figures)
    assert "RemoteInferenceClient" in text and "`pytest`" in text and figures.router_command in text
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, [(p.pid, p.cmdline()) for p in left]


def test_only_replaces_its_section_and_keeps_the_rest() -> None:
    report = "# Benchmarks\n\n## (h) Hop\n\nhop figures\n\n## (i) SkyRL\n\nold\n\n## (j) Shards\n\nshards\n"
    replaced = replace_section(report, "## (i) ", "\n## (i) SkyRL\n\nnew\n")
    assert replaced == "# Benchmarks\n\n## (h) Hop\n\nhop figures\n\n## (i) SkyRL\n\nnew\n\n## (j) Shards\n\nshards\n"
    assert replace_section("# Benchmarks\n\n## (h) Hop\n", "## (i) ", "\n## (i) SkyRL\n") == (
        "# Benchmarks\n\n## (h) Hop\n\n## (i) SkyRL\n"
    )
    first_time = replace_section("# B\n\n## (h) Hop\n\nh\n\n## (s) Shards\n\ns\n", "## (i) ", "\n## (i) SkyRL\n\nnew\n")
    assert first_time == "# B\n\n## (h) Hop\n\nh\n\n## (i) SkyRL\n\nnew\n\n## (s) Shards\n\ns\n"
    # a section rendered without the blank lines around it (or with more) still sits one blank line from each side
    assert replace_section(report, "## (i) ", "## (i) SkyRL\n\nnew\n\n\n") == replaced
