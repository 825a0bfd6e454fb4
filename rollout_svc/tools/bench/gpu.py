"""BENCHMARKS.md (n): the trainer's side of a weight sync on a GPU (`rollout_svc.tools.gpu_check`), or, where this
machine has no GPU, a dated line saying so and how to measure it on one."""

from __future__ import annotations

import platform
import time

from rollout_svc.tools.gpu_check import GB, GpuFigures, ModelShape, run_check

HEADING = "## (n) GPU: the trainer's side of a weight sync"


def run_gpu_bench() -> GpuFigures | None:
    """Run the check on this machine's first CUDA device, with Qwen2.5-7B's shape; None where there is none."""
    import torch

    if not torch.cuda.is_available():
        return None
    return run_check(ModelShape(), "cuda")


def render_gpu(figures: GpuFigures | None, command: str) -> str:
    """The section: the figures beside a bare `.cpu()` of the same tensors, or the dated absence of a GPU."""
    lines = ["", HEADING, "", f"Command: `{command}` (it runs `python -m rollout_svc.tools.gpu_check` where CUDA is)."]
    if figures is None:
        lines += [
            "",
            f"No GPU on {time.strftime('%Y-%m-%d')}: this machine ({platform.machine()}) has no CUDA device, and no GPU"
            " machine was lent to the session that wrote this. No vLLM engine has run on a GPU in this project",
            '(docs/gpu.md, "What ran where"); the check\'s CPU path runs in tests/unit/test_gpu_check.py.',
        ]
        return "\n".join(lines) + "\n"
    gbs = figures.bytes / GB
    lines += [
        "",
        f"{figures.device}, torch {figures.torch_version}: a Qwen2.5-7B-shaped state dict in bf16 ({figures.tensors}"
        f" tensors, {gbs:.1f} GB) held on the GPU, sent as `WeightSender` sends it over gloo to a receiver on the CPU"
        f" of the same host ({figures.buckets} buckets).",
        "",
        "| step | seconds | GB/s |",
        "|---|---:|---:|",
        f"| bare `.cpu()` of every tensor (the floor) | {figures.bare_cpu_s:.2f} | {gbs / figures.bare_cpu_s:.1f} |",
        f"| pack into CPU buckets (`WeightSender._send`) | {figures.pack_s:.2f} | {gbs / figures.pack_s:.1f} |",
        f"| broadcast over gloo | {figures.send_s:.2f} | {gbs / figures.send_s:.1f} |",
        f"| receive (the worker's side) | {figures.receive_s:.2f} | {gbs / figures.receive_s:.1f} |",
        "",
        f"Pack over bare copy: {figures.pack_over_bare:.2f}x. Bytes equal at both ends (digests):"
        f" {'yes' if figures.digests_equal else 'NO'}.",
    ]
    return "\n".join(lines) + "\n"
