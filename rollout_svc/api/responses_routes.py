"""OpenAI's Responses API: `POST /v1/responses` (streaming too), `GET` and `DELETE /v1/responses/{id}`, `POST
/v1/responses/{id}/cancel`.

A turn is a chat plan (`rollout_svc.openai.responses`) run through `RolloutClient` like a chat completion; a stored
response lives in Redis (`api.response_store`), so a conversation continues by `previous_response_id` through any
`serve` replica, and its turns are one session: sticky to one worker, whose prefix cache holds the conversation (a
worker that died hands the session to another, which prefills it anew). The request id of a turn's generation is
its response id, so a cancel from any replica aborts it fleet-wide (`RolloutClient.abort`). Our fields, as on chat:
`weight_version` and `worker_id` on each response, the `X-Worker-ID` header, `X-Session-ID` (else the first
response's id names the session).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollout_svc.api.generation import Generation, until_disconnected, worker_header
from rollout_svc.api.response_store import ResponseStore
from rollout_svc.api.served import ServedModels, session_header
from rollout_svc.openai.errors import APIError, from_exception
from rollout_svc.openai.plans import raise_for
from rollout_svc.openai.render import StreamState
from rollout_svc.openai.responses import Turn, input_messages, message_item, new_id, output_text_part
from rollout_svc.openai.responses_schemas import ResponsesRequest
from rollout_svc.protocol import Trajectory, TrajectoryChunk

Events = AsyncGenerator[tuple[int, TrajectoryChunk | Trajectory], None]


def responses_router(
    served: ServedModels, generation: Generation, store: ResponseStore, default_max_tokens: int
) -> APIRouter:
    router = APIRouter()
    runs = TurnRuns(generation, store)

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API (`openai.responses.create` and `.stream`): a turn of a conversation, stored in
        Redis unless `store` is false."""
        target = await served.resolve(body.model)
        history: list[dict[str, Any]] = []
        session = session_header(request, body.session_id)
        if body.previous_response_id is not None:
            previous = await store.get(body.previous_response_id)
            history, session = previous["conversation"], session or previous["session_id"]
        response_id = new_id("resp")
        new = input_messages(body.input)
        turn = Turn(body, target.name, history, new, session or response_id, default_max_tokens, id=response_id)
        turn.plan.adapter, turn.plan.model_name, turn.plan.request_ids = target.adapter, target.model_name, [turn.id]
        if body.stream:
            return await runs.stream(request, turn)
        return await runs.respond(request, turn)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        """A stored response as it stands (in_progress while it is generated)."""
        response: dict[str, Any] = (await store.get(response_id))["response"]
        return response

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Delete a stored response (a conversation cannot continue from it after)."""
        if not await store.delete(response_id):
            raise store.not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        """Cancel a response being generated, through whichever replica runs it: its request is aborted
        fleet-wide, and it ends `cancelled` with the tokens made so far. 400 for one that already ended (vLLM's
        answer), 404 for one not stored."""
        record = await store.get(response_id)
        status = record["response"]["status"]
        if status not in ("queued", "in_progress"):
            raise APIError(400, f"Cannot cancel a response that is {status}: only one in progress", param="response_id")
        await served.client_for(record.get("model_name", "")).abort(record["request_ids"])
        await store.set_status(response_id, "cancelled")
        response: dict[str, Any] = {**record["response"], "status": "cancelled"}
        return response

    return router


class TurnRuns:
    """Runs turns: a JSON response, or the Responses event stream; writes each stored turn's record."""

    def __init__(self, generation: Generation, store: ResponseStore) -> None:
        self.generation, self.store = generation, store

    async def _record(self, turn: Turn, response: dict[str, Any], t: Trajectory | None, output: list[Any]) -> None:
        if not turn.body.store:
            return
        record = {
            "response": response,
            "conversation": turn.answered(output) if t is not None else turn.conversation,
            "input": turn.new,
            "prompt_token_ids": t.prompt_token_ids if t is not None else [],
            "session_id": turn.session_id,
            "model_name": turn.plan.model_name,
            "request_ids": turn.plan.request_ids or [],
        }
        await self.store.put(turn.id, record)

    async def _finish(self, turn: Turn, t: Trajectory) -> dict[str, Any]:
        """The response of a finished trajectory (raises `APIError` for a failed one), recorded."""
        try:
            raise_for(t)
        except APIError as exc:
            await self._failed(turn, exc)
            raise
        output = turn.output_items(t)
        response = turn.response(t, output, turn.status_of(t))
        await self._record(turn, response, t, output)
        self.generation.count([t], turn.plan)
        return response

    async def _failed(self, turn: Turn, exc: APIError) -> None:
        failed = turn.response(None, [], "failed")
        failed["error"] = {"code": exc.code or "server_error", "message": exc.message}
        await self._record(turn, failed, None, [])

    async def respond(self, request: Request, turn: Turn) -> Response:
        await self._record(turn, turn.response(None, [], "in_progress"), None, [])
        final: list[Trajectory] = []

        async def collect() -> None:
            async for _, event in self.generation.events(turn.plan):
                if isinstance(event, Trajectory):
                    final.append(event)

        await until_disconnected(request, collect())
        return JSONResponse(await self._finish(turn, final[0]), headers=worker_header(final))

    async def stream(self, request: Request, turn: Turn) -> Response:
        """The event stream, once the first event has arrived (an error before it is an HTTP error)."""
        await self._record(turn, turn.response(None, [], "in_progress"), None, [])
        try:
            first, events = await self.generation.open_stream(request, turn.plan)
        except APIError as exc:
            await self._failed(turn, exc)
            raise
        assert first is not None  # a turn is one request
        headers = {"X-Worker-ID": first[1].worker_id} if first[1].worker_id else None
        return StreamingResponse(self._sse(turn, first, events), media_type="text/event-stream", headers=headers)

    async def _sse(
        self, turn: Turn, first: tuple[int, TrajectoryChunk | Trajectory], events: Events
    ) -> AsyncIterator[bytes]:
        """`response.created`, `response.in_progress`, the output items (text deltas as tokens come; function calls
        whole, as their arguments are made of the whole output), `response.completed`."""
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            body = {"type": kind, "sequence_number": next(sequence), **fields}
            return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()

        state, message_id = StreamState(), new_id("msg")
        try:
            yield event("response.created", response=turn.response(None, [], "in_progress"))
            yield event("response.in_progress", response=turn.response(None, [], "in_progress"))
            pending: list[tuple[int, TrajectoryChunk | Trajectory]] = [first]
            final: Trajectory | None = None
            while final is None:
                _, got = pending.pop() if pending else await anext(events)
                if isinstance(got, Trajectory):
                    final = got
                elif state.take(got):
                    if state.tokens == len(got.token_ids):  # the first text: the message item opens
                        for opening in _open_message(event, message_id):
                            yield opening
                    yield _delta(event, message_id, 0, got.text)
            raise_for(final)
            output = turn.output_items(final)
            if state.tokens:  # the message streamed: its id stays, and what the chunks did not carry follows
                output[0]["id"] = message_id
                rest, _ = state.rest(final)
                if rest:
                    yield _delta(event, message_id, 0, rest)
            for index, out in enumerate(output):
                for closing in _item_events(event, index, out, opened=bool(state.tokens) and index == 0):
                    yield closing
            response = turn.response(final, output, turn.status_of(final))
            await self._record(turn, response, final, output)
            self.generation.count([final], turn.plan)
            yield event("response.completed", response=response)
        except Exception as exc:  # headers are gone: the error is an event, as vLLM's server sends it
            error = from_exception(exc)
            await self._failed(turn, error)
            yield event("error", code=error.code or "server_error", message=error.message, param=error.param)
        finally:
            await events.aclose()  # cancels what has not finished (a client that went away)


