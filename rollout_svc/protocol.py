"""Every message that crosses a process boundary, and its msgpack encoding (never pickle).

Here: requests (`RolloutRequest` with its `SamplingParams`, tokenizer requests), their answers (`Trajectory`, its
chunks, error and tokenizer results), a worker's heartbeat (`WorkerStatus`), and the envelope (`encode`, `decode`).
The orders that run the fleet (control commands, weight-sync orders and manifests, catch-ups) are defined in
`rollout_svc.orders` and imported from here like the rest.

Wire format of one message (the value of the field `m` of a stream entry):

    msgpack({"v": SCHEMA_VERSION, "t": "<type name>", "b": <the model's fields>})

encoded and decoded with msgspec (`rollout_svc.wire`): requests, commands and orders are validated by their models on
decode; what workers answer (trajectories, chunks, results) is checked by a msgspec Struct of the same fields.

A reader refuses another schema version with `ProtocolError` rather than guessing. Within one schema version
messages evolve by adding optional fields: a reader ignores fields it does not know, so producers and workers
need no lockstep upgrade. User parameters are the exception: `SamplingParams` refuses unknown fields (a typo
must not be silently ignored), and a worker answers such a request with an `invalid_request` error result.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgpack
import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollout_svc.errors import InvalidRequestError, ProtocolError
from rollout_svc.keys import MAX_COST, WorkerLabel

# The orders that run the fleet live in `rollout_svc.orders`; they are named from here, as every wire type is.
from rollout_svc.orders import CatchUpAnswer as CatchUpAnswer
from rollout_svc.orders import CatchUpOrder as CatchUpOrder
from rollout_svc.orders import ControlCommand as ControlCommand
from rollout_svc.orders import EngineWeightOp as EngineWeightOp
from rollout_svc.orders import EngineWeightOpName as EngineWeightOpName
from rollout_svc.orders import TensorSpec as TensorSpec
from rollout_svc.orders import TransferGroup as TransferGroup
from rollout_svc.orders import WeightManifest as WeightManifest
from rollout_svc.orders import WeightSyncOrder as WeightSyncOrder
from rollout_svc.wire import ENVELOPE, Message, WireModel, encode_envelope

SCHEMA_VERSION = 1
M = TypeVar("M", bound=BaseModel)

FinishReason = Literal["stop", "length", "abort", "error"]
# Why a request stopped early (finish_reason "abort"): a pause in abort mode, an explicit abort or cancel, its
# deadline, its worker shutting down, its worker found stale (it missed a weight sync), its call's completion
# target (a partial rollout, cut to be continued by a later call), a straggler move whose hand-over failed, or its
# own staleness bound (`RolloutRequest.max_staleness`, `min_weight_version`: its tokens would be staler than it allows).
# "pause", "shutdown", "stale" and "migrate" are retried token-exact by RolloutClient; "staleness" is generated again
# from scratch (or returned as it is, `stale_policy="mark"`).
AbortCause = Literal["pause", "user", "deadline", "shutdown", "stale", "partial", "migrate", "staleness"]
PauseMode = Literal["keep", "abort", "wait"]
WeightSpan = tuple[int, int]  # (weight version, index of the first completion token generated under it)
ErrorCode = Literal[
    "invalid_request",  # bad input: fix it, retrying will not help
    "deadline_exceeded",  # the request's deadline passed before it finished
    "max_deliveries",  # delivered max_deliveries times without a result (it may crash workers)
    "undecodable",  # the entry could not be decoded
    "engine_error",  # the engine failed on this request
    "shard_unavailable",  # the Redis primary of the request's shard stayed unreachable past redis_outage_s
    "unknown_adapter",  # the request names a LoRA adapter its worker does not hold (never loaded, or unloaded)
]
INT64_MAX = 2**63 - 1  # the largest integer MessagePack (and vLLM's int64 tensors) carry signed
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
TopLogprob = tuple[int, str, float]  # (token id, its text, logprob)
PromptLogprob = tuple[int, str, float, int]  # (token id, its text, logprob, rank: 1 is the most likely)


class StructuredOutputs(Message):
    """Constrained decoding, as vLLM's `StructuredOutputsParams`: give exactly one of a JSON schema (`json`, a dict
    or its JSON text), any JSON object (`json_object`), a `regex`, a `choice` of strings, or an EBNF `grammar`."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [
            n for n in ("json_", "json_object", "regex", "choice", "grammar") if getattr(self, n) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice, grammar")
        return self

    def to_vllm(self) -> dict[str, Any]:
        """The keyword arguments of `vllm.sampling_params.StructuredOutputsParams`."""
        return self.model_dump(by_alias=True, exclude_none=True)


