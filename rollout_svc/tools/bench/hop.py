"""`rollout-svc bench`, the hop section: the hop between a producer and its engines, rollout-svc vs vllm-router.

Every hop figure is a ratio to vllm-router measured in the same run (the machine is shared and noisy):

- the anchor (`rollout_svc.tools.bench.router`): vllm-router in front of two trivial aiohttp backends that answer
  every `POST /v1/completions` with one fixed completion of 16 tokens, driven by one aiohttp session in this
  process: requests/s and p50/p99 latency at K requests in flight (closed loop), and p50 at 1 in flight;
- ours: a private redis-server and two echo workers (16 token ids in, 16 out), one `RolloutClient` in this
  process: one batched `generate` call, then single-request `generate` calls at K in flight and at 1;
- CPU per request of every process on each side (this process, the router or the workers, the backends or Redis);
- Redis `used_memory` per 1,000 queued requests of 1,000 prompt tokens, enqueued with no worker running.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import redis
from rich.console import Console

from rollout_svc.client.calls import Call
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.connections.urls import redis_sync
from rollout_svc.deploy.local import LocalCluster, PrivateRedis
from rollout_svc.tools.bench.router import (
    HOP_PROMPT,
    CpuMeter,
    InTurnFigures,
    Point,
    RouterFleet,
    at_least,
    cpu_of,
    in_turn,
    listed,
    measured,
    median_round,
    read_meters,
    round_ratios,
    router_fleet,
    router_sender,
)
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import private_settings

HOP_WORKERS = 2
WORKER_CAPACITY = 4096  # echo max_num_seqs per worker: every request in flight admitted (2 x 4,096 > 5,000)
MEMORY_PROMPT_TOKENS = 1000
MEMORY_VOCAB = 49152
MEMORY_CHUNK = 5000  # requests built and enqueued at a time (the client holds no more than this)
MEMORY_MAX_QUEUED = 1_000_000  # the memory part's admission limit, far above its largest level
MB = 1_000_000


@dataclass(frozen=True)
class HopPlan:
    in_flights: tuple[int, ...] = (64, 256, 1000, 5000)
    duration_s: float = 5.0  # per closed-loop point
    min_requests: int = 0  # per closed-loop point: it goes on past duration_s until this many were sent
    single_requests: int = 1000  # at 1 in flight
    batched_requests: int = 20_000
    batched_runs: int = 2  # best of
    rounds: int = 3  # each load measured this many times on each side, alternating which side goes first
    memory_levels: tuple[int, ...] = (1000, 10_000, 100_000)


@dataclass
class MemoryPoint:
    queued: int
    used_bytes: int  # INFO used_memory now minus before the first request
    payload_bytes: int  # the entries' msgpack payloads together
    enqueue_s: float  # building and enqueuing this level's new requests

    @property
    def mb_per_1k(self) -> float:
        return self.used_bytes / MB / (self.queued / 1000)

    @property
    def payload_mb_per_1k(self) -> float:
        return self.payload_bytes / MB / (self.queued / 1000)


@dataclass
class HopFigures(InTurnFigures):
    plan: HopPlan
    command: str
    router_command: str
    router_rounds: list[list[Point]]  # per plan.in_flights, one point per round
    router_single_rounds: list[Point]  # 1 in flight, one per round
    batched: Point
    ours_rounds: list[list[Point]]
    ours_single_rounds: list[Point]
    memory: list[MemoryPoint]
    max_queued_requests: int  # ours' admission limit (the throughput runs)

    @property
    def router_single(self) -> Point:
        """The router's median round at 1 in flight, by p50."""
        return median_round(self.router_single_rounds, "p50_ms")

    @property
    def ours_single(self) -> Point:
        return median_round(self.ours_single_rounds, "p50_ms")

    @property
    def router_best(self) -> Point:
        return max(self.router, key=lambda p: p.requests_per_s)

    def p50_ratios(self) -> list[float]:
        """Ours / the router's p50 at 1 in flight, one per round."""
        return round_ratios(self.ours_single_rounds, self.router_single_rounds, "p50_ms")

    def ratios(self) -> list[tuple[str, float, str, bool | None]]:
        """(what, ratio, goal, met) for each of the issue's goals; met None where there is none (for comparison)."""
        low, high = self.plan.in_flights[0], self.plan.in_flights[-1]
        rows: list[tuple[str, float, str]] = [
            (
                "batched `generate` / vllm-router's best rate",
                self.batched.requests_per_s / self.router_best.requests_per_s,
                ">= 4",
            ),
            *(
                (
                    f"single-request, {n:,} in flight: ours / vllm-router's",
                    median(self.rate_ratios(i)),
                    ">= 1.2",
                )
                for i, n in enumerate(self.plan.in_flights)
                if n in (64, 256)
            ),
            ("p50 at 1 in flight: ours / vllm-router's", median(self.p50_ratios()), "<= 1.5"),
            (
                f"ours, {high:,} in flight / {low:,} in flight",
                self.ours[-1].requests_per_s / self.ours[0].requests_per_s,
                ">= 0.9",
            ),
            (
                f"vllm-router, {high:,} in flight / {low:,} in flight",
                self.router[-1].requests_per_s / self.router[0].requests_per_s,
                "-",
            ),
        ]
        return [(what, value, goal, goal_met(value, goal)) for what, value, goal in rows]


