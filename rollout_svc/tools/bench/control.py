"""`rollout-svc bench`, control part: how long a pause takes to be acknowledged, and what a keep-pause costs.

Both on echo workers (the control path, not the model): (c) the time from issuing `pause` to the last
worker's acknowledgement, p50 and p99 over many pause/resume cycles, with 2 and 4 workers, idle and with
requests flowing; (d) how long a request in flight through a keep-pause is frozen beyond the pause itself:
its latency minus the same request's latency unpaused, minus the pause as its caller knows it (from `pause`
returning to `resume` being issued). What remains is the pause's propagation: acknowledgement, the resume
reaching the worker, and the engine stepping again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import percentile, private_settings

CONTROL_WORKERS = (2, 4)
FROZEN_TOKENS, FROZEN_DELAY_S, FROZEN_PAUSE_S = 500, 0.002, 0.5  # a 1 s generation, paused for 0.5 s
LOAD_RATE_PER_S = 500  # requests/s flowing through the workers during the loaded measurement


@dataclass
class ControlFigures:
    workers: int
    cycles: int
    idle_p50_ms: float
    idle_p99_ms: float
    loaded_p50_ms: float
    loaded_p99_ms: float
    resume_p50_ms: float


@dataclass
class FrozenFigures:
    runs: int
    unpaused_s: float
    pause_s: float
    beyond_p50_ms: float
    beyond_max_ms: float


def control_latency(
    redis_url: str | None, workers: int, cycles: int, log_dir: Path, console: Console
) -> ControlFigures:
    settings = private_settings(redis_url, "bench-control")
    engine = EngineSettings(engine="echo", max_num_seqs=1024, echo_token_delay_s=0.001)
    cluster = LocalCluster(settings, workers, engine, log_dir=log_dir)
    with Progress(None, f"bench (c) control latency, {workers} workers"), cluster.running(ready_timeout_s=60):
        figures = asyncio.run(_measure_control(settings, workers, cycles))
    console.print(figures)
    return figures


async def _measure_control(settings: Settings, workers: int, cycles: int) -> ControlFigures:
    async with RolloutClient(settings) as client:
        await client.generate([[1, 2, 3]] * 100, {"max_tokens": 3})  # warm-up: connections, scripts
        idle, resumes = await pause_cycles(client, cycles)
        stop = asyncio.Event()
        load = asyncio.create_task(_steady_load(client, stop))
        try:
            loaded, _ = await pause_cycles(client, cycles)
        finally:
            stop.set()
            await load
    idle.sort()
    loaded.sort()
    resumes.sort()
    ms = 1000.0
    return ControlFigures(
        workers,
        cycles,
        percentile(idle, 50) * ms,
        percentile(idle, 99) * ms,
        percentile(loaded, 50) * ms,
        percentile(loaded, 99) * ms,
        percentile(resumes, 50) * ms,
    )


async def pause_cycles(client: RolloutClient, cycles: int) -> tuple[list[float], list[float]]:
    """`cycles` keep-pauses and resumes, back to back; the seconds each pause and each resume took."""
    pauses, resumes = [], []
    for _ in range(cycles):
        started = time.perf_counter()
        await client.pause("keep")
        pauses.append(time.perf_counter() - started)
        started = time.perf_counter()
        await client.resume()
        resumes.append(time.perf_counter() - started)
    return pauses, resumes


async def _steady_load(client: RolloutClient, stop: asyncio.Event) -> None:
    """Single-request calls at LOAD_RATE_PER_S (they queue through the pauses), until `stop`."""
    tasks: set[asyncio.Task] = set()
    while not stop.is_set():
        task = asyncio.create_task(client.generate([[5, 6, 7, 8]], {"max_tokens": 4}))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        await asyncio.sleep(1 / LOAD_RATE_PER_S)
    await asyncio.gather(*tasks)


def frozen_beyond_pause(redis_url: str | None, runs: int, log_dir: Path, console: Console) -> FrozenFigures:
    settings = private_settings(redis_url, "bench-frozen")
    engine = EngineSettings(engine="echo", echo_token_delay_s=FROZEN_DELAY_S)
    cluster = LocalCluster(settings, 1, engine, log_dir=log_dir)
    with Progress(None, "bench (d) frozen beyond a keep-pause"), cluster.running(ready_timeout_s=60):
        figures = asyncio.run(_measure_frozen(settings, runs))
    console.print(figures)
    return figures


async def _measure_frozen(settings: Settings, runs: int) -> FrozenFigures:
    prompt, params = list(range(1, FROZEN_TOKENS + 1)), {"max_tokens": FROZEN_TOKENS}
    async with RolloutClient(settings) as client:
        unpaused = []
        for _ in range(runs):
            started = time.perf_counter()
            await client.generate([prompt], params)
            unpaused.append(time.perf_counter() - started)
        base_s = sorted(unpaused)[len(unpaused) // 2]
        beyond, pauses = [], []
        for _ in range(runs):
            started = time.perf_counter()
            task = asyncio.create_task(client.generate([prompt], params))
            await asyncio.sleep(base_s / 3)
            await client.pause("keep")
            paused = time.perf_counter()
            await asyncio.sleep(FROZEN_PAUSE_S)
            pause_s = time.perf_counter() - paused
            await client.resume()
            [trajectory] = await task
            assert trajectory.interruptions == 0 and len(trajectory.completion_token_ids) == FROZEN_TOKENS
            pauses.append(pause_s)
            beyond.append(time.perf_counter() - started - base_s - pause_s)
    beyond.sort()
    return FrozenFigures(runs, base_s, sum(pauses) / runs, percentile(beyond, 50) * 1000, beyond[-1] * 1000)


def report(control: list[ControlFigures], frozen: FrozenFigures | None) -> list[str]:
    """The report's control sections (markdown lines)."""
    lines = [
        "",
        "## (c) Control latency, EchoEngine",
        "",
        'Time from issuing `pause(mode="keep")` to the last worker\'s acknowledgement (`RolloutClient.pause`',
        "returning), then the same for `resume`, back to back; idle, and with single-request calls flowing at",
        f"{LOAD_RATE_PER_S} requests/s (they queue through each pause). Goal: p50 < 10 ms.",
        "",
        "| workers | cycles | pause p50 (ms), idle | p99 (ms), idle | pause p50 (ms), loaded | p99 (ms), loaded"
        " | resume p50 (ms), idle |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in control:
        lines.append(
            f"| {f.workers} | {f.cycles} | {f.idle_p50_ms:.2f} | {f.idle_p99_ms:.2f} | {f.loaded_p50_ms:.2f} |"
            f" {f.loaded_p99_ms:.2f} | {f.resume_p50_ms:.2f} |"
        )
    if frozen is not None:
        lines += [
            "",
            "## (d) A keep-paused request, frozen beyond the pause",
            "",
            f"One echo worker, a request of {FROZEN_TOKENS} tokens at {FROZEN_DELAY_S * 1000:g} ms each, kept through"
            f" a pause of {FROZEN_PAUSE_S:g} s issued a third of the way in. Frozen beyond the pause = its latency",
            "minus its median unpaused latency minus the pause as the caller knows it (from `pause` returning to",
            "`resume` being issued): the propagation of the pause and of the resume.",
            "",
            "| runs | unpaused latency (s) | pause (s) | beyond the pause, p50 (ms) | max (ms) |",
            "|---:|---:|---:|---:|---:|",
            f"| {frozen.runs} | {frozen.unpaused_s:.3f} | {frozen.pause_s:.3f} | {frozen.beyond_p50_ms:.1f} |"
            f" {frozen.beyond_max_ms:.1f} |",
        ]
    return lines
