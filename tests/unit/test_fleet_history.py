"""The fleet's figures over time, from heartbeats' running sums (`client.fleet_history`)."""

from __future__ import annotations

import pytest

from rollout_svc.client.fleet_history import FleetHistory


def _report(*workers: tuple[str, float, int, int, float, int, float, int]) -> dict:
    """Workers as (id, heartbeat_at, served, generated_tokens, generation_s, first_tokens, first_token_s, in_flight)."""
    return {
        "workers": [
            {"worker_id": w, "heartbeat_at": at, "served": served, "generated_tokens": tokens, "generation_s": gen_s,
             "first_tokens": firsts, "first_token_s": first_s, "in_flight": in_flight}
            for w, at, served, tokens, gen_s, firsts, first_s, in_flight in workers
        ],
        "streams": {"s": {"length": 5, "queued": 3, "pending": 2}},
    }  # fmt: skip


def test_rates_are_differences_over_each_heartbeats_own_clock():
    history = FleetHistory()
    first = history.add(_report(("a", 100.0, 10, 100, 1.0, 0, 0.0, 4)), now=1000.0)
    assert first["requests_per_s"] == 0 and first["ttft_ms"] is None and first["tpot_ms"] is None
    # a: 20 more requests, 200 tokens in 2 engine-seconds, over 2 s of its heartbeats; 4 streamed, 0.2 s to first
    # token in all. b: first seen, no rate yet.
    second = history.add(_report(("a", 102.0, 30, 300, 3.0, 4, 0.2, 6), ("b", 50.0, 7, 70, 0.7, 0, 0.0, 1)), now=1000.5)
    assert second["requests_per_s"] == pytest.approx(10.0) and second["tokens_per_s"] == pytest.approx(100.0)
    assert second["tpot_ms"] == pytest.approx(10.0) and second["ttft_ms"] == pytest.approx(50.0)
    assert second["queued"] == 3 and second["pending"] == 2 and second["in_flight"] == {"a": 6, "b": 1}
    # the same heartbeats read again: the latest rates stand (not zero); b restarted (its sums went down): no rate
    third = history.add(_report(("a", 102.0, 30, 300, 3.0, 4, 0.2, 6), ("b", 51.0, 2, 20, 0.2, 0, 0.0, 1)), now=1001.0)
    assert third["requests_per_s"] == pytest.approx(10.0)
    columns = history.series()
    assert columns["t"] == [1000.0, 1000.5, 1001.0] and columns["requests_per_s"][1] == pytest.approx(10.0)
    assert columns["in_flight"] == {"a": [4, 6, 6], "b": [None, 1, 1]}  # b was not in the fleet at first


def test_samples_are_spaced_and_kept_for_the_window():
    history = FleetHistory(window_s=10.0, min_interval_s=1.0)
    assert history.due(now=0.0)
    history.add(_report(), now=0.0)
    assert not history.due(now=0.5) and history.due(now=1.0)
    for t in range(1, 15):
        history.add(_report(), now=float(t))
    assert history.series()["t"][0] == 4.0 and len(history.series()["t"]) == 11  # the last 10 s


def test_each_workers_rate_for_top():
    """`top`'s column: served requests a second between a worker's heartbeats (each by its own `heartbeat_at`)."""
    history = FleetHistory()

    def at(t: float, *served: tuple[str, int]) -> dict[str, float]:
        history.add(_report(*((w, t, n, 0, 0.0, 0, 0.0, 0) for w, n in served)), now=t)
        return history.worker_rates()

    assert at(100.0, ("w-a", 10)) == {}  # first sight: no rate yet
    assert at(102.0, ("w-a", 30), ("w-b", 5)) == {"w-a": 10.0}
    # w-b restarted under its id (its count went down): no rate until the next report; w-a gone: left out
    assert at(103.0, ("w-b", 1)) == {}
    assert at(104.0, ("w-b", 4)) == {"w-b": 3.0}
