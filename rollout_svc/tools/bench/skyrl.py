"""`rollout-svc bench`, section (i): SkyRL's own client path, `serve` vs vllm-router, the load SkyRL's generators make.

SkyRL's `RemoteInferenceClient.generate` (skyrl 0.3.0, unmodified, its own aiohttp session and concurrency cap)
sends one `POST /inference/v1/generate` per prompt, then one `POST /detokenize` for its text. Both sides are driven
the same way from this process, K lanes each calling `generate` with one prompt (16 token ids in, 16 out) as its
last call returns (closed loop, K = 1, 64, 1,000), both up at once, measured in turn at each load, `rounds` times
(the router first in odd rounds, serve first in even ones); each ratio is the median of the rounds' ratios (this
machine is shared and noisy: one round's ratio moved by +-0.15 between runs), each side's figures its median round:

- vllm-router 0.1.17 over two trivial aiohttp backends that answer both routes with fixed bodies
  (`rollout_svc.tools.bench.router`); SkyRL's client as SkyRL runs it behind a router: `proxy_url` the router,
  `server_urls` the two backends;
- one `rollout-svc serve` over 2 echo workers and a private redis-server; SkyRL's client as docs/skyrl.md says:
  `proxy_url` and `server_urls=[serve]`.

SkyRL caps a client's generates in flight at 512 per entry of `server_urls` (`SKYRL_GENERATE_CONCURRENCY_PER_ENGINE`):
512 for `serve`, 1,024 for the router; the report says so beside the 1,000 point. CPU per request of every process on
each side (this process is the load generator on both).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from rich.console import Console

from rollout_svc.connections.urls import redis_sync
from rollout_svc.tools.bench.api import serving
from rollout_svc.tools.bench.hop import beside_router, goal_met, goals_table, redis_cpu
from rollout_svc.tools.bench.router import (
    HOP_PROMPT,
    MODEL,
    CpuMeter,
    InTurnFigures,
    Point,
    at_least,
    cpu_of,
    in_turn,
    listed,
    round_ratios,
)

CLIENT_MODULE = "skyrl.backends.skyrl_train.inference_servers.remote_inference_client"
SKYRL_WORKERS = 2
PARAMS = {"max_tokens": len(HOP_PROMPT), "temperature": 0.0, "stop": None}  # None: as SkyRL's defaults send it


@dataclass(frozen=True)
class SkyRLPlan:
    in_flights: tuple[int, ...] = (1, 64, 1000)
    duration_s: float = 5.0  # per closed-loop point
    min_requests: int = 0  # per closed-loop point: it goes on past duration_s until this many were sent
    rounds: int = 3  # each load measured this many times on each side, alternating which side goes first


@dataclass
class SkyRLFigures(InTurnFigures):
    plan: SkyRLPlan
    command: str
    router_command: str
    router_rounds: list[list[Point]]  # per plan.in_flights, one point per round
    ours_rounds: list[list[Point]]

    def p50_ratios(self, i: int) -> list[float]:
        return round_ratios(self.ours_rounds[i], self.router_rounds[i], "p50_ms")

    def ratios(self) -> list[tuple[str, float, str, bool | None]]:
        """(what, value, goal, met) for the issue's goals at 64 in flight and at 1: medians of the rounds' ratios."""
        at = {points[0].in_flight: i for i, points in enumerate(self.router_rounds)}
        rows: list[tuple[str, float, str]] = []
        if 64 in at:
            rows.append(("req/s at 64 in flight: serve / vllm-router", median(self.rate_ratios(at[64])), ">= 0.8"))
        if 1 in at:
            rows.append(("p50 at 1 in flight: serve / vllm-router", median(self.p50_ratios(at[1])), "<= 1.5"))
        for in_flight, i in at.items():
            if in_flight not in (1, 64):
                what = f"req/s at {in_flight:,} in flight: serve / vllm-router"
                rows.append((what, median(self.rate_ratios(i)), "-"))
        return [(what, value, goal, goal_met(value, goal)) for what, value, goal in rows]


def run_skyrl_bench(
    redis_url: str | None,
    console: Console,
    log_dir: Path | None = None,
    plan: SkyRLPlan | None = None,
    command: str = "rollout-svc bench",
) -> SkyRLFigures:
    """Measure section (i). `redis_url`: ours runs on a private redis-server when None, else on this one under a key
    prefix of its own. Every process it started is stopped on return. Raises `RuntimeError` naming `make install` if
    SkyRL's client is not installed."""
    from rollout_svc.integrations.skyrl import skyrl_module

    try:
        skyrl_module(CLIENT_MODULE)
    except ImportError as exc:
        raise RuntimeError(f"SkyRL's client is not installed ({exc}): run `make install` (skyrl==0.3.0)") from exc
    plan = plan or SkyRLPlan()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rollout-bench-skyrl-"))
    title = "bench (i) SkyRL's client: vllm-router and its 2 backends, serve and its 2 echo workers"
    with (
        beside_router(redis_url, "bench-skyrl", log_dir, SKYRL_WORKERS, title) as (settings, fleet, cluster),
        serving(settings, 1, log_dir) as serves,
        contextlib.closing(redis_sync(settings.redis_url)) as rds,
    ):
        [(serve_url, serve_process)] = serves
        router_side = (
            fleet.url,
            fleet.backend_urls,
            {"client": time.process_time, "router": cpu_of([fleet.router_pid]), "backends": cpu_of(fleet.backend_pids)},
        )
        ours_side = (
            serve_url,
            [serve_url],
            {
                "client": time.process_time,
                "serve": cpu_of([serve_process.pid]),
                "workers": cpu_of([p.pid for p in cluster.processes]),
                "redis": redis_cpu(rds),
            },
        )
        router_rounds, ours_rounds = asyncio.run(_measure(router_side, ours_side, plan))
    figures = SkyRLFigures(plan, command, fleet.command_line, router_rounds, ours_rounds)
    console.print(figures)
    return figures


