"""Worker liveness: heartbeat hashes with a TTL, the set of registered workers, and the reap lock."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from rollout_svc.keys import Keys
from rollout_svc.protocol import WorkerStatus


class Registry:
    """A worker is live while its heartbeat hash exists; it expires `heartbeat_ttl_s` after the last beat."""

    def __init__(self, redis: Redis, keys: Keys, heartbeat_ttl_s: float) -> None:
        self.redis, self.keys = redis, keys
        self._ttl_ms = int(heartbeat_ttl_s * 1000)

    async def heartbeat(self, status: WorkerStatus) -> None:
        """Write the heartbeat hash, reset its TTL, and (re-)register the worker id."""
        key = self.keys.worker(status.worker_id)
        fields: dict[Any, Any] = {k: str(v) for k, v in status.model_dump().items()}
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, self._ttl_ms)
        pipe.sadd(self.keys.workers, status.worker_id)
        await pipe.execute()

    async def deregister(self, worker_id: str) -> None:
        """A clean exit: the worker is gone at once, not after its TTL."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.keys.worker(worker_id), self.keys.worker_sessions(worker_id))
        pipe.srem(self.keys.workers, worker_id)
        await pipe.execute()

    async def live_workers(self) -> list[WorkerStatus]:
        """Every worker whose heartbeat has not expired, sorted by id."""
        ids = await self._worker_ids()
        pipe = self.redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self.keys.worker(worker_id))
        hashes = await pipe.execute()
        return [WorkerStatus.model_validate({k.decode(): v.decode() for k, v in h.items()}) for h in hashes if h]

    async def dead_workers(self) -> list[str]:
        """Registered worker ids whose heartbeat expired and whose requests are not yet reclaimed."""
        ids = await self._worker_ids()
        pipe = self.redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.exists(self.keys.worker(worker_id))
        alive = await pipe.execute()
        return [worker_id for worker_id, a in zip(ids, alive, strict=True) if not a]

    async def _worker_ids(self) -> list[str]:
        members: Any = await self.redis.smembers(self.keys.workers)
        return sorted(w.decode() for w in members)

    async def is_alive(self, worker_id: str) -> bool:
        return bool(await self.redis.exists(self.keys.worker(worker_id)))

    async def try_reap_lock(self, dead_worker_id: str, reaper_id: str, ttl_s: float) -> bool:
        """Only one live worker reclaims a dead worker's requests at a time; the lock expires if it dies."""
        return bool(await self.redis.set(self.keys.reap_lock(dead_worker_id), reaper_id, nx=True, px=int(ttl_s * 1000)))

    async def forget(self, dead_worker_id: str) -> None:
        """After a dead worker's requests are reclaimed: drop its id, session index and lock."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.srem(self.keys.workers, dead_worker_id)
        pipe.delete(self.keys.worker_sessions(dead_worker_id), self.keys.reap_lock(dead_worker_id))
        await pipe.execute()
