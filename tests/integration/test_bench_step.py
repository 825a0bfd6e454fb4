"""`rollout-svc bench`'s RL-step section, tiny: a seeded sampled step on 4 simulated GPUs of one worker process,
FIFO and placement by cost, against the oracle lower bound."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from rollout_svc.tools.bench.simstep import StepPlan, render_step, run_step_bench

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH"),
]


def test_step_bench_tiny(tmp_path: Path) -> None:
    plan = StepPlan(
        prompts=16, samples=4, gpus=(4,), engines_per_process=4, length_median=200, length_p99=1500,
        max_tokens=3000, max_prompt_tokens=256, time_scale=25.0,
    )  # fmt: skip
    figures = run_step_bench(None, Console(file=io.StringIO()), tmp_path, plan, command="tiny")
    assert [(r.gpus, r.placement) for r in figures.rows] == [(4, "fifo"), (4, "cost")]
    oracle_s = figures.oracle_s[4]
    assert 0 < figures.longest_alone_s <= oracle_s
    for row in figures.rows:
        # The oracle is a lower bound; the wall clock only adds (scheduling, the machine's load).
        assert row.makespan_s >= 0.95 * oracle_s, (row, oracle_s)
        assert 1 <= len(row.busy_s) <= 4  # the simulated GPUs that served
        assert 0 <= row.idle_fraction < 1 and row.tokens_per_gpu_s > 0
        assert row.output_tokens == figures.rows[0].output_tokens  # seeded: the same workload in every row
    assert len(figures.rows[1].busy_s) == 4  # by cost: every simulated GPU got work
    text = render_step(figures)
    assert "simulated" in text and "oracle" in text and "| 4 | cost |" in text
