"""RolloutClient: what a trainer (or any producer) uses to submit rollout requests and await trajectories."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollout_svc.config import Settings
from rollout_svc.errors import GenerationError, InvalidRequestError, ProtocolError, RequestTimeoutError
from rollout_svc.keys import PAYLOAD_FIELD
from rollout_svc.protocol import (
    ChatMessage,
    DetokenizeRequest,
    ErrorResult,
    Request,
    RolloutRequest,
    SamplingParams,
    TokenizeRequest,
    TokenizeResult,
    Trajectory,
    WorkerStatus,
    as_sampling_params,
    decode,
    encode,
)
from rollout_svc.registry import Registry
from rollout_svc.streams import RequestStreams

log = logging.getLogger("rollout_svc.client")
T = TypeVar("T")


class _Pending:
    """One submitted batch: its results by position; `done` resolves once every one is in."""

    __slots__ = ("done", "remaining", "results")

    def __init__(self, count: int, loop: asyncio.AbstractEventLoop) -> None:
        self.results: list[Any] = [None] * count
        self.remaining = count
        self.done: asyncio.Future[None] = loop.create_future()

    def set(self, index: int, result: Any) -> bool:
        """Record a result; False if that position already had one (a duplicate delivery)."""
        if self.results[index] is not None:
            return False
        self.results[index] = result
        self.remaining -= 1
        if self.remaining == 0 and not self.done.done():
            self.done.set_result(None)
        return True


class _Connection:
    """What a client holds while connected, bound to one event loop: Redis, its results stream, the reader."""

    def __init__(self, settings: Settings) -> None:
        self.loop = asyncio.get_running_loop()
        self.redis = Redis.from_url(settings.redis_url, decode_responses=False)
        self.streams = RequestStreams(self.redis, settings.keys, settings.session_ttl_s)
        self.registry = Registry(self.redis, settings.keys, settings.heartbeat_ttl_s)
        self.producer_id = uuid.uuid4().hex
        self.results = settings.keys.results(self.producer_id)
        self.waiting: dict[str, tuple[_Pending, int]] = {}  # request id -> its batch and position
        self._request_numbers = itertools.count()
        self.duplicates = 0
        self._block_ms = settings.read_block_ms
        self._closing = False
        self._max_queued = settings.max_queued_requests
        self.outbox: asyncio.Queue[tuple[list[tuple[str | None, bytes]], asyncio.Future[None]] | None]
        self.outbox = asyncio.Queue()
        self.reader = asyncio.create_task(self._read_results())
        self.submitter = asyncio.create_task(self._submit_batches())

    def new_id(self) -> str:
        """A request (or group) id unique across producers: this producer's id and a counter."""
        return f"{self.producer_id}-{next(self._request_numbers)}"

    def expect(self, request_ids: Sequence[str]) -> _Pending:
        """Register a batch of request ids whose results the reader should collect, in this order."""
        pending = _Pending(len(request_ids), self.loop)
        self.waiting.update((request_id, (pending, i)) for i, request_id in enumerate(request_ids))
        return pending

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.waiting.pop(request_id, None)

    async def enqueue(self, items: list[tuple[str | None, bytes]]) -> None:
        """Hand a batch to the submitter; raises its `QueueFullError` or Redis error."""
        done = self.loop.create_future()
        self.outbox.put_nowait((items, done))
        await done

    async def _submit_batches(self) -> None:
        """The single submitter: concurrent callers' batches go to Redis together, in one round trip.

        This bounds the connections a busy producer (the API, an open-loop benchmark) opens to two.
        """
        while True:
            waiting = [await self.outbox.get()]
            while not self.outbox.empty():
                waiting.append(self.outbox.get_nowait())
            ready = [w for w in waiting if w is not None]
            outcomes: list[Any]
            try:
                outcomes = await self.streams.enqueue_batches([items for items, _ in ready], self._max_queued)
            except Exception as exc:  # Redis away: every waiting caller hears it
                outcomes = [exc] * len(ready)
            for (_, done), outcome in zip(ready, outcomes, strict=True):
                if not done.done():
                    if isinstance(outcome, BaseException):
                        done.set_exception(outcome)
                    else:
                        done.set_result(None)
            if len(ready) < len(waiting):
                return

    async def _read_results(self) -> None:
        """The single reader: routes each result to its future by request id, ignores duplicates."""
        last_id, failures = b"0-0", 0
        done_ids: list[bytes] = []
        while not self._closing:
            try:
                records = await self.streams.read_results(self.results, last_id, done_ids, self._block_ms)
                done_ids, failures = [], 0
            except (RedisError, OSError) as exc:  # the reader must outlive any Redis trouble
                failures += 1
                log.warning("reading results failed (%s); retrying", exc)
                await asyncio.sleep(min(2.0, 0.1 * 2**failures))
                continue
            for entry_id, fields in records:
                last_id = entry_id
                done_ids.append(entry_id)
                self._route(fields.get(PAYLOAD_FIELD, b""))
            if records:
                await asyncio.sleep(0)  # let the callers just woken run before the next read is sent

    def _route(self, payload: bytes) -> None:
        try:
            result = decode(payload)
        except ProtocolError as exc:
            log.error("dropped an undecodable result: %s", exc)
            return
        waiting = self.waiting.get(result.request_id)
        if waiting is None or not waiting[0].set(waiting[1], result):
            self.duplicates += 1  # at-least-once delivery: a requeued request may answer twice

    async def close(self) -> None:
        # Let the reader finish its blocking read rather than cancel it: a pipeline cancelled mid-read
        # can leave redis-py waiting on a reply that never comes.
        self._closing = True
        self.outbox.put_nowait(None)
        _, pending = await asyncio.wait([self.reader, self.submitter], timeout=self._block_ms / 1000 + 5)
        for task in pending:
            task.cancel()
        try:
            await self.redis.delete(self.results)
        finally:
            await self.redis.aclose()


