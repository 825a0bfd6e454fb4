"""`rollout-svc demo`: ShareGPT first turns plus multi-turn sessions through RolloutClient on a local cluster."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.protocol import SamplingParams, Trajectory
from rollout_svc.tools import dataset
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import percentile, private_settings


@dataclass
class DemoRecord:
    """Everything served, for the report. Latencies in seconds, from submission to result."""

    trajectories: list[Trajectory] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)
    session_workers: dict[str, list[str]] = field(default_factory=dict)


def run_demo(
    redis_url: str | None,
    workers: int,
    engine: EngineSettings,
    prompts: int,
    sessions: int,
    turns: int,
    max_tokens: int,
) -> DemoRecord:
    """Start a cluster, serve the prompts and sessions, print the report, stop the cluster.

    Progress goes to stdout: a bar on a terminal, else a line at least every 5 s (see `rollout_svc.tools.progress`).
    """
    console = Console()
    settings = private_settings(redis_url, "demo")
    first_turns = dataset.first_turns(prompts)
    session_turns = dataset.multi_turn(sessions, turns, skip=prompts)
    log_dir = Path(tempfile.mkdtemp(prefix="rollout-demo-"))
    cluster = LocalCluster(settings, workers, engine, log_dir=log_dir)
    console.print(f"starting {workers} {engine.engine} workers on {settings.redis_url} (logs: {log_dir})")
    with contextlib.ExitStack() as stack:
        with Progress(None, f"starting {workers} {engine.engine} workers"):
            stack.enter_context(cluster.running(ready_timeout_s=900))
        params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=max_tokens, seed=0)
        started = time.perf_counter()
        record = asyncio.run(_drive(settings, first_turns, session_turns, params))
        elapsed_s = time.perf_counter() - started
    _report(console, record, elapsed_s, workers)
    return record


async def _drive(
    settings: Settings, first_turns: list[list[dict]], session_turns: list[list[str]], params: SamplingParams
) -> DemoRecord:
    record = DemoRecord()
    total = len(first_turns) + sum(len(s) for s in session_turns)
    async with RolloutClient(settings) as client:
        with Progress(total, "requests") as progress:

            async def one(conversation: list[dict], session_id: str | None = None) -> Trajectory:
                submitted = time.perf_counter()
                [trajectory] = await client.chat([conversation], params, [session_id] if session_id else None)
                record.latencies_s.append(time.perf_counter() - submitted)
                record.trajectories.append(trajectory)
                record.questions.append(conversation[-1]["content"])
                progress.advance()
                return trajectory

            async def session(user_turns: list[str]) -> None:
                session_id, messages = uuid.uuid4().hex, []
                record.session_workers[session_id] = []
                for turn in user_turns:
                    messages.append({"role": "user", "content": turn})
                    trajectory = await one(list(messages), session_id)
                    record.session_workers[session_id].append(trajectory.worker_id)
                    messages.append({"role": "assistant", "content": trajectory.text})
                await client.finish_session(session_id)

            await asyncio.gather(*(one(c) for c in first_turns), *(session(s) for s in session_turns))
    return record


def _report(console: Console, record: DemoRecord, elapsed_s: float, workers: int) -> None:
    ok = [t for t in record.trajectories if t.finish_reason != "error"]
    output_tokens = sum(len(t.completion_token_ids) for t in ok)
    latencies = sorted(record.latencies_s)
    table = Table("metric", "value", title="rollout-svc demo")
    table.add_row("requests served", f"{len(ok)} ok, {len(record.trajectories) - len(ok)} errors")
    table.add_row(
        "sessions", f"{len(record.session_workers)} x {max(map(len, record.session_workers.values()), default=0)} turns"
    )
    table.add_row(
        "workers", f"{workers}: " + ", ".join(f"{w} served {n}" for w, n in Counter(t.worker_id for t in ok).items())
    )
    table.add_row("wall time", f"{elapsed_s:.1f} s")
    table.add_row("throughput", f"{output_tokens / elapsed_s:.1f} output tok/s, {len(ok) / elapsed_s:.2f} req/s")
    for q in (50, 90, 99):
        table.add_row(f"latency p{q} (submit to result)", f"{percentile(latencies, q):.2f} s")
    sticky = all(len(set(ws)) == 1 for ws in record.session_workers.values())
    table.add_row("sessions sticky", "yes: every turn of a session on one worker" if sticky else "NO")
    console.print(table)
    # Show one whole session (its turns, in order), then two single-turn answers.
    asked = dict(zip((t.request_id for t in record.trajectories), record.questions, strict=True))
    session = next(iter(record.session_workers), None)
    shown = [t for t in record.trajectories if session and t.session_id == session]
    shown += [t for t in record.trajectories if t.session_id is None and t.finish_reason != "error"][:2]
    for t in shown:
        where = f"session {t.session_id[:8]}, " if t.session_id else ""
        console.rule(f"[bold]{where}{t.worker_id}[/bold], {len(t.completion_token_ids)} tokens, {t.finish_reason}")
        console.print(f"[bold]Q:[/bold] {asked[t.request_id][:300]}")
        console.print(f"[bold]A:[/bold] {t.text[:500] if t.finish_reason != 'error' else t.error}")
