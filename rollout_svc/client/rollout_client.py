"""RolloutClient: what a trainer (or any producer) uses to submit rollout requests, await trajectories and steer
the fleet (pause, resume, abort, sleep)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Literal

from rollout_svc.client.call_runner import CallRunner
from rollout_svc.client.calls import ClientStats
from rollout_svc.client.connection import Connection, IdsPrompt, Params, Prompt, RequestBuilder
from rollout_svc.client.control_verbs import ControlVerbs
from rollout_svc.client.expected import ExpectedLengths
from rollout_svc.client.partial import check_target
from rollout_svc.client.step_store import finish_step, run_step
from rollout_svc.client.steps import StepReport, step_report
from rollout_svc.config import Settings
from rollout_svc.connections.urls import warn_if_evicting
from rollout_svc.control import commands
from rollout_svc.control.lora import AdapterSpec
from rollout_svc.errors import InvalidRequestError, ModelNotFoundError
from rollout_svc.protocol import (
    ChatMessage,
    DetokenizeRequest,
    RolloutRequest,
    TokenizeRequest,
    Trajectory,
    TrajectoryChunk,
    WorkerStatus,
)

_CHECKED_EVICTION: set[str] = set()  # Redis URLs whose maxmemory-policy this process has checked
__all__ = ["AdapterSpec", "IdsPrompt", "Params", "Prompt", "RolloutClient"]


class RolloutClient(ControlVerbs):
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
        self._parts()

    def _parts(self) -> None:
        self._connector = Connector(self.settings, self.producer_id)
        self._connect = self._connector.get  # the started connection of this event loop
        self._runner = CallRunner()  # runs its calls, and keeps the last one for `step_report`
        self.expected_lengths = ExpectedLengths()  # per prompt, from the groups `sample` returned

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings.model_dump(mode="json"), "producer_id": self.producer_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.settings = Settings.model_validate(state["settings"])
        self.producer_id = state.get("producer_id")
        self._parts()

    async def __aenter__(self) -> RolloutClient:
        await self._connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the reader and delete this producer's results stream."""
        await self._connector.close()

    @property
    def stats(self) -> ClientStats:
        """Duplicates ignored, token-exact retries and cancels this client has seen on its current connection."""
        connection = self._connector.connection
        return connection.stats if connection is not None else ClientStats()

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
        step_id: str | None = None,
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
            step_id: name the call as a step that survives this process: if it dies mid-step (or before it used
                the results), a client in another process calls `attach_step(step_id)` and collects every result, in
                order, under the same ids, while the fleet goes on generating (nothing is generated twice). Call
                `finish_step(step_id)` once the results are used; unique until then (or `step_ttl_s`).

        Retries after an abort are token-exact for greedy sampling without penalties; with penalties, a
        `seed` or stop strings that span the cut, the continuation may differ from an uninterrupted run.

        Raises:
            InvalidRequestError: bad prompts, sampling params or target (nothing was sent).
            QueueFullError: the requests stream is over its admission limit (nothing was sent).
            RequestTimeoutError: some requests got no result in time (`.completed` holds the rest).
            ModelNotFoundError: the fleet holds no adapter named `adapter` (nothing was sent).
        """
        check_target(completion_target, cut_after_s)
        build = RequestBuilder(await self._connect(), timeout_s)
        requests = build.rollout(build.ids(prompt_token_ids), sampling_params, session_ids, group_ids, adapter=adapter)
        await self._check_adapter(adapter)
        target = (completion_target, cut_after_s)
        if step_id is not None:
            return await run_step(
                self.settings,
                self._runner,
                step_id,
                requests,
                timeout_s=timeout_s,
                raise_on_error=raise_on_error,
                target=target,
            )
        return await self._runner.run(build, requests, raise_on_error, target)

    async def attach_step(
        self, step_id: str, *, timeout_s: float | None = None, raise_on_error: bool = False
    ) -> list[Trajectory]:
        """Collect the trajectories of the step `step_id` (named by `generate(..., step_id=)` or `run(...,
        step_id=)` in a process that may have died since): every one, in the step's order, under its requests'
        ids; those still generating are awaited (within `timeout_s`, default `request_timeout_s`), those retried or
        regenerated since are awaited under their latest attempt. The step is kept until `finish_step` (or its TTL):
        attaching again collects it again. A step not collected within `step_ttl_s` of its last client expires
        (counted, `rollout-svc status`).

        Raises `InvalidRequestError` if no such step lives (collected already, expired, or never started), and what
        `generate` raises."""
        return await run_step(
            self.settings, self._runner, step_id, None, timeout_s=timeout_s, raise_on_error=raise_on_error
        )

    async def finish_step(self, step_id: str) -> bool:
        """Say the named step's results are used (trained on, checkpointed): its record and results go, its id is
        free. Until then a process that died after collecting them collects them again with `attach_step`. Returns
        False if there was no such step (finished already, or expired)."""
        return await finish_step(await self._connect(), self.settings, step_id)

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
        build = RequestBuilder(await self._connect(), timeout_s)
        requests = build.rollout(build.ids(prompt_token_ids), sampling_params, session_ids, group_ids, adapter=adapter)
        await self._check_adapter(adapter)
        target = (completion_target, cut_after_s)
        async for index, event in self._runner.events(build, requests, raise_on_error, chunks=False, target=target):
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
        request_ids: Sequence[str] | None = None,
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
            request_ids: B ids of your own, unique across the fleet (`abort` names them), default fresh ones.

        The other arguments are `generate`'s. A chunk's `offset` places its tokens in the completion; after a
        token-exact retry chunks may repeat tokens already seen (same offset), so keep them by offset. Leaving the
        loop early cancels the requests not yet finished. Same errors as `generate`.
        """
        build = RequestBuilder(await self._connect(), timeout_s)
        template = {"tools": tools, "parse_tool_calls": parse_tool_calls, "chat_template_kwargs": chat_template_kwargs}
        requests = build.rollout(
            build.prompts(prompts, request_ids),
            sampling_params,
            session_ids,
            group_ids,
            stream=chunks,
            adapter=adapter,
            **template,
        )
        await self._check_adapter(adapter)
        async for event in self._runner.events(build, requests, raise_on_error, chunks=chunks):
            yield event

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
        step_id: str | None = None,
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
        enqueued longest expected first (`client/expected.py`); the result is in input order either way. `adapter`,
        `step_id` (`attach_step` returns the step's n x B trajectories flat, in the order they were enqueued) and the
        errors are `generate`'s.
        """
        if n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {n}")
        if group_placement not in ("spread", "pack"):
            raise InvalidRequestError(f"group_placement must be 'spread' or 'pack', got {group_placement!r}")
        check_target(completion_target, cut_after_s)
        build, learned = RequestBuilder(await self._connect(), timeout_s), self.expected_lengths
        order = learned.order(prompt_token_ids, by_length=expected_lengths)
        pack = group_placement == "pack"
        requests, groups = build.samples(prompt_token_ids, n, sampling_params, order, pack, adapter=adapter)
        await self._check_adapter(adapter)
        target = (completion_target, cut_after_s)
        try:
            if step_id is not None:
                flat = await run_step(
                    self.settings, self._runner, step_id, requests, timeout_s=timeout_s,
                    raise_on_error=raise_on_error, target=target,
                )  # fmt: skip
            else:
                flat = await self._runner.run(build, requests, raise_on_error, target)
        finally:
            if pack:  # unpin the groups: their pins would count as sessions for an hour
                await asyncio.gather(*(self.finish_session(g) for g in groups), return_exceptions=True)
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
        build = RequestBuilder(await self._connect(), timeout_s)
        prompts = [{"messages": list(conversation)} for conversation in conversations]
        requests = build.rollout(prompts, sampling_params, session_ids, None, adapter=adapter)
        await self._check_adapter(adapter)
        return await self._runner.run(build, requests, raise_on_error)

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
        build = RequestBuilder(await self._connect(), timeout_s)
        template = {"tools": tools, "parse_tool_calls": parse_tool_calls, "chat_template_kwargs": chat_template_kwargs}
        requests = build.rollout(
            build.prompts(prompts, request_ids),
            sampling_params,
            session_ids,
            group_ids,
            text_as_detokenized=text_as_detokenized,
            adapter=adapter,
            **template,
        )
        await self._check_adapter(adapter)
        return requests

    async def run(
        self,
        requests: Sequence[RolloutRequest],
        *,
        enqueued: bool = False,
        timeout_s: float | None = None,
        raise_on_error: bool = False,
        step_id: str | None = None,
    ) -> list[Trajectory]:
        """Send requests built by `rollout_requests` and return their trajectories in order (as `generate`).

        `enqueued=True`: do not send them, only await their results: an earlier run of this named producer
        (`producer_id`) enqueued them and their results come to its stream. Same errors as `generate`; a timeout or
        a cancel cancels the unfinished requests on the workers. `step_id`: run them as a named step, as
        `generate`'s (not with `enqueued`: a step's own client attaches with `attach_step`).
        """
        if step_id is not None:
            if enqueued:
                raise InvalidRequestError("a named step is attached to with attach_step(step_id), not enqueued=True")
            return await run_step(
                self.settings, self._runner, step_id, requests, timeout_s=timeout_s, raise_on_error=raise_on_error
            )
        build = RequestBuilder(await self._connect(), timeout_s)
        return await self._runner.run(build, requests, raise_on_error, enqueued=enqueued)

    async def step_report(self) -> StepReport:
        """How this client's last generation call (generate, sample, chat, as_completed, stream, run) used the
        fleet: makespan, busy time per worker (the live workers that served none count idle), idle fraction,
        cuts and moves (`StepReport`). Raises `InvalidRequestError` before the first such call."""
        if self._runner.last_step is None:
            raise InvalidRequestError("no generation call yet: step_report() describes the last one")
        call, started, ended = self._runner.last_step
        trajectories = [r for r in call.results if isinstance(r, Trajectory)]
        live = [w.worker_id for w in await self.workers()]
        stale = (sum(p.regenerations for p in call.positions), sum(p.stale_tokens for p in call.positions))
        return step_report(trajectories, started, ended, live, stale)

    # --- LoRA adapters ----------------------------------------------------------------------------------

    async def load_adapter(
        self, name: str, path: str, *, version: int | None = None, timeout_s: float | None = None
    ) -> int:
        """Load the LoRA adapter in directory `path` (peft's `save_pretrained` output, under the workers'
        checkpoint root) as `name` on every worker, or a new version of `name`: requests on the old version finish
        on it, new ones take the new one, nothing pauses. Returns the version (default: the newest + 1) once every
        live worker loaded it. Raises `ControlCommandError` naming each worker whose load failed and why."""
        control = (await self._connect()).control
        version = await control.next_adapter_version(name, version)
        await control.issue(commands.load_adapter(name, path, version), timeout_s=timeout_s)
        return version

    async def unload_adapter(self, name: str, *, timeout_s: float | None = None) -> int:
        """Drop adapter `name` fleet-wide (requests running on it finish); requests for it then raise
        `ModelNotFoundError`. Returns the epoch."""
        return await self._issue(commands.unload_adapter(name), timeout_s)

    async def adapters(self) -> dict[str, AdapterSpec]:
        """The adapters the fleet holds: name -> its newest version and directory."""
        return (await self.fleet_state()).adapters

    async def _check_adapter(self, name: str | None) -> None:
        """Raise `ModelNotFoundError` unless the fleet holds adapter `name` (None: the base model, always)."""
        if name is not None and name not in (held := await self.adapters()):
            raise ModelNotFoundError(name, sorted(held))

    # --- sessions and fleet -----------------------------------------------------------------------------

    async def finish_session(self, session_id: str) -> bool:
        """Unpin a session: its next request is placed anew. Returns whether it was pinned."""
        return await (await self._connect()).session_streams(session_id).finish_session(session_id)

    async def session_worker(self, session_id: str) -> str | None:
        """The worker a session is pinned to, or None."""
        return await (await self._connect()).session_streams(session_id).pinned_worker(session_id)

    async def workers(self) -> list[WorkerStatus]:
        """Live workers (heartbeat not expired), sorted by id, with their control state (`state`, `applied_epoch`)."""
        return await (await self._connect()).registry.live_workers()

    async def named_models(self) -> list[str]:
        """The named models whose workers ever registered in this deployment (`Settings.model_name`; each has queues
        and control state of its own: address one with `RolloutClient(settings, model_name=...)`)."""
        return await (await self._connect()).fleet.named_models()

    async def world_size(self) -> int:
        """GPUs (ranks) behind the live workers: each worker's tensor x pipeline x data parallel size, summed (1 per
        echo or sim engine). `len(await workers())` counts worker processes."""
        return sum(w.weight_ranks for w in await self.workers())

    # --- the tokenizer (a worker's: the client needs none) -------------------------------------------

    async def tokenize(
        self, texts: Sequence[str], add_special_tokens: bool = True, *, timeout_s: float | None = None
    ) -> list[list[int]]:
        """Token ids of each text, from a worker's tokenizer (the client needs none). Served while paused."""
        build = RequestBuilder(await self._connect(), timeout_s)
        fields = [{"text": text, "add_special_tokens": add_special_tokens} for text in texts]
        requests = [build.request(TokenizeRequest, i, f) for i, f in enumerate(fields)]
        return [r.token_ids for r in await self._runner.run(build, requests, raise_on_error=True)]

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
        build = RequestBuilder(await self._connect(), timeout_s)
        template = {"tools": tools, "chat_template_kwargs": chat_template_kwargs}
        requests = [
            build.request(TokenizeRequest, i, {"messages": list(c), **template}) for i, c in enumerate(conversations)
        ]
        return [r.token_ids for r in await self._runner.run(build, requests, raise_on_error=True)]

    async def detokenize(
        self, token_ids: Sequence[Sequence[int]], skip_special_tokens: bool = True, *, timeout_s: float | None = None
    ) -> list[str]:
        """Text of each list of token ids, from a worker's tokenizer."""
        build = RequestBuilder(await self._connect(), timeout_s)
        fields = [{"token_ids": list(ids), "skip_special_tokens": skip_special_tokens} for ids in token_ids]
        requests = [build.request(DetokenizeRequest, i, f) for i, f in enumerate(fields)]
        return [r.text for r in await self._runner.run(build, requests, raise_on_error=True)]


