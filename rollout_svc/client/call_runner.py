"""What one call does over a producer's connection (`CallRunner`): the requests a `RequestBuilder` made, submitted,
awaited within the call's budget, cut once its completion target is met, and however it ends, its unfinished
requests cancelled on the workers (`client.connection` says how the connection does each)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from rollout_svc.client.calls import Call, GroupTarget, Position
from rollout_svc.client.connection import NO_TARGET, Connection, RequestBuilder, Target
from rollout_svc.client.lifecycle import error_trajectory
from rollout_svc.errors import GenerationError, RequestTimeoutError
from rollout_svc.protocol import ErrorResult, Request, RolloutRequest, Trajectory, TrajectoryChunk


class CallRunner:
    """Runs a caller's calls: a `Call` of the requests a `RequestBuilder` made, submitted on its connection, awaited
    within its budget, cut once its completion target is met; however a call ends, its unfinished requests are
    cancelled on the workers. `last_step`: the last call of rollout requests, its start and end (unix s)."""

    def __init__(self) -> None:
        self.last_step: tuple[Call, float, float] | None = None

    async def run(
        self,
        build: RequestBuilder,
        requests: Sequence[Request],
        raise_on_error: bool,
        target: Target = NO_TARGET,
        enqueued: bool = False,
        attempt_ids: Sequence[str] | None = None,
    ) -> list[Any]:
        """Every request's answer, in order: a trajectory (an error result as one with `finish_reason="error"`, or
        `GenerationError` with `raise_on_error`), or a tokenizer result. `enqueued`: do not send them, only await
        them (`Connection.attach`), each position under its id in `attempt_ids` where given (a named step's
        latest attempts). Raises `QueueFullError`, `RequestTimeoutError` (positions being retried end with
        their partial tokens first: `Call.expire`), or the Redis error."""
        if not requests:
            return []
        connection = build.connection
        call, started, timer = Call(requests, connection.loop), time.time(), None
        for position, attempt_id in zip(call.positions, attempt_ids or (), strict=False):
            position.attempt_id = attempt_id
        try:
            if enqueued:
                connection.attach(call)
            else:
                await connection.submit(call)
            timer = _watch(connection, call, target)
            deadline = connection.loop.call_later(build.budget_s, _resolve, call.done)  # wakes this caller in time
            try:
                await call.done  # not asyncio.wait: one loop iteration less between the last result and the caller
            finally:
                deadline.cancel()
            if call.remaining:
                call.expire()
            if call.remaining:
                raise _late(call, build.budget_s)
            # An answer that is not an error result goes to the caller as it is.
            return [
                p.result if not isinstance(p.result, ErrorResult) else _answer_of(p, raise_on_error)
                for p in call.positions
            ]
        finally:
            if timer is not None:
                timer.cancel()
            connection.release(call)
            call.close()
            if isinstance(requests[0], RolloutRequest):
                self.last_step = (call, started, time.time())

    async def events(
        self,
        build: RequestBuilder,
        requests: list[RolloutRequest],
        raise_on_error: bool,
        chunks: bool,
        target: Target = NO_TARGET,
    ) -> AsyncIterator[tuple[int, TrajectoryChunk | Trajectory]]:
        """Submit `requests` and yield `(index, chunk)` (with `chunks`) and `(index, trajectory)` as they arrive
        (answers as `run`'s). On timeout it yields what finished (retried requests with their partial tokens), then
        raises `RequestTimeoutError`."""
        connection = build.connection
        call, started, timer = Call(requests, connection.loop, chunks), time.time(), None
        # With chunks every event (chunks, then each position's end) comes through `call.events`, else through
        # `call.completed`: one queue, so nothing is yielded twice.
        queue: asyncio.Queue[Any] = call.events if call.events is not None else call.completed
        finished = 0
        try:
            await connection.submit(call)
            timer = _watch(connection, call, target)
            deadline = time.monotonic() + build.budget_s
            while finished < len(requests):
                try:
                    event = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    call.expire()
                    while not queue.empty():
                        index, chunk = _event(queue.get_nowait())
                        if chunk is None:
                            yield index, _answer_of(call.positions[index], raise_on_error)
                    if call.remaining:  # as `run`: positions that ended with their partial tokens are answers
                        raise _late(call, build.budget_s) from None
                    return
                index, chunk = _event(event)
                if chunk is not None:
                    yield index, chunk
                else:
                    finished += 1
                    yield index, _answer_of(call.positions[index], raise_on_error)
        finally:
            if timer is not None:
                timer.cancel()
            connection.release(call)
            call.close()
            self.last_step = (call, started, time.time())


def _watch(connection: Connection, call: Call, target: Target) -> asyncio.TimerHandle | None:
    """Cut `call` once `target` (completion target, cut after s) is met; returns the timer to cancel, if any."""
    fraction, after_s = target
    if fraction is not None:
        call.watch(GroupTarget(call.requests, fraction), lambda: connection.cut(call))
    return None if after_s is None else connection.loop.call_later(after_s, connection.cut, call)


def _answer_of(position: Position, raise_on_error: bool) -> Any:
    """A position's answer as its caller gets it: an error result as a trajectory with `finish_reason="error"`, or
    `GenerationError` with `raise_on_error`; any other as it is."""
    result = position.result
    if not isinstance(result, ErrorResult):
        return result
    if raise_on_error:
        raise GenerationError(result.request_id, result.code, result.message, result.recoverable)
    assert isinstance(position.request, RolloutRequest)
    return error_trajectory(position.request, result)


def _late(call: Call, timeout_s: float) -> RequestTimeoutError:
    late = [call.positions[i].request.request_id for i in call.unfinished()]
    completed = {p.request.request_id: p.result for p in call.positions if p.result is not None}
    return RequestTimeoutError(late, timeout_s, completed)


def _event(event: int | tuple[int, TrajectoryChunk | None]) -> tuple[int, TrajectoryChunk | None]:
    """An entry of `Call.completed` (a position that finished) or `Call.events`, as `(position, chunk or None)`."""
    return (event, None) if isinstance(event, int) else event


def _resolve(done: asyncio.Future[None]) -> None:
    """A call's deadline: wake its caller, which then expires what did not finish."""
    if not done.done():
        done.set_result(None)