def _open_message(event: Any, message_id: str, index: int = 0) -> list[bytes]:
    """What opens a message item: the item (no content yet), then its one `output_text` part (empty)."""
    item = {**message_item(message_id, "", "in_progress"), "content": []}
    part = output_text_part("")
    return [
        event("response.output_item.added", output_index=index, item=item),
        event("response.content_part.added", item_id=message_id, output_index=index, content_index=0, part=part),
    ]


def _delta(event: Any, item_id: str, index: int, text: str) -> bytes:
    """A `response.output_text.delta`: `text` added to the message item `item_id` (output `index`)."""
    return event(
        "response.output_text.delta", item_id=item_id, output_index=index, content_index=0, delta=text, logprobs=[]
    )


def _item_events(event: Any, index: int, item: dict[str, Any], opened: bool) -> list[bytes]:
    """The events that carry output item `index` whole (where its message is `opened` already: what closes it)."""
    out: list[bytes] = []
    if item["type"] == "message":
        part = item["content"][0]
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if not opened:
            out += _open_message(event, item["id"], index)
            if part["text"]:
                out.append(_delta(event, item["id"], index, part["text"]))
        out.append(event("response.output_text.done", **common, text=part["text"], logprobs=[]))
        out.append(event("response.content_part.done", **common, part=part))
    else:
        added = {**item, "arguments": "", "status": "in_progress"}
        out.append(event("response.output_item.added", output_index=index, item=added))
        common = {"item_id": item["id"], "output_index": index}
        out.append(event("response.function_call_arguments.delta", **common, delta=item["arguments"]))
        out.append(event("response.function_call_arguments.done", **common, arguments=item["arguments"]))
    out.append(event("response.output_item.done", output_index=index, item=item))
    return out
