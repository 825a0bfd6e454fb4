"""`--dtype auto` on the CPU backend: float32 unless the CPU has bf16 in hardware, chosen from its flags and logged."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from workers import dtype as engine_dtypes
from workers.dtype import engine_dtype, read_cpu_flags, resolve_dtype

AVX2_ONLY = {"fpu", "sse4_2", "avx", "avx2", "fma"}
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512_bf16"}
AMX = AVX2_ONLY | {"avx512f", "amx_bf16", "amx_tile"}


def test_auto_on_a_cpu_without_native_bf16_is_float32():
    chosen, reason = resolve_dtype("auto", cpu_backend=True, cpu_flags=AVX2_ONLY)
    assert chosen == "float32"
    assert "avx512_bf16" in reason and "amx_bf16" in reason and "emulated" in reason


@pytest.mark.parametrize(("flags", "flag"), [(AVX512_BF16, "avx512_bf16"), (AMX, "amx_bf16")])
def test_auto_on_a_cpu_with_native_bf16_is_bfloat16(flags: set[str], flag: str):
    chosen, reason = resolve_dtype("auto", cpu_backend=True, cpu_flags=flags)
    assert (chosen, flag in reason) == ("bfloat16", True)


@pytest.mark.parametrize("explicit", ["bfloat16", "float16", "float32", "half"])
def test_an_explicit_dtype_is_left_as_asked(explicit: str):
    assert resolve_dtype(explicit, cpu_backend=True, cpu_flags=AVX2_ONLY)[0] == explicit
    assert resolve_dtype(explicit, cpu_backend=False, cpu_flags=AVX512_BF16)[0] == explicit


def test_auto_on_a_gpu_or_with_unknown_flags_is_vllms_choice():
    assert resolve_dtype("auto", cpu_backend=False, cpu_flags=AVX2_ONLY)[0] == "auto"
    assert resolve_dtype("auto", cpu_backend=True, cpu_flags=None)[0] == "auto"


def test_the_flags_come_from_the_first_flags_line(tmp_path: Path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert read_cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512_bf16"}
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # aarch64 has no `flags` line
    assert read_cpu_flags(cpuinfo) is None
    assert read_cpu_flags(tmp_path / "absent") is None


def test_the_choice_and_its_reason_are_logged(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.INFO, logger="rollout_svc.worker"):
        assert engine_dtype("auto", cpu_backend=True, cpu_flags=AVX2_ONLY) == "float32"
    [record] = [r for r in caplog.records if r.name == "rollout_svc.worker"]
    assert record.levelno == logging.INFO
    assert "engine dtype: float32" in record.getMessage() and "avx512_bf16" in record.getMessage()


def test_the_engine_reads_this_machines_flags(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(engine_dtypes, "read_cpu_flags", lambda: AVX2_ONLY)
    with caplog.at_level(logging.INFO, logger="rollout_svc.worker"):
        assert engine_dtype("auto", cpu_backend=True) == "float32"
        assert engine_dtype("auto", cpu_backend=False) == "auto"
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["engine dtype: float32", "engine dtype: auto"]


@pytest.mark.imports_vllm
def test_vllm_engine_args_runs_the_choice(monkeypatch: pytest.MonkeyPatch):
    """The one place every engine's arguments are built (VLLMEngine and `workers.direct`) applies it."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from workers.vllm_args import vllm_engine_args

    monkeypatch.setattr(engine_dtypes, "read_cpu_flags", lambda: AVX2_ONLY)
    assert vllm_engine_args("/no/model", dtype="auto").dtype == ("float32" if current_platform.is_cpu() else "auto")
    assert vllm_engine_args("/no/model", dtype="bfloat16").dtype == "bfloat16"
