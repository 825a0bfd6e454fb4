"""A producer's connection, and what one call's requests are built as (`RequestBuilder`: each validated, under a
fresh id, addressed to its shard, with the call's deadline); `client.call_runner` submits, awaits and cancels them
over it (`CallRunner`).

One `Connection` per event loop. Requests go to shards (`rollout_svc.fleet`): a session's by rendezvous hashing of its
id over the live shards, the others round robin over the live shards weighted by their live workers; a request's
`reply_to`, this producer's results stream in its shard, is set as it is built, and it is enqueued where its
`reply_to` points. One Redis is the one-shard case. The connection's parts do the rest: the submitter
(`client.submitter`) sends what callers queued, in one round trip per shard; each shard's reader (`client.results`)
routes results to their call by request id, retries a request cut by a pause or a shutdown token-exact under a new id
(the caller only ever sees the merged trajectory), regenerates a stale one; the shard watch (`client.shard_watch`)
links new shards and resubmits what a restarted Redis forgot. A request's life (the `Attempt` record of each, one
map by request id) and the rules deciding a retry, a regeneration and the caller's answer are
`client.lifecycle`'s. An explicit abort, a cancel and a deadline are final.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from pydantic import ValidationError
from redis.exceptions import RedisError

from rollout_svc.client.calls import Call, ClientStats
from rollout_svc.client.context_limit import ContextLimit, too_long
from rollout_svc.client.lifecycle import Attempt
from rollout_svc.client.partial import continued_fields
from rollout_svc.client.results import ResultRouter
from rollout_svc.client.shard_watch import ShardWatch
from rollout_svc.client.submitter import CancelOp, CutOp, EnqueueOp, Submitter
from rollout_svc.config import Settings, tune_gc
from rollout_svc.dataplane.producer_streams import ENQUEUE_CHUNK, ProducerStreams
from rollout_svc.dataplane.streams import Enqueue
from rollout_svc.errors import InvalidRequestError, QueueFullError
from rollout_svc.fleet import Fleet, FleetControl, FleetRegistry, rendezvous
from rollout_svc.protocol import (
    ChatMessage,
    Request,
    RolloutRequest,
    SamplingParams,
    Trajectory,
    as_sampling_params,
    encode,
)

log = logging.getLogger("rollout_svc.client")


class Connection:
    """What a client holds while connected, bound to one event loop: a link per shard (`fleet`), this producer's
    results stream in each, the attempts it awaits (`attempts`, request id -> `Attempt`), and its parts: the
    submitter (`Submitter`), the results' router (`ResultRouter`, a reader per shard) and the shard watch
    (`ShardWatch`). `await start()` before the first submit."""

    def __init__(self, settings: Settings, producer_id: str | None = None) -> None:
        """`producer_id`: a stable name whose results stream outlives this connection (a batch job that may be run
        again re-attaches to it): results are read from its start, never deleted by the reader, and the stream is
        left on close (its owner deletes it). Default: a fresh id, its stream consumed and deleted on close."""
        self.settings = settings
        self.loop = asyncio.get_running_loop()
        self.fleet = Fleet(settings)
        self.redis = self.fleet.router  # the keys outside every shard
        self.registry = FleetRegistry(self.fleet)
        self.context = ContextLimit(self.registry.live_workers)
        self.control = FleetControl(self.fleet)
        self.named = producer_id is not None
        self.producer_id = producer_id or uuid.uuid4().hex
        # Request ids of a named producer carry a per-connection nonce: a late answer to an earlier connection's
        # retry must not match this one's.
        self._id_prefix = f"{self.producer_id}-{uuid.uuid4().hex[:8]}" if self.named else self.producer_id
        self._request_numbers = itertools.count()
        self._results_in: dict[str, str] = {}  # shard -> this producer's results stream there (a `reply_to`)
        self._shard_of_results: dict[str, str] = {}  # the other way round, for the shards asked for so far
        self._rotation: Iterator[str] = iter(())  # unkeyed requests' shards, round robin
        self._rotation_of: tuple[str, ...] = ()  # the live shards (one entry per live worker) it cycles through
        self.attempts: dict[str, Attempt] = {}  # request id -> the attempt awaited (or being cancelled) under it
        # Told (position, request id) of each retry or regeneration once Redis took it: a named step records them.
        self.on_attempt: Callable[[int, str], None] | None = None
        self.stats = ClientStats()
        self._closed = asyncio.Event()
        self.router = ResultRouter(
            settings,
            self.producer_id,
            self.named,
            self.attempts,
            self.stats,
            self._new_attempt,
            self.enqueue,
            self._closed,
        )
        self.submitter = Submitter(settings, self.fleet, self.attempts, self.router.answer, self._closed)
        self.watch = ShardWatch(
            settings, self.fleet, self.router, self.stats, self._addressed, self.enqueue, self._closed
        )

    async def start(self) -> None:
        """Find the shards and whether workers live in each, start their tasks. Raises the Redis error if no shard
        can be reached."""
        tune_gc(self.settings.client.gc_young_threshold)
        await self.watch.start()

    def shard_for(self, session_id: str | None) -> str:
        """The shard a request goes to: a session's by rendezvous hashing over the live shards (all known shards if
        none is live), an unkeyed one round robin over the live shards, one turn per live worker."""
        live = self.fleet.live() or sorted(self.fleet.links) or [self.settings.shard]
        if len(live) == 1:
            return live[0]
        if session_id:
            return rendezvous(session_id, live)
        weighted = tuple(n for n in live for _ in range(max(1, self.fleet.links[n].workers)))
        if weighted != self._rotation_of:
            self._rotation_of, self._rotation = weighted, itertools.cycle(weighted)
        return next(self._rotation)

    def reply_to(self, session_id: str | None) -> str:
        """The `reply_to` of a new request: this producer's results stream in the shard it goes to (`shard_for`); a
        request is enqueued to the shard its `reply_to` names."""
        return self._results_of(self.shard_for(session_id))

    def _results_of(self, shard: str) -> str:
        results = self._results_in.get(shard)
        if results is None:  # a shard linked since it was last asked for
            results = self.fleet.links[shard].keys.results(self.producer_id)
            self._results_in[shard], self._shard_of_results[results] = results, shard
        return results

    def _new_attempt(self, request: RolloutRequest) -> tuple[str, str]:
        return self.new_id(), self.reply_to(request.session_id)

    def _addressed(self, request: Request) -> Request:
        """`request` to the shard chosen for it now (a copy if that changes its `reply_to`)."""
        reply_to = self.reply_to(request.session_id if isinstance(request, RolloutRequest) else None)
        return request if request.reply_to == reply_to else request.model_copy(update={"reply_to": reply_to})

    def session_streams(self, session_id: str) -> ProducerStreams:
        """The data plane of the shard a session's requests go to."""
        return self.fleet.links[self.shard_for(session_id)].streams

    def new_id(self) -> str:
        """A request (or group) id unique across producers: this producer's id and a counter."""
        return f"{self._id_prefix}-{next(self._request_numbers)}"

    async def submit(self, call: Call) -> None:
        """Await a call's requests' results from now on, and enqueue them (admission-checked, all or nothing).

        A prompt longer than every live worker's context is answered at once, not enqueued (`context_limit`).
        Raises `QueueFullError`, or the Redis error if Redis is away. Whatever it raises, `cancel(call)` is safe
        (and needed, if a batch larger than a chunk was refused after its first chunks went in).
        """
        longest = await self.context.longest()
        for i, position in enumerate(call.positions):
            if (refused := too_long(position.request, longest)) is not None:
                call.set(i, refused)
        attempts = [Attempt(call, i, p.request) for i, p in enumerate(call.positions) if p.result is None]
        if not attempts:
            return
        try:
            await self.enqueue(attempts, self.settings.client.max_queued_requests)
        except QueueFullError:
            if len(attempts) <= ENQUEUE_CHUNK and len({a.shard for a in attempts}) == 1:  # nothing was sent
                self.forget(call)
                call.remaining = 0
            raise

    def attach(self, call: Call) -> None:
        """Await a call's requests' results without enqueuing them: they were enqueued by an earlier connection of
        this named producer, and their results come to the same stream, which the reader then reads again from
        its start (a named producer's results are never deleted, so one that arrived before is found)."""
        for i, position in enumerate(call.positions):
            self.attempts[position.attempt_id] = Attempt(call, i, position.request)
            if isinstance(position.request, RolloutRequest) and position.request.adapter is not None:
                self.router.adapters.setdefault(position.request.adapter, 0)
        self.router.reread = set(self.fleet.links)

    def enqueue(self, attempts: Sequence[Attempt], limit: int) -> asyncio.Future[None]:
        """Await the attempts' results from now on (a retry's too), and hand their requests to the submitter, each to
        the shard its `reply_to` names (one of another connection's is addressed anew). `limit`: the admission
        limit (-1: none). The future resolves once Redis took them all."""
        done = self.loop.create_future()
        items, shards = [], []
        for attempt in attempts:
            request = attempt.request
            self.attempts[request.request_id] = attempt  # its results are routed to its call from now on
            shard = self._shard_of_results.get(request.reply_to)
            if shard is None:
                request = attempt.request = self._addressed(request)
                shard = self._shard_of_results[request.reply_to]
            attempt.shard = shard
            attempt.sending += 1
            if isinstance(request, RolloutRequest):
                if request.adapter is not None:
                    self.router.adapters.setdefault(request.adapter, 0)  # its newest version is read with results
                items.append(Enqueue(encode(request), request.session_id, cost=request.cost_tokens()))
            else:
                items.append(Enqueue(encode(request), tokens=True))
            shards.append(shard)
        self.submitter.outbox.put_nowait(EnqueueOp(items, limit, list(attempts), shards, done))
        if self.on_attempt is not None:
            self._tell_attempts(attempts, done, self.on_attempt)
        return done

    @staticmethod
    def _tell_attempts(
        attempts: Sequence[Attempt], done: asyncio.Future[None], tell: Callable[[int, str], None]
    ) -> None:
        """Once Redis took them, `tell` (position, request id) of each attempt that is not its position's first."""
        moved = [
            (a.index, a.request.request_id)
            for a in attempts
            if a.request.request_id != a.call.positions[a.index].request.request_id
        ]
        if not moved:
            return

        def taken(future: asyncio.Future[None]) -> None:
            if not future.cancelled() and future.exception() is None:
                for index, request_id in moved:
                    tell(index, request_id)

        done.add_done_callback(taken)

    def cancel(self, call: Call) -> None:
        """Stop awaiting a call's unfinished requests and cancel them on the workers (queued or in flight)."""
        ids = [call.positions[i].attempt_id for i in call.unfinished()]
        for request_id in ids:
            if (attempt := self.attempts.get(request_id)) is not None:
                attempt.cancelling = True  # kept, with its shard and placement, until the cancel is sent
        if ids:
            self.stats.cancelled += len(ids)
            self.submitter.outbox.put_nowait(CancelOp(ids))

    def cut(self, call: Call) -> None:
        """End a call's unfinished positions early, as partial rollouts (its completion target was met): each current
        attempt is cancelled on the workers (in flight: aborted, it answers with its tokens so far; queued: deleted
        and answered here, unrun; taken later: answered unrun by its worker), and whatever answer comes is final,
        `abort_cause="partial"` if it was cut (`cut_fields`). The call's `done` resolves once every answer came."""
        ids = []
        for index in call.unfinished():
            position = call.positions[index]
            if not position.cutting:
                position.cutting = True
                ids.append(position.attempt_id)
        if ids:
            self.submitter.outbox.put_nowait(CutOp(ids))

    def release(self, call: Call) -> None:
        """A call ended: cancel its unfinished requests on the workers, and stop awaiting its requests."""
        if call.remaining:
            self.cancel(call)
        self.forget(call)

    def forget(self, call: Call) -> None:
        """Stop awaiting a call's requests (those being cancelled stay until their cancel is sent)."""
        for position in call.positions:
            attempt = self.attempts.get(position.attempt_id)
            if attempt is not None and not attempt.cancelling:
                del self.attempts[position.attempt_id]

    async def close(self) -> None:
        """Stop the tasks (leased pauses issued here lapse after their lease unless resumed) and delete this
        producer's results streams, unless it is named."""
        # Let the reader finish its blocking read rather than cancel it: a pipeline cancelled mid-read
        # can leave redis-py waiting on a reply that never comes.
        self._closed.set()
        await self.control.close()
        self.submitter.outbox.put_nowait(None)
        tasks = [self.submitter.task, *self.watch.tasks]
        _, pending = await asyncio.wait(tasks, timeout=self.settings.read_block_ms / 1000 + 5)
        for task in pending:
            task.cancel()
        try:
            if not self.named:
                await self.fleet.each(lambda link: link.redis.delete(link.keys.results(self.producer_id)))
        except (RedisError, OSError) as exc:  # Redis away: the stream expires on its own (results_ttl_s)
            log.warning("could not delete the results streams of %s on close (%s)", self.producer_id, exc)
        finally:
            await self.fleet.close()


