"""The chaos soak's fleet, on loopback as children of this process: a private append-only Redis and echo workers,
started, signalled, supervised as a process manager would, and killed whatever happens; the soak's knobs and
journal (`rollout_svc.tools.chaos.soak` drives the load and the faults)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from redis.exceptions import RedisError

from rollout_svc.config import EngineSettings, Settings, settings_env
from rollout_svc.connections.urls import redis_async
from rollout_svc.deploy.local import PrivateRedis
from rollout_svc.deploy.processes import die_with_parent, free_port

RESTART_DELAY_S = 1.0  # a process manager's delay before it starts a worker again
CONTROL_TIMEOUT_S = 15.0  # a control command's acks (a stalled worker is dropped once reaped, within the TTL)
WORKER_ERROR_SAMPLES = 5
# Children get SIGKILL when this process dies (`cluster.die_with_parent`): a worker it stopped (SIGSTOP) would hold a
# SIGTERM pending until continued, forever.
DEATH_SIGNAL = signal.SIGKILL


@dataclass
class ChaosConfig:
    """One soak's knobs. `minutes` of load and faults; then the drain (each call bounded by `request_timeout_s`)
    and the settle (`settle_s`). `seed`: the fault schedule and the load (timings still vary from run to run)."""

    minutes: float = 1.0
    seed: int = 0
    workers: int = 3
    capacity: int = 16  # per worker (max_num_seqs)
    token_delay_s: float = 0.01  # echo: a request of n tokens generates for n of these
    # Longer than a Redis restart (down up to 2 s, then its load), as any deployment's TTL must be: with 2.5 s, every
    # restart expired every heartbeat, and the reaping and fencing that followed each one stacked up into calls
    # past their 30 s timeout in one 10-minute run. Still short enough for dozens of stalls past it per run.
    heartbeat_ttl_s: float = 4.0
    heartbeat_interval_s: float = 0.5
    session_drivers: int = 6
    batch_drivers: int = 2
    request_timeout_s: float = 30.0
    fault_gap_s: tuple[float, float] = (0.5, 2.5)
    settle_s: float = 30.0
    log_dir: Path | None = None  # None: a temporary folder, removed after a clean run
    syncs: bool = True  # a trainer syncs weights every 1-3 s (`chaos.syncs`), and the nemesis kills it
    http_pauses: bool = True  # a `serve` of its own, and trainers killed holding its pause (`chaos.http_pauses`)
    step_restarts: bool = True  # trainers killed mid-step, a new process attaching (`chaos.step_restarts`)

    def settings(self, redis_url: str) -> Settings:
        return Settings(
            redis_url=redis_url,
            key_prefix="chaos",
            heartbeat_ttl_s=self.heartbeat_ttl_s,
            heartbeat_interval_s=self.heartbeat_interval_s,
            request_timeout_s=self.request_timeout_s,
            control_timeout_s=CONTROL_TIMEOUT_S,
        )


class Journal:
    """The run as it happens, one flushed line per event: seconds since the start, a kind, what happened."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream, self.started_at = stream, time.time()

    def __call__(self, kind: str, text: str) -> None:
        self.stream.write(f"{time.time() - self.started_at:7.1f} s  {kind:<14} {text}\n")
        self.stream.flush()

    def print(self, text: str = "") -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


# --- the fleet: Redis and workers as child processes -----------------------------------------------------------


@dataclass
class Slot:
    """One worker's place in the fleet and the process running there now (a kill replaces it)."""

    name: str
    worker_id: str
    process: subprocess.Popen[bytes] | None = None
    busy: bool = False  # a fault holds it: killed and not yet replaced, or stalled
    kills: int = 0


