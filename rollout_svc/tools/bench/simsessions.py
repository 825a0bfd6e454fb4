"""`rollout-svc bench`, section (l): multi-turn agent sessions on a simulated GPU fleet (`--engine sim`), sticky
placement beside the same workload with stickiness off, and the prefix-cache hits each gets.

Each session is `turns` turns of one conversation: a ShareGPT first user turn (4 characters a token), then after
every model turn a tool result of `tool_tokens` tokens and a wait of `tool_wait_s` simulated seconds (the agent
running its tool), the next prompt being the whole conversation so far. Output lengths come from the sim's
log-normal model (median `length_median`, p99 `length_p99`); a turn's seed is fixed, so both rows serve the same
tokens. Sticky: every turn carries its session id (`session_ids`), so a session's turns run on one worker and find
its earlier turns in that engine's prefix cache; off: no session id, each turn placed by cost anywhere. Reported per
row: prefix-cache hit rate (`Trajectory.cached_tokens` over prompt tokens), makespan and turn latency (simulated s),
and whether every session stayed on one worker.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import Settings
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.protocol import Trajectory
from rollout_svc.tools.bench.simstep import SimFleetPlan, all_serving, sharegpt_prompts
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import percentile, private_settings

HEADING = "## (l) Multi-turn agent sessions on a simulated fleet"


@dataclass(frozen=True)
class SessionsPlan(SimFleetPlan):
    """Section (l)'s workload on its simulated fleet: agents' turns, shorter than an RL step's generations."""

    length_median: int = 300
    length_p99: int = 2000
    sessions: int = 128
    turns: int = 10
    gpus: int = 16
    max_tokens: int = 4096
    tool_tokens: int = 200
    tool_wait_s: float = 5.0  # simulated
    max_first_turn_tokens: int = 1024


@dataclass
class SessionsRow:
    sticky: bool
    prompt_tokens: int
    cached_tokens: int
    makespan_s: float  # simulated
    latencies_s: list[float]  # simulated, per turn
    one_worker_each: bool

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


@dataclass
class SessionsFigures:
    plan: SessionsPlan
    rows: list[SessionsRow] = field(default_factory=list)
    command: str = ""


def run_sessions_bench(
    redis_url: str | None, console: Console, log_dir: Path, plan: SessionsPlan | None = None, command: str = ""
) -> SessionsFigures:
    plan = plan or SessionsPlan()
    figures = SessionsFigures(plan, command=command)
    openings = sharegpt_prompts(plan.sessions, plan.max_first_turn_tokens)
    for sticky in (True, False):
        with Progress(None, f"bench (l) sessions, {plan.gpus} simulated GPUs, sticky {'on' if sticky else 'off'}"):
            row = _one_run(redis_url, plan, openings, sticky, log_dir)
        figures.rows.append(row)
        console.print(row)
    return figures


def _one_run(
    redis_url: str | None, plan: SessionsPlan, openings: list[list[int]], sticky: bool, log_dir: Path
) -> SessionsRow:
    settings = private_settings(redis_url, f"bench-sessions-{'sticky' if sticky else 'free'}")
    max_model_len = plan.turns * (plan.max_tokens + plan.tool_tokens) + plan.max_first_turn_tokens + 64
    cluster = LocalCluster(settings, 1, plan.engine(plan.gpus, max_model_len), log_dir=log_dir)
    with cluster.running(ready_timeout_s=120):
        return asyncio.run(_drive(settings, plan, openings, sticky))


async def _drive(settings: Settings, plan: SessionsPlan, openings: list[list[int]], sticky: bool) -> SessionsRow:
    scale = plan.time_scale
    latencies: list[float] = []
    served: list[Trajectory] = []
    workers: dict[int, set[str]] = {}
    async with RolloutClient(settings) as client:
        await all_serving(client, plan.gpus)

        async def session(index: int, opening: list[int]) -> None:
            rng = random.Random(index)
            prompt, session_id = list(opening), f"agent-{index}"
            for turn in range(plan.turns):
                params = {"max_tokens": plan.max_tokens, "temperature": 1.0, "seed": 1000 * index + turn}
                started = time.monotonic()
                [t] = await client.generate([prompt], params, [session_id] if sticky else None, timeout_s=3600)
                latencies.append((time.monotonic() - started) * scale)
                served.append(t)
                workers.setdefault(index, set()).add(t.worker_id)
                tool = [rng.randrange(32, 127) for _ in range(plan.tool_tokens)]
                prompt = [*prompt, *t.completion_token_ids, *tool]
                if turn + 1 < plan.turns:
                    await asyncio.sleep(plan.tool_wait_s / scale)
            if sticky:
                await client.finish_session(session_id)

        started = time.monotonic()
        await asyncio.gather(*(session(i, o) for i, o in enumerate(openings)))
        makespan_s = (time.monotonic() - started) * scale
    return SessionsRow(
        sticky,
        sum(len(t.prompt_token_ids) for t in served),
        sum(t.cached_tokens for t in served),
        makespan_s,
        sorted(latencies),
        all(len(w) == 1 for w in workers.values()),
    )


def render_sessions(f: SessionsFigures) -> str:
    p = f.plan
    lines = [
        f"{HEADING}\n",
        f"Command: `{f.command}`.\n" if f.command else "",
        f"{p.sessions} agent sessions of {p.turns} turns at once on {p.gpus} {p.fleet_words}: a ShareGPT first "
        f"turn, then after each model turn (log-normal length, median {p.length_median}, p99 {p.length_p99} tokens) "
        f"a tool result of {p.tool_tokens} tokens after a {p.tool_wait_s:g} s tool wait; each prompt is the whole "
        "conversation so far. Sticky: every turn carries its session id; off: none (each turn placed by cost). Hit "
        "rate: prompt tokens found in the engine's prefix cache (`Trajectory.cached_tokens`) over all prompt tokens.\n",
        "| sessions sticky | prefix-cache hit rate | prompt tokens | makespan (sim s) | turn latency p50 / p90 "
        "(sim s) | every session on one worker |",
        "|---|---|---|---|---|---|",
    ]
    for row in f.rows:
        lines.append(
            f"| {'on' if row.sticky else 'off'} | {row.hit_rate:.0%} | {row.prompt_tokens:,} | {row.makespan_s:.0f} | "
            f"{percentile(row.latencies_s, 50):.1f} / {percentile(row.latencies_s, 90):.1f} | "
            f"{'yes' if row.one_worker_each else 'no'} |"
        )
    return "\n".join(lines) + "\n"
