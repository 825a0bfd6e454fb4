"""`rollout-svc bench`, section (k): the simulator checked against the real engine. Fit the sim's CPU profile to vLLM
on SmolLM2-135M here (step times against batch size and context), then predict a different workload (ShareGPT turns
on 2 workers) and compare its makespan with the measured one.

1. Fit. Two real vLLM workers (one core each, as `up` binds them); every fit call runs on both at once. For each
   batch size B and context C: B requests of C random prompt tokens, once for 1 output token and once for 97
   (`ignore_eos`); a decode step is their time difference over 96. A prefill is one request of C tokens for 1 token,
   or B of them at once in one step (16 of 128: short prompts as a chat workload prefills them). A decode point
   whose B sequences of C + 97 tokens do not fit in the KV cache is left out: there the real engine preempts and
   runs the batch in waves, which the simulator's scheduler models, not its cost of one step (measured with one: 32
   x 1024 took 317 ms a step against 150 ms at 32 x 512, and pulled the fitted KV read rate from the 8.9 GB/s the
   points that fit give to 5.6). The profile (the weights' and the KV cache's effective read bandwidth, effective
   FLOP/s, overhead per step and per sequence in it: `workers/sim/cost.py`'s roofline plus overheads) is the least
   relative squared error: the rates over a log grid, then a finer one, the two overheads in closed form for each.
2. Predict. The ShareGPT workload (first user turns, chat-templated by the real model, each for as many tokens as
   ShareGPT's reply had, capped, `ignore_eos`) goes to the 2 real workers, then, as the same token ids, to 2 sim
   workers with the fitted profile (the same capacity, KV cache and context, chunked prefill off as on the real CPU
   engine), in real time. Makespan: the call's wall clock, first submit to last answer.

The real engine's runs come in `FitPlan.repeats` rounds, each every fit point and then the workload once, and each
figure is the median over the rounds: a shared machine's speed drifts over minutes, and measured in rounds the fit
and the workload see the same drift (measured one after the other, three fits and then three workloads, the
prediction error moved from -20% to +25% between two runs of the section).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import CPU_KV_CACHE_BYTES, EngineSettings, Settings
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.tools import dataset
from rollout_svc.tools.bench.simpublished import BLOCK_SIZE
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import private_settings
from workers.dtype import engine_dtype
from workers.sim.blocks import BlockPool
from workers.sim.cost import StepCost
from workers.sim.profiles import SMOLLM2_135M, GPUProfile
from workers.sim.scheduler import Scheduler, Sequence

HEADING = "## (k) The simulator against the real engine"
# Each fit call runs on both workers at once, one session each (sessions go to the least loaded worker): their two
# cores may share a physical core or memory bandwidth, and the workload runs on both, so the fit sees them contended.
FIT_SESSIONS = ("simfit-a", "simfit-b")


@dataclass(frozen=True)
class FitPlan:
    batches: tuple[int, ...] = (1, 8, 32)
    contexts: tuple[int, ...] = (64, 512, 1024)
    prefills: tuple[int, ...] = (256, 1024, 1900)
    # (prompts, tokens each) prefilled in one step: short prompts many to a step, as a workload of chat turns has
    # them (the single long prompts above alone left the prefill of ~100-token prompts to extrapolation)
    batched_prefills: tuple[tuple[int, int], ...] = ((16, 128),)
    decode_tokens: int = 96  # a decode step: the difference of two calls over this (32 left the points noisy)
    workload_prompts: int = 96
    max_reply_tokens: int = 160
    max_prompt_chars: int = 2400
    capacity: int = 64
    # Each fit point and each makespan is the median of this many rounds: one run of each moved 20-25% between two
    # runs here minutes apart (2026-11-27: the real engine's makespan 27.7 s, then 21.3 s).
    repeats: int = 3
    kv_cache_memory_bytes: int = CPU_KV_CACHE_BYTES

    def kv_tokens(self, dtype_bytes: int) -> int:
        """Tokens the real engine's KV cache holds, its KV in `dtype_bytes` an element (SmolLM2-135M's shape)."""
        return self.kv_cache_memory_bytes // (SMOLLM2_135M.kv_bytes_per_token // SMOLLM2_135M.dtype_bytes * dtype_bytes)

    def decode_points(self, dtype_bytes: int) -> list[tuple[int, int]]:
        """The (batch, context) decode points whose sequences fit in the KV cache for the longer of the two calls."""
        limit = self.kv_tokens(dtype_bytes)
        grid = itertools.product(self.batches, self.contexts)
        return [(b, c) for b, c in grid if b * (c + 1 + self.decode_tokens) <= limit]


@dataclass
class FitPoint:
    kind: str  # "decode" (one step of `batch` sequences of `context` tokens) or "prefill" (`batch` of `context`)
    batch: int
    context: int
    seconds: float

    @property
    def sequences(self) -> int:
        """The sequences in one step of this point."""
        return self.batch

    def modelled_s(self, cost: StepCost) -> float:
        """What `cost` says this point takes."""
        if self.kind == "decode":
            return cost.decode_s(self.batch, self.batch * self.context)
        if self.batch == 1:
            return cost.prefill_s(self.context)
        tokens = self.batch * self.context  # `batch` prompts of `context` tokens in one step
        return cost.step_s(tokens, tokens, self.batch * self.context * (self.context + 1) / 2, self.batch)


@dataclass
class FitFigures:
    plan: FitPlan
    points: list[FitPoint] = field(default_factory=list)
    profile: GPUProfile | None = None
    fit_error: float = 0.0  # root mean square relative error of the fitted model over the points
    measured_s: float = 0.0
    predicted_s: float = 0.0
    replayed_s: float = 0.0  # the sim's scheduler and cost model alone, offline (`replay_workload`)
    requests: int = 0
    output_tokens: int = 0
    command: str = ""
    dtype_bytes: int = 2  # of the real engine's KV cache: 4 where it runs in float32 (workers/dtype.py)

    @property
    def makespan_error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def run_fit_bench(
    redis_url: str | None, model: Path, console: Console, log_dir: Path, plan: FitPlan | None = None, command: str = ""
) -> FitFigures:
    """Fit, write the profile to `log_dir/cpu-profile.json`, predict; raises what the clusters raise."""
    plan = plan or FitPlan()
    figures = FitFigures(plan, command=command)
    engine = EngineSettings(
        engine="vllm", model=str(model), max_num_seqs=plan.capacity, kv_cache_memory_bytes=plan.kv_cache_memory_bytes
    )
    settings = private_settings(redis_url, "bench-simfit")
    real = LocalCluster(settings, 2, engine, log_dir=log_dir)
    with Progress(None, "bench (k) the real engine: fit points and the workload"), real.running(ready_timeout_s=900):
        prompts, params = asyncio.run(_real_runs(settings, plan, figures))
    figures.profile, figures.fit_error = fit_profile(figures.points)
    profile_path = log_dir / "cpu-profile.json"
    profile_path.write_text(json.dumps(asdict(figures.profile)))
    # what the figures came from, to replay offline: the fit points, and the workload's lengths in tokens
    prompt_tokens, max_tokens = [len(p) for p in prompts], [q["max_tokens"] for q in params]
    runs = {
        "points": [asdict(p) for p in figures.points],
        "measured_s": figures.measured_s,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
    }
    (log_dir / "simfit-runs.json").write_text(json.dumps(runs))
    sim = EngineSettings(
        engine="sim",
        sim_gpu=str(profile_path),
        sim_model="smollm2-135m",
        max_num_seqs=plan.capacity,
        # as many tokens as the real engine's cache holds: the sim's SmolLM2 keeps its KV in bf16
        kv_cache_memory_bytes=plan.kv_cache_memory_bytes * SMOLLM2_135M.dtype_bytes // figures.dtype_bytes,
        max_model_len=engine.context_len,
        # The real engine's budget: vLLM 0.32 without chunked prefill (off on CPU, workers/vllm_args.py) takes the
        # larger of max_model_len and SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS (2048) tokens a step.
        sim_max_num_batched_tokens=2048,
    )
    sim_settings = private_settings(redis_url, "bench-simfit-sim")
    simulated = LocalCluster(sim_settings, 2, sim, log_dir=log_dir)
    with Progress(None, "bench (k) the simulator: the same workload"), simulated.running(ready_timeout_s=120):
        figures.predicted_s, _ = asyncio.run(_workload(sim_settings, prompts, params, plan.repeats))
    figures.replayed_s = replay_workload(
        figures.profile, prompt_tokens, max_tokens, plan.kv_tokens(figures.dtype_bytes)
    )
    console.print(figures)
    return figures


async def _real_runs(settings: Settings, plan: FitPlan, figures: FitFigures) -> tuple[list[list[int]], list[dict]]:
    """`plan.repeats` rounds of every fit point and then the workload, on the real engine; the medians."""
    figures.dtype_bytes = 4 if engine_dtype("auto", cpu_backend=True) == "float32" else 2
    rng = random.Random(0)  # fresh random prompts every call: no run finds another's in the prefix cache
    rounds: list[list[FitPoint]] = []
    makespans: list[float] = []
    async with RolloutClient(settings) as client:
        await _warm_up(client)
        prompts, params = await _sharegpt_workload(client, plan)
        for _ in range(plan.repeats):
            rounds.append(await _fit_points(client, plan, plan.decode_points(figures.dtype_bytes), rng))
            makespan, figures.output_tokens = await _run_workload(client, prompts, params)
            makespans.append(makespan)
    figures.points = [
        FitPoint(p.kind, p.batch, p.context, statistics.median(r[i].seconds for r in rounds))
        for i, p in enumerate(rounds[0])
    ]
    figures.measured_s, figures.requests = statistics.median(makespans), len(prompts)
    return prompts, params


async def _warm_up(client: RolloutClient) -> None:
    for session in (*FIT_SESSIONS, None):
        await client.generate([[100] * 64] * 4, {"max_tokens": 8, "ignore_eos": True}, [session] * 4)


async def _fit_points(
    client: RolloutClient, plan: FitPlan, decode_points: list[tuple[int, int]], rng: random.Random
) -> list[FitPoint]:
    """One run of each of `decode_points` (batch, context) and of each prefill of `plan`, on prompts from `rng`."""

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[rng.randrange(1000, 20000) for _ in range(length)] for _ in range(count)]

    async def on(session: str, batch: list[list[int]], tokens: int) -> float:
        started = time.monotonic()
        await client.generate(batch, {"max_tokens": tokens, "ignore_eos": True}, [session] * len(batch))
        return time.monotonic() - started

    async def timed(batch: list[list[int]], tokens: int) -> float:  # the mean of the two workers' times
        times = await asyncio.gather(*(on(session, batch, tokens) for session in FIT_SESSIONS))
        return sum(times) / len(times)

    async def decode_s(batch: int, context: int) -> float:
        one = await timed(prompts(batch, context), 1)
        many = await timed(prompts(batch, context), 1 + plan.decode_tokens)
        return max(1e-4, (many - one) / plan.decode_tokens)

    points = []
    for batch, context in decode_points:
        points.append(FitPoint("decode", batch, context, await decode_s(batch, context)))
    for batch, context in [*((1, c) for c in plan.prefills), *plan.batched_prefills]:
        points.append(FitPoint("prefill", batch, context, await timed(prompts(batch, context), 1)))
    return points


def fit_profile(points: list[FitPoint]) -> tuple[GPUProfile, float]:
    """The profile (the weights' and the KV cache's read bandwidth, FLOP/s, overhead per step and per sequence;
    efficiencies folded in, 1.0) that fits `points` best in relative squared error, and that error's root mean
    square. Overlapped (a roofline) or added memory and compute time, whichever fits; the rates on a log grid, then
    a finer one around its best; for each, the two overheads (which add to the roofline's time) in closed form:
    non-negative linear least squares in two unknowns."""

    def fitted(bandwidth: float, flops: float, kv_bandwidth: float, overlapped: bool) -> tuple[float, float, float]:
        cost = StepCost(_profile(bandwidth, flops, 0.0, kv_bandwidth, overlapped=overlapped), SMOLLM2_135M)
        return _overheads([(p.modelled_s(cost), p.sequences, p.seconds) for p in points])

    def grid(lo: float, hi: float, n: int) -> list[float]:
        return [math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * i / (n - 1)) for i in range(n)]

    def refined(overlapped: bool) -> tuple[float, float, float, bool]:
        coarse = itertools.product(grid(1e8, 1e12, 17), grid(1e9, 1e13, 21), grid(1e8, 1e13, 21), (overlapped,))
        best = min(coarse, key=lambda rates: fitted(*rates)[2])
        fine = itertools.product(
            grid(best[0] / 2, best[0] * 2, 9),
            grid(best[1] / 1.6, best[1] * 1.6, 9),
            grid(best[2] / 1.6, best[2] * 1.6, 9),
            (overlapped,),
        )
        return min(fine, key=lambda rates: fitted(*rates)[2])

    bandwidth, flops, kv_bandwidth, overlapped = min(map(refined, (True, False)), key=lambda rates: fitted(*rates)[2])
    overhead, seq_overhead, error = fitted(bandwidth, flops, kv_bandwidth, overlapped)
    return _profile(bandwidth, flops, overhead, kv_bandwidth, seq_overhead, overlapped), math.sqrt(error)


def _overheads(rows: list[tuple[float, int, float]]) -> tuple[float, float, float]:
    """For rows of (roofline seconds r, sequences n, measured seconds y): the overheads o, s >= 0 minimising the
    mean of ((r + o + s n - y) / y)^2, and that mean. The unconstrained optimum (the 2x2 normal equations) when
    both are >= 0, else the better of the two with one overhead at 0 (the optimum lies on the boundary)."""
    a = [(1 / y, n / y, (y - r) / y) for r, n, y in rows]  # o * a0 + s * a1 ~ a2

    def mean_error(o: float, s: float) -> float:
        return sum((o * a0 + s * a1 - b) ** 2 for a0, a1, b in a) / len(a)

    s00 = sum(a0 * a0 for a0, _, _ in a)
    s01 = sum(a0 * a1 for a0, a1, _ in a)
    s11 = sum(a1 * a1 for _, a1, _ in a)
    s0b = sum(a0 * b for a0, _, b in a)
    s1b = sum(a1 * b for _, a1, b in a)
    candidates = [(max(0.0, s0b / s00), 0.0), (0.0, max(0.0, s1b / s11))]
    determinant = s00 * s11 - s01 * s01
    if determinant > 1e-12 * s00 * s11:
        o, s = (s0b * s11 - s1b * s01) / determinant, (s1b * s00 - s0b * s01) / determinant
        if o >= 0 and s >= 0:
            candidates.append((o, s))
    o, s = min(candidates, key=lambda c: mean_error(*c))
    return o, s, mean_error(o, s)


def _profile(
    bandwidth: float,
    flops: float,
    overhead: float,
    kv_bandwidth: float = 0.0,
    seq_overhead: float = 0.0,
    overlapped: bool = True,
) -> GPUProfile:
    return GPUProfile(
        name="cpu",
        hbm_bytes_per_s=bandwidth,
        peak_flops=flops,
        memory_bytes=0.0,  # the KV cache is the engine's `kv_cache_memory_bytes`, as on the real CPU engine
        bandwidth_efficiency=1.0,
        compute_efficiency=1.0,
        step_overhead_s=overhead,
        kv_bytes_per_s=kv_bandwidth,
        seq_overhead_s=seq_overhead,
        overlapped=overlapped,
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


async def _run_workload(client: RolloutClient, prompts: list[list[int]], params: list[dict]) -> tuple[float, int]:
    """Every request at once, the prefix cache reset first: (wall seconds from the first submit to the last answer,
    output tokens)."""
    await client.reset_prefix_cache()  # the same prompts again: none of them prefilled already
    started = time.monotonic()
    results = await asyncio.gather(*(client.generate([p], q) for p, q in zip(prompts, params, strict=True)))
    return time.monotonic() - started, sum(len(t.completion_token_ids) for [t] in results)


async def _workload(
    settings: Settings, prompts: list[list[int]], params: list[dict], repeats: int = 1
) -> tuple[float, int]:
    """`_run_workload` `repeats` times: (the median of the makespans, output tokens of one run)."""
    runs = []
    async with RolloutClient(settings) as client:
        await client.generate([[100] * 16], {"max_tokens": 2, "ignore_eos": True})  # connections, scripts
        for _ in range(repeats):
            makespan, tokens = await _run_workload(client, prompts, params)
            runs.append(makespan)
    return statistics.median(runs), tokens


def replay_workload(
    profile: GPUProfile,
    prompt_tokens: list[int],
    max_tokens: list[int],
    kv_tokens: int,
    workers: int = 2,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
) -> float:
    """The workload's makespan (s) through the sim's scheduler and cost model alone, offline: no worker, no Redis,
    no clock. Each request (`prompt_tokens[i]` distinct prompt tokens, `max_tokens[i]` out) goes to the worker with
    the least work in tokens (prompt plus output), as placement by cost does when every request arrives at once;
    each worker's engine holds `kv_tokens` tokens of KV in blocks of the sim's `BLOCK_SIZE` tokens, without chunked
    prefill (the real CPU engine's). What this gives beside the live sim's figure separates the cost model's error
    from the stack's."""
    loads = [0] * workers
    parts: list[list[Sequence]] = [[] for _ in range(workers)]
    for i, (n, m) in enumerate(zip(prompt_tokens, max_tokens, strict=True)):
        w = loads.index(min(loads))
        loads[w] += n + m
        parts[w].append(Sequence(str(i), list(range(i * 100_000, i * 100_000 + n)), m, lambda _: 0))
    cost, ends = StepCost(profile, SMOLLM2_135M), []
    for part in parts:
        blocks = BlockPool(kv_tokens // BLOCK_SIZE, BLOCK_SIZE)
        scheduler = Scheduler(blocks, max_num_seqs, max_num_batched_tokens, False)
        for seq in part:
            scheduler.add(seq)
        now = 0.0
        while scheduler.running or scheduler.waiting:
            step = scheduler.schedule()
            now += cost.step_s(*step.cost_inputs())
            scheduler.commit(step)
        ends.append(now)
    return max(ends)


def render_fit(f: FitFigures) -> str:
    profile = f.profile
    assert profile is not None
    lines = [
        f"{HEADING}\n",
        f"Command: `{f.command}`.\n" if f.command else "",
        "The simulated engine's CPU profile fitted to vLLM on SmolLM2-135M here (2 workers, one core each; each fit "
        "call on both at once), then used to predict a different workload: "
        f"{f.requests} ShareGPT first turns, each for its ShareGPT reply's length in tokens (capped at "
        f"{f.plan.max_reply_tokens}; {f.output_tokens} output tokens in all), at once on 2 workers. Each fit point "
        f"and each makespan is the median of {f.plan.repeats} rounds, each every fit point and then the workload "
        "(the prefix cache reset before each run of the workload). Decode points whose sequences do not fit in the "
        f"KV cache ({f.plan.kv_tokens(f.dtype_bytes):,} tokens) are left out: there the engine preempts, which the "
        "simulator's scheduler models, not its step cost.\n",
        f"Fitted profile: the weights read at {profile.hbm_bytes_per_s / 1e9:.1f} GB/s and the KV cache at "
        f"{profile.kv_bytes_per_s / 1e9:.1f}, {profile.peak_flops / 1e9:.1f} GFLOP/s, "
        f"{profile.step_overhead_s * 1e3:.1f} ms per step and {profile.seq_overhead_s * 1e3:.2f} ms per sequence in "
        "it; RMS relative "
        f"error over the {len(f.points)} fit points {f.fit_error:.0%}.\n",
        "| | makespan (s) |",
        "|---|---|",
        f"| real vLLM, measured | {f.measured_s:.1f} |",
        f"| simulator, predicted | {f.predicted_s:.1f} |",
        f"| the sim's scheduler and cost model alone, offline | {f.replayed_s:.1f} |",
        f"\nPrediction error: {f.makespan_error:+.1%} (goal: within 15%).\n",
        "| fit point | batch | context | measured (ms) | model (ms) |",
        "|---|---|---|---|---|",
    ]
    cost = StepCost(profile, SMOLLM2_135M)
    for p in f.points:
        lines.append(f"| {p.kind} | {p.batch} | {p.context} | {p.seconds * 1e3:.1f} | {p.modelled_s(cost) * 1e3:.1f} |")
    return "\n".join(lines) + "\n\n"
