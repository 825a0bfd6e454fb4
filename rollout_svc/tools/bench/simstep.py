"""`rollout-svc bench`, section (j): one GRPO-shaped RL step on a simulated GPU fleet (`--engine sim`, workers/sim),
first-come-first-served placement beside placement by cost, with straggler moves (workers/moves.py), and with
partial rollouts too (the call ends once `partial_target` of its groups finished; the rest are cut), against the
oracle lower bound.

The step: `prompts` prompts x `samples` samples (`RolloutClient.sample`, seeded, so every row serves the same
workload), prompt lengths from ShareGPT's first turns (4 characters a token), output lengths from the sim's log-normal
model (median 1k, p99 16k tokens, 70% of the log-variance shared by a prompt's samples; `workers/sim/lengths.py`),
capped at `max_tokens`. Each row starts a fresh fleet of `gpus` simulated H100s serving the 7B profile,
`engines_per_process` to a worker process, and times the call; a simulated second lasts 1 / `time_scale` s.

Per row, from the call's step report (`RolloutClient.step_report`): the makespan (simulated s), each simulated GPU's
busy time (some request of its running: from the trajectories' queue and generation times), the fleet's idle fraction
(1 - busy / (gpus x makespan)), output tokens per GPU-second, and for partial rollouts the requests cut and the tokens
they carry to the next step. The oracle lower bound is the longer of the longest request run alone and the step's
total work at the fleet's peak throughput (prefill at the profile's 8,192-token step rate; decode at the batch size
that maximises tokens per second with the step's mean context, within the KV cache).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.client.steps import union, worker_spans
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.protocol import Trajectory
from rollout_svc.tools import dataset
from rollout_svc.tools.bench.simrouter import router_step
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import private_settings
from workers.sim.cost import StepCost
from workers.sim.engine import default_kv_cache_bytes
from workers.sim.profiles import gpu_profile, model_profile

HEADING = "## (j) RL step on a simulated fleet"


@dataclass(frozen=True)
class SimFleetPlan:
    """The simulated fleet a section runs on (`--engine sim`, workers/sim): GPUs of the profile `gpu` serving the
    profile `model`, output lengths log-normal (median and p99 in tokens), a simulated second lasting 1 /
    `time_scale` s of wall clock."""

    gpu: str = "h100"
    model: str = "qwen2.5-7b"
    length_median: int = 1000
    length_p99: int = 16000
    time_scale: float = 10.0

    def engine(self, engines: int, max_model_len: int) -> EngineSettings:
        """The engine settings of one worker process of `engines` simulated GPUs, contexts up to `max_model_len`."""
        return EngineSettings(
            engine="sim",
            sim_gpu=self.gpu,
            sim_model=self.model,  # type: ignore[arg-type]
            sim_engines=engines,
            sim_time_scale=self.time_scale,
            sim_length_median=self.length_median,
            sim_length_p99=self.length_p99,
            max_model_len=max_model_len,
        )

    @property
    def fleet_words(self) -> str:
        """The simulated fleet as a report describes it."""
        return (
            f"simulated {self.gpu.upper()}s serving the {self.model} profile (`--engine sim`, workers/sim; a simulated "
            f"second lasts 1/{self.time_scale:g} s here)"
        )


@dataclass(frozen=True)
class StepPlan(SimFleetPlan):
    prompts: int = 256
    samples: int = 8
    gpus: tuple[int, ...] = (16, 64)
    engines_per_process: int = 16
    max_tokens: int = 32768
    max_prompt_tokens: int = 2048
    placements: tuple[str, ...] = ("fifo", "cost", "cost+moves", "cost+moves+expected", "cost+moves+partial")
    partial_target: float = 0.9  # the completion target of the "+partial" rows: a fraction of the groups
    move_after_s: float = 20.0  # "+moves" rows: a generation may move after this long in its engine (simulated s)
    router_policies: tuple[str, ...] = ("round_robin", "power_of_two", "cache_aware", "sticky_least_loaded")


@dataclass
class StepRow:
    gpus: int
    placement: str
    makespan_s: float  # simulated
    busy_s: dict[str, float]  # simulated, per worker
    output_tokens: int
    cut: int = 0  # requests cut by the completion target
    moves: int = 0  # interruptions the trajectories were continued through (straggler moves)
    cut_tokens: int = 0  # the tokens they carry
    # per worker, the (start, end) of each request it ran, in simulated s from the step's start; and of those the
    # requests continued there after a straggler move
    spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    moved: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @property
    def idle_fraction(self) -> float:
        return 1 - sum(self.busy_s.values()) / (self.gpus * self.makespan_s)

    @property
    def tokens_per_gpu_s(self) -> float:
        return self.output_tokens / (self.gpus * self.makespan_s)


@dataclass
class StepFigures:
    plan: StepPlan
    rows: list[StepRow] = field(default_factory=list)
    oracle_s: dict[int, float] = field(default_factory=dict)  # gpus -> the lower bound (simulated s)
    longest_alone_s: float = 0.0
    command: str = ""
    timeline: str = ""  # the PNG of the step's timelines (`draw_timeline`), relative to BENCHMARKS.md; "": none


def sharegpt_prompts(count: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of ShareGPT first-turn lengths (4 characters a token, at most `max_tokens`, at least 16), of
    printable byte ids."""
    rng = random.Random(seed)
    turns = dataset.first_turns(count, max_chars=4 * max_tokens)
    lengths = [max(16, len(turn[0]["content"]) // 4) for turn in turns]
    return [[rng.randrange(32, 127) for _ in range(n)] for n in lengths]


def run_step_bench(
    redis_url: str | None, console: Console, log_dir: Path, plan: StepPlan | None = None, command: str = ""
) -> StepFigures:
    plan = plan or StepPlan()
    figures = StepFigures(plan, command=command)
    prompts = sharegpt_prompts(plan.prompts, plan.max_prompt_tokens)
    for gpus in plan.gpus:
        whole: list[Trajectory] = []  # a step run to its end: what the oracle bounds
        for placement in plan.placements:
            with Progress(None, f"bench (j) RL step, {gpus} simulated GPUs, placement {placement}"):
                row, trajectories = _one_step(redis_url, plan, prompts, gpus, placement, log_dir)
            figures.rows.append(row)
            console.print(row)
            whole = trajectories if not row.cut else whole
        for policy in plan.router_policies:
            with Progress(None, f"bench (j) RL step, {gpus} simulated GPUs, vllm-router {policy}"):
                row, _ = _router_row(plan, prompts, gpus, policy, log_dir)
            figures.rows.append(row)
            console.print(row)
        figures.longest_alone_s, figures.oracle_s[gpus] = oracle(plan, whole or trajectories, gpus)
    return figures


def _one_step(
    redis_url: str | None, plan: StepPlan, prompts: list[list[int]], gpus: int, placement: str, log_dir: Path
) -> tuple[StepRow, list[Trajectory]]:
    settings = private_settings(redis_url, f"bench-step-{placement}").model_copy(deep=True)
    settings.worker.placement = placement.split("+")[0]  # type: ignore[assignment]
    if "+moves" in placement:
        settings.worker.move_stragglers = True
        settings.worker.move_after_s = plan.move_after_s / plan.time_scale
        settings.worker.move_check_s = min(1.0, settings.worker.move_after_s)
    processes = max(1, gpus // plan.engines_per_process)
    cluster = LocalCluster(settings, processes, _engine(plan, gpus // processes), log_dir=log_dir)
    with cluster.running(ready_timeout_s=120):
        return asyncio.run(_measure_step(settings, plan, prompts, gpus, placement))


def _engine(plan: StepPlan, engines: int) -> EngineSettings:
    """The simulated engines of the plan, `engines` to a process."""
    return plan.engine(engines, max_model_len=plan.max_tokens + plan.max_prompt_tokens + 16)


def _router_row(
    plan: StepPlan, prompts: list[list[int]], gpus: int, policy: str, log_dir: Path
) -> tuple[StepRow, list[Trajectory]]:
    """The step through vllm-router (`policy`) in front of the same simulated engines served over HTTP: the requests
    `sample` makes (prompt i, seed 1 + j for sample j), all at once."""
    requests = [(prompt, 1 + j) for prompt in prompts for j in range(plan.samples)]
    per_process = min(gpus, plan.engines_per_process)
    report, trajectories = router_step(
        _engine(plan, 1), requests, plan.max_tokens, gpus, per_process, policy, log_dir / f"router-{policy}"
    )
    report = report.scaled(plan.time_scale)
    row = StepRow(gpus, f"vllm-router {policy}", report.makespan_s, report.busy_s, report.output_tokens)
    row.spans, row.moved = spans(report.busy_s, trajectories, plan.time_scale)
    return row, trajectories


async def _measure_step(
    settings: Settings, plan: StepPlan, prompts: list[list[int]], gpus: int, placement: str
) -> tuple[StepRow, list[Trajectory]]:
    async with RolloutClient(settings) as client:
        await all_serving(client, gpus)
        params = {"max_tokens": plan.max_tokens, "temperature": 1.0, "seed": 1}
        target = plan.partial_target if "+partial" in placement else None
        if "+expected" in placement:  # an earlier epoch of the same prompts (other seeds) teaches their lengths
            await client.sample(prompts, plan.samples, {**params, "seed": 1 + plan.samples}, timeout_s=3600)
        groups = await client.sample(prompts, plan.samples, params, completion_target=target, timeout_s=3600)
        report = (await client.step_report()).scaled(plan.time_scale)
    trajectories = [t for group in groups for t in group]
    row = StepRow(
        gpus,
        placement,
        report.makespan_s,
        report.busy_s,
        report.output_tokens,
        cut=report.cut,
        cut_tokens=report.cut_tokens,
        moves=report.moves,
    )
    row.spans, row.moved = spans(report.busy_s, trajectories, plan.time_scale)
    return row, trajectories


Spans = dict[str, list[tuple[float, float]]]


def spans(workers: Collection[str], trajectories: Sequence[Trajectory], time_scale: float) -> tuple[Spans, Spans]:
    """Per worker (every one of `workers`, busy or not), the (start, end) of its requests in simulated s from the
    step's start (`worker_spans`, as the step report counts them), and of those continued after a move."""

    def scaled(of: Sequence[Trajectory]) -> Spans:
        by_worker = worker_spans(of, 0.0, workers).items()
        return {w: [(a * time_scale, b * time_scale) for a, b in runs] for w, runs in by_worker}

    return scaled(trajectories), scaled([t for t in trajectories if t.interruptions and t.abort_cause != "partial"])


# the rows `draw_timeline` draws, beside one another: first come first served, ours at its best, the best router's
TIMELINE_ROWS = ("fifo", "cost+moves+expected", "vllm-router power_of_two")


def draw_timeline(f: StepFigures, path: Path) -> str:
    """Draw the step on the smallest fleet as people would rather look at it: one line per GPU (busiest at the
    top), a bar where some request of it ran, orange where that was a request continued after a straggler move,
    nothing where it idled, a dashed line at the oracle; `TIMELINE_ROWS` side by side (those measured). Writes the PNG
    at `path` (matplotlib, Agg) and returns its file name. Raises ImportError without matplotlib (the dev extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = min(f.oracle_s)
    rows = [r for name in TIMELINE_ROWS for r in f.rows if r.gpus == gpus and r.placement == name]
    end = max(r.makespan_s for r in rows)
    figure, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 0.28 * gpus + 1.6), sharey=False, squeeze=False)
    for ax, row in zip(axes[0], rows, strict=True):
        order = sorted(row.spans, key=lambda w: row.busy_s.get(w, 0.0))
        for y, worker in enumerate(order):
            for runs, color in ((row.spans[worker], "#4c72b0"), (row.moved.get(worker, []), "#dd8452")):
                ax.broken_barh([(a, b - a) for a, b in union(runs)], (y - 0.4, 0.8), color=color)
        ax.axvline(f.oracle_s[gpus], color="black", linestyle="--", linewidth=1)
        ax.set_xlim(0, end * 1.02)
        ax.set_yticks([])
        ax.set_xlabel("simulated s")
        ax.set_title(f"{row.placement}: {row.makespan_s:.0f} s, idle {row.idle_fraction:.0%}", fontsize=10)
    axes[0][0].set_ylabel(f"{gpus} simulated GPUs")
    figure.suptitle("One RL step: busy (blue), continued after a move (orange), idle (white); dashed: the oracle")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path.name


async def all_serving(client: RolloutClient, gpus: int, timeout_s: float = 120) -> None:
    """Return once `gpus` simulated GPUs serve; `RuntimeError` if fewer do after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while sum(w.state == "serving" for w in await client.workers()) < gpus:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {gpus} simulated GPUs serving after {timeout_s:g} s")
        await asyncio.sleep(0.2)


def oracle(plan: StepPlan, trajectories: list[Trajectory], gpus: int) -> tuple[float, float]:
    """(the longest request run alone, the lower bound): simulated seconds, from the cost model of the plan's GPU
    and model (workers/sim/cost.py) and the step's actual prompt and output lengths."""
    gpu, model = gpu_profile(plan.gpu), model_profile(plan.model)
    cost = StepCost(gpu, model)
    longest = max(trajectories, key=lambda t: len(t.completion_token_ids))
    prompt, output = len(longest.prompt_token_ids), len(longest.completion_token_ids)
    alone_s = cost.prefill_s(prompt) + sum(cost.decode_s(1, prompt + k) for k in range(1, output))
    prompt_tokens = sum(len(t.prompt_token_ids) for t in trajectories)
    output_tokens = sum(len(t.completion_token_ids) for t in trajectories)
    mean_context = (prompt_tokens + output_tokens / 2) / len(trajectories)
    kv_tokens = default_kv_cache_bytes(gpu, model) / model.kv_bytes_per_token
    best = max(
        batch / cost.decode_s(batch, int(batch * mean_context))
        for batch in range(1, 1025)
        if batch * mean_context <= kv_tokens
    )
    prefill_per_token_s = cost.prefill_s(8192) / 8192
    work_s = (output_tokens / best + prompt_tokens * prefill_per_token_s) / gpus
    return alone_s, max(alone_s, work_s)


def render_step(f: StepFigures) -> str:
    p = f.plan
    lines = [
        f"{HEADING}\n",
        f"Command: `{f.command}`.\n" if f.command else "",
        f"One GRPO-shaped step: {p.prompts} prompts x n={p.samples} (`RolloutClient.sample`, seeded: every row the "
        f"same workload), ShareGPT first-turn prompt lengths, output lengths log-normal with median {p.length_median} "
        f"and p99 {p.length_p99} tokens (a prompt's samples alike; capped at {p.max_tokens}), on {p.fleet_words}. "
        "Each row is a fresh fleet. Busy: some request of the worker's running. The "
        "oracle is the lower bound: the longer of the longest request run alone and the step's work at the fleet's "
        "peak throughput. `+moves`: a GPU running several generations hands the one that has made the most tokens "
        f"to a GPU that holds no work (cut, continued token-exact there) once it has run {p.move_after_s:g} "
        "simulated s (`ROLLOUT_MOVE_STRAGGLERS`). `+expected`: the client first samples the same prompts once with "
        "other seeds (an earlier epoch, not measured), so each request of the measured step carries its prompt's "
        "expected length (`RolloutRequest.expected_tokens`), which placement counts in place of `max_tokens`, and "
        "the groups are enqueued longest expected first. "
        f"`+partial`: the call ends once {p.partial_target:.0%} of the groups finished "
        "(`completion_target`): the rest are cut and carried to the next step with their tokens (the oracle is the "
        "full step's: the cut row did less work). Moves: the interruptions the step's trajectories were continued "
        "through.\n",
        "| GPUs | placement | makespan (sim s) | x oracle | busiest / least busy GPU (sim s) | idle fraction | "
        "tokens per GPU-s | moves | cut (tokens carried) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in f.rows:
        oracle_s = f.oracle_s[row.gpus]
        busy = sorted(row.busy_s.values())
        lines.append(
            f"| {row.gpus} | {row.placement} | {row.makespan_s:.0f} | {row.makespan_s / oracle_s:.2f} | "
            f"{busy[-1]:.0f} / {busy[0]:.0f} | {row.idle_fraction:.2f} | {row.tokens_per_gpu_s:.0f} | {row.moves} | "
            f"{f'{row.cut} ({row.cut_tokens:,})' if row.cut else '-'} |"
        )
    oracle_rows = ", ".join(f"{g} GPUs: {s:.0f} s" for g, s in f.oracle_s.items())
    lines.append(f"\nOracle lower bound: {oracle_rows} (the longest request alone: {f.longest_alone_s:.0f} s).\n")
    if f.timeline:
        lines.append(f"![The step on {min(f.oracle_s)} simulated GPUs, one line per GPU]({f.timeline})\n")
        lines.append(f"The step on {min(f.oracle_s)} GPUs, one line per GPU: {', '.join(TIMELINE_ROWS)}.\n")
    return "\n".join(lines) + "\n"
