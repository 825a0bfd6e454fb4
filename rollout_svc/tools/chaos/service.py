"""Whether the chaos soak's fleet can take work, sampled for the ledger's `late` check (`Ledger.could_not_serve`).

A request that waits past its call's timeout is lost or hung only if some worker could have taken it meanwhile. Under
the soak's faults there are stretches where none can: Redis is away, the fleet is paused or asleep, or no worker
serves (every worker was killed after a broadcast and restarted stale, no live peer holds the committed version to
catch up from, and each new trainer's sync fails under the next faults: a 10-minute run had 45 s of it). The monitor
reads the control state and the heartbeats every `SAMPLE_S` and records those stretches.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollout_svc.connections.urls import redis_async
from rollout_svc.control.plane import FleetState
from rollout_svc.keys import Keys
from rollout_svc.tools.chaos.fleet import ChaosFleet
from rollout_svc.tools.chaos.ledger import Ledger

SAMPLE_S = 0.25


class ServiceMonitor:
    """Samples the fleet until stopped (`run`); records the stretches in which no worker could take work."""

    def __init__(self, fleet: ChaosFleet, ledger: Ledger) -> None:
        self.keys, self.ledger = fleet.settings.keys, ledger
        self.fresh_s = 2 * fleet.settings.worker.heartbeat_interval_s  # a heartbeat older than this: stalled or dead
        self.redis = redis_async(fleet.redis_url, decode_responses=False, socket_timeout=1.0)

    async def run(self, stop: asyncio.Event) -> None:
        down_since: float | None = None
        try:
            while not stop.is_set():
                sampled_at = time.time()
                serviceable = await self.serviceable()
                if not serviceable and down_since is None:
                    down_since = sampled_at
                elif serviceable and down_since is not None:
                    self.ledger.could_not_serve(down_since, sampled_at)
                    down_since = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SAMPLE_S)
        finally:
            if down_since is not None:
                self.ledger.could_not_serve(down_since, time.time())
            await self.redis.aclose()

    async def serviceable(self) -> bool:
        """Redis answers, the fleet is neither paused nor asleep, and a worker with a fresh heartbeat serves."""
        try:
            state = await fleet_state(self.redis, self.keys)
            if state.paused or state.sleeping:
                return False
            return b"serving" in (await fresh_labels(self.redis, self.keys, self.fresh_s)).values()
        except (RedisError, OSError):
            return False


async def fleet_state(redis: Redis, keys: Keys) -> FleetState:
    """The control state as the workers read it (a lapsed pause left out, by Redis's clock)."""
    fields: Any = await redis.hgetall(keys.state)
    seconds, micros = await redis.time()
    return FleetState.from_hash(fields, seconds * 1000 + micros // 1000)


async def fresh_labels(redis: Redis, keys: Keys, fresh_s: float) -> dict[str, bytes]:
    """Each registered worker's state label, by worker id, where its heartbeat is younger than `fresh_s` (an older
    one is a stalled or killed worker's last word)."""
    labels: dict[str, bytes] = {}
    members: Any = await redis.smembers(keys.workers)
    for worker_id in sorted(m.decode() for m in members):
        fields: Any = await redis.hmget(keys.worker(worker_id), ["state", "heartbeat_at"])
        label, beat = fields
        if label is not None and beat is not None and time.time() - float(beat) < fresh_s:
            labels[worker_id] = label
    return labels
