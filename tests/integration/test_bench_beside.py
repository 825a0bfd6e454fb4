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
    plan = BesidePlan(commit="HEAD", workers=(2,), requests=300, in_flight=8, rounds=1, profiled=200, read_aheads=(4,))
    run = run_beside_bench(Console(file=io.StringIO()), tmp_path, plan, command="tiny")
    for side in ("this", "earlier", "this@4", "earlier/split"):
        [figures] = run.rounds[side][2]
        assert figures["requests_per_s"] > 0 and figures["redis_us"] > 0 and figures["workers_us"] > 0, figures
        assert 3 <= figures["commands"] < 100, figures  # an enqueue, a read, a publish, a result read at least
        scripts = run.scripts_of(side, 2)  # the SLOWLOG pass: each request enqueued and published by a script
        assert scripts["enqueue"][0] > 0 and scripts["publish"][0] > 0 and scripts["plain"][0] > 0, scripts
        assert all(us > 0 for _calls, us, _inner in scripts.values()), scripts
        assert scripts["publish"][2] >= scripts["publish"][0], scripts  # an XACK a request, at least, inside it
    text = render_beside(run)
    earlier = f"`{run.earlier_commit}`"
    assert "Command: `tiny`" in text and f"| 2 | {earlier} |" in text and "| publish |" in text
    assert "The most of it went to `" in text and "(this, read-ahead 4) |" in text
    assert f"| 2 | {earlier} (split: capacity 4 a worker) |" in text  # 8 in flight over 2 workers
    assert f"| 2 | this | {earlier} | " in text and f"| 2 | this, read-ahead 4 | {earlier} | " in text
    assert f"| 2 | {earlier} split (4 a worker) | {earlier} | " in text
    assert f"| 2 | this | {earlier} split (4 a worker) | " in text
    # the split fleet's workers served at that capacity (`rollout-svc up --max-num-seqs 4`), the others at the default
    logged = {side: (tmp_path / f"{side}-2-0.log").read_text(errors="replace") for side in ("earlier", "earlier-split")}
    assert logged["earlier-split"].count("serving echo (capacity 4)") == 2, logged["earlier-split"][-2000:]
    assert "(capacity 4)" not in logged["earlier"] and "serving echo (capacity" in logged["earlier"]


def test_a_split_side_runs_the_earlier_tree_at_in_flight_over_w_a_worker() -> None:
    plan = BesidePlan(workers=(2, 4), in_flight=64, read_aheads=(16,))
    assert plan.sides(2) == ["earlier", "this"]
    assert plan.sides(4) == ["earlier", "this", "this@16", "earlier/split"]
    assert [plan.capacity(side, 4) for side in plan.sides(4)] == [0, 0, 0, 16]
    assert BesidePlan(in_flight=10).capacity("earlier/split", 4) == 3  # rounded up: all 10 fit
    assert BesidePlan(split=False).sides(4) == ["earlier", "this", "this@16", "this@64"]


def test_an_unknown_commit_is_refused_by_name() -> None:
    with pytest.raises(RuntimeError, match="'no-such-commit' is not in"):
        resolve(project_root(), "no-such-commit")
