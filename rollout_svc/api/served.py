"""What every generation route checks first: the model asked for against the live workers' and the fleet's LoRA
adapters (`ServedModels`), and the request's session (`session_header`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi import Request

from rollout_svc.client.rollout_client import AdapterSpec, RolloutClient
from rollout_svc.openai.errors import APIError
from rollout_svc.protocol import WorkerStatus

T = TypeVar("T")


class Refreshed(Generic[T]):
    """A value read anew at most once per `ttl_s`, by one read at a time: callers that find it stale while a read is
    under way await that read (single flight). Without that, every request in flight when the value went stale
    read it at once: 1,000 SkyRL generates at a moment took the client's connections past redis-py's pool limit
    (100), and some were answered 503 "Too many connections". A failed read fails its waiters and is tried again
    by the next caller."""

    def __init__(self, read: Callable[[], Awaitable[T]], initial: T, ttl_s: float) -> None:
        self.read, self.value, self.ttl_s = read, initial, ttl_s
        self.read_at = float("-inf")
        self._reading: asyncio.Future[T] | None = None

    async def get(self) -> T:
        if time.monotonic() - self.read_at <= self.ttl_s:
            return self.value
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read())
        return await asyncio.shield(self._reading)

    async def _read(self) -> T:
        try:
            self.value, self.read_at = await self.read(), time.monotonic()
            return self.value
        finally:
            self._reading = None


def session_header(request: Request, body_session: str | None) -> str | None:
    """The session of a request: the `X-Session-ID` header (read directly: a declared header parameter costs FastAPI
    ~5% of a request), else the body's `session_id`. Raises `APIError` 400 for an empty or over-long one."""
    session = request.headers.get("x-session-id")
    if session is None:
        return body_session
    if not 0 < len(session) <= 256:
        raise APIError(400, "X-Session-ID must be 1 to 256 characters", param="X-Session-ID")
    return session


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: `name`, to answer with; the LoRA `adapter` (None: a base model); the named
    model whose workers run it (`model_name`, "": the default model)."""

    name: str
    adapter: str | None
    model_name: str


class ServedModels:
    """The live workers, read from Redis at most once per `ttl_s`, and the model names served: `served_model_names`,
    or every model a live worker has reported (the model folder's name) since this process started, kept while no
    worker is live: a moment without a live worker (one killed, its replacement starting) changes neither
    `/v1/models` nor what a request may name. Such a request waits in the queue, within its deadline, as the Python
    client's do; `/health` is what says the fleet is down."""

    def __init__(self, client: RolloutClient, served_model_names: list[str], ttl_s: float = 1.0) -> None:
        self.client, self.served, self.ttl_s = client, served_model_names, ttl_s
        self._workers: Refreshed[list[WorkerStatus]] = Refreshed(self._read_workers, [], ttl_s)
        self._seen: set[str] = set()  # models live workers reported, kept after they died
        self._named: Refreshed[list[str]] = Refreshed(client.named_models, [], ttl_s)  # named models, own queues each
        self._clients: dict[str, RolloutClient] = {}  # named model -> its client

    async def named(self) -> list[str]:
        """The named models of the deployment (their workers registered them), read at most once per `ttl_s`."""
        return await self._named.get()

    def client_for(self, model_name: str) -> RolloutClient:
        """The client of named model `model_name` ("": the fleet's default model, this app's own client)."""
        if not model_name:
            return self.client
        if model_name not in self._clients:
            self._clients[model_name] = RolloutClient(self.client.settings, model_name=model_name)
        return self._clients[model_name]

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    async def workers(self) -> list[WorkerStatus]:
        """The live workers, read at most once per `ttl_s`."""
        return await self._workers.get()

    async def _read_workers(self) -> list[WorkerStatus]:
        workers = await self.client.workers()
        self._seen.update(w.model for w in workers if w.model)
        return workers

    async def first(self) -> str | None:
        """The name `/v1/models` lists first (None while no model is known)."""
        return next(iter(await self.models()), None)

    async def models(self) -> list[str]:
        """The default model's names (configured, or what its workers reported), then the named models."""
        named = await self.named()
        if self.served:
            return [*self.served, *(n for n in named if n not in self.served)]
        await self.workers()
        return [*sorted(self._seen - set(named)), *named]

    async def max_model_lens(self, names: list[str]) -> dict[str, int]:
        """Per served name, the longest context (`max_model_len`, tokens) of a live worker serving it, as vLLM's
        `/v1/models` reports it; a name whose workers are all away (or have not started an engine yet) is left
        out. The default model's names share its workers' (every live worker not of a named model)."""
        named = await self.named()
        longest: dict[str, int] = {}
        for worker in await self.workers():
            key = worker.model if worker.model in named else ""
            longest[key] = max(longest.get(key, 0), worker.max_model_len)
        lens = {name: longest.get(name if name in named else "", 0) for name in names}
        return {name: length for name, length in lens.items() if length}

    async def adapters(self) -> dict[str, tuple[str, AdapterSpec]]:
        """The LoRA adapters every model holds now, name -> (the named model holding it, "" for the default model;
        its spec). Read at every call: an unloaded one must answer 404 at once."""
        held = {name: ("", spec) for name, spec in (await self.client.adapters()).items()}
        for model_name in await self.named():
            for name, spec in (await self.client_for(model_name).adapters()).items():
                held.setdefault(name, (model_name, spec))
        return held

    async def resolve(self, model: str | None) -> Target:
        """What a request's `model` names, read once: the name to answer with (None: the first served), the LoRA
        adapter it names (vLLM's convention: `model=<adapter name>`), and the named model whose workers run it.
        Raises `APIError` 404 for a model not served, 503 while no model is known (no name configured, and no
        worker has been live since this process started)."""
        names = await self.models()
        if not names:
            raise APIError(
                503,
                "no worker has been live since this server started, so it knows no model: start one with "
                "`rollout-svc worker` or `rollout-svc up` (or name the model with ROLLOUT_SERVED_MODEL_NAME)",
                code="no_worker",
            )
        model = names[0] if model is None else model
        if model in names:
            return Target(model, None, model if model in await self.named() else "")
        adapters = await self.adapters()
        if model not in adapters:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {', '.join([*names, *sorted(adapters)])}",
                param="model",
                code="model_not_found",
            )
        return Target(model, model, adapters[model][0])
