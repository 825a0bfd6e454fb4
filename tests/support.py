"""Test support: worker subprocesses, the environment that hands them a test's settings, and waits for events."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import redis

from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy import local as cluster
from rollout_svc.deploy.processes import free_port
from rollout_svc.keys import PAYLOAD_FIELD, WORKERS_GROUP
from rollout_svc.protocol import Trajectory, TrajectoryChunk, decode

if TYPE_CHECKING:
    from rollout_svc import RolloutClient

ROOT = Path(__file__).resolve().parents[1]
# Options of echo workers that receive weights: torch imported before the worker registers (as vLLM does), since a
# cold `import torch` holds the GIL, and with it the heartbeat, for seconds on a busy machine.
SYNC_ECHO_ARGS = ("--echo-preload-weight-transfer",)
# Their heartbeat TTL: the default's 10 s, not the 2 s of the other tests. A sync's gloo receive and digest share two
# cores with the engine's tests beside them under xdist, and a make test on CI once lost a worker mid-sync at 6 s.
SYNC_HEARTBEAT_TTL_S = 10.0


def _normal_priority() -> None:
    """In the child, before exec: the default priority (nice 0). A session's Redis started by a test on the real
    engine would otherwise inherit that test's nice 10 (tests/conftest.py) and serve every later test from behind the
    engines; raising it back needs root (CAP_SYS_NICE): without, it stays as it was."""
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A redis-server of our own on a free port (no persistence), as its URL once it answers; stopped on leaving."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not on PATH: install Redis >= 6.2 (apt install redis-server)"
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        preexec_fn=_normal_priority,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    try:
        yield url
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=10)


def settings_env(settings: Settings) -> dict[str, str]:
    """This process's environment, plus the env vars that give a worker `settings`."""
    return {**os.environ, **cluster.settings_env(settings)}


def fresh_python(code: str) -> str:
    """What `code` prints, run by a fresh interpreter at the project root: what an import pulls in, or what a second
    process computes, free of anything this test process imported. Raises `CalledProcessError` if it fails."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.02) -> Any:
    """Poll `predicate` until it returns something truthy (returned); AssertionError naming `what` after timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)


async def async_wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.02) -> Any:
    """`wait_until` for the event loop; `predicate` may be a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(interval_s)


class Streaming:
    """A `RolloutClient.stream` call running in a task, so a test can await its requests' progress: `tokens[i]` is
    how many tokens prompt i has streamed so far, `arrived[i]` when its trajectory came (monotonic s); `await
    streaming.task` gives the trajectories in prompt order.

    Example::

        run = Streaming(client, prompts, {"max_tokens": 30})
        await run.streamed(2, timeout_s=5)  # each request made 2 tokens or more: cut now, it is cut mid-generation
        await client.pause("abort")
        trajectories = await run.task
    """

    def __init__(self, client: RolloutClient, prompts: list[Any], params: Any = None, **kwargs: Any) -> None:
        self.tokens = [0] * len(prompts)
        self.arrived: dict[int, float] = {}
        self.task: asyncio.Future[list[Trajectory]] = asyncio.ensure_future(
            self._collect(client, prompts, params, kwargs)
        )

    async def _collect(
        self, client: RolloutClient, prompts: list[Any], params: Any, kwargs: dict[str, Any]
    ) -> list[Trajectory]:
        done: dict[int, Trajectory] = {}
        async for index, item in client.stream(prompts, params, **kwargs):
            if isinstance(item, TrajectoryChunk):  # a retry's chunks may repeat tokens: count by offset
                self.tokens[index] = max(self.tokens[index], item.offset + len(item.token_ids))
            else:
                done[index], self.arrived[index] = item, time.monotonic()
        return [done[i] for i in range(len(prompts))]

    async def streamed(self, at_least: int, timeout_s: float, count: int | None = None) -> list[int]:
        """Wait until `count` prompts (default: all) have streamed `at_least` tokens each; returns the counts then.
        Raises what the stream raised, or AssertionError, if it ended first."""

        what = f"{'all' if count is None else count} requests to stream {at_least} tokens"

        def reached() -> bool:
            if sum(n >= at_least for n in self.tokens) >= (len(self.tokens) if count is None else count):
                return True
            if self.task.done():
                self.task.result()  # raises the stream's error, if any
                raise AssertionError(f"the stream ended before {what}: {self.tokens}")
            return False

        await async_wait_until(reached, timeout_s, what)
        return list(self.tokens)


def pending(rds: redis.Redis, stream: str) -> int:
    """How many entries of a requests stream workers have taken and not answered (its PEL)."""
    if not rds.exists(stream):
        return 0
    return int(rds.xpending(stream, WORKERS_GROUP)["pending"])


def queued(rds: redis.Redis, stream: str) -> int:
    """How many entries of a requests stream wait to be taken (acked entries are deleted). One MULTI: an entry
    answered between the two reads would otherwise count as queued."""
    if not rds.exists(stream):
        return 0
    pipe = rds.pipeline(transaction=True)
    pipe.xlen(stream)
    pipe.xpending(stream, WORKERS_GROUP)
    length, summary = pipe.execute()
    return int(length) - int(summary["pending"])


class Results:
    """A producer's results stream read directly, for tests that send raw requests."""

    def __init__(self, rds: redis.Redis, stream: str) -> None:
        self.rds, self.stream, self._last = rds, stream, b"0-0"

    def read(self, count: int, timeout_s: float = 10) -> list[Any]:
        """The next `count` results (decoded), waiting up to `timeout_s`."""
        results: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while len(results) < count:
            block_ms = max(1, int((deadline - time.monotonic()) * 1000))
            assert time.monotonic() < deadline, f"got {len(results)} of {count} results on {self.stream}"
            for _, records in self.rds.xread({self.stream: self._last}, block=block_ms) or []:
                for entry_id, fields in records:
                    self._last = entry_id
                    results.append(decode(fields[PAYLOAD_FIELD]))
        return results


