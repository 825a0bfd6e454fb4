"""The hot lane: the two routes SkyRL's `generate` calls for every completion (`POST /inference/v1/generate`, then
`POST /detokenize`), answered in front of the app's middleware stack, without Starlette's router, FastAPI's request
machinery and the middlewares.

Why: a profile of `serve` under SkyRL's client at 64 in flight (py-spy; BENCHMARKS.md (i)) put a third of its CPU in
the layers between uvicorn and the endpoint (route matching over every route, dependency solving, the exception
wrappers), more than the endpoints and the queue client together. The lane runs the same endpoint function the
FastAPI route runs (registered on both by `HotLane.post`, so `/docs` lists it and the route answers alike if the lane
is bypassed), with the same checks in the same order: the bearer secret (`Auth.data`), the JSON body validated by
the same pydantic model (a failure is FastAPI's 400, `invalid_body`), then the endpoint; any error answered in
OpenAI's shape as the app's handlers answer it (`from_exception`). It counts its requests itself (`observe`), under
their path, as the metrics middleware counts the others. A profile at 1 in flight then showed the middlewares'
wrappers of every `send`, JSON parsing before pydantic's validation and the standard library's JSON encoder at about a
sixth of what was left: the lane sits in front of the middlewares (`outermost`), validates the raw body in one step
(`model_validate_json`) and its routes answer with `FastJSONResponse` (msgspec).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
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

        lane = HotLane(auth.data, metrics.observe_request)
        lane.outermost(app)                            # in front of every middleware of the app

        @lane.post(router, "/detokenize", DetokenizeBody)
        async def detokenize(body: DetokenizeBody, request: Request) -> Response: ...
    """

    def __init__(
        self, check: Callable[[Request], None], observe: Callable[[str, int, float], None] | None = None
    ) -> None:
        self.check, self.observe = check, observe
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

    def outermost(self, app: Starlette) -> None:
        """Put this lane in front of `app`'s whole middleware stack (Starlette's error middleware and every middleware
        added to `app`, whatever the order they are added in): its routes skip them all; every other request goes
        through them as before. Each request the lane answers is passed to `observe(route path, HTTP status,
        seconds)` once its response is sent (or failed), as the metrics middleware counts the others."""
        build = app.build_middleware_stack
        app.build_middleware_stack = lambda: _HotRoutes(build(), self)  # type: ignore[method-assign]


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
        started, status = time.perf_counter(), 500
        scope["route"] = route
        request = Request(scope, receive)
        try:
            try:
                self.lane.check(request)
                body = await _body(request, route.body)
                response = await route.endpoint(body, request)
            except Exception as exc:  # as the app's exception handlers answer it (rollout_svc.api.errors)
                response = json_response(from_exception(exc))
            status = response.status_code
            await response(scope, receive, send)
        finally:
            if self.lane.observe is not None:
                self.lane.observe(route.path, status, time.perf_counter() - started)


class FastJSONResponse(JSONResponse):
    """A `JSONResponse` encoded by msgspec (in C, about 5x the standard library's `json.dumps` that `JSONResponse`
    renders with). The same JSON (compact, UTF-8; an exponent may be spelled shorter: `1e-7` for `1e-07`), except a NaN
    or an infinity: `JSONResponse` refuses it (a 500), this writes `null`."""

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def _route_path(scope: Scope) -> str:
    """The path routes match against: the request's path less the app's `root_path` (as Starlette's router)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _body(request: Request, model: type[B]) -> B:
    """The request's JSON body as `model`, validated as FastAPI validates a body parameter, parsed and validated in
    one step by pydantic-core (`model_validate_json`: JSON's types are the same in both of pydantic's modes). Raises
    `APIError` 400: not JSON, no body, or `invalid_body` naming every field that failed."""
    raw = await request.body()
    if raw.strip() in (b"", b"null"):
        raise APIError(400, "body: Field required (send a JSON object)", param="body")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors()
        if errors and errors[0]["type"] == "json_invalid":
            raise APIError(400, f"the body is not JSON: {errors[0]['msg']}") from exc
        raise invalid_body(errors) from exc