def goal_met(value: float, goal: str) -> bool | None:
    """Whether `value` meets a goal written `>= x` or `<= x`; None for `-` (no goal)."""
    if goal == "-":
        return None
    op, bound = goal.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


def run_hop_bench(
    redis_url: str | None,
    console: Console,
    log_dir: Path | None = None,
    plan: HopPlan | None = None,
    command: str = "rollout-svc bench",
) -> HopFigures:
    """Measure the hop section: vllm-router and ours (both up at once, measured in turn at each load), then Redis
    memory. `redis_url`: ours runs on a private redis-server when None, else on this one under a key prefix of its
    own; the memory part always starts a fresh private one. Every process it started is stopped on return."""
    plan = plan or HopPlan()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rollout-bench-hop-"))
    title = "bench (h) hop: vllm-router and its 2 backends, rollout-svc and its 2 echo workers"
    with beside_router(redis_url, "bench-hop", log_dir, HOP_WORKERS, title) as (settings, fleet, cluster):
        workers = [p.pid for p in cluster.processes]
        hops = asyncio.run(_measure_hops(fleet, settings, workers, plan))
    with Progress(None, "bench (h) hop: Redis memory per queued request"):
        memory = asyncio.run(_measure_memory(plan.memory_levels))
    figures = HopFigures(
        plan, command, fleet.command_line, *hops, memory=memory, max_queued_requests=settings.client.max_queued_requests
    )
    console.print(figures)
    return figures


@contextlib.contextmanager
def beside_router(
    redis_url: str | None, name: str, log_dir: Path, workers: int, title: str
) -> Iterator[tuple[Settings, RouterFleet, LocalCluster]]:
    """Both sides of a section measured beside vllm-router, up at once: the router and its two backends
    (`router_fleet`), and `workers` echo workers of `WORKER_CAPACITY` each, on a private redis-server when
    `redis_url` is None, else on that Redis under the key prefix `name`. `title` is the progress line. Yields
    (the echo side's settings, the router's fleet, the echo workers); every process is stopped on leaving."""
    settings = private_settings(redis_url, name).copy_with(redis_data_dir=log_dir / "redis")
    engine = EngineSettings(engine="echo", max_num_seqs=WORKER_CAPACITY)
    cluster = LocalCluster(settings, workers, engine, log_dir=log_dir)
    with Progress(None, title), router_fleet(log_dir) as fleet, cluster.running(ready_timeout_s=60):
        yield settings, fleet, cluster


def goals_table(ratios: list[tuple[str, float, str, bool | None]]) -> list[str]:
    """The report's table of the issue's goals (markdown lines, a blank line first) from `ratios` (what, value,
    goal, met: None where there is no goal)."""
    met_text = {True: "yes", False: "no", None: "-"}
    return [
        "",
        "The issue's goals, beside the figures (not asserted):",
        "",
        "| ratio | value | goal | met |",
        "|---|---:|---|---|",
        *(f"| {what} | {value:.2f} | {goal} | {met_text[met]} |" for what, value, goal, met in ratios),
    ]


def redis_cpu(client: redis.Redis) -> CpuMeter:
    """Redis' own CPU seconds (INFO cpu: user + system, every thread; with a shared Redis, its other users' too)."""

    def read() -> float:
        info: Any = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    return read


