"""`rollout-svc chaos --minutes 1`: a minute of load under every kind of fault, and a clean ledger (a soak: `make
test-long`, not `make test`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollout_svc.tools.chaos.soak import FAULT_KINDS
from rollout_svc.tools.chaos.sync_faults import SYNC_FAULT_KINDS
from tests.support import ROOT


@pytest.mark.timeout(300)  # a minute of faults, the start, the drain, one last sync and the checks: ~70-130 s
def test_a_minute_of_chaos_leaves_a_clean_ledger(tmp_path):
    command = [sys.executable, "-m", "rollout_svc", "chaos", "--minutes", "1", "--seed", "7"]
    command += ["--log-dir", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=290)
    story = run.stdout[-6000:] + run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert {"requests", "faults", "violations"} <= summary.keys()
    assert summary["violations"] == [], story
    assert run.returncode == 0, story
    assert summary["requests"] >= 500, story
    assert summary["answered"] == summary["requests"]
    assert set(summary["faults"]) == {*FAULT_KINDS, "kill_sender", *SYNC_FAULT_KINDS}  # those aimed at the syncs
    assert summary["syncs"]["syncs_committed"] > 0, summary["syncs"]
    # bounded requests (max_staleness 0) across those syncs: some cut by their workers, none generated past the bound
    assert summary["bounded"]["cut_for_staleness"] >= 1, summary["bounded"]
    assert all(count >= 1 for count in summary["faults"].values()), summary["faults"]
    assert summary["syncs"].get("late_workers_on_time", 0) >= 1, summary["syncs"]
    assert summary["outcomes"]["aborted_by_user"] > 0  # the session aborts hit something
    assert "SIGKILL" in story and "SIGSTOP" in story and "Redis back from its append-only file" in story
