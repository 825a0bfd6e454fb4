"""RolloutClient: what a trainer (or any producer) uses to submit rollout requests, await trajectories and steer
the fleet (pause, resume, abort, sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Literal, TypeVar

from pydantic import ValidationError

from rollout_svc.client.calls import Call, ClientStats, GroupTarget
from rollout_svc.client.connection import Connection
from rollout_svc.client.expected import ExpectedLengths
from rollout_svc.client.fleet_calls import FleetCalls
from rollout_svc.client.lifecycle import error_trajectory
from rollout_svc.client.partial import check_target, continued_fields
from rollout_svc.client.steps import StepReport, step_report
from rollout_svc.client.token_calls import TokenCalls
from rollout_svc.config import Settings
from rollout_svc.connections.urls import warn_if_evicting
from rollout_svc.errors import GenerationError, InvalidRequestError, RequestTimeoutError
from rollout_svc.protocol import (
    ChatMessage,
    ErrorResult,
    Request,
    RolloutRequest,
    SamplingParams,
    Trajectory,
    TrajectoryChunk,
    as_sampling_params,
)

T = TypeVar("T")
_CHECKED_EVICTION: set[str] = set()  # Redis URLs whose maxmemory-policy this process has checked
Params = SamplingParams | dict[str, Any] | None
# A prompt of `stream`: token ids, text (tokenized by the worker, special tokens added), or chat messages.
Prompt = Sequence[int] | str | Sequence[dict[str, Any] | ChatMessage]
# A prompt of `generate`: token ids, or a trajectory a completion target cut, to continue.
IdsPrompt = Sequence[int] | Trajectory


class RolloutClient(FleetCalls, TokenCalls):
    """Async client of the rollout service. Holds only its settings, so it pickles (to Ray actors, say).

    Example (start a local cluster first: `rollout-svc up --workers 2 --engine vllm`)::

        import asyncio
        from rollout_svc import RolloutClient

        async def main():
            async with RolloutClient(redis_url="redis://127.0.0.1:6379/0") as client:
                ids = await client.tokenize(["The capital of France is"])
                [trajectory] = await client.generate(ids, {"temperature": 0.0, "max_tokens": 8})
                print(trajectory.text, trajectory.logprobs, trajectory.worker_id)
                await client.pause(mode="keep")   # every worker froze its in-flight requests
                await client.resume()

        asyncio.run(main())

    Every call takes `timeout_s` (default `Settings.client.request_timeout_s`); past it, `RequestTimeoutError`. The
    deadline is the caller's budget and keeps running while the fleet is paused. Cancelling a call (or leaving
    `as_completed` early) cancels its requests on the workers, queued and in flight. A request cut by a pause in
    abort mode, or by its worker shutting down, is retried token-exact and returned whole
    (`Trajectory.interruptions` counts the cuts).

    Partial rollouts: `generate`, `sample` and `as_completed` take a completion target (`completion_target`, a
    fraction of the call's groups; `cut_after_s`, a time): once it is met, what has not finished is cut and comes
    back with `finish_reason="abort"`, `abort_cause="partial"` and its tokens so far; pass those trajectories as
    prompts to a later `generate` to continue them token-exact (`rollout_svc/client/partial.py`). `step_report()`
    says how the last call used the fleet.
    """

    def __init__(self, settings: Settings | None = None, *, producer_id: str | None = None, **overrides: Any) -> None:
        """`overrides`: `Settings` fields. `producer_id`: a stable producer name whose results stream outlives the
        client, for a job that may be run again and must collect what an earlier run enqueued (see `run`)."""
        self.settings = settings.copy_with(**overrides) if settings else Settings(**overrides)
        self.producer_id = producer_id
        self._connection: Connection | None = None
        self._starting: asyncio.Future[None] | None = None  # the current connection's start, awaited by every caller
        self._last_step: tuple[Call, float, float] | None = None  # the last generation call, its start and end (unix s)
        self.expected_lengths = ExpectedLengths()  # per prompt, from the groups `sample` returned

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings.model_dump(mode="json"), "producer_id": self.producer_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.settings = Settings.model_validate(state["settings"])
        self.producer_id = state.get("producer_id")
        self._connection, self._starting = None, None
        self._last_step, self.expected_lengths = None, ExpectedLengths()

    async def __aenter__(self) -> RolloutClient:
        await self._connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the reader and delete this producer's results stream."""
        if self._connection is not None:
            connection, starting, self._connection, self._starting = self._connection, self._starting, None, None
            if starting is not None and not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            await connection.close()

    async def _connect(self) -> Connection:
        """The started connection of this event loop. Concurrent first calls share one start (none sees a
        connection before it has discovered the shards); a start that failed is tried again by the next call."""
        connection, starting = self._connection, self._starting
        if _started(starting) and connection is not None and connection.loop is asyncio.get_running_loop():
            return connection  # no shield, no await: this runs several times a request
        if connection is None or connection.loop is not asyncio.get_running_loop():
            connection = self._connection = Connection(self.settings, self.producer_id)
            self._starting = asyncio.ensure_future(self._start(connection))
        starting = self._starting
        assert starting is not None  # set with the connection
        try:
            await asyncio.shield(starting)  # a done start: at once
        except BaseException:
            if starting.done() and self._connection is connection:
                self._connection = self._starting = None
            raise
        return connection

    async def _start(self, connection: Connection) -> None:
        await connection.start()
        if self.settings.redis_url not in _CHECKED_EVICTION:  # once per process and Redis
            _CHECKED_EVICTION.add(self.settings.redis_url)
            await warn_if_evicting(connection.redis, "rollout client")

    @property
    def stats(self) -> ClientStats:
        """Duplicates ignored, token-exact retries and cancels this client has seen on its current connection."""
        return self._connection.stats if self._connection is not None else ClientStats()

    # --- generation -----------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: Sequence[IdsPrompt],
        sampling_params: Params = None,
        session_ids: Sequence[str | None] | None = None,
        *,
        group_ids: Sequence[str | None] | None = None,
        completion_target: float | None = None,
        cut_after_s: float | None = None,
        timeout_s: float | None = None,
        raise_on_error: bool = False,
        adapter: str | None = None,
    ) -> list[Trajectory]:
        """Generate one completion per prompt; returns trajectories in input order.

        Args:
            prompt_token_ids: B prompts, each a non-empty list of token ids, or a trajectory an earlier call cut
                (`abort_cause="partial"`, or another abort) to continue token-exact: the worker generates after its
                tokens (`max_tokens` counts them) and answers with the whole completion, its weight-version
                spans kept. Its session and group carry over unless `session_ids` / `group_ids` name others.
            sampling_params: vLLM-named sampling params (a dict or `SamplingParams`), shared by all prompts.
            session_ids: None, or B session ids (None entries allowed): every request of one session
                is served by one worker (its KV cache stays warm) until `finish_session` or its TTL.
            group_ids: optional B group ids, carried through to the trajectories.
            completion_target: end the call once this fraction (0, 1] of its groups finished (requests sharing a
                group id are a group; others, groups of one): the rest are cut and returned with their tokens so
                far, `finish_reason="abort"`, `abort_cause="partial"` (partial rollouts).
            cut_after_s: likewise, once this many seconds passed (whichever comes first, with a target).
            timeout_s: per request, from submission, pauses included; past it the request is dropped by the
                worker (a request being retried after an abort returns its partial tokens with
                `finish_reason="abort"`, `abort_cause="deadline"`).
            raise_on_error: raise `GenerationError` on the first failed request instead of returning a
                trajectory with `finish_reason == "error"` for it.
            adapter: the LoRA adapter to generate with, by the name it was loaded under (`load_adapter`), at its
                newest version (`Trajectory.adapter_versions` says which); None: the base model.

        Retries after an abort are token-exact for greedy sampling without penalties; with penalties, a
        `seed` or stop strings that span the cut, the continuation may differ from an uninterrupted run.

        Raises:
            InvalidRequestError: bad prompts, sampling params or target (nothing was sent).
            QueueFullError: the requests stream is over its admission limit (nothing was sent).
            RequestTimeoutError: some requests got no result in time (`.completed` holds the rest).
            ModelNotFoundError: the fleet holds no adapter named `adapter` (nothing was sent).
        """
        check_target(completion_target, cut_after_s)
        requests = await self._ids_requests(
            prompt_token_ids, sampling_params, session_ids, group_ids, timeout_s, adapter=adapter
        )
        results = await self._run(requests, timeout_s, target=(completion_target, cut_after_s))
        return self._trajectories(requests, results, raise_on_error)

    async def as_completed(
        self,
        prompt_token_ids: Sequence[IdsPrompt],
        sampling_params: Params = None,
        session_ids: Sequence[str | None] | None = None,
        *,
        group_ids: Sequence[str | None] | None = None,
        completion_target: float | None = None,
        cut_after_s: float | None = None,
        timeout_s: float | None = None,
        raise_on_error: bool = False,
        adapter: str | None = None,
    ) -> AsyncIterator[tuple[int, Trajectory]]:
        """`generate`, yielding `(index, trajectory)` in completion order instead of a list in input order.

        Each trajectory is final (retries merged). Leaving the loop early cancels the requests not yet yielded,
        queued and in flight. On timeout it yields what finished (retried requests with their partial tokens),
        then raises `RequestTimeoutError`. Same arguments and errors as `generate`::

            async for index, trajectory in client.as_completed(prompts, {"max_tokens": 256}):
                buffer.add(index, trajectory)

        With a completion target, the cut ones are yielded last (once their workers answered the cut).
        """
        check_target(completion_target, cut_after_s)
        requests = await self._ids_requests(
            prompt_token_ids, sampling_params, session_ids, group_ids, timeout_s, adapter=adapter
        )
        target = (completion_target, cut_after_s)
        async for index, event in self._events(requests, timeout_s, raise_on_error, chunks=False, target=target):
            assert isinstance(event, Trajectory)
            yield index, event

    async def stream(
        self,
        prompts: Sequence[Prompt],
        sampling_params: Params | Sequence[Params] = None,
        session_ids: Sequence[str | None] | None = None,
        *,
        chunks: bool = True,
        group_ids: Sequence[str | None] | None = None,
        tools: list[dict[str, Any]] | None = None,
        parse_tool_calls: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        raise_on_error: bool = False,
        adapter: str | None = None,
    ) -> AsyncGenerator[tuple[int, TrajectoryChunk | Trajectory], None]:
        """Generate with tokens streamed back as they are made: yields `(index, TrajectoryChunk)` as each prompt's
        worker sends its new tokens (a few at a time: `stream_interval_s`), then `(index, Trajectory)`
        once it finished (the whole completion, retries merged), in arrival order. `chunks=False`: trajectories only.

        Args:
            prompts: B prompts, each token ids, a text (tokenized by the worker with special tokens, as vLLM's
                completions API does), or a conversation (chat messages, templated by the worker).
            sampling_params: shared by all prompts, or a list of B (say, one seed per sample of a group).
            tools: OpenAI function tools for the chat template; `parse_tool_calls`: the worker parses tool calls
                out of the output (`Trajectory.tool_calls`, `.content`). `chat_template_kwargs`: for the template.

        The other arguments are `generate`'s. A chunk's `offset` places its tokens in the completion; after a
        token-exact retry chunks may repeat tokens already seen (same offset), so keep them by offset. Leaving the
        loop early cancels the requests not yet finished. Same errors as `generate`.
        """
        requests = await self._prompt_requests(
            prompts,
            sampling_params,
            session_ids,
            group_ids,
            timeout_s,
            None,
            stream=chunks,
            tools=tools,
            parse_tool_calls=parse_tool_calls,
            chat_template_kwargs=chat_template_kwargs,
            adapter=adapter,
        )
        async for event in self._events(requests, timeout_s, raise_on_error, chunks=chunks):
            yield event

    async def _events(
        self,
        requests: list[RolloutRequest],
        timeout_s: float | None,
        raise_on_error: bool,
        chunks: bool,
        target: tuple[float | None, float | None] = (None, None),
    ) -> AsyncIterator[tuple[int, TrajectoryChunk | Trajectory]]:
        """Submit `requests` and yield `(index, chunk)` (with `chunks`) and `(index, trajectory)` as they arrive;
        `target`: (completion target, cut after s), as `generate`'s."""
        connection = await self._connect()
        call = connection.new_call(requests, chunks=chunks)
        timeout_s = self._timeout(timeout_s)
        started, timer = time.time(), None
        # With chunks every event (chunks, then each position's end) comes through `call.events`, else through
        # `call.completed`: one queue, so nothing is yielded twice.
        queue: asyncio.Queue[Any] = call.events if call.events is not None else call.completed
        finished = 0
        try:
            await connection.submit(call)
            timer = self._watch(connection, call, target)
            deadline = time.monotonic() + timeout_s
            while finished < len(requests):
                try:
                    event = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    call.expire()
                    while not queue.empty():
                        index, chunk = _event(queue.get_nowait())
                        if chunk is None:
                            yield index, self._trajectory(requests[index], call.positions[index].result, raise_on_error)
                    if call.remaining:  # as `generate`: positions that ended with their partial tokens are answers
                        raise self._late(call, timeout_s) from None
                    return
                index, chunk = _event(event)
                if chunk is not None:
                    yield index, chunk
                else:
                    finished += 1
                    yield index, self._trajectory(requests[index], call.positions[index].result, raise_on_error)
        finally:
            if timer is not None:
                timer.cancel()
            if call.remaining:
                connection.cancel(call)
            connection.forget(call)
            self._last_step = (call, started, time.time())

    async def sample(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling_params: Params = None,
        *,
        group_placement: Literal["spread", "pack"] = "spread",
        completion_target: float | None = None,
        cut_after_s: float | None = None,
        timeout_s: float | None = None,
        raise_on_error: bool = False,
        expected_lengths: bool = True,
        adapter: str | None = None,
    ) -> list[list[Trajectory]]:
        """Draw `n` samples of each prompt (a group): returns B lists of n trajectories, in input order.

        The n requests of a group share a `group_id`. `group_placement="spread"` (the default) spreads them over
        the workers like any requests (placement by cost); `"pack"` runs each group on one worker, its prompt
        prefilled once and shared through the prefix cache: the group is a session named by its group id (its
        trajectories carry it as `session_id`), new groups going to the worker with the least work (tokens), and
        finished when the call ends. With a `seed`, sample j uses `seed + j`, so the n samples differ (as vLLM's
        `n` does) and the call is reproducible. `completion_target`: end once this fraction of the groups finished
        whole (`generate`'s; continue a cut sample with `generate`, which keeps its group id). `expected_lengths`:
        each request carries its prompt's expected output length, learned from this client's earlier groups of it
        (`self.expected_lengths`), which placement by cost counts in place of `max_tokens`, and the groups are
        enqueued longest expected first (`client/expected.py`); the result is in input order either way. `adapter`
        and the errors are `generate`'s.
        """
        if n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {n}")
        if group_placement not in ("spread", "pack"):
            raise InvalidRequestError(f"group_placement must be 'spread' or 'pack', got {group_placement!r}")
        check_target(completion_target, cut_after_s)
        params = as_sampling_params(sampling_params)
        await self._check_adapter(adapter)
        connection = await self._connect()
        requests, groups, learned = [], [], self.expected_lengths
        order = learned.order(prompt_token_ids, by_length=expected_lengths)
        for i, expected in order:
            prompt, group_id = prompt_token_ids[i], connection.new_id()
            groups.append(group_id)
            session_id = group_id if group_placement == "pack" else None
            for j in range(n):
                seeded = params if params.seed is None else params.model_copy(update={"seed": params.seed + j})
                fields = {"prompt_token_ids": list(prompt), "group_id": group_id, "sampling_params": seeded}
                fields |= {"expected_tokens": expected, "adapter": adapter}
                requests.append(self._build(RolloutRequest, i, timeout_s, connection, session_id=session_id, **fields))
        try:
            results = await self._run(requests, timeout_s, target=(completion_target, cut_after_s))
        finally:
            if group_placement == "pack":  # unpin the groups: their pins would count as sessions for an hour
                await asyncio.gather(*(self.finish_session(g) for g in groups), return_exceptions=True)
        flat = self._trajectories(requests, results, raise_on_error)
        out: list[list[Trajectory]] = [[] for _ in prompt_token_ids]
        for k, (i, _) in enumerate(order):
            out[i] = flat[k * n : (k + 1) * n]
            learned.observe(prompt_token_ids[i], out[i])
        return out

    async def chat(
        self,
        conversations: Sequence[Sequence[dict[str, Any] | ChatMessage]],
        sampling_params: Params = None,
        session_ids: Sequence[str | None] | None = None,
        *,
        timeout_s: float | None = None,
        raise_on_error: bool = False,
        adapter: str | None = None,
    ) -> list[Trajectory]:
        """Generate the next assistant turn of each conversation (OpenAI-style `{"role", "content"}` dicts).

        The worker applies the model's chat template; `Trajectory.prompt_token_ids` are the ids it used.
        `adapter` and the errors are `generate`'s.
        """
        params = as_sampling_params(sampling_params)
        await self._check_adapter(adapter)
        sessions = _per_prompt(session_ids, len(conversations), "session_ids")
        connection = await self._connect()
        requests = [
            self._build(
                RolloutRequest,
                i,
                timeout_s,
                connection,
                messages=list(c),
                session_id=sessions[i],
                sampling_params=params,
                adapter=adapter,
            )
            for i, c in enumerate(conversations)
        ]
        return self._trajectories(requests, await self._run(requests, timeout_s), raise_on_error)

    async def rollout_requests(
        self,
        prompts: Sequence[Prompt],
        sampling_params: Params | Sequence[Params] = None,
        session_ids: Sequence[str | None] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        group_ids: Sequence[str | None] | None = None,
        tools: list[dict[str, Any]] | None = None,
        parse_tool_calls: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        text_as_detokenized: bool = False,
        adapter: str | None = None,
    ) -> list[RolloutRequest]:
        """The validated rollout requests of `stream`'s arguments, not sent: for `run`. `request_ids`: B ids of your
        own (unique across the fleet; a batch job uses `batch:{id}:{custom_id}`), default fresh ones. Their
        deadline runs from now. `text_as_detokenized`: each trajectory's text as `detokenize` would give it (see
        `RolloutRequest`). `adapter`: `generate`'s. Raises `InvalidRequestError`, `ModelNotFoundError`."""
        return await self._prompt_requests(
            prompts,
            sampling_params,
            session_ids,
            group_ids,
            timeout_s,
            request_ids,
            tools=tools,
            parse_tool_calls=parse_tool_calls,
            chat_template_kwargs=chat_template_kwargs,
            text_as_detokenized=text_as_detokenized,
            adapter=adapter,
        )

    async def _prompt_requests(
        self,
        prompts: Sequence[Prompt],
        sampling_params: Params | Sequence[Params],
        session_ids: Sequence[str | None] | None,
        group_ids: Sequence[str | None] | None,
        timeout_s: float | None,
        request_ids: Sequence[str] | None,
        **extra: Any,
    ) -> list[RolloutRequest]:
        """`_generation_requests` of prompts as `stream` takes them (ids, text or conversations), with `request_ids`
        of the caller's own if given."""
        fields = [_prompt_fields(prompt) for prompt in prompts]
        if request_ids is not None:
            if len(request_ids) != len(fields):
                raise InvalidRequestError(f"{len(request_ids)} request ids for {len(fields)} prompts; give one each")
            for field, request_id in zip(fields, request_ids, strict=True):
                field["request_id"] = request_id
        return await self._generation_requests(fields, sampling_params, session_ids, group_ids, timeout_s, **extra)

    async def run(
        self,
        requests: Sequence[RolloutRequest],
        *,
        enqueued: bool = False,
        timeout_s: float | None = None,
        raise_on_error: bool = False,
    ) -> list[Trajectory]:
        """Send requests built by `rollout_requests` and return their trajectories in order (as `generate`).

        `enqueued=True`: do not send them, only await their results: an earlier run of this named producer
        (`producer_id`) enqueued them and their results come to its stream. Same errors as `generate`; a timeout or
        a cancel cancels the unfinished requests on the workers.
        """
        results = await self._run(requests, timeout_s, enqueued=enqueued)
        return self._trajectories(requests, results, raise_on_error)

    async def _ids_requests(
        self,
        prompts: Sequence[IdsPrompt],
        sampling_params: Params,
        session_ids: Sequence[str | None] | None,
        group_ids: Sequence[str | None] | None,
        timeout_s: float | None,
        adapter: str | None = None,
    ) -> list[RolloutRequest]:
        """`_generation_requests` of `generate`'s prompts: token ids, or trajectories to continue (their session and
        group unless the caller names others)."""
        connection = await self._connect()
        fields: list[dict[str, Any]] = []
        sessions = _per_prompt(session_ids, len(prompts), "session_ids")
        groups = _per_prompt(group_ids, len(prompts), "group_ids")
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, Trajectory):
                fields.append(continued_fields(i, prompt, connection.new_id()))
                sessions[i] = sessions[i] or fields[-1].pop("session_id")
                groups[i] = groups[i] or fields[-1].pop("group_id")
            else:
                fields.append({"prompt_token_ids": list(prompt)})
        return await self._generation_requests(fields, sampling_params, sessions, groups, timeout_s, adapter=adapter)

    async def _generation_requests(
        self,
        prompts: Sequence[dict[str, Any]],
        sampling_params: Params | Sequence[Params],
        session_ids: Sequence[str | None] | None,
        group_ids: Sequence[str | None] | None,
        timeout_s: float | None,
        **extra: Any,
    ) -> list[RolloutRequest]:
        """Validated rollout requests: `prompts[i]` holds request i's prompt field (and may hold its `request_id`),
        `sampling_params` is shared or one per prompt, `extra` (streaming, tools) goes into every request. Raises
        `InvalidRequestError`."""
        if isinstance(sampling_params, (list, tuple)):
            params = [as_sampling_params(p) for p in sampling_params]
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts; give one each")
        else:
            params = [as_sampling_params(sampling_params)] * len(prompts)  # type: ignore[arg-type]
        sessions = _per_prompt(session_ids, len(prompts), "session_ids")
        groups = _per_prompt(group_ids, len(prompts), "group_ids")
        await self._check_adapter(extra.get("adapter"))
        connection = await self._connect()
        return [
            self._build(
                RolloutRequest,
                i,
                timeout_s,
                connection,
                **prompt,
                session_id=sessions[i],
                group_id=groups[i],
                sampling_params=params[i],
                **extra,
            )
            for i, prompt in enumerate(prompts)
        ]

    def _timeout(self, timeout_s: float | None) -> float:
        return self.settings.client.request_timeout_s if timeout_s is None else timeout_s

    def _build(self, cls: type[T], index: int, timeout_s: float | None, connection: Connection, **fields: Any) -> T:
        """Validate one request before anything is sent, addressed to the shard it will go to (its `reply_to`, the
        results stream there) with its deadline. Raises `InvalidRequestError` naming its index."""
        now = time.time()
        fields.setdefault("request_id", connection.new_id())
        try:
            return cls(  # type: ignore[call-arg]
                reply_to=connection.reply_to(fields.get("session_id")),
                deadline=now + self._timeout(timeout_s),
                submitted_at=now,
                **fields,
            )
        except ValidationError as exc:
            raise InvalidRequestError(f"request {index} is invalid: {exc}") from exc

    async def _run(
        self,
        requests: Sequence[Request],
        timeout_s: float | None,
        enqueued: bool = False,
        target: tuple[float | None, float | None] = (None, None),
    ) -> list[Any]:
        """Enqueue a batch (unless `enqueued`: then only await it) and await every result, in order. Cancelled or
        failed: its requests are cancelled. `target`: (completion target, cut after s), as `generate`'s."""
        if not requests:
            return []
        connection = await self._connect()
        call = connection.new_call(requests)
        timeout_s = self._timeout(timeout_s)
        started, timer = time.time(), None
        try:
            if enqueued:
                connection.attach(call)
            else:
                await connection.submit(call)
            timer = self._watch(connection, call, target)
            deadline = connection.loop.call_later(timeout_s, _resolve, call.done)  # wakes this caller in time
            try:
                await call.done  # not asyncio.wait: one loop iteration less between the last result and the caller
            finally:
                deadline.cancel()
            if call.remaining:
                call.expire()
            if call.remaining:
                raise self._late(call, timeout_s)
            return call.results
        finally:
            if timer is not None:
                timer.cancel()
            if call.remaining:
                connection.cancel(call)
            connection.forget(call)
            if isinstance(requests[0], RolloutRequest):
                self._last_step = (call, started, time.time())

    @staticmethod
    def _watch(
        connection: Connection, call: Call, target: tuple[float | None, float | None]
    ) -> asyncio.TimerHandle | None:
        """Cut `call` once `target` (completion target, cut after s) is met; returns the timer to cancel, if any."""
        fraction, after_s = target
        if fraction is not None:
            call.watch(GroupTarget(call.requests, fraction), lambda: connection.cut(call))
        return None if after_s is None else connection.loop.call_later(after_s, connection.cut, call)

    async def step_report(self) -> StepReport:
        """How this client's last generation call (generate, sample, chat, as_completed, stream, run) used the
        fleet: makespan, busy time per worker (the live workers that served none count idle), idle fraction,
        cuts and moves (`StepReport`). Raises `InvalidRequestError` before the first such call."""
        if self._last_step is None:
            raise InvalidRequestError("no generation call yet: step_report() describes the last one")
        call, started, ended = self._last_step
        trajectories = [r for r in call.results if isinstance(r, Trajectory)]
        live = [w.worker_id for w in await self.workers()]
        return step_report(trajectories, started, ended, live)

    @staticmethod
    def _late(call: Call, timeout_s: float) -> RequestTimeoutError:
        late = [call.positions[i].request.request_id for i in call.unfinished()]
        completed = {p.request.request_id: p.result for p in call.positions if p.result is not None}
        return RequestTimeoutError(late, timeout_s, completed)

    def _trajectories(self, requests: Sequence[Request], results: list[Any], raise_on_error: bool) -> list[Trajectory]:
        return [self._trajectory(r, result, raise_on_error) for r, result in zip(requests, results, strict=True)]

    @staticmethod
    def _trajectory(request: Request, result: Any, raise_on_error: bool) -> Trajectory:
        if isinstance(result, ErrorResult):
            if raise_on_error:
                raise GenerationError(result.request_id, result.code, result.message, result.recoverable)
            assert isinstance(request, RolloutRequest)
            return error_trajectory(request, result)
        return result


def _event(event: int | tuple[int, TrajectoryChunk | None]) -> tuple[int, TrajectoryChunk | None]:
    """An entry of `Call.completed` (a position that finished) or `Call.events`, as `(position, chunk or None)`."""
    return (event, None) if isinstance(event, int) else event


def _prompt_fields(prompt: Prompt) -> dict[str, Any]:
    """The RolloutRequest field a prompt goes in: `prompt` (text), `messages` (a conversation) or token ids."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    items = list(prompt)
    if items and not isinstance(items[0], int):
        return {"messages": items}
    return {"prompt_token_ids": items}


def _per_prompt(values: Sequence[str | None] | None, count: int, name: str) -> list[str | None]:
    if values is None:
        return [None] * count
    if len(values) != count:
        raise InvalidRequestError(f"{name} has {len(values)} entries for {count} prompts; give one per prompt")
    return list(values)


def _resolve(done: asyncio.Future[None]) -> None:
    """A call's deadline: wake its caller, which then expires what did not finish."""
    if not done.done():
        done.set_result(None)


def _started(start: asyncio.Future[None] | None) -> bool:
    """Whether a connection's start finished without an error."""
    return start is not None and start.done() and not start.cancelled() and start.exception() is None
