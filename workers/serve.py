"""Serving one taken entry: decode it, answer what an abort hit, run it on the engine, merge a continuation."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable

from rollout_svc import tracing
from rollout_svc.config import Settings
from rollout_svc.connections.urls import REDIS_AWAY
from rollout_svc.dataplane.recovery_streams import RecoveryStreams
from rollout_svc.dataplane.streams import Enqueue, Entry
from rollout_svc.dataplane.worker_streams import WorkerStreams
from rollout_svc.errors import EngineDeadError, InvalidRequestError, ProtocolError
from rollout_svc.protocol import (
    DetokenizeRequest,
    ErrorCode,
    ErrorResult,
    Request,
    Result,
    RolloutRequest,
    TokenizeRequest,
    TokenizeResult,
    Trajectory,
    TrajectoryChunk,
    construct,
    decode,
    encode,
    reply_address,
    unrun_trajectory,
)
from workers import traces
from workers.engine import Completion, Engine, Generation, joined
from workers.inflight import AbortRules, InFlight, InFlightIndex
from workers.lora_table import AdapterRef
from workers.metrics import WorkerMetrics
from workers.state import WorkerState
from workers.totals import ServedTotals

log = logging.getLogger("rollout_svc.worker")
SECOND_DELIVERY_POLL_S = 0.05  # how often a second delivery looks whether the running copy was published
REDIS_ERRORS = REDIS_AWAY  # what a Redis that is away raises: the worker's loops back off and try again
RETRY_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)


def backoff_s(failures: int) -> float:
    return RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1]


async def idle(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, but return at once when `stopping` is set (a worker's loops between their rounds)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


class RequestServer:
    """Turns taken entries into results on one engine. `publish(record)` queues a record once answered (its
    `reply_to` and `payload` set; `reply_to` None: acknowledge only); `on_engine_dead(exc)` stops the worker.
    `streams` pins sessions, sends chunks and hands stragglers over; `recovery` forwards a session's request to the
    worker holding the session, and dead-letters what cannot be served."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        state: WorkerState,
        index: InFlightIndex,
        rules: AbortRules,
        streams: WorkerStreams,
        recovery: RecoveryStreams,
        publish: Callable[[InFlight], None],
        on_engine_dead: Callable[[EngineDeadError], None],
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.settings, self.engine, self.state, self.index, self.rules = settings, engine, state, index, rules
        self.streams, self.recovery, self.keys = streams, recovery, settings.keys
        self._publish, self._on_engine_dead = publish, on_engine_dead
        self.metrics = metrics  # None: nothing is counted
        self.totals = ServedTotals()  # generations run on the engine and what they made, for the heartbeat

    async def serve(self, record: InFlight) -> None:
        """Serve one entry; while Redis is away (pinning, dead-lettering), retry rather than drop it.

        Cancelled: the entry stays pending and is requeued at exit.
        """
        taken_at = time.time()
        for failures in itertools.count(1):
            try:
                return await self._serve_once(record, taken_at)
            except REDIS_ERRORS as exc:
                log.warning("serving %s failed (%s); retrying", record.entry.entry_id, exc)
                await asyncio.sleep(backoff_s(failures))

    async def _serve_once(self, record: InFlight, taken_at: float) -> None:
        """Run one entry and queue its result, or dead-letter it."""
        entry = record.entry
        try:
            request = decode(entry.payload)
        except InvalidRequestError as exc:  # a well-formed request with bad user parameters: tell its producer
            return await self._refuse(record, str(exc))
        except ProtocolError as exc:
            await self._dead_letter(entry, "undecodable", str(exc))
            return
        if entry.deliveries > self.settings.worker.max_deliveries:
            message = f"delivered {entry.deliveries} times without a result"
            await self._dead_letter(entry, "max_deliveries", message)
            return
        if (running := self.index.running(request.request_id)) is not None:
            return await self._second_delivery(record, request, running)
        self.index.decoded(record, request)
        if tracing.enabled():
            traces.taken(request, entry, self.state.worker_id, taken_at)
        if isinstance(request, RolloutRequest) and self.rules.hits(record):
            return self._answer(record, request, unrun_trajectory(request, "user", self.state.worker_id))
        if isinstance(request, RolloutRequest) and request.session_id and entry.stream == self.keys.requests:
            # A session's request in the shared stream (no live worker when it was sent, or requeued from a
            # dead one): pin the session here, unless a live worker holds it already. If one does (it took a
            # request of the same session from the shared stream first), this one goes to it: a session runs on
            # one worker at a time (found by the chaos soak: two requests of one turn ran on two workers at once).
            holder = await self.streams.pin_session(request.session_id, self.state.worker_id)
            if holder is not None and holder != self.state.worker_id:
                forward = Enqueue(
                    entry.payload, entry.session_id, entry.deliveries - 1, entry.epoch, cost=entry.cost, forward=True
                )  # to the holder even while it drains (found by the chaos soak: a pin to a draining worker dropped)
                await self.recovery.requeue([forward], [entry])  # placed on the holder; not counted as a delivery
                return
        try:
            result = await self._run(request, record, taken_at)
        except EngineDeadError as exc:
            self._on_engine_dead(exc)
            return  # unanswered, the entry stays pending: requeued when the worker exits
        if record.move_to is not None and isinstance(result, Trajectory) and await self._hand_over(record, result):
            return
        if isinstance(result, Trajectory) and await self._put_back(record, request, result):
            return
        self._answer(record, request, result)

    async def _second_delivery(self, record: InFlight, request: Request, running: InFlight) -> None:
        """A second delivery of a request this worker runs already: its enqueue was sent again after a lost reply, or
        resubmitted after Redis restarted (both entries pending here), or its entry was requeued while this worker was
        presumed dead (a stall past the heartbeat TTL) and the copy came back to it. It waits until the running copy
        is published: answered there, this one is acked without an answer; fenced there (its entry was requeued: this
        is the copy), this one is answered with its result. Before, it was always acked unanswered, and a chaos run
        lost a request so. Acked unanswered too where the running copy is another request (a retry of this one) or
        was not answered (handed over: its continuation answers)."""
        if running.task is not None:  # (never this one's own: it is not indexed by request id before it is decoded)
            await asyncio.wait([running.task])  # not its cancellation: this one is cancelled by its own cause
        same = running.request is not None and running.request.request_id == request.request_id
        answered = same and running.publishing and running.reply_to is not None
        while answered and not running.removed:  # until published (`fenced` then says how); a rare path: polled
            await asyncio.sleep(SECOND_DELIVERY_POLL_S)
        record.reply_to, record.payload = (
            (running.reply_to, running.payload) if answered and running.fenced else (None, b"")
        )
        self._publish(record)

    async def _hand_over(self, record: InFlight, result: Trajectory) -> bool:
        """Complete a straggler move (workers/moves.py): add the continuation of `result` (cut by the move) to the
        idle worker's pinned stream, then acknowledge the entry here without an answer. False (answer it: the
        producer retries it) if it was not cut by the move, has no tokens left to make, or Redis refused."""
        request, target = record.request, record.move_to
        if not isinstance(request, RolloutRequest) or target is None or result.abort_cause != "migrate":
            return False
        if len(result.completion_token_ids) >= request.sampling_params.max_tokens:
            return False
        moved = request.continued(result, request.original_request_id)
        entry = record.entry
        try:
            await self.streams.hand_over(target, Enqueue(encode(moved), epoch=entry.epoch, cost=entry.cost))
        except REDIS_ERRORS as exc:
            log.warning("moving %s to %s failed (%s): its producer retries it", request.request_id, target, exc)
            return False
        if self.metrics is not None:
            self.metrics.moves.inc()
        record.reply_to = None  # acknowledged without an answer: the continuation answers
        self._publish(record)
        return True

    async def _put_back(self, record: InFlight, request: Request, result: Trajectory) -> bool:
        """Put a rollout request that a pause (or a sleep) cut before it entered the engine back in the queue, as if
        it had not been taken, and acknowledge its entry here without an answer. Such a request was taken just as the
        pause landed here: typically the retry of a request the same pause cut on another worker, which this worker's
        read delivered before its own pause did (it waited for the pause, `WorkerState.control_applied`). Answered,
        it would reach its producer as a second interruption with nothing made, and be retried. One that was in the
        engine when the pause came, generating or waiting there, is cut and answered as vLLM's abort answers it.
        The copy keeps the payload, session, epoch and cost, and is not counted as a delivery. Like a move, it is
        delivered at least once: a worker dying in between leaves both copies, and the producer keeps the first
        answer. False (answer it) if it entered the engine, was cut for another cause, or Redis refused the copy."""
        if not isinstance(request, RolloutRequest) or result.finish_reason != "abort" or result.abort_cause != "pause":
            return False
        if record.entered_at:  # in the engine when the pause came: an interruption, answered
            return False
        entry = record.entry
        copy = Enqueue(entry.payload, entry.session_id, max(entry.deliveries - 1, 0), entry.epoch, cost=entry.cost)
        self.index.forget_request(record)  # the copy, taken here before this entry is acknowledged, runs
        try:
            await self.recovery.requeue([copy], [])
        except REDIS_ERRORS as exc:
            log.warning("putting %s back in the queue failed (%s): its producer retries it", request.request_id, exc)
            return False
        record.reply_to = None  # acknowledged without an answer (its cost off this worker's load): the copy answers
        self._publish(record)
        return True

    def _answer(self, record: InFlight, request: Request, result: Result) -> None:
        record.reply_to, record.payload, record.answered_at = request.reply_to, encode(result), time.time()
        if self.metrics is not None:
            self.metrics.observe(request, result)
        self._publish(record)

    async def _dead_letter(self, entry: Entry, code: ErrorCode, message: str) -> None:
        await self.recovery.dead_letter(
            entry,
            code,
            message,
            self.state.worker_id,
            maxlen=self.settings.worker.dead_letter_maxlen,
            results_ttl_s=self.settings.results_ttl_s,
        )

    async def _refuse(self, record: InFlight, message: str) -> None:
        address = reply_address(record.entry.payload)
        if address is None:
            await self._dead_letter(record.entry, "undecodable", message)
            return
        error = ErrorResult(
            request_id=address[0], code="invalid_request", message=message, worker_id=self.state.worker_id
        )
        record.reply_to, record.payload = address[1], encode(error)
        if self.metrics is not None:
            self.metrics.observe(None, error)
        self._publish(record)

    async def _run(self, request: Request, record: InFlight, taken_at: float) -> Result:
        if request.deadline is not None and request.deadline <= time.time():
            if isinstance(request, RolloutRequest):
                return unrun_trajectory(request, "deadline", self.state.worker_id)
            return self._error(request, "deadline_exceeded", "the deadline passed before a worker took the request")
        try:
            return await self._dispatch(request, record, taken_at)
        except UnknownAdapter as exc:
            return self._error(request, "unknown_adapter", str(exc))
        except InvalidRequestError as exc:
            return self._error(request, "invalid_request", str(exc))
        except EngineDeadError:
            raise
        except Exception as exc:  # one bad request never takes the worker down
            log.exception("request %s failed", request.request_id)
            return self._error(request, "engine_error", f"{type(exc).__name__}: {exc}", recoverable=True)

    async def _dispatch(self, request: Request, record: InFlight, taken_at: float) -> Result:
        worker_id = self.state.worker_id
        if isinstance(request, TokenizeRequest):
            if request.messages is not None:
                messages = [m.model_dump() for m in request.messages]
                ids = await self.engine.chat_prompt(messages, request.tools, request.chat_template_kwargs)
            else:
                ids = await self.engine.tokenize(request.text or "", request.add_special_tokens)
            return TokenizeResult(request_id=request.request_id, token_ids=ids, worker_id=worker_id)
        if isinstance(request, DetokenizeRequest):
            text = await self.engine.detokenize(request.token_ids, request.skip_special_tokens)
            return TokenizeResult(request_id=request.request_id, text=text, worker_id=worker_id)
        return await self._generate(request, record, taken_at)

    async def _generate(self, request: RolloutRequest, record: InFlight, taken_at: float) -> Trajectory:
        """Run a rollout request; a continuation goes on after its prior tokens and answers with the whole."""
        prompt = await self._prompt(request)
        prior = request.continuation
        params = request.sampling_params
        prior_ids = prior.token_ids if prior else []
        if prior is not None:
            kept = len(prior_ids)
            params = params.model_copy(
                update={"max_tokens": params.max_tokens - kept, "min_tokens": max(0, params.min_tokens - kept)}
            )
        # Enqueued after a control command this worker has not applied yet (a pause that cut it elsewhere): applied
        # first, bounded by two heartbeat intervals (the converger's own poll); served if still not
        await self.state.control_applied(record.entry.epoch, 2 * self.settings.worker.heartbeat_interval_s)
        if record.abort_cause is None and self._too_stale(request, record):
            record.abort_cause = "staleness"
        if record.abort_cause is not None:  # stopped before it reached the engine: it never will
            unrun = unrun_trajectory(request, record.abort_cause, self.state.worker_id)
            update: dict[str, object] = {"prompt_token_ids": prompt}
            if record.abort_cause == "staleness":  # judged by this worker's version: its producer's staleness too
                update["weight_version"] = max(unrun.weight_version, self.state.weight_version)
            return unrun.model_copy(update=update)
        adapter = None
        if request.adapter is not None and (adapter := self.state.adapters.acquire(request.adapter)) is None:
            raise UnknownAdapter(
                f"this worker holds no adapter {request.adapter} (loaded adapters: "
                f"{self.state.adapters.summary() or 'none'}); load it with `rollout-svc adapter load`"
            )
        started = time.time()
        record.in_engine, record.start_version = True, self.state.weight_version
        record.entered_at = time.monotonic()
        chunks = ChunkSender(self, request, len(prior_ids)) if request.stream else None
        try:
            lora_id = None if adapter is None else adapter.lora_id
            with traces.generation(request, self.state.worker_id, self.state.weight_version) as headers:
                generation = Generation(request.request_id, prompt, params, prior_ids, lora_id, headers)
                completion = await self.engine.generate(generation, chunks)
        finally:
            record.in_engine = False
            if adapter is not None:
                await self.state.adapters.release(adapter, self.engine)
        self.totals.generated(len(completion.completion_token_ids), time.time() - started)
        aborted = completion.finish_reason == "abort"
        tokens, logprobs, text = completion.completion_token_ids, completion.logprobs, completion.text
        tops, texts = completion.top_logprobs, completion.tokens
        resumed = False  # a retry that generated more: its whole completion is detokenized below
        if prior is not None:
            tokens, logprobs = prior.token_ids + tokens, prior.logprobs + logprobs
            resumed = bool(completion.completion_token_ids)
            if not resumed:
                text = prior.text
            if tops is not None:  # an earlier attempt's top logprobs, where it had them
                tops = (prior.top_logprobs or [[] for _ in prior.token_ids]) + tops
                texts = (prior.tokens or [""] * len(prior.token_ids)) + (texts or [])
        if request.text_as_detokenized and tokens and not aborted:  # as a DetokenizeRequest's default decodes them
            text = await self.engine.detokenize(tokens, True)
        elif resumed:  # the whole completion, detokenized whole: UTF-8 can split at the cut
            text = await self.engine.detokenize(tokens, params.skip_special_tokens)
        content, tool_calls = None, None
        if request.parse_tool_calls and request.tools and not aborted:
            content, calls = self.engine.parse_tool_calls(text, request.tools)
            tool_calls = calls or None
        spans = weight_spans(prior.weight_versions if prior else [], record, len(tokens))
        stale_cut = aborted and record.abort_cause == "staleness"
        # Built from this engine's own output, not validated again: the producer validates what it decodes.
        return construct(
            Trajectory,
            request_id=request.request_id,
            session_id=request.session_id,
            group_id=request.group_id,
            prompt_token_ids=prompt,
            completion_token_ids=tokens,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            text=text,
            # A cut for staleness names the version that judged it (its producer may not have read its commit yet).
            weight_version=max(spans[-1][0], self.state.weight_version) if stale_cut else spans[-1][0],
            weight_versions=spans,
            worker_id=self.state.worker_id,
            queue_time_s=max(0.0, taken_at - request.submitted_at),
            generation_time_s=time.time() - started,
            trace_id=tracing.trace_id(request.traceparent),
            abort_cause=(record.abort_cause or "shutdown") if aborted else None,
            interruptions=prior.interruptions if prior else 0,
            staleness=None,
            top_logprobs=tops,
            tokens=texts,
            tool_calls=tool_calls,
            content=content,
            # a retry's engine prompt goes on with the earlier attempt's tokens: the request's prompt is the part
            prompt_logprobs=None if completion.prompt_logprobs is None else completion.prompt_logprobs[: len(prompt)],
            cached_tokens=completion.cached_tokens,
            adapter=request.adapter,
            adapter_versions=adapter_spans(prior.adapter_versions if prior else [], adapter, len(prior_ids), tokens),
        )

    def _too_stale(self, request: RolloutRequest, record: InFlight) -> bool:
        """Whether `request` (`record`'s), being taken, would begin with a token staler than its bound: its
        continuation's first (those tokens are counted as discarded), else the first this worker would make now (its
        weights older than the request's `min_weight_version`)."""
        state = self.state
        floor = request.staleness_floor(max(state.committed_version, state.weight_version))
        if floor is None:
            return False
        first = record.first_token_version(0)  # the continuation's; None: it has no token yet
        if (state.weight_version if first is None else first) >= floor:
            return False
        prior = request.continuation
        if prior is not None and self.metrics is not None:
            self.metrics.stale_tokens.inc(len(prior.token_ids))
        return True

    async def _prompt(self, request: RolloutRequest) -> list[int]:
        """The prompt's token ids: given, or text tokenized with special tokens (as vLLM's completions API does), or
        messages rendered by the chat template (with the request's tools and template arguments)."""
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        if request.prompt is not None:
            return await self.engine.tokenize(request.prompt, True)
        messages = [m.model_dump() for m in request.messages or []]
        return await self.engine.chat_prompt(messages, request.tools, request.chat_template_kwargs)

    async def send_chunk(self, reply_to: str, chunk: TrajectoryChunk) -> None:
        """Send a streaming chunk; Redis away: dropped with a warning (the final trajectory holds every token)."""
        try:
            await self.streams.send_chunk(reply_to, encode(chunk), self.settings.results_ttl_s)
        except REDIS_ERRORS as exc:
            log.warning("a streaming chunk of %s was not sent (%s)", chunk.request_id, exc)

    def _error(self, request: Request, code: ErrorCode, message: str, recoverable: bool = False) -> ErrorResult:
        return ErrorResult(
            request_id=request.request_id,
            code=code,
            message=message,
            recoverable=recoverable,
            worker_id=self.state.worker_id,
        )


