"""SkyRL's control routes on `serve`, fleet-wide through the control plane: vLLM's pause, resume, sleep, wake-up,
prefix-cache reset and request aborts, each answered once every live worker acknowledged it, in vLLM's shape."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request

from rollout_svc.api.skyrl.records import InFlight
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import MAX_LEASE_S
from rollout_svc.openai.errors import APIError

HOLDER = "http"  # the pause holder of the HTTP control routes
PauseMode = Literal["keep", "abort", "wait"]


def control_router(client: RolloutClient, inflight: InFlight) -> APIRouter:
    router = APIRouter(tags=["skyrl", "control"])  # "control": the admin token's routes, outside /admin

    @router.post("/pause")
    async def pause(
        mode: Annotated[PauseMode, Query()] = "abort",
        clear_cache: Annotated[bool, Query()] = True,
        lease_s: Annotated[float, Query(ge=0, le=MAX_LEASE_S)] = 0.0,
    ) -> dict[str, str]:
        """vLLM's pause, fleet-wide: `keep` freezes in-flight requests until `/resume`; `abort` cuts them (a caller
        of `/inference/v1/generate` never sees it: the request is retried token-exact after `/resume`); `wait` lets
        them finish. `clear_cache` (vLLM's default true, ignored for `keep`) then drops every prefix cache.
        Held until `/resume`; `lease_s` (ours, not vLLM's) > 0 makes it lapse that long after it was issued."""
        await client.pause(mode, holder=HOLDER, lease_s=lease_s, renew=False)
        if clear_cache and mode != "keep":
            await client.reset_prefix_cache()
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict[str, str]:
        await client.resume(holder=HOLDER)
        return {"status": "resumed"}

    @router.post("/sleep")
    async def sleep(
        level: Annotated[int, Query(ge=1, le=2)] = 1, mode: Annotated[PauseMode, Query()] = "abort"
    ) -> dict[str, Any]:
        """vLLM's sleep, fleet-wide (level 1 or 2; in-flight requests first paused as `mode` says). SkyRL's client
        also sends `tags`, which vLLM's /sleep does not read: nor does this one."""
        await client.sleep(level, mode)
        return {"status": "sleeping", "level": level}

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[Literal["weights", "kv_cache"]] | None, Query()] = None) -> dict[str, Any]:
        """vLLM's wake_up, fleet-wide: all memory, or the pools `tags` names."""
        await client.wake_up(tags or None)
        awake = (await client.fleet_state()).sleep_level == 0
        return {"status": "awake" if awake else "sleeping", "tags": tags or None}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        request: Request, reset_running_requests: Annotated[bool, Query()] = False
    ) -> dict[str, bool]:
        """Drop every engine's prefix cache. `reset_running_requests` as a query parameter (vLLM) or in a JSON body
        (SkyRL's client sends `{"reset_running_requests": ...}`)."""
        body = await _json_object(request)
        running = body.get("reset_running_requests", reset_running_requests)
        if not isinstance(running, bool):
            raise APIError(400, "reset_running_requests must be true or false", param="reset_running_requests")
        await client.reset_prefix_cache(running)
        return {"success": True}

    @router.post("/abort_requests")
    async def abort_requests(request: Request) -> dict[str, Any]:
        """vLLM's: abort the requests `request_ids` names (the ids given to `/inference/v1/generate` through this
        server), or, with none, every request in the fleet. Aborted requests answer with `finish_reason` abort."""
        body = await _json_object(request)
        external = body.get("request_ids")
        if external:
            if not isinstance(external, list) or not all(isinstance(i, str) for i in external):
                raise APIError(400, "request_ids must be a list of strings", param="request_ids")
            by_client = inflight.ours(external)
            for runs, ours in by_client.items():
                await runs.abort(ours)
            return {"status": "aborted", "aborted": sum(map(len, by_client.values()))}
        await client.abort(all=True)
        return {"status": "aborted", "aborted": None}

    return router


async def _json_object(request: Request) -> dict[str, Any]:
    """The request's JSON object body; {} for an empty body. Raises `APIError` 400 for anything else."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body
