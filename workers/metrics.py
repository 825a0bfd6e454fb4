"""A worker's Prometheus metrics: what it took, served and generated; served by `python -m workers --metrics-port`.

Names (counters are exposed with `_total`):

- `rollout_worker_generations_total{finish_reason}`: trajectories answered (stop, length, abort; an abort answered
  unrun included), and `rollout_worker_aborts_total{cause}` those cut or unrun (pause, user, deadline, shutdown,
  stale). `rollout_worker_errors_total{code}`: error results (`ErrorResult.code`).
- `rollout_worker_prompt_tokens_total`: prompt tokens of those trajectories; `rollout_worker_generated_tokens_total`:
  tokens this worker generated (a continuation's earlier tokens, made elsewhere, are not counted again).
- `rollout_worker_redeliveries_total`: entries taken with a delivery count > 1 (a dead worker had them).
- `rollout_worker_engine_seconds` (histogram): `Trajectory.generation_time_s` of trajectories that ran.
- `rollout_worker_staleness` (histogram, weight versions): the committed version as this worker last read it
  minus the version of a trajectory's first token, the client's definition taken at the worker.
- `rollout_worker_in_flight` (entries taken and not yet answered), `rollout_worker_weight_version` (its weights).

Beside them, vLLM's own series (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_hits`,
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`, spec-decode acceptance, ...), which vLLM's
`PrometheusStatLogger` registers in this process's default registry when the engine logs stats (on GPUs by default;
`--disable-log-stats` turns them off), each sample labelled with the worker's `worker_id` (`VLLMSeries`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from rollout_svc.dataplane.streams import Entry
from rollout_svc.protocol import ErrorResult, Request, Result, RolloutRequest, Trajectory, staleness_at
from workers.inflight import InFlightIndex
from workers.state import WorkerState

ENGINE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 8, 16)


class VLLMSeries(Collector):
    """vLLM's own Prometheus series from `source` (the process's default registry, where vLLM's stat logger puts
    them), each sample with a `worker_id` label added, so a fleet's scrapes tell the workers apart."""

    def __init__(self, worker_id: Callable[[], str], source: CollectorRegistry = REGISTRY) -> None:
        self.worker_id, self.source = worker_id, source

    def collect(self) -> Iterator[Metric]:
        worker_id = self.worker_id()
        for family in self.source.collect():
            if not family.name.startswith("vllm:"):
                continue
            relabelled = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {**sample.labels, "worker_id": worker_id}
                relabelled.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
            yield relabelled


class WorkerMetrics:
    """One worker's metrics in a registry of its own. `watch` binds the gauges to the worker's state.

    Example::

        metrics = WorkerMetrics()
        metrics.serve_http(9400)                # http://127.0.0.1:9400/metrics, from a thread of its own
        worker = Worker(settings, engine, metrics=metrics)
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._state: WorkerState | None = None
        self._vllm: VLLMSeries | None = None
        r = self.registry
        self.generations = Counter(
            "rollout_worker_generations", "Trajectories answered, by finish reason.", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "rollout_worker_prompt_tokens", "Prompt tokens of answered trajectories.", registry=r
        )
        self.generated_tokens = Counter("rollout_worker_generated_tokens", "Tokens this worker generated.", registry=r)
        self.redeliveries = Counter(
            "rollout_worker_redeliveries", "Entries taken with a delivery count above 1.", registry=r
        )
        self.aborts = Counter(
            "rollout_worker_aborts", "Trajectories cut or answered unrun, by cause.", ["cause"], registry=r
        )
        self.errors = Counter("rollout_worker_errors", "Error results, by error code.", ["code"], registry=r)
        self.moves = Counter("rollout_worker_moves", "Generations moved from here to an idle worker.", registry=r)
        self.stale_tokens = Counter(
            "rollout_worker_stale_discarded_tokens",
            "Tokens generated, then dropped as staler than their request's bound: cut at a weight sync, or a "
            "continuation's found too stale when taken (the goal is 0).",
            registry=r,
        )
        self.engine_s = Histogram(
            "rollout_worker_engine_seconds",
            "Seconds a generation ran on the engine.",
            registry=r,
            buckets=ENGINE_BUCKETS_S,
        )
        self.staleness = Histogram(
            "rollout_worker_staleness",
            "Committed weight version (as last read) minus the first token's version, per trajectory.",
            registry=r,
            buckets=STALENESS_BUCKETS,
        )
        self.in_flight = Gauge("rollout_worker_in_flight", "Entries taken and not yet answered.", registry=r)
        self.weight_version = Gauge(
            "rollout_worker_weight_version", "The version of this engine's weights.", registry=r
        )

    def watch(self, state: WorkerState, index: InFlightIndex) -> None:
        """Read the gauges (and the committed version for staleness) from the worker's own state at each scrape, and
        serve vLLM's own series beside them, labelled with its worker id."""
        self._state = state
        if self._vllm is None:
            self._vllm = VLLMSeries(lambda: state.worker_id)
            self.registry.register(self._vllm)
        self.in_flight.set_function(lambda: len(index))
        self.weight_version.set_function(lambda: state.weight_version)

    def serve_http(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve `GET /metrics` on `host:port` from a daemon thread. Raises `OSError` if the port is taken."""
        start_http_server(port, addr=host, registry=self.registry)

    def taken(self, entry: Entry) -> None:
        """An entry was taken from a stream (`entry.deliveries` counts this delivery)."""
        if entry.deliveries > 1:
            self.redeliveries.inc()

    def observe(self, request: Request | None, result: Result) -> None:
        """A result is about to be published; `request` is None where the entry could not be decoded."""
        if isinstance(result, ErrorResult):
            self.errors.labels(result.code).inc()
        elif isinstance(result, Trajectory):
            self._trajectory(request, result)

    def _trajectory(self, request: Request | None, trajectory: Trajectory) -> None:
        prior = request.continuation if isinstance(request, RolloutRequest) else None
        self.generations.labels(trajectory.finish_reason).inc()
        if trajectory.abort_cause is not None:
            self.aborts.labels(trajectory.abort_cause).inc()
        self.prompt_tokens.inc(len(trajectory.prompt_token_ids))
        self.generated_tokens.inc(len(trajectory.completion_token_ids) - (len(prior.token_ids) if prior else 0))
        if trajectory.generation_time_s > 0:  # 0: answered unrun
            self.engine_s.observe(trajectory.generation_time_s)
        if self._state is not None:
            # Never below 0: a worker may load a version before it reads that version's commit.
            committed = self._state.committed_version
            self.staleness.observe(staleness_at(trajectory.weight_versions, trajectory.weight_version, committed))
