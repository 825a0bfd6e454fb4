"""What the demo, the benchmarks and the soak share: a private Redis (or key prefix) per run, and percentiles."""

from __future__ import annotations

import statistics
import uuid

from rollout_svc.config import Settings
from rollout_svc.deploy.processes import free_port


def private_settings(redis_url: str | None, name: str) -> Settings:
    """A private Redis on a free port, or the given one under a key prefix of its own (no collisions)."""
    if redis_url is None:
        return Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", key_prefix=name)
    return Settings(redis_url=redis_url, key_prefix=f"{name}-{uuid.uuid4().hex[:8]}")


def percentile(sorted_values: list[float], q: float) -> float:
    """Percentile q (1-99) of an ascending list, interpolated (`statistics.quantiles`, inclusive); 0.0 if empty."""
    if not sorted_values:
        return 0.0
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[min(98, int(q) - 1)]