Side = tuple[str, list[str], dict[str, CpuMeter]]  # proxy_url, server_urls, CPU meters


async def _measure(router_side: Side, ours_side: Side, plan: SkyRLPlan) -> tuple[list[list[Point]], list[list[Point]]]:
    from rollout_svc.integrations.skyrl import skyrl_module

    client_class = skyrl_module(CLIENT_MODULE).RemoteInferenceClient
    clients = [
        client_class(proxy_url=proxy, server_urls=servers, data_parallel_size=1, model_name=MODEL)
        for proxy, servers, _ in (router_side, ours_side)
    ]
    try:
        sides = ((_sender(clients[0]), router_side[2]), (_sender(clients[1]), ours_side[2]))
        points: tuple[list[list[Point]], list[list[Point]]] = ([], [])
        for in_flight in plan.in_flights:
            router, ours = await in_turn(sides, in_flight, plan.rounds, plan.duration_s, min_requests=plan.min_requests)
            points[0].append(router)
            points[1].append(ours)
        return points
    finally:
        for client in clients:
            await client.teardown()


def _sender(client: Any) -> Any:
    batch = {"prompt_token_ids": [HOP_PROMPT], "sampling_params": PARAMS}

    async def send() -> None:
        out = await client.generate(batch)
        assert out["stop_reasons"] == ["stop"] and len(out["response_ids"][0]) == len(HOP_PROMPT), out

    return send


# --- the report ----------------------------------------------------------------------------------------------------


def render_skyrl(f: SkyRLFigures) -> str:
    """The report's section (i) (markdown): the command, the setup, the figures beside vllm-router's, CPU."""
    lines = [
        "",
        "## (i) SkyRL's client path: RemoteInferenceClient through serve vs through vllm-router",
        "",
        f"Command: `{f.command}`.",
        "SkyRL's own `RemoteInferenceClient` (skyrl 0.3.0, unmodified: its aiohttp session, its concurrency cap),"
        " one instance per side",
        "in this process. Each of K lanes calls `generate` with one prompt (16 token ids in, 16 out, greedy) as its"
        " last call returns,",
        "as SkyRL's generators do; each call is one `POST /inference/v1/generate` and one `POST /detokenize`."
        f" Closed loop for {f.plan.duration_s:g} s{at_least(f.plan.min_requests)}",
        f"after a warm-up round of K; both sides up at once, measured in turn at each load, {f.plan.rounds} rounds (the"
        " router first in odd rounds, serve first in even ones): each side's figures are its median round by req/s,",
        "each ratio the median of the rounds' ratios (listed: this machine is shared and noisy).",
        "vllm-router 0.1.17 over two trivial aiohttp backends answering both routes with fixed bodies (`proxy_url`"
        " the router,",
        f"`server_urls` the backends); it ran as `{f.router_command}`.",
        f"rollout-svc: one `rollout-svc serve` over {SKYRL_WORKERS} echo workers and a private redis-server"
        " (`proxy_url` and `server_urls`",
        "both serve, as docs/skyrl.md says). SkyRL caps a client's generates in flight at 512 per server URL: 512"
        " through serve, 1,024",
        "through the router.",
        "",
        "| in flight | vllm-router req/s | p50 (ms) | p99 (ms) | serve req/s | p50 (ms) | p99 (ms) | serve / router"
        " req/s (rounds) | p50 serve / router (rounds) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for i, (router, ours) in enumerate(zip(f.router, f.ours, strict=True)):
        rates, p50s = f.rate_ratios(i), f.p50_ratios(i)
        lines.append(
            f"| {router.in_flight:,} | {router.requests_per_s:,.0f} | {router.p50_ms:.2f} | {router.p99_ms:.2f} |"
            f" {ours.requests_per_s:,.0f} | {ours.p50_ms:.2f} | {ours.p99_ms:.2f} | {listed(rates)} | {listed(p50s)} |"
        )
    lines += goals_table(f.ratios())
    lines += [
        "",
        "CPU microseconds per request, by process (user + system over the measured window; the client is this"
        " process, the load generator):",
        "",
        "| side, in flight | client | vllm-router / serve | backends / workers | Redis | all |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, points in (("vllm-router", f.router), ("serve", f.ours)):
        for p in points:
            cpu = p.cpu_us
            middle = cpu.get("router", cpu.get("serve", 0.0))
            backends = cpu.get("backends", cpu.get("workers", 0.0))
            redis = f"{cpu['redis']:,.0f}" if "redis" in cpu else "-"
            lines.append(
                f"| {name}, {p.in_flight:,} | {cpu['client']:,.0f} | {middle:,.0f} | {backends:,.0f} | {redis} |"
                f" {sum(cpu.values()):,.0f} |"
            )
    return "\n".join(lines) + "\n"
