"""Section (g) of `rollout-svc bench`: batch jobs on RQ beside `RolloutClient.chat` on the same echo workers.

One cluster of `BATCH_WORKERS` echo workers; the same ShareGPT first turns (chat, `max_tokens` 16) go once through
`RolloutClient.chat` (all at once) and once as a batch file run by one `rollout-svc batch-worker --burst` (from
`batch submit` to `completed`, `batch_concurrency` lines in flight). The ratio is the price of the batch path: the
job's per-line plan, the lease, the submitted marks, the once-only output script and the output file.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from rollout_svc.batch.jobs import submit_batch
from rollout_svc.batch.store import BatchStore
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import EngineSettings, Settings, settings_env
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.deploy.processes import die_with_parent
from rollout_svc.tools import dataset
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import private_settings

BATCH_WORKERS = 2
MAX_TOKENS = 16


@dataclass
class BatchFigures:
    lines: int
    client_per_s: float
    batch_per_s: float  # from the run's start (the batch `in_progress`) to `completed`
    batch_total_s: float  # from `batch submit` to `completed`, the batch worker's start-up included
    concurrency: int

    @property
    def ratio(self) -> float:
        return self.batch_per_s / self.client_per_s


def batch_overhead(redis_url: str | None, lines: int, log_dir: Path, console: Console) -> BatchFigures:
    settings = private_settings(redis_url, "bench-batch")
    cluster = LocalCluster(settings, BATCH_WORKERS, EngineSettings(engine="echo", max_num_seqs=4096), log_dir=log_dir)
    conversations = dataset.first_turns(lines, max_chars=400)
    with Progress(None, "bench (g) batch jobs beside the Python client"), cluster.running(ready_timeout_s=60):
        client_per_s = asyncio.run(_client_rate(settings, conversations))
        batch_per_s, batch_total_s = asyncio.run(_batch_rate(settings, conversations, log_dir))
    figures = BatchFigures(lines, client_per_s, batch_per_s, batch_total_s, settings.batch.batch_concurrency)
    console.print(figures, f"ratio {figures.ratio:.3f}")
    return figures


async def _client_rate(settings: Settings, conversations: list[list[dict]]) -> float:
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    async with RolloutClient(settings) as client:
        await client.chat(conversations[:50], params)  # warm-up
        started = time.perf_counter()
        trajectories = await client.chat(conversations, params)
        elapsed_s = time.perf_counter() - started
    assert all(t.finish_reason in ("stop", "length") for t in trajectories)
    return len(conversations) / elapsed_s


async def _batch_rate(settings: Settings, conversations: list[list[dict]], log_dir: Path) -> tuple[float, float]:
    body = b"".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "echo", "messages": c, "max_tokens": MAX_TOKENS, "temperature": 0.0},
            }
        ).encode()
        + b"\n"
        for i, c in enumerate(conversations)
    )
    store = BatchStore(settings)
    env = {**os.environ, **settings_env(settings)}
    args = [sys.executable, "-m", "rollout_svc", "batch-worker", "--burst", "--redis-url", settings.redis_url]
    try:
        started = time.perf_counter()
        file_id = await store.create_file(body, "bench.jsonl", "batch")
        batch_id = await submit_batch(store, file_id, "/v1/chat/completions")
        with open(log_dir / "batch-worker.log", "ab") as out:
            worker = subprocess.Popen(die_with_parent(args), env=env, stdout=out, stderr=subprocess.STDOUT)
        running_at = None
        try:
            while True:
                meta = await store.batch(batch_id)
                assert meta is not None
                if running_at is None and meta["status"] != "validating":
                    running_at = time.perf_counter()
                if meta["status"] in ("completed", "failed", "cancelled"):
                    break
                if worker.poll() is not None:
                    raise RuntimeError(f"the batch worker exited early; see {log_dir / 'batch-worker.log'}")
                await asyncio.sleep(0.01)
            ended = time.perf_counter()
        finally:
            worker.wait(timeout=60)
        assert meta["status"] == "completed" and int(meta["failed"]) == 0, meta
    finally:
        await store.close()
    assert running_at is not None
    return len(conversations) / max(1e-3, ended - running_at), ended - started


def report(figures: BatchFigures | None, command: str) -> list[str]:
    if figures is None:
        return []
    return [
        "",
        "## (g) Batch jobs on RQ beside the Python client",
        "",
        f"Command: `{command}`. {BATCH_WORKERS} echo workers; {figures.lines} ShareGPT first turns as chat requests",
        f"(`max_tokens` {MAX_TOKENS}), once through `RolloutClient.chat` (all at once) and once as a batch file run by",
        f"one `rollout-svc batch-worker --burst` ({figures.concurrency} lines in flight), timed from `batch submit`",
        "to `completed`; the batch's rate is from its run's start (status `in_progress`, polled every 10 ms).",
        "",
        "| path | requests/s |",
        "|---|---|",
        f"| `RolloutClient.chat` | {figures.client_per_s:,.0f} |",
        f"| batch job, running | {figures.batch_per_s:,.0f} |",
        f"| ratio batch / client | {figures.ratio:.2f} |",
        "",
        "From `batch submit` to `completed`, the batch worker's start-up (RQ, its scheduler, a fork) included:",
        f"{figures.batch_total_s:.2f} s for {figures.lines} lines.",
    ]
