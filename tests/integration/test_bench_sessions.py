"""`rollout-svc bench`'s multi-turn sessions section, tiny: sticky sessions stay on one simulated GPU and find their
earlier turns in its prefix cache; the same sessions without stickiness find fewer."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from rollout_svc.tools.bench.simsessions import SessionsPlan, render_sessions, run_sessions_bench

pytestmark = pytest.mark.timeout(240)


def test_sessions_bench_tiny(tmp_path: Path) -> None:
    plan = SessionsPlan(
        sessions=12,
        turns=4,
        gpus=4,
        length_median=50,
        length_p99=200,
        max_tokens=400,
        tool_tokens=40,
        tool_wait_s=1.0,
        max_first_turn_tokens=256,
        time_scale=25.0,
    )
    figures = run_sessions_bench(None, Console(file=io.StringIO()), tmp_path, plan, command="tiny")
    sticky, free = figures.rows
    assert sticky.sticky and not free.sticky
    assert sticky.prompt_tokens == free.prompt_tokens > 0  # the same conversations, token for token
    assert len(sticky.latencies_s) == len(free.latencies_s) == 12 * 4
    assert sticky.one_worker_each
    # Turns 2..4 of a sticky session find the conversation so far cached (all but its last partial block)
    assert sticky.hit_rate > 0.5 and sticky.hit_rate > free.hit_rate + 0.2, (sticky.hit_rate, free.hit_rate)
    text = render_sessions(figures)
    assert "| on |" in text and "| off |" in text