async def _measure_hops(
    fleet: RouterFleet, settings: Settings, worker_pids: list[int], plan: HopPlan
) -> tuple[list[list[Point]], list[Point], Point, list[list[Point]], list[Point]]:
    """Both sides, up at once and measured in turn at each load, `plan.rounds` times (`in_turn`: the router first
    in odd rounds, ours in even ones), so drift hits both alike: the router's rounds at each load and at 1 in
    flight, our best batched call, our rounds at each load and at 1 in flight."""
    params = {"max_tokens": len(HOP_PROMPT)}
    with contextlib.closing(redis_sync(settings.redis_url)) as rds:
        ours_meters = {"client": time.process_time, "workers": cpu_of(worker_pids), "redis": redis_cpu(rds)}
        async with (
            router_sender(fleet, max(plan.in_flights)) as (router_send, router_meters),
            RolloutClient(settings) as client,
        ):

            async def ours_send() -> None:
                [trajectory] = await client.generate([HOP_PROMPT], params)
                assert trajectory.finish_reason == "stop", trajectory

            await client.generate([HOP_PROMPT] * 100, params)  # warm-up: connections, scripts loaded
            batched = [await _batched(client, plan.batched_requests, ours_meters) for _ in range(plan.batched_runs)]
            sides = ((router_send, router_meters), (ours_send, ours_meters))
            router: list[list[Point]] = []
            ours: list[list[Point]] = []
            for in_flight in plan.in_flights:
                theirs, mine = await in_turn(
                    sides, in_flight, plan.rounds, plan.duration_s, min_requests=plan.min_requests
                )
                router.append(theirs)
                ours.append(mine)
            router_single, ours_single = await in_turn(sides, 1, plan.rounds, requests=plan.single_requests)
    return router, router_single, max(batched, key=lambda p: p.requests_per_s), ours, ours_single


async def _batched(client: RolloutClient, requests: int, meters: dict[str, CpuMeter]) -> Point:
    """One `generate` call of `requests` prompts: its rate and CPU per request (its latency is its duration)."""
    before, started = read_meters(meters), time.perf_counter()
    trajectories = await client.generate([HOP_PROMPT] * requests, {"max_tokens": len(HOP_PROMPT)})
    elapsed_s, after = time.perf_counter() - started, read_meters(meters)
    assert all(t.finish_reason == "stop" for t in trajectories)
    cpu = {role: after[role] - before[role] for role in meters}
    return measured(len(trajectories), elapsed_s, [elapsed_s], requests, cpu)


# --- Redis memory --------------------------------------------------------------------------------------------------


async def _measure_memory(levels: tuple[int, ...]) -> list[MemoryPoint]:
    """A fresh private redis-server (no persistence) and no worker: enqueue requests of `MEMORY_PROMPT_TOKENS`
    random token ids up to each level (`_enqueue`); at each level, with every client connection closed,
    `used_memory` over the empty baseline, and XLEN of the requests stream, which must equal the level."""
    settings = private_settings(None, "bench-hop-memory").copy_with(max_queued_requests=MEMORY_MAX_QUEUED)
    redis_server = PrivateRedis(settings.redis_url)
    redis_server.start()
    rds = redis_sync(settings.redis_url)
    rng = random.Random(0)
    prompts = [[rng.randrange(MEMORY_VOCAB) for _ in range(MEMORY_PROMPT_TOKENS)] for _ in range(64)]
    try:
        await _enqueue(settings, prompts, 0)  # loads the scripts, so the baseline holds them
        baseline = int(rds.info("memory")["used_memory"])
        points, queued, payload_bytes = [], 0, 0
        for level in sorted(levels):
            started = time.perf_counter()
            payload_bytes += await _enqueue(settings, prompts, level - queued)
            enqueue_s, queued = time.perf_counter() - started, level
            length = int(rds.xlen(settings.keys.requests))
            if length != level:
                raise RuntimeError(f"XLEN {settings.keys.requests} is {length}, {level} were enqueued")
            used = int(rds.info("memory")["used_memory"]) - baseline
            points.append(MemoryPoint(level, used, payload_bytes, enqueue_s))
        return points
    finally:
        rds.close()
        redis_server.stop()


async def _enqueue(settings: Settings, prompts: list[list[int]], count: int) -> int:
    """Enqueue `count` requests in chunks through the client's own path: built by `RolloutClient.rollout_requests`,
    sent by its connection's `submit` (what `generate` does), then forgotten (no result is awaited), so the client
    holds one chunk at a time. Returns their payload bytes. Closes the client."""
    from rollout_svc.protocol import encode

    payload_bytes = 0
    async with RolloutClient(settings) as client:
        connection = await client._connect()
        for start in range(0, count, MEMORY_CHUNK):
            size = min(MEMORY_CHUNK, count - start)
            chunk = [prompts[(start + i) % len(prompts)] for i in range(size)]
            requests = await client.rollout_requests(chunk, {"max_tokens": 16}, timeout_s=3600)
            call = Call(requests, connection.loop)
            await connection.submit(call)
            connection.forget(call)
            payload_bytes += sum(len(encode(r)) for r in requests)
    return payload_bytes


# --- the report ----------------------------------------------------------------------------------------------------