class SamplingParams(Message):
    """Sampling parameters, with vLLM's field names and meanings (`vllm.SamplingParams`).

    `n` is not a field: use `RolloutClient.sample(prompts, n)`, which sends n requests of one group.
    Raises `pydantic.ValidationError` (through the client: `InvalidRequestError`) on bad values or unknown fields.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT64_MAX, description="0 or -1: no top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(16, ge=1, le=INT64_MAX)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=20, description="top logprobs per token (vLLM's meaning; the sampled token's is always given)"
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="logprobs of each prompt token, with the top k at its position (vLLM's meaning)"
    )
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not all(math.isfinite(x) for x in (self.temperature, self.repetition_penalty)):
            raise ValueError("temperature and repetition_penalty must be finite")
        return self


class ChatMessage(Message):
    """One turn of a conversation, as in OpenAI's chat API."""

    model_config = ConfigDict(extra="allow", frozen=True)  # tool calls, names: passed to the template
    role: str
    content: str | None = ""


class Continuation(Message):
    """What an interrupted request generated before it was resubmitted (a token-exact retry).

    The worker generates after `prompt + token_ids`, with `max_tokens` and `min_tokens` reduced by
    `len(token_ids)`, and answers with the whole completion: these tokens and logprobs, then the new ones,
    the text detokenized whole. `retry_of` is the request id the caller submitted; an explicit abort of it
    also hits its retries. `interruptions` counts the aborts so far.
    """

    retry_of: str
    token_ids: list[TokenId] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    text: str = ""
    interruptions: int = Field(0, ge=0)
    weight_versions: list[WeightSpan] = Field(default_factory=list)
    top_logprobs: list[list[TopLogprob]] | None = None
    tokens: list[str] | None = None  # each token's text, where the attempt had them (asked for logprobs)
    adapter_versions: list[WeightSpan] = Field(default_factory=list)  # as weight_versions, of the request's adapter

    @classmethod
    def of(cls, result: Trajectory, retry_of: str, interruptions_added: int = 1) -> Continuation:
        """What the interrupted attempt `result` generated, for the attempt that goes on from it: its tokens,
        logprobs (and top logprobs, token texts), text, weight and adapter version spans, and its interruptions
        plus `interruptions_added` (one: this attempt was interrupted; zero: a trajectory a caller passes back to
        be continued, whose cut it already counts). `retry_of`: the request id the caller submitted."""
        return cls(
            retry_of=retry_of,
            token_ids=result.completion_token_ids,
            logprobs=result.logprobs,
            text=result.text,
            interruptions=result.interruptions + interruptions_added,
            weight_versions=result.weight_versions,
            adapter_versions=result.adapter_versions,
            top_logprobs=result.top_logprobs,
            tokens=result.tokens,
        )


