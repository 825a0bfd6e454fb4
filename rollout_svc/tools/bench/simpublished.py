"""`rollout-svc bench`, section (m): the simulator's GPU profiles beside published vLLM figures for the same GPU and
a model of the same shape, each workload replayed as published (its requests' prompt and output lengths, their
arrivals) through the simulator's scheduler and cost model (`workers/sim`), offline: no Redis, no workers, the
simulated clock only (what `--engine sim` runs, without the queue in front of it).

The published figures and where they come from (found for this comparison; none was measured here):

- H100 SXM, Meta-Llama-3-8B-Instruct in BF16 on one GPU: LambdaLabs' vLLM benchmark, repository
  `LambdaLabsML/vllm-benchmark` at commit a4f9f4371a1ccac781293837fce2bce0cc6d25cc,
  `results/prompt_320/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json` (320 ShareGPT requests at once,
  `benchmark_serving.py` at request rate inf; `output_throughput` 6026.6 tokens/s, `median_tpot_ms` 20.03; its
  `input_lens` and `output_lens` are below) and `results/prompt_10/...` in the same folder (10 requests at once:
  347.9 tokens/s, median TPOT 7.56 ms). Dated 2024-09-07: vLLM 0.6.0, likely with `--num-scheduler-steps 10`
  (its inter-token latency, ~126 ms against a 20 ms TPOT, shows tokens streamed ten at a time); not recorded.
- H200, DeepSeek-R1-Distill-Llama-8B (Llama-3.1-8B's shapes) in BF16 on one GPU: `simon-mo/vLLM-Benchmark` at commit
  50f0e9eee8ad33416f85ed882230721d0fb009f0, `saved-results/v0.8.1/h200/llama-8b/` (vLLM 0.8.1, random prompts of
  1,000 tokens for 2,000 output tokens, `--ignore-eos`, 50 requests at 10 a second; median TPOT 8.77 ms; only 31 of
  the 50 completed there, so its throughput is not compared, only its TPOT).
- A ~32B dense model on one H100 or H200 under vLLM: no published figure found (QwQ-32B's in the same repository
  ran on 2 GPUs, tensor parallel, which the simulator does not model).

TPOT as vLLM's `benchmark_serving.py` computes it: (a request's end - its first token) / (its output tokens - 1),
the median over requests with more than one; throughput: output tokens over the time from the first arrival to the
last answer.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from workers.sim.blocks import BlockPool
from workers.sim.cost import StepCost
from workers.sim.engine import default_kv_cache_bytes
from workers.sim.profiles import GPUS, MODELS
from workers.sim.scheduler import Scheduler, Sequence

HEADING = "## (m) The simulator's GPU profiles beside published vLLM figures"
BLOCK_SIZE = 16

_LAMBDA_320_INPUTS = (
    "13 25 27 10 329 29 399 328 4 205 16 372 403 9 12 770 227 8 14 390 659 59 76 744 619 279 344 9 10 45 11 4 80 "
    "768 317 40 619 8 298 16 17 696 575 11 7 281 12 147 481 770 336 6 331 9 45 222 802 481 93 641 22 15 16 77 32 "
    "689 178 9 628 480 42 336 24 515 761 112 113 348 82 467 245 11 24 343 13 387 258 32 28 225 248 35 133 98 27 23 "
    "58 363 203 140 140 230 310 521 768 317 298 336 491 19 10 59 48 20 20 54 107 53 72 18 10 768 7 933 239 277 26 "
    "35 462 386 25 23 17 20 44 661 631 349 53 71 37 10 21 37 496 8 9 353 10 595 5 49 286 305 56 43 52 310 35 7 7 "
    "238 10 143 660 191 72 39 258 312 49 9 15 561 76 561 501 8 66 15 303 19 455 27 143 688 9 31 361 21 117 8 12 775 "
    "338 176 349 166 419 401 307 169 647 21 9 34 12 37 45 154 8 10 18 253 486 611 96 19 62 529 15 30 10 445 680 762 "
    "441 77 12 276 178 22 159 95 366 4 7 770 8 45 480 90 32 329 768 72 86 53 83 419 44 14 56 28 707 235 27 668 17 "
    "427 44 370 8 674 455 185 68 19 132 304 9 34 39 54 768 661 404 240 25 95 60 24 12 85 66 62 462 22 241 25 32 13 "
    "175 31 342 43 339 144 233 16 10 11 269 587 8 233 10 48 9 335 22 61 29 692 7 332 512 13 128 24"
)

_LAMBDA_320_OUTPUTS = (
    "120 613 233 194 101 741 9 3 6 31 392 84 396 45 291 9 173 277 334 37 587 372 36 135 26 45 450 118 226 4 5 146 "
    "59 11 567 192 476 130 13 223 188 16 35 276 202 492 239 129 26 79 17 204 11 207 78 340 17 9 123 6 559 5 316 26 "
    "417 206 151 42 25 18 159 0 25 267 19 12 768 67 628 11 218 296 382 49 125 0 26 237 350 13 490 408 58 29 512 413 "
    "526 16 416 434 451 17 573 0 7 8 11 22 0 249 281 392 611 572 23 256 31 39 300 355 340 9 172 458 147 240 154 768 "
    "0 141 42 26 780 334 125 4 4 721 63 24 331 482 110 216 184 99 285 22 355 40 150 46 0 0 574 572 214 0 419 163 "
    "162 77 482 170 510 53 16 384 57 9 170 356 173 19 390 339 77 17 520 8 8 198 510 478 304 398 16 475 91 54 509 "
    "608 36 425 15 25 12 363 0 0 44 43 267 474 334 31 261 402 346 176 22 22 159 203 8 16 16 216 86 0 234 258 247 23 "
    "47 16 447 221 702 0 44 142 740 18 76 299 250 24 300 178 5 373 25 23 76 322 87 389 21 7 527 485 339 394 11 27 "
    "254 313 392 111 365 0 79 11 275 22 99 373 38 0 657 283 503 250 16 407 0 7 261 322 322 91 56 365 342 316 25 441 "
    "646 241 222 4 27 290 7 21 336 16 360 199 381 297 18 338 301 189 373 478 394 23 230 455 283 0 201 0 20 308 30 "
    "295"
)
_LAMBDA_10_OUTPUTS = "120 429 233 194 101 741 9 3 6 31"  # the 10-request run's; its inputs are the 320's first 10


@dataclass(frozen=True)
class Published:
    """One published vLLM run: its workload (prompt and output lengths in tokens; arrivals `interval_s` apart, 0 at
    once) on `gpu` serving `model` (profile names), and what it measured (None: not compared)."""

    label: str
    gpu: str
    model: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    interval_s: float
    output_tokens_per_s: float | None
    median_tpot_ms: float
    vllm: str
    source: str


def _lengths(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split())


PUBLISHED = (
    Published(
        "320 ShareGPT requests at once",
        "h100",
        "llama3-8b",
        _lengths(_LAMBDA_320_INPUTS),
        _lengths(_LAMBDA_320_OUTPUTS),
        0.0,
        6026.6,
        20.03,
        "0.6.0 (likely 10 scheduler steps)",
        "LambdaLabsML/vllm-benchmark@a4f9f43 results/prompt_320/1xH100-80GB-SXM/"
        "Meta-Llama-3-8B-Instruct_tp1_len2048.json",
    ),
    Published(
        "10 ShareGPT requests at once",
        "h100",
        "llama3-8b",
        _lengths(_LAMBDA_320_INPUTS)[:10],
        _lengths(_LAMBDA_10_OUTPUTS),
        0.0,
        347.9,
        7.56,
        "0.6.0 (likely 10 scheduler steps)",
        "LambdaLabsML/vllm-benchmark@a4f9f43 results/prompt_10/1xH100-80GB-SXM/"
        "Meta-Llama-3-8B-Instruct_tp1_len2048.json",
    ),
    Published(
        "50 requests of 1,000 tokens for 2,000, 10 a second",
        "h200",
        "llama3-8b",
        (1000,) * 50,
        (2000,) * 50,
        0.1,
        None,
        8.77,
        "0.8.1",
        "simon-mo/vLLM-Benchmark@50f0e9e saved-results/v0.8.1/h200/llama-8b/ (1000 in, 2000 out)",
    ),
)


@dataclass(frozen=True)
class Replay:
    """What the simulator made of one workload: simulated seconds from the first arrival to the last answer,
    output tokens, and the median TPOT and time to first token (ms)."""

    duration_s: float
    output_tokens: int
    median_tpot_ms: float
    median_ttft_ms: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s


def replay(
    run: Published, max_num_seqs: int = 1024, max_num_batched_tokens: int = 8192, chunked_prefill: bool = True
) -> Replay:
    """Run `run`'s workload through the simulator's scheduler and cost model on one simulated GPU (vLLM 0.32's
    defaults on H100 and H200: 1,024 sequences, 8,192 tokens a step, chunked prefill, 90% of memory). Prompts are
    distinct (no prefix-cache hits, as in the published runs); a request of 0 output tokens runs for 1."""
    gpu, model = GPUS[run.gpu], MODELS[run.model]
    cost = StepCost(gpu, model)
    blocks = int(default_kv_cache_bytes(gpu, model) // (BLOCK_SIZE * model.kv_bytes_per_token))
    scheduler = Scheduler(BlockPool(blocks, BLOCK_SIZE), max_num_seqs, max_num_batched_tokens, chunked_prefill)
    arrivals = [i * run.interval_s for i in range(len(run.inputs))]
    pending = [
        Sequence(str(i), list(range(i * 100_000, i * 100_000 + max(1, n))), max(1, m), lambda _: 0)
        for i, (n, m) in enumerate(zip(run.inputs, run.outputs, strict=True))
    ]
    first: dict[str, float] = {}
    ends: dict[str, float] = {}
    now, index = 0.0, 0
    while index < len(pending) or scheduler.running or scheduler.waiting:
        while index < len(pending) and arrivals[index] <= now:
            scheduler.add(pending[index])
            index += 1
        if not (scheduler.running or scheduler.waiting):
            now = arrivals[index]
            continue
        step = scheduler.schedule()
        now += cost.step_s(*step.cost_inputs())
        finished = scheduler.commit(step)
        for seq, _ in step.items:
            if seq.output and seq.request_id not in first:
                first[seq.request_id] = now
        for seq in finished:
            ends[seq.request_id] = now
    tpots = [(ends[seq.request_id] - first[seq.request_id]) / (seq.target - 1) for seq in pending if seq.target > 1]
    ttfts = [first[seq.request_id] - arrivals[i] for i, seq in enumerate(pending)]
    return Replay(
        max(ends.values()),
        sum(seq.target for seq in pending),
        statistics.median(tpots) * 1e3,
        statistics.median(ttfts) * 1e3,
    )


def run_published_bench() -> list[tuple[Published, Replay]]:
    """Every published run beside its replay (seconds here: the simulated clock is not slept)."""
    return [(run, replay(run)) for run in PUBLISHED]


def render_published(rows: list[tuple[Published, Replay]], command: str = "") -> str:
    lines = [
        f"{HEADING}\n",
        f"Command: `{command}`.\n" if command else "",
        "Published vLLM runs on one GPU, replayed through the simulator's scheduler and cost model (offline, "
        "`rollout_svc/tools/bench/simpublished.py`, which names every source): the same prompt and output lengths "
        "and arrivals, on the same GPU's profile, serving a model profile of the published model's shapes "
        "(`llama3-8b`: Llama-3-8B and Llama-3.1-8B share them). The simulator schedules as vLLM 0.32 does; the "
        "published runs are of older versions (named). Sim / published: above 1.0, the simulator is faster.\n",
        "| GPU | workload | vLLM | output tokens/s published | simulated | sim / published | median TPOT (ms) "
        "published | simulated | sim / published |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, sim in rows:
        published = f"{run.output_tokens_per_s:,.0f}" if run.output_tokens_per_s else "- (not compared)"
        ratio = f"{sim.output_tokens_per_s / run.output_tokens_per_s:.2f}" if run.output_tokens_per_s else "-"
        lines.append(
            f"| {run.gpu.upper()} | {run.label} | {run.vllm} | {published} | {sim.output_tokens_per_s:,.0f} | {ratio} "
            f"| {run.median_tpot_ms:.2f} | {sim.median_tpot_ms:.2f} | {run.median_tpot_ms / sim.median_tpot_ms:.2f} |"
        )
    lines.append("\nSources:\n")
    lines += [f"- {run.label} on {run.gpu.upper()}: `{run.source}`" for run, _ in rows]
    lines.append(
        "- No published vLLM figure for a ~32B dense model on one H100 or H200 was found (QwQ-32B's ran on 2 GPUs, "
        "tensor parallel, which the simulator does not model), so the qwen2.5-32b profile is not checked."
    )
    return "\n".join(lines) + "\n\n"
