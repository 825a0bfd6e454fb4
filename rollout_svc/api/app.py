"""The FastAPI app: OpenAI's routes for agents (chat, completions, the Responses API, the Batch API), SkyRL's
session routes, `/admin/*`, health, metrics.

Stateless: every route submits through one `RolloutClient` (a producer like any other), so several `serve`
processes can run against one Redis. Example::

    rollout-svc up --workers 2 --engine vllm --api-port 8000
    python -c "from openai import OpenAI; c = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-');
               print(c.chat.completions.create(model=c.models.list().data[0].id,
                     messages=[{'role': 'user', 'content': 'Hi'}]).choices[0].message.content)"
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from rollout_svc import tracing
from rollout_svc.api.admin import admin_router
from rollout_svc.api.auth import Auth
from rollout_svc.api.batches import batch_router
from rollout_svc.api.dashboard import mount_dashboard
from rollout_svc.api.errors import install_error_handlers
from rollout_svc.api.generation import Generation, until_disconnected
from rollout_svc.api.hot import FastJSONResponse, HotLane
from rollout_svc.api.lora_routes import adapter_router
from rollout_svc.api.metrics import install_metrics
from rollout_svc.api.pause_holders import PauseHolders, RenewOnCall
from rollout_svc.api.response_store import ResponseStore
from rollout_svc.api.responses_routes import responses_router
from rollout_svc.api.served import ServedModels, session_header
from rollout_svc.api.server_info import server_info_router
from rollout_svc.api.skyrl.control_routes import control_router
from rollout_svc.api.skyrl.data_routes import data_router
from rollout_svc.api.skyrl.records import DetokenizedTexts, InFlight
from rollout_svc.api.skyrl.weight_routes import weights_router
from rollout_svc.batch.store import BatchStore
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import Settings
from rollout_svc.errors import GenerationError
from rollout_svc.integrations.skyrl.weights import EngineWeightTransfer
from rollout_svc.openai.errors import APIError
from rollout_svc.openai.plans import chat_plan, completion_plan
from rollout_svc.openai.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeBody, TokenizeBody


def create_app(settings: Settings | None = None, served_model_names: list[str] | None = None) -> FastAPI:
    """Build the app. `served_model_names`: the names `/v1/models` lists and requests must use (default: the
    model folder names the live workers report). Auth comes from `settings.api` (`api_keys`, `admin_token`)."""
    settings = settings or Settings()
    client = RolloutClient(settings)
    served = ServedModels(
        client, list(served_model_names or ([settings.api.served_model_name] if settings.api.served_model_name else []))
    )
    auth = Auth(settings.api.api_keys, settings.api.admin_token)

    batches = BatchStore(settings)
    responses = ResponseStore(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.close()
        await served.close()
        await batches.close()
        await responses.close()
        await transfer.close()
        await holders.close()
        tracing.shutdown()

    app = FastAPI(
        title="rollout-svc",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible API in front of a rollout-svc fleet (Redis Streams + vLLM workers).",
    )
    install_error_handlers(app)
    metrics = install_metrics(app, client)
    lane = HotLane(auth.data, metrics.observe_request)  # SkyRL's two calls per completion (rollout_svc.api.hot)

    async def in_force() -> set[str]:
        return set((await client.fleet_state()).holders)

    holders = PauseHolders(client.renew_pause, in_force, lambda _: metrics.pause_lapses.inc())
    app.add_middleware(RenewOnCall, holders=holders)  # a holder's calls renew its leased pause
    lane.outermost(app)  # in front of the middlewares: it counts its requests in `metrics` itself
    generation = Generation(client, metrics, settings.client.request_timeout_s)
    generation.client_for = served.client_for
    data = [auth.data_dependency()]
    detokenized = DetokenizedTexts()

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when Redis answers and at least one worker is live, of any model; 503 otherwise, saying which.
        `workers`: the live workers; `models`, where the fleet has named models: the live workers of each."""
        try:
            workers = await client.workers()
            named = {n: len(await served.client_for(n).workers()) for n in await client.named_models()}
        except (RedisError, OSError) as exc:
            return JSONResponse({"status": "error", "detail": f"Redis unreachable: {exc}"}, status_code=503)
        total = len(workers) + sum(named.values())
        if not total:
            detail = "no live workers: start one with `rollout-svc worker`"
            return JSONResponse({"status": "error", "detail": detail}, status_code=503)
        return JSONResponse({"status": "ok", "workers": total} | ({"models": named} if named else {}))

    @app.get("/v1/models", dependencies=data)
    async def models() -> dict[str, Any]:
        """OpenAI's model list: the served model names, then the LoRA adapters the fleet holds as vLLM lists them
        (`parent`: the base model, `root`: the adapter's directory). `max_model_len`, as vLLM adds it: the longest
        context of a live worker serving the model (absent while none is live)."""
        names, created = await served.models(), int(time.time())
        lens = await served.max_model_lens(names)
        data = [{"id": n, "object": "model", "created": created, "owned_by": "rollout-svc"} for n in names]
        for entry in data:
            if entry["id"] in lens:
                entry["max_model_len"] = lens[entry["id"]]
        named = await served.named()
        default = next((n for n in names if n not in named), None)
        for name, (model_name, spec) in sorted((await served.adapters()).items()):
            entry = {"id": name, "object": "model", "created": created, "owned_by": "rollout-svc"}
            data.append(entry | {"root": spec.path, "parent": model_name or default, "version": spec.version})
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions", dependencies=data)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions (streaming too); `X-Session-ID` (or `session_id`) pins a conversation to one
        worker, named in the `X-Worker-ID` response header."""
        target = await served.resolve(body.model)
        session = session_header(request, body.session_id)
        plan = chat_plan(body, target.name, session, settings.api.api_default_max_tokens)
        plan.adapter, plan.model_name = target.adapter, target.model_name
        return await generation.respond(request, plan)

    @app.post("/v1/completions", dependencies=data)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI's (legacy) completions: a text or token-id prompt, or a batch of them, in order."""
        target = await served.resolve(body.model)
        plan = completion_plan(body, target.name, session_header(request, body.session_id))
        plan.adapter, plan.model_name = target.adapter, target.model_name
        return await generation.respond(request, plan)

    @app.post("/tokenize", dependencies=data)
    async def tokenize(body: TokenizeBody, request: Request) -> dict[str, Any]:
        """vLLM's tokenize: `{"tokens", "count", "max_model_len"}` from a worker's tokenizer (of the model that
        `model` names)."""
        client = served.client_for((await served.resolve(body.model)).model_name)
        try:
            if body.messages is not None:
                messages = [m.as_dict() for m in body.messages]
                [ids] = await until_disconnected(request, client.apply_chat_template([messages]))
            else:
                texts = [body.prompt or ""]
                [ids] = await until_disconnected(request, client.tokenize(texts, body.add_special_tokens))
        except (GenerationError, ValueError) as exc:
            raise APIError(400, str(exc)) from exc
        return {"tokens": ids, "count": len(ids), "max_model_len": None}

    @lane.post(app, "/detokenize", DetokenizeBody, data)
    async def detokenize(body: DetokenizeBody, request: Request) -> Response:
        """vLLM's detokenize: `{"prompt"}`, the text of `tokens`: of a completion `/inference/v1/generate` just
        returned, known here; else from a worker's tokenizer (of the model that `model` names)."""
        target = await served.resolve(body.model)
        text = detokenized.take(target.name, body.tokens)
        if text is None:
            client = served.client_for(target.model_name)
            try:
                [text] = await until_disconnected(request, client.detokenize([body.tokens]))
            except GenerationError as exc:
                raise APIError(400, str(exc)) from exc
        return FastJSONResponse({"prompt": text})

    @app.post("/v1/sessions/{session_id}/finish", dependencies=data)
    async def finish_session(session_id: str) -> dict[str, Any]:
        """Release a session: its next request is placed anew (its worker's KV cache is no longer favoured)."""
        return {"session_id": session_id, "finished": await client.finish_session(session_id)}

    @app.post("/finish_session", dependencies=data)
    async def finish_session_skyrl(session_id: str) -> dict[str, Any]:
        """SkyRL's spelling: `POST /finish_session?session_id=...`."""
        return {"session_id": session_id, "finished": await client.finish_session(session_id)}

    app.include_router(batch_router(batches), dependencies=data)
    app.include_router(
        responses_router(served, generation, responses, settings.api.api_default_max_tokens), dependencies=data
    )
    inflight = InFlight()
    default_max_tokens = settings.api.api_default_max_tokens
    transfer = EngineWeightTransfer(client.settings)  # one per server: vLLM's weight transfer, fleet-wide
    app.include_router(
        data_router(client, served, generation, inflight, default_max_tokens, detokenized, lane, transfer),
        dependencies=data,
    )
    app.include_router(server_info_router(client, served), dependencies=data)
    control = [] if settings.api.open_control else [auth.admin_dependency()]  # open: loopback only (`serve`)
    app.include_router(control_router(client, inflight, holders, auth), dependencies=control)
    app.include_router(weights_router(client, transfer), dependencies=control)
    app.include_router(adapter_router(client), dependencies=control)
    app.include_router(admin_router(client), dependencies=[auth.admin_dependency()])
    mount_dashboard(app, settings, auth)  # its own check: a header or the sign-in's cookie
    if tracing.setup("serve") is not None:
        trace_http(app)
    return app


def trace_http(app: FastAPI) -> None:
    """Each HTTP request in a span (`rollout.http`) under its caller's W3C `traceparent` header where it sent one:
    the parent of the calls it makes (`rollout_svc.tracing`). Only where tracing is on (a middleware costs every
    request)."""

    @app.middleware("http")
    async def traced(request: Request, call_next: Any) -> Response:
        tags = {"http.request.method": request.method, "url.path": request.url.path}
        with tracing.span("rollout.http", request.headers.get("traceparent"), **tags):
            return await call_next(request)
