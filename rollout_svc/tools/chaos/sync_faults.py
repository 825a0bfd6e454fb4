"""The chaos soak's faults aimed at weight sync, beyond killing the trainer (`syncs.Syncer.kill`), and their checks.

  kill_receiving  SIGKILL a worker while a sync's buckets are on their way to it (the sync's tensors were announced
                  and it has not reached the `received` or `loaded` barrier yet); replaced as `kill` replaces one
  cut_pubsub      CLIENT KILL TYPE pubsub: every pub/sub connection drops (the workers' nudges, the acks the operator
                  awaits); each reconnects, and what was published meanwhile is lost (the heartbeat-interval polls
                  and the durable state must cover it)
  late_worker     start one more worker (`late-N`) and time it from live to serving the committed version (a peer
                  or a checkpoint catch-up; there is no trainer call for it); then stop it (SIGTERM, a drain)

Checks: a late worker serves within `LATE_WORKER_S` of going live, unless Redis restarted, the fleet was held paused
(by anyone: a sync's own pause too), a new version was committed or a peer it tried to catch up from was stopped
meanwhile (those are counted as excused);
after the trainer is killed, once its pause's lease has passed and nobody else holds a pause, no worker is still
paused two heartbeat intervals later (a worker stopped since the kill, stalled or killed, is left out: its last
heartbeat predates the lapse).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollout_svc.connections.urls import redis_async
from rollout_svc.keys import LOADED, RECEIVED
from rollout_svc.protocol import WeightSyncOrder, decode
from rollout_svc.tools.chaos.fleet import ChaosFleet, Journal, Slot, exited
from rollout_svc.tools.chaos.http_pauses import HTTP_PAUSE_LEASE_S
from rollout_svc.tools.chaos.http_pauses import KIND as HTTP_PAUSE_KILL
from rollout_svc.tools.chaos.ledger import Ledger
from rollout_svc.tools.chaos.service import fleet_state, fresh_labels
from rollout_svc.tools.chaos.syncs import SYNC_LEASE_S, Syncer

SYNC_FAULT_KINDS = ("kill_receiving", "cut_pubsub", "late_worker")
LATE_WORKER_S = 5.0  # its load time (milliseconds on the echo engine) + 5 s
MID_TRANSFER_WAIT_S = 6.0  # how long kill_receiving waits for a sync to be mid-transfer
EXCUSING = ("redis_restart", "pause", "kill_sender", "kill_receiving")  # faults that hold a late worker back
REDIS_AWAY = (RedisError, OSError)
STOPPING = ("stall", "kill", "kill_receiving")  # faults that stop a worker's process (their target: its worker id)
FAILED_PEER = re.compile(r"catching up to weight version \d+ from (\S+) failed")  # a late worker's log (catch_up.py)


def slot_id(worker_id: str) -> str:
    """The id a worker process was started under, without the incarnation a stall past its TTL adds (`w0~2` -> `w0`,
    as workers/state.py names them): what the faults' targets name."""
    return worker_id.split("~")[0]


