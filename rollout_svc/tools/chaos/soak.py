"""`rollout-svc chaos`: a Jepsen-style soak: steady load through echo workers while a nemesis injects faults, then
the ledger (`rollout_svc.tools.chaos.ledger`) and the fleet's end state are checked.

Everything runs on loopback as children of this process: a private `redis-server` (append-only, fsync every
second, its files in the log folder) and N echo workers with a short heartbeat TTL, so that a stall past the TTL
fits many times into a minute. Session drivers run multi-turn sessions (a turn is sent once the previous one was
answered; some turns send two requests of the session at once) and batch drivers send `run` calls of 8-32 prompts, all
on one `RolloutClient` (with syncs, every other batch call on a second one whose requests carry a staleness bound of 0:
`rollout_svc.tools.chaos.stale_load`), each request under an id of ours in the ledger. The nemesis draws fault kinds
from a shuffled deck (so each kind comes equally often) at random intervals, from a seeded RNG, and runs each as a task
of its own, so faults overlap (a stall outlives the next faults), within limits: one worker is always left alone, one
Redis restart and one pause (the nemesis's, or an HTTP holder's) at a time.

  kill           SIGKILL a worker's process group; a replacement starts 0.5-2 s later, as a process manager would
                 (alternately under the same worker id, which requeues what the dead one held at start, and a new
                 one, whose predecessor the others reap once its heartbeat expires)
  stall          SIGSTOP a worker for its heartbeat TTL + 1-2 s, then SIGCONT (it is reaped meanwhile, then fenced)
  redis_restart  stop Redis (alternately SIGTERM, which flushes the append-only file, and SIGKILL, which may lose
                 the last second of writes), leave it down 0.5-2 s, start it again from its files; with syncs, every
                 other pair of restarts waits (up to 6 s) for a sync mid-transfer first
  pause          pause in turn in each mode (keep, abort, wait) for 0.3-2 s, then resume (retried until acked)
  abort_session  abort(session_id=...) of a session with a turn in flight; its driver starts a new session
  kill_sender    SIGKILL the trainer that syncs weights every 1-3 s (`rollout_svc.tools.chaos.syncs`), whatever it is
                 doing (its pause must lapse by itself); another starts 0.5-2 s later. With `--no-syncs`, no trainer
  kill_receiving, cut_pubsub, late_worker: with syncs, see `rollout_svc.tools.chaos.sync_faults`.
  http_pause_kill  a trainer takes `POST /pause?mode=keep` on the soak's `serve` as its own holder and is SIGKILLed
                 before its `/resume`; agents' chats through serve must be answered once its lease lapses
                 (`rollout_svc.tools.chaos.http_pauses`). Never while the nemesis pauses or restarts Redis
  step_restart   a trainer runs a named step of 24 requests and is SIGKILLed mid-step; a new process attaches to the
                 step and must collect every request once, in order (`rollout_svc.tools.chaos.step_restarts`). Never
                 while Redis restarts

At the end the load stops, the faults under way finish (stalled workers continue, Redis is up, the fleet
resumed), the calls in flight return (each bounded by its timeout), and the run waits (bounded) for the queues to
drain and every worker slot to serve. Then: every request answered exactly once and correctly, no session on two
workers at once, nothing queued or pending, the fleet serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollout_svc.client.lifecycle import error_trajectory
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.connections.urls import redis_async
from rollout_svc.errors import RequestTimeoutError, RolloutError
from rollout_svc.keys import WORKERS_GROUP, Keys
from rollout_svc.protocol import ErrorResult, PauseMode, RolloutRequest, Trajectory, reply_address
from rollout_svc.tools.chaos.fleet import (
    CONTROL_TIMEOUT_S,
    ChaosConfig,
    ChaosFleet,
    Journal,
    Slot,
    exited,
    worker_errors,
)
from rollout_svc.tools.chaos.http_pauses import HttpPauses
from rollout_svc.tools.chaos.ledger import Answer, Ledger, Submitted, Verdict, check
from rollout_svc.tools.chaos.service import ServiceMonitor
from rollout_svc.tools.chaos.stale_load import bounded_client, client_for, report_line
from rollout_svc.tools.chaos.step_restarts import StepRestarts
from rollout_svc.tools.chaos.sync_faults import SYNC_FAULT_KINDS, SyncFaults
from rollout_svc.tools.chaos.syncs import SYNC_DEADLINE_S, Syncer

FAULT_KINDS = ("kill", "stall", "redis_restart", "pause", "abort_session", "http_pause_kill", "step_restart")
PAUSE_MODES: tuple[PauseMode, ...] = ("keep", "abort", "wait")
PROMPT_TOKENS = (32, 126)  # printable ASCII: the echo's text reads as its prompt
RESUME_PERSIST_S = 30.0  # a resume is retried this long: a fleet left paused would fail every later request
PROGRESS_EVERY_S = 10.0
SHOWN_VIOLATIONS = 20  # printed in full; the JSON line holds up to `JSON_VIOLATIONS`
JSON_VIOLATIONS = 100
CONTROL_ERRORS = (RolloutError, RedisError, OSError, TimeoutError)


# --- the load: session and batch drivers ------------------------------------------------------------------------


class Load:
    """Session drivers and batch drivers on one client (as a trainer's rollout loops share one), every other batch
    call on `bounded` where there is one (`stale_load`); every request goes in the ledger before it is sent, every
    answer when it comes."""

    def __init__(
        self,
        client: RolloutClient,
        ledger: Ledger,
        journal: Journal,
        config: ChaosConfig,
        bounded: RolloutClient | None = None,
    ) -> None:
        self.client, self.ledger, self.journal, self.config = client, ledger, journal, config
        self.bounded = bounded
        self.current: dict[int, str] = {}  # session driver -> its session now
        self.in_flight: set[str] = set()  # sessions with a turn in flight
        self.calls = self.calls_in_flight = self.refused_calls = 0
        self._run_id = uuid.uuid4().hex[:8]
        self._numbers = itertools.count()

    def start(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        seed = self.config.seed
        drivers = [self._sessions(i, random.Random(f"{seed}-s{i}"), stop) for i in range(self.config.session_drivers)]
        drivers += [self._batches(i, random.Random(f"{seed}-b{i}"), stop) for i in range(self.config.batch_drivers)]
        return [asyncio.create_task(driver) for driver in drivers]

    def pick_session(self, rng: random.Random) -> str | None:
        """A session with a turn in flight if there is one (an abort that hits something), else any."""
        candidates = sorted(self.in_flight) or sorted(self.current.values())
        return rng.choice(candidates) if candidates else None

    async def _sessions(self, driver: int, rng: random.Random, stop: asyncio.Event) -> None:
        """Multi-turn sessions: each turn's prompt is the last turn's prompt, its answer and a new user part. A turn
        that is not answered whole (aborted, refused, late) ends the session; the driver starts a new one."""
        for number in itertools.count():
            if stop.is_set():
                return
            session_id = self.current[driver] = f"s{driver}.{number}-{self._run_id}"
            history = _tokens(rng, 8, 24)
            for turn in range(rng.randint(2, 6)):
                if stop.is_set():
                    break
                prompts = [history + _tokens(rng, 2, 12) for _ in range(2 if rng.random() < 0.3 else 1)]
                self.in_flight.add(session_id)
                try:
                    answered = await self._call(f"session {session_id} turn {turn}", prompts, rng, session_id)
                finally:
                    self.in_flight.discard(session_id)
                if answered is None or any(t.finish_reason not in ("stop", "length") for t in answered):
                    break
                history = prompts[0] + answered[0].completion_token_ids
            with contextlib.suppress(RedisError, OSError):
                await self.client.finish_session(session_id)

    async def _batches(self, driver: int, rng: random.Random, stop: asyncio.Event) -> None:
        for number in itertools.count():
            if stop.is_set():
                return
            prompts = [_tokens(rng, 4, 32) for _ in range(rng.randint(8, 32))]
            client = client_for(number, self.client, self.bounded)
            await self._call(f"batch b{driver}.{number}", prompts, rng, None, client)

    async def _call(
        self,
        label: str,
        prompts: list[list[int]],
        rng: random.Random,
        session_id: str | None,
        client: RolloutClient | None = None,
    ) -> list[Trajectory] | None:
        """One `run` call on `client` (default the load's); each request's answer goes in the ledger. Returns the
        trajectories, or None if the call raised: refused at submission (Redis away, queue full), or late (past its
        timeout)."""
        client = client or self.client
        max_tokens = rng.randint(4, 32)
        ids = [f"chaos-{self._run_id}-{next(self._numbers)}" for _ in prompts]
        sessions = [session_id] * len(prompts) if session_id else None
        params = {"max_tokens": max_tokens, "temperature": 0.0}
        timeout_s = self.config.request_timeout_s
        requests = await client.rollout_requests(prompts, params, sessions, request_ids=ids, timeout_s=timeout_s)
        for request, prompt in zip(requests, prompts, strict=True):
            at, bound = request.submitted_at, request.max_staleness  # the bound the request carries, as sent
            self.ledger.submit(Submitted(request.request_id, prompt, max_tokens, at, session_id, label, bound))
        self.calls += 1
        self.calls_in_flight += 1
        try:
            trajectories = await client.run(requests, timeout_s=timeout_s)
        except RequestTimeoutError as exc:
            self._answer_late(requests, exc)
            return None
        except (RolloutError, RedisError, OSError) as exc:
            self._answer_all(requests, Answer(time.time(), refused=f"{type(exc).__name__}: {exc}"))
            self.refused_calls += 1
            await asyncio.sleep(0.2)  # Redis is away: do not spin
            return None
        finally:
            self.calls_in_flight -= 1
        received_at = time.time()
        for request, trajectory in zip(requests, trajectories, strict=True):
            self.ledger.answer(request.request_id, Answer(received_at, trajectory=trajectory))
        return trajectories

    def _answer_all(self, requests: Sequence[RolloutRequest], answer: Answer) -> None:
        for request in requests:
            self.ledger.answer(request.request_id, answer)

    def _answer_late(self, requests: Sequence[RolloutRequest], exc: RequestTimeoutError) -> None:
        received_at = time.time()
        self.journal(
            "late", f"{len(exc.request_ids)} requests unanswered after {exc.timeout_s:g} s: {exc.request_ids[:3]}"
        )
        for request in requests:
            result = exc.completed.get(request.request_id)
            if result is None:
                self.ledger.answer(request.request_id, Answer(received_at, late=True))
            else:
                self.ledger.answer(request.request_id, Answer(received_at, trajectory=_as_trajectory(request, result)))


def _tokens(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randint(*PROMPT_TOKENS) for _ in range(rng.randint(low, high))]


def _as_trajectory(request: RolloutRequest, result: Trajectory | ErrorResult) -> Trajectory:
    return result if isinstance(result, Trajectory) else error_trajectory(request, result)


# --- the nemesis ---------------------------------------------------------------------------------------------------


class Nemesis:
    """Injects faults at random intervals until stopped; each runs as a task of its own (see the module docstring)."""

    def __init__(
        self,
        fleet: ChaosFleet,
        operator: RolloutClient,
        load: Load,
        ledger: Ledger,
        journal: Journal,
        config: ChaosConfig,
        syncer: Syncer | None = None,
        http_pauses: HttpPauses | None = None,
        step_restarts: StepRestarts | None = None,
    ) -> None:
        self.fleet, self.operator, self.load, self.ledger, self.journal = fleet, operator, load, ledger, journal
        self.config, self.rng, self.syncer = config, random.Random(f"{config.seed}-nemesis"), syncer
        self.sync_faults = SyncFaults(fleet, ledger, journal, syncer) if syncer is not None else None
        self.http_pauses, self.step_restarts = http_pauses, step_restarts
        left_out = {"http_pause_kill": http_pauses is None, "step_restart": step_restarts is None}
        kinds = tuple(kind for kind in FAULT_KINDS if not left_out.get(kind, False))
        self.kinds = kinds + (("kill_sender", *SYNC_FAULT_KINDS) if syncer is not None else ())
        self.counts: Counter[str] = Counter({kind: 0 for kind in self.kinds})
        self.details: Counter[str] = Counter()  # pause modes, Redis signals, replacement ids
        self.anomalies: list[str] = []  # control commands that failed or timed out, faults that failed half-way
        self._redis_busy = self._pausing = False
        self._deck: list[str] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._faults: dict[str, Callable[[], Awaitable[None]]] = {
            "kill": self._kill,
            "stall": self._stall,
            "redis_restart": self._redis_restart,
            "pause": self._pause,
            "abort_session": self._abort_session,
            "kill_sender": self._kill_sender,
            "kill_receiving": self._kill_receiving,
            "cut_pubsub": self._cut_pubsub,
            "late_worker": self._late_worker,
            "http_pause_kill": self._http_pause_kill,
            "step_restart": self._step_restart,
        }

    async def run(self, stop: asyncio.Event) -> None:
        while not await _wait(stop, self.rng.uniform(*self.config.fault_gap_s)):
            kind = self._draw()
            if kind is not None:
                task = asyncio.create_task(self._apply(kind))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def heal(self, timeout_s: float) -> None:
        """Wait for the faults under way to finish: stalled workers continued, Redis up, the fleet resumed."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)

    def _draw(self) -> str | None:
        """The next kind from a shuffled deck of every kind, skipping (and keeping) those that cannot run now."""
        if not self._deck:
            self._deck = list(self.kinds)
            self.rng.shuffle(self._deck)
        for kind in self._deck:
            if self._possible(kind):
                self._deck.remove(kind)
                return kind
        return None

    def _possible(self, kind: str) -> bool:
        if kind in ("kill", "stall", "kill_receiving"):
            return len(self._free_slots()) >= 2  # one worker is always left alone
        if kind == "late_worker":
            return self.sync_faults is not None and not self.sync_faults.late_busy
        if kind == "cut_pubsub":
            return self.sync_faults is not None and not self._redis_busy
        if kind == "redis_restart":
            return not self._redis_busy and not self._http_pausing() and not self._stepping()
        if kind == "pause":
            return not self._pausing and not self._http_pausing()
        if kind == "http_pause_kill":  # its pause alone, Redis up: the chats through serve must all be answered
            return self.http_pauses is not None and not (self._http_pausing() or self._pausing or self._redis_busy)
        if kind == "step_restart":  # Redis up: a SIGKILL restart may lose the last second of the step's record
            return self.step_restarts is not None and not (self._stepping() or self._redis_busy)
        if kind == "kill_sender":
            return self.syncer is not None and self.syncer.process is not None
        return bool(self.load.current)

    def _http_pausing(self) -> bool:
        return self.http_pauses is not None and self.http_pauses.busy

    def _stepping(self) -> bool:
        return self.step_restarts is not None and self.step_restarts.busy

    def _free_slots(self) -> list[Slot]:
        return [s for s in self.fleet.slots if not s.busy and s.process is not None and s.process.poll() is None]

    async def _apply(self, kind: str) -> None:
        try:
            await self._faults[kind]()
        except Exception as exc:  # a fault that failed half-way is reported; the soak goes on
            self.anomalies.append(f"{kind}: {type(exc).__name__}: {exc}")
            self.journal(kind, f"FAILED: {type(exc).__name__}: {exc}")

    def _record(self, kind: str, target: str, *, applied: bool = True) -> None:
        """Note a fault in the ledger (evidence for violations near it); count it only if it took effect (a control
        command that failed while Redis was away did not, and is an anomaly instead)."""
        self.counts[kind] += applied
        self.ledger.fault(kind, target, time.time())

    async def _kill(self, slot: Slot | None = None, kind: str = "kill") -> None:
        slot = slot or self.rng.choice(self._free_slots())
        slot.busy = True
        try:
            assert slot.process is not None
            pid = self.fleet.signal(slot, signal.SIGKILL)
            self._record(kind, slot.worker_id)
            self.journal(kind, f"{slot.worker_id} (pid {pid}): SIGKILL")
            await exited(slot.process, 5.0)
            await asyncio.sleep(self.rng.uniform(0.5, 2.0))  # a process manager's restart delay
            slot.kills += 1
            same = slot.kills % 2 == 1
            if not same:
                slot.worker_id = f"{slot.name}-r{slot.kills}"
            self.fleet.spawn(slot)
            self.details["replaced under the same id" if same else "replaced under a new id"] += 1
            assert slot.process is not None
            self.journal("kill", f"replacement {slot.worker_id} (pid {slot.process.pid}) started")
        finally:
            slot.busy = False

    async def _stall(self) -> None:
        slot = self.rng.choice(self._free_slots())
        slot.busy = True
        stall_s = self.config.heartbeat_ttl_s + self.rng.uniform(1.0, 2.0)
        try:
            pid = self.fleet.signal(slot, signal.SIGSTOP)
            self._record("stall", slot.worker_id)
            self.journal("stall", f"{slot.worker_id} (pid {pid}): SIGSTOP for {stall_s:.1f} s")
            await asyncio.sleep(stall_s)
        finally:
            self.fleet.signal(slot, signal.SIGCONT)
            slot.busy = False
        self.journal("stall", f"{slot.worker_id} (pid {pid}): SIGCONT")

    async def _redis_restart(self) -> None:
        self._redis_busy = True
        sig = signal.SIGTERM if self.counts["redis_restart"] % 2 == 0 else signal.SIGKILL
        down_s = self.rng.uniform(0.5, 2.0)
        try:
            mid_sync = self.sync_faults is not None and self.counts["redis_restart"] % 4 >= 2  # every other pair
            if (
                mid_sync
                and self.sync_faults
                and await self.sync_faults.receiving([s.worker_id for s in self.fleet.slots])
            ):
                self.details["Redis restarted mid-transfer"] += 1
            self._record("redis_restart", sig.name)
            self.details[f"Redis {sig.name}"] += 1
            await self.fleet.stop_redis(sig)
            self.journal("redis_restart", f"Redis stopped with {sig.name}; down for {down_s:.1f} s")
            await asyncio.sleep(down_s)
            took_s = await self.fleet.start_redis()
            self.journal("redis_restart", f"Redis back from its append-only file ({took_s:.2f} s to answer)")
        finally:
            self._redis_busy = False

    async def _pause(self) -> None:
        self._pausing = True
        mode = PAUSE_MODES[self.counts["pause"] % len(PAUSE_MODES)]  # each mode as often
        try:
            paused = await self._control(
                "pause", f"mode {mode}", self.operator.pause(mode, timeout_s=CONTROL_TIMEOUT_S)
            )
            self._record("pause", mode, applied=paused)
            self.details[f"pause {mode}"] += paused
            await asyncio.sleep(self.rng.uniform(0.3, 2.0))
        finally:
            await self._resume()
            self._pausing = False

    async def _resume(self) -> None:
        deadline = time.monotonic() + RESUME_PERSIST_S
        while not await self._control("resume", "", self.operator.resume(timeout_s=CONTROL_TIMEOUT_S)):
            if time.monotonic() > deadline:
                self.journal("resume", f"gave up after {RESUME_PERSIST_S:g} s: the fleet may stay paused")
                return
            await asyncio.sleep(0.5)

    async def _kill_sender(self) -> None:
        assert self.syncer is not None and self.sync_faults is not None
        self._record("kill_sender", "trainer")
        killed_at = time.time()
        await self.syncer.kill(self.rng)
        await self.sync_faults.check_lapse(killed_at)

    async def _kill_receiving(self) -> None:
        assert self.sync_faults is not None
        free = {s.worker_id: s for s in self._free_slots()}
        worker_id = await self.sync_faults.receiving(list(free))
        slot = free.get(worker_id or "")
        if slot is None or slot.busy or len(self._free_slots()) < 2:
            self.journal("kill_receiving", "no sync mid-transfer to a free worker: skipped")
            return
        await self._kill(slot, "kill_receiving")

    async def _cut_pubsub(self) -> None:
        assert self.sync_faults is not None
        cut = await self.sync_faults.cut_pubsub()
        self._record("cut_pubsub", f"{cut} connections")
        self.journal("cut_pubsub", f"CLIENT KILL TYPE pubsub: {cut} connections dropped")

    async def _late_worker(self) -> None:
        assert self.sync_faults is not None
        await self.sync_faults.late_worker(self._record)

    async def _http_pause_kill(self) -> None:
        assert self.http_pauses is not None
        said = await self.http_pauses.kill_holder(self.rng, self._record)
        if not said.startswith("paused"):  # not a violation: the chats and the lapse are checked all the same
            self.anomalies.append(f"http_pause_kill: the trainer's /pause {said or 'was not answered'}")

    async def _step_restart(self) -> None:
        assert self.step_restarts is not None
        why = await self.step_restarts.restart(self.rng, self._record)
        if why:  # not a violation: the fault did not apply
            self.anomalies.append(f"step_restart: {why}")

    async def _abort_session(self) -> None:
        session_id = self.load.pick_session(self.rng)
        if session_id is None:
            return
        try:
            aborted = await self._control("abort_session", session_id, self.operator.abort(session_id=session_id))
            self._record("abort_session", session_id, applied=aborted)
        finally:  # acknowledged or not, it may have hit whatever the session had sent until now
            self.ledger.session_aborted(session_id, time.time())

    async def _control(self, kind: str, what: str, command: Awaitable[int]) -> bool:
        """Run a control command, bounded; journal how it went. False (and an anomaly) if it failed."""
        started = time.monotonic()
        try:
            epoch = await asyncio.wait_for(command, CONTROL_TIMEOUT_S + 5)
        except CONTROL_ERRORS as exc:
            self.anomalies.append(f"{kind} {what}".rstrip() + f": {type(exc).__name__}: {exc}")
            failed = f"failed after {time.monotonic() - started:.2f} s: {type(exc).__name__}: {exc}"
            self.journal(kind, f"{what} {failed}".lstrip())
            return False
        self.journal(kind, f"{what} acknowledged in {time.monotonic() - started:.2f} s (epoch {epoch})".lstrip())
        return True


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `event`; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)
    return event.is_set()


# --- the end state ----------------------------------------------------------------------------------------------


@dataclass
class EndState:
    """What the fleet looked like once settled: violations, and figures for the report."""

    violations: list[dict[str, Any]]
    streams: int
    workers: list[str]
    fenced_results: int
    dead_letters: int


async def settle(fleet: ChaosFleet, operator: RolloutClient, config: ChaosConfig, journal: Journal) -> EndState:
    """Wait (up to `settle_s`) until every requests stream is empty with nothing pending and every worker slot has
    a live, serving worker; then report what is not so, naming the requests still in Redis."""
    keys, deadline = fleet.settings.keys, time.monotonic() + config.settle_s
    redis = redis_async(fleet.redis_url, decode_responses=False)
    try:
        while True:
            backlog, streams = await _backlog(redis, keys)
            workers = await operator.workers()
            serving = [w.worker_id for w in workers if w.state == "serving"]
            settled = not backlog and len(serving) == len(workers) == config.workers
            if settled or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        violations = [await _stream_violation(redis, stream, counts) for stream, counts in backlog.items()]
        if not (len(serving) == len(workers) == config.workers):
            states = ", ".join(f"{w.worker_id} {w.state}" for w in workers) or "none"
            what = f"{config.workers} workers serving expected {config.settle_s:g} s after the faults; live: {states}"
            violations.append({"check": "fleet", "what": what})
        dead_letters = int(await redis.xlen(keys.dead))
    finally:
        await redis.aclose()
    journal("settle", f"{streams} requests streams, {len(backlog)} not empty; workers serving: {', '.join(serving)}")
    fenced = sum(w.fenced_results for w in workers)
    return EndState(violations, streams, serving, fenced, dead_letters)


async def _backlog(redis: Redis, keys: Keys) -> tuple[dict[str, tuple[int, int]], int]:
    """({stream: (length, pending)} of the requests streams that are not empty, how many streams there are)."""
    names = {keys.requests, keys.token_requests}
    async for name in redis.scan_iter(match=f"{keys.requests}:*", _type="stream"):
        names.add(name.decode())
    backlog = {}
    for name in sorted(names):
        length = int(await redis.xlen(name))
        pending = 0
        with contextlib.suppress(RedisError):  # no group yet: nothing pending
            pending = int((await redis.xpending(name, WORKERS_GROUP))["pending"])
        if length or pending:
            backlog[name] = (length, pending)
    return backlog, len(names)


async def _stream_violation(redis: Redis, stream: str, counts: tuple[int, int]) -> dict[str, Any]:
    """A violation naming what a stream still holds: request ids, and for pending ones their consumer."""
    holders: dict[Any, tuple[str, int]] = {}
    with contextlib.suppress(RedisError):
        pending: list[Any] = await redis.xpending_range(stream, WORKERS_GROUP, "-", "+", 20)
        holders = {p["message_id"]: (p["consumer"].decode(), p["times_delivered"]) for p in pending}
    held = []
    entries: Any = await redis.xrange(stream, count=20)
    for entry_id, fields in entries:
        address = reply_address(fields.get(b"m", b""))
        consumer, deliveries = holders.get(entry_id, ("queued", 0))
        held.append(f"{address[0] if address else entry_id.decode()} ({consumer}, delivered {deliveries})")
    what = f"{stream} holds {counts[0]} entries, {counts[1]} pending: {', '.join(held)}"
    return {"check": "drained", "what": what}


# --- the soak ----------------------------------------------------------------------------------------------------


def run_chaos(config: ChaosConfig, stream: IO[str] | None = None) -> dict[str, Any]:
    """Start the fleet, drive load and faults for `config.minutes`, drain, check, print the story and the findings
    on `stream` (default stdout), and return the summary (what the final JSON line holds: `requests`, `faults`,
    `violations`, ...). Every child process is killed on the way out, whatever happened; Ctrl-C and SIGTERM raise
    `KeyboardInterrupt` once they are."""
    journal = Journal(stream or sys.stdout)
    log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="rollout-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / "chaos.log")  # the client's warnings (Redis away, retries), not stdout
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    fleet = ChaosFleet(config, log_dir)
    try:
        summary, verdict = asyncio.run(_soak(config, fleet, journal))
    except asyncio.CancelledError as exc:  # SIGTERM (see `_cancel_on_sigterm`)
        raise KeyboardInterrupt from exc
    finally:
        fleet.close()
        root.removeHandler(handler)
        handler.close()
    summary["worker_errors"], summary["worker_error_samples"] = worker_errors(log_dir)
    _report(journal, summary, verdict)
    if summary["violations"] or summary["worker_errors"]:
        journal.print(f"logs (workers, Redis and its append-only file, this client) kept in {log_dir}")
    elif config.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    return summary


async def _soak(config: ChaosConfig, fleet: ChaosFleet, journal: Journal) -> tuple[dict[str, Any], Verdict]:
    _cancel_on_sigterm()
    journal.print(
        f"chaos: seed {config.seed}, {config.minutes:g} min of load and faults; {config.workers} echo workers "
        f"(capacity {config.capacity}, {config.token_delay_s * 1000:g} ms a token, heartbeat TTL "
        f"{config.heartbeat_ttl_s:g} s); Redis {fleet.redis_url} (append-only, fsync every second); logs in "
        f"{fleet.log_dir}"
    )
    await fleet.start()
    journal("fleet", f"Redis and {config.workers} workers up: {', '.join(s.worker_id for s in fleet.slots)}")
    ledger = Ledger(journal.started_at)
    syncer = Syncer(fleet, journal) if config.syncs else None
    http_pauses = HttpPauses(fleet, ledger, journal) if config.http_pauses else None
    if http_pauses is not None:
        await http_pauses.start()
    step_restarts = StepRestarts(fleet, ledger, journal) if config.step_restarts else None
    async with (
        RolloutClient(fleet.settings) as client,
        RolloutClient(fleet.settings) as operator,
        bounded_client(fleet.settings, config.syncs) as bounded,
    ):
        load = Load(client, ledger, journal, config, bounded)
        nemesis = Nemesis(fleet, operator, load, ledger, journal, config, syncer, http_pauses, step_restarts)
        supervisor = asyncio.create_task(fleet.supervise(journal))
        monitoring = asyncio.Event()
        monitor = asyncio.create_task(ServiceMonitor(fleet, ledger).run(monitoring))
        try:
            if syncer is not None:
                await syncer.start()
            failed_drivers = await _drive(load, nemesis, config, journal)
            monitoring.set()
            await monitor
            if syncer is not None:  # one more sync, then no trainer: its pause, if it held one, lapses
                await syncer.finish(timeout_s=2 * SYNC_DEADLINE_S)
            end = await settle(fleet, operator, config, journal)
        finally:
            monitoring.set()
            supervisor.cancel()
            if syncer is not None:
                await syncer.stop()
            if http_pauses is not None:
                await http_pauses.close()
        loads = [c.stats for c in (client, bounded) if c is not None]  # the load's clients, both
        client_stats = {"retries": sum(s.retries for s in loads), "duplicates": sum(s.duplicates for s in loads)}
    sync_violations: list[dict[str, Any]] = []
    if syncer is not None and nemesis.sync_faults is not None:
        await nemesis.sync_faults.close()
        syncer.check_versions(ledger)
        sync_violations = syncer.violations + nemesis.sync_faults.violations
    http_violations = http_pauses.violations if http_pauses is not None else []
    step_violations = step_restarts.violations if step_restarts is not None else []
    fault_violations = sync_violations + http_violations + step_violations
    verdict = check(ledger, failed_drivers + fleet.crashes + end.violations + fault_violations)
    summary = _summary(config, ledger, load, nemesis, verdict, end, client_stats, journal)
    if syncer is not None and nemesis.sync_faults is not None:
        summary["syncs"] = dict(syncer.counts) | dict(nemesis.sync_faults.counts)
    if verdict.bounds:
        summary["bounded"] = verdict.bounds
    if http_pauses is not None:
        summary["http_pauses"] = dict(http_pauses.counts)
    if step_restarts is not None:
        summary["step_restarts"] = dict(step_restarts.counts)
    return summary, verdict


async def _drive(load: Load, nemesis: Nemesis, config: ChaosConfig, journal: Journal) -> list[dict[str, Any]]:
    """Load and faults for `config.minutes`; then the faults heal and the calls in flight return (bounded). Returns
    a violation for each driver that raised (the client raised what it promises not to) or hung."""
    stop = asyncio.Event()
    drivers = load.start(stop)
    faults = asyncio.create_task(nemesis.run(stop))
    journal("load", f"{config.session_drivers} session drivers, {config.batch_drivers} batch drivers")
    until = time.monotonic() + config.minutes * 60
    while not await _wait(stop, min(PROGRESS_EVERY_S, until - time.monotonic())):
        if time.monotonic() >= until:
            stop.set()
            break
        journal("load", f"{load.ledger.answered} answered, {load.calls_in_flight} calls in flight")
    await faults
    journal("load", f"stopped: {load.calls_in_flight} calls in flight; waiting for the faults under way to end")
    await nemesis.heal(timeout_s=RESUME_PERSIST_S + CONTROL_TIMEOUT_S + 10)
    done, hung = await asyncio.wait(drivers, timeout=config.request_timeout_s + 10)
    for task in hung:  # past their own timeout: the ledger reports their requests as never answered
        task.cancel()
    violations = [{"check": "driver", "what": "a driver's call did not return within its timeout"} for _ in hung]
    for task in done:
        if task.exception() is not None:
            what = f"a driver's call raised {type(task.exception()).__name__}: {task.exception()}"
            violations.append({"check": "driver", "what": what})
    journal("load", f"{load.calls} calls returned" + (f"; {len(violations)} drivers failed" if violations else ""))
    return violations


def _cancel_on_sigterm() -> None:
    """SIGTERM (`timeout`, a supervisor) cancels the soak like Ctrl-C, so the children are killed on the way out."""
    task = asyncio.current_task()
    if task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)


