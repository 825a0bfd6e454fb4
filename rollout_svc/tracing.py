"""OpenTelemetry traces through the queue: off unless an OTLP endpoint is set.

Configured by OpenTelemetry's own variables, read by its SDK: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns tracing on, exported over OTLP/HTTP (protobuf) in batches
(`OTEL_BSP_SCHEDULE_DELAY`, ms); `OTEL_SERVICE_NAME` names the process (default: `rollout-svc-<role>`);
`OTEL_SDK_DISABLED=true` keeps it off; `OTEL_TRACES_SAMPLER` samples. Off, nothing of OpenTelemetry is imported and
each hook costs one check.

A trace follows a call: the producer's call (`rollout.call`, in the process that called `generate`, `stream`,
`sample` or an HTTP route, under the HTTP caller's `traceparent` where it sent one) is the parent of every span of
its requests, wherever they run; its W3C `traceparent` travels in each request entry (`RolloutRequest.traceparent`),
retries and moves included (they copy the request). A worker adds, per attempt: `rollout.queue_wait` (submission to
its take), `rollout.take`, `rollout.generation` (the engine; vLLM's own tracing on GPU workers is handed the same
parent) and `rollout.publish` (the answer to its result published); the producer `rollout.result` as each result
arrives. Control commands (`rollout.control.<command>`) and weight syncs (`rollout.weight_sync`) are spans of their
issuer's. A request's trace id is in its result (`Trajectory.trace_id`). Times are each process's own clock.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_state: dict[str, Any] = {}  # "tracer" once set up; "off" once found off


def enabled() -> bool:
    """Whether this process traces: an OTLP endpoint is set and the SDK is not disabled."""
    if "off" in _state:
        return False
    if "tracer" in _state:
        return True
    on = any(os.environ.get(name) for name in _ENDPOINTS) and os.environ.get("OTEL_SDK_DISABLED", "").lower() != "true"
    if not on:
        _state["off"] = True
    return on


def setup(role: str) -> Any:
    """Set up this process's tracer (once; the first role names the service unless `OTEL_SERVICE_NAME` does): an
    SDK `TracerProvider` exporting over OTLP/HTTP in batches. Returns the tracer, or None where tracing is off."""
    if not enabled():
        return None
    if "tracer" not in _state:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        name = os.environ.get("OTEL_SERVICE_NAME") or f"rollout-svc-{role}"
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _state["provider"], _state["tracer"] = provider, provider.get_tracer("rollout_svc")
    return _state["tracer"]


def tracer() -> Any:
    """This process's tracer (set up as a producer if nothing set it up before), or None where tracing is off."""
    return _state.get("tracer") or setup("producer")


def shutdown() -> None:
    """Export what is still buffered (a process that exits)."""
    provider = _state.get("provider")
    if provider is not None:
        provider.shutdown()


def traceparent(span: Any) -> str | None:
    """The W3C `traceparent` of `span`'s context (None for no span)."""
    if span is None:
        return None
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def parent_of(header: str | None) -> Any:
    """The OpenTelemetry context a W3C `traceparent` names (None for none, or one that does not parse)."""
    if not header:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({"traceparent": header})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def trace_id(header: str | None) -> str | None:
    """The trace id (32 hex digits) of a W3C `traceparent`, or None."""
    if not header:
        return None
    parts = header.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def record(name: str, parent: str | None, start_s: float, end_s: float | None = None, **attributes: Any) -> None:
    """A finished span `name` under the `traceparent` `parent`, from `start_s` to `end_s` (unix s; now by default),
    with `attributes` (None values left out). Nothing where tracing is off or there is no parent."""
    if parent is None or (active := tracer()) is None:
        return
    span = active.start_span(name, context=parent_of(parent), start_time=int(start_s * 1e9))
    span.set_attributes(_given(attributes))
    span.end(end_time=int((time.time() if end_s is None else end_s) * 1e9))


@contextlib.contextmanager
def span(name: str, parent: str | None = None, **attributes: Any) -> Iterator[Any]:
    """A span around the block, under the `traceparent` `parent` or this context's current span, made current in
    the block; yields it (None where tracing is off). An exception in the block is recorded on it."""
    active = tracer()
    if active is None:
        yield None
        return
    with active.start_as_current_span(name, context=parent_of(parent)) as current:
        current.set_attributes(_given(attributes))
        yield current


def start(name: str, **attributes: Any) -> Any:
    """A span started under this context's current span (the caller ends it), or None where tracing is off."""
    active = tracer()
    if active is None:
        return None
    started = active.start_span(name)
    started.set_attributes(_given(attributes))
    return started


def _given(attributes: dict[str, Any]) -> dict[str, Any]:
    """A span's attributes, the None values left out (OpenTelemetry takes none)."""
    return {k: v for k, v in attributes.items() if v is not None}
