"""`rollout-svc bench`'s fleet-scale section, tiny: two fleets of simulated GPUs, each measured on a private Redis
(Redis CPU and commands per request, the idle fleet, pause acknowledgements, a checkpoint commit, placement), a
row each in the section and a plot beside it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from rollout_svc.tools.bench.scale import ScalePlan, draw_scale, render_scale, run_scale_bench

pytestmark = pytest.mark.timeout(300)


def test_scale_bench_tiny(tmp_path: Path) -> None:
    plan = ScalePlan(
        fleets=(2, 8), per_process=4, requests=200, batch=25, cycles=3, syncs=1, cluster_shards=0, idle_s=1.0
    )
    run = run_scale_bench(None, Console(file=io.StringIO()), tmp_path, plan, command="tiny")
    assert [(r.workers, r.shards) for r in run.rows] == [(2, 1), (8, 1)]
    # A new session is placed: more commands, clear at 2 workers (16 against 6 a request). At 8, each batch of
    # requests without one wakes all 8 workers and the two measures come within 10% (20 against 17-21 on a busy host).
    assert run.rows[0].commands_new_session > run.rows[0].commands_plain, run.rows[0]
    for row in run.rows:
        assert row.commands_new_session > 0 and row.commands_plain > 0, row
        assert 0 < row.pause_p50_ms <= row.pause_p99_ms, row
        assert row.commit_s > 0 and row.idle_commands_per_s > 0, row
        assert 1.0 <= row.max_over_ideal <= 2.0, row  # 2 x W equal requests: no worker more than twice its share
    run.plot = draw_scale(run, tmp_path / "fleet-scale.png")
    assert (tmp_path / run.plot).stat().st_size > 10_000
    text = render_scale(run)
    assert "| 8 | one |" in text and "fleet-scale.png" in text and "Command: `tiny`" in text
