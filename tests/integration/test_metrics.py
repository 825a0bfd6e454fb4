"""Prometheus metrics: the API's `GET /metrics` (requests by route, fleet gauges from Redis) and a worker's own
`--metrics-port`, against a real redis-server and real echo worker processes."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rollout_svc import RolloutClient
from rollout_svc.api import create_app
from rollout_svc.config import Settings
from rollout_svc.dataplane.streams import Entry
from rollout_svc.protocol import RolloutRequest, Trajectory
from tests.support import async_wait_until, free_port, queued
from workers.inflight import InFlightIndex
from workers.metrics import WorkerMetrics
from workers.state import WorkerState

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text page: {(sample name, labels): value}."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 for a labelled counter never incremented (prometheus_client omits it)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def fleet_counter(ports: list[int], name: str) -> float:
    """`name` summed over the workers whose metrics are served on `ports` (`--metrics-port`)."""
    total = 0.0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            total += value(parse(response.read().decode()), name)
    return total


@asynccontextmanager
async def api(settings: Settings, timeout_s: float = 5.0) -> AsyncIterator[httpx.AsyncClient]:
    """The API app in process, its lifespan run (so its RolloutClient is closed at the end); an HTTP client of it
    whose requests time out after `timeout_s` (httpx's default: 5 s)."""
    app = create_app(settings)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=timeout_s) as http,
    ):
        yield http


async def scrape(http: httpx.AsyncClient) -> Samples:
    response = await http.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


async def test_api_metrics_count_requests_by_route_and_read_the_fleet(settings, echo_workers, rds):
    echo_workers(2)
    requests_stream = settings.keys.requests
    async with api(settings) as http, RolloutClient(settings) as client:
        # 1. Requests by route template and status; a path no route matches counts under `other`.
        before = await scrape(http)
        for path in ["/v1/models", "/v1/models", "/health", "/no/such/path", "/no/such/other/path"]:
            await http.get(path)
        # SkyRL's two calls per completion, answered by the hot lane (rollout_svc.api.hot), count as any route's.
        generated = await http.post("/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": {}})
        assert generated.status_code == 200, generated.text
        tokens = generated.json()["choices"][0]["token_ids"]
        assert (await http.post("/detokenize", json={"tokens": tokens})).status_code == 200
        assert (await http.post("/inference/v1/generate", json={"token_ids": []})).status_code == 400
        after = await scrape(http)
        routes = [("/v1/models", "200"), ("/health", "200"), ("other", "404"), ("/metrics", "200")]
        routes += [("/inference/v1/generate", "200"), ("/inference/v1/generate", "400"), ("/detokenize", "200")]
        moved = {
            (route, status): value(after, "rollout_api_requests_total", route=route, status=status)
            - value(before, "rollout_api_requests_total", route=route, status=status)
            for route, status in routes
        }
        assert moved == {
            ("/v1/models", "200"): 2,
            ("/health", "200"): 1,
            ("other", "404"): 2,
            ("/metrics", "200"): 1,
            ("/inference/v1/generate", "200"): 1,
            ("/inference/v1/generate", "400"): 1,
            ("/detokenize", "200"): 1,
        }
        assert value(after, "rollout_api_request_duration_seconds_count", route="/v1/models") == 2
        assert not any("no/such" in dict(labels).get("route", "") for _, labels in after)

        # 2. Fleet gauges: workers by state, paused, queue depth; a paused fleet leaves requests queued.
        async def workers_in(state: str) -> float:
            return value(await scrape(http), "rollout_workers", state=state)

        await async_wait_until(lambda: workers_in("serving"), 10, "workers serving in the gauges")
        fleet = await scrape(http)
        assert value(fleet, "rollout_workers", state="serving") == 2
        assert value(fleet, "rollout_workers", state="stale") == 0  # every state is there, 0 included
        assert value(fleet, "rollout_redis_up") == 1
        assert value(fleet, "rollout_paused") == 0
        assert value(fleet, "rollout_weight_version") == 0
        assert value(fleet, "rollout_dead_letters") == 0

        await client.pause("keep")
        generation = asyncio.create_task(client.generate([[1, 2, 3]] * 5, {"max_tokens": 2}))
        await async_wait_until(lambda: queued(rds, requests_stream) == 5, 10, "5 requests queued while paused")
        paused = await scrape(http)
        assert value(paused, "rollout_paused") == 1
        assert value(paused, "rollout_workers", state="paused") == 2
        assert value(paused, "rollout_queue_depth", stream=requests_stream) == 5
        assert value(paused, "rollout_pending_entries", stream=requests_stream) == 0

        await client.resume()
        assert len(await generation) == 5
        resumed = await scrape(http)
        assert value(resumed, "rollout_paused") == 0
        assert value(resumed, "rollout_queue_depth", stream=requests_stream) == 0


