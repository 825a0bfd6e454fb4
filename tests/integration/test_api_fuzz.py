"""The API fuzzed from its own OpenAPI schema (schemathesis), against a real redis-server and 2 echo workers.

Every operation gets schema-valid cases (positive) and, where it takes a body or a query, schema-invalid ones
(negative). Whatever arrives, the app answers it: no 5xx and no exception reaching the server (schemathesis' ASGI
transport raises one), an error in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, an invalid
request a 4xx, and only the statuses the route can give. With 2 live echo workers (instant generations) a 503 (no
worker, Redis down) or a 504 on the data plane would be a bug, so neither is allowed; a 504 is allowed on an admin
command only when the case set its own `timeout_s`, which may be a microsecond. Half of the positive cases name the
served model (`echo`), so they get past the model check into the queue, the workers and the response renderer.
Admin commands that pause or put the fleet to sleep are undone after each case, so the fleet serves throughout.
`/metrics` is not in the schema; `/health` answers 200 here, so its non-OpenAI 503 body never meets the checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import hypothesis
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck
from hypothesis import strategies as st
from schemathesis import APIOperation, BaseSchema, Case, CheckContext, GenerationMode, Response
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import negative_data_rejection, response_schema_conformance

from rollout_svc.api import create_app
from rollout_svc.config import Settings
from tests.support import WorkerProcs

DATA_AUTH = {"Authorization": "Bearer k"}
ADMIN_AUTH = {"Authorization": "Bearer adm"}
MODEL = "echo"  # the model name echo workers report
EXAMPLES = 50  # per operation and mode: 0.5-2 s each here
CONFIG = schemathesis.Config.from_dict(
    {
        # Negative data must be refused with a 4xx (schemathesis' default also accepts a 5xx).
        "checks": {"negative_data_rejection": {"expected-statuses": ["400", "401", "403", "404", "405", "422"]}},
        # An admin command given a `timeout_s` too short for the workers' acks answers 504 (`expected_status`
        # allows it only then).
        "operations": [
            {
                "include-path-regex": "^/admin/",
                "checks": {"not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "504"]}},
            }
        ],
    }
)
SERVER_SIDE_TYPES = {"server_error", "service_unavailable", "timeout"}


def operations() -> list[tuple[str, str, bool]]:
    """(method, path, takes input) of every operation in the schema; building the app needs no Redis. A path
    parameter alone is no input to negate: any string is a valid one."""
    paths = create_app(Settings()).openapi()["paths"]
    return [
        (method.upper(), path, "requestBody" in spec or any(p["in"] != "path" for p in spec.get("parameters", [])))
        for path, methods in paths.items()
        for method, spec in methods.items()
    ]


# The admin token's routes: /admin/*, and the control routes of SkyRL's server protocol (tagged "control").
ADMIN_PATHS = {
    path
    for path, methods in create_app(Settings()).openapi()["paths"].items()
    if path.startswith("/admin") or any("control" in spec.get("tags", []) for spec in methods.values())
}


def cases(admin: bool) -> list[Any]:
    """pytest params: each operation of the data plane (or /admin) positive, and negative where it takes input."""
    params = []
    for method, path, takes_input in operations():
        if (path in ADMIN_PATHS) != admin:
            continue
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if takes_input else [GenerationMode.POSITIVE]
        if path in ("/admin/weights/checkpoint", "/fetch_weights"):
            modes = [GenerationMode.NEGATIVE]  # a valid body is a real weight sync: tests/integration/test_weight_sync
        if "lora_adapter" in path:
            modes = [GenerationMode.NEGATIVE]  # a valid body is a real adapter load: tests/integration/test_adapters
        params += [pytest.param(method, path, mode, id=f"{method} {path} {mode.value}") for mode in modes]
    return params


@pytest.fixture(scope="module")
def api(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BaseSchema]:
    """The app's schema, loaded from the app itself, the app in front of 2 live echo workers (lifespan running)."""
    settings = Settings(redis_url=redis_url, key_prefix="fuzz", api_keys=["k"], admin_token="adm", request_timeout_s=5)
    rds = redis.Redis.from_url(redis_url)
    rds.flushall()
    rds.close()
    workers = WorkerProcs(settings, tmp_path_factory.mktemp("fuzz-workers"))
    try:
        for worker_id in ("echo-0", "echo-1"):
            workers.start(worker_id, "--engine", "echo")
        workers.wait_live("echo-0", "echo-1")
        app = create_app(settings)
        yield schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)
        asgi.shutdown_lifespans()  # the app's lifespan closes its RolloutClient; a failure there fails the test
    finally:
        workers.stop_all()


