"""The fleet view `status` prints and `top` redraws, from a report as `fleet_status` builds it."""

from __future__ import annotations

import io

from rich.console import Console

from rollout_svc.cli.fleet_view import status_view


def _worker(worker_id: str, served: int) -> dict:
    return {
        "worker_id": worker_id, "state": "serving", "applied_epoch": 3, "engine": "echo", "model": "m",
        "weight_ranks": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
        "in_flight": 2, "capacity": 8, "served": served, "weight_version": 7,
    }  # fmt: skip


def _report(*workers: dict, paused: bool = False) -> dict:
    return {
        "paused": paused, "pause_mode": "keep" if paused else None,
        "pause_holders": {"trainer": "keep"} if paused else {}, "pause_leases": {}, "lapsed_pauses": {},
        "sleep_level": 0, "epoch": 3, "weight_version": 7, "weight_checkpoint": None, "workers": list(workers),
        "loads": {"w-a": 40}, "streams": {"rollout:{g0}:requests": {"length": 5, "queued": 4, "pending": 1}},
        "dead_letters": 2, "steps": {"live": 1, "expired": 0}, "named_models": {},
    }  # fmt: skip


def _text(report: dict, rates: dict[str, float] | None = None) -> str:
    console = Console(file=io.StringIO(), width=250)
    console.print(status_view(report, rates))
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_the_view_shows_each_worker_the_queues_and_the_pause():
    text = _text(_report(_worker("w-a", 10), _worker("w-b", 0), paused=True), {"w-a": 12.5})
    assert "fleet: paused (keep) by trainer (keep, held until resumed)" in text
    assert "w-a" in text and "w-b" in text and "requests/s" in text and "12.5" in text
    assert "rollout:{g0}:requests" in text and "dead letters: 2" in text
    assert "requests/s" not in _text(_report(_worker("w-a", 10)))  # `status`: no rates
