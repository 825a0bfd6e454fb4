"""What a worker served, summed since it started: carried by its heartbeat (`WorkerStatus`), so that whoever reads
two heartbeats (the dashboard, `rollout-svc top`) has its rates between them without scraping the worker."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class ServedTotals:
    """Running sums: `served` (generations run on the engine, aborted ones included), `generated_tokens` (tokens this
    worker generated, a continuation's earlier ones not again) over
    `generation_s` (seconds its generations ran on the engine, `Trajectory.generation_time_s`): time per output
    token is the ratio of their differences. `first_token_s` over `first_tokens`: a streamed request's time to first
    token, from its submission to its first chunk sent (what a streaming caller waits; a request that is not streamed
    has no first token before its answer)."""

    served: int = 0
    generated_tokens: int = 0
    generation_s: float = 0.0
    first_tokens: int = 0
    first_token_s: float = 0.0

    def generated(self, tokens: int, seconds: float) -> None:
        """A generation ran: `tokens` new tokens in `seconds` on the engine."""
        self.served += 1
        self.generated_tokens += tokens
        self.generation_s += max(0.0, seconds)

    def first_token(self, submitted_at: float, now: float | None = None) -> None:
        """A streamed request's first tokens went out; `submitted_at`: its submission, unix s."""
        self.first_tokens += 1
        self.first_token_s += max(0.0, (time.time() if now is None else now) - submitted_at)
