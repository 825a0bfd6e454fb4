"""Trajectories as OpenAI response bodies: chat completions, text completions, their stream chunks, usage, logprobs.

Shapes follow OpenAI's API reference and vLLM's server (`return_token_ids` adds `token_ids` to each choice and the
prompt's ids: `prompt_token_ids` at the top of a chat response, in each choice of a completions response).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rollout_svc.protocol import Trajectory, TrajectoryChunk


def sse(body: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>\\n\\n` (or the literal `[DONE]`)."""
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


@dataclass
class Reply:
    """What one response is about: its id, model, creation time, and what the caller asked to see."""

    kind: str  # "chat" or "text"
    model: str
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    token_ids_as_tokens: bool = False  # vLLM's `return_tokens_as_token_ids`: logprobs' tokens as "token_id:N"
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs`: per prompt position, {token id: logprob, rank, text}
    forced_tool: str | None = None  # a named tool_choice: the output is that function's arguments
    required_tools: bool = False  # tool_choice "required": the output is a JSON list of calls
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id

    def _envelope(self, object_type: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """What every response body and stream chunk opens with: id, object, created, model, choices."""
        return {
            "id": self.response_id,
            "object": object_type,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # --- whole responses --------------------------------------------------------------------------------

    def response(self, trajectories: list[Trajectory], prompt_indices: list[int]) -> dict[str, Any]:
        """The whole response; `trajectories[i]` is choice i, `prompt_indices[i]` the prompt it answers."""
        choices = [self.choice(i, t) for i, t in enumerate(trajectories)]
        body = self._envelope("chat.completion" if self.kind == "chat" else "text_completion", choices)
        body["usage"] = usage(trajectories, prompt_indices)
        if self.kind == "chat" and self.return_token_ids and trajectories:
            body["prompt_token_ids"] = trajectories[0].prompt_token_ids
        if self.kind == "chat" and self.prompt_logprobs and trajectories:
            body["prompt_logprobs"] = prompt_logprobs(trajectories[0])
        return body

    def choice(self, index: int, t: Trajectory) -> dict[str, Any]:
        finish: str = t.finish_reason
        if self.kind == "text":
            choice: dict[str, Any] = {"index": index, "text": t.text, "logprobs": None, "finish_reason": finish}
            if self.logprobs:
                tokens, tops = self.named(t.completion_token_ids, t.tokens, t.top_logprobs)
                choice["logprobs"] = text_logprobs(t.completion_token_ids, t.logprobs, tokens, tops)
            if self.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = t.prompt_token_ids, t.completion_token_ids
            if self.prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs(t)
            return choice
        content, calls = self.message_parts(t)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
        if self.logprobs:
            tokens, tops = self.named(t.completion_token_ids, t.tokens, t.top_logprobs)
            choice["logprobs"] = {"content": chat_logprobs(t.logprobs, tokens, tops, self.top_logprobs)}
        if self.return_token_ids:
            choice["token_ids"] = t.completion_token_ids
        return choice

    def named(
        self, token_ids: list[int], tokens: list[str] | None, tops: list[list[tuple[int, str, float]]] | None
    ) -> tuple[list[str] | None, list[list[tuple[int, str, float]]] | None]:
        """The tokens and each position's top logprobs as logprobs name them: their texts, or "token_id:N" (vLLM's
        `return_tokens_as_token_ids`)."""
        if not self.token_ids_as_tokens:
            return tokens, tops
        named_tops = None if tops is None else [[(i, f"token_id:{i}", lp) for i, _, lp in row] for row in tops]
        return [f"token_id:{i}" for i in token_ids], named_tops

    def message_parts(self, t: Trajectory) -> tuple[str | None, list[dict[str, Any]]]:
        """The assistant message's content and tool calls (parsed by the worker, or forced by tool_choice)."""
        if self.forced_tool is not None:
            call = {
                "id": tool_call_id(),
                "type": "function",
                "function": {"name": self.forced_tool, "arguments": t.text},
            }
            return None, [call]
        if self.required_tools:
            try:
                items = json.loads(t.text)
                calls = [
                    {
                        "id": tool_call_id(),
                        "type": "function",
                        "function": {"name": item["name"], "arguments": json.dumps(item.get("parameters", {}))},
                    }
                    for item in items
                ]
                return None, calls
            except (ValueError, TypeError, KeyError):  # cut short (length): the text as it is
                return t.text, []
        if t.tool_calls:
            return t.content, list(t.tool_calls)
        return t.text, []

    # --- stream chunks ----------------------------------------------------------------------------------

    def chunk(self, choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", choices)
        if usage_body is not None:
            body["usage"] = usage_body
        return body

    def role_chunk(self, indices: range) -> dict[str, Any]:
        """The first chunk of a chat stream: each choice's assistant role, empty content."""
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in indices
        ]
        return self.chunk(choices)

    def delta_choice(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: list[float],
        tokens: list[str] | None,
        tops: list[list[tuple[int, str, float]]] | None,
        finish_reason: str | None = None,
        extra_delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One choice of a stream chunk: the text (and tokens) it adds."""
        if self.kind == "text":
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
            if self.logprobs and token_ids:
                choice["logprobs"] = text_logprobs(token_ids, logprobs, *self.named(token_ids, tokens, tops))
        else:
            delta: dict[str, Any] = {"content": text} if text or not extra_delta else {}
            delta.update(extra_delta or {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if self.logprobs and token_ids:
                named, named_tops = self.named(token_ids, tokens, tops)
                choice["logprobs"] = {"content": chat_logprobs(logprobs, named, named_tops, self.top_logprobs)}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice


class StreamState:
    """What one choice of a stream has sent: tokens by offset, and their text (what the final trajectory adds to)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.text = ""

    def take(self, chunk: TrajectoryChunk) -> bool:
        """Keep a chunk that goes on exactly where the stream is (a retry may repeat or skip tokens)."""
        if chunk.offset != self.tokens or not chunk.token_ids:
            return False
        self.tokens += len(chunk.token_ids)
        self.text += chunk.text
        return True

    def rest(self, t: Trajectory) -> tuple[str, slice]:
        """The text and the token slice of a final trajectory that the stream has not sent yet."""
        text = t.text[len(self.text) :] if t.text.startswith(self.text) else ""
        return text, slice(self.tokens, None)


def usage(trajectories: list[Trajectory], prompt_indices: list[int]) -> dict[str, Any]:
    """OpenAI's usage: each prompt's tokens once (n samples share it), every completion's tokens, and of the prompt
    tokens those the engine found in its prefix cache (`prompt_tokens_details.cached_tokens`, as OpenAI's and vLLM's
    servers give it; per prompt, its first sample's)."""
    prompts: dict[int, tuple[int, int]] = {}
    for t, p in zip(trajectories, prompt_indices, strict=True):
        prompts.setdefault(p, (len(t.prompt_token_ids), t.cached_tokens))
    prompt_tokens = sum(n for n, _ in prompts.values())
    completion_tokens = sum(len(t.completion_token_ids) for t in trajectories)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(cached for _, cached in prompts.values())},
    }


def chat_logprobs(
    logprobs: list[float], tokens: list[str] | None, tops: list[list[tuple[int, str, float]]] | None, k: int
) -> list[dict[str, Any]]:
    """Chat `logprobs.content`: per token `{"token", "logprob", "bytes", "top_logprobs": [...]}`."""
    texts = tokens or [""] * len(logprobs)
    rows = []
    for i, (text, logprob) in enumerate(zip(texts, logprobs, strict=False)):
        top = tops[i][:k] if tops and i < len(tops) else []
        rows.append(
            {
                "token": text,
                "logprob": _finite(logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": s, "logprob": _finite(lp), "bytes": list(s.encode())} for _, s, lp in top],
            }
        )
    return rows


def text_logprobs(
    token_ids: list[int],
    logprobs: list[float],
    tokens: list[str] | None,
    tops: list[list[tuple[int, str, float]]] | None,
) -> dict[str, Any]:
    """Completions `logprobs`: `tokens`, `token_logprobs`, `top_logprobs` (per position, {token: logprob} of the
    sampled token, then the top k: vLLM's `_create_completion_logprobs`, so `logprobs: 0` gives the sampled token's
    alone), `text_offset` (each token's character offset in the completion)."""
    texts = tokens or [""] * len(token_ids)
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    rows = tops or [[] for _ in texts]
    return {
        "tokens": texts,
        "token_logprobs": [_finite(lp) for lp in logprobs],
        "top_logprobs": [
            {text: _finite(lp)} | {s: _finite(top) for _, s, top in row}
            for text, lp, row in zip(texts, logprobs, rows, strict=False)
        ],
        "text_offset": offsets,
    }


def prompt_logprobs(t: Trajectory) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` of a choice: per prompt position, None at the first (nothing comes before it), else
    {token id as text: {"logprob", "rank", "decoded_token"}}, the prompt token's first, then the top k."""
    if t.prompt_logprobs is None:
        return None
    rows: list[dict[str, dict[str, Any]] | None] = []
    for position in t.prompt_logprobs:
        entries = {str(i): {"logprob": _finite(lp), "rank": rank, "decoded_token": s} for i, s, lp, rank in position}
        rows.append(entries or None)
    return rows


def _finite(value: float) -> float:
    """JSON has no -inf: vLLM's server clamps to -9999.0 as well."""
    return max(value, -9999.0) if value == value else -9999.0
