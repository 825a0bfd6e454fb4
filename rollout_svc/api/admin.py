"""`/admin/*`: the control plane and the fleet's weights over HTTP, behind the admin token (see `auth.py`).

Weights come by checkpoint only (`POST /admin/weights/checkpoint`): a broadcast needs the trainer's tensors, which
stay with `WeightSender` in the trainer's process.

Each command returns once every live worker acknowledged it, with the control epoch it produced; a command some
worker did not acknowledge in time answers 504 naming them (the desired state stays written: retrying converges),
one a worker's engine refused 409.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter

from rollout_svc.api.schemas import (
    AbortBody,
    CheckpointBody,
    PauseBody,
    ResetPrefixCacheBody,
    ResumeBody,
    SleepBody,
    WakeUpBody,
)
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.errors import WeightSyncError
from rollout_svc.openai.errors import APIError
from rollout_svc.protocol import PauseMode

if TYPE_CHECKING:
    from rollout_svc.client.weight_sender import SyncReport


def admin_router(client: RolloutClient) -> APIRouter:
    router = APIRouter(prefix="/admin", tags=["admin"])

    @router.post("/pause")
    async def pause(body: PauseBody | None = None) -> dict[str, Any]:
        """Pause the fleet (`mode` keep, abort or wait) under `holder`: held until `/admin/resume`, or with `lease_s`
        a timed pause that lapses that long after it was issued (the API cannot tell whether its caller lives)."""
        body = body or PauseBody()
        epoch = await client.pause(
            body.mode, holder=body.holder, timeout_s=body.timeout_s, lease_s=body.lease_s, renew=False
        )
        return {"epoch": epoch, "paused": True, "mode": body.mode, "holder": body.holder}

    @router.post("/resume")
    async def resume(body: ResumeBody | None = None) -> dict[str, Any]:
        """Release `holder`'s pause."""
        body = body or ResumeBody()
        epoch = await client.resume(holder=body.holder, timeout_s=body.timeout_s)
        return {"epoch": epoch, "paused": (await client.fleet_state()).paused}

    @router.post("/abort")
    async def abort(body: AbortBody) -> dict[str, Any]:
        """Abort requests by id, by session, or all (exactly one)."""
        if sum([bool(body.request_ids), body.session_id is not None, body.all]) != 1:
            raise APIError(400, "give exactly one of request_ids, session_id and all=true")
        epoch = await client.abort(body.request_ids, session_id=body.session_id, all=body.all, timeout_s=body.timeout_s)
        return {"epoch": epoch}

    @router.post("/sleep")
    async def sleep(body: SleepBody | None = None) -> dict[str, Any]:
        body = body or SleepBody()
        return {"epoch": await client.sleep(body.level, body.mode, timeout_s=body.timeout_s)}

    @router.post("/wake_up")
    async def wake_up(body: WakeUpBody | None = None) -> dict[str, Any]:
        body = body or WakeUpBody()
        return {"epoch": await client.wake_up(body.tags, timeout_s=body.timeout_s)}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(body: ResetPrefixCacheBody | None = None) -> dict[str, Any]:
        body = body or ResetPrefixCacheBody()
        epoch = await client.reset_prefix_cache(body.reset_running_requests, timeout_s=body.timeout_s)
        return {"epoch": epoch}

    @router.get("/workers")
    async def workers() -> dict[str, Any]:
        """The live workers' heartbeats: state, load, applied epoch, weight version."""
        return {"workers": [w.model_dump() for w in await client.workers()]}

    @router.get("/state")
    async def state() -> dict[str, Any]:
        """The fleet's desired control state: epoch, pause holders and mode (with when each leased pause lapses, and
        the pauses that lapsed, unix seconds), sleep level, committed weights."""
        s = await client.fleet_state()
        return {
            "epoch": s.epoch,
            "paused": s.paused,
            "pause_mode": s.pause_mode,
            "holders": s.holders,
            "pause_leases": s.leases,
            "lapsed_pauses": s.lapsed,
            "sleep_level": s.sleep_level,
            "weight_version": s.weight_version,
            "weight_checkpoint": s.weight_checkpoint,
        }

    @router.get("/weight_version")
    async def weight_version() -> dict[str, Any]:
        """The committed weight version (and its checkpoint, if it came from one), and each live worker's."""
        s = await client.fleet_state()
        per_worker = {w.worker_id: w.weight_version for w in await client.workers()}
        return {"weight_version": s.weight_version, "weight_checkpoint": s.weight_checkpoint, "workers": per_worker}

    @router.post("/weights/checkpoint")
    async def update_weights_from_checkpoint(body: CheckpointBody) -> dict[str, Any]:
        """A weight sync from a checkpoint (`WeightSender.update_from_checkpoint`): pause, every worker loads it,
        commit `version`, resume. Returns the `SyncReport` (loaded, stale, dead, seconds). 400: the version is not above
        the committed one; 409: no worker loaded it (the old version stays committed), naming why."""
        return dataclasses.asdict(await sync_from_checkpoint(client, body.path, body.version, body.pause_mode))

    return router


async def sync_from_checkpoint(
    client: RolloutClient, path: str, version: int, pause_mode: PauseMode, stable_wait_s: float | None = None
) -> SyncReport:
    """`WeightSender.update_from_checkpoint` for an HTTP route: a `WeightSyncError` (no worker loaded it) becomes
    `APIError` 409 naming why; `InvalidRequestError` (a version not above the committed one, a `stable_wait_s` not
    under the sync timeout) is the app's 400."""
    from rollout_svc.client.weight_sender import WeightSender  # imports torch: only when a sync is asked for

    async with WeightSender(settings=client.settings) as sender:
        try:
            return await sender.update_from_checkpoint(path, version, pause_mode, stable_wait_s=stable_wait_s)
        except WeightSyncError as exc:
            raise APIError(409, str(exc), code="weight_sync_failed") from exc
