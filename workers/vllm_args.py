"""vLLM's engine arguments, the same for every engine we start (`VLLMEngine`, `workers.direct`), and its shutdown."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollout_svc.config import CPU_KV_CACHE_BYTES, CPU_MAX_NUM_SEQS, DEFAULT_MAX_MODEL_LEN
from workers.dtype import engine_dtype
from workers.vllm_flags import engine_args
from workers.weight_extension import WORKER_EXTENSION

if TYPE_CHECKING:  # vllm is imported lazily: a worker running EchoEngine must not pay its import
    from vllm.engine.arg_utils import AsyncEngineArgs

# What the CPU backend runs where the user gives nothing else, each for a reason vLLM's defaults fail there
# (`vllm_engine_args`); on GPUs vLLM's own defaults stand.
CPU_DEFAULTS: dict[str, Any] = {
    "max_model_len": DEFAULT_MAX_MODEL_LEN,  # the model's own (8k for SmolLM2) sizes every buffer for it
    "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES,  # vLLM's CPU default (a share of the RAM) fails on small hosts
    "max_num_seqs": CPU_MAX_NUM_SEQS,  # a batch two cores step in tens of milliseconds
    "enforce_eager": True,  # no CUDA graphs on a CPU; without it vLLM compiles the model at every start
    "disable_log_stats": True,  # nothing scrapes the engine's stats on a test host; they cost a log line a step
    # vLLM 0.32's CPU runner rewinds the per-request generator of a request whose prefill was chunked
    # (`Generator.set_offset`), which CPU generators do not support: one request with a `seed` among long prompts
    # killed the whole engine ("CPU Generator does not use offset").
    "enable_chunked_prefill": False,
}


def vllm_engine_args(
    model: str,
    *,
    dtype: str = "auto",
    max_model_len: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    max_num_seqs: int | None = None,
    seed: int = 0,
    enable_sleep_mode: bool | None = None,
    vllm_flags: Sequence[str] = (),
    **extra: Any,
) -> AsyncEngineArgs:
    """The `AsyncEngineArgs` of every engine we start, so VLLMEngine and `workers.direct` run identical settings.

    On a GPU (CUDA, ROCm, any platform but the CPU) the engine runs as `vllm serve` would: the service sets only what
    it needs, and every other field is vLLM's default unless given here or in `vllm_flags`:
    `logprobs_mode="processed_logprobs"` (a sampled token's logprob under the distribution it was sampled from, after
    temperature, penalties, top-k/top-p: what an RL importance ratio needs; vLLM's default is the raw model
    logprob), the worker extension (`workers.weight_extension`: weight loads), the `seed`, sleep mode where the
    platform supports it (`enable_sleep_mode` None), and the weight-transfer config when asked for (`extra`). On the
    CPU, `CPU_DEFAULTS` too (each with its reason), and `dtype="auto"` is float32 unless the CPU has bf16 in
    hardware (`workers.dtype.resolve_dtype`; the choice and its reason are logged). `dtype="float32"` is what greedy
    token-equality checks need (bf16 and batching change the numerics).

    `model` is a Hugging Face folder (see `rollout_svc.model.prepare_model`). `max_model_len`, `max_num_seqs` and
    `kv_cache_memory_bytes` (None: the platform's default) and `extra` (any `AsyncEngineArgs` field) are passed to
    `AsyncEngineArgs` and win over the defaults; `vllm_flags`, vLLM's own flags as `vllm serve` takes them
    (`workers.vllm_flags`), win over everything. Raises `VLLMFlagError` for a flag vLLM refuses.
    """
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    settings: dict[str, Any] = {
        "model": model,
        "seed": seed,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_sleep_mode": current_platform.is_sleep_mode_available()
        if enable_sleep_mode is None
        else enable_sleep_mode,
    }
    if cpu:
        settings |= CPU_DEFAULTS
    if cpu or dtype != "auto":
        settings["dtype"] = engine_dtype(dtype, cpu_backend=cpu)
    given = {
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "max_num_seqs": max_num_seqs,
    }
    settings |= {name: value for name, value in given.items() if value is not None}
    ranks = int(extra.get("tensor_parallel_size", 1)) * int(extra.get("pipeline_parallel_size", 1))
    if ranks > 1:
        # Processes of its own, not Ray's actors: a worker is one process tree wherever it runs (`up`, compose, a
        # Ray actor holding a bundle of TP x PP GPUs); vLLM would pick Ray whenever Ray is initialized.
        settings["distributed_executor_backend"] = "mp"
    return engine_args(settings | extra, list(vllm_flags))


def usage_context() -> Any:
    """The `UsageContext` our engines are built under: `vllm serve`'s (OPENAI_API_SERVER) on GPUs, whose batch
    defaults vLLM sizes by the device (1,024 sequences and 8,192 batched tokens on an H100 or H200, vLLM 0.32's
    `EngineArgs.get_batch_defaults`); the engine context on the CPU, whose settings the tests were measured on."""
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.ENGINE_CONTEXT if current_platform.is_cpu() else UsageContext.OPENAI_API_SERVER


def shutdown_llm(llm: Any) -> None:
    """`AsyncLLM.shutdown()`, then what it leaves: vLLM 0.32 closes its client's zmq sockets but not their
    context, which the garbage collector then destroys with a ResourceWarning. The caller should `del` its
    reference and `gc.collect()`: AsyncLLM sits in a reference cycle, and collected at interpreter exit (after
    vLLM's module globals are gone) its __del__ prints a TypeError."""
    llm.shutdown()
    context = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "ctx", None)
    if context is not None and not context.closed:
        context.destroy(linger=0)
