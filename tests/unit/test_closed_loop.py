"""The benches' closed loop: a duration, a request count, and a duration with a minimum count."""

from __future__ import annotations

import asyncio

from rollout_svc.tools.bench.router import closed_loop


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
