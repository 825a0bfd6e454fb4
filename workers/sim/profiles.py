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


def datasheet_gpu(name: str, hbm_bytes_per_s: float, peak_flops: float, memory_bytes: float, source: str) -> GPUProfile:
    """A GPU from its datasheet's bandwidth, dense bf16 FLOP/s and memory, with the serving step's assumed
    efficiencies: assumptions, not measurements. Decode is a sweep over the weights at 80% of the HBM bandwidth,
    prefill runs at 60% of peak dense FLOPs, a step costs 1 ms of CPU time and a sequence nothing more. BENCHMARKS.md
    section m sets the H100 and H200 profiles beside published vLLM runs of an 8B model (within 7% of their TPOT at
    low batch, 1.3x too fast at 320 requests at once); no single-GPU figure for a 32B model was found."""
    return GPUProfile(name, hbm_bytes_per_s, peak_flops, memory_bytes, 0.8, 0.6, 1.0e-3, source)


#                     name,   HBM B/s, dense bf16 FLOP/s, memory, source
H100_SXM = datasheet_gpu("h100", 3.35e12, 989e12, 80 * GB, "NVIDIA H100 Tensor Core GPU datasheet (SXM5): HBM3")
H200 = datasheet_gpu("h200", 4.8e12, 989e12, 141 * GB, "NVIDIA H200 Tensor Core GPU datasheet (SXM): HBM3e")

# Each model's shape as its config.json gives it (head dim = hidden_size / num_attention_heads), in bf16. Llama-3.1-8B
# has Meta-Llama-3-8B's shape: the model of the published runs BENCHMARKS.md (m) compares with.
#                          name,           params,  layers, heads, KV heads, head dim, bytes, source
QWEN25_7B = ModelProfile("qwen2.5-7b", 7.62e9, 28, 28, 4, 128, 2, "Qwen/Qwen2.5-7B-Instruct config.json")
QWEN25_32B = ModelProfile("qwen2.5-32b", 32.76e9, 64, 40, 8, 128, 2, "Qwen/Qwen2.5-32B-Instruct config.json")
SMOLLM2_135M = ModelProfile("smollm2-135m", 134.5e6, 30, 9, 3, 64, 2, "HuggingFaceTB/SmolLM2-135M-Instruct config.json")
LLAMA3_8B = ModelProfile("llama3-8b", 8.03e9, 32, 32, 8, 128, 2, "meta-llama/Meta-Llama-3-8B-Instruct config.json")

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
