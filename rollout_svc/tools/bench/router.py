"""`rollout-svc bench`, the hop section's anchor: vllm-router (the Rust router vLLM users pick) in front of two trivial
HTTP backends, and the closed-loop load both sides of the section are driven with (see `rollout_svc.tools.bench.hop`).

Each backend is a minimal aiohttp server (`python -m rollout_svc.tools.bench.router --backend PORT`) that answers
`POST /v1/completions` with one fixed OpenAI-style completion of 16 tokens, `GET /health` (what the router polls
before it serves, and every `--health-check-interval-secs`) and `GET /v1/models`. Every process runs in a process
group of its own and gets SIGTERM if this one dies; leaving `router_fleet` stops them all (bounded waits, then
SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING

from rollout_svc.deploy.processes import die_with_parent, free_port
from rollout_svc.tools.runs import percentile

if TYPE_CHECKING:
    from aiohttp import web

HOP_PROMPT = list(range(1, 17))  # 16 token ids in, 16 out: the queue-overhead section's request
MODEL = "echo"
COMPLETION = {
    "id": "cmpl-hop",
    "object": "text_completion",
    "created": 0,
    "model": MODEL,
    "choices": [
        {"index": 0, "text": "abcdefghijklmnop", "token_ids": HOP_PROMPT, "logprobs": None, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 16, "completion_tokens": 16, "total_tokens": 32},
}
GENERATE = {  # vLLM's `/inference/v1/generate` answer (SkyRL's `generate`), 16 token ids out
    "request_id": "gen-hop",
    "choices": [{"index": 0, "token_ids": HOP_PROMPT, "logprobs": None, "finish_reason": "stop"}],
}
DETOKENIZED = {"prompt": "abcdefghijklmnop"}  # vLLM's `/detokenize` answer (SkyRL's `generate` calls it after each)
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

Send = Callable[[], Awaitable[None]]
CpuMeter = Callable[[], float]  # cumulative CPU seconds of one role (this process, the router, the workers, ...)


@dataclass
class Point:
    """One closed-loop run: `in_flight` requests kept in flight (or one call of `requests` prompts when batched)."""

    in_flight: int
    requests: int
    elapsed_s: float
    p50_ms: float
    p99_ms: float
    cpu_us: dict[str, float] = field(default_factory=dict)  # role -> CPU microseconds per request

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s


def cpu_of(pids: list[int]) -> CpuMeter:
    """A meter of the user + system CPU seconds of `pids` and their children (0 for a process that is gone)."""
    import psutil

    def read() -> float:
        total = 0.0
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                for p in [process, *process.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        times = p.cpu_times()
                        total += times.user + times.system
        return total

    return read


def measured(requests: int, elapsed_s: float, latencies_s: list[float], in_flight: int, cpu: dict[str, float]) -> Point:
    latencies_s.sort()
    per_request = {role: seconds / max(1, requests) * 1e6 for role, seconds in cpu.items()}
    ms = 1000.0
    return Point(
        in_flight,
        requests,
        elapsed_s,
        percentile(latencies_s, 50) * ms,
        percentile(latencies_s, 99) * ms,
        per_request,
    )


def read_meters(meters: dict[str, CpuMeter]) -> dict[str, float]:
    return {role: meter() for role, meter in meters.items()}


async def closed_loop(
    send: Send,
    in_flight: int,
    meters: dict[str, CpuMeter],
    duration_s: float | None = None,
    requests: int | None = None,
    min_requests: int = 0,
) -> Point:
    """Keep `in_flight` sends going (each lane sends its next as its last returns) for `duration_s` (then the last
    ones drain) or for `requests` sends in all; each latency, the rate and every role's CPU per request.
    `min_requests` (with `duration_s`): go on past the duration until this many were sent, so a point measured while
    the machine stalls still holds enough requests for its CPU readings (10 ms ticks) to mean something."""
    assert (duration_s is None) != (requests is None), "give a duration or a request count"
    latencies_s: list[float] = []
    remaining = requests if requests is not None else -1
    sent = 0
    end = float("inf")

    async def lane() -> None:
        nonlocal remaining, sent
        while True:
            if remaining == 0 or (time.perf_counter() >= end and sent >= min_requests):
                return
            sent += 1
            if remaining > 0:
                remaining -= 1
            started = time.perf_counter()
            await send()
            latencies_s.append(time.perf_counter() - started)

    before = read_meters(meters)
    started = time.perf_counter()
    if duration_s is not None:
        end = started + duration_s
    await asyncio.gather(*(lane() for _ in range(in_flight)))
    elapsed_s = time.perf_counter() - started
    after = read_meters(meters)
    cpu = {role: after[role] - before[role] for role in meters}
    return measured(len(latencies_s), elapsed_s, latencies_s, in_flight, cpu)


async def in_turn(
    sides: tuple[tuple[Send, dict[str, CpuMeter]], tuple[Send, dict[str, CpuMeter]]],
    in_flight: int,
    rounds: int,
    duration_s: float | None = None,
    requests: int | None = None,
    min_requests: int = 0,
) -> tuple[list[Point], list[Point]]:
    """Two sides (how each sends one request, and its CPU meters) at one load: a warm-up round of `in_flight` sends
    each (connections opened), then `rounds` closed loops each (`closed_loop`, with `duration_s` or `requests`,
    and `min_requests`), in turn: the first side first in odd rounds, the second first in even ones, so a drift of
    the machine's speed hits both alike. Each side's points, one per round."""
    for send, _ in sides:
        await closed_loop(send, in_flight, {}, requests=in_flight)
    points: tuple[list[Point], list[Point]] = ([], [])
    for r in range(rounds):
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            send, meters = sides[side]
            points[side].append(await closed_loop(send, in_flight, meters, duration_s, requests, min_requests))
    return points


def median_round(points: list[Point], by: str = "requests_per_s") -> Point:
    """One side's median round at one load, ranked by the `Point` field `by` (of an even count, the lower middle)."""
    return sorted(points, key=lambda p: float(getattr(p, by)))[(len(points) - 1) // 2]


def round_ratios(ours: list[Point], theirs: list[Point], of: str) -> list[float]:
    """Round by round, ours over theirs of the `Point` field `of` (rounds measured in turn: `in_turn`)."""
    return [float(getattr(o, of)) / float(getattr(t, of)) for o, t in zip(ours, theirs, strict=True)]


class InTurnFigures:
    """What figures of two sides measured in turn (`in_turn`) have alike: each side's points at each load, one per
    round (`router_rounds`, `ours_rounds`, set by the dataclass that mixes this in), each side's median round and the
    rounds' ratios of a load."""

    router_rounds: list[list[Point]]
    ours_rounds: list[list[Point]]

    @property
    def router(self) -> list[Point]:
        """The router's median round (by requests/s) at each load."""
        return [median_round(points) for points in self.router_rounds]

    @property
    def ours(self) -> list[Point]:
        return [median_round(points) for points in self.ours_rounds]

    def rate_ratios(self, i: int) -> list[float]:
        """Ours / the router's requests/s at load i, one per round."""
        return round_ratios(self.ours_rounds[i], self.router_rounds[i], "requests_per_s")


def listed(ratios: list[float]) -> str:
    """The rounds' ratios as a report lists them: their median, then each: `1.21 (1.21, 1.30, 1.02)`."""
    return f"{median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})"


def at_least(requests: int) -> str:
    """How a closed loop's `min_requests` reads after its duration in a bench's text (nothing when it has none)."""
    return f" (and until {requests:,} were sent)" if requests else ""


# --- the processes -----------------------------------------------------------------------------------------------


@dataclass
class RouterFleet:
    url: str
    router_pid: int
    backend_pids: list[int]
    command: list[str]  # the router's command line, `vllm-router` first
    backend_urls: list[str] = field(default_factory=list)

    @property
    def command_line(self) -> str:
        return " ".join(self.command)


def router_binary() -> str:
    """The `vllm-router` script beside this interpreter, else on PATH. Raises `RuntimeError` if there is none."""
    binary = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if binary is None:
        raise RuntimeError("vllm-router is not installed: pip install vllm-router==0.1.17 (the dev extra has it)")
    return binary


def router_args(backends: list[str], port: int, metrics_port: int, policy: str = "round_robin") -> list[str]:
    """Its options: `policy` over the backends (round robin by default), logging at warning (nothing per request),
    its own ports."""
    return [
        *("--worker-urls", *backends),
        *("--host", "127.0.0.1", "--port", str(port), "--policy", policy),
        *("--prometheus-port", str(metrics_port), "--log-level", "warning", "--worker-startup-check-interval", "1"),
    ]


class Spawned:
    """The processes a part of the bench starts, each in a process group of its own that gets SIGTERM if this one
    dies, its output in `log_dir/<name>.log`. A context manager: leaving it stops them all (`stop`)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Spawned:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "ab") as out:
            process = subprocess.Popen(
                die_with_parent(args), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.processes.append(process)
        return process

    def wait_answering(self, url: str, body: dict | None, process: subprocess.Popen[bytes]) -> None:
        """Return once `url` answers 200 (a POST of `body`, else a GET). Raises `RuntimeError` naming the logs if
        `process` exits or `START_TIMEOUT_S` passes first."""
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                response = httpx.post(url, json=body, timeout=1.0) if body else httpx.get(url, timeout=1.0)
                if response.status_code == 200:
                    return
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer in {START_TIMEOUT_S:g} s; see the logs in {self.log_dir}")
            time.sleep(0.1)

    def start_router(
        self, backends: list[str], check: dict, policy: str = "round_robin", name: str = "vllm-router"
    ) -> tuple[str, subprocess.Popen[bytes], list[str]]:
        """vllm-router (`policy`) in front of `backends`: its URL, its process and its options (`router_args`), once
        it answered the completion `check`."""
        args = router_args(backends, free_port(), free_port(), policy)
        router = self.spawn([router_binary(), *args], name)
        url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
        self.wait_answering(f"{url}/v1/completions", check, router)
        return url, router, args

    def stop(self) -> None:
        """SIGTERM each process group, wait (bounded), then SIGKILL what is left of each group."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self.processes.clear()


@contextlib.contextmanager
def router_fleet(log_dir: Path, backends: int = 2) -> Iterator[RouterFleet]:
    """`backends` backends, then vllm-router in front of them; yields once the router answered a completion."""
    with Spawned(log_dir) as spawned:
        urls = []
        for i in range(backends):
            port = free_port()
            spawned.spawn(
                [sys.executable, "-m", "rollout_svc.tools.bench.router", "--backend", str(port)], f"backend-{i}"
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url, process in zip(urls, spawned.processes, strict=True):
            spawned.wait_answering(f"{url}/health", None, process)
        pids = [p.pid for p in spawned.processes]
        check = {"model": MODEL, "prompt": HOP_PROMPT, "max_tokens": 16}
        url, router, args = spawned.start_router(urls, check)
        yield RouterFleet(url, router.pid, pids, ["vllm-router", *args], urls)


# --- sending through the router ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def router_sender(fleet: RouterFleet, connections: int) -> AsyncIterator[tuple[Send, dict[str, CpuMeter]]]:
    """A send of one `POST /v1/completions` through the router (the response parsed, as a caller would), and the CPU
    meters of that side: one aiohttp session with up to `connections` keep-alive connections (one per request in
    flight)."""
    import aiohttp

    meters = {
        "client": time.process_time,
        "router": cpu_of([fleet.router_pid]),
        "backends": cpu_of(fleet.backend_pids),
    }
    body = {"model": MODEL, "prompt": HOP_PROMPT, "max_tokens": len(HOP_PROMPT)}
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=connections)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        target = f"{fleet.url}/v1/completions"

        async def send() -> None:
            async with http.post(target, json=body) as response:
                response.raise_for_status()
                choice = (await response.json())["choices"][0]
            assert choice["finish_reason"] == "stop", choice

        yield send, meters


# --- the backend process -----------------------------------------------------------------------------------------


def backend_app(model: str, posts: Mapping[str, Callable[[web.Request], Awaitable[web.Response]]]) -> web.Application:
    """A vLLM-style backend's aiohttp app: `posts` (route -> handler), `GET /health` (what vllm-router polls before
    it serves) and `GET /v1/models` (the one model `model`)."""
    from aiohttp import web

    models = {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "rollout-svc"}]}

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def list_models(request: web.Request) -> web.Response:
        return web.json_response(models)

    app = web.Application()
    for route, handler in posts.items():
        app.router.add_post(route, handler)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    return app


def serve_backend(port: int) -> None:
    """A trivial vLLM-style backend: one fixed answer (the body is read) for every `POST /v1/completions`, and, for
    SkyRL's client, every `POST /inference/v1/generate` and `POST /detokenize`."""
    from aiohttp import web

    def fixed(answer: object) -> Callable[[web.Request], Awaitable[web.Response]]:
        body = json.dumps(answer).encode()

        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=body, content_type="application/json")

        return handler

    posts = {"/v1/completions": COMPLETION, "/inference/v1/generate": GENERATE, "/detokenize": DETOKENIZED}
    app = backend_app(MODEL, {route: fixed(answer) for route, answer in posts.items()})
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=8192, shutdown_timeout=1.0)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--backend":
        sys.exit("usage: python -m rollout_svc.tools.bench.router --backend PORT")
    serve_backend(int(sys.argv[2]))
