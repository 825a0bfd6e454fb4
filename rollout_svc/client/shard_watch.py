"""A producer's watch over the shards: it links the shards workers register (starting each one's reader and Redis
watcher), counts their live workers, and notices a shard's Redis restarting or failing over.

A new server `run_id` means Redis restarted or failed over, and may have come back without its recent writes (a
restart without persistence, a replica promoted before it had them). The watch then asks Redis which of the requests
awaited there it still holds and resubmits the rest under the same ids, so no caller waits out its timeout for a
request Redis forgot; a request both answered and resubmitted is answered once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from rollout_svc.client.calls import ClientStats
from rollout_svc.client.results import EnqueueAttempts, ResultRouter
from rollout_svc.config import Settings
from rollout_svc.connections.urls import server_run_id
from rollout_svc.fleet import Fleet, ShardLink
from rollout_svc.protocol import Request

log = logging.getLogger("rollout_svc.client")
REDIS_CHECK_S = 1.0  # how often a connection asks each shard's Redis for its run_id, and whether workers live there


class ShardWatch:
    """The shard watcher task and, per shard, its reader (`ResultRouter.read`) and its Redis watcher. Given the
    connection's `fleet`, `router`, `addressed` (a request to the shard chosen for it now), `enqueue` (past
    admission) and `closed` (set when the connection closes)."""

    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        router: ResultRouter,
        stats: ClientStats,
        addressed: Callable[[Request], Request],
        enqueue: EnqueueAttempts,
        closed: asyncio.Event,
    ) -> None:
        self.settings, self.fleet, self.router, self.stats = settings, fleet, router, stats
        self._addressed, self._enqueue, self._closed = addressed, enqueue, closed
        self.by_shard: dict[str, list[asyncio.Task[None]]] = {}  # shard -> its reader and Redis watcher
        self.watcher: asyncio.Task[None] | None = None

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """Every task it started."""
        return [*(t for ts in self.by_shard.values() for t in ts), *([self.watcher] if self.watcher else [])]

    async def start(self) -> None:
        """Find the shards and whether workers live in each, start their tasks. Raises the Redis error if no shard
        can be reached."""
        await self.fleet.refresh()
        if not self.fleet.links:
            raise RedisConnectionError(f"no shard of {self.settings.redis_url} could be reached")
        await self._check_shards()
        if self.watcher is None:
            self.watcher = asyncio.create_task(self._watch_shards())

    async def _check_shards(self) -> None:
        for link in list(self.fleet.links.values()):
            if link.name not in self.by_shard:
                self.by_shard[link.name] = [
                    asyncio.create_task(self.router.read(link)),
                    asyncio.create_task(self._watch_redis(link)),
                ]
            try:
                await self.fleet.check(link)
            except (RedisError, OSError):  # away: no new request goes there; the reader counts the outage
                link.workers = 0

    async def _watch_shards(self) -> None:
        """Every `REDIS_CHECK_S`: shards registered since, and which have live workers."""
        while not self._closed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), REDIS_CHECK_S)
            if self._closed.is_set():
                return
            await self.fleet.refresh()
            await self._check_shards()

    async def _watch_redis(self, link: ShardLink) -> None:
        """Ask a shard's Redis for its run_id every `REDIS_CHECK_S`; when it changes, resubmit what it no longer
        holds."""
        known: str | None = None
        while not self._closed.is_set():
            try:
                run_id = await server_run_id(link.redis)
                if run_id is None:
                    log.info("Redis does not answer INFO: a restart that loses writes will not be noticed")
                    return
                if known is not None and run_id != known:
                    self.stats.redis_changes += 1
                    change = (link.name, known[:8], run_id[:8])
                    log.warning("Redis of shard %s restarted or failed over (run_id %s -> %s)", *change)
                    await self._resubmit_lost(link)
                known = run_id
            except (RedisError, OSError) as exc:  # away: asked again; a change is still seen once it is back
                log.debug("asking Redis for its run_id failed (%s)", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), REDIS_CHECK_S)

    async def _resubmit_lost(self, link: ShardLink) -> None:
        """Resubmit, under the same ids and past admission, the requests awaited in `link`'s shard that its Redis no
        longer holds (each to the shard chosen for it now)."""
        awaited = {a.request.request_id: a for a in self.router.awaited_in(link)}
        held = await link.streams.held(set(awaited), link.keys.results(self.router.producer_id))
        # Still awaited after that read, and not being enqueued (an enqueue riding out the outage sends it once back).
        lost = [
            a
            for rid, a in awaited.items()
            if rid not in held and self.router.attempts.get(rid) is a and not a.cancelling and not a.sending
        ]
        if not lost:
            return
        for attempt in lost:
            attempt.request = self._addressed(attempt.request)
        self.stats.resubmitted += len(lost)
        counts = (len(lost), len(awaited))
        log.warning("Redis no longer holds %d of the %d requests awaited here: resubmitting them", *counts)
        await self._enqueue(lost, -1)
