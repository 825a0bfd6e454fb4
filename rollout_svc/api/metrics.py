"""The API's Prometheus metrics: HTTP requests and tokens it served, and fleet gauges read from Redis per scrape.

Served at `GET /metrics` in Prometheus' text format (`install_metrics`). Names:

- `rollout_api_requests_total{route,status}`: `route` is the matched route's path template (`/v1/models`), or
  `other` for a path no route matches, so the label's values stay bounded whatever clients send.
- `rollout_api_request_duration_seconds{route}` (histogram): until the response's last byte (a stream's too).
- `rollout_api_pause_lapses_total`: HTTP pauses whose holder went quiet past its lease (`api/pause_holders.py`).
- `rollout_api_prompt_tokens_total`, `rollout_api_completion_tokens_total`, and the histogram
  `rollout_api_time_to_first_token_seconds`: reported by the routes (`count_tokens`, `observe_first_token`).
- Fleet gauges, read from Redis at each scrape (what `rollout-svc status` reads): `rollout_redis_up` (0 or 1; while
  0, the others are left out), `rollout_queue_depth{stream}` (entries waiting to be taken),
  `rollout_pending_entries{stream}` (taken, not yet answered), `rollout_dead_letters`, `rollout_workers{state}`
  (live workers in each state, 0 included), `rollout_paused` (0 or 1), `rollout_weight_version` (committed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any, get_args

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.client.status import fleet_status
from rollout_svc.config import Settings
from rollout_svc.keys import WorkerLabel

log = logging.getLogger("rollout_svc.api")
UNMATCHED_ROUTE = "other"  # the route label of a request no route matched (a 404, a redirect)
FLEET_READ_TIMEOUT_S = 5.0  # a scrape answers (with rollout_redis_up 0) rather than hang on a Redis that hangs
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
FIRST_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class FleetCollector(Collector):
    """Yields the fleet gauges from the last `fleet_status` snapshot (None: Redis did not answer)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        fleet = self.snapshot
        yield GaugeMetricFamily(
            "rollout_redis_up", "Whether Redis answered this scrape (0 or 1).", float(fleet is not None)
        )
        if fleet is None:
            return
        depth = GaugeMetricFamily("rollout_queue_depth", "Entries waiting to be taken, per stream.", labels=["stream"])
        pending = GaugeMetricFamily(
            "rollout_pending_entries", "Entries taken by a worker and not yet answered, per stream.", labels=["stream"]
        )
        for stream, counts in fleet["streams"].items():
            depth.add_metric([stream], counts["queued"])
            pending.add_metric([stream], counts["pending"])
        workers = GaugeMetricFamily("rollout_workers", "Live workers, per state.", labels=["state"])
        for state in get_args(WorkerLabel):
            workers.add_metric([state], sum(w["state"] == state for w in fleet["workers"]))
        yield depth
        yield pending
        yield workers
        yield GaugeMetricFamily(
            "rollout_dead_letters", "Entries in the dead-letter stream.", float(fleet["dead_letters"])
        )
        yield GaugeMetricFamily("rollout_paused", "Whether the fleet is paused (0 or 1).", float(fleet["paused"]))
        yield GaugeMetricFamily(
            "rollout_weight_version", "The committed weight version.", float(fleet["weight_version"])
        )


class ApiMetrics:
    """The API's metrics in a registry of their own (so several apps in one process do not collide).

    Example::

        metrics = ApiMetrics(settings)
        metrics.count_tokens(prompt=12, completion=64)
        body = await metrics.render()   # Prometheus text format; reads the fleet gauges from Redis first
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rollout_api_requests",
            "HTTP requests answered, by route template and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "rollout_api_request_duration_seconds",
            "Seconds from a request's arrival to its response's last byte, by route template.",
            ["route"],
            registry=self.registry,
            buckets=DURATION_BUCKETS_S,
        )
        self.prompt_tokens = Counter(
            "rollout_api_prompt_tokens", "Prompt tokens of served requests.", registry=self.registry
        )
        self.completion_tokens = Counter(
            "rollout_api_completion_tokens", "Completion tokens of served requests.", registry=self.registry
        )
        self.pause_lapses = Counter(
            "rollout_api_pause_lapses",
            "HTTP pauses that lapsed: their holder stopped calling before its lease ran out (it died or hung).",
            registry=self.registry,
        )
        self.first_token = Histogram(
            "rollout_api_time_to_first_token_seconds",
            "Seconds from a streamed request's arrival to its first token.",
            registry=self.registry,
            buckets=FIRST_TOKEN_BUCKETS_S,
        )
        self.fleet = FleetCollector()
        self.registry.register(self.fleet)
        self._by_label: dict[tuple[str, int], tuple[Any, Any]] = {}  # (route, status): its counter and histogram

    def observe_request(self, route: str, status: int, duration_s: float) -> None:
        """Count one answered request: `route` a path template (or `other`), `status` its HTTP status code."""
        children = self._by_label.get((route, status))
        if children is None:  # prometheus-client's labels() takes a lock and builds its key on every call
            children = (self.requests.labels(route, str(status)), self.duration.labels(route))
            self._by_label[route, status] = children
        children[0].inc()
        children[1].observe(duration_s)

    def count_tokens(self, prompt: int, completion: int) -> None:
        """Add one response's token counts (prompt tokens, generated tokens; both >= 0)."""
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)

    def observe_first_token(self, seconds: float) -> None:
        """Record a streamed response's time to first token, in seconds from the request's arrival."""
        self.first_token.observe(seconds)

    async def refresh_fleet(self) -> None:
        """Read the fleet gauges from Redis (one `fleet_status`); if Redis fails or hangs, `rollout_redis_up` is 0."""
        try:
            self.fleet.snapshot = await asyncio.wait_for(fleet_status(self.settings), FLEET_READ_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("metrics: could not read the fleet from Redis (%s); rollout_redis_up is 0", exc)
            self.fleet.snapshot = None

    async def render(self) -> bytes:
        """Refresh the fleet gauges, then every metric in Prometheus' text format (`CONTENT_TYPE_LATEST`)."""
        await self.refresh_fleet()
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware counting each HTTP request when its response ends (a stream is not buffered)."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets if the app raises before it starts a response

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.observe_request(route_template(scope), status, time.perf_counter() - started)


def route_template(scope: Scope) -> str:
    """The path template of the route the router matched (Starlette sets `scope["route"]`), else `other`."""
    return getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE


def install_metrics(app: FastAPI, client: RolloutClient) -> ApiMetrics:
    """Count `app`'s requests and serve `GET /metrics` (no auth; fleet gauges read from `client`'s Redis).

    Call it while building the app (middleware cannot be added once it serves). Returns the `ApiMetrics`, whose
    `count_tokens` and `observe_first_token` the routes call; it is also `app.state.metrics`.
    """
    metrics = ApiMetrics(client.settings)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.state.metrics = metrics

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        """Every metric in Prometheus' text format; a Redis that does not answer gives `rollout_redis_up 0`."""
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return metrics
