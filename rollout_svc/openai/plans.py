"""An OpenAI request as rollout requests, without HTTP: the plan of a chat or completions body (shared by the API
and batch jobs).

`n` samples of a prompt are n requests of one group (sample j seeded `seed + j`, as `RolloutClient.sample`), choice
index `prompt * n + j` (vLLM's order). Tools: `auto` asks the worker to parse tool calls (vLLM's parser, run there);
a named or `required` `tool_choice`, and `response_format`, constrain decoding with vLLM's structured outputs (a JSON
schema built as vLLM's server builds it). Bad values raise `APIError` 400, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rollout_svc.client.rollout_client import Prompt
from rollout_svc.openai.errors import APIError, invalid_body
from rollout_svc.openai.render import Reply
from rollout_svc.openai.schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice, _Sampling
from rollout_svc.protocol import SamplingParams, StructuredOutputs, Trajectory

_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
)


@dataclass
class Plan:
    """The rollout requests of one API request: choice i is `prompts[i]` under `params[i]`."""

    reply: Reply
    prompts: list[Prompt]
    params: list[SamplingParams]
    prompt_indices: list[int]
    session_id: str | None
    group_ids: list[str | None]
    stream: bool
    include_usage: bool = False
    tools: list[dict[str, Any]] | None = None
    parse_tool_calls: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chunks: bool = True  # workers stream tokens (off when tool calls are made of the whole output)
    adapter: str | None = None  # the LoRA adapter the request's `model` names (None: the base model)
    model_name: str = ""  # the named model (`Settings.model_name`) whose workers run it ("": the default model)
    request_ids: list[str] | None = None  # one per prompt, given (a stored response's, to cancel it by); None: fresh

    def template_options(self) -> dict[str, Any]:
        """How the workers template this plan's chats and read their answers, as `RolloutClient.stream` takes it:
        OpenAI's function `tools`, `chat_template_kwargs`, and whether to parse tool calls out of the output."""
        return {
            "tools": self.tools,
            "parse_tool_calls": self.parse_tool_calls,
            "chat_template_kwargs": self.chat_template_kwargs,
        }


def sampling_params(
    body: _Sampling, max_tokens: int, logprobs: int | None, structured: StructuredOutputs | None
) -> SamplingParams:
    """Our SamplingParams of an OpenAI body. Raises `APIError` 400 naming a bad value."""
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "logprobs": logprobs,
        "structured_outputs": structured,
        "seed": body.seed,
        "prompt_logprobs": body.prompt_logprobs,
    }
    fields.update({name: getattr(body, name) for name in _SAMPLING_FIELDS if getattr(body, name) is not None})
    if body.stop is not None:
        fields["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    try:
        return SamplingParams.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(p) for p in error.get("loc", ()))
        raise APIError(400, f"{param or 'sampling params'}: {error.get('msg')}", param=param or None) from exc


# vLLM's `StructuredOutputsParams` options we do not serve: dropped when unset (falsy), refused when set
_UNSERVED_STRUCTURED = frozenset(
    {
        "disable_fallback",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
        "structural_tag",
        "_backend",
        "_backend_was_auto",
    }
)


def vllm_structured_outputs(body: _Sampling) -> StructuredOutputs | None:
    """`structured_outputs` as vLLM's server takes it (`StructuredOutputsParams`: exactly one of `json`, `regex`,
    `choice`, `grammar`, `json_object`), as ours; an option we do not serve (`structural_tag`, `whitespace_pattern`,
    the `disable_*` switches) set away from its default is refused by name. Raises `APIError` 400."""
    given = body.structured_outputs
    if given is None:
        return None
    unserved = sorted(k for k, v in given.items() if k in _UNSERVED_STRUCTURED and v)
    if unserved:
        raise APIError(
            400,
            f"structured_outputs.{unserved[0]} is not supported by rollout-svc: give one of json, regex, choice, "
            "grammar, json_object",
            param=f"structured_outputs.{unserved[0]}",
        )
    fields = {k: v for k, v in given.items() if k not in _UNSERVED_STRUCTURED}
    try:
        return StructuredOutputs.model_validate(fields)
    except ValidationError as exc:
        raise invalid_body([{**e, "loc": ("structured_outputs", *e["loc"])} for e in exc.errors()]) from exc


def _show_asked(reply: Reply, body: _Sampling) -> None:
    """What the reply shows besides the text, as the body asks (vLLM's fields): token ids, tokens named by their
    ids in logprobs, prompt logprobs."""
    reply.return_token_ids, reply.token_ids_as_tokens = body.return_token_ids, body.return_tokens_as_token_ids
    reply.prompt_logprobs = body.prompt_logprobs is not None


