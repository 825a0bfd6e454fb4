"""The dtype an engine runs in: vLLM's own choice, except `auto` on a CPU without native bf16, which is float32."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("rollout_svc.worker")

# x86 flags (as /proc/cpuinfo spells them) of bf16 in hardware: AVX512-BF16 dot products, or AMX tiles.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")


def read_cpu_flags(cpuinfo: Path = CPUINFO) -> set[str] | None:
    """The CPU's feature flags from the first `flags` line of `/proc/cpuinfo` (x86 only); None where there is none
    (another architecture, or no /proc)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return None


def resolve_dtype(dtype: str, *, cpu_backend: bool, cpu_flags: set[str] | None) -> tuple[str, str]:
    """The dtype to give vLLM for the dtype asked for, and why: `(dtype, reason)`.

    Only `auto` on the CPU backend is decided here: vLLM's `auto` picks bfloat16 on every x86 CPU, but without
    avx512_bf16 or amx_bf16 bf16 is emulated and ~4x slower than float32 (SmolLM2-135M, 32 prompts x 64 tokens on
    an avx2-only host: 15.7 tok/s in bf16, 69.7 tok/s in float32), so there `auto` means float32. An explicit
    dtype, `auto` on a GPU, and `auto` where the flags are unknown (`cpu_flags` None: not x86) go to vLLM as they are.
    """
    if dtype != "auto":
        return dtype, "set explicitly"
    if not cpu_backend:
        return "auto", "not the CPU backend: vLLM picks the model's dtype"
    if cpu_flags is None:
        return "auto", "CPU flags unknown (not x86?): vLLM picks"
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags]
    if native:
        return "bfloat16", f"auto on the CPU backend, and this CPU has {' and '.join(native)}: bf16 in hardware"
    return "float32", (
        f"auto on the CPU backend, and this CPU has neither {' nor '.join(NATIVE_BF16_FLAGS)}: "
        "bf16 would be emulated, ~4x slower than float32"
    )


def engine_dtype(dtype: str, *, cpu_backend: bool, cpu_flags: set[str] | None = None) -> str:
    """`resolve_dtype` with this machine's flags (read from /proc/cpuinfo if not given), logged at INFO."""
    if cpu_backend and cpu_flags is None:
        cpu_flags = read_cpu_flags()
    chosen, reason = resolve_dtype(dtype, cpu_backend=cpu_backend, cpu_flags=cpu_flags)
    log.info("engine dtype: %s (asked for %s; %s)", chosen, dtype, reason)
    return chosen