def python312() -> str | None:
    """A Python 3.12 on this machine, as the Makefile finds one (`python3.12` on the PATH, else pyenv's), or None."""
    with contextlib.suppress(OSError):
        found = subprocess.run(
            ["python3.12", "-c", "import sys; print(sys.executable)"], capture_output=True, text=True
        )
        if found.returncode == 0:
            return found.stdout.strip()
    with contextlib.suppress(OSError):
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip()
        if root:
            return next((str(p) for p in sorted(Path(root).glob("versions/3.12*/bin/python3.12"))), None)
    return None


class WorkerProcs:
    """Starts `python -m workers` subprocesses and kills whatever is left at teardown."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings, self.log_dir = settings, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, worker_id: str, *args: str, env: dict[str, str] | None = None, python: str = sys.executable
    ) -> subprocess.Popen[bytes]:
        """`python -m workers` (this venv's Python, or `python`: another venv's) as `worker_id`."""
        with open(self.log_dir / f"{worker_id}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [python, "-m", "workers", "--worker-id", worker_id, *args],
                env={**settings_env(self.settings), **(env or {})},
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[worker_id] = proc
        return proc

    def wait_live(self, *worker_ids: str, timeout_s: float = 60) -> None:
        client = redis.Redis.from_url(self.settings.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while not all(client.exists(self.settings.keys.worker(w)) for w in worker_ids):
                for w in worker_ids:
                    proc = self.procs.get(w)  # None: a replica of a process started under another id (--sim-engines)
                    assert proc is None or proc.poll() is None, f"worker {w} exited: {self.log(w)[-3000:]}"
                assert time.monotonic() < deadline, f"workers {worker_ids} not live after {timeout_s} s"
                time.sleep(0.05)
        finally:
            client.close()

    def start_ready(self, worker_ids: list[str], *args: str, env: dict[str, str] | None = None) -> list[str]:
        """Start these workers with the same args, then wait until each is live and converged (`wait_ready`)."""
        for worker_id in worker_ids:
            self.start(worker_id, *args, env=env)
        self.wait_ready(*worker_ids)
        return worker_ids

    def wait_ready(self, *worker_ids: str) -> None:
        """Until each worker is live and out of `starting`: what a test that submits work at once needs."""
        self.wait_live(*worker_ids)
        self.wait_converged(*worker_ids)

    def wait_converged(self, *worker_ids: str, timeout_s: float = 30) -> None:
        """Until each worker left `starting` (it applied the fleet's control state: serving, paused, ...). A test
        that submits at once to workers still starting sees one worker take everything while the other starts."""
        client = redis.Redis.from_url(self.settings.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while any(client.hget(self.settings.keys.worker(w), "state") in (None, b"starting") for w in worker_ids):
                assert time.monotonic() < deadline, f"workers {worker_ids} still starting after {timeout_s} s"
                time.sleep(0.02)
        finally:
            client.close()

    def log(self, worker_id: str) -> str:
        return (self.log_dir / f"{worker_id}.log").read_text(errors="replace")

    def pid(self, worker_id: str) -> int:
        return self.procs[worker_id].pid

    def kill(self, worker_id: str, sig: int = signal.SIGKILL) -> None:
        os.killpg(self.procs[worker_id].pid, sig)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)  # a test may have stopped one
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def vllm_workers(settings: Settings, engine: EngineSettings, log_dir: Path, count: int = 2) -> Iterator[WorkerProcs]:
    """`count` vLLM workers `vllm-0`, `vllm-1`, ... (one CPU core each), live on entering, stopped on leaving."""
    procs = WorkerProcs(settings, log_dir)
    ids = [f"vllm-{i}" for i in range(count)]
    for i, worker_id in enumerate(ids):
        procs.start(worker_id, *engine.to_args(), env={"VLLM_CPU_OMP_THREADS_BIND": str(i)})
    try:
        procs.wait_live(*ids, timeout_s=600)
        yield procs
    finally:
        procs.stop_all()


@contextlib.contextmanager
def serve(settings: Settings, log: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`rollout-svc serve` on a free port, `env` added to the settings' environment (keys, tokens); yields its base
    URL once it answers."""
    port = free_port()
    environment = {**settings_env(settings), **(env or {})}
    command = [sys.executable, "-m", "rollout_svc", "serve", "--port", str(port), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=environment, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{base}/metrics", timeout=1).status_code == 200
            return False

        wait_until(up, 45, "rollout-svc serve answering")  # 20 s ran out in a CI run under load
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a response still open (a test that failed mid-stream): no leftovers
            proc.kill()
            proc.wait()