def render_hop(f: HopFigures) -> str:
    """The report's hop section (markdown): the command, the setup, then the figures beside vllm-router's."""
    plan, rs, us = f.plan, f.router_single, f.ours_single
    lines = [
        "",
        "## (h) Hop: rollout-svc vs vllm-router",
        "",
        f"Command: `{f.command}`.",
        "Every figure here is read beside vllm-router 0.1.17 (the Rust router vLLM users pick), measured in the same"
        " run: both",
        f"sides up at once, measured in turn at each load, {plan.rounds} rounds (the router first in odd rounds, ours"
        " first in even ones):",
        "each side's figures are its median round (by req/s; at 1 in flight by p50), each ratio the median of the"
        " rounds' ratios (listed:",
        "this machine is shared and noisy). All load from one Python process.",
        "vllm-router: `POST /v1/completions` (16 token ids in) through it to two trivial aiohttp backends, each"
        " answering one fixed",
        "completion of 16 tokens; one `aiohttp` session, a keep-alive connection per request in flight. It ran as",
        f"`{f.router_command}`.",
        f"rollout-svc: a private redis-server and {HOP_WORKERS} echo workers (16 token ids in, 16 out; capacity"
        f" {WORKER_CAPACITY:,} each, so",
        f"{max(plan.in_flights):,} in flight are all admitted; admission limit {f.max_queued_requests:,} queued),"
        f" one `RolloutClient`: one batched",
        f"`generate` of {plan.batched_requests:,} prompts (best of {plan.batched_runs}), and single-request"
        " `generate` calls. Closed loop: K requests",
        f"kept in flight for {plan.duration_s:g} s{at_least(plan.min_requests)} after a warm-up round of K"
        f" (requests/s over the window and its drain), then {plan.single_requests:,} at 1 in flight.",
        "",
        "| load | vllm-router req/s | p50 (ms) | p99 (ms) | rollout-svc req/s | p50 (ms) | p99 (ms) | ours / router |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| one batched `generate` of {plan.batched_requests:,} | - | - | - | {f.batched.requests_per_s:,.0f} | - | - |"
        f" {f.batched.requests_per_s / f.router_best.requests_per_s:.2f} (of the router's best) |",
    ]
    for i, (router, ours) in enumerate(zip(f.router, f.ours, strict=True)):
        lines.append(
            f"| {router.in_flight:,} in flight | {router.requests_per_s:,.0f} | {router.p50_ms:.2f} |"
            f" {router.p99_ms:.2f} | {ours.requests_per_s:,.0f} | {ours.p50_ms:.2f} | {ours.p99_ms:.2f} |"
            f" {listed(f.rate_ratios(i))} |"
        )
    lines += [
        f"| 1 in flight | {rs.requests_per_s:,.0f} | {rs.p50_ms:.2f} | {rs.p99_ms:.2f} | {us.requests_per_s:,.0f} |"
        f" {us.p50_ms:.2f} | {us.p99_ms:.2f} | p50: {listed(f.p50_ratios())} |",
        *goals_table(f.ratios()),
    ]
    lines += [
        "",
        "CPU microseconds per request, by process (user + system, over the measured window; the client is this"
        " process, the load",
        "generator; the workers' and the backends' are summed; Redis' from INFO cpu):",
        "",
        "| side, load | client | vllm-router / workers | backends / Redis | all |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, point in [
        *((f"vllm-router, {p.in_flight:,} in flight", p) for p in f.router),
        ("vllm-router, 1 in flight", rs),
        (f"rollout-svc, batched {plan.batched_requests:,}", f.batched),
        *((f"rollout-svc, {p.in_flight:,} in flight", p) for p in f.ours),
        ("rollout-svc, 1 in flight", us),
    ]:
        cpu = list(point.cpu_us.values())
        lines.append(f"| {name} | {' | '.join(f'{us:,.0f}' for us in cpu)} | {sum(cpu):,.0f} |")
    lines += [
        "",
        f"Redis memory: a fresh private redis-server (no persistence) and no worker; requests of"
        f" {MEMORY_PROMPT_TOKENS:,} random prompt token ids",
        f"(in [0, {MEMORY_VOCAB:,})), `max_tokens` 16, enqueued through the client's own path (`rollout_requests`,"
        " then its connection's",
        f"`submit`, what `generate` does) with admission at {MEMORY_MAX_QUEUED:,}; XLEN of the requests stream"
        " checked to equal the count.",
        "`used_memory` (INFO memory) over the empty baseline, every client connection closed; MB = 10^6 bytes."
        " Goal: < 5 MB per",
        "1,000 queued requests at every level.",
        "",
        "| queued | used_memory (MB) | MB per 1k | payload (msgpack) MB per 1k | goal met | enqueue time (s) |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    lines += [
        f"| {m.queued:,} | {m.used_bytes / MB:,.1f} | {m.mb_per_1k:.2f} | {m.payload_mb_per_1k:.2f} |"
        f" {'yes' if m.mb_per_1k < 5 else 'no'} | {m.enqueue_s:.1f} |"
        for m in f.memory
    ]
    return "\n".join(lines) + "\n"