async def test_api_metrics_answer_while_redis_is_down(settings):
    nowhere = settings.copy_with(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    async with api(nowhere) as http:
        assert (await http.get("/no/such/path")).status_code == 404
        samples = await scrape(http)
    assert value(samples, "rollout_redis_up") == 0
    assert not any(name == "rollout_paused" for name, _ in samples)  # fleet gauges are left out, not 0
    assert value(samples, "rollout_api_requests_total", route="other", status="404") == 1


async def test_worker_metrics_count_what_it_served(settings, echo_workers):
    port = free_port()
    echo_workers(1, "--metrics-port", str(port), "--max-model-len", "64")
    prompts = [list(range(1, 1 + n)) for n in (3, 5, 8, 13, 21)]  # echo: the completion is the prompt, cut
    async with RolloutClient(settings) as client:
        trajectories = await client.generate(prompts, {"max_tokens": 10})
        # the context's length: taken (the client refuses only longer ones, tests/integration/test_context_limit.py),
        # and refused by the echo worker, which leaves no token to generate
        [failed] = await client.generate([list(range(1, 65))], {"max_tokens": 10})
    assert failed.finish_reason == "error"

    def scrape_worker() -> Samples:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return parse(response.read().decode())

    samples = await asyncio.to_thread(scrape_worker)
    reasons = [t.finish_reason for t in trajectories]
    for reason in ("stop", "length"):
        expected = reasons.count(reason)
        assert value(samples, "rollout_worker_generations_total", finish_reason=reason) == expected
    assert value(samples, "rollout_worker_generations_total", finish_reason="error") == 0
    assert value(samples, "rollout_worker_errors_total", code="invalid_request") == 1
    assert value(samples, "rollout_worker_prompt_tokens_total") == sum(map(len, prompts))
    generated = sum(len(t.completion_token_ids) for t in trajectories)
    assert generated == 3 + 5 + 8 + 10 + 10
    assert value(samples, "rollout_worker_generated_tokens_total") == generated
    assert value(samples, "rollout_worker_engine_seconds_count") == len(prompts)
    assert value(samples, "rollout_worker_staleness_count") == len(prompts)
    assert value(samples, "rollout_worker_staleness_sum") == 0
    assert value(samples, "rollout_worker_redeliveries_total") == 0
    assert value(samples, "rollout_worker_weight_version") == 0


def test_worker_metrics_count_redeliveries_continuations_and_staleness():
    metrics = WorkerMetrics()
    state = WorkerState("w", weight_version=3, committed_version=3)
    metrics.watch(state, InFlightIndex(engine=None))
    metrics.taken(Entry("s", b"1-0", b"", deliveries=1))
    metrics.taken(Entry("s", b"2-0", b"", deliveries=3))
    request = RolloutRequest.model_validate(
        {
            "request_id": "r",
            "reply_to": "results",
            "prompt_token_ids": [1, 2],
            "continuation": {
                "retry_of": "r0",
                "token_ids": [5, 6, 7],
                "logprobs": [0.0] * 3,
                "weight_versions": [(1, 0)],
            },
        }
    )
    trajectory = Trajectory(
        request_id="r",
        prompt_token_ids=[1, 2],
        completion_token_ids=[5, 6, 7, 8, 9],
        finish_reason="abort",
        abort_cause="pause",
        weight_version=3,
        weight_versions=[(1, 0), (3, 3)],
        generation_time_s=0.5,
    )
    metrics.observe(request, trajectory)
    samples = parse(prometheus_text(metrics))
    assert value(samples, "rollout_worker_redeliveries_total") == 1
    assert value(samples, "rollout_worker_generated_tokens_total") == 2  # 3 of the 5 came from an earlier attempt
    assert value(samples, "rollout_worker_aborts_total", cause="pause") == 1
    assert value(samples, "rollout_worker_staleness_sum") == 2  # committed 3, first token under version 1
    assert value(samples, "rollout_worker_weight_version") == 3
    assert value(samples, "rollout_worker_in_flight") == 0


def prometheus_text(metrics: WorkerMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


def test_vllms_own_series_are_served_beside_ours_labelled_with_the_worker():
    """What vLLM's PrometheusStatLogger registers in the process's default registry (its names: `vllm:...`, labels
    model_name and engine) comes out of the worker's /metrics with its worker id; other default-registry series
    (the Python process's own) do not."""
    from prometheus_client import REGISTRY, Counter, Gauge

    metrics = WorkerMetrics()
    metrics.watch(WorkerState("w7"), InFlightIndex(engine=None))
    running = Gauge("vllm:num_requests_running", "vLLM's.", ["model_name", "engine"], registry=REGISTRY)
    hits = Counter("vllm:prefix_cache_hits", "vLLM's.", ["model_name", "engine"], registry=REGISTRY)
    try:
        running.labels("m", "0").set(5)
        hits.labels("m", "0").inc(42)
        samples = parse(prometheus_text(metrics))
        assert value(samples, "vllm:num_requests_running", model_name="m", engine="0", worker_id="w7") == 5
        assert value(samples, "vllm:prefix_cache_hits_total", model_name="m", engine="0", worker_id="w7") == 42
        assert not any(name.startswith(("python_", "process_")) for name, _ in samples)
    finally:
        REGISTRY.unregister(running)
        REGISTRY.unregister(hits)
    assert not any(name.startswith("vllm:") for name, _ in parse(prometheus_text(metrics)))