class RolloutRequest(Message):
    """One generation: a prompt (token ids; text, which the worker tokenizes with its special tokens as vLLM's
    completions API does; or chat messages the worker templates) and sampling params.

    `deadline` and `submitted_at` are unix seconds (wall clock: producer and worker hosts must keep
    time with NTP). `reply_to` is the results stream of the producer. `continuation` is set on a retry.
    `tools` (OpenAI's function tools) and `chat_template_kwargs` go into the chat template; with `parse_tool_calls`
    the worker runs its tool-call parser (vLLM's, `--tool-call-parser`) on the output. `stream`: the worker also
    sends `TrajectoryChunk`s (new tokens, a few at a time) before the final trajectory. `text_as_detokenized`: the
    trajectory's `text` is its completion token ids decoded whole as a `DetokenizeRequest` decodes them
    (`skip_special_tokens=True`), not the engine's incremental text: for a caller that asks for just that next
    (SkyRL's `generate` calls `/detokenize` after each, which `serve` then answers without a worker).
    `expected_tokens`: the output tokens it is expected to make (`sample` sets it from the prompt's earlier groups,
    `client/expected.py`); placement counts it in place of `max_tokens` (`cost_tokens`). None: unknown.
    `adapter`: the LoRA adapter to generate with, by the name it was loaded under (`ControlPlane.load_adapter`),
    at its newest version when the attempt starts; None: the base model. A worker that does not hold it answers
    `unknown_adapter`, never the base model.
    Staleness bound (`staleness_floor`; None: none): `max_staleness` (weight versions; the client copies
    `ClientSettings.max_staleness`) and `min_weight_version` (absolute; prime-rl's `max_async_level` and AReaL's
    `max_head_offpolicyness` as a version floor). The worker checks it when it takes the request and at each weight
    sync while it holds it: where its first token would come from a version below the floor, it answers at once with
    `abort_cause="staleness"` (its tokens so far kept in the answer) instead of generating on.
    `traceparent`: the W3C trace context of its producer's call where tracing is on (`rollout_svc.tracing`): the
    parent of the spans its attempts make on the workers.
    """

    request_id: str = Field(min_length=1)
    session_id: str | None = None
    group_id: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    reply_to: str
    deadline: float | None = None
    submitted_at: float = Field(default_factory=time.time)
    continuation: Continuation | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    parse_tool_calls: bool = False
    stream: bool = False
    text_as_detokenized: bool = False
    expected_tokens: int | None = Field(None, ge=1)
    adapter: str | None = None
    max_staleness: int | None = Field(None, ge=0)
    min_weight_version: int | None = Field(None, ge=0)
    traceparent: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> RolloutRequest:
        if sum(p is not None for p in (self.prompt_token_ids, self.messages, self.prompt)) != 1:
            raise ValueError("give exactly one of prompt_token_ids, messages and prompt")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.continuation is not None:
            if self.prompt_token_ids is None:
                raise ValueError("a continuation needs prompt_token_ids (the templated prompt of a chat request)")
            if len(self.continuation.token_ids) != len(self.continuation.logprobs):
                raise ValueError("a continuation needs one logprob per token")
            if len(self.continuation.token_ids) >= self.sampling_params.max_tokens:
                raise ValueError("a continuation must leave at least one token to generate")
        return self

    def cost_tokens(self) -> int:
        """The work this request brings a worker, in tokens: its prompt's (token ids counted; text and messages
        estimated at 4 characters a token, OpenAI's rule of thumb for English) plus the tokens it may still
        generate: `max_tokens`, or `expected_tokens` where that is set and smaller. A continuation's earlier tokens
        move from the second part to the first (prefilled, not generated): the sum stays. What placement shares out
        (docs/architecture.md)."""
        if self.prompt_token_ids is not None:
            prompt = len(self.prompt_token_ids)
        else:
            text = self.prompt if self.prompt is not None else "".join(m.content or "" for m in self.messages or ())
            prompt = len(text) // 4 + 1
        output = self.sampling_params.max_tokens
        total = prompt + (output if self.expected_tokens is None else min(output, self.expected_tokens))
        return min(total, MAX_COST)  # a max_tokens of 10^30 is valid input, not a load to sum in Lua

    def continued(self, result: Trajectory, retry_of: str, **fields: Any) -> RolloutRequest:
        """This request going on from `result`, its interrupted attempt (a token-exact retry, or a straggler's
        move): on the prompt ids `result` was served with (a chat or text prompt as its templated ids), with the
        `Continuation.of(result, retry_of)`, and `fields` changed besides (a retry's `request_id`, `reply_to`,
        `submitted_at`). A copy, not validated again."""
        prompt = {"prompt_token_ids": result.prompt_token_ids, "messages": None, "prompt": None}
        return self.model_copy(update={**prompt, "continuation": Continuation.of(result, retry_of), **fields})

    def staleness_floor(self, committed_version: int) -> int | None:
        """The oldest weight version this request's first token may come from while `committed_version` is the
        fleet's: `committed_version - max_staleness` (the staleness a client measures at receipt, `staleness_at`,
        judged before generating) and `min_weight_version`, the higher; None where the request sets neither."""
        floors = [self.min_weight_version]
        if self.max_staleness is not None:
            floors.append(committed_version - self.max_staleness)
        given = [floor for floor in floors if floor is not None]
        return max(given) if given else None

    @property
    def original_request_id(self) -> str:
        """The id the caller submitted: `request_id`, or for a retry the request it continues."""
        return self.continuation.retry_of if self.continuation else self.request_id


class TokenizeRequest(Message):
    """Turn text (or chat messages, templated with a generation prompt) into token ids on a worker. `tools` and
    `chat_template_kwargs` go into the chat template, as a `RolloutRequest`'s do."""

    request_id: str = Field(min_length=1)
    text: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reply_to: str
    deadline: float | None = None
    submitted_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.text is None) == (self.messages is None):
            raise ValueError("give exactly one of text and messages")
        return self


