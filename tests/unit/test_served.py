"""`Refreshed`: what every API request reads (the live workers, the named models) is read by one read at a time."""

from __future__ import annotations

import asyncio

import pytest

from rollout_svc.api.served import Refreshed


async def test_requests_that_find_the_value_stale_share_one_read() -> None:
    reads: list[int] = []
    release = asyncio.Event()

    async def read() -> int:
        reads.append(len(reads))
        await release.wait()
        return len(reads)

    value = Refreshed(read, 0, ttl_s=60)
    waiting = [asyncio.ensure_future(value.get()) for _ in range(1000)]
    await asyncio.sleep(0.01)
    release.set()
    assert await asyncio.gather(*waiting) == [1] * 1000
    assert reads == [0]  # one read for the 1,000 (each its own read before: past redis-py's pool of 100)
    assert await value.get() == 1 and reads == [0]  # fresh: not read again within its TTL


async def test_a_failed_read_fails_its_waiters_and_the_next_caller_reads_again() -> None:
    outcomes = [ConnectionError("Redis away"), 7]

    async def read() -> int:
        await asyncio.sleep(0)
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    value = Refreshed(read, 0, ttl_s=60)
    failed = await asyncio.gather(value.get(), value.get(), return_exceptions=True)
    assert all(isinstance(f, ConnectionError) for f in failed)
    assert await value.get() == 7


async def test_a_cancelled_caller_does_not_cancel_the_read_others_wait_for() -> None:
    release = asyncio.Event()

    async def read() -> int:
        await release.wait()
        return 5

    value = Refreshed(read, 0, ttl_s=60)
    first, second = asyncio.ensure_future(value.get()), asyncio.ensure_future(value.get())
    await asyncio.sleep(0)
    first.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await second == 5
