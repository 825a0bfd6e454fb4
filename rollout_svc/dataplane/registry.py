"""Worker liveness: heartbeat hashes with a TTL, the set of registered workers, and the reap lock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from rollout_svc.dataplane.scripts import HEARTBEAT_LUA, RELEASE_LOCK_LUA, RETAKE_LOCK_LUA
from rollout_svc.keys import Keys
from rollout_svc.protocol import WorkerStatus


class Registry:
    """A worker is live while its heartbeat hash exists; it expires `heartbeat_ttl_s` after the last beat."""

    def __init__(self, redis: Redis, keys: Keys, heartbeat_ttl_s: float) -> None:
        self.redis, self.keys = redis, keys
        self._ttl_ms = int(heartbeat_ttl_s * 1000)
        self._beat = redis.register_script(HEARTBEAT_LUA)
        self._release = redis.register_script(RELEASE_LOCK_LUA)
        self._retake = redis.register_script(RETAKE_LOCK_LUA)

    async def load_scripts(self) -> None:
        """Load the script once, so that no EVALSHA meets NOSCRIPT in the normal course."""
        self._beat.sha = await self.redis.script_load(self._beat.script)

    async def heartbeat(self, status: WorkerStatus, *, renew: bool = False, announce: bool = False) -> bool:
        """Write the heartbeat hash, reset its TTL, and (re-)register the worker id, in one step.

        `renew`: refuse (return False) if the hash has expired since the last beat. `announce`: also publish
        "worker_id applied_epoch error_epoch" on the acks channel, so an issuer waiting for this epoch hears at
        once (and whether it failed here).
        """
        fields = [x for item in status.to_hash().items() for x in item]
        channel = self.keys.acks_channel if announce else ""
        announcement = f"{status.worker_id} {status.applied_epoch} {status.error_epoch}"
        args: list[str | int] = [self._ttl_ms, status.worker_id, int(renew), channel, announcement]
        keys = [self.keys.worker(status.worker_id), self.keys.workers]
        return bool(await self._beat(keys=keys, args=[*args, *fields]))

    async def deregister(self, worker_id: str) -> None:
        """A clean exit: the worker is gone at once, not after its TTL."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.worker(worker_id), self.keys.worker_sessions(worker_id))
        pipe.srem(self.keys.workers, worker_id)
        await pipe.execute()

    async def worker_ids(self) -> list[str]:
        """Every registered worker id (live, or dead and not yet reaped), sorted."""
        members: Any = await self.redis.smembers(self.keys.workers)
        return sorted(w.decode() for w in members)

    async def live_ids(self) -> list[str]:
        """The ids of the workers whose heartbeat has not expired, sorted (cheaper than `live_workers`)."""
        ids = await self.worker_ids()
        return [worker_id for worker_id, alive in zip(ids, await self._alive(ids), strict=True) if alive]

    async def _alive(self, worker_ids: Sequence[str]) -> list[bool]:
        """Whether each worker's heartbeat hash still exists (one round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.exists(self.keys.worker(worker_id))
        return [bool(n) for n in await pipe.execute()]

    async def statuses(self, worker_ids: Sequence[str]) -> dict[str, WorkerStatus | None]:
        """Each worker's heartbeat, or None where it has expired."""
        pipe = self.redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.hgetall(self.keys.worker(worker_id))
        hashes = await pipe.execute()
        return {w: WorkerStatus.from_hash(h) if h else None for w, h in zip(worker_ids, hashes, strict=True)}

    async def live_workers(self) -> list[WorkerStatus]:
        """Every worker whose heartbeat has not expired, sorted by id."""
        return [s for s in (await self.statuses(await self.worker_ids())).values() if s is not None]

    async def dead_workers(self) -> list[str]:
        """Registered worker ids whose heartbeat expired and whose requests are not yet reclaimed."""
        ids = await self.worker_ids()
        return [worker_id for worker_id, alive in zip(ids, await self._alive(ids), strict=True) if not alive]

    async def try_reap_lock(self, dead_worker_id: str, reaper_id: str, ttl_s: float, *, retake: bool = False) -> bool:
        """Only one live worker reclaims a dead worker's requests at a time; the lock expires if it dies.

        `retake`: also true (and the TTL renewed) if `reaper_id` holds it already, for a caller that never runs twice
        at once under one id (a worker's reap loop): a reap cut short by Redis going away leaves the lock held, and
        the reaper's next pass finishes it rather than every reaper waiting out the TTL (a 10-minute chaos soak saw a
        dead worker's requests wait 60 s so, its reaper's lock having outlived a Redis restart)."""
        key, ttl_ms = self.keys.reap_lock(dead_worker_id), int(ttl_s * 1000)
        if retake:
            return bool(await self._retake(keys=[key], args=[reaper_id, ttl_ms]))
        return bool(await self.redis.set(key, reaper_id, nx=True, px=ttl_ms))

    async def take_reap_turn(self, reaper_id: str, ttl_s: float) -> bool:
        """Whether it is `reaper_id`'s turn to look for dead workers (`Keys.reap_turn`): taken if free, kept (its TTL
        renewed) if it holds it already."""
        return bool(await self._retake(keys=[self.keys.reap_turn], args=[reaper_id, max(1, int(ttl_s * 1000))]))

    async def pass_reap_turn(self, reaper_id: str) -> None:
        """Give the turn up (if `reaper_id` holds it), so that the next worker's pass looks at once."""
        await self._release(keys=[self.keys.reap_turn], args=[reaper_id])

    async def release_reap_lock(self, worker_id: str, holder: str) -> bool:
        """Release a reap lock if `holder` still holds it (it may have expired and been taken by another)."""
        return bool(await self._release(keys=[self.keys.reap_lock(worker_id)], args=[holder]))

    async def reap_lock_holder(self, worker_id: str) -> str | None:
        """Who holds this worker id's reap lock, if anyone."""
        holder = await self.redis.get(self.keys.reap_lock(worker_id))
        return holder.decode() if isinstance(holder, bytes) else holder

    async def alive(self, worker_id: str) -> bool:
        """Whether this worker's heartbeat has not expired."""
        return bool(await self.redis.exists(self.keys.worker(worker_id)))

    async def forget(self, dead_worker_id: str) -> None:
        """After a dead worker's requests are reclaimed: drop its id, session index and lock."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.srem(self.keys.workers, dead_worker_id)
        pipe.delete(self.keys.worker_sessions(dead_worker_id), self.keys.reap_lock(dead_worker_id))
        await pipe.execute()
