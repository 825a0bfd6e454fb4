"""`rollout-svc demo`'s workload (ShareGPT first turns and multi-turn sessions at once) on 2 echo workers: neither
serves less than a third of the tokens (before placement by cost the first reader took most: 72 requests and 16 on 2
vLLM workers, 82% of the work), and every session stays on one worker. The same run on vLLM served 44 and 44
(docs/simulator.md, placement)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from rollout_svc.config import EngineSettings
from rollout_svc.tools.demo import run_demo

pytestmark = pytest.mark.timeout(240)


def test_the_demo_splits_its_work_evenly_over_two_workers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    # 10 ms a token: the run (~6 s) waits on generation, not on the CPU, so a worker the loaded host leaves without
    # a core for a moment does not decide the split (at 2 ms a token the whole run took ~2 s, and CI split it 67/33).
    engine = EngineSettings(engine="echo", echo_token_delay_s=0.01)
    record = run_demo(None, 2, engine, prompts=64, sessions=8, turns=3, max_tokens=128)
    served = Counter(t.worker_id for t in record.trajectories if t.finish_reason != "error")
    assert sum(served.values()) == 64 + 8 * 3 and len(served) == 2
    # Placement balances the work, in tokens (prompt and output), not the count of requests: ShareGPT's lengths vary,
    # so counts moved between 44/44 and 33/55 in runs whose tokens were within 13% of even (ten runs, 2026-11-29, an
    # idle machine). A session's later turns go where its first went, whatever they cost, and a worker the machine
    # leaves without a core rightly takes less (the pull model gives work to whoever has room): under `make test`'s
    # load one run split 65/35 (CI, 2026-11-29). Neither worker under a third is still far from the 82/18 it guards.
    work = Counter()
    for t in record.trajectories:
        work[t.worker_id] += len(t.prompt_token_ids) + len(t.completion_token_ids)
    total = sum(work.values())
    assert all(tokens >= total / 3 for tokens in work.values()), work
    assert all(len(set(workers)) == 1 for workers in record.session_workers.values())
