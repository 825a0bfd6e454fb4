"""The tokenizer calls of `RolloutClient` (tokenize, chat template, detokenize): served by a worker's tokenizer, so the
client needs none. A mixin: `RolloutClient` gives it its connection, request building and call running."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from rollout_svc.client.connection import Connection
from rollout_svc.errors import GenerationError
from rollout_svc.protocol import DetokenizeRequest, ErrorResult, Request, TokenizeRequest, TokenizeResult

T = TypeVar("T", bound=Request)


class TokenCalls:
    """What `RolloutClient` asks of a worker's tokenizer."""

    async def _connect(self) -> Connection:
        raise NotImplementedError  # RolloutClient's

    def _build(self, cls: type[T], index: int, timeout_s: float | None, connection: Connection, **fields: Any) -> T:
        raise NotImplementedError  # RolloutClient's

    async def _run(self, requests: Sequence[Request], timeout_s: float | None) -> list[Any]:
        raise NotImplementedError  # RolloutClient's

    async def tokenize(
        self, texts: Sequence[str], add_special_tokens: bool = True, *, timeout_s: float | None = None
    ) -> list[list[int]]:
        """Token ids of each text, from a worker's tokenizer (the client needs none). Served while paused."""
        connection = await self._connect()
        requests = [
            self._build(TokenizeRequest, i, timeout_s, connection, text=t, add_special_tokens=add_special_tokens)
            for i, t in enumerate(texts)
        ]
        return [r.token_ids for r in await self._token_results(requests, timeout_s)]

    async def apply_chat_template(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> list[list[int]]:
        """Prompt token ids of each conversation under the model's chat template, with a generation prompt (unless
        `chat_template_kwargs` says otherwise: `add_generation_prompt`, `continue_final_message`, `chat_template`).
        `tools`: OpenAI's function tools, for the template."""
        connection, template = await self._connect(), {"tools": tools, "chat_template_kwargs": chat_template_kwargs}
        requests = [
            self._build(TokenizeRequest, i, timeout_s, connection, messages=list(c), **template)
            for i, c in enumerate(conversations)
        ]
        return [r.token_ids for r in await self._token_results(requests, timeout_s)]

    async def detokenize(
        self, token_ids: Sequence[Sequence[int]], skip_special_tokens: bool = True, *, timeout_s: float | None = None
    ) -> list[str]:
        """Text of each list of token ids, from a worker's tokenizer."""
        connection = await self._connect()
        requests = [
            self._build(
                DetokenizeRequest, i, timeout_s, connection, token_ids=list(t), skip_special_tokens=skip_special_tokens
            )
            for i, t in enumerate(token_ids)
        ]
        return [r.text for r in await self._token_results(requests, timeout_s)]

    async def _token_results(self, requests: Sequence[Request], timeout_s: float | None) -> list[TokenizeResult]:
        results = await self._run(requests, timeout_s)
        for result in results:
            if isinstance(result, ErrorResult):
                raise GenerationError(result.request_id, result.code, result.message, result.recoverable)
        return results
