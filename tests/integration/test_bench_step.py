"""`rollout-svc bench`'s RL-step section, tiny: a seeded sampled step on 4 simulated GPUs of one worker process,
FIFO, placement by cost, with moves, expected lengths and partial rollouts, against the oracle lower bound."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from rollout_svc.tools.bench.simstep import TIMELINE_ROWS, StepPlan, draw_timeline, render_step, run_step_bench

pytestmark = pytest.mark.timeout(180)


def test_step_bench_tiny(tmp_path: Path) -> None:
    plan = StepPlan(
        prompts=16,
        samples=4,
        gpus=(4,),
        engines_per_process=4,
        length_median=200,
        length_p99=1500,
        max_tokens=3000,
        max_prompt_tokens=256,
        time_scale=25.0,
        move_after_s=2.0,
        router_policies=("power_of_two",),
    )
    figures = run_step_bench(None, Console(file=io.StringIO()), tmp_path, plan, command="tiny")
    placements = [
        (4, "fifo"),
        (4, "cost"),
        (4, "cost+moves"),
        (4, "cost+moves+expected"),
        (4, "cost+moves+partial"),
        (4, "vllm-router power_of_two"),
    ]
    assert [(r.gpus, r.placement) for r in figures.rows] == placements
    oracle_s = figures.oracle_s[4]
    assert 0 < figures.longest_alone_s <= oracle_s
    fifo, cost, moves, expected, partial, router = figures.rows
    # vllm-router in front of the same engines over HTTP: the same work
    for row in (fifo, cost, moves, expected, router):
        # The oracle is a lower bound; the wall clock only adds (scheduling, the machine's load).
        assert row.makespan_s >= 0.95 * oracle_s, (row, oracle_s)
        assert row.output_tokens == fifo.output_tokens and row.cut == 0  # seeded: the same workload, run whole
    for row in figures.rows:
        assert len(row.busy_s) == 4  # every simulated GPU, busy or not
        assert 0 <= row.idle_fraction < 1 and row.tokens_per_gpu_s > 0
    assert min(cost.busy_s.values()) > 0  # by cost: every simulated GPU got work
    # Partial rollouts: 90% of the 16 groups (15) finished, the rest cut with the tokens they had
    assert 1 <= partial.cut <= 4 and 0 <= partial.cut_tokens < partial.output_tokens < fifo.output_tokens
    # every row knows what ran where: every GPU, and as many requests as it served
    assert all(len(row.spans) == 4 and sum(map(len, row.spans.values())) == 16 * 4 for row in figures.rows)
    figures.timeline = draw_timeline(figures, tmp_path / "step-timeline.png")
    assert (tmp_path / figures.timeline).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(TIMELINE_ROWS) <= {row.placement for row in figures.rows}
    text = render_step(figures)
    assert f"]({figures.timeline})" in text
    assert "simulated" in text and "oracle" in text and "| 4 | cost |" in text and "| 4 | cost+moves+partial |" in text
