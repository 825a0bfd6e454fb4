"""`/v1/chat/completions` and `/v1/completions`: a plan (`rollout_svc.openai.plans`) run through `RolloutClient`.

A streaming request makes its workers send their tokens a few at a time; the response streams them as server-sent
events in OpenAI's chunk format, ending with `data: [DONE]`. A client that goes away cancels its requests (queued or
in flight) on the workers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.openai.errors import APIError, from_exception
from rollout_svc.openai.plans import Plan, raise_for
from rollout_svc.openai.render import Reply, StreamState, sse, usage
from rollout_svc.protocol import Trajectory, TrajectoryChunk

T = TypeVar("T")


# --- running a plan ---------------------------------------------------------------------------------------


class Generation:
    """Runs plans on one `RolloutClient` for one app; `metrics` (an `ApiMetrics`, or None) counts tokens."""

    def __init__(self, client: RolloutClient, metrics: Any, timeout_s: float) -> None:
        self.client, self.metrics, self.timeout_s = client, metrics, timeout_s
        self.client_for: Callable[[str], RolloutClient] = lambda _: client  # a named model's client (`served.py`)

    def events(self, plan: Plan) -> AsyncGenerator[tuple[int, TrajectoryChunk | Trajectory], None]:
        """The plan's requests sent: `(index, TrajectoryChunk)` as tokens come (where `plan.chunks`), then `(index,
        Trajectory)` per prompt (`RolloutClient.stream`)."""
        sessions = [plan.session_id] * len(plan.prompts) if plan.session_id else None
        return self.client_for(plan.model_name).stream(
            plan.prompts,
            plan.params,
            sessions,
            chunks=plan.stream and plan.chunks,
            group_ids=plan.group_ids,
            adapter=plan.adapter,
            timeout_s=self.timeout_s,
            request_ids=plan.request_ids,
            **plan.template_options(),
        )

    async def respond(self, request: Request, plan: Plan) -> Response:
        """Run a plan: a JSON response, or a stream (whose first event has arrived before the headers go)."""
        if plan.stream:
            return await self._stream(request, plan)
        results: list[Trajectory | None] = [None] * len(plan.prompts)

        async def collect() -> None:
            async for index, event in self.events(plan):
                if isinstance(event, Trajectory):
                    results[index] = event

        await until_disconnected(request, collect())
        trajectories = [t for t in results if t is not None]
        for t in trajectories:
            raise_for(t)
        self.count(trajectories, plan)
        body = plan.reply.response(trajectories, plan.prompt_indices)
        return JSONResponse(body, headers=worker_header(trajectories))

    async def open_stream(
        self, request: Request, plan: Plan
    ) -> tuple[
        tuple[int, TrajectoryChunk | Trajectory] | None, AsyncGenerator[tuple[int, TrajectoryChunk | Trajectory], None]
    ]:
        """The plan's events once the first has arrived (None: nothing to generate), its time to first token
        observed, so that an error before it is an HTTP error: raises `APIError` (for a first trajectory that
        failed, a client gone away) with the requests cancelled."""
        started = time.perf_counter()
        events = self.events(plan)
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
        return first, events

    async def _stream(self, request: Request, plan: Plan) -> Response:
        first, events = await self.open_stream(request, plan)
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
            self.count(done, plan)
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

    def count(self, trajectories: list[Trajectory], plan: Plan) -> None:
        if self.metrics is not None and trajectories:
            counted = usage(trajectories, plan.prompt_indices[: len(trajectories)])
            self.metrics.count_tokens(counted["prompt_tokens"], counted["completion_tokens"])


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
