"""Child processes of a local deployment: tied to their parent's life, signalled as a group, given CPUs and ports."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys

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


def visible_gpus() -> list[str]:
    """The GPUs this process may give its workers: `CUDA_VISIBLE_DEVICES` where set (its comma-separated ids), else
    the indexes `nvidia-smi` lists; none where there is neither (a CPU host)."""
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()] if listed.returncode == 0 else []


def gpu_sets(count: int, ranks: int, gpus: list[str]) -> list[str]:
    """`count` engines of `ranks` GPUs each (tensor x pipeline x data parallel), given disjoint sets of `gpus`, as
    CUDA_VISIBLE_DEVICES values ("0", "1", ... or "0,1,2,3", "4,5,6,7"). Raises `ValueError` where there are too
    few: two vLLM engines on one GPU would each take vLLM's share of its memory."""
    if count * ranks > len(gpus):
        raise ValueError(
            f"{count} workers of {ranks} GPU(s) each need {count * ranks} GPUs; this host has {len(gpus)} "
            f"({','.join(gpus)}): start fewer workers, or use --ray on a cluster with more"
        )
    return [",".join(gpus[i * ranks : (i + 1) * ranks]) for i in range(count)]


def signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (`bind(0)`), for a server of ours to bind soon (a private Redis, a test's API).
    Another socket may take it before the server binds it: `PrivateRedis.start` tries again while it is held, and
    says what Redis said if it stays held. (Drawing below the kernel's ephemeral range instead, to keep outgoing
    connections off it, made two of our own picks meet more often: a CI run saw it.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