class DetokenizeRequest(Message):
    """Turn token ids into text on a worker."""

    request_id: str = Field(min_length=1)
    token_ids: list[TokenId]
    skip_special_tokens: bool = True
    reply_to: str
    deadline: float | None = None
    submitted_at: float = Field(default_factory=time.time)


class Trajectory(Message):
    """The result of one rollout request.

    Shapes: `completion_token_ids` and `logprobs` have one entry per generated token; `logprobs[i]` is
    the natural-log probability of `completion_token_ids[i]` under the sampling distribution.
    Times are seconds: `queue_time_s` from submission to the worker taking it, `generation_time_s`
    inside the engine (summed over retries). `finish_reason == "error"` marks a request that failed; `error`
    says why. `finish_reason == "abort"` marks one stopped early; `abort_cause` says why. `interruptions`
    counts the aborts (pauses, worker shutdowns) it was retried through, token-exact.

    Weights: `weight_versions` lists the versions the completion spanned as `(version, first_token_index)` pairs,
    in order (a keep-pause across a weight sync gives two); `weight_version` is the version of the last token
    (of the engine, for a trajectory without tokens). `staleness` is set by the client: the committed version when
    it received the trajectory minus the version of its first token (None until then).
    Adapters: a request that named one has `adapter` (its name) and `adapter_versions`, the adapter's versions the
    completion spanned, as `weight_versions` (a new version never cuts a running attempt: only a retry can move to
    one); `adapter_version` is the last one's. `adapter_staleness`, set by the client as `staleness` is: the adapter's
    newest version when it received the trajectory minus the version of its first token; `max_staleness` bounds it
    as it bounds `staleness`.

    Asked for (`sampling_params.logprobs = k`): `top_logprobs[i]` lists up to k `(token_id, token, logprob)` of the
    most likely tokens at position i, best first, and `tokens[i]` is the text of `completion_token_ids[i]`. Asked for
    (`sampling_params.prompt_logprobs = k`): `prompt_logprobs[i]` lists `(token_id, token, logprob, rank)` at prompt
    position i, the prompt token's first, then the top k (vLLM's entries, in its order; position 0 has none: nothing
    comes before it). `cached_tokens`: prompt tokens the engine found in its prefix cache on the last attempt (vLLM's
    `num_cached_tokens`, OpenAI's `usage.prompt_tokens_details.cached_tokens`). Asked to parse tool calls: `tool_calls`
    holds OpenAI-shaped calls (`{"id", "type": "function",
    "function": {"name", "arguments"}}`, arguments as JSON text) and `content` the text around them. `trace_id`: the
    trace (32 hex digits) its request's spans are in, where tracing is on (`rollout_svc.tracing`).
    """

    request_id: str
    session_id: str | None = None
    group_id: str | None = None
    prompt_token_ids: list[int]
    completion_token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    finish_reason: FinishReason
    text: str = ""
    weight_version: int = 0
    worker_id: str = ""
    queue_time_s: float = 0.0
    generation_time_s: float = 0.0
    error: str | None = None
    error_code: ErrorCode | None = None
    abort_cause: AbortCause | None = None
    interruptions: int = 0
    weight_versions: list[WeightSpan] = Field(default_factory=list)
    staleness: int | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    tokens: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    content: str | None = None
    prompt_logprobs: list[list[PromptLogprob]] | None = None
    cached_tokens: int = 0
    adapter: str | None = None
    adapter_versions: list[WeightSpan] = Field(default_factory=list)
    adapter_staleness: int | None = None
    trace_id: str | None = None

    @property
    def adapter_version(self) -> int | None:
        """The adapter version of the last token (None: no adapter, or no attempt ran)."""
        return self.adapter_versions[-1][0] if self.adapter_versions else None


class TrajectoryChunk(Message):
    """Part of a streaming request's completion, sent before its final `Trajectory` (which holds all of it).

    `offset` is the index of `token_ids[0]` in the whole completion (a retry's chunks go on after the tokens its
    earlier attempts made); `text` is the text these tokens add. Chunks of one request arrive in order and before
    its trajectory; a chunk may repeat tokens a retry regenerates, so readers keep what they have by `offset`.
    """

    request_id: str
    offset: int
    token_ids: list[int]
    logprobs: list[float] = Field(default_factory=list)
    text: str = ""
    worker_id: str = ""
    top_logprobs: list[list[TopLogprob]] | None = None
    tokens: list[str] | None = None