class Connector:
    """The started connection of the running event loop, made on first use (`get`). Concurrent first calls share one
    start (none sees a connection before it has discovered the shards); a start that failed is tried again by the
    next call; a call on another event loop gets a connection of its own."""

    def __init__(self, settings: Settings, producer_id: str | None) -> None:
        self.settings, self.producer_id = settings, producer_id
        self.connection: Connection | None = None
        self._starting: asyncio.Future[None] | None = None  # the current connection's start, awaited by every caller

    async def get(self) -> Connection:
        """The started connection. Raises the Redis error if no shard can be reached."""
        connection, starting = self.connection, self._starting
        if _started(starting) and connection is not None and connection.loop is asyncio.get_running_loop():
            return connection  # no shield, no await: this runs several times a request
        if connection is None or connection.loop is not asyncio.get_running_loop():
            connection = self.connection = Connection(self.settings, self.producer_id)
            self._starting = asyncio.ensure_future(self._start(connection))
        starting = self._starting
        assert starting is not None  # set with the connection
        try:
            await asyncio.shield(starting)  # a done start: at once
        except BaseException:
            if starting.done() and self.connection is connection:
                self.connection = self._starting = None
            raise
        return connection

    async def _start(self, connection: Connection) -> None:
        await connection.start()
        if self.settings.redis_url not in _CHECKED_EVICTION:  # once per process and Redis
            _CHECKED_EVICTION.add(self.settings.redis_url)
            await warn_if_evicting(connection.redis, "rollout client")

    async def close(self) -> None:
        """Close the connection, if any (a start under way is cancelled first)."""
        if self.connection is not None:
            connection, starting, self.connection, self._starting = self.connection, self._starting, None, None
            if starting is not None and not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            await connection.close()


def _started(start: asyncio.Future[None] | None) -> bool:
    """Whether a connection's start finished without an error."""
    return start is not None and start.done() and not start.cancelled() and start.exception() is None
