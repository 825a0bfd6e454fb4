"""Straggler moves: a worker that runs several generations while another worker has nothing cuts its longest-running
one and hands its continuation, token-exact, to the idle worker (DESIGN.md section 6b, "Moves").

At the end of an RL step most GPUs have finished their share while a few still run the long tail, each several
long generations at once: on a GPU every decode step reads the weights and every running sequence's KV cache, so a
sequence that shares its GPU decodes slower than one alone. Moving it to an idle GPU costs a prefill of its prompt
and the tokens it made (one step of up to 8,192 tokens, against one step per token of decode) and takes it out of
its old batch. The rule, checked every `move_check_s` by each worker:

- placement is by cost, moves are on (`WorkerSettings.move_stragglers`), and this worker runs at least 2
  generations (a request alone on its GPU gains nothing by moving);
- some other worker holds no work and has a free slot (`WorkerStreams.idle_workers`: load 0 in `Keys.loads`);
- then its generations that have been in the engine at least `move_after_s`, not of a session (sessions stay
  sticky), moved fewer than `MAX_MOVES` times and worth a re-prefill (below) go one to each idle worker, those that
  have made the most tokens first, leaving at least one here.

Which to move: output lengths in RL are long-tailed (log-normal-like), whose hazard falls with age, so the
generation that has made the most tokens is the one expected to run longest (the "Lindy" estimate: as many more
tokens as it has made, at most what its `max_tokens` leaves). In a step where every request starts at once, the
oldest is any of them; the longest-running is the straggler. Worth it: its expected rest is at least
1/`REPREFILL_RATIO` of the tokens it must prefill again there (prompt and output so far): a prefill step computes
thousands of tokens in the time of a few decode steps (the simulator's H100 profile: 8,192 tokens of a 7B model in
about 30 decode steps' time), so the ratio only keeps a move from re-prefilling a long context to save a few tokens.

A move is an abort in the engine with cause `migrate`; the serve path then adds the continuation (same request id,
its tokens, logprobs and weight-version spans; `Trajectory.interruptions` counts the move) to the idle worker's pinned
stream before it acknowledges the old entry (a worker dying in between delivers it twice; the producer keeps the
first answer). If that fails, the partial trajectory goes back to its producer, which retries it token-exact.
Each move is logged with its estimate and counted (`rollout_worker_moves`).
"""

from __future__ import annotations

import logging
import time

from rollout_svc.config import Settings
from rollout_svc.connections.urls import REDIS_AWAY
from rollout_svc.dataplane.worker_streams import WorkerStreams
from rollout_svc.protocol import RolloutRequest
from workers.inflight import InFlight, InFlightIndex
from workers.metrics import WorkerMetrics

log = logging.getLogger("rollout_svc.worker")
MAX_MOVES = 2  # a request is moved at most this many times (interruptions of any cause count)
REPREFILL_RATIO = 16  # a move's expected rest must be at least 1/16 of the tokens it prefills again


class StragglerMover:
    """Decides and starts this worker's moves (`check`, called by the sweep loop); the serve path completes them."""

    def __init__(
        self,
        settings: Settings,
        worker_id: str,
        index: InFlightIndex,
        streams: WorkerStreams,
        metrics: WorkerMetrics | None,
    ) -> None:
        self.settings, self.worker_id, self.index, self.streams = settings, worker_id, index, streams
        self.metrics = metrics
        self._next_check = 0.0

    def enabled(self) -> bool:
        worker = self.settings.worker
        return worker.move_stragglers and worker.placement == "cost"

    async def check(self) -> int:
        """Move what the rule allows now (at most every `move_check_s`); returns how many moves were started."""
        now = time.monotonic()
        if not self.enabled() or now < self._next_check:
            return 0
        self._next_check = now + self.settings.worker.move_check_s
        running = [r for r in self.index.records() if r.generation and r.in_engine and r.abort_cause is None]
        if len(running) < 2:
            return 0
        made = {id(r): self._made(r) for r in running}
        movable = sorted(
            (r for r in running if self._movable(r, now) and self._worth_it(r, made[id(r)])),
            key=lambda r: (-made[id(r)], r.entered_at),
        )
        if not movable:
            return 0
        try:
            idle = await self.streams.idle_workers(self.worker_id, int(self.settings.heartbeat_ttl_s * 1000))
        except REDIS_AWAY as exc:  # nothing moves while Redis is away; the next check tries again
            log.debug("no straggler moves: Redis is away (%s)", exc)
            return 0
        moves = list(zip(movable[: len(running) - 1], idle, strict=False))
        for record, target in moves:
            assert isinstance(record.request, RolloutRequest)
            record.move_to = target
            log.info(
                "moving %s to idle worker %s: %d tokens made in %.1f s beside %d other generations here; expected "
                "rest about as many, against a re-prefill of %d tokens there",
                record.request.request_id,
                target,
                made[id(record)],
                now - record.entered_at,
                len(running) - 1,
                len(record.request.prompt_token_ids or ()) + made[id(record)],
            )
            await self.index.cancel(record, "migrate")
        return len(moves)

    def _made(self, record: InFlight) -> int:
        """Output tokens `record`'s generation has made, here and before any earlier interruption."""
        request = record.request
        assert isinstance(request, RolloutRequest)
        kept = len(request.continuation.token_ids) if request.continuation is not None else 0
        return kept + (self.index.engine.output_tokens(request.request_id) or 0)

    def _worth_it(self, record: InFlight, made: int) -> bool:
        """Its expected rest (as many tokens as made, at most what `max_tokens` leaves) is at least
        1/`REPREFILL_RATIO` of the tokens a continuation prefills again."""
        request = record.request
        assert isinstance(request, RolloutRequest)
        rest = min(made, request.sampling_params.max_tokens - made)
        return made > 0 and rest * REPREFILL_RATIO >= len(request.prompt_token_ids or ()) + made

    def _movable(self, record: InFlight, now: float) -> bool:
        request = record.request
        if not isinstance(request, RolloutRequest) or request.session_id is not None:
            return False
        moved = request.continuation.interruptions if request.continuation is not None else 0
        return moved < MAX_MOVES and now - record.entered_at >= self.settings.worker.move_after_s
