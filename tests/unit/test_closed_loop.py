"""The benches' closed loop: a duration, a request count, and a duration with a minimum count; two sides measured
in turn, and the rounds' medians and ratios."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from rollout_svc.tools.bench.router import Point, closed_loop, in_turn, measured, median_round, round_ratios


async def _slow_send() -> None:
    await asyncio.sleep(0.05)


async def test_a_duration_with_a_minimum_goes_on_until_that_many_were_sent() -> None:
    # 2 lanes of 50 ms sends over a 10 ms window: 2 requests alone, at least 10 with the minimum.
    alone = await closed_loop(_slow_send, 2, {}, duration_s=0.01)
    assert alone.requests == 2, alone
    point = await closed_loop(_slow_send, 2, {}, duration_s=0.01, min_requests=10)
    assert point.requests == 10, point
    assert point.elapsed_s >= 0.25, point


async def test_a_request_count_sends_exactly_that_many() -> None:
    point = await closed_loop(_slow_send, 3, {}, requests=7)
    assert point.requests == 7, point


async def test_in_turn_alternates_which_side_goes_first_after_a_warm_up_of_each() -> None:
    order: list[str] = []

    def sender(name: str) -> Callable[[], Awaitable[None]]:
        async def send() -> None:
            order.append(name)

        return send

    first, second = await in_turn(((sender("a"), {}), (sender("b"), {})), 1, 3, requests=2)
    # a warm-up send each (1 in flight), then 3 rounds of 2 sends each: a first, b first, a first
    assert order == ["a", "b", "a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"], order
    assert [p.requests for p in first] == [p.requests for p in second] == [2, 2, 2]


def test_the_median_round_and_the_rounds_ratios() -> None:
    def point(requests: int, elapsed_s: float, p50_ms: float) -> Point:
        return measured(requests, elapsed_s, [p50_ms / 1000], 1, {})

    ours = [point(100, 1.0, 2.0), point(300, 1.0, 1.0), point(200, 1.0, 4.0)]
    theirs = [point(100, 1.0, 1.0), point(100, 1.0, 1.0), point(400, 1.0, 2.0)]
    assert median_round(ours).requests_per_s == 200  # by requests/s
    assert median_round(ours, "p50_ms").p50_ms == 2.0
    assert median_round(ours[:2]).requests_per_s == 100  # of an even count, the lower middle
    assert round_ratios(ours, theirs, "requests_per_s") == [1.0, 3.0, 0.5]
    assert round_ratios(ours, theirs, "p50_ms") == [2.0, 1.0, 2.0]