def unrun_trajectory(request: RolloutRequest, cause: AbortCause, worker_id: str = "") -> Trajectory:
    """The answer to a request aborted before it ran: no new tokens (a retry keeps what it had)."""
    prior = request.continuation
    return Trajectory(
        request_id=request.request_id,
        session_id=request.session_id,
        group_id=request.group_id,
        prompt_token_ids=request.prompt_token_ids or [],
        completion_token_ids=list(prior.token_ids) if prior else [],
        logprobs=list(prior.logprobs) if prior else [],
        text=prior.text if prior else "",
        finish_reason="abort",
        abort_cause=cause,
        interruptions=prior.interruptions if prior else 0,
        weight_versions=list(prior.weight_versions) if prior else [],
        weight_version=prior.weight_versions[-1][0] if prior and prior.weight_versions else 0,
        adapter=request.adapter,
        adapter_versions=list(prior.adapter_versions) if prior else [],
        worker_id=worker_id,
        queue_time_s=max(0.0, time.time() - request.submitted_at),
    )


class ErrorResult(Message):
    """A worker's answer to a request it could not serve. `recoverable`: may a retry succeed?"""

    request_id: str
    code: ErrorCode
    message: str
    recoverable: bool = False
    worker_id: str = ""


class TokenizeResult(Message):
    """The answer to a TokenizeRequest (`token_ids`) or a DetokenizeRequest (`text`)."""

    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    worker_id: str = ""


Request = RolloutRequest | TokenizeRequest | DetokenizeRequest
Result = Trajectory | ErrorResult | TokenizeResult  # a request's answer; a TrajectoryChunk comes before it
_TYPES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in (
        RolloutRequest,
        TokenizeRequest,
        DetokenizeRequest,
        Trajectory,
        TrajectoryChunk,
        ErrorResult,
        TokenizeResult,
        ControlCommand,
        WeightSyncOrder,
        WeightManifest,
        CatchUpOrder,
        CatchUpAnswer,
    )
}


# What workers answer, one per request: decoded with a msgspec Struct of the model's fields (`wire.WireModel`).
_TRUSTED = {cls.__name__: WireModel(cls) for cls in (Trajectory, TrajectoryChunk, ErrorResult, TokenizeResult)}


def construct(cls: type[M], **values: Any) -> M:
    """A worker's answer (`Trajectory`, `TrajectoryChunk`, `ErrorResult`, `TokenizeResult`) built from values this
    process computed, without validating them (what `model_construct` does, faster)."""
    return _TRUSTED[cls.__name__].build(**values)  # type: ignore[no-any-return]


def encode(message: Message) -> bytes:
    """Pack a message into its MessagePack envelope (`wire.encode_envelope`)."""
    return encode_envelope(SCHEMA_VERSION, message)


def decode(data: bytes, committed_version: int | None = None) -> Any:
    """Unpack an envelope into its message. `committed_version`: the fleet's committed weight version as a producer
    receives the message; a `Trajectory` then comes with its `staleness` (`staleness_at`), built once.

    Raises `ProtocolError` if it is not one we understand, and `InvalidRequestError` for a well-formed
    request whose user parameters are bad (an unknown sampling field): its producer gets an error result.
    """
    try:
        envelope = ENVELOPE.decode(data)
        version, type_name, body = envelope.v, envelope.t, envelope.b
    except Exception as exc:
        raise ProtocolError(f"not a rollout-svc message ({type(exc).__name__}: {exc})") from exc
    if version != SCHEMA_VERSION:
        raise ProtocolError(
            f"message has schema version {version!r}, this build speaks {SCHEMA_VERSION}: "
            "run the same rollout-svc version on producers and workers"
        )
    cls = _TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r}")
    trusted = _TRUSTED.get(type_name)
    try:
        if trusted is not None:
            values = trusted.values(body)
            if committed_version is not None and type_name == "Trajectory":
                spans, version = values["weight_versions"], values["weight_version"]
                # Cut by its worker as too stale: judged by the version it gives, whose commit may not be read yet.
                committed = committed_version
                if values["abort_cause"] == "staleness":
                    committed = max(committed, version)
                values["staleness"] = staleness_at(spans, version, committed)
            return trusted.make(values)
        return cls.model_validate(msgspec.msgpack.decode(body))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"invalid {type_name}: {exc}") from exc
    except ValidationError as exc:
        if all(error["loc"][:1] == ("sampling_params",) for error in exc.errors()):
            raise InvalidRequestError(f"invalid sampling params: {exc}") from exc
        raise ProtocolError(f"invalid {type_name}: {exc}") from exc