# --- checks: (ctx, response, case), raising AssertionError on a failure ------------------------------------------


def openai_error_shape(ctx: CheckContext, response: Response, case: Case) -> None:
    """An error response carries OpenAI's error object."""
    if response.status_code >= 400:
        assert_openai_error(response.json())


def expected_status(ctx: CheckContext, response: Response, case: Case) -> None:
    """Only what the route can answer with a healthy fleet and a valid key: 200, 400 (bad body or value), 404 (an
    unknown model; on the admin routes only for unloading an adapter not loaded, vLLM's answer), 409 for loading an
    adapter (the workers here have no checkpoint root: each refuses, named) and for a `/pause` whose `lease_s` ran out
    before the acks came. A 504 on /admin only when the case gave the command its own `timeout_s`."""
    admin = case.operation.path in ADMIN_PATHS
    allowed = {200, 400} if admin else {200, 400, 404}
    if case.operation.path.endswith("/unload_lora_adapter"):  # a lenient body naming no loaded adapter (a CI run)
        allowed.add(404)
    if case.operation.path.endswith("/load_lora_adapter"):  # the fuzz fleet's workers load no adapter: 409 naming each
        allowed.add(409)
    if admin and isinstance(case.body, dict) and case.body.get("timeout_s") is not None:
        allowed.add(504)
    lease_s = (case.query or {}).get("lease_s")
    if case.operation.path == "/pause" and isinstance(lease_s, (int, float)) and lease_s > 0:
        allowed.add(409)  # a lease shorter than the workers' acks take: lapsed before it was answered, `pause_lapsed`
    assert response.status_code in allowed, f"{response.status_code} not among {sorted(allowed)}: {response.text}"


