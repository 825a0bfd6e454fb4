"""The hot lane (rollout_svc.api.hot) on a bare FastAPI app, no Redis: it answers its routes itself with the same
checks as FastAPI's route (auth first, then the body, then the endpoint), in OpenAI's error shape, and passes
everything else to the app."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from rollout_svc.api.auth import Auth
from rollout_svc.api.errors import install_error_handlers
from rollout_svc.api.hot import HotLane
from rollout_svc.errors import QueueFullError
from rollout_svc.openai.schemas import Body

KEY = "secret-key"


class Echo(Body):
    tokens: list[int] = Field(min_length=1)


def build() -> tuple[FastAPI, list[str]]:
    """An app whose `/echo` is on the lane and `/slow` is FastAPI's; `seen` records which way each request went, and
    what the lane counted (`observed:<path>:<status>`)."""
    app = FastAPI()
    install_error_handlers(app)
    auth = Auth([KEY], None)
    seen: list[str] = []
    lane = HotLane(auth.data, lambda path, status, seconds: seen.append(f"observed:{path}:{status}"))
    lane.outermost(app)

    @app.middleware("http")
    async def note(request: Request, call_next: Any) -> Response:  # added after: the lane is still in front of it
        seen.append(f"middleware:{request.url.path}")
        response: Response = await call_next(request)
        return response

    @lane.post(app, "/echo", Echo, [auth.data_dependency()])
    async def echo(body: Echo, request: Request) -> Response:
        seen.append(f"echo:{request.scope.get('route').path}")
        if body.tokens == [429]:
            raise QueueFullError("requests", 10, 10)
        if body.tokens == [500]:
            raise RuntimeError("a bug")
        return JSONResponse({"tokens": body.tokens[::-1]}, headers={"X-Lane": "yes"})

    @app.post("/slow", dependencies=[auth.data_dependency()])
    async def slow(body: Echo) -> dict[str, list[int]]:
        seen.append("slow")
        return {"tokens": body.tokens}

    return app, seen


AUTH = {"Authorization": f"Bearer {KEY}"}


async def test_the_lane_answers_its_routes_and_passes_the_rest_on() -> None:
    app, seen = build()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
        answer = await http.post("/echo", json={"tokens": [1, 2, 3]}, headers=AUTH)
        assert answer.status_code == 200 and answer.json() == {"tokens": [3, 2, 1]}
        assert answer.headers["x-lane"] == "yes"
        assert (await http.post("/slow", json={"tokens": [7]}, headers=AUTH)).json() == {"tokens": [7]}
        assert (await http.get("/echo", headers=AUTH)).status_code == 405  # a GET is FastAPI's: its route is POST
        assert (await http.post("/echo/", json={"tokens": [1]}, headers=AUTH)).status_code in (307, 404)
        assert seen == [
            "echo:/echo",
            "observed:/echo:200",
            "middleware:/slow",
            "slow",
            "middleware:/echo",  # the GET, and the path with a slash: FastAPI's, through the middleware
            "middleware:/echo/",
        ]
        # The FastAPI route is registered too (its OpenAPI entry), with the same body model.
        assert "/echo" in app.openapi()["paths"]


async def test_the_lane_checks_as_fastapi_does_and_answers_in_openai_shape() -> None:
    app, seen = build()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
        for path in ("/echo", "/slow"):  # the lane and FastAPI's route answer alike
            missing = await http.post(path, json={"tokens": [1]})
            assert missing.status_code == 401
            assert missing.json()["error"]["code"] == "missing_api_key"
            wrong = await http.post(path, json={"tokens": [1]}, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
            bad = await http.post(path, json={"tokens": "abc"}, headers=AUTH)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens", bad.text
            empty = await http.post(path, json={"tokens": []}, headers=AUTH)
            assert empty.status_code == 400 and "tokens" in empty.json()["error"]["message"]
        not_json = await http.post("/echo", content=b"{nope", headers=AUTH)
        assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]["message"]
        no_body = await http.post("/echo", headers=AUTH)
        assert no_body.status_code == 400
        lane_seen = [s for s in seen if not s.startswith("middleware:")]
        # Nothing reached an endpoint; the lane counted what it answered.
        assert lane_seen == [f"observed:/echo:{status}" for status in (401, 401, 400, 400, 400, 400)], seen
        seen.clear()

        full = await http.post("/echo", json={"tokens": [429]}, headers=AUTH)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        bug = await http.post("/echo", json={"tokens": [500]}, headers=AUTH)
        assert bug.status_code == 500 and bug.json()["error"]["code"] == "internal_error"
        assert seen == ["echo:/echo", "observed:/echo:429", "echo:/echo", "observed:/echo:500"]


async def test_the_lane_matches_below_the_root_path() -> None:
    app, seen = build()
    transport = httpx.ASGITransport(app=app, root_path="/api")  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
        answer = await http.post("/api/echo", json={"tokens": [4, 5]}, headers=AUTH)
        assert answer.status_code == 200 and answer.json() == {"tokens": [5, 4]}
        assert seen == ["echo:/echo", "observed:/echo:200"]
