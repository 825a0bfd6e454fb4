"""The Engine protocol a worker drives, and its records: what a generation returns (`Completion`, joined from
deltas) and an engine's parallelism. The engines: `VLLMEngine` (vllm_engine.py), `EchoEngine` (echo.py, for queue
tests), `SimEngine` (sim/)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rollout_svc.protocol import (
    EngineWeightOpName,
    PauseMode,
    PromptLogprob,
    SamplingParams,
    TransferGroup,
    WeightManifest,
)

ReceivedFrom = Literal["trainer", "peer", "held", "previous"]
ChatMessages = list[dict[str, Any]]  # OpenAI's chat messages: {"role": ..., "content": ...} each
ToolSpecs = list[dict[str, Any]]  # OpenAI's tools: {"type": "function", "function": {...}} each


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one request. `logprobs[i]` is the logprob of `completion_token_ids[i]`.

    Where the sampling params ask for `logprobs = k`: `top_logprobs[i]` holds up to k `(token id, text, logprob)`
    best first, and `tokens[i]` the text of `completion_token_ids[i]`. A streaming delta (see `Engine.generate`) is
    a Completion of the new tokens only, with `text` the text they add and `finish_reason` "". Where they ask
    for `prompt_logprobs`, `prompt_logprobs[i]` holds position i's `(token id, text, logprob, rank)`, the prompt
    token's first (see `Trajectory.prompt_logprobs`); a streaming request's first delta carries them.
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"; "" for a delta
    text: str
    top_logprobs: list[list[tuple[int, str, float]]] | None = None
    tokens: list[str] | None = None
    prompt_logprobs: list[list[PromptLogprob]] | None = None  # asked for: per position of `prompt_token_ids`
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache (vLLM's `num_cached_tokens`)


OnDelta = Callable[[Completion], Awaitable[None]]


@dataclass(slots=True)  # not frozen: one is made per request served, and a frozen one takes ~1 us more to make
class Generation:
    """What an engine is asked to generate: one request's new tokens after `prompt_token_ids + prior`.

    `prior`: what an interrupted attempt of the request generated (a retry goes on after it). `lora_id`: with the
    LoRA adapter `Engine.add_adapter` loaded under that id (None: the base model). `trace_headers`: the W3C trace
    context of the worker's generation span (`workers.traces`), for an engine's own spans (vLLM's); None: untraced."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prior: Sequence[int] = ()
    lora_id: int | None = None
    trace_headers: dict[str, str] | None = None


@dataclass(frozen=True)
class ParallelSizes:
    """An engine's parallelism, vLLM's: `tensor` x `pipeline` ranks per model replica, `data` replicas."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @property
    def ranks(self) -> int:
        """Devices (GPUs) the engine spans, each a rank of a weight transfer."""
        return self.tensor * self.pipeline * self.data


class Engine(Protocol):
    """One engine replica. A worker calls `start` once, then many `generate` calls concurrently.

    `generate` raises `InvalidRequestError` for input this engine cannot serve (for example a prompt
    longer than its context) and `EngineDeadError` when the engine itself has died. An aborted request
    (`abort`, or `pause("abort")`) returns what it generated so far with finish reason `abort`.
    The pause modes are vLLM's (`AsyncLLM.pause_generation`): `keep` freezes running requests (their KV cache
    stays) until `resume`; `abort` aborts them; `wait` lets them finish. In every mode requests added while
    paused wait until `resume`.
    """

    model_name: str
    capacity: int  # how many requests it runs at once; the worker reads no more than its free capacity
    memory_released: bool  # whether `sleep` frees engine memory (vLLM on CPU: no)

    # What it holds once started, as its heartbeat advertises it: tokens of one sequence (prompt and output), its KV
    # cache in tokens (vLLM's num_gpu_blocks x block_size), and its settings as vLLM resolved them ("" where none).
    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_cache_tokens(self) -> int: ...

    @property
    def engine_config(self) -> str: ...

    async def start(self) -> None: ...

    async def generate(self, generation: Generation, on_delta: OnDelta | None = None) -> Completion:
        """Generate after `generation.prompt_token_ids + generation.prior`; the Completion holds the new tokens only.
        `on_delta`, if given, is awaited with each batch of new tokens as the engine makes them (vLLM's delta outputs),
        before the final Completion is returned."""
        ...

    async def add_adapter(self, name: str, lora_id: int, path: str) -> None:
        """Load the LoRA adapter in directory `path` (peft's format; the caller checked it is allowed) as `name`,
        for requests that give `lora_id`. Raises what the engine raises (LoRA not enabled, rank too large)."""
        ...

    async def remove_adapter(self, lora_id: int) -> None:
        """Unload an adapter `add_adapter` loaded (no request runs on it any more)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    async def sleep(self, level: int, mode: PauseMode) -> None: ...

    async def wake_up(self, tags: list[str] | None) -> bool: ...

    async def reset_prefix_cache(self, reset_running_requests: bool) -> bool: ...

    async def chat_prompt(
        self, messages: ChatMessages, tools: ToolSpecs | None = None, chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int]: ...

    def parse_tool_calls(self, text: str, tools: ToolSpecs) -> tuple[str | None, list[dict[str, Any]]]:
        """Split model output into its content and OpenAI-shaped tool calls (none found: `(text, [])`)."""
        ...

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]: ...

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool) -> str: ...

    async def close(self) -> None: ...

    # --- weight sync (the receiving end; see rollout_svc.weightsync.transfer and workers.weight_receiver) ---

    weight_ranks: int  # ranks it takes in a weight transfer group (vLLM: tensor x pipeline x data parallel size)
    parallel: ParallelSizes  # how its ranks split (1, 1, 1 but for vLLM)

    async def join_weight_group(self, spec: TransferGroup, first_rank: int, host: str) -> None:
        """Join the trainer's transfer group (blocks until every rank has; raises on its timeout)."""
        ...

    async def leave_weight_group(self) -> None: ...

    async def receive_weights(self, manifest: WeightManifest) -> dict[str, Any]:
        """Receive the announced buckets from rank 0 into buffers this engine keeps, generating on meanwhile with the
        weights it has; nothing is loaded (`load_received` does, once every bucket arrived). Returns
        `{"receive_s": seconds receiving, "digest": of what arrived (`weightsync.transfer.weights_digest`)}`.
        Raises what the transfer raises (a peer gone): then nothing is kept to load."""
        ...

    async def load_received(self, source: ReceivedFrom = "trainer") -> dict[str, float]:
        """Load what the last `receive_weights` (source trainer; the caller paused the engine) or
        `receive_from_peer` (source peer; the worker is stale, it has no work) received. Returns seconds loading.
        Raises `RuntimeError` if nothing was received since the last load. What was loaded is then held, to serve.
        Source held: load again the version held from the last such load (the worker is stale: it loaded another
        version since, a checkpoint or vLLM's own transfer, that was never committed); source previous: the version
        loaded from a transfer before the last one (which was never committed; kept where the bucket buffers are
        pooled, on the CPU). `RuntimeError` if a receive overwrote it or none is kept."""
        ...

    async def serve_weights(self, spec: TransferGroup, host: str) -> dict[str, float]:
        """Send the version loaded last from a transfer (held on the CPU) to a late peer, as rank 0 of `spec`,
        generating on meanwhile; returns once sent (seconds sending). Raises `RuntimeError` if none is held (one
        loaded from a checkpoint is not), and what the transfer raises (the peer did not come, or went)."""
        ...

    async def receive_from_peer(self, spec: TransferGroup, first_rank: int, host: str, manifest: WeightManifest) -> str:
        """Receive `manifest`'s buckets from a peer (rank 0 of `spec`; this engine's ranks from `first_rank`) into
        buffers of their own; nothing is loaded (`load_received("peer")`). Returns the digest of what arrived
        (`weightsync.transfer.weights_digest`). Raises what the transfer raises."""
        ...

    async def load_checkpoint(self, path: str) -> dict[str, float]:
        """Load the safetensors of checkpoint directory `path` (the caller checked it is allowed)."""
        ...

    async def engine_weight_op(self, op: EngineWeightOpName, info: dict[str, Any]) -> None:
        """One call of vLLM's native weight transfer (`EngineWeightOp`): the trainer-led broadcast SkyRL drives.
        Raises `InvalidRequestError` where the engine has none (say what to use instead), and what vLLM raises."""
        ...

    def output_tokens(self, request_id: str) -> int | None:
        """Tokens generated so far by a request the engine holds (None: it holds no such request)."""
        ...


def joined(parts: list[Completion], prompt_token_ids: list[int] | None = None, finish_reason: str = "") -> Completion:
    """Consecutive delta Completions as one: their tokens, logprobs, text (and top logprobs, token texts) in order.
    The whole Completion of a request run with delta outputs, or a streaming chunk's worth of them."""
    tops = None if not parts or parts[0].top_logprobs is None else [t for p in parts for t in p.top_logprobs or []]
    texts = None if tops is None else [t for p in parts for t in p.tokens or []]
    return Completion(
        prompt_token_ids or [],
        [t for p in parts for t in p.completion_token_ids],
        [lp for p in parts for lp in p.logprobs],
        finish_reason,
        "".join(p.text for p in parts),
        tops,
        texts,
        next((p.prompt_logprobs for p in parts if p.prompt_logprobs is not None), None),
    )
