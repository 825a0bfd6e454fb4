"""A request longer than every live worker's context is refused at submission, not taken by a worker and failed.

The live workers' heartbeats say each engine's context (`WorkerStatus.max_model_len`, as vLLM resolved it); the
longest of them is read at most every `REFRESH_S` per producer, not per request, so the Redis work per request stays
the same. A prompt of token ids longer than that is answered at once as vLLM's server answers it (an
`invalid_request` error naming both lengths); a text or chat prompt is tokenized by the worker, which refuses it
there. While no worker is live (or none has said its context), nothing is refused: the request waits in the queue.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from rollout_svc.protocol import ErrorResult, Request, RolloutRequest, WorkerStatus

REFRESH_S = 5.0


class ContextLimit:
    """The longest context of a live worker (`read`: the live workers), at most `REFRESH_S` old."""

    def __init__(self, read: Callable[[], Awaitable[list[WorkerStatus]]]) -> None:
        self._read = read
        self._longest = 0
        self._read_at = -REFRESH_S

    async def longest(self) -> int:
        """Tokens of the longest context a live worker runs (0: none known)."""
        if time.monotonic() - self._read_at >= REFRESH_S:
            self._longest = max((w.max_model_len for w in await self._read()), default=0)
            self._read_at = time.monotonic()
        return self._longest


def too_long(request: Request, longest: int) -> ErrorResult | None:
    """The refusal of `request` if its prompt of token ids (with what a continuation already generated) is longer
    than `longest` tokens (0: none known), as vLLM refuses it; None otherwise."""
    if not longest or not isinstance(request, RolloutRequest) or request.prompt_token_ids is None:
        return None
    tokens = len(request.prompt_token_ids) + (len(request.continuation.token_ids) if request.continuation else 0)
    if tokens <= longest:
        return None
    return ErrorResult(
        request_id=request.request_id,
        code="invalid_request",
        message=f"the prompt has {tokens} tokens, more than the longest context of any live worker ({longest} "
        "tokens, its max_model_len): shorten the prompt, or start workers with a longer --max-model-len",
    )
