"""One caller's batch of requests (a `Call`): a record per position (`Position`), results as they finish; the merge
of a retried request's attempts into one trajectory; what a connection has seen (`ClientStats`)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_svc import tracing
from rollout_svc.protocol import Request, RolloutRequest, Trajectory, TrajectoryChunk


@dataclass
class ClientStats:
    """What a connection has seen. `duplicates`: results no caller awaited (an at-least-once redelivery, or the
    answer to a cancelled request); `retries`: token-exact resubmissions; `cancelled`: requests cancelled;
    `regenerated`: trajectories dropped as staler than `max_staleness` and generated again (`stale_tokens`: the
    tokens they had, generated and then discarded; the goal is 0, which the workers' bound checks keep near);
    `staleness`: how many
    trajectories arrived at each staleness (committed weight version at receipt minus their first token's);
    `redis_changes`: times Redis restarted or failed over under this connection; `resubmitted`: requests sent again
    because Redis no longer held them then."""

    duplicates: int = 0
    retries: int = 0
    redis_changes: int = 0
    resubmitted: int = 0
    cancelled: int = 0
    regenerated: int = 0
    stale_tokens: int = 0
    staleness: Counter[int] = field(default_factory=Counter)


class GroupTarget:
    """A completion target over a call's requests: met once `fraction` of its groups finished (every request of the
    group answered, whatever its finish reason). Requests without a `group_id` are groups of one; requests sharing
    one are a group (`sample`'s n samples of a prompt, or members of a group carried over from an earlier call).
    The number of groups needed is `ceil(fraction x groups)`, at least 1."""

    def __init__(self, requests: Sequence[Request], fraction: float) -> None:
        self._group_of: list[str] = []
        sizes: Counter[str] = Counter()
        for index, request in enumerate(requests):
            group = getattr(request, "group_id", None) or f"#{index}"
            self._group_of.append(group)
            sizes[group] += 1
        self._left = dict(sizes)
        self.needed = max(1, math.ceil(fraction * len(sizes) - 1e-9))
        self.complete = 0

    @property
    def reached(self) -> bool:
        return self.complete >= self.needed

    def finished(self, index: int) -> None:
        group = self._group_of[index]
        self._left[group] -= 1
        if self._left[group] == 0:
            self.complete += 1


@dataclass(slots=True)
class Position:
    """One position of a call. `request`: the caller's. `attempt_id`: the request id it is awaited under now (a
    retry or a regeneration has a new one). `partial`: what its last aborted attempt returned, being continued.
    `spent_s`: the (queue, generation) seconds of the earlier attempts it continues. `regenerations`: times it was
    dropped as staler than `max_staleness` and generated again (`stale_tokens`: the tokens those dropped).
    `cutting`: cut by a completion target (its answer is final). `result`: its answer, None until it came."""

    request: Request
    attempt_id: str
    partial: Trajectory | None = None
    spent_s: tuple[float, float] = (0.0, 0.0)
    regenerations: int = 0
    stale_tokens: int = 0
    cutting: bool = False
    result: Any = None


class Call:
    """One caller's batch of requests (a generate / sample / chat / tokenize call): a `Position` record each.

    `completed` yields positions as they finish; `done` resolves when all have. With `chunks`, `events` also yields
    `(position, TrajectoryChunk)` for streaming requests, as they arrive, and `(position, None)` when a position
    finished.
    """

    def __init__(self, requests: Sequence[Request], loop: asyncio.AbstractEventLoop, chunks: bool = False) -> None:
        self.positions = [Position(request, request.request_id) for request in requests]
        self.span: Any = None  # `rollout.call` where traced: the parent of its requests' spans (`rollout_svc.tracing`)
        if tracing.enabled() and requests and isinstance(requests[0], RolloutRequest):
            self._traced()
        self.remaining = len(self.positions)
        self.done: asyncio.Future[None] = loop.create_future()
        if not self.positions:
            self.done.set_result(None)
        self._completed: asyncio.Queue[int] | None = None  # made on first use: most calls never read it
        self.events: asyncio.Queue[tuple[int, TrajectoryChunk | None]] | None = asyncio.Queue() if chunks else None
        self.target: GroupTarget | None = None
        self.on_target: Callable[[], None] | None = None

    def _traced(self) -> None:
        """Start `rollout.call` under this context's span, and carry its `traceparent` in every request it sends
        that carries none (a named step attached again keeps its first call's)."""
        self.span = tracing.start("rollout.call", **{"rollout.requests": len(self.positions)})
        parent = tracing.traceparent(self.span)
        for position in self.positions:
            request = position.request
            if isinstance(request, RolloutRequest) and request.traceparent is None:
                position.request = request.model_copy(update={"traceparent": parent})

    @property
    def requests(self) -> list[Request]:
        """The caller's requests, in order."""
        return [position.request for position in self.positions]

    @property
    def results(self) -> list[Any]:
        """Each position's answer (None where none came yet), in order."""
        return [position.result for position in self.positions]

    def watch(self, target: GroupTarget, reached: Callable[[], None]) -> None:
        """Call `reached()` once, when `target` is met (now, if it is already)."""
        self.target, self.on_target = target, reached
        for index in self.finished():
            target.finished(index)
        self._check_target()

    def _check_target(self) -> None:
        if self.on_target is not None and self.target is not None and self.target.reached:
            reached, self.on_target = self.on_target, None
            reached()

    @property
    def completed(self) -> asyncio.Queue[int]:
        """The positions, as they finish (those finished before the first look first)."""
        if self._completed is None:
            self._completed = asyncio.Queue()
            for index in self.finished():
                self._completed.put_nowait(index)
        return self._completed

    def chunk(self, index: int, chunk: TrajectoryChunk) -> None:
        if self.events is not None and self.positions[index].result is None:
            self.events.put_nowait((index, chunk))

    def set(self, index: int, result: Any) -> None:
        position = self.positions[index]
        if position.result is not None:
            return
        position.result = result
        self.remaining -= 1
        if self.span is not None:
            self._traced_result(position, result)
        if self._completed is not None:
            self._completed.put_nowait(index)
        if self.events is not None:
            self.events.put_nowait((index, None))
        if self.target is not None:
            self.target.finished(index)
            self._check_target()
        if self.remaining == 0 and not self.done.done():
            self.done.set_result(None)

    def _traced_result(self, position: Position, result: Any) -> None:
        """`rollout.result`: a position's answer reached its caller; the call's span ends with its last."""
        request = position.request
        parent = request.traceparent if isinstance(request, RolloutRequest) else None
        tags = {"rollout.request_id": request.request_id, "rollout.worker_id": getattr(result, "worker_id", None)}
        tracing.record("rollout.result", parent, time.time(), None, **tags, **_finish_tags(result))
        if self.remaining == 0:
            self.span.end()

    def close(self) -> None:
        """The call is over, answered or not (expired, or its caller gone): its span ends if it has not."""
        if self.span is not None and self.span.is_recording():
            self.span.set_attribute("rollout.unanswered", self.remaining)
            self.span.end()

    def finished(self) -> list[int]:
        return [i for i, position in enumerate(self.positions) if position.result is not None]

    def unfinished(self) -> list[int]:
        return [i for i, position in enumerate(self.positions) if position.result is None]

    def renew(self, index: int, request_id: str, partial: Trajectory | None, discarded: int = 0) -> None:
        """Await position `index` under a new attempt, `request_id`: a retry that continues `partial` (what the last
        attempt returned; its times count towards the position's), or, `partial` None, a regeneration, which starts
        over (the times so far are dropped, and the `discarded` tokens made so far) and counts in `regenerations`."""
        position = self.positions[index]
        position.attempt_id, position.partial = request_id, partial
        if partial is None:
            position.spent_s = (0.0, 0.0)
            position.regenerations += 1
            position.stale_tokens += discarded
            return
        queue_s, generation_s = position.spent_s
        position.spent_s = (queue_s + partial.queue_time_s, generation_s + partial.generation_time_s)

    def merged(self, index: int, result: Trajectory, **update: Any) -> Trajectory:
        """An attempt's trajectory as the caller sees it: under the original request id, queue and generation times
        summed over the attempts it continues (`renew`), `update` applied."""
        position = self.positions[index]
        if not update and position.partial is None and result.request_id == position.request.request_id:
            return result  # the request's own answer (the common case: no copy)
        queue_s, generation_s = position.spent_s
        update = {
            "request_id": position.request.request_id,
            "queue_time_s": queue_s + result.queue_time_s,
            "generation_time_s": generation_s + result.generation_time_s,
            **update,
        }
        return result.model_copy(update=update)

    def end_with_partial(self, index: int, **update: Any) -> None:
        """Finish a position being retried with the partial trajectory its last attempt returned."""
        position = self.positions[index]
        partial = position.partial
        assert partial is not None
        queue_s, generation_s = position.spent_s  # the partial's own times are in these already
        update = {
            "request_id": position.request.request_id,
            "queue_time_s": queue_s,
            "generation_time_s": generation_s,
            "interruptions": partial.interruptions + 1,
            **update,
        }
        self.set(index, partial.model_copy(update=update))

    def expire(self) -> None:
        """The caller's deadline passed: a position being retried ends with its partial tokens (abort, deadline)."""
        for index in self.unfinished():
            if self.positions[index].partial is not None:
                self.end_with_partial(index, abort_cause="deadline")


def _finish_tags(result: Any) -> dict[str, Any]:
    if isinstance(result, Trajectory):
        return {"rollout.finish_reason": result.finish_reason, "rollout.tokens": len(result.completion_token_ids)}
    return {"rollout.error": getattr(result, "code", None)}
