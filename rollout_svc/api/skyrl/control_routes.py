"""SkyRL's control routes on `serve`, fleet-wide through the control plane: vLLM's pause, resume, sleep, wake-up,
prefix-cache reset and request aborts, each answered once every live worker acknowledged it, in vLLM's shape."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request

from rollout_svc.api.auth import Auth
from rollout_svc.api.pause_holders import PauseHolders, holder_of
from rollout_svc.api.skyrl.records import InFlight
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import MAX_LEASE_S
from rollout_svc.openai.errors import APIError

PauseMode = Literal["keep", "abort", "wait"]


def control_router(client: RolloutClient, inflight: InFlight, holders: PauseHolders, auth: Auth) -> APIRouter:
    """`holders`: the server's leased HTTP pauses (`api/pause_holders.py`); `auth`: who may release another's."""
    router = APIRouter(tags=["skyrl", "control"])  # "control": the admin token's routes, outside /admin
    default_lease_s = client.settings.api.api_pause_lease_s

    @router.post("/pause", responses={409: {"description": "its lease ran out before every worker acknowledged it"}})
    async def pause(
        request: Request,
        mode: Annotated[PauseMode, Query()] = "abort",
        clear_cache: Annotated[bool, Query()] = True,
        lease_s: Annotated[float | None, Query(ge=0, le=MAX_LEASE_S)] = None,
    ) -> dict[str, str]:
        """vLLM's pause, fleet-wide: `keep` freezes in-flight requests until `/resume`; `abort` cuts them (a caller
        of `/inference/v1/generate` never sees it: the request is retried token-exact after `/resume`); `wait` lets
        them finish. `clear_cache` (vLLM's default true, ignored for `keep`) then drops every prefix cache.
        The pause is the caller's (`X-Rollout-Holder`, else its key, else its address: `api/pause_holders.py`),
        held until its `/resume` under a lease (`lease_s`, ours; default `serve --pause-lease-s`; 0: no lease) that
        each of its calls renews: it lapses that long after the holder's last call."""
        holder = holder_of(request.headers, request.client)
        lease = default_lease_s if lease_s is None else lease_s
        asked = time.monotonic()
        await client.pause(mode, holder=holder, lease_s=lease, renew=False)
        # Every live worker acknowledged (a stalled one only once reaped): the lease counts from this answer, and a
        # pause that lapsed meanwhile is not reported as held (found by the chaos soak, at a 3 s lease).
        if lease > 0 and not await client.renew_pause(holder, lease):
            took = time.monotonic() - asked
            holders.lapsed(holder, f"its {lease:g} s lease ran out while the workers acknowledged it ({took:.1f} s)")
            raise APIError(
                409,
                f"the pause of {holder} lapsed before every worker acknowledged it ({took:.1f} s, past its {lease:g} s "
                "lease): the fleet serves; pause again with a longer lease_s (default: serve --pause-lease-s)",
                code="pause_lapsed",
            )
        holders.paused(holder, lease)
        if clear_cache and mode != "keep":
            await client.reset_prefix_cache()
        return {"status": "paused"}  # vLLM's answer, as SkyRL reads it: `GET /is_paused` names the holders

    @router.post("/resume")
    async def resume(request: Request, holder: Annotated[str | None, Query()] = None) -> dict[str, str]:
        """Release the caller's own pause (the fleet serves once no holder pauses it). `holder` (ours): another's,
        with the admin token only (`GET /is_paused` names the holders)."""
        own = holder_of(request.headers, request.client)
        if holder is not None and holder != own:
            auth.admin(request)
        target = holder or own
        await client.resume(holder=target)
        holders.resumed(target)
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
