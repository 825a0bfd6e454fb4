"""What a worker's heartbeat says its engine holds: its batch, its context, its KV cache in tokens and its settings
as vLLM resolved them (the vLLM engine's read from a started engine in tests/e2e/test_service_vllm.py)."""

from __future__ import annotations

from types import SimpleNamespace

from workers.echo import EchoEngine
from workers.sim.engine import SimEngine
from workers.sim.profiles import H100_SXM, QWEN25_7B
from workers.state import WorkerState
from workers.vllm_engine import engine_config


def test_the_heartbeat_carries_the_engines_batch_context_and_kv_cache():
    status = WorkerState("w0").status(EchoEngine(capacity=8, max_model_len=1024), 0, 0.0)
    assert (status.capacity, status.max_num_seqs, status.max_model_len) == (8, 8, 1024)
    assert status.kv_cache_tokens == 8 * 1024 and status.engine_config == ""

    sim = SimEngine(H100_SXM, QWEN25_7B, capacity=256, max_model_len=4096)
    status = WorkerState("w1").status(sim, 0, 0.0)
    assert (status.max_num_seqs, status.max_model_len) == (256, 4096)
    # an H100's 80 GB at 0.9, less 15 GB of weights, at 57,344 bytes a token: about a million tokens
    assert status.kv_cache_tokens == sim.scheduler.pool.num_blocks * 16 and 900_000 < status.kv_cache_tokens < 1_100_000


def test_a_vllm_engines_settings_are_said_as_vllm_resolved_them():
    config = SimpleNamespace(
        model_config=SimpleNamespace(dtype="torch.bfloat16", quantization="fp8", enforce_eager=False),
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name="FULL_AND_PIECEWISE")),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        speculative_config=SimpleNamespace(method="eagle3"),
    )
    said = (
        "dtype=bfloat16 quantization=fp8 cuda_graphs=on prefix_caching=on speculative=eagle3"
        " logprobs_mode=raw_logprobs lora=none weight_transfer=none"
    )
    assert engine_config(config) == said
    config.model_config.enforce_eager, config.speculative_config = True, None
    assert "cuda_graphs=off" in engine_config(config) and "speculative=none" in engine_config(config)
    config.model_config.logprobs_mode = "processed_logprobs"
    config.lora_config = SimpleNamespace(max_lora_rank=8, max_loras=2)
    config.weight_transfer_config = SimpleNamespace(backend="nccl")
    assert engine_config(config).endswith("logprobs_mode=processed_logprobs lora=8x2 weight_transfer=nccl")
