"""The chaos soak's bounded load: with syncs, every other batch call goes through a client whose requests carry a
staleness bound of 0 (`max_staleness=0`, `stale_policy="mark"`), so each commit makes the work it holds too stale.

A worker must then cut such a request (at the load that makes it too stale, or when it takes a continuation whose
first token is older than the floor) and answer at once, `abort` with cause `staleness` and its tokens so far, never
generating on under the new version; with policy `mark` the client returns that answer as it is, so the ledger sees
it. Each request goes in the ledger with its bound (`Submitted.max_staleness`, read from the request the client
built): the ledger judges a cut as an answer (`cut_for_staleness`, its tokens a prefix of the echo) and checks that no
answered bounded trajectory holds a token under a version above its first token's (`check_bounds`, violations
`stale_generated`). Without syncs no commit makes anything stale: there is no bounded client.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import Settings

MAX_STALENESS = 0  # weight versions: a request's every token from the version of its first
BOUNDED_EVERY = 2  # each batch driver sends every other call through the bounded client


@contextlib.asynccontextmanager
async def bounded_client(settings: Settings, syncs: bool) -> AsyncIterator[RolloutClient | None]:
    """The bounded load's client (a producer of its own on `settings`' fleet), or None without syncs."""
    if not syncs:
        yield None
        return
    async with RolloutClient(settings, max_staleness=MAX_STALENESS, stale_policy="mark") as client:
        yield client


def client_for(number: int, client: RolloutClient, bounded: RolloutClient | None) -> RolloutClient:
    """The client a batch driver's call `number` (0, 1, ...) goes through: the bounded one for every other call, where
    there is one; else `client`, the load's."""
    return bounded if bounded is not None and number % BOUNDED_EVERY == 1 else client


def report_line(bounds: dict[str, int]) -> str:
    """The report's line on the bounded load (`Verdict.bounds`, as `ledger.check_bounds` counts it)."""
    return (
        f"  bounded     {bounds['bounded_requests']} requests with max_staleness {MAX_STALENESS}: "
        f"{bounds['cut_for_staleness']} cut for staleness (at a sync's load, or taken after a commit), "
        f"{bounds['answered_whole']} answered whole ({bounds['whole_stale_at_receipt']} of them stale at receipt)"
    )
