"""SkyRL's server protocol on `serve`: the routes of vLLM's server and SkyRL's server actor, answered by the fleet as
one server whose world size is every GPU (weight-transfer rank) behind it.

Sources: SkyRL 0.3.0's `remote_inference_client.py` (the calls) and `vllm_server_actor.py` (the server it expects:
vLLM's, with its RL and dev routes), vLLM 0.32's `entrypoints/rl/online/api_router.py`, `serve/dev/sleep`,
`serve/dev/cache` and `scale_out/token_in_token_out` (the shapes). Point SkyRL's `RemoteInferenceClient` at
`serve` as both `proxy_url` and `server_urls=[that URL]`.

Data routes (`data_router`, the data-plane keys): `POST /inference/v1/generate`, `/v1/chat/completions/render`
(text only); `GET /get_world_size`,
`/get_server_info`, `/servers`, `/is_paused`, `/is_sleeping`.

Control routes (`control_router`): `POST /pause?mode=keep|abort|wait&clear_cache=`, `/resume`,
`/sleep?level=&mode=`, `/wake_up?tags=`, `/reset_prefix_cache`, `/abort_requests`. Each is fleet-wide through the
control plane and answers once every live worker acknowledged it, in vLLM's shape. They need the admin token, as
`/admin/*` does; SkyRL's client sends none, so `serve --open-control` serves them without one, which `serve` allows
only on a loopback address. A pause is held as holder `http` (`/resume` releases that holder only: a pause held by
the trainer's `WeightSender` or an operator stays).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from rollout_svc.api.generation import Generation, until_disconnected, worker_header
from rollout_svc.api.hot import FastJSONResponse, HotLane
from rollout_svc.api.served import ServedModels, session_header
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import MAX_LEASE_S
from rollout_svc.openai.errors import APIError
from rollout_svc.openai.plans import raise_for
from rollout_svc.openai.schemas import ChatCompletionRequest
from rollout_svc.openai.tokens import GenerateBody, generate_params, generate_response, group_params, render_chat
from rollout_svc.protocol import Trajectory

HOLDER = "http"  # the pause holder of the HTTP control routes
# Request ids this process makes: a random prefix of its own (ids stay apart across serve processes), then a counter;
# uuid4 per request read the OS's random source (a system call) twice a generate.
_ID_PREFIX, _ids = uuid.uuid4().hex[:20], itertools.count()
PauseMode = Literal["keep", "abort", "wait"]


class InFlight:
    """The requests this `serve` process has in flight for `/inference/v1/generate`, by the caller's `request_id`
    (vLLM's id), so `/abort_requests` can name them: external id -> our request ids, each with the client (the named
    model's) that runs it."""

    def __init__(self) -> None:
        self.ids: dict[str, list[tuple[str, RolloutClient]]] = {}

    def add(self, external: str, ours: list[str], client: RolloutClient) -> None:
        self.ids.setdefault(external, []).extend((o, client) for o in ours)

    def remove(self, external: str, ours: list[str]) -> None:
        left = [(o, c) for o, c in self.ids.get(external, []) if o not in ours]
        if left:
            self.ids[external] = left
        else:
            self.ids.pop(external, None)

    def ours(self, external: list[str]) -> dict[RolloutClient, list[str]]:
        """Our request ids of the `external` ones, by the client that runs them."""
        by_client: dict[RolloutClient, list[str]] = {}
        for e in external:
            for o, client in self.ids.get(e, []):
                by_client.setdefault(client, []).append(o)
        return by_client


class DetokenizedTexts:
    """The text of each completion `/inference/v1/generate` returned lately, as a worker's `/detokenize` gives it (the
    workers decode it so: `RolloutRequest.text_as_detokenized`), so the `/detokenize` SkyRL's `generate` sends after
    each is answered here, without a worker round trip. Keyed by model and a BLAKE2b digest of the token ids, with a
    count (equal completions, as greedy samples often are, are each asked for once); each is taken once; at most
    `capacity` keys, the oldest dropped first (a caller that never asks leaves nothing behind). A miss goes to a
    worker as before."""

    def __init__(self, capacity: int = 16384) -> None:
        self.capacity = capacity
        self.texts: OrderedDict[tuple[str, bytes], tuple[str, int]] = OrderedDict()

    @staticmethod
    def _key(model: str, token_ids: Sequence[int]) -> tuple[str, bytes]:
        return model, hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).digest()

    def put(self, model: str, trajectories: Sequence[Trajectory]) -> None:
        for t in trajectories:
            if t.completion_token_ids and t.finish_reason != "abort":
                key = self._key(model, t.completion_token_ids)
                _, count = self.texts.pop(key, ("", 0))
                self.texts[key] = (t.text, count + 1)
        while len(self.texts) > self.capacity:
            self.texts.popitem(last=False)

    def take(self, model: str, token_ids: Sequence[int]) -> str | None:
        key = self._key(model, token_ids)
        text, count = self.texts.get(key, ("", 0))
        if count == 0:
            return None
        if count == 1:
            del self.texts[key]
        else:
            self.texts[key] = (text, count - 1)
        return text