# --- what one call does over a connection --------------------------------------------------------------------------

Params = SamplingParams | dict[str, Any] | None
# A prompt of `stream`: token ids, text (tokenized by the worker, special tokens added), or chat messages.
Prompt = Sequence[int] | str | Sequence[dict[str, Any] | ChatMessage]
# A prompt of `generate`: token ids, or a trajectory a completion target cut, to continue.
IdsPrompt = Sequence[int] | Trajectory
Target = tuple[float | None, float | None]  # (completion target, cut after s), as `generate`'s
NO_TARGET: Target = (None, None)
R = TypeVar("R", bound=Request)


class RequestBuilder:
    """The validated requests of one call, built before anything is sent: each under a fresh id (unless the caller
    gave its own), addressed to the shard it goes to (its `reply_to`, this producer's results stream there), with
    the call's deadline. `budget_s`: the call's timeout (`timeout_s`, default `Settings.client.request_timeout_s`),
    resolved once, here, for every request's deadline and for the wait (`CallRunner`). Each method raises
    `InvalidRequestError` naming the bad argument or request (nothing was sent)."""

    def __init__(self, connection: Connection, timeout_s: float | None) -> None:
        self.connection = connection
        self.budget_s = connection.settings.client.request_timeout_s if timeout_s is None else timeout_s

    def ids(self, prompts: Sequence[IdsPrompt]) -> list[dict[str, Any]]:
        """The prompt fields of `generate`'s prompts: token ids, or a trajectory to continue (its `Continuation` under
        a new id, with its session and group, which `rollout` keeps unless the caller names others)."""
        fields: list[dict[str, Any]] = []
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, Trajectory):
                fields.append(continued_fields(index, prompt, self.connection.new_id()))
            else:
                fields.append({"prompt_token_ids": list(prompt)})
        return fields

    def prompts(self, prompts: Sequence[Prompt], request_ids: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The prompt fields of `stream`'s prompts (token ids, text or a conversation), under `request_ids` of the
        caller's own if given (one each)."""
        fields = [_prompt_fields(prompt) for prompt in prompts]
        if request_ids is not None:
            if len(request_ids) != len(fields):
                raise InvalidRequestError(f"{len(request_ids)} request ids for {len(fields)} prompts; give one each")
            for field, request_id in zip(fields, request_ids, strict=True):
                field["request_id"] = request_id
        return fields

    def rollout(
        self,
        prompts: Sequence[dict[str, Any]],
        sampling_params: Params | Sequence[Params],
        session_ids: Sequence[str | None] | None,
        group_ids: Sequence[str | None] | None,
        **extra: Any,
    ) -> list[RolloutRequest]:
        """Rollout requests: `prompts[i]` holds request i's prompt field (and may hold its `request_id`, and the
        session and group of a trajectory it continues), `sampling_params` is shared or one per prompt, `session_ids`
        and `group_ids` None or one per prompt (a given one wins), `extra` (streaming, tools, adapter) goes into every
        request."""
        if isinstance(sampling_params, (list, tuple)):
            params = [as_sampling_params(p) for p in sampling_params]
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts; give one each")
        else:
            params = [as_sampling_params(sampling_params)] * len(prompts)  # type: ignore[arg-type]
        sessions = _per_prompt(session_ids, len(prompts), "session_ids")
        groups = _per_prompt(group_ids, len(prompts), "group_ids")
        requests = []
        for i, prompt in enumerate(prompts):
            fields = {**prompt, "sampling_params": params[i], **extra}
            fields["session_id"] = sessions[i] or prompt.get("session_id")
            fields["group_id"] = groups[i] or prompt.get("group_id")
            requests.append(self.request(RolloutRequest, i, fields))
        return requests

    def samples(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling_params: Params,
        order: Sequence[tuple[int, int | None]],
        pack: bool,
        **extra: Any,
    ) -> tuple[list[RolloutRequest], list[str]]:
        """`sample`'s requests: `n` of each prompt, in `order` ((prompt index, expected output tokens) pairs), each
        prompt's under one new group id (with `pack`, its session too); with a `seed`, sample j seeded `seed + j`.
        Returns them, and the group ids in that order."""
        params = as_sampling_params(sampling_params)
        requests, groups = [], []
        for i, expected in order:
            group_id = self.connection.new_id()
            groups.append(group_id)
            for j in range(n):
                seeded = params if params.seed is None else params.model_copy(update={"seed": params.seed + j})
                fields = {"prompt_token_ids": list(prompts[i]), "group_id": group_id, "sampling_params": seeded}
                fields |= {"session_id": group_id if pack else None, "expected_tokens": expected, **extra}
                requests.append(self.request(RolloutRequest, i, fields))
        return requests, groups

    def request(self, cls: type[R], index: int, fields: dict[str, Any]) -> R:
        """One request of `cls` (prompt `index` of the call) of `fields`, under a fresh id unless they hold one, to
        the shard its session goes to, its deadline `budget_s` from now."""
        now = time.time()
        fields.setdefault("request_id", self.connection.new_id())
        if cls is RolloutRequest:  # its staleness bound travels with it: the worker checks it before it generates
            fields.setdefault("max_staleness", self.connection.settings.client.max_staleness)
        try:
            return cls(  # type: ignore[call-arg]
                reply_to=self.connection.reply_to(fields.get("session_id")),
                deadline=now + self.budget_s,
                submitted_at=now,
                **fields,
            )
        except ValidationError as exc:
            raise InvalidRequestError(f"request {index} is invalid: {exc}") from exc


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