def event_stream(ctx: CheckContext, response: Response, case: Case) -> None:
    """A streamed response is server-sent events of JSON ending with `[DONE]` (the Responses API's: with
    `response.completed`, or its `error` event); an error event in it (its headers were gone) is OpenAI-shaped and
    not a server-side one: a 5xx in disguise."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    lines = response.text.split("\n")  # not splitlines(): U+2028 and the like are text in an event, not line ends
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events, "an empty event stream"
    if case.operation.path == "/v1/responses":
        payloads = [json.loads(event) for event in events]
        assert all(p["sequence_number"] == i for i, p in enumerate(payloads)), "sequence numbers in order from 0"
        if not response.stream_cut_short:
            assert payloads[-1]["type"] in ("response.completed", "error"), f"the stream ends with {events[-1]}"
        for p in payloads:
            if p["type"] == "error":
                assert isinstance(p["message"], str) and p["message"], p
                assert p["code"] not in ("internal_error", "server_error", "redis_error"), f"a server-side error: {p}"
        return
    if not response.stream_cut_short:  # the transport stops reading after a number of events
        assert events[-1] == "[DONE]", f"the stream does not end with [DONE]: {events[-3:]}"
    for event in events:
        if event == "[DONE]":
            continue
        payload = json.loads(event)
        if "error" in payload:
            assert_openai_error(payload)
            assert payload["error"]["type"] not in SERVER_SIDE_TYPES, f"a server-side error in a stream: {event}"


def assert_openai_error(body: Any) -> None:
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"not OpenAI's error shape: {body!r}"
    error = body["error"]
    assert isinstance(error.get("message"), str) and error["message"], f"no message: {body!r}"
    assert isinstance(error.get("type"), str) and error["type"], f"no type: {body!r}"
    assert "param" in error and "code" in error, f"param and code are always there (null or not): {body!r}"
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body


CHECKS = [
    not_a_server_error,
    negative_data_rejection,
    response_schema_conformance,
    openai_error_shape,
    expected_status,
    event_stream,
]


# --- the fuzzing ----------------------------------------------------------------------------------------------------


def fuzz(
    operation: APIOperation, mode: GenerationMode, headers: dict[str, str], after: Callable[[], None] | None = None
) -> None:
    """`EXAMPLES` generated cases of `operation`, each sent with `headers` and checked; `after` runs after each."""

    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        # Schemathesis' bodies are big and slow to draw on a busy machine; that is no flaw of the test.
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode), served_model=st.booleans())
    def run(case: Case, served_model: bool) -> None:
        if mode.is_positive and served_model and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # past the model check (a 404) into the queue, the workers and the renderer
        try:
            response = case.call(headers=headers)  # an exception the app let through to the server raises here
            case.validate_response(response, checks=CHECKS, headers=headers)
        finally:
            if after is not None:
                after()

    run()


@pytest.mark.timeout(60)  # a failure's shrinking replays many cases
@pytest.mark.parametrize(("method", "path", "mode"), cases(admin=False))
def test_data_plane_answers_any_input_without_a_server_error(api: BaseSchema, method, path, mode):
    fuzz(api[path][method], mode, DATA_AUTH)


@pytest.mark.timeout(60)  # a failure's shrinking replays many cases
@pytest.mark.parametrize(("method", "path", "mode"), cases(admin=True))
def test_admin_routes_answer_any_input_without_a_server_error(api: BaseSchema, method, path, mode):
    with asgi.get_client(api.app) as http:

        def serve_again() -> None:
            """Release every pause holder and wake the fleet, so the next case meets a serving fleet."""
            state = http.get("/admin/state", headers=ADMIN_AUTH).json()
            for holder in state["holders"]:
                response = http.post("/admin/resume", json={"holder": holder}, headers=ADMIN_AUTH)
                assert response.status_code == 200, response.text
            if state["sleep_level"]:
                response = http.post("/admin/wake_up", json={}, headers=ADMIN_AUTH)
                assert response.status_code == 200, response.text

        fuzz(api[path][method], mode, ADMIN_AUTH, after=serve_again)
        state = http.get("/admin/state", headers=ADMIN_AUTH).json()
        assert (state["holders"], state["sleep_level"]) == ({}, 0)
        served = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}, headers=DATA_AUTH
        )
        assert served.status_code == 200, served.text


# What the fuzzer found, kept as examples it may not draw again.
FOUND = [
    # An integer beyond 64 bits anywhere in a body failed msgpack's encoding on its way to the workers: a 500.
    ("/detokenize", {"tokens": [2**64]}, "tokens.0"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2**64]}, "prompt.list[constrained-int].1"),
    ("/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 2**64}, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "x": -(2**63) - 1}]}, "messages.0.x"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user"}], "chat_template_kwargs": {"a": [2**64]}},
        "chat_template_kwargs.a.0",
    ),
    # A boolean or a numeric string where the schema says number was coerced (`true` ran as 1 s), not refused.
    ("/admin/reset_prefix_cache", {"timeout_s": True}, "timeout_s"),
    ("/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": "16"}, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}], "stream": 1}, "stream"),
]


@pytest.mark.parametrize(("path", "body", "param"), FOUND)
def test_what_the_fuzzer_found_is_a_400_naming_the_value(api: BaseSchema, path, body, param):
    headers = ADMIN_AUTH if path.startswith("/admin") else DATA_AUTH
    with asgi.get_client(api.app) as http:
        response = http.post(path, json=body, headers=headers)
    assert response.status_code == 400, response.text
    assert_openai_error(response.json())
    assert f"{param}: " in response.json()["error"]["message"], response.text
