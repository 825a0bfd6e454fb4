"""Traces through the queue, as a user turns them on: `OTEL_EXPORTER_OTLP_ENDPOINT` pointed at an OTLP/HTTP receiver
run by the test, a producer process calling `generate`, echo workers. One call makes one trace: the producer's call,
each attempt's queue wait, take, generation and publish on the worker, the result back at the producer, every span
a child of the call across the processes; a request cut by an abort pause and retried shows both attempts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.support import ROOT, serve, settings_env, wait_until

pytestmark = pytest.mark.timeout(120)

# The producer: one generate (a pause in abort mode and a resume mid-way with `abort`), printing its trajectories.
PRODUCER = r"""
import asyncio, json, sys
from rollout_svc import RolloutClient

async def main():
    async with RolloutClient() as client:
        if sys.argv[1] == "timeout":  # no worker: the call ends unanswered
            from rollout_svc import RequestTimeoutError
            try:
                await client.generate([[1, 2, 3]], {"max_tokens": 4}, timeout_s=1.0)
            except RequestTimeoutError:
                print(json.dumps({"timed_out": True}))
            return
        call = asyncio.create_task(client.generate([list(range(1, 41))], {"max_tokens": 40}))
        if sys.argv[1] == "abort":
            await asyncio.sleep(0.6)
            await client.pause("abort", holder="tracer-test")
            await client.resume(holder="tracer-test")
        [trajectory] = await call
        print(json.dumps({"trace_id": trajectory.trace_id, "interruptions": trajectory.interruptions,
                          "finish_reason": trajectory.finish_reason, "request_id": trajectory.request_id}))

asyncio.run(main())
"""


class Receiver:
    """An OTLP/HTTP traces receiver (`POST /v1/traces`, protobuf): the spans it got, flattened."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    named = resource.resource.attributes
                    service = next(a.value.string_value for a in named if a.key == "service.name")
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            spans.append({
                                "service": service, "name": span.name, "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
                                "attributes": {a.key: _value(a.value) for a in span.attributes},
                            })  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, trace_id: str) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["trace_id"] == trace_id]


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    yield found
    found.server.shutdown()
    found.server.server_close()


def _traced(receiver: Receiver) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}


def produce(settings, mode: str, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PRODUCER, mode],
        env={**settings_env(settings), **env}, cwd=ROOT, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_one_generate_is_one_trace_across_the_processes(settings, workers, receiver):
    workers.start("traced-0", "--engine", "echo", env=_traced(receiver))
    workers.wait_live("traced-0")
    result = produce(settings, "plain", _traced(receiver))
    trace_id = result["trace_id"]
    assert trace_id and len(trace_id) == 32
    wanted = {"rollout.call", "rollout.queue_wait", "rollout.take", "rollout.generation", "rollout.publish"}
    wanted |= {"rollout.result"}
    wait_until(lambda: wanted <= {s["name"] for s in receiver.of(trace_id)}, 15, f"every span of trace {trace_id}")
    spans = {s["name"]: s for s in receiver.of(trace_id)}
    call = spans["rollout.call"]
    assert call["service"] == "rollout-svc-producer" and call["parent"] == ""  # the root: the producer's call
    for name in wanted - {"rollout.call"}:
        assert spans[name]["parent"] == call["span_id"], (name, spans[name])  # linked across the processes
    for name in ("rollout.queue_wait", "rollout.take", "rollout.generation", "rollout.publish"):
        assert spans[name]["service"] == "rollout-svc-worker", spans[name]
        assert spans[name]["attributes"]["rollout.worker_id"] == "traced-0"
        assert spans[name]["attributes"]["rollout.request_id"] == result["request_id"]
    assert spans["rollout.result"]["attributes"]["rollout.finish_reason"] == result["finish_reason"]


def test_a_retried_request_shows_both_attempts(settings, workers, receiver):
    workers.start("traced-1", "--engine", "echo", "--echo-token-delay-s", "0.05", env=_traced(receiver))
    workers.wait_live("traced-1")
    result = produce(settings, "abort", _traced(receiver))
    assert result["interruptions"] >= 1, result  # cut by the pause, continued token-exact
    trace_id = result["trace_id"]

    def generations() -> list[dict[str, Any]]:
        return [s for s in receiver.of(trace_id) if s["name"] == "rollout.generation"]

    wait_until(lambda: len(generations()) >= 2, 15, "both attempts' generation spans")
    call = next(s for s in receiver.of(trace_id) if s["name"] == "rollout.call")
    attempts = generations()
    assert {a["attributes"]["rollout.retry"] for a in attempts} == {False, True}, attempts
    assert len({a["attributes"]["rollout.request_id"] for a in attempts}) == 2  # each attempt under its own id
    assert {a["attributes"]["rollout.original_request_id"] for a in attempts} == {result["request_id"]}
    assert all(a["parent"] == call["span_id"] for a in attempts)
    controls = {s["name"] for s in receiver.spans if s["service"] == "rollout-svc-producer"}
    assert {"rollout.control.pause", "rollout.control.resume"} <= controls  # the pause and resume are spans too


def test_untraced_without_an_endpoint(settings, echo_workers):
    echo_workers(1)
    assert produce(settings, "plain", {})["trace_id"] is None
    time.sleep(0)  # nothing to wait for: no span is made, no receiver asked


def test_an_http_call_joins_its_callers_trace(settings, workers, receiver, tmp_path):
    workers.start("traced-2", "--engine", "echo", env=_traced(receiver))
    workers.wait_live("traced-2")
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with serve(settings, tmp_path / "serve.log", env=_traced(receiver)) as base:
        answer = httpx.post(
            f"{base}/v1/completions",
            json={"model": "echo", "prompt": [1, 2, 3], "max_tokens": 4},
            headers={"traceparent": f"00-{caller_trace}-{caller_span}-01"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        wanted = {"rollout.http", "rollout.call", "rollout.generation", "rollout.result"}
        wait_until(lambda: wanted <= {s["name"] for s in receiver.of(caller_trace)}, 15, "the HTTP call's spans")
    spans = {s["name"]: s for s in receiver.of(caller_trace)}
    assert spans["rollout.http"]["parent"] == caller_span and spans["rollout.http"]["service"] == "rollout-svc-serve"
    assert spans["rollout.call"]["parent"] == spans["rollout.http"]["span_id"]
    assert spans["rollout.generation"]["parent"] == spans["rollout.call"]["span_id"]


def test_a_call_that_ends_unanswered_still_ends_its_span(settings, receiver):
    assert produce(settings, "timeout", _traced(receiver)) == {"timed_out": True}  # no worker took it

    def ended() -> list[dict[str, Any]]:
        return [s for s in receiver.spans if s["name"] == "rollout.call" and "rollout.unanswered" in s["attributes"]]

    [call] = wait_until(ended, 15, "the unanswered call's span")
    assert call["attributes"]["rollout.unanswered"] == 1 and call["attributes"]["rollout.requests"] == 1
