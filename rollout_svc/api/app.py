"""FastAPI app factory: health and the model list, served from the fleet's heartbeats in Redis.

The OpenAI data plane (/v1/chat/completions, /v1/completions) is not built yet; it lands with the
OpenAI-API issue and will submit through `RolloutClient` like any other producer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from rollout_svc.client import RolloutClient
from rollout_svc.config import Settings


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; it holds one `RolloutClient` (its connection opens on first use)."""
    settings = settings or Settings()
    client = RolloutClient(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.close()

    app = FastAPI(title="rollout-svc", version="0.1.0", lifespan=lifespan)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when Redis answers and at least one worker is live; 503 otherwise, saying which."""
        try:
            workers = await client.workers()
        except (RedisError, OSError) as exc:
            return JSONResponse({"status": "error", "detail": f"Redis unreachable: {exc}"}, status_code=503)
        if not workers:
            detail = "no live workers: start one with `rollout-svc worker`"
            return JSONResponse({"status": "error", "detail": detail}, status_code=503)
        return JSONResponse({"status": "ok", "workers": len(workers)})

    @app.get("/v1/models")
    async def models() -> dict:
        """OpenAI's model list: one entry per model some live worker serves."""
        names = sorted({w.model for w in await client.workers()})
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "rollout-svc"} for n in names]}

    return app
