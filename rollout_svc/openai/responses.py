"""The Responses API without HTTP: a `ResponsesRequest` as a chat plan (`rollout_svc.openai.plans`), and a trajectory
as a response object and its stream of events.

Input items become chat messages as vLLM's server turns them (`vllm/entrypoints/openai/responses/utils.py`): a
message item its message (text parts joined), consecutive `function_call` items one assistant message with those
`tool_calls` (arguments parsed from JSON, as vLLM passes them to the chat template), a `function_call_output` a
`tool` message. `instructions` come first, as a system message, and are not carried to the next turn (OpenAI's
rule). The output is a `message` item with one `output_text` part, or `function_call` items where the model called
tools (parsed by the worker, or forced by `tool_choice`). Shapes: OpenAI's `openai.types.responses.Response` and its
stream events (`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`, ..., `response.completed`, each with a
`sequence_number`), which the official client parses; a response that ran out of `max_output_tokens` is
`incomplete` and its stream still ends with `response.completed`, as vLLM's does.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from rollout_svc.openai.errors import APIError, invalid_body
from rollout_svc.openai.plans import Plan, chat_plan
from rollout_svc.openai.responses_schemas import FunctionTool, NamedFunctionChoice, ResponsesRequest
from rollout_svc.openai.schemas import ChatCompletionRequest
from rollout_svc.protocol import Trajectory

Message = dict[str, Any]
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "refusal"})
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(given: str | list[dict[str, Any]]) -> list[Message]:
    """The chat messages of `input`: a string is one user message. Raises `APIError` 400 naming the item."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[Message] = []
    for i, item in enumerate(given):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer", param=where)
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _arguments(item, where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
        elif kind == "reasoning":
            continue  # what a reasoning model thought: not part of the next prompt (vLLM drops it as well)
        else:
            raise APIError(
                400,
                f"{where}: input items of type {kind!r} are not supported by rollout-svc: give messages, "
                "function_call and function_call_output items (or previous_response_id)",
                param=where,
            )
    if not messages:
        raise APIError(400, "input holds no message", param="input")
    return messages


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{where}.{name} must be a non-empty string", param=f"{where}.{name}")
    return value


def _arguments(item: dict[str, Any], where: str) -> Any:
    """A call's arguments for the chat template: the JSON object they hold, else their text."""
    text = item.get("arguments")
    if not isinstance(text, str):
        raise APIError(400, f"{where}.arguments must be a string of JSON", param=f"{where}.arguments")
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return parsed if isinstance(parsed, dict) else text


def _text(content: Any, where: str) -> str:
    """A content's text: a string, or text parts joined. Raises `APIError` 400 on a part that is not text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise APIError(
                400,
                f"{where}.{j}: content parts of type {kind!r} are not supported by rollout-svc: send input_text",
                param=f"{where}.{j}",
            )
        texts.append(part.get("text", part.get("refusal")))
    return "".join(texts)


@dataclass
class Turn:
    """One `POST /v1/responses`: its request, the conversation before it, its plan, and its output once run."""

    body: ResponsesRequest
    model: str
    history: list[Message]  # the conversation so far, without instructions (a previous response's)
    new: list[Message]  # this turn's input as messages
    session_id: str
    default_max_tokens: int  # when the body sets no max_output_tokens (`serve`'s `api_default_max_tokens`)
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    tools: list[FunctionTool] = field(init=False)  # the body's tools, validated once
    plan: Plan = field(init=False)

    def __post_init__(self) -> None:
        try:
            self.tools = self.body.function_tools()
        except (ValueError, ValidationError) as exc:
            raise APIError(400, str(exc), param="tools") from exc
        self.plan = _plan(self, self.body)

    @property
    def conversation(self) -> list[Message]:
        """The messages this turn continues (no instructions): the history, then the new input."""
        return [*self.history, *self.new]

    # --- the response object -------------------------------------------------------------------------------

    def response(self, t: Trajectory | None, output: list[dict[str, Any]], status: str) -> dict[str, Any]:
        """The response object (`status` in_progress, completed, incomplete, cancelled, failed) with `output` and,
        given its trajectory, usage and our fields: `weight_version`, `worker_id`."""
        body = self.body
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
        choice = body.tool_choice
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": self.plan.params[0].max_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": None,
            "store": body.store,
            "temperature": self.plan.params[0].temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": choice.model_dump() if isinstance(choice, NamedFunctionChoice) else choice,
            "tools": tools,
            "top_p": self.plan.params[0].top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
        }
        if t is not None:
            prompt, completion = len(t.prompt_token_ids), len(t.completion_token_ids)
            out["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": t.cached_tokens},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion,
            }
            out["weight_version"], out["worker_id"] = t.weight_version, t.worker_id
        return out

    def output_items(self, t: Trajectory) -> list[dict[str, Any]]:
        """The output of a finished trajectory: a message item, or one `function_call` item per tool call (with the
        text before them as a message item, where the model wrote any)."""
        content, calls = self.plan.reply.message_parts(t)
        items = [message_item(new_id("msg"), content, "completed")] if content or not calls else []
        items += [
            function_call_item(new_id("fc"), call["function"]["name"], call["function"]["arguments"], "completed")
            for call in calls
        ]
        return items

    def status_of(self, t: Trajectory) -> str:
        if t.finish_reason == "length":
            return "incomplete"
        if t.finish_reason == "abort":
            return "cancelled" if t.abort_cause == "user" else "incomplete"
        return "completed"

    def answered(self, output: list[dict[str, Any]]) -> list[Message]:
        """The conversation after this turn (no instructions): what it continued, its input, then its output as the
        assistant's messages (its calls as `tool_calls`), for the next turn's `previous_response_id`."""
        items = [
            {"type": "message", "role": "assistant", "content": item["content"][0]["text"]}
            if item["type"] == "message"
            else item
            for item in output
        ]
        return [*self.conversation, *(input_messages(items) if items else [])]


def output_text_part(text: str) -> dict[str, Any]:
    """A message item's one content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    part = output_text_part(text or "")
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def function_call_item(item_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": new_id("call"),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _plan(turn: Turn, body: ResponsesRequest) -> Plan:
    """The chat plan of a turn: instructions, the conversation, tools, tool_choice and text.format as chat's."""
    tools = [t.as_chat_tool() for t in turn.tools]
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    choice = body.tool_choice
    chat: dict[str, Any] = {
        "model": turn.model,
        "messages": [*system, *turn.conversation],
        "tools": tools or None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, NamedFunctionChoice)
        else (choice if tools else None),
        "seed": body.seed,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "stream": body.stream,  # the workers send tokens as they come
    }
    chat |= {name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        request = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from exc
    return chat_plan(request, turn.model, turn.session_id, turn.default_max_tokens)
