"""What `rollout-svc status` reports: control state, live workers, queue depths and pending counts, dead letters."""

from __future__ import annotations

from typing import Any

from rollout_svc.config import Settings
from rollout_svc.connect import redis_async
from rollout_svc.control import ControlPlane


async def fleet_status(settings: Settings) -> dict[str, Any]:
    """The fleet as JSON-ready data.

    Returns `{"paused": bool, "pause_mode": "keep"|"abort"|"wait"|None, "pause_holders": {holder: mode},
    "sleep_level": n, "epoch": n, "weight_version": n (committed), "weight_checkpoint": path or None,
    "workers": [WorkerStatus dict], "streams": {name: {length, pending, queued}}, "dead_letters": n}`. Each worker's
    `state` is starting, serving, paused, sleeping, draining or stale (its weights are not the committed ones), and
    `applied_epoch` the control epoch it acknowledged (right after a command returns, every worker's is >= it).
    """
    redis = redis_async(settings.redis_url, decode_responses=False)
    keys = settings.keys
    try:
        control = ControlPlane(redis, settings)
        desired = await control.state()
        workers = await control.registry.live_workers()
        depths = {}
        for stream in [keys.requests, keys.token_requests, *(keys.pinned_requests(w.worker_id) for w in workers)]:
            depths[stream] = await control.streams.depth(stream)
        dead_letters = await redis.xlen(keys.dead)
    finally:
        await redis.aclose()
    return {
        "paused": desired.paused,
        "pause_mode": desired.pause_mode,
        "pause_holders": desired.holders,
        "sleep_level": desired.sleep_level if desired.sleeping else 0,
        "epoch": desired.epoch,
        "weight_version": desired.weight_version,
        "weight_checkpoint": desired.weight_checkpoint or None,
        "workers": [w.model_dump() for w in workers],
        "streams": depths,
        "dead_letters": dead_letters,
    }
