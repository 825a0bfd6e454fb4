"""`rollout-svc chaos`, briefly: the soak's machinery (its fleet and `serve`, every kind of fault, the ledger and its
checks) runs and finds a clean ledger. The minute-long soak is tests/long/test_chaos.py (`make test-long`); operators
run `rollout-svc chaos --minutes M`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_svc.tools.chaos.soak import FAULT_KINDS
from rollout_svc.tools.chaos.step_restarts import STEP_REQUESTS
from tests.support import ROOT


def named_logs(violations: list[dict[str, str]], log_dir: Path) -> dict[str, str]:
    """The end of the log of each worker slot (and of the client) a violation names: what a failure needs read."""
    text = json.dumps(violations[:5])
    paths = [p for p in sorted(log_dir.glob("*.log")) if re.search(rf"\b{re.escape(p.stem)}\b", text)]
    return {p.name: p.read_text(errors="replace")[-2500:] for p in [*paths, log_dir / "chaos.log"] if p.exists()}


@pytest.mark.timeout(120)  # 24 s of faults, the start (serve's too), the drain and the checks: ~30 s
def test_a_short_chaos_run_injects_every_kind_of_fault_and_leaves_a_clean_ledger(tmp_path):
    command = [sys.executable, "-m", "rollout_svc", "chaos", "--minutes", "0.4", "--seed", "7", "--no-syncs"]
    command += ["--log-dir", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=110)
    story = run.stdout[-6000:] + run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"requests", "faults", "violations"} <= summary.keys()
    # The violations first: a long story is cut where CI prints it.
    violations = summary["violations"]
    logs = named_logs(violations, tmp_path) if violations else {}
    # A string, not a tuple: pytest prints a non-string message through saferepr, cut to 240 characters (as a CI
    # run's was, leaving the logs out).
    parts = [json.dumps(violations[:5], indent=1), str(summary.get("worker_error_samples")), story[-2000:]]
    parts += [f"--- {name}\n{text}" for name, text in logs.items()]
    assert violations == [], "\n".join(parts)
    assert run.returncode == 0, story
    assert summary["requests"] >= 100, story
    assert summary["answered"] == summary["requests"]
    assert set(summary["faults"]) == set(FAULT_KINDS)
    assert all(count >= 1 for count in summary["faults"].values()), summary["faults"]
    # a trainer killed holding an HTTP pause: serve counted the lapse, and the agents' chats were answered meanwhile
    assert summary["http_pauses"]["http_pause_lapses"] >= 1 and summary["http_pauses"]["agent_chats_ok"] >= 1, story
    # a trainer killed mid-step: a new process attached to its step and collected every request of it, echoed
    assert summary["step_restarts"]["steps_restarted"] >= 1, story
    assert summary["step_restarts"]["trajectories_collected"] >= STEP_REQUESTS, story
    assert "SIGKILL" in story or "SIGSTOP" in story, story


@pytest.mark.parametrize("held", [True, False])
async def test_a_late_worker_is_excused_for_the_time_the_fleet_was_held_paused_only(
    held, settings, rds, tmp_path, monkeypatch
):
    """A late worker timed from live to serving the committed version: the time the fleet was held paused (by anyone:
    a sync whose receiver was killed just before it went live keeps its own pause until its transfer fails) is not
    held against it; the same wait with nobody holding a pause is a violation. A 2-minute run of seed 1234 counted
    two late workers so, each behind a sync that lost a receiver 1-3 s before they went live (10 s to fail)."""
    import asyncio
    import time
    from collections import Counter
    from types import SimpleNamespace

    from rollout_svc.keys import StateField
    from rollout_svc.tools.chaos import sync_faults
    from rollout_svc.tools.chaos.fleet import Slot
    from rollout_svc.tools.chaos.ledger import Ledger

    keys, late, holder = settings.keys, "late-1", StateField.holder("sync-1")
    fleet = SimpleNamespace(log_dir=tmp_path, settings=settings, redis_url=settings.redis_url)
    syncer = SimpleNamespace(counts=Counter())
    faults = sync_faults.SyncFaults(fleet, Ledger(time.time()), lambda *_: None, syncer)  # type: ignore[arg-type]
    state = {StateField.WEIGHT_VERSION: "3"} | ({holder: "keep"} if held else {})
    rds.hset(keys.state, mapping=state)
    rds.hset(keys.worker(late), mapping={"state": "paused" if held else "starting", "weight_version": "3"})
    wait_s = 0.6  # over the bound the test sets: 0.3 s

    async def released() -> None:
        await asyncio.sleep(wait_s)
        rds.hdel(keys.state, holder)
        rds.hset(keys.worker(late), "state", "serving")

    monkeypatch.setattr(sync_faults, "LATE_WORKER_S", 0.3)
    try:
        await asyncio.gather(faults._time_late(Slot(late, late)), released())
    finally:
        await faults.close()
    if held:
        assert faults.violations == [] and faults.counts["late_workers_excused"] == 1
    else:
        assert [v["check"] for v in faults.violations] == ["late_worker"], faults.violations