class RolloutClient:
    """Async client of the rollout service. Holds only its settings, so it pickles (to Ray actors, say).

    Example (start a local cluster first: `rollout-svc up --workers 2 --engine vllm`)::

        import asyncio
        from rollout_svc import RolloutClient

        async def main():
            async with RolloutClient(redis_url="redis://127.0.0.1:6379/0") as client:
                ids = await client.tokenize(["The capital of France is"])
                [trajectory] = await client.generate(ids, {"temperature": 0.0, "max_tokens": 8})
                print(trajectory.text, trajectory.logprobs, trajectory.worker_id)

        asyncio.run(main())

    Every call takes `timeout_s` (default `Settings.request_timeout_s`); past it, `RequestTimeoutError`.
    """

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        self.settings = settings.model_copy(update=overrides) if settings else Settings(**overrides)
        self._connection: _Connection | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings.model_dump(mode="json")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.settings = Settings.model_validate(state["settings"])
        self._connection = None

    async def __aenter__(self) -> RolloutClient:
        await self._connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the reader and delete this producer's results stream."""
        if self._connection is not None:
            connection, self._connection = self._connection, None
            await connection.close()

    async def _connect(self) -> _Connection:
        connection = self._connection
        if connection is None or connection.loop is not asyncio.get_running_loop():
            connection = self._connection = _Connection(self.settings)
            await connection.streams.load_scripts()
        return connection

    # --- generation -----------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        session_ids: Sequence[str | None] | None = None,
        *,
        group_ids: Sequence[str | None] | None = None,
        timeout_s: float | None = None,
        raise_on_error: bool = False,
    ) -> list[Trajectory]:
        """Generate one completion per prompt; returns trajectories in input order.

        Args:
            prompt_token_ids: B prompts, each a non-empty list of token ids.
            sampling_params: vLLM-named sampling params (a dict or `SamplingParams`), shared by all prompts.
            session_ids: None, or B session ids (None entries allowed): every request of one session
                is served by one worker (its KV cache stays warm) until `finish_session` or its TTL.
            group_ids: optional B group ids, carried through to the trajectories.
            timeout_s: per request, from submission; past it the request is dropped by the worker.
            raise_on_error: raise `GenerationError` on the first failed request instead of returning a
                trajectory with `finish_reason == "error"` for it.

        Raises:
            InvalidRequestError: bad prompts or sampling params (nothing was sent).
            QueueFullError: the requests stream is over its admission limit (nothing was sent).
            RequestTimeoutError: some requests got no result in time (`.completed` holds the rest).
        """
        params = as_sampling_params(sampling_params)
        sessions = _per_prompt(session_ids, len(prompt_token_ids), "session_ids")
        groups = _per_prompt(group_ids, len(prompt_token_ids), "group_ids")
        connection = await self._connect()
        requests = [
            self._rollout_request(
                i, params, timeout_s, connection, prompt_token_ids=list(p), session_id=sessions[i], group_id=groups[i]
            )
            for i, p in enumerate(prompt_token_ids)
        ]
        return await self._generate_all(requests, timeout_s, raise_on_error)

    async def sample(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        raise_on_error: bool = False,
    ) -> list[list[Trajectory]]:
        """Draw `n` samples of each prompt (a group): returns B lists of n trajectories, in input order.

        The n requests of a group share a `group_id` and spread over workers. With a `seed`, sample j
        uses `seed + j`, so the n samples differ (as vLLM's `n` does) and the call is reproducible.
        """
        if n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {n}")
        params = as_sampling_params(sampling_params)
        connection = await self._connect()
        requests = []
        for i, prompt in enumerate(prompt_token_ids):
            group_id = connection.new_id()
            for j in range(n):
                seeded = params if params.seed is None else params.model_copy(update={"seed": params.seed + j})
                requests.append(
                    self._rollout_request(
                        i, seeded, timeout_s, connection, prompt_token_ids=list(prompt), group_id=group_id
                    )
                )
        flat = await self._generate_all(requests, timeout_s, raise_on_error)
        return [flat[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    async def chat(
        self,
        conversations: Sequence[Sequence[dict[str, Any] | ChatMessage]],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        session_ids: Sequence[str | None] | None = None,
        *,
        timeout_s: float | None = None,
        raise_on_error: bool = False,
    ) -> list[Trajectory]:
        """Generate the next assistant turn of each conversation (OpenAI-style `{"role", "content"}` dicts).

        The worker applies the model's chat template; `Trajectory.prompt_token_ids` are the ids it used.
        Same errors as `generate`.
        """
        params = as_sampling_params(sampling_params)
        sessions = _per_prompt(session_ids, len(conversations), "session_ids")
        connection = await self._connect()
        requests = [
            self._rollout_request(i, params, timeout_s, connection, messages=list(c), session_id=sessions[i])
            for i, c in enumerate(conversations)
        ]
        return await self._generate_all(requests, timeout_s, raise_on_error)

    def _rollout_request(
        self, index: int, params: SamplingParams, timeout_s: float | None, connection: _Connection, **fields: Any
    ) -> RolloutRequest:
        return self._build(RolloutRequest, index, timeout_s, connection, sampling_params=params, **fields)

    def _build(self, cls: type[T], index: int, timeout_s: float | None, connection: _Connection, **fields: Any) -> T:
        """Validate one request before anything is sent. Raises `InvalidRequestError` naming its index."""
        now = time.time()
        timeout_s = self.settings.request_timeout_s if timeout_s is None else timeout_s
        try:
            return cls(  # type: ignore[call-arg]
                request_id=connection.new_id(),
                reply_to=connection.results,
                deadline=now + timeout_s,
                submitted_at=now,
                **fields,
            )
        except ValidationError as exc:
            raise InvalidRequestError(f"request {index} is invalid: {exc}") from exc

    async def _generate_all(
        self, requests: list[RolloutRequest], timeout_s: float | None, raise_on_error: bool
    ) -> list[Trajectory]:
        results = await self._submit(requests, timeout_s)
        trajectories = []
        for request, result in zip(requests, results, strict=True):
            if isinstance(result, ErrorResult):
                if raise_on_error:
                    raise GenerationError(result.request_id, result.code, result.message, result.recoverable)
                result = _error_trajectory(request, result)
            trajectories.append(result)
        return trajectories

    async def _submit(self, requests: Sequence[Request], timeout_s: float | None) -> list[Any]:
        """Enqueue a batch (pipelined, one script call per 1000) and await every result, in order."""
        if not requests:
            return []
        connection = await self._connect()
        timeout_s = self.settings.request_timeout_s if timeout_s is None else timeout_s
        request_ids = [r.request_id for r in requests]
        pending = connection.expect(request_ids)
        try:
            items = [(getattr(r, "session_id", None), encode(r)) for r in requests]
            await connection.enqueue(items)
            await asyncio.wait([pending.done], timeout=timeout_s)
            if pending.remaining:
                late = [i for i, r in zip(request_ids, pending.results, strict=True) if r is None]
                completed = {i: r for i, r in zip(request_ids, pending.results, strict=True) if r is not None}
                raise RequestTimeoutError(late, timeout_s, completed)
            return pending.results
        finally:
            connection.forget(request_ids)

    # --- tokens -----------------------------------------------------------------------------------------

    async def tokenize(
        self, texts: Sequence[str], add_special_tokens: bool = True, *, timeout_s: float | None = None
    ) -> list[list[int]]:
        """Token ids of each text, from a worker's tokenizer (the client needs none)."""
        connection = await self._connect()
        requests = [
            self._build(TokenizeRequest, i, timeout_s, connection, text=t, add_special_tokens=add_special_tokens)
            for i, t in enumerate(texts)
        ]
        return [r.token_ids for r in await self._token_results(requests, timeout_s)]

    async def apply_chat_template(
        self, conversations: Sequence[Sequence[dict[str, Any]]], *, timeout_s: float | None = None
    ) -> list[list[int]]:
        """Prompt token ids of each conversation under the model's chat template, with a generation prompt."""
        connection = await self._connect()
        requests = [
            self._build(TokenizeRequest, i, timeout_s, connection, messages=list(c))
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
        results = await self._submit(requests, timeout_s)
        for result in results:
            if isinstance(result, ErrorResult):
                raise GenerationError(result.request_id, result.code, result.message, result.recoverable)
        return results

    # --- sessions and fleet -----------------------------------------------------------------------------

    async def finish_session(self, session_id: str) -> bool:
        """Unpin a session: its next request is placed anew. Returns whether it was pinned."""
        return await (await self._connect()).streams.finish_session(session_id)

    async def session_worker(self, session_id: str) -> str | None:
        """The worker a session is pinned to, or None."""
        return await (await self._connect()).streams.pinned_worker(session_id)

    async def workers(self) -> list[WorkerStatus]:
        """Live workers (heartbeat not expired), sorted by id."""
        return await (await self._connect()).registry.live_workers()

    async def world_size(self) -> int:
        """Number of live engine replicas."""
        return len(await self.workers())


class SyncRolloutClient:
    """Blocking wrapper: the same methods as `RolloutClient`, run on a private event loop thread.

    Example::

        client = SyncRolloutClient(redis_url="redis://127.0.0.1:6379/0")
        trajectories = client.generate([[1, 2, 3]], {"max_tokens": 8})
        client.close()
    """

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        self.client = RolloutClient(settings, **overrides)
        self._loop: asyncio.AbstractEventLoop | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"client": self.client}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.client, self._loop = state["client"], None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)
        if not asyncio.iscoroutinefunction(method):
            return method
        return lambda *args, **kwargs: self._run(method(*args, **kwargs))

    def close(self) -> None:
        if self._loop is not None:
            self._run(self.client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _per_prompt(values: Sequence[str | None] | None, count: int, name: str) -> list[str | None]:
    if values is None:
        return [None] * count
    if len(values) != count:
        raise InvalidRequestError(f"{name} has {len(values)} entries for {count} prompts; give one per prompt")
    return list(values)


def _error_trajectory(request: RolloutRequest, error: ErrorResult) -> Trajectory:
    return Trajectory(
        request_id=request.request_id,
        session_id=request.session_id,
        group_id=request.group_id,
        prompt_token_ids=request.prompt_token_ids or [],
        finish_reason="error",
        worker_id=error.worker_id,
        error=error.message,
        error_code=error.code,
    )
