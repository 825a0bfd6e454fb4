"""The fleet's figures over the last minutes, from its reports (`client.status.fleet_status`) taken while someone
watches (the dashboard, `rollout-svc top`): each worker's heartbeat carries what it served, summed since it started
(`WorkerStatus.served`, `generated_tokens`, `generation_s`, `first_tokens`, `first_token_s`), so its rates are the
differences between two of its heartbeats, over their own timestamps (`heartbeat_at`: a heartbeat's clock, not the
reader's)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

TOTALS = ("served", "generated_tokens", "generation_s", "first_tokens", "first_token_s")


@dataclass
class _Worker:
    """A worker's last heartbeat read (`at`: its `heartbeat_at`; `totals` as `TOTALS`) and what it served since the
    one before (`delta`, over `span_s` seconds)."""

    at: float
    totals: tuple[float, ...]
    delta: tuple[float, ...] = (0.0,) * len(TOTALS)
    span_s: float = 0.0


@dataclass
class FleetHistory:
    """Samples of the fleet, at most one a `min_interval_s`, kept for `window_s` seconds.

    Each sample: `t` (unix s), `requests_per_s` and `tokens_per_s` (generations and generated tokens a second, every
    worker's latest rate summed), `ttft_ms` (mean time to first token of streamed requests over the workers' latest
    heartbeat intervals; None where none streamed), `tpot_ms` (engine seconds per generated token, likewise), `queued`
    and `pending` (entries waiting in the streams, and delivered but not answered), and `in_flight` per worker (the
    step's timeline: requests each worker holds over time)."""

    window_s: float = 600.0
    min_interval_s: float = 0.9
    samples: deque[dict[str, Any]] = field(default_factory=deque)
    _workers: dict[str, _Worker] = field(default_factory=dict)

    def due(self, now: float | None = None) -> bool:
        """Whether a new report should be taken: the last sample is `min_interval_s` old or more."""
        now = time.time() if now is None else now
        return not self.samples or now - self.samples[-1]["t"] >= self.min_interval_s

    def add(self, report: dict[str, Any], now: float | None = None) -> dict[str, Any]:
        """Add a sample from `report` (`fleet_status`'s); returns it. Workers gone from the report are forgotten; a
        worker whose sums went down (restarted under its id) starts again from this heartbeat."""
        now = time.time() if now is None else now
        seen: dict[str, _Worker] = {}
        for w in report["workers"]:
            totals, at = tuple(float(w.get(name, 0) or 0) for name in TOTALS), float(w.get("heartbeat_at", 0) or 0)
            last = self._workers.get(w["worker_id"])
            if last is None or any(new < old for new, old in zip(totals, last.totals, strict=True)) or at < last.at:
                seen[w["worker_id"]] = _Worker(at, totals)
            elif at > last.at:
                delta = tuple(new - old for new, old in zip(totals, last.totals, strict=True))
                seen[w["worker_id"]] = _Worker(at, totals, delta, at - last.at)
            else:  # the same heartbeat as last time: its latest rates stand
                seen[w["worker_id"]] = last
        self._workers = seen
        moving = [s for s in seen.values() if s.span_s > 0]
        _, tokens, engine_s, firsts, first_s = (sum(s.delta[i] for s in moving) for i in range(len(TOTALS)))
        sample = {
            "t": now,
            "requests_per_s": sum(s.delta[0] / s.span_s for s in moving),
            "tokens_per_s": sum(s.delta[1] / s.span_s for s in moving),
            "ttft_ms": first_s / firsts * 1e3 if firsts else None,
            "tpot_ms": engine_s / tokens * 1e3 if tokens else None,
            "queued": sum(d["queued"] for d in report["streams"].values()),
            "pending": sum(d["pending"] for d in report["streams"].values()),
            "in_flight": {w["worker_id"]: w["in_flight"] for w in report["workers"]},
        }
        self.samples.append(sample)
        while self.samples and now - self.samples[0]["t"] > self.window_s:
            self.samples.popleft()
        return sample

    def worker_rates(self) -> dict[str, float]:
        """Each worker's served requests a second over its latest two heartbeats, as of the last sample; a worker
        seen once only, or since its sums went down (restarted under its id), has none yet."""
        return {worker_id: w.delta[0] / w.span_s for worker_id, w in self._workers.items() if w.span_s > 0}

    def series(self) -> dict[str, Any]:
        """The samples as columns, as the charts take them: {"t": [...], figure: [...], "in_flight": {worker id:
        [...] (None where it was not in the fleet)}}."""
        samples = list(self.samples)
        columns: dict[str, Any] = {"t": [s["t"] for s in samples]}
        for name in ("requests_per_s", "tokens_per_s", "ttft_ms", "tpot_ms", "queued", "pending"):
            columns[name] = [s[name] for s in samples]
        workers = sorted({w for s in samples for w in s["in_flight"]})
        columns["in_flight"] = {w: [s["in_flight"].get(w) for s in samples] for w in workers}
        return columns
