"""`rollout-svc bench`, HTTP part: what `rollout-svc serve` carries beside the Python client path, same run.

(f) On echo workers, the same single-prompt requests (16 token ids in, 16 out) three ways, rounds alternating so
drift hits all alike: `RolloutClient.generate` called in this process; `POST /v1/completions` to one `serve`
process; the same round-robin over two. Closed loop at C in flight (requests/s, p50/p99 latency), then at 1 in
flight (p50/p99). The HTTP load generator is this process: one `aiohttp` session with a keep-alive connection per
request in flight (httpx's pool costs ~4x the CPU per request at 32 connections, encode/httpx#3215, which on a 2-CPU
machine would measure the load generator more than `serve`). Its CPU is reported beside the `serve` processes',
since on a small machine they share the cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import EngineSettings, Settings, settings_env
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.deploy.processes import die_with_parent, free_port
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import percentile, private_settings

if TYPE_CHECKING:
    import aiohttp

API_PROMPT = list(range(1, 17))  # 16 tokens in, 16 out (as the queue-overhead part)
API_WORKERS = 2
SERVE_COUNTS = (1, 2)
API_ROUNDS = 3
SINGLE_REQUESTS = 300  # per round, at 1 in flight
WARMUP_REQUESTS = 200
SERVE_READY_TIMEOUT_S = 60.0

Send = Callable[[int], Awaitable[None]]  # called with the lane that sends


@dataclass
class PathFigures:
    """One way in: the Python client (`serves` 0) or HTTP through `serves` serve processes."""

    serves: int
    requests_per_s: float  # at C in flight, best round
    loaded_p50_ms: float  # at C in flight, every round
    loaded_p99_ms: float
    single_p50_ms: float  # at 1 in flight, every round
    single_p99_ms: float
    client_cores: float  # the load generator's CPU seconds per second, in the best round (this process)
    serve_cores: float  # the serve processes' together, same round
    machine_cores: float  # every process on the machine, same round

    @property
    def name(self) -> str:
        if not self.serves:
            return "Python client"
        return f"HTTP, {self.serves} serve process" + ("es" if self.serves > 1 else "")


@dataclass
class ApiFigures:
    workers: int
    in_flight: int
    requests: int
    single_requests: int
    rounds: int
    paths: list[PathFigures]

    @property
    def ratio(self) -> float:
        """HTTP through one serve process / the Python client, requests/s at C in flight. Goal >= 0.5."""
        return self.paths[1].requests_per_s / self.paths[0].requests_per_s

    @property
    def p50_gap_ms(self) -> float:
        """HTTP through one serve process minus the Python client, p50 at 1 in flight. Goal <= 1 ms."""
        return self.paths[1].single_p50_ms - self.paths[0].single_p50_ms


@dataclass
class _Run:
    latencies_s: list[float]
    requests_per_s: float
    client_cores: float
    serve_cores: float
    machine_cores: float


def api_overhead(
    redis_url: str | None, requests: int, in_flight: int, log_dir: Path, console: Console, rounds: int = API_ROUNDS
) -> ApiFigures:
    """Measure (f) on a cluster of its own: `API_WORKERS` echo workers and `max(SERVE_COUNTS)` serve processes."""
    settings = private_settings(redis_url, "bench-api")
    engine = EngineSettings(engine="echo", max_num_seqs=4096)
    cluster = LocalCluster(settings, API_WORKERS, engine, log_dir=log_dir)
    with (
        Progress(None, "bench (f) HTTP API beside the Python client"),
        cluster.running(ready_timeout_s=60),
        serving(settings, max(SERVE_COUNTS), log_dir) as serves,
    ):
        figures = asyncio.run(_measure(settings, serves, requests, in_flight, rounds))
    console.print(figures, f"ratio {figures.ratio:.3f}, p50 gap at 1 in flight {figures.p50_gap_ms:+.2f} ms")
    return figures


# --- the serve processes ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(settings: Settings, count: int, log_dir: Path) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """`count` `rollout-svc serve` processes on free loopback ports, each answering /health; stopped on leaving."""
    env = {**os.environ, **settings_env(settings)}  # ROLLOUT_REDIS_URL and the key prefix included
    serves: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for i in range(count):
            port = free_port()
            args = [sys.executable, "-m", "rollout_svc", "serve", "--host", "127.0.0.1", "--port", str(port)]
            with open(log_dir / f"serve-{i}.log", "ab") as out:
                process = subprocess.Popen(die_with_parent(args), env=env, stdout=out, stderr=subprocess.STDOUT)
            serves.append((f"http://127.0.0.1:{port}", process))
        for url, process in serves:
            _wait_healthy(url, process, log_dir)
        yield serves
    finally:
        for _, process in serves:
            process.send_signal(signal.SIGTERM)
        for _, process in serves:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log_dir: Path) -> None:
    import httpx

    deadline = time.monotonic() + SERVE_READY_TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"`rollout-svc serve` at {url} did not become healthy; see its log in {log_dir}")
        time.sleep(0.1)


# --- measuring -------------------------------------------------------------------------------------------------


async def _measure(
    settings: Settings, serves: list[tuple[str, subprocess.Popen[bytes]]], requests: int, in_flight: int, rounds: int
) -> ApiFigures:
    import aiohttp

    params = {"max_tokens": len(API_PROMPT)}
    headers = {"Authorization": f"Bearer {settings.api.api_keys[0]}"} if settings.api.api_keys else None
    connector = aiohttp.TCPConnector(limit=in_flight * len(serves), limit_per_host=in_flight)
    async with (
        RolloutClient(settings) as client,
        aiohttp.ClientSession(connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as http,
    ):
        async with http.get(f"{serves[0][0]}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        body = {"model": model, "prompt": API_PROMPT, "max_tokens": len(API_PROMPT)}
        ways: dict[int, tuple[Send, list[int]]] = {0: (_python_send(client, params), [])}
        for n in SERVE_COUNTS:
            ways[n] = (_http_send(http, [url for url, _ in serves[:n]], body), [p.pid for _, p in serves[:n]])
        for send, _ in ways.values():  # warm-up: connections, scripts, each serve's view of the fleet
            await _closed_loop(send, WARMUP_REQUESTS, in_flight, [])
        loaded: dict[int, list[_Run]] = {n: [] for n in ways}
        single: dict[int, list[_Run]] = {n: [] for n in ways}
        for _ in range(rounds):  # alternated, so drift hits every way alike
            for n, (send, pids) in ways.items():
                loaded[n].append(await _closed_loop(send, requests, in_flight, pids))
                single[n].append(await _closed_loop(send, SINGLE_REQUESTS, 1, pids))
    paths = [_path_figures(n, loaded[n], single[n]) for n in ways]
    return ApiFigures(API_WORKERS, in_flight, requests, SINGLE_REQUESTS, rounds, paths)


def _python_send(client: RolloutClient, params: dict[str, Any]) -> Send:
    async def send(lane: int) -> None:
        [trajectory] = await client.generate([API_PROMPT], params)
        assert trajectory.finish_reason == "stop", trajectory

    return send


def _http_send(http: aiohttp.ClientSession, urls: list[str], body: dict[str, Any]) -> Send:
    """POST /v1/completions over a keep-alive connection, round-robin over `urls`; the response parsed, as a caller
    would."""
    targets = itertools.cycle([f"{url}/v1/completions" for url in urls])

    async def send(lane: int) -> None:
        async with http.post(next(targets), json=body) as response:
            response.raise_for_status()
            choice = (await response.json())["choices"][0]
        assert choice["finish_reason"] == "stop", choice

    return send


async def _closed_loop(send: Send, requests: int, in_flight: int, serve_pids: list[int]) -> _Run:
    """`requests` sends, `in_flight` at a time (each lane sends its next as its last returns): each latency, the
    rate, and the CPU seconds per second of this process, of `serve_pids` and of the whole machine."""
    remaining = requests
    latencies_s: list[float] = []

    async def lane(index: int) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            await send(index)
            latencies_s.append(time.perf_counter() - started)

    client_cpu_s, serve_cpu_s, machine_cpu_s = time.process_time(), _cpu_s(serve_pids), _machine_cpu_s()
    started = time.perf_counter()
    await asyncio.gather(*(lane(i) for i in range(in_flight)))
    elapsed_s = time.perf_counter() - started
    return _Run(
        sorted(latencies_s),
        requests / elapsed_s,
        (time.process_time() - client_cpu_s) / elapsed_s,
        (_cpu_s(serve_pids) - serve_cpu_s) / elapsed_s,
        (_machine_cpu_s() - machine_cpu_s) / elapsed_s,
    )


def _path_figures(serves: int, loaded: list[_Run], single: list[_Run]) -> PathFigures:
    best = max(loaded, key=lambda run: run.requests_per_s)
    loaded_s = sorted(s for run in loaded for s in run.latencies_s)
    single_s = sorted(s for run in single for s in run.latencies_s)
    ms = 1000.0
    return PathFigures(
        serves,
        best.requests_per_s,
        percentile(loaded_s, 50) * ms,
        percentile(loaded_s, 99) * ms,
        percentile(single_s, 50) * ms,
        percentile(single_s, 99) * ms,
        best.client_cores,
        best.serve_cores,
        best.machine_cores,
    )


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of `pids` so far (Linux /proc; 0.0 where unreadable)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return total / os.sysconf("SC_CLK_TCK")


def _machine_cpu_s() -> float:
    """CPU seconds spent by every core so far, idle and iowait excluded (Linux /proc/stat; 0.0 elsewhere)."""
    try:
        ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # guest time is within user


# --- the report ------------------------------------------------------------------------------------------------


def report(figures: ApiFigures) -> list[str]:
    """The report's HTTP section (markdown lines)."""
    f = figures
    lines = [
        "",
        "## (f) The HTTP API beside the Python client, EchoEngine",
        "",
        f"{f.workers} echo workers; the same single-prompt requests ({len(API_PROMPT)} token ids in, {len(API_PROMPT)}"
        " out) three ways,",
        f"alternated over {f.rounds} rounds: `RolloutClient.generate` in the load generator's process;"
        " `POST /v1/completions` to",
        "one `rollout-svc serve` process; the same round-robin over two. Closed loop: requests/s over"
        f" {f.requests} requests at",
        f"{f.in_flight} in flight (best round); latency percentiles over every round, at {f.in_flight} in flight and"
        f" at 1 in flight ({f.single_requests}",
        "requests a round). The HTTP load generator is one process: one `aiohttp` session with a keep-alive"
        " connection per request",
        "in flight (httpx's pool costs several times more CPU per request at 32 connections, encode/httpx#3215).",
        "CPU columns: CPU seconds per second in the best round, and per request; the load generator is that"
        " process, the",
        f"machine every process on its {os.cpu_count()} CPUs, which the load generator, the serve processes, the"
        " workers and Redis share.",
        "Goals: one serve process >= 0.5 x the Python client's requests/s; its p50 at 1 in flight within 1 ms of"
        " the Python",
        "client's.",
        "",
        f"| path | requests/s at {f.in_flight} in flight | p50 (ms) | p99 (ms) | p50 (ms), 1 in flight"
        " | p99 (ms), 1 in flight | load generator CPU (s/s) | its CPU per request (ms) | serve CPU (s/s)"
        " | its CPU per request (ms) | machine CPU (s/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in f.paths:
        serve = f"{p.serve_cores:.2f} | {p.serve_cores / p.requests_per_s * 1000:.2f}" if p.serves else "- | -"
        lines.append(
            f"| {p.name} | {p.requests_per_s:,.0f} | {p.loaded_p50_ms:.2f} | {p.loaded_p99_ms:.2f} |"
            f" {p.single_p50_ms:.2f} | {p.single_p99_ms:.2f} | {p.client_cores:.2f} |"
            f" {p.client_cores / p.requests_per_s * 1000:.2f} | {serve} | {p.machine_cores:.2f} |"
        )
    python, one = f.paths[0], f.paths[1]
    lines += [
        "",
        f"HTTP through one serve process / Python client, requests/s: {f.ratio:.2f} (goal >= 0.5);"
        f" p50 at 1 in flight: {one.single_p50_ms:.2f} ms vs {python.single_p50_ms:.2f} ms, a gap of"
        f" {f.p50_gap_ms:+.2f} ms (goal <= 1 ms).",
    ]
    if len(f.paths) > 2:
        lines[-1] += f" Two serve processes / one: {f.paths[2].requests_per_s / one.requests_per_s:.2f}."
    return lines