def staleness_at(weight_versions: Sequence[WeightSpan], weight_version: int, committed_version: int) -> int:
    """A trajectory's staleness (DESIGN.md, section 5) when `committed_version` is the fleet's committed weight
    version: that minus the version of its first token (`weight_versions[0]`; `weight_version`, its engine's, if it
    has no token), not below 0."""
    first = weight_versions[0][0] if weight_versions else weight_version
    return max(0, committed_version - first)


def reply_address(data: bytes) -> tuple[str, str] | None:
    """Best effort (request_id, reply_to) of an entry that failed to decode, so its producer can be told."""
    try:
        body = msgpack.unpackb(data)["b"]
        request_id, reply_to = body["request_id"], body["reply_to"]
    except Exception:
        return None
    if isinstance(request_id, str) and isinstance(reply_to, str):
        return request_id, reply_to
    return None


def as_sampling_params(value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """Validate user sampling params. Raises `InvalidRequestError` naming every bad field."""
    if isinstance(value, SamplingParams):
        return value
    try:
        return SamplingParams.model_validate(value or {})
    except ValidationError as exc:
        raise InvalidRequestError(f"invalid sampling params: {exc}") from exc


class WorkerStatus(BaseModel):
    """A worker's heartbeat, as stored in the hash `rollout:worker:{worker_id}` (times: unix seconds).

    `state`: a `keys.WorkerLabel` (starting: not yet converged; serving, paused, sleeping, draining: stopping;
    stale: behind the committed weight version). `applied_epoch`
    is the control epoch it has applied (its acknowledgement); `pause_mode` the mode it is paused in ("" when
    not paused); `memory_released` whether sleeping freed engine memory (never on CPU). `fenced_results`
    counts results it dropped because their request had been requeued while it was presumed dead.
    `tensor_parallel_size` x `pipeline_parallel_size` x `data_parallel_size` = `weight_ranks`: the devices (GPUs)
    its engine spans, each a rank of a weight transfer (1 for the echo and sim engines). `adapters`: the LoRA
    adapters it holds, newest version of each, as `name@version` joined by commas (`adapter_versions` parses it).
    What its engine holds once started: `max_num_seqs` sequences at once per data-parallel replica (`capacity` in
    all), `max_model_len` tokens each (prompt and output), `kv_cache_tokens` in its KV cache (vLLM's
    num_gpu_blocks x block_size; the echo engine's: every sequence at full length), and `engine_config`, its settings
    as vLLM resolved them (`dtype=bfloat16 quantization=none cuda_graphs=on prefix_caching=on speculative=none`).
    What it served, summed since it started (`workers.totals.ServedTotals`: rates are differences between two
    heartbeats): `served` generations, `generated_tokens` in `generation_s` seconds on the engine, and
    `first_tokens` streamed requests' first chunks, `first_token_s` seconds after their submission in all.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)
    worker_id: str
    state: WorkerLabel = "serving"
    engine: str = ""
    model: str = ""
    weight_digest: str = ""
    capacity: int = 0
    in_flight: int = 0
    served: int = 0
    weight_version: int = 0
    host: str = ""
    pid: int = 0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    applied_epoch: int = 0
    pause_mode: str = ""
    sleep_level: int = 0
    memory_released: bool = False
    fenced_results: int = 0
    incarnation: int = 0
    error_epoch: int = 0
    error: str = ""
    weight_ranks: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    adapters: str = ""
    max_num_seqs: int = 0
    max_model_len: int = 0
    kv_cache_tokens: int = 0
    engine_config: str = ""
    generated_tokens: int = 0
    generation_s: float = 0.0
    first_tokens: int = 0
    first_token_s: float = 0.0

    @property
    def adapter_versions(self) -> dict[str, int]:
        """`adapters` parsed: name -> the newest version it holds."""
        pairs = (item.rpartition("@") for item in self.adapters.split(",") if item)
        return {name: int(version) for name, _, version in pairs}

    def to_hash(self) -> dict[str, str]:
        """The heartbeat hash's fields: every value as a string (bools as 1/0)."""
        return {k: str(int(v)) if isinstance(v, bool) else str(v) for k, v in self.model_dump().items()}

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> WorkerStatus:
        return cls.model_validate({k.decode(): v.decode() for k, v in fields.items()})
