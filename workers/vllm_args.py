"""vLLM's engine arguments, the same for every engine we start (`VLLMEngine`, `workers.direct`), and its shutdown."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from workers.dtype import engine_dtype
from workers.vllm_flags import engine_args
from workers.weight_extension import WORKER_EXTENSION

if TYPE_CHECKING:  # vllm is imported lazily: a worker running EchoEngine must not pay its import
    from vllm.engine.arg_utils import AsyncEngineArgs

MiB = 1024 * 1024


def vllm_engine_args(
    model: str,
    *,
    dtype: str = "auto",
    max_model_len: int = 2048,
    kv_cache_memory_bytes: int = 512 * MiB,
    max_num_seqs: int = 64,
    enforce_eager: bool = True,
    seed: int = 0,
    enable_sleep_mode: bool | None = None,
    vllm_flags: Sequence[str] = (),
    **extra: Any,
) -> AsyncEngineArgs:
    """The `AsyncEngineArgs` of every engine we start, so VLLMEngine and `workers.direct` run identical settings.

    `model` is a Hugging Face folder (see `rollout_svc.model.prepare_model`). `dtype="float32"` is what
    greedy token-equality checks need (bf16 and batching change the numerics). `kv_cache_memory_bytes`
    is explicit because vLLM's default (a fraction of device memory) fails on small CPU hosts. `dtype="auto"` on
    the CPU backend is float32 unless the CPU has bf16 in hardware (`workers.dtype.resolve_dtype`); the choice
    and its reason are logged.
    `logprobs_mode="processed_logprobs"`: a sampled token's logprob is taken under the distribution it was
    sampled from (after temperature, penalties, top-k/top-p), which is what an RL importance ratio needs;
    vLLM's default would give the raw model logprob. `enable_sleep_mode` (None: where the platform supports
    it, that is on GPUs) lets `sleep` free memory. `extra` is passed to `AsyncEngineArgs` and wins; `vllm_flags`,
    vLLM's own flags as `vllm serve` takes them (`workers.vllm_flags`), win over both. Raises `VLLMFlagError` for a
    flag vLLM refuses.

    On CPU, chunked prefill is off: vLLM 0.32's CPU runner rewinds the per-request generator of a request
    whose prefill was chunked (`Generator.set_offset`), which CPU generators do not support, so one
    request with a `seed` among long prompts killed the whole engine ("CPU Generator does not use offset").
    """
    from vllm.platforms import current_platform

    settings: dict[str, Any] = {
        "model": model,
        "dtype": engine_dtype(dtype, cpu_backend=current_platform.is_cpu()),
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "max_num_seqs": max_num_seqs,
        "enforce_eager": enforce_eager,
        "seed": seed,
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True,
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_sleep_mode": current_platform.is_sleep_mode_available()
        if enable_sleep_mode is None
        else enable_sleep_mode,
    }
    if current_platform.is_cpu():
        settings["enable_chunked_prefill"] = False
    ranks = int(extra.get("tensor_parallel_size", 1)) * int(extra.get("pipeline_parallel_size", 1))
    if ranks > 1:
        # Processes of its own, not Ray's actors: a worker is one process tree wherever it runs (`up`, compose, a
        # Ray actor holding a bundle of TP x PP GPUs); vLLM would pick Ray whenever Ray is initialized.
        settings["distributed_executor_backend"] = "mp"
    return engine_args(settings | extra, list(vllm_flags))


def shutdown_llm(llm: Any) -> None:
    """`AsyncLLM.shutdown()`, then what it leaves: vLLM 0.32 closes its client's zmq sockets but not their
    context, which the garbage collector then destroys with a ResourceWarning. The caller should `del` its
    reference and `gc.collect()`: AsyncLLM sits in a reference cycle, and collected at interpreter exit (after
    vLLM's module globals are gone) its __del__ prints a TypeError."""
    llm.shutdown()
    context = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "ctx", None)
    if context is not None and not context.closed:
        context.destroy(linger=0)