class ChaosFleet:
    """The private Redis and the echo workers. Children are started from the event loop's thread (their
    PR_SET_PDEATHSIG follows the thread that started them) and `close()` kills every one, whatever happened."""

    def __init__(self, config: ChaosConfig, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.redis_url = f"redis://127.0.0.1:{free_port()}/0"
        (log_dir / "checkpoints").mkdir(parents=True, exist_ok=True)  # the trainer's checkpoint syncs write there
        self.settings = config.settings(self.redis_url).copy_with(checkpoint_root=log_dir / "checkpoints")
        self.redis = PrivateRedis(self.redis_url, log_dir / "redis")
        self.redis_process: subprocess.Popen[bytes] | None = None
        self.engine = EngineSettings(
            engine="echo",
            max_num_seqs=config.capacity,
            echo_token_delay_s=config.token_delay_s,
            echo_preload_weight_transfer=config.syncs,  # torch imported at start: a replacement joins a sync at once
        )
        self.slots = [Slot(f"w{i}", f"w{i}") for i in range(config.workers)]
        self.processes: list[subprocess.Popen[bytes]] = []  # every child ever started
        self.crashes: list[dict[str, Any]] = []  # workers that exited on their own, as violations

    async def start(self, timeout_s: float = 60.0) -> None:
        await self.start_redis()
        for slot in self.slots:
            self.spawn(slot)
        await self.wait_live(timeout_s)

    async def start_redis(self, timeout_s: float = 15.0) -> float:
        """Start Redis from its files and wait until it answers (not while it loads them). Returns seconds taken."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("chaos needs redis-server on PATH (apt install redis-server)")
        assert self.redis.data_dir is not None
        self.redis.data_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_dir / "redis.log", "ab") as out:  # the child holds its own descriptor
            self.redis_process = subprocess.Popen(
                die_with_parent(self.redis.args(binary), DEATH_SIGNAL), stdout=out, stderr=subprocess.STDOUT
            )
        self.processes.append(self.redis_process)
        client = redis_async(self.redis_url, socket_connect_timeout=0.5, socket_timeout=1.0)
        try:
            while True:
                with contextlib.suppress(RedisError, OSError):
                    if await client.ping():
                        return time.monotonic() - started
                if self.redis_process.poll() is not None or time.monotonic() - started > timeout_s:
                    raise RuntimeError(f"Redis did not come back on {self.redis_url}; see {self.log_dir}/redis.log")
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    async def stop_redis(self, sig: signal.Signals) -> None:
        assert self.redis_process is not None
        self.redis_process.send_signal(sig)
        if not await exited(self.redis_process, 10.0):
            self.redis_process.kill()
            await exited(self.redis_process, 5.0)

    def spawn(self, slot: Slot) -> None:
        args = [sys.executable, "-m", "workers", "--worker-id", slot.worker_id, *self.engine.to_args()]
        slot.process = self.child(args, f"{slot.name}.log")

    def child(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        """Start `args` as a child of the soak: the fleet's settings in its environment, its output appended to
        `log_name` in the log folder, in a session of its own (a SIGKILL of its group kills it whole), dying with
        this process, and killed by `close` whatever happens."""
        env = {**os.environ, **settings_env(self.settings)}
        with open(self.log_dir / log_name, "ab") as out:  # the child holds its own descriptor
            process = subprocess.Popen(
                die_with_parent(args, DEATH_SIGNAL),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def signal(self, slot: Slot, sig: signal.Signals) -> int:
        """Send `sig` to the slot's process group; returns the worker's pid."""
        assert slot.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(slot.process.pid, sig)
        return slot.process.pid

    async def wait_live(self, timeout_s: float) -> None:
        keys, deadline = self.settings.keys, time.monotonic() + timeout_s
        client = redis_async(self.redis_url)
        try:
            while not all([await client.exists(keys.worker(s.worker_id)) for s in self.slots]):
                for slot in self.slots:
                    if slot.process is not None and slot.process.poll() is not None:
                        raise RuntimeError(
                            f"worker {slot.worker_id} exited at start; see {self.log_dir}/{slot.name}.log"
                        )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers not live after {timeout_s:g} s; see the logs in {self.log_dir}")
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    async def supervise(self, journal: Journal) -> None:
        """A process manager's loop (until cancelled): a worker that exited on its own (not killed by the nemesis) is
        recorded as a crash, with the error its log ends with, and started again under the same id."""
        while True:
            await asyncio.sleep(0.5)
            for slot in self.slots:
                if slot.busy or slot.process is None or slot.process.poll() is None:
                    continue
                pid, code = slot.process.pid, slot.process.returncode
                error = last_error(self.log_dir / f"{slot.name}.log")
                what = f"worker {slot.worker_id} (pid {pid}) exited with {code} on its own: {error}"
                self.crashes.append({"check": "crash", "what": what, "worker_id": slot.worker_id})
                journal("crash", f"{what}; restarting it")
                slot.busy = True
                await asyncio.sleep(RESTART_DELAY_S)
                self.spawn(slot)
                slot.busy = False

    def close(self) -> None:
        """Kill every child still running (a stopped one is continued first, so that it can die)."""
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGCONT)
                    os.killpg(process.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)


def last_error(log_path: Path) -> str:
    """The last ERROR line of a worker's log and the exception that ends it (its last line naming an error)."""
    lines = log_path.read_text(errors="replace").splitlines()
    logged = next((line.split(" ERROR ", 1)[1] for line in reversed(lines) if " ERROR " in line), "no ERROR logged")
    raised = next((line for line in reversed(lines) if re.match(r"^[\w.]+(Error|Exception)\b", line)), "")
    return f"{logged[:200]}" + (f" ({raised[:200]})" if raised else "")


async def exited(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while process.poll() is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def worker_errors(log_dir: Path) -> tuple[int, list[str]]:
    """(how many ERROR lines the workers logged, the first few distinct ones without their timestamps): a request
    that failed inside a worker is not always seen by the caller (the client drops a duplicate's answer)."""
    count, samples = 0, list[str]()
    for path in sorted(log_dir.glob("w*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if " ERROR " not in line:
                continue
            count += 1
            message = f"{path.stem}: {line.split(' ERROR ', 1)[1][:200]}"
            if len(samples) < WORKER_ERROR_SAMPLES and message not in samples:
                samples.append(message)
    return count, samples