def _expand(
    reply: Reply, body: _Sampling, prompts: list[Prompt], params: SamplingParams, session_id: str | None
) -> tuple[list[Prompt], list[SamplingParams], list[int], list[str | None]]:
    """n samples per prompt: choice `p * n + j` is prompt p seeded `seed + j`, its group the prompt's."""
    out_prompts, out_params, indices, groups = [], [], [], []
    for p, prompt in enumerate(prompts):
        group = f"{reply.id}-{p}" if body.n > 1 else None
        for j in range(body.n):
            seeded = params if params.seed is None or j == 0 else params.model_copy(update={"seed": params.seed + j})
            out_prompts.append(prompt)
            out_params.append(seeded)
            indices.append(p)
            groups.append(group)
    return out_prompts, out_params, indices, groups


def chat_plan(body: ChatCompletionRequest, model: str, session_id: str | None, default_max_tokens: int) -> Plan:
    """Plan a chat completion: messages, tools and structured outputs. Raises `APIError` 400."""
    try:
        messages = [m.as_dict() for m in body.messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    reply = Reply("chat", model, logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0)
    _show_asked(reply, body)
    structured = vllm_structured_outputs(body)
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    formatted = body.response_format is not None and body.response_format.type != "text"
    if structured is not None and (forced or formatted):
        raise APIError(
            400, "give structured_outputs, or response_format or a tool_choice, not both", param="structured_outputs"
        )
    if isinstance(choice, NamedToolChoice):
        reply.forced_tool = choice.function.name
        [function] = [t.function for t in body.tools or [] if t.function.name == choice.function.name][:1]
        structured = StructuredOutputs(json_=function.parameters or {"type": "object"})
    elif choice == "required":
        reply.required_tools = True
        structured = StructuredOutputs(json_=_required_tools_schema(body))
    elif body.response_format is not None and body.response_format.type == "json_object":
        structured = StructuredOutputs(json_object=True)
    elif body.response_format is not None and body.response_format.type == "json_schema":
        assert body.response_format.json_schema is not None
        structured = StructuredOutputs(json_=body.response_format.json_schema.schema_)
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens, logprobs, structured)
    prompts, all_params, indices, groups = _expand(reply, body, [messages], params, session_id)
    parse = choice == "auto" and tools is not None
    return Plan(
        reply,
        prompts,
        all_params,
        indices,
        session_id,
        groups,
        body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        tools=tools,
        parse_tool_calls=parse,
        chat_template_kwargs=body.template_kwargs(),
        chunks=not (parse or reply.forced_tool or reply.required_tools),
    )


def completion_plan(body: CompletionRequest, model: str, session_id: str | None) -> Plan:
    """Plan a text completion: text or token-id prompts, one or a batch. Raises `APIError` 400."""
    if body.echo:
        raise APIError(
            400, "echo is not supported: the prompt is in `prompt_token_ids` with return_token_ids", param="echo"
        )
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    try:
        prompts: list[Prompt] = list(body.prompts())
    except ValueError as exc:
        raise APIError(400, str(exc), param="prompt") from exc
    reply = Reply("text", model, logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0)
    _show_asked(reply, body)
    params = sampling_params(body, body.max_tokens or 16, body.logprobs, vllm_structured_outputs(body))
    all_prompts, all_params, indices, groups = _expand(reply, body, prompts, params, session_id)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Plan(reply, all_prompts, all_params, indices, session_id, groups, body.stream, include_usage)


def _required_tools_schema(body: ChatCompletionRequest) -> dict[str, Any]:
    """`tool_choice="required"`: a non-empty JSON list of `{"name", "parameters"}` of the given tools (vLLM's
    `_get_json_schema_from_tool`)."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for t in body.tools or []
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": variants}}


def raise_for(t: Trajectory) -> None:
    """An API error for a failed trajectory: bad input 400, a deadline 504, an engine failure 500."""
    if t.finish_reason == "error":
        if t.error_code == "unknown_adapter":
            raise APIError(404, t.error or "unknown adapter", param="model", code="model_not_found")
        if t.error_code == "invalid_request":
            raise APIError(400, t.error or "invalid request", code="invalid_request")
        if t.error_code == "deadline_exceeded":
            raise APIError(504, t.error or "deadline exceeded", code="deadline_exceeded")
        raise APIError(500, f"generation failed on worker {t.worker_id}: {t.error}", code=t.error_code)
    if t.finish_reason == "abort" and t.abort_cause == "deadline" and not t.completion_token_ids:
        raise APIError(504, "the request's deadline passed before it was served", code="deadline_exceeded")
