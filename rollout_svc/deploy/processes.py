"""Child processes of a local deployment: tied to their parent's life, signalled as a group, given CPUs and ports."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

# Sets PR_SET_PDEATHSIG (argv[1], a signal number), then execs the real command: if `up` itself is killed with -9,
# its Redis and workers get SIGTERM (workers drain and requeue) instead of living on as orphans. The signal
# follows the *thread* that started the child: the main thread, or the supervisor, which lives until stop().
_DIE_WITH_PARENT = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, int(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])"
)


def die_with_parent(args: list[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """`args`, run so that the child gets `sig` when this process dies (Linux; elsewhere unchanged)."""
    if not sys.platform.startswith("linux"):
        return args
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(int(sig)), *args]


def cpu_sets(count: int, ranks: int = 1) -> list[str]:
    """Split this process's CPUs evenly among `count` engines of `ranks` ranks each (tensor x pipeline x data
    parallel), as VLLM_CPU_OMP_THREADS_BIND values: "0-1" for one rank, "0|1|0" for three ranks on two CPUs (vLLM's
    CPU backend binds rank i to the i-th `|`-separated set; with fewer CPUs than ranks, ranks share CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    slots = max(1, count * ranks)
    per = max(1, len(cpus) // slots)
    sets = []
    for slot in range(slots):
        chunk = cpus[(slot * per) % len(cpus) :][:per]
        sets.append(f"{chunk[0]}-{chunk[-1]}" if len(chunk) > 1 else str(chunk[0]))
    return ["|".join(sets[i * ranks : (i + 1) * ranks]) for i in range(count)]


def signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 20000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server of ours to bind soon (a private Redis, a test's API).

    Drawn at random below the kernel's ephemeral range (`ip_local_port_range`, 32768-60999 by default) and checked
    by binding it: a port from `bind(0)` is one the kernel also hands to outgoing connections, and one of those (any
    Redis client on the host) can take it before the server binds it (a CI run saw a private Redis fail so). A port
    below 32768 also leaves room for Redis Cluster's bus port (port + 10000). Where the range cannot be read or leaves
    no room below it, falls back to `bind(0)`."""
    try:
        low = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = LOWEST_PICKED_PORT
    for _ in range(64 if low - LOWEST_PICKED_PORT >= 1000 else 0):
        port = random.randrange(LOWEST_PICKED_PORT, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
