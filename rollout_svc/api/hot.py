"""The hot lane: the two routes SkyRL's `generate` calls for every completion (`POST /inference/v1/generate`, then
`POST /detokenize`), answered without Starlette's router, FastAPI's request machinery and its exception middlewares.

Why: a profile of `serve` under SkyRL's client at 64 in flight (py-spy; BENCHMARKS.md (i)) put a third of its CPU in
the layers between uvicorn and the endpoint (route matching over every route, dependency solving, the exception
wrappers), more than the endpoints and the queue client together. The lane runs the same endpoint function the
FastAPI route runs (registered on both by `HotLane.post`, so `/docs` lists it and the route answers alike if the lane
is bypassed), with the same checks in the same order: the bearer secret (`Auth.data`), the JSON body validated by
the same pydantic model (a failure is FastAPI's 400, `invalid_body`), then the endpoint; any error answered in
OpenAI's shape as the app's handlers answer it (`from_exception`). It sits inside the metrics middleware, so its
requests are counted under their path.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_svc.api.errors import json_response
from rollout_svc.openai.errors import APIError, from_exception, invalid_body

B = TypeVar("B", bound=BaseModel)
Endpoint = Callable[[Any, Request], Awaitable[Response]]


@dataclass(frozen=True)
class HotRoute:
    path: str  # also the route label the metrics middleware reads (`scope["route"].path`)
    body: type[BaseModel]
    endpoint: Endpoint


class HotLane:
    """The hot routes of one app and the check every one runs first (`check(request)`, raising `APIError`).

    Example::

        lane = HotLane(auth.data)
        app.add_middleware(lane.middleware)            # before the metrics middleware: inside it

        @lane.post(router, "/detokenize", DetokenizeBody)
        async def detokenize(body: DetokenizeBody, request: Request) -> Response: ...
    """

    def __init__(self, check: Callable[[Request], None]) -> None:
        self.check = check
        self.routes: dict[str, HotRoute] = {}

    def post(
        self, router: APIRouter | Any, path: str, body: type[B], dependencies: Sequence[Any] | None = None
    ) -> Callable[[Endpoint], Endpoint]:
        """Register an endpoint `(body: B, request) -> Response` at `POST path` on `router` (a FastAPI app or
        `APIRouter`, with `dependencies`: the same check as this lane's) and on this lane."""

        def register(endpoint: Endpoint) -> Endpoint:
            router.post(path, dependencies=dependencies)(endpoint)
            self.routes[path] = HotRoute(path, body, endpoint)
            return endpoint

        return register

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """The ASGI middleware around `app` (Starlette's `add_middleware` calls this with the inner app)."""
        return _HotRoutes(app, self)


class _HotRoutes:
    def __init__(self, app: ASGIApp, lane: HotLane) -> None:
        self.app, self.lane = app, lane

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.lane.routes.get(_route_path(scope))
        if route is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = route
        request = Request(scope, receive)
        try:
            self.lane.check(request)
            body = await _body(request, route.body)
            response = await route.endpoint(body, request)
        except Exception as exc:  # as the app's exception handlers answer it (rollout_svc.api.errors)
            response = json_response(from_exception(exc))
        await response(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path routes match against: the request's path less the app's `root_path` (as Starlette's router)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _body(request: Request, model: type[B]) -> B:
    """The request's JSON body as `model`, validated as FastAPI validates a body parameter (the decoded JSON, in
    Python mode). Raises `APIError` 400: not JSON, or `invalid_body` naming every field that failed."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except ValueError as exc:
        raise APIError(400, f"the body is not JSON: {exc}") from exc
    if data is None:
        raise APIError(400, "body: Field required (send a JSON object)", param="body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from exc
