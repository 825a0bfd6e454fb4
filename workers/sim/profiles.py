"""What the cost model knows of a GPU and a model: bandwidth, peak FLOPs and memory; parameters and KV-cache shape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class GPUProfile:
    """One accelerator as the step cost model sees it.

    `hbm_bytes_per_s` and `peak_flops` (dense bf16) are the datasheet's; `bandwidth_efficiency` and
    `compute_efficiency` the fractions a serving step reaches (decode is a GEMV sweep over the weights, prefill a
    GEMM); `step_overhead_s` is the fixed cost of one engine step (scheduling, input preparation, sampling, kernel
    launches under CUDA graphs). `memory_bytes` is what vLLM sizes its KV cache from (`gpu_memory_utilization`).
    `kv_bytes_per_s`: the rate decode attention reads the KV cache at, where it differs from the weights' (0: the
    same effective bandwidth; on this machine's CPU, fitted, paged decode attention reads KV far slower).
    `seq_overhead_s`: the further fixed cost of each sequence in a step (vLLM's per-request work between the
    forward passes: the scheduler's bookkeeping, sampling, detokenizing and output processing in Python), which
    runs on the CPU beside, not overlapped with, the forward pass; small on a GPU host (0 in the GPU profiles),
    fitted on this machine's CPU, where it is most of a decode step's cost past a batch of 8. `overlapped`: memory
    and compute time overlap, the step taking the larger (a GPU's roofline); False: they add (a CPU core that
    streams the KV cache in attention and runs the GEMMs one after the other; the fit chooses).
    """

    name: str
    hbm_bytes_per_s: float
    peak_flops: float
    memory_bytes: float
    bandwidth_efficiency: float
    compute_efficiency: float
    step_overhead_s: float
    source: str
    kv_bytes_per_s: float = 0.0
    seq_overhead_s: float = 0.0
    overlapped: bool = True


@dataclass(frozen=True)
class ModelProfile:
    """One dense decoder-only transformer: `params` parameters of `dtype_bytes` each; its KV cache holds, per token
    and layer, a key and a value of `kv_heads * head_dim` elements (grouped-query attention)."""

    name: str
    params: float
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    source: str

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def linear_flops(self, new_tokens: float) -> float:
        """FLOPs of the linear layers for `new_tokens` tokens: 2 per parameter per token (Kaplan et al. 2020,
        "Scaling Laws for Neural Language Models", sec. 2.1)."""
        return 2 * self.params * new_tokens

    def attention_flops(self, attended: float) -> float:
        """FLOPs of attention over `attended` (query, key) pairs: QK^T and AV, 2 matmuls of 2 FLOPs per
        multiply-add over `heads * head_dim` per pair and layer."""
        return 4 * self.layers * self.heads * self.head_dim * attended

    def flops(self, new_tokens: float, attended: float) -> float:
        """FLOPs of a step that computes `new_tokens` tokens, `attended` (query, key) pairs among them."""
        return self.linear_flops(new_tokens) + self.attention_flops(attended)


# The efficiencies and the overhead are assumptions, not measurements: decode as a sweep over the weights at 80% of
# the HBM bandwidth, prefill at 60% of peak dense FLOPs, 1 ms of CPU time per step, none per sequence. BENCHMARKS.md
# section m sets the H100 and H200 profiles beside published vLLM runs of an 8B model (within 7% of their TPOT at low
# batch, 1.3x too fast at 320 requests at once); no single-GPU figure for a 32B model was found.
H100_SXM = GPUProfile(
    name="h100",
    hbm_bytes_per_s=3.35e12,
    peak_flops=989e12,
    memory_bytes=80 * GB,
    bandwidth_efficiency=0.8,
    compute_efficiency=0.6,
    step_overhead_s=1.0e-3,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, 989 TFLOPS dense BF16",
)
H200 = GPUProfile(
    name="h200",
    hbm_bytes_per_s=4.8e12,
    peak_flops=989e12,
    memory_bytes=141 * GB,
    bandwidth_efficiency=0.8,
    compute_efficiency=0.6,
    step_overhead_s=1.0e-3,
    source="NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16",
)

QWEN25_7B = ModelProfile(
    name="qwen2.5-7b",
    params=7.62e9,
    layers=28,
    heads=28,
    kv_heads=4,
    head_dim=128,
    dtype_bytes=2,
    source="Qwen/Qwen2.5-7B-Instruct config.json: 28 layers, hidden 3584, 28 heads, 4 KV heads; 7.61B parameters",
)
QWEN25_32B = ModelProfile(
    name="qwen2.5-32b",
    params=32.76e9,
    layers=64,
    heads=40,
    kv_heads=8,
    head_dim=128,
    dtype_bytes=2,
    source="Qwen/Qwen2.5-32B-Instruct config.json: 64 layers, hidden 5120, 40 heads, 8 KV heads; 32.8B parameters",
)
SMOLLM2_135M = ModelProfile(
    name="smollm2-135m",
    params=134.5e6,
    layers=30,
    heads=9,
    kv_heads=3,
    head_dim=64,
    dtype_bytes=2,
    source="HuggingFaceTB/SmolLM2-135M-Instruct config.json: 30 layers, hidden 576, 9 heads, 3 KV heads",
)

LLAMA3_8B = ModelProfile(
    name="llama3-8b",
    params=8.03e9,
    layers=32,
    heads=32,
    kv_heads=8,
    head_dim=128,
    dtype_bytes=2,
    source="meta-llama/Meta-Llama-3-8B-Instruct config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads; 8.03B "
    "parameters (Llama-3.1-8B's are the same); the model of the published runs BENCHMARKS.md (m) compares with",
)

GPUS = {gpu.name: gpu for gpu in (H100_SXM, H200)}
MODELS = {model.name: model for model in (QWEN25_7B, QWEN25_32B, SMOLLM2_135M, LLAMA3_8B)}


def gpu_profile(name: str) -> GPUProfile:
    """The profile named `name` (`h100`, `h200`), or the one in the JSON file at path `name` (what
    `workers.sim.fit` writes for this machine's CPU). Raises ValueError saying what to give instead."""
    if name in GPUS:
        return GPUS[name]
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"unknown simulated GPU {name!r}: choose one of {sorted(GPUS)} or give the path of a profile's JSON "
            "(`rollout-svc bench --only sim-fit` writes this machine's)"
        )
    try:
        return GPUProfile(**json.loads(path.read_text()))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{path} is not a GPU profile ({exc}): its keys are {list(GPUProfile.__annotations__)}"
        ) from exc


def model_profile(name: str) -> ModelProfile:
    """The model profile named `name`; raises ValueError naming the choices for any other name."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown simulated model {name!r}: choose one of {sorted(MODELS)}") from None