class SyncFaults:
    """The faults of the module docstring; `violations` and `counts` (late workers timed, excused)."""

    def __init__(self, fleet: ChaosFleet, ledger: Ledger, journal: Journal, syncer: Syncer) -> None:
        self.fleet, self.ledger, self.journal, self.syncer = fleet, ledger, journal, syncer
        self.keys = fleet.settings.keys
        self.redis: Redis = redis_async(fleet.redis_url, decode_responses=False, socket_timeout=2.0)
        self.violations: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()
        self.late_busy = False
        self._late = 0

    async def close(self) -> None:
        await self.redis.aclose()

    # --- kill_receiving -------------------------------------------------------------------------------------

    async def receiving(self, candidates: list[str]) -> str | None:
        """A worker among `candidates` that a sync is sending to right now (waits up to `MID_TRANSFER_WAIT_S`)."""
        deadline = time.monotonic() + MID_TRANSFER_WAIT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(*REDIS_AWAY):
                order = await self._order()
                announced = order is not None and await self.redis.exists(self.keys.weight_manifest(order.sync_id))
                if order is not None and announced:
                    done: set[str] = set()
                    for phase in (RECEIVED, LOADED):
                        arrived: Any = await self.redis.hkeys(self.keys.weight_barrier(order.sync_id, phase))
                        done |= {w.decode() for w in arrived}
                    receiving = [w for w in order.members if w in candidates and w not in done]
                    if receiving:
                        return receiving[0]
            await asyncio.sleep(0.01)
        return None

    async def _order(self) -> WeightSyncOrder | None:
        data: Any = await self.redis.get(self.keys.weight_sync)
        order = decode(data) if data is not None else None
        return order if isinstance(order, WeightSyncOrder) else None

    # --- cut_pubsub -----------------------------------------------------------------------------------------

    async def cut_pubsub(self) -> int:
        """Drop every pub/sub connection; how many there were."""
        return int(await self.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub"))

    # --- late_worker ----------------------------------------------------------------------------------------

    async def late_worker(self, record: Callable[[str, str], None]) -> None:
        """Start `late-N`, time it to serving the committed version, stop it."""
        self.late_busy = True
        self._late += 1
        slot = Slot(f"late-{self._late}", f"late-{self._late}")
        try:
            self.fleet.spawn(slot)
            assert slot.process is not None
            record("late_worker", slot.worker_id)
            self.journal("late_worker", f"{slot.worker_id} (pid {slot.process.pid}) started")
            await self._time_late(slot)
        finally:
            if slot.process is not None:
                await self._stop(slot)
            self.late_busy = False

    async def _time_late(self, slot: Slot) -> None:
        live = await self._until(lambda: self._heartbeat(slot.worker_id, b"state"), 30.0)
        if live is None:
            self.journal("late_worker", f"{slot.worker_id} not live after 30 s (Redis away?): not timed")
            return
        started, commits = time.time(), self.syncer.counts["syncs_committed"]
        paused_s, paused_since = 0.0, None  # how long the fleet was held paused while it waited (a sync's pause too)

        async def serving() -> bool | None:
            nonlocal paused_s, paused_since
            state, version = await self._heartbeat_fields(slot.worker_id, b"state", b"weight_version")
            fleet, now = await fleet_state(self.redis, self.keys), time.time()
            if paused_since is not None:
                paused_s += now - paused_since
            paused_since = now if fleet.paused else None
            return (state == b"serving" and version == str(fleet.weight_version).encode()) or None

        took = await self._until(serving, 3 * LATE_WORKER_S) and time.time() - started
        excused = [
            f.kind for f in self.ledger.faults if f.kind in EXCUSING and started - 1.0 <= f.at <= time.time()
        ] + (["a commit"] if self.syncer.counts["syncs_committed"] != commits else [])
        excused += self._peers_stopped(slot, started)
        # on time but for the fleet being held paused: a sync whose receiver was killed a moment before it went live
        # holds its pause until its transfer fails (seed 1234, 2 minutes: 10 s, to a gloo read error)
        if took and took - paused_s <= LATE_WORKER_S < took:
            excused.append(f"the fleet held paused {paused_s:.1f} s of it")
        if took and took <= LATE_WORKER_S:
            self.counts["late_workers_on_time"] += 1
            self.journal("late_worker", f"{slot.worker_id} serving the committed version {took:.2f} s after live")
        elif excused:
            self.counts["late_workers_excused"] += 1
            what = f"took {took:.2f} s" if took else f"not serving after {3 * LATE_WORKER_S:g} s"
            self.journal("late_worker", f"{slot.worker_id} {what}; excused: {', '.join(sorted(set(excused)))}")
        else:
            what = f"took {took:.2f} s" if took else f"not serving after {3 * LATE_WORKER_S:g} s"
            self.journal("late_worker", f"{slot.worker_id} {what} to serve the committed version: a violation")
            self.violations.append(
                {"check": "late_worker", "what": f"{slot.worker_id} {what} to serve (at most {LATE_WORKER_S:g} s)"}
            )

    def _peers_stopped(self, slot: Slot, started: float) -> list[str]:
        """A stopping fault (`STOPPING`) of a peer the late worker tried to catch up from, and failed: it waits for an
        answer up to the heartbeat TTL, then asks another (docs/weight-sync.md), so each such peer may cost it a TTL.
        Counted from a TTL before it went live: a peer stopped then still looked live when it was picked."""
        try:
            lines = (self.fleet.log_dir / f"{slot.name}.log").read_text(errors="replace").splitlines()
        except OSError:
            return []
        failed = {slot_id(m.group(1)) for line in lines if (m := FAILED_PEER.search(line))}
        since = started - self.fleet.settings.heartbeat_ttl_s - 1.0
        return [
            f"{f.kind} of its peer {f.target}"
            for f in self.ledger.faults
            if f.kind in STOPPING and slot_id(f.target) in failed and since <= f.at <= time.time()
        ]

    async def _stop(self, slot: Slot) -> None:
        assert slot.process is not None
        with contextlib.suppress(ProcessLookupError):
            self.fleet.signal(slot, signal.SIGTERM)
        if not await exited(slot.process, 40.0):
            self.fleet.signal(slot, signal.SIGKILL)
            await exited(slot.process, 5.0)
        self.journal("late_worker", f"{slot.worker_id} stopped")

    async def _heartbeat(self, worker_id: str, field: bytes) -> bool | None:
        return bool(await self.redis.hget(self.keys.worker(worker_id), field)) or None

    async def _heartbeat_fields(self, worker_id: str, *fields: bytes) -> list[Any]:
        return list(await self.redis.hmget(self.keys.worker(worker_id), list(fields)))

    @staticmethod
    async def _until(probe: Callable[[], Awaitable[bool | None]], timeout_s: float) -> bool | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(*REDIS_AWAY):
                if await probe():
                    return True
            await asyncio.sleep(0.05)
        return None

    # --- a dead trainer's pause -----------------------------------------------------------------------------

    async def check_lapse(self, killed_at: float) -> None:
        """After `kill_sender`: when the dead trainer's lease is over (at most `SYNC_LEASE_S` after the kill) plus two
        heartbeat intervals (a worker reads the state, then beats, once an interval each) and half a second, no
        worker beating now says it is paused, unless someone holds a pause then, or held one that lapsed less than
        that long ago: an HTTP trainer killed within its lease and that much (found by seed 31: an HTTP pause that
        lapsed at the check's very moment still showed in two heartbeats). A killed or stalled worker's last
        heartbeat, not yet expired, is left out."""
        interval = self.fleet.settings.worker.heartbeat_interval_s
        await asyncio.sleep(SYNC_LEASE_S + 2 * interval + 0.5)
        with contextlib.suppress(*REDIS_AWAY):
            state = await fleet_state(self.redis, self.keys)
            lapsing = time.time() - (HTTP_PAUSE_LEASE_S + 2 * interval + 0.5)
            if (
                state.holders
                or any(f.kind == "redis_restart" and f.at >= killed_at for f in self.ledger.faults)
                or any(f.kind == HTTP_PAUSE_KILL and f.at >= lapsing for f in self.ledger.faults)
            ):  # another pause, lapsing yet in the heartbeats, or a Redis restart (no heartbeats)
                self.counts["lapse_checks_excused"] += 1
                return
            # Stopped since the kill (SIGSTOP or SIGKILL): its last heartbeat was written before the lapse's deadline
            # (one stalled 0.2 s before this check was judged on a heartbeat written while the lease still ran).
            stopped = {f.target for f in self.ledger.faults if f.kind in STOPPING and f.at >= killed_at}
            labels = await fresh_labels(self.redis, self.keys, 2 * interval)  # not killed, not stalled
            paused = [w for w, label in labels.items() if label == b"paused" and slot_id(w) not in stopped]
            self.counts["lapse_checks"] += 1
            if paused:
                waited = time.time() - killed_at
                what = f"{', '.join(paused)} still paused {waited:.1f} s after the trainer was killed, no pause held"
                self.violations.append({"check": "lapse", "what": what})
                self.journal("kill_sender", what)
