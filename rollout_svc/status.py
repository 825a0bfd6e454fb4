"""What `rollout-svc status` reports: live workers, queue depths and pending counts, dead letters."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from rollout_svc.config import Settings
from rollout_svc.registry import Registry
from rollout_svc.streams import RequestStreams


async def fleet_status(settings: Settings) -> dict[str, Any]:
    """The fleet as JSON-ready data.

    Returns `{"workers": [WorkerStatus dict], "streams": {name: {length, pending, queued}}, "dead_letters": n}`.
    """
    redis = Redis.from_url(settings.redis_url, decode_responses=False)
    keys = settings.keys
    try:
        workers = await Registry(redis, keys, settings.heartbeat_ttl_s).live_workers()
        streams = RequestStreams(redis, keys, settings.session_ttl_s)
        depths = {keys.requests: await streams.depth(keys.requests)}
        for worker in workers:
            pinned = keys.pinned_requests(worker.worker_id)
            depths[pinned] = await streams.depth(pinned)
        dead_letters = await redis.xlen(keys.dead)
    finally:
        await redis.aclose()
    return {"workers": [w.model_dump() for w in workers], "streams": depths, "dead_letters": dead_letters}
