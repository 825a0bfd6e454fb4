"""`rollout-svc bench`, section (k): the simulator checked against the real engine. Fit the sim's CPU profile to vLLM
on SmolLM2-135M here (step times against batch size and context), then predict a different workload (ShareGPT turns
on 2 workers) and compare its makespan with the measured one.

1. Fit. Two real vLLM workers (one core each, as `up` binds them); every fit call runs on both at once.
   For each batch size B and context C: B requests of C random prompt tokens, once for 1 output token and once for
   33 (`ignore_eos`); a decode step is their time difference over 32. A prefill is one request of C tokens for 1
   token. The profile (the weights' and the KV cache's effective read bandwidth, effective FLOP/s, overhead per
   step: `workers/sim/cost.py`'s roofline) is the least relative squared error over a log grid, then a finer one.
2. Predict. The ShareGPT workload (first user turns, chat-templated by the real model, each for as many tokens as
   ShareGPT's reply had, capped, `ignore_eos`) goes to the 2 real workers, then, as the same token ids, to 2 sim
   workers with the fitted profile (the same capacity, KV cache and context, chunked prefill off as on the real CPU
   engine), in real time. Makespan: the call's wall clock, first submit to last answer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.tools import dataset
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import private_settings
from workers.sim.cost import StepCost
from workers.sim.profiles import SMOLLM2_135M, GPUProfile

HEADING = "## (k) The simulator against the real engine"
# Each fit call runs on both workers at once, one session each (sessions go to the least loaded worker): their two
# cores may share a physical core or memory bandwidth, and the workload runs on both, so the fit sees them contended.
FIT_SESSIONS = ("simfit-a", "simfit-b")


@dataclass(frozen=True)
class FitPlan:
    batches: tuple[int, ...] = (1, 8, 32)
    contexts: tuple[int, ...] = (64, 512, 1024)
    prefills: tuple[int, ...] = (256, 1024, 1900)
    decode_tokens: int = 32
    workload_prompts: int = 96
    max_reply_tokens: int = 160
    max_prompt_chars: int = 2400
    capacity: int = 64


@dataclass
class FitPoint:
    kind: str  # "decode" (one step of `batch` sequences of `context` tokens) or "prefill" (`context` tokens)
    batch: int
    context: int
    seconds: float

    def modelled_s(self, cost: StepCost) -> float:
        """What `cost` says this point takes."""
        if self.kind == "decode":
            return cost.decode_s(self.batch, self.batch * self.context)
        return cost.prefill_s(self.context)


@dataclass
class FitFigures:
    plan: FitPlan
    points: list[FitPoint] = field(default_factory=list)
    profile: GPUProfile | None = None
    fit_error: float = 0.0  # root mean square relative error of the fitted model over the points
    measured_s: float = 0.0
    predicted_s: float = 0.0
    requests: int = 0
    output_tokens: int = 0
    command: str = ""

    @property
    def makespan_error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def run_fit_bench(
    redis_url: str | None, model: Path, console: Console, log_dir: Path, plan: FitPlan | None = None, command: str = ""
) -> FitFigures:
    """Fit, write the profile to `log_dir/cpu-profile.json`, predict; raises what the clusters raise."""
    plan = plan or FitPlan()
    figures = FitFigures(plan, command=command)
    engine = EngineSettings(engine="vllm", model=str(model), max_num_seqs=plan.capacity)
    settings = private_settings(redis_url, "bench-simfit")
    real = LocalCluster(settings, 2, engine, log_dir=log_dir)
    with Progress(None, "bench (k) the real engine: fit points and the workload"), real.running(ready_timeout_s=900):
        prompts, params = asyncio.run(_real_runs(settings, plan, figures))
    figures.profile, figures.fit_error = fit_profile(figures.points)
    profile_path = log_dir / "cpu-profile.json"
    profile_path.write_text(json.dumps(asdict(figures.profile)))
    sim = EngineSettings(
        engine="sim",
        sim_gpu=str(profile_path),
        sim_model="smollm2-135m",
        max_num_seqs=plan.capacity,
        kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
        max_model_len=engine.max_model_len,
    )
    sim_settings = private_settings(redis_url, "bench-simfit-sim")
    simulated = LocalCluster(sim_settings, 2, sim, log_dir=log_dir)
    with Progress(None, "bench (k) the simulator: the same workload"), simulated.running(ready_timeout_s=120):
        figures.predicted_s, _ = asyncio.run(_workload(sim_settings, prompts, params))
    console.print(figures)
    return figures


async def _real_runs(settings: Settings, plan: FitPlan, figures: FitFigures) -> tuple[list[list[int]], list[dict]]:
    async with RolloutClient(settings) as client:
        await _warm_up(client)
        figures.points = await _fit_points(client, plan)
        prompts, params = await _sharegpt_workload(client, plan)
        figures.measured_s, figures.output_tokens = await _workload(settings, prompts, params)
        figures.requests = len(prompts)
    return prompts, params


async def _warm_up(client: RolloutClient) -> None:
    for session in (*FIT_SESSIONS, None):
        await client.generate([[100] * 64] * 4, {"max_tokens": 8, "ignore_eos": True}, [session] * 4)


async def _fit_points(client: RolloutClient, plan: FitPlan) -> list[FitPoint]:
    rng = random.Random(0)

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[rng.randrange(1000, 20000) for _ in range(length)] for _ in range(count)]

    async def on(session: str, batch: list[list[int]], tokens: int) -> float:
        started = time.monotonic()
        await client.generate(batch, {"max_tokens": tokens, "ignore_eos": True}, [session] * len(batch))
        return time.monotonic() - started

    async def timed(batch: list[list[int]], tokens: int) -> float:  # the mean of the two workers' times
        times = await asyncio.gather(*(on(session, batch, tokens) for session in FIT_SESSIONS))
        return sum(times) / len(times)

    points = []
    for batch, context in itertools.product(plan.batches, plan.contexts):
        one = await timed(prompts(batch, context), 1)
        many = await timed(prompts(batch, context), 1 + plan.decode_tokens)
        points.append(FitPoint("decode", batch, context, max(1e-4, (many - one) / plan.decode_tokens)))
    for context in plan.prefills:
        points.append(FitPoint("prefill", 1, context, await timed(prompts(1, context), 1)))
    return points


def fit_profile(points: list[FitPoint]) -> tuple[GPUProfile, float]:
    """The roofline profile (bandwidth, FLOPs, overhead; efficiencies folded in, 1.0) that fits `points` best in
    relative squared error, and that error's root mean square. A log grid, then a finer one around its best."""

    def error(bandwidth: float, flops: float, overhead: float, kv_bandwidth: float) -> float:
        cost = StepCost(_profile(bandwidth, flops, overhead, kv_bandwidth), SMOLLM2_135M)
        return sum(((p.modelled_s(cost) - p.seconds) / p.seconds) ** 2 for p in points) / len(points)

    def grid(lo: float, hi: float, n: int) -> list[float]:
        return [math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / (n - 1)) for i in range(n)]

    coarse = itertools.product(
        grid(1e8, 1e12, 17), grid(1e9, 1e13, 21), [0.0, *grid(1e-4, 0.05, 12)], grid(1e8, 1e13, 21)
    )
    best = min(coarse, key=lambda args: error(*args))
    fine = itertools.product(
        grid(best[0] / 2, best[0] * 2, 9),
        grid(best[1] / 1.6, best[1] * 1.6, 9),
        [0.0, *grid(max(1e-4, best[2] / 2), max(2e-4, best[2] * 2), 12)],
        grid(best[3] / 1.6, best[3] * 1.6, 9),
    )
    best = min(fine, key=lambda args: error(*args))
    return _profile(*best), math.sqrt(error(*best))


