"""What every generation route checks first: the model asked for against the live workers' (`ServedModels`), and the
request's session (`session_header`)."""

from __future__ import annotations

import time

from fastapi import Request

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.openai.errors import APIError
from rollout_svc.protocol import WorkerStatus


def session_header(request: Request, body_session: str | None) -> str | None:
    """The session of a request: the `X-Session-ID` header (read directly: a declared header parameter costs FastAPI
    ~5% of a request), else the body's `session_id`. Raises `APIError` 400 for an empty or over-long one."""
    session = request.headers.get("x-session-id")
    if session is None:
        return body_session
    if not 0 < len(session) <= 256:
        raise APIError(400, "X-Session-ID must be 1 to 256 characters", param="X-Session-ID")
    return session


class ServedModels:
    """The live workers, read from Redis at most once per `ttl_s`, and the model names served: `served_model_names`,
    or every model a live worker has reported (the model folder's name) since this process started, kept while no
    worker is live: a moment without a live worker (one killed, its replacement starting) changes neither
    `/v1/models` nor what a request may name. Such a request waits in the queue, within its deadline, as the Python
    client's do; `/health` is what says the fleet is down."""

    def __init__(self, client: RolloutClient, served_model_names: list[str], ttl_s: float = 1.0) -> None:
        self.client, self.served, self.ttl_s = client, served_model_names, ttl_s
        self._workers: list[WorkerStatus] = []
        self._read_at = float("-inf")
        self._seen: set[str] = set()  # models live workers reported, kept after they died

    async def workers(self) -> list[WorkerStatus]:
        if time.monotonic() - self._read_at > self.ttl_s:
            self._workers, self._read_at = await self.client.workers(), time.monotonic()
            self._seen.update(w.model for w in self._workers if w.model)
        return self._workers

    async def models(self) -> list[str]:
        if self.served:
            return self.served
        await self.workers()
        return sorted(self._seen)

    async def check(self, model: str | None) -> str:
        """The model name to answer with. Raises `APIError` 404 for a model not served, 503 while no model is known
        (no name configured, and no worker has been live since this process started)."""
        names = await self.models()
        if not names:
            raise APIError(
                503,
                "no worker has been live since this server started, so it knows no model: start one with "
                "`rollout-svc worker` or `rollout-svc up` (or name the model with ROLLOUT_SERVED_MODEL_NAME)",
                code="no_worker",
            )
        if model is None:
            return names[0]
        if model not in names:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {', '.join(names)}",
                param="model",
                code="model_not_found",
            )
        return model
