"""`rollout-svc bench`'s section beside an earlier commit, tiny: the earlier tree taken out of this checkout's
history, each tree's own fleet and client measured in turn, a row each and the ratios."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from rollout_svc.tools.bench.beside import BesidePlan, project_root, render_beside, resolve, run_beside_bench

pytestmark = pytest.mark.timeout(300)


def test_beside_bench_tiny(tmp_path: Path) -> None:
    plan = BesidePlan(commit="HEAD", workers=(1,), requests=300, in_flight=8, rounds=1, profiled=200, read_aheads=(4,))
    run = run_beside_bench(Console(file=io.StringIO()), tmp_path, plan, command="tiny")
    for side in ("this", "earlier", "this@4"):
        [figures] = run.rounds[side][1]
        assert figures["requests_per_s"] > 0 and figures["redis_us"] > 0 and figures["workers_us"] > 0, figures
        assert 3 <= figures["commands"] < 100, figures  # an enqueue, a read, a publish, a result read at least
        scripts = run.scripts_of(side, 1)  # the SLOWLOG pass: each request enqueued and published by a script
        assert scripts["enqueue"][0] > 0 and scripts["publish"][0] > 0 and scripts["plain"][0] > 0, scripts
        assert all(us > 0 for _calls, us, _inner in scripts.values()), scripts
        assert scripts["publish"][2] >= scripts["publish"][0], scripts  # an XACK a request, at least, inside it
    text = render_beside(run)
    assert "Command: `tiny`" in text and f"| 1 | `{run.earlier_commit}` |" in text and "| 1 | " in text
    assert "| 1 | `" in text and "| publish |" in text and "The most of it went to `" in text
    assert "(this, read-ahead 4) |" in text and "| 1 | 4 | " in text and "| 1 | default | " in text


def test_an_unknown_commit_is_refused_by_name() -> None:
    with pytest.raises(RuntimeError, match="'no-such-commit' is not in"):
        resolve(project_root(), "no-such-commit")