def data_router(
    client: RolloutClient,
    served: ServedModels,
    generation: Generation,
    inflight: InFlight,
    default_max_tokens: int,
    detokenized: DetokenizedTexts,
    lane: HotLane,
) -> APIRouter:
    """`served`: the app's `ServedModels`; `generation`: its `Generation` (for the timeout and token counts);
    `default_max_tokens`: a chat request's when it sets none; `detokenized`: where each completion's text goes for
    the app's `/detokenize`; `lane`: the app's hot lane, which answers `/inference/v1/generate`."""
    router = APIRouter(tags=["skyrl"])

    @router.post("/v1/chat/completions/render")
    async def render_chat_completion(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        """vLLM's render: a chat request as the `/inference/v1/generate` body that would run it (vLLM's
        `GenerateRequest`: the prompt's token ids under the workers' chat template, its sampling params), without
        generating. Text only: no multimodal `features`."""
        target = await served.resolve(body.model)
        session = session_header(request, body.session_id)
        runs = served.client_for(target.model_name)
        return await until_disconnected(request, render_chat(runs, body, target.name, session, default_max_tokens))

    @lane.post(router, "/inference/v1/generate", GenerateBody)
    async def generate(body: GenerateBody, request: Request) -> JSONResponse:
        """vLLM's token-in, token-out generate (SkyRL's `generate` and `sample`): `n` samples of `token_ids` as one
        group; `X-Session-ID` (or `session_id`) pins the session to one worker. `model` names a served model (the
        fleet's, or a named model's workers) or a LoRA adapter."""
        target = await served.resolve(body.model)
        model, runs = target.name, served.client_for(target.model_name)
        params, n = generate_params(body)
        session = session_header(request, body.session_id)
        external = body.request_id or f"{_ID_PREFIX}{next(_ids):012x}"
        attempt = next(_ids)  # apart from another call that names the same request_id
        ours = [f"gen:{external}:{attempt:x}:{j}" for j in range(n)]
        requests = await runs.rollout_requests(
            [list(body.token_ids)] * n,
            group_params(params, n),
            [session] * n if session else None,
            request_ids=ours,
            group_ids=[ours[0]] * n if n > 1 else None,
            timeout_s=generation.timeout_s,
            text_as_detokenized=True,
            adapter=target.adapter,
        )
        inflight.add(external, ours, runs)
        try:
            trajectories: list[Trajectory] = await until_disconnected(request, runs.run(requests))
        finally:
            inflight.remove(external, ours)
        for t in trajectories:
            raise_for(t)
        detokenized.put(model, trajectories)
        if generation.metrics is not None:
            generation.metrics.count_tokens(len(body.token_ids), sum(len(t.completion_token_ids) for t in trajectories))
        return FastJSONResponse(
            generate_response(body, model, trajectories, external), headers=worker_header(trajectories)
        )

    @router.get("/get_world_size")
    async def get_world_size(include_dp: Annotated[bool, Query()] = True) -> dict[str, int]:
        """vLLM's: the weight-transfer ranks (GPUs) behind this server: every live engine's (`include_dp`, the
        default), or one engine's (`include_dp=false`: its tensor x pipeline parallel size)."""
        ranks = [w.weight_ranks for w in await client.workers()]
        if not ranks:
            raise APIError(503, "no live worker: start one with `rollout-svc worker`", code="no_worker")
        return {"world_size": sum(ranks) if include_dp else max(ranks)}

    @router.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        """This server as SkyRL's server group sees one: its world size, model, committed weight version, and the
        engines behind it."""
        workers = await client.workers()
        state = await client.fleet_state()
        return {
            "world_size": sum(w.weight_ranks for w in workers),
            "model": next(iter(await served.models()), None),
            "weight_version": state.weight_version,
            "engines": [
                {"worker_id": w.worker_id, "world_size": w.weight_ranks, "weight_version": w.weight_version}
                for w in workers
            ],
        }

    @router.get("/servers")
    async def servers(request: Request) -> dict[str, list[str]]:
        """The router's list of servers to fan control calls out to: this one (the fleet answers as one server)."""
        return {"servers": [str(request.base_url).rstrip("/")]}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": (await client.fleet_state()).paused}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": (await client.fleet_state()).sleep_level > 0}

    return router


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