def _summary(
    config: ChaosConfig,
    ledger: Ledger,
    load: Load,
    nemesis: Nemesis,
    verdict: Verdict,
    end: EndState,
    client_stats: dict[str, int],
    journal: Journal,
) -> dict[str, Any]:
    return {
        "requests": len(ledger.submitted),
        "answered": ledger.answered,
        "outcomes": dict(verdict.outcomes),
        "faults": dict(nemesis.counts),  # kill_sender: the trainer's; its syncs under "syncs"
        "violations": verdict.violations[:JSON_VIOLATIONS],
        "violations_total": len(verdict.violations),
        "calls": load.calls,
        "refused_calls": load.refused_calls,
        "fault_details": dict(sorted(nemesis.details.items())),
        "sessions": verdict.sessions,
        "client": client_stats,
        "fenced_results": end.fenced_results,
        "dead_letters": end.dead_letters,
        "crashes": len(nemesis.fleet.crashes),
        "anomalies": nemesis.anomalies[:JSON_VIOLATIONS],
        "seed": config.seed,
        "minutes": config.minutes,
        "elapsed_s": round(time.time() - journal.started_at, 1),
        "unserviceable_s": round(sum(until - since for since, until in ledger.unserviceable), 1),
    }


def _report(journal: Journal, summary: dict[str, Any], verdict: Verdict) -> None:
    """What the soak found, in words (the JSON line follows, printed by the caller)."""
    outcomes, sessions = verdict.outcomes, verdict.sessions
    faults = ", ".join(f"{n} {kind}" for kind, n in summary["faults"].items())
    journal.print("\nfound:")
    journal.print(f"  faults      {faults} ({', '.join(f'{n} {d}' for d, n in summary['fault_details'].items())})")
    journal.print(
        f"  requests    {summary['requests']} in {summary['calls']} calls: {outcomes['ok']} echoed whole, "
        f"{outcomes['aborted_by_user']} aborted explicitly, {outcomes['refused']} refused at submission "
        f"({summary['refused_calls']} calls, Redis away), {outcomes['dead_letter']} dead letters, "
        f"{outcomes['late']} late, {outcomes['late_excused']} late while no worker could serve (excused)"
    )
    journal.print(
        f"  sessions    {sessions.get('sessions', 0)} sessions, {sessions.get('timed_requests', 0)} requests timed on "
        f"their worker, {sessions.get('moves', 0)} moves between workers, {sessions.get('untimed', 0)} retried "
        "(untimed)"
    )
    journal.print(
        f"  fleet       workers fenced {summary['fenced_results']} results; the load's clients retried "
        f"{summary['client']['retries']} token-exact and dropped {summary['client']['duplicates']} duplicates; "
        f"{summary['dead_letters']} dead letters in Redis"
    )
    if "syncs" in summary:
        journal.print(f"  syncs       {', '.join(f'{n} {what}' for what, n in summary['syncs'].items())}")
    if "bounded" in summary:
        journal.print(report_line(summary["bounded"]))
    if "http_pauses" in summary:
        journal.print(f"  http pauses {', '.join(f'{n} {what}' for what, n in summary['http_pauses'].items())}")
    if "step_restarts" in summary:
        journal.print(f"  steps       {', '.join(f'{n} {what}' for what, n in summary['step_restarts'].items())}")
    for anomaly in summary["anomalies"][:SHOWN_VIOLATIONS]:
        journal.print(f"  anomaly     {anomaly}")
    if summary["worker_errors"]:
        journal.print(f"  workers     logged {summary['worker_errors']} errors, among them:")
        for sample in summary["worker_error_samples"]:
            journal.print(f"                {sample}")
    if not verdict.violations:
        journal.print(
            "  violations  none: every request answered exactly once, no session on two workers at once, "
            "nothing left queued or pending"
        )
        return
    journal.print(f"  violations  {len(verdict.violations)}:")
    for violation in verdict.violations[:SHOWN_VIOLATIONS]:
        near = f" (faults near: {'; '.join(violation['faults_near'])})" if violation.get("faults_near") else ""
        where = f" {violation['request_id']} [{violation.get('call', '')}]" if "request_id" in violation else ""
        journal.print(f"    {violation['check']}:{where} {violation['what']}{near}")
