"""What `rollout-svc status` reports (control state, live workers, queue depths and pending counts, dead letters),
and the current weight sync the dashboard shows."""

from __future__ import annotations

from typing import Any

from redis.exceptions import RedisError

from rollout_svc.config import Settings
from rollout_svc.fleet import Fleet, FleetControl, FleetRegistry, sorted_workers
from rollout_svc.keys import JOINED, LOADED, RECEIVED


async def fleet_status(settings: Settings, fleet: Fleet | None = None) -> dict[str, Any]:
    """The fleet as JSON-ready data, read over `fleet` (refreshed here, left open: `sync_status` may read it next)
    or over a `Fleet` of its own (closed on return).

    Returns `{"paused": bool, "pause_mode": "keep"|"abort"|"wait"|None, "pause_holders": {holder: mode},
    "pause_leases": {holder: when its pause lapses, unix s}, "lapsed_pauses": {holder: when its leased pause lapsed},
    "sleep_level": n, "epoch": n, "weight_version": n (committed), "weight_checkpoint": path or None,
    "adapters": {name: {"version": n, "path": directory}} (the LoRA adapters the fleet holds),
    "workers": [WorkerStatus dict], "loads": {worker id: tokens of work it holds (what placement shares by)},
    "streams": {name: {length, pending, queued}}, "dead_letters": n, "steps": {"live": named steps not yet
    collected, "expired": those that expired unattached (`RolloutClient.attach_step`)},
    "shards": [name], "unreachable_shards": [name], "model_name": this model's name ("": the default),
    "named_models": {name: the same report of that named model} (from the default model's report only)}`: every
    reachable shard's workers, streams and dead letters,
    and the control state as the first shard that answers holds it (every command writes it in all). Each worker's
    `state` is starting, serving, paused, sleeping, draining or stale (its weights are not the committed ones), and
    `applied_epoch` the control epoch it acknowledged (right after a command returns, every worker's is >= it).
    """
    own = fleet is None
    fleet = Fleet(settings) if fleet is None else fleet
    named: list[str] = []
    try:
        shards = await fleet.refresh()
        if not settings.model_name:
            named = await fleet.named_models()
        desired = await FleetControl(fleet).state()
        by_shard = await FleetRegistry(fleet).live_workers_by_shard()
        keys = settings.keys
        steps = {
            "live": int(await fleet.router.zcard(keys.steps)),
            "expired": int(await fleet.router.get(keys.steps_expired) or 0),
        }
        workers = sorted_workers(by_shard)
        depths: dict[str, dict[str, int]] = {}
        dead_letters = 0
        loads: dict[str, int] = {}
        unreachable = [name for name in fleet.links if name not in by_shard]
        for name, shard_workers in by_shard.items():
            link = fleet.links[name]
            keys = link.keys
            try:
                pinned = [keys.pinned_requests(w.worker_id) for w in shard_workers]
                for stream in [keys.requests, keys.token_requests, *pinned]:
                    depths[stream] = await link.streams.depth(stream)
                dead_letters += int(await link.redis.xlen(keys.dead))
                loads |= await link.streams.loads()
            except (RedisError, OSError):  # its primary is down: reported, the other shards still are
                unreachable.append(link.name)
    finally:
        if own:
            await fleet.close()
    return {
        "paused": desired.paused,
        "pause_mode": desired.pause_mode,
        "pause_holders": desired.holders,
        "pause_leases": desired.leases,
        "lapsed_pauses": desired.lapsed,
        "sleep_level": desired.sleep_level if desired.sleeping else 0,
        "epoch": desired.epoch,
        "weight_version": desired.weight_version,
        "weight_checkpoint": desired.weight_checkpoint or None,
        "adapters": {name: {"version": s.version, "path": s.path} for name, s in sorted(desired.adapters.items())},
        "workers": [w.model_dump() for w in workers],
        "loads": {w.worker_id: loads.get(w.worker_id, 0) for w in workers},
        "streams": depths,
        "dead_letters": dead_letters,
        "steps": steps,
        "shards": shards,
        "unreachable_shards": sorted(unreachable),
        "model_name": settings.model_name,
        "named_models": {name: await fleet_status(settings.copy_with(model_name=name)) for name in named},
    }


async def sync_status(fleet: Fleet) -> dict[str, Any] | None:
    """The current weight sync (`WeightSyncPlane.order`, of the first shard of `fleet`, refreshed, that answers:
    every sync writes it in all), with each phase's barrier (`Keys.weight_barrier`): {"sync_id", "version",
    "transport", "staged", "members", "issued_at", "phases": {"joined" | "received" | "loaded": {worker id: "ok" or
    its error}}}; None if none yet (or one this build cannot read)."""
    for link in fleet.links.values():
        try:
            order = await link.weights.order()
            if order is None:
                return None
            phases = {}
            for phase in (JOINED, RECEIVED, LOADED):
                reached: Any = await link.redis.hgetall(link.keys.weight_barrier(order.sync_id, phase))
                phases[phase] = {k.decode(): v.decode() for k, v in reached.items()}
        except (OSError, RedisError):
            continue  # this shard is away: the next one
        return {
            "sync_id": order.sync_id, "version": order.version, "transport": order.transport,
            "staged": order.staged, "members": order.members, "issued_at": order.issued_at, "phases": phases,
        }  # fmt: skip
    return None


async def fleet_and_sync_status(settings: Settings) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`fleet_status` and `sync_status` read over one `Fleet` (what the dashboard shows each second)."""
    fleet = Fleet(settings)
    try:
        return await fleet_status(settings, fleet), await sync_status(fleet)
    finally:
        await fleet.close()
