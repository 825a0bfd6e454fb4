"""SkyRL's data routes on `serve` (the data-plane keys): vLLM's token-in, token-out generate, the chat render, and
what SkyRL's server group reads of a server (world size, server info, the server list, paused, sleeping)."""

from __future__ import annotations

import itertools
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from rollout_svc.api.generation import Generation, until_disconnected, worker_header
from rollout_svc.api.hot import FastJSONResponse, HotLane
from rollout_svc.api.served import ServedModels, session_header
from rollout_svc.api.skyrl.records import DetokenizedTexts, InFlight
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.integrations.skyrl.shapes import GenerateBody
from rollout_svc.integrations.skyrl.tokens import generate_params, generate_response, group_params, render_chat
from rollout_svc.integrations.skyrl.weights import EngineWeightTransfer
from rollout_svc.openai.errors import APIError
from rollout_svc.openai.plans import raise_for
from rollout_svc.openai.schemas import ChatCompletionRequest
from rollout_svc.protocol import Trajectory

# Request ids this process makes: a random prefix of its own (ids stay apart across serve processes), then a counter;
# uuid4 per request read the OS's random source (a system call) twice a generate.
_ID_PREFIX, _ids = uuid.uuid4().hex[:20], itertools.count()


def data_router(
    client: RolloutClient,
    served: ServedModels,
    generation: Generation,
    inflight: InFlight,
    default_max_tokens: int,
    detokenized: DetokenizedTexts,
    lane: HotLane,
    transfer: EngineWeightTransfer,
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
        ranks = list((await transfer.world_size()).values())
        if not ranks:
            raise APIError(503, "no live worker: start one with `rollout-svc worker`", code="no_worker")
        if include_dp:
            transfer.reported = sum(ranks)  # what the trainer counts: an init for another count is refused
        return {"world_size": sum(ranks) if include_dp else max(ranks)}

    @router.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        """This server as SkyRL's server group sees one: its world size, model, committed weight version, and the
        engines behind it, each with what it holds as vLLM resolved it (batch, context and KV cache in tokens, its
        settings: `WorkerStatus`)."""
        workers = await client.workers()
        state = await client.fleet_state()
        return {
            "world_size": sum(w.weight_ranks for w in workers),
            "model": await served.first(),
            "weight_version": state.weight_version,
            "engines": [
                {
                    "worker_id": w.worker_id,
                    "world_size": w.weight_ranks,
                    "weight_version": w.weight_version,
                    "max_num_seqs": w.max_num_seqs,
                    "max_model_len": w.max_model_len,
                    "kv_cache_tokens": w.kv_cache_tokens,
                    "engine_config": w.engine_config,
                }
                for w in workers
            ],
        }

    @router.get("/servers")
    async def servers(request: Request) -> dict[str, list[str]]:
        """The router's list of servers to fan control calls out to: this one (the fleet answers as one server)."""
        return {"servers": [str(request.base_url).rstrip("/")]}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        """vLLM's `{"is_paused"}`, and ours: `holders`, each pause in force by holder, with its mode and when its
        lease lapses (unix s; None: held until resumed), and `lapsed`, holders whose leased pause lapsed, when."""
        state = await client.fleet_state()
        held = {h: {"mode": m, "lease_until": state.leases.get(h)} for h, m in state.holders.items()}
        return {"is_paused": state.paused, "holders": held, "lapsed": state.lapsed}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": (await client.fleet_state()).sleep_level > 0}

    return router
