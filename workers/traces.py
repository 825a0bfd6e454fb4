"""A worker's spans of a traced request (`rollout_svc.tracing`): each under the `traceparent` its entry carries,
tagged with the request, its attempt and this worker. Nothing where tracing is off or the request carries none."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

from rollout_svc import tracing
from rollout_svc.dataplane.streams import Entry
from rollout_svc.protocol import Request, RolloutRequest


def _tags(request: RolloutRequest, worker_id: str) -> dict[str, Any]:
    return {
        "rollout.request_id": request.request_id,
        "rollout.original_request_id": request.original_request_id,
        "rollout.retry": request.continuation is not None,
        "rollout.worker_id": worker_id,
        "rollout.session_id": request.session_id,
    }


def taken(request: Request, entry: Entry, worker_id: str, taken_at: float) -> None:
    """`rollout.queue_wait` (its submission, on the producer's clock, to this take) and `rollout.take` (the take to
    now: its checks before it is served)."""
    if not isinstance(request, RolloutRequest) or request.traceparent is None:
        return
    tags = _tags(request, worker_id) | {"rollout.stream": entry.stream, "rollout.deliveries": entry.deliveries}
    tracing.record("rollout.queue_wait", request.traceparent, request.submitted_at, taken_at, **tags)
    tracing.record("rollout.take", request.traceparent, taken_at, None, **tags, **{"rollout.entry_id": entry.entry_id})


_UNTRACED: contextlib.nullcontext[None] = contextlib.nullcontext(None)  # reusable: it holds no state


def generation(
    request: RolloutRequest, worker_id: str, weight_version: int
) -> contextlib.AbstractContextManager[dict[str, str] | None]:
    """`rollout.generation` around the engine's run; yields the W3C headers that make an engine's own spans its
    children (vLLM's `trace_headers`), None where it is not traced (then at the cost of one check: the hot path)."""
    if request.traceparent is None or not tracing.enabled():
        return _UNTRACED
    return _generation(request, worker_id, weight_version)


@contextlib.contextmanager
def _generation(request: RolloutRequest, worker_id: str, weight_version: int) -> Iterator[dict[str, str] | None]:
    tags = _tags(request, worker_id) | {"rollout.weight_version": weight_version}
    with tracing.span("rollout.generation", request.traceparent, **tags) as span:
        yield {"traceparent": header} if (header := tracing.traceparent(span)) else None


def published(records: Iterable[Any], worker_id: str) -> None:
    """`rollout.publish`: each traced answer, from when it was answered (`InFlight.answered_at`) to its result
    published, now."""
    now = time.time()
    for record in records:
        request = record.request
        if isinstance(request, RolloutRequest) and request.traceparent and record.answered_at:
            tracing.record("rollout.publish", request.traceparent, record.answered_at, now, **_tags(request, worker_id))
