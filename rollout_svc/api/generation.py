"""`/v1/chat/completions` and `/v1/completions`: an OpenAI request becomes rollout requests through `RolloutClient`.

`n` samples of a prompt are n requests of one group (sample j seeded `seed + j`, as `RolloutClient.sample`), choice
index `prompt * n + j` (vLLM's order). Tools: `auto` asks the worker to parse tool calls (vLLM's parser, run there);
a named or `required` `tool_choice`, and `response_format`, constrain decoding with vLLM's structured outputs (a JSON
schema built as vLLM's server builds it). A streaming request makes its workers send their tokens a few at a time;
the response streams them as server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.
A client that goes away cancels its requests (queued or in flight) on the workers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from rollout_svc.api.errors import APIError, from_exception
from rollout_svc.api.render import Reply, StreamState, sse, usage
from rollout_svc.api.schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice, _Sampling
from rollout_svc.client import Prompt, RolloutClient
from rollout_svc.protocol import SamplingParams, StructuredOutputs, Trajectory, TrajectoryChunk

T = TypeVar("T")
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
    reply.return_token_ids = body.return_token_ids
    structured: StructuredOutputs | None = None
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
        chat_template_kwargs=body.chat_template_kwargs,
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
    reply.return_token_ids = body.return_token_ids
    params = sampling_params(body, body.max_tokens or 16, body.logprobs, None)
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


# --- running a plan ---------------------------------------------------------------------------------------


class Generation:
    """Runs plans on one `RolloutClient` for one app; `metrics` (an `ApiMetrics`, or None) counts tokens."""

    def __init__(self, client: RolloutClient, metrics: Any, timeout_s: float) -> None:
        self.client, self.metrics, self.timeout_s = client, metrics, timeout_s

    def _events(self, plan: Plan) -> AsyncGenerator[tuple[int, TrajectoryChunk | Trajectory], None]:
        sessions = [plan.session_id] * len(plan.prompts) if plan.session_id else None
        return self.client.stream(
            plan.prompts,
            plan.params,
            sessions,
            chunks=plan.stream and plan.chunks,
            group_ids=plan.group_ids,
            tools=plan.tools,
            parse_tool_calls=plan.parse_tool_calls,
            chat_template_kwargs=plan.chat_template_kwargs,
            timeout_s=self.timeout_s,
        )

    async def respond(self, request: Request, plan: Plan) -> Response:
        """Run a plan: a JSON response, or a stream (whose first event has arrived before the headers go)."""
        if plan.stream:
            return await self._stream(request, plan)
        results: list[Trajectory | None] = [None] * len(plan.prompts)

        async def collect() -> None:
            async for index, event in self._events(plan):
                if isinstance(event, Trajectory):
                    results[index] = event

        await until_disconnected(request, collect())
        trajectories = [t for t in results if t is not None]
        for t in trajectories:
            raise_for(t)
        self._count(trajectories, plan)
        body = plan.reply.response(trajectories, plan.prompt_indices)
        return JSONResponse(body, headers=worker_header(trajectories))

    async def _stream(self, request: Request, plan: Plan) -> Response:
        started = time.perf_counter()
        events = self._events(plan)
        try:
            first = await until_disconnected(request, anext(events))
        except StopAsyncIteration:  # nothing to generate
            first = None
        except BaseException:
            await events.aclose()
            raise
        if first is not None and isinstance(first[1], Trajectory):
            try:
                raise_for(first[1])
            except APIError:
                await events.aclose()
                raise
        if self.metrics is not None:
            self.metrics.observe_first_token(time.perf_counter() - started)
        worker = first[1].worker_id if first is not None else ""
        body = self._sse(plan, first, events)
        return StreamingResponse(
            body, media_type="text/event-stream", headers={"X-Worker-ID": worker} if worker else None
        )

    async def _sse(
        self,
        plan: Plan,
        first: tuple[int, TrajectoryChunk | Trajectory] | None,
        events: AsyncGenerator[tuple[int, TrajectoryChunk | Trajectory], None],
    ) -> AsyncIterator[bytes]:
        reply, count = plan.reply, len(plan.prompts)
        states = [StreamState() for _ in range(count)]
        finals: list[Trajectory | None] = [None] * count
        try:
            if reply.kind == "chat":
                yield sse(reply.role_chunk(range(count)))
            pending = [first] if first is not None else []
            while True:
                if pending:
                    index, event = pending.pop()
                else:
                    try:
                        index, event = await anext(events)
                    except StopAsyncIteration:
                        break
                if isinstance(event, TrajectoryChunk):
                    if states[index].take(event):
                        choice = reply.delta_choice(
                            index, event.text, event.token_ids, event.logprobs, event.tokens, event.top_logprobs
                        )
                        yield sse(reply.chunk([choice]))
                    continue
                finals[index] = event
                yield sse(reply.chunk([self._last_choice(reply, index, event, states[index])]))
            done = [t for t in finals if t is not None]
            self._count(done, plan)
            if plan.include_usage:
                yield sse(reply.chunk([], usage(done, plan.prompt_indices[: len(done)])))
            yield sse("[DONE]")
        except Exception as exc:  # headers are gone: the error goes in the stream, as vLLM's server does
            yield sse(from_exception(exc).body())
            yield sse("[DONE]")
        finally:
            await events.aclose()  # cancels what has not finished (a client that went away)

    @staticmethod
    def _last_choice(reply: Reply, index: int, t: Trajectory, state: StreamState) -> dict[str, Any]:
        """The end of one choice: what the chunks did not carry, its tool calls, its finish reason."""
        finish: str | None = t.finish_reason
        if t.finish_reason == "error":
            text, rest, extra = f"[error: {t.error}]", slice(0, 0), None
        else:
            text, rest = state.rest(t)
            extra = None
            if reply.kind == "chat":
                content, calls = reply.message_parts(t)
                if calls:
                    text = content or ""
                    extra = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                    finish = "tool_calls" if finish == "stop" else finish
        tops = t.top_logprobs[rest] if t.top_logprobs is not None else None
        tokens = t.tokens[rest] if t.tokens is not None else None
        ids, logprobs = t.completion_token_ids[rest], t.logprobs[rest]
        return reply.delta_choice(index, text, ids, logprobs, tokens, tops, finish, extra)

    def _count(self, trajectories: list[Trajectory], plan: Plan) -> None:
        if self.metrics is not None and trajectories:
            counted = usage(trajectories, plan.prompt_indices[: len(trajectories)])
            self.metrics.count_tokens(counted["prompt_tokens"], counted["completion_tokens"])


def raise_for(t: Trajectory) -> None:
    """An API error for a failed trajectory: bad input 400, a deadline 504, an engine failure 500."""
    if t.finish_reason == "error":
        if t.error_code == "invalid_request":
            raise APIError(400, t.error or "invalid request", code="invalid_request")
        if t.error_code == "deadline_exceeded":
            raise APIError(504, t.error or "deadline exceeded", code="deadline_exceeded")
        raise APIError(500, f"generation failed on worker {t.worker_id}: {t.error}", code=t.error_code)
    if t.finish_reason == "abort" and t.abort_cause == "deadline" and not t.completion_token_ids:
        raise APIError(504, "the request's deadline passed before it was served", code="deadline_exceeded")


def worker_header(trajectories: list[Trajectory]) -> dict[str, str]:
    """`X-Worker-ID`: the worker that served the response (several, comma-separated, for n > 1 spread out)."""
    workers = list(dict.fromkeys(t.worker_id for t in trajectories if t.worker_id))
    return {"X-Worker-ID": ",".join(workers)} if workers else {}


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` in this task, unless the client goes away first: then this task is cancelled (`work`'s requests
    with it) and `APIError` 499 is raised (nobody reads it). One watcher task per request, not a task for the work."""
    this = asyncio.current_task()
    assert this is not None
    disconnected = asyncio.Event()
    watcher = asyncio.ensure_future(_disconnect(request, this, disconnected))
    try:
        return await work
    except asyncio.CancelledError:
        if not disconnected.is_set():
            raise
        this.uncancel()
        raise APIError(499, "the client closed the request") from None
    finally:
        watcher.cancel()


async def _disconnect(request: Request, task: asyncio.Task[Any], disconnected: asyncio.Event) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            disconnected.set()
            task.cancel()
            return