class ChunkSender:
    """The engine's `on_delta` for a streaming request: gathers its new tokens and sends them as `TrajectoryChunk`s
    into the producer's results stream. The first tokens of a completion go at once (time to first token is what an
    agent feels); after them, once `stream_chunk_tokens` have gathered, or `stream_interval_s` passed since the last
    send and 2 tokens or more have gathered, or 4 intervals passed (so a chunk holds a few tokens or tens of
    milliseconds of them, not one entry per token where each step is slower than the interval). A continuation
    (`offset` > 0: its caller has tokens already) gathers from the start. What is still gathered at the end is not
    sent: the final trajectory holds every token."""

    def __init__(
        self, server: RequestServer, request: RolloutRequest, offset: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.server, self.request, self.offset, self.clock = server, request, offset, clock
        worker = server.settings.worker
        self.interval_s, self.max_tokens = worker.stream_interval_s, worker.stream_chunk_tokens
        self.pending: list[Completion] = []
        self.last_sent = clock()
        self.first = offset == 0  # nothing of this completion streamed yet

    async def __call__(self, delta: Completion) -> None:
        self.pending.append(delta)
        gathered = sum(len(d.completion_token_ids) for d in self.pending)
        waited = self.clock() - self.last_sent
        # The first tokens; full; or an interval passed and it holds 2 tokens or more (not an entry per token where
        # steps are slow); or 4 intervals passed (a slow engine still streams).
        if (
            self.first
            or gathered >= self.max_tokens
            or (waited >= self.interval_s and gathered >= 2)
            or waited >= 4 * self.interval_s
        ):
            await self.flush()

    async def flush(self) -> None:
        pending, self.pending = self.pending, []
        if not pending:
            return
        part = joined(pending)
        chunk = construct(
            TrajectoryChunk,
            request_id=self.request.request_id,
            offset=self.offset,
            token_ids=part.completion_token_ids,
            logprobs=part.logprobs,
            text=part.text,
            worker_id=self.server.state.worker_id,
            top_logprobs=part.top_logprobs,
            tokens=part.tokens,
        )
        if self.first:  # this completion's first tokens: the caller's time to first token
            self.server.totals.first_token(self.request.submitted_at)
        self.offset += len(part.completion_token_ids)
        self.last_sent, self.first = self.clock(), False
        await self.server.send_chunk(self.request.reply_to, chunk)


class UnknownAdapter(InvalidRequestError):
    """The request names an adapter this worker does not hold (answered with code `unknown_adapter`)."""


def adapter_spans(
    prior: list[tuple[int, int]], adapter: AdapterRef | None, kept: int, tokens: list[int]
) -> list[tuple[int, int]]:
    """The `(adapter version, first token index)` spans of a completion: those of its earlier attempts, then this
    attempt's version from its first token (`kept`: the tokens before it) if it made any and the version differs."""
    spans = list(prior)
    if adapter is not None and (not spans or spans[-1][0] != adapter.version) and (len(tokens) > kept or not spans):
        spans.append((adapter.version, kept))
    return spans


def weight_spans(prior: list[tuple[int, int]], record: InFlight, total: int) -> list[tuple[int, int]]:
    """The `(weight version, first token index)` spans of a completion of `total` tokens: those of its earlier
    attempts (`prior`), then the version it entered the engine with (at the first token this attempt made), then
    each weight sync while it ran (`record.version_marks`, token indices counted over the whole completion).

    A span that holds no token is dropped (a sync at the very end, or two at one token), and so is a repeated
    version; a completion without tokens keeps one span, the version its engine had last.
    """
    request = record.request
    kept = len(request.continuation.token_ids) if isinstance(request, RolloutRequest) and request.continuation else 0
    spans: list[tuple[int, int]] = []
    for version, first in [*prior, (record.start_version, kept), *record.version_marks]:
        first = max(first, spans[-1][1] if spans else 0)
        if spans and spans[-1][1] == first:  # the span before holds no token: this one replaces it
            spans.pop()
        if spans and spans[-1][0] == version:
            continue
        spans.append((version, first))
    while len(spans) > 1 and spans[-1][1] >= total:
        spans.pop()
    return spans
