"""The time of one engine step: the larger of its memory time and its compute time, plus fixed overheads."""

from __future__ import annotations

from dataclasses import dataclass

from workers.sim.profiles import GPUProfile, ModelProfile


@dataclass(frozen=True)
class StepCost:
    """A roofline model of one vLLM step on `gpu` serving `model`.

    A step computes `new_tokens` tokens of some sequences (one each for a decode, a chunk for a prefill) whose
    attention reads `context_tokens` KV entries in all (each sequence's tokens computed before this step plus
    the new ones) and scores `attended` (query, key) pairs. Its memory time reads the weights once and the KV
    entries once, at the GPU's effective bandwidth (the KV entries at `kv_bytes_per_s` where the profile sets one);
    its compute time is `ModelProfile.flops` at its effective peak. The step takes the larger (the roofline:
    Williams et al. 2009, CACM 52(4); their sum where the profile is not `overlapped`) plus `step_overhead_s` and
    `seq_overhead_s` per sequence in the step.
    """

    gpu: GPUProfile
    model: ModelProfile

    def step_s(self, new_tokens: int, context_tokens: int, attended: float, sequences: int = 1) -> float:
        """Seconds (simulated) of one step of `sequences` sequences; the other arguments are token counts summed
        over them."""
        gpu, model = self.gpu, self.model
        bandwidth = gpu.hbm_bytes_per_s * gpu.bandwidth_efficiency
        kv_s = context_tokens * model.kv_bytes_per_token / (gpu.kv_bytes_per_s or bandwidth)
        memory_s = model.weight_bytes / bandwidth + kv_s
        compute_s = model.flops(new_tokens, attended) / (gpu.peak_flops * gpu.compute_efficiency)
        roofline_s = max(memory_s, compute_s) if gpu.overlapped else memory_s + compute_s
        return roofline_s + gpu.step_overhead_s + sequences * gpu.seq_overhead_s

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of `batch` sequences holding `context_tokens` tokens in all before it."""
        return self.step_s(batch, context_tokens + batch, context_tokens + batch, batch)

    def prefill_s(self, prompt_tokens: int) -> float:
        """One step prefilling a prompt of `prompt_tokens` alone (causal: n(n+1)/2 attended pairs)."""
        return self.step_s(prompt_tokens, prompt_tokens, prompt_tokens * (prompt_tokens + 1) / 2)
