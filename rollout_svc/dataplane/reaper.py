"""Reclaiming what dead workers held: their pending entries and pinned backlog go back to the queue (Redis only).

A worker whose heartbeat expired is dead. The live worker that wins its reap lock requeues the entries it had
taken (pending in any requests stream) and those waiting in its pinned stream, through the same placement
script as any enqueue, so sessions are re-pinned to live workers. An entry already delivered `max_deliveries`
times becomes a dead letter and its producer is told. Each batch is requeued and acked in one script, so a crash
here loses nothing. No process is needed: a test drives a `Reaper` directly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Collection

from redis.asyncio import Redis

from rollout_svc.config import Settings
from rollout_svc.dataplane.recovery_streams import RecoveryStreams
from rollout_svc.dataplane.registry import Registry
from rollout_svc.dataplane.streams import Enqueue, Entry, StreamConnection, entry_id_key

log = logging.getLogger("rollout_svc.dataplane.reaper")
REAP_LOCK_TTL_S = 60.0
REAP_TURN_SHARE = 0.9  # of a heartbeat interval: a reap turn lapses before its holder's next pass, so any may take it
FORGET_ATTEMPTS = 10  # a consumer still taking entries while it is reaped: requeue, and try to forget it, this often


class Reaper:
    """Requeues dead workers' requests (an entry delivered too often becomes a dead letter)."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.settings, self.keys = settings, settings.keys
        self.streams = RecoveryStreams(StreamConnection(redis, self.keys, settings.session_ttl_s))
        self.registry = Registry(redis, self.keys, settings.heartbeat_ttl_s)
        self._ttl_ms = int(settings.heartbeat_ttl_s * 1000)
        self._turn_s = REAP_TURN_SHARE * settings.worker.heartbeat_interval_s

    async def reap_dead(self, reaper_id: str) -> dict[str, int]:
        """Reclaim every registered worker whose heartbeat expired and whose reap lock this caller wins, and every
        consumer that holds pending entries, is idle past the heartbeat TTL and has no heartbeat (a worker reaped
        while it lived that took more before it noticed, then died: it is no longer registered).

        Looking reads every registered worker's heartbeat: the workers take turns (`Registry.take_reap_turn`, held for
        most of a heartbeat interval), so the fleet looks about once an interval, not once per worker. A pass that
        finds a dead worker whose reap lock another holds gives the turn up, so that one's next pass looks at once.

        Returns {dead worker id: requests requeued} ({} where it was not this caller's turn).
        """
        if not await self.registry.take_reap_turn(reaper_id, self._turn_s):
            return {}
        reaped = {}
        dead = await self.registry.dead_workers()
        for stream in (self.keys.requests, self.keys.token_requests):
            for consumer in await self.streams.orphaned_consumers(stream, self._ttl_ms):
                if consumer not in dead and not await self.registry.alive(consumer):
                    dead.append(consumer)
        for dead_worker_id in dead:
            moved = await self.reap(dead_worker_id, reaper_id, retake=True)  # one reap loop per reaper id
            if moved is not None:
                reaped[dead_worker_id] = moved
                log.warning("worker %s is dead: requeued %d of its requests", dead_worker_id, moved)
        if len(reaped) < len(dead):
            await self.registry.pass_reap_turn(reaper_id)
        return reaped

    async def reap(self, worker_id: str, reaper_id: str, *, retake: bool = False) -> int | None:
        """Reclaim one worker (dead, or this process's own former incarnation) if its reap lock is free.

        Returns how many requests were requeued, or None if another process holds the lock. `retake`: `reaper_id`
        may hold it already, from a reap of its that Redis cut short (`Registry.try_reap_lock`); only for a caller
        that never reaps twice at once under that id (`reap_dead`, from a worker's one reap loop).
        """
        if not await self.registry.try_reap_lock(worker_id, reaper_id, REAP_LOCK_TTL_S, retake=retake):
            return None
        if await self.registry.alive(worker_id):
            # A process came back under this id after it was found dead (a restart under the same id, which holds
            # this lock while it starts): its streams are its own again, and requeueing them would place them back.
            await self.registry.release_reap_lock(worker_id, reaper_id)
            return None
        moved = await self.reclaim(worker_id, backlog=True)
        await self.streams.forget_load(worker_id)  # else the loads hash keeps every dead id, read by every take
        await self.registry.forget(worker_id)
        return moved

    async def reclaim(self, worker_id: str, *, backlog: bool) -> int:
        """Requeue what `worker_id` holds: its pending entries in every requests stream, and with `backlog` its
        pinned stream's undelivered entries too (then the stream and the consumer go). Returns how many moved."""
        pinned = self.keys.pinned_requests(worker_id)
        moved = 0
        for stream in (self.keys.requests, pinned, self.keys.token_requests):
            while entries := await self.streams.pending_of(stream, worker_id):
                moved += await self.requeue(entries)
        if backlog:
            while entries := await self.streams.undelivered(pinned):
                moved += await self.requeue(entries)
            await self.streams.delete(pinned)
            for stream in (self.keys.requests, self.keys.token_requests):
                # A worker reaped while it lived (Redis forgot its heartbeat; a stall) may take more meanwhile: its
                # consumer goes only once it holds nothing, what it took since being requeued first.
                for _ in range(FORGET_ATTEMPTS):
                    if await self.streams.forget_consumer(stream, worker_id):
                        break
                    while entries := await self.streams.pending_of(stream, worker_id):
                        moved += await self.requeue(entries)
        return moved

    async def hold_lock_to_start(self, worker_id: str) -> str:
        """Take the reap lock of a worker's own id before it registers under it. An earlier process with this id
        (a restart under the same id) may be being reaped right now: the reaper deletes the pinned stream and the
        consumer when it is done, so this waits for it (at most the lock's TTL), and then no reaper starts on this
        id until it is registered and live. Returns the lock's holder value. `RuntimeError` if it stays held."""
        holder = f"starting:{os.getpid()}"  # the same on a retry, which may find the lock still held by it
        deadline = time.monotonic() + REAP_LOCK_TTL_S + 5
        while not await self.registry.try_reap_lock(worker_id, holder, REAP_LOCK_TTL_S):
            current = await self.registry.reap_lock_holder(worker_id)
            if current == holder:
                break
            if current is not None and _own_id_holder(current, worker_id) and not await self.registry.alive(worker_id):
                # Held by an earlier process under this id, not by a reaper, and no process lives under it: that
                # one is gone (it died holding it, or a Redis restart lost its release: a 10-minute chaos soak saw a
                # replacement wait out the 60 s TTL so). Its lock is let go, and taken again at the loop's top.
                log.info(
                    "the reap lock of %s was held by its earlier process (%s), now gone: taken over", worker_id, current
                )
                await self.registry.release_reap_lock(worker_id, current)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"the reap lock of worker id {worker_id} stayed held for {REAP_LOCK_TTL_S} s")
            log.info("another worker is requeueing what an earlier %s left; waiting for it", worker_id)
            await asyncio.sleep(0.2)
        return holder

    async def release_backlog(self, worker_id: str) -> int:
        """A live worker that takes no work for a while (stale: its weights are not the committed version; it
        catches up or waits for the next sync) puts the entries waiting in its pinned stream back through placement,
        which pins their sessions to workers that can serve them (or queues them shared if none can). Its heartbeat
        must say so first: placement keeps a pin to a serving or paused worker. Only the entries there when it
        starts move (one that placement puts back meanwhile stays). Under the worker's reap lock, so a reaper that
        finds it dead meanwhile does not requeue them too. Returns how many moved; 0 if the lock is held."""
        if not await self.registry.try_reap_lock(worker_id, worker_id, REAP_LOCK_TTL_S):
            return 0
        pinned, moved = self.keys.pinned_requests(worker_id), 0
        try:
            last = await self.streams.last_id(pinned)
            after: bytes | None = None
            while last is not None and (entries := await self.streams.undelivered(pinned, after=after)):
                entries = [e for e in entries if entry_id_key(e.entry_id) <= entry_id_key(last)]
                if not entries:
                    break
                after = entries[-1].entry_id
                moved += await self.requeue(entries)
        finally:
            await self.registry.release_reap_lock(worker_id, worker_id)
        if moved:
            log.info("worker %s is stale: %d requests pinned to it placed on workers that serve", worker_id, moved)
        return moved

    async def requeue_orphans(self, worker_id: str) -> int:
        """After a Redis restart: requeue the entries of the shared streams and `worker_id`'s pinned stream that no
        read will deliver (`RecoveryStreams.orphans`), under one reap lock per stream so that workers reconciling at
        once do not each requeue them. Returns how many moved (and logs it)."""
        moved = 0
        for stream in (self.keys.requests, self.keys.pinned_requests(worker_id), self.keys.token_requests):
            if not await self.registry.try_reap_lock(f"orphans:{stream}", worker_id, REAP_LOCK_TTL_S):
                continue
            try:
                while entries := await self.streams.orphans(stream):
                    moved += await self.requeue(entries)
            finally:
                await self.registry.release_reap_lock(f"orphans:{stream}", worker_id)
        if moved:
            log.warning("Redis brought back %d requests behind the consumer group (no read gets them): requeued", moved)
        return moved

    async def pending_keys(self, worker_id: str, streams: Collection[str], count: int) -> set[tuple[str, bytes]]:
        """(stream, entry id) of up to `count` entries of each of `streams` pending on `worker_id` (XPENDING)."""
        return {(s, i) for s in streams for i in await self.streams.pending_ids(s, worker_id, count)}

    async def requeue_forgotten(
        self, worker_id: str, held: Callable[[], Collection[tuple[str, bytes]]], settle_s: float | None = None
    ) -> int:
        """After a Redis restart that lost its last second of writes (killed, `appendfsync everysec`): requeue the
        entries Redis holds pending on `worker_id` (shared, pinned and token streams) that the worker no longer has
        in flight. A request it answered in that second comes back so: the publish script's result, ack and delete
        were lost together, perhaps after its producer read the result; nothing reads a worker's own pending list
        but the reaper of a dead worker, so such an entry stayed pending for good (a chaos run's drain found one),
        and a producer that lost the result too and asked `ProducerStreams.held` would have waited on it.

        `held()`: (stream, entry id) of what the worker has in flight now. Two looks `settle_s` apart: an entry a
        read had delivered but the worker had not yet put in flight at the first look is held at the second, and
        one it answered meanwhile is acked; only an entry unheld at both is requeued (served again: a producer that
        has its result drops the second one). `settle_s` defaults to a blocking read's time and a second. Returns
        how many moved (and logs it)."""

        streams = (self.keys.requests, self.keys.pinned_requests(worker_id), self.keys.token_requests)
        first = await self.pending_keys(worker_id, streams, 1000) - set(held())  # ids only: most are held
        if not first:
            return 0
        await asyncio.sleep(self.settings.read_block_ms / 1e3 + 1 if settle_s is None else settle_s)
        forgotten = first & (await self.pending_keys(worker_id, streams, 1000) - set(held()))
        if not forgotten:
            return 0
        entries = [
            e for s in streams for e in await self.streams.pending_of(s, worker_id) if (s, e.entry_id) in forgotten
        ]
        moved = await self.requeue(entries)
        if entries:
            log.warning(
                "Redis holds %d requests pending on %s that it no longer has in flight (answered before a restart "
                "that lost the acknowledgement): requeued",
                len(entries),
                worker_id,
            )
        return moved

    async def requeue(self, entries: list[Entry]) -> int:
        """Put entries back in the queue (same payload, session and epoch; deliveries carried), ack the old ones.

        Entries already delivered `max_deliveries` times become dead letters. Returns how many were requeued.
        """
        items, done = [], []
        for entry in entries:
            if entry.deliveries >= self.settings.worker.max_deliveries:
                message = f"delivered {entry.deliveries} times; each worker that took it died"
                await self.streams.dead_letter(
                    entry,
                    "max_deliveries",
                    message,
                    "",
                    maxlen=self.settings.worker.dead_letter_maxlen,
                    results_ttl_s=self.settings.results_ttl_s,
                )
                continue
            tokens = entry.stream == self.keys.token_requests
            items.append(Enqueue(entry.payload, entry.session_id, entry.deliveries, entry.epoch, tokens, entry.cost))
            done.append(entry)
        if items:
            await self.streams.requeue(items, done)
        return len(items)


def _own_id_holder(holder: str, worker_id: str) -> bool:
    """Whether a reap lock's holder is a process of the worker id itself (one starting, `hold_lock_to_start`, or
    one handing its backlog on, `release_backlog`) rather than a reaper (another worker's id)."""
    return holder.startswith("starting:") or holder == worker_id