def _profile(bandwidth: float, flops: float, overhead: float, kv_bandwidth: float = 0.0) -> GPUProfile:
    return GPUProfile(
        name="cpu",
        hbm_bytes_per_s=bandwidth,
        peak_flops=flops,
        memory_bytes=0.0,  # the KV cache is the engine's `kv_cache_memory_bytes`, as on the real CPU engine
        bandwidth_efficiency=1.0,
        compute_efficiency=1.0,
        step_overhead_s=overhead,
        kv_bytes_per_s=kv_bandwidth,
        source="fitted by `rollout-svc bench --only simfit` to vLLM on this machine's CPU (SmolLM2-135M)",
    )


async def _sharegpt_workload(client: RolloutClient, plan: FitPlan) -> tuple[list[list[int]], list[dict]]:
    """ShareGPT first user turns, templated by the real model's chat template; each with ShareGPT's reply length
    (4 characters a token, capped) as `max_tokens`, `ignore_eos`: the same work on either engine."""
    conversations = []
    for messages in dataset.conversations(max_turn_chars=plan.max_prompt_chars):
        conversations.append(messages[:2])
        if len(conversations) == plan.workload_prompts:
            break
    prompts = await client.apply_chat_template([c[:1] for c in conversations])
    replies = [max(8, min(plan.max_reply_tokens, len(c[1]["content"]) // 4)) for c in conversations]
    return prompts, [{"max_tokens": n, "ignore_eos": True, "temperature": 0.0} for n in replies]


async def _workload(settings: Settings, prompts: list[list[int]], params: list[dict]) -> tuple[float, int]:
    """Every request at once; (wall seconds from the first submit to the last answer, output tokens)."""
    async with RolloutClient(settings) as client:
        await client.generate([[100] * 16], {"max_tokens": 2, "ignore_eos": True})  # connections, scripts
        started = time.monotonic()
        results = await asyncio.gather(*(client.generate([p], q) for p, q in zip(prompts, params, strict=True)))
        elapsed = time.monotonic() - started
    return elapsed, sum(len(t.completion_token_ids) for [t] in results)


def render_fit(f: FitFigures) -> str:
    profile = f.profile
    assert profile is not None
    lines = [
        f"{HEADING}\n",
        f"Command: `{f.command}`.\n" if f.command else "",
        "The simulated engine's CPU profile fitted to vLLM on SmolLM2-135M here (2 workers, one core each; each fit "
        "call on both at once), then used to predict a different workload: "
        f"{f.requests} ShareGPT first turns, each for its ShareGPT reply's length in tokens (capped at "
        f"{f.plan.max_reply_tokens}; {f.output_tokens} output tokens in all), at once on 2 workers.\n",
        f"Fitted profile: the weights read at {profile.hbm_bytes_per_s / 1e9:.1f} GB/s and the KV cache at "
        f"{profile.kv_bytes_per_s / 1e9:.1f}, {profile.peak_flops / 1e9:.1f} GFLOP/s, "
        f"{profile.step_overhead_s * 1e3:.1f} ms per step; RMS relative "
        f"error over the {len(f.points)} fit points {f.fit_error:.0%}.\n",
        "| | makespan (s) |",
        "|---|---|",
        f"| real vLLM, measured | {f.measured_s:.1f} |",
        f"| simulator, predicted | {f.predicted_s:.1f} |",
        f"\nPrediction error: {f.makespan_error:+.0%} (goal: within 15%).\n",
        "| fit point | batch | context | measured (ms) | model (ms) |",
        "|---|---|---|---|---|",
    ]
    cost = StepCost(profile, SMOLLM2_135M)
    for p in f.points:
        lines.append(f"| {p.kind} | {p.batch} | {p.context} | {p.seconds * 1e3:.1f} | {p.modelled_s(cost) * 1e3:.1f} |")
    return "\n".join(lines) + "\n\n"
