"""The leased pauses one issuer holds, renewed while it lives: a holder that dies (or hangs) loses its pause.

A pause issued with `lease_s` > 0 lapses that long after it was issued or last renewed (`control.plane`: the workers
leave a lapsed pause out of the desired state at their next heartbeat, without anyone writing). `PauseLeases` renews
each of an issuer's leased pauses every third of its lease, in every shard. A renewal that finds the pause gone (it
was resumed by someone else, or it lapsed while this process stalled) stops renewing it and records why in `lost`:
a weight sync checks that before it commits (`client.weight_sender`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

from redis.exceptions import RedisError

log = logging.getLogger("rollout_svc.control")
RENEWALS_PER_LEASE = 3  # a lease survives two lost renewals in a row


class PauseLeases:
    """Renews leased pauses. `renew(holder, lease_s)` extends one pause everywhere and returns whether it is still
    held everywhere (`FleetControl.renew_lease`).

    Example (what `FleetControl.issue` does with a leased pause and its resume)::

        leases = PauseLeases(control.renew_lease)
        with leases.issuing("weight-sync", 20.0):
            await plane.issue(commands.pause("keep", holder="weight-sync", lease_s=20.0))   # renewed from now on
        ...
        leases.release("weight-sync")                                                     # resumed: stop renewing
    """

    def __init__(self, renew: Callable[[str, float], Awaitable[bool]]) -> None:
        self._renew = renew
        self.held: dict[str, float] = {}  # holder -> its lease in seconds
        self.lost: dict[str, str] = {}  # holder -> why its pause is no longer held
        self._issuing: set[str] = set()  # pauses being issued: a renewal that finds none yet is not a loss
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def issuing(self, holder: str, lease_s: float) -> Iterator[None]:
        """Around the issue of `holder`'s pause with `lease_s`: renew it from now on (also if the issue fails: the
        pause may be written, and a retry converges; `release` stops it)."""
        self.held[holder] = lease_s
        self.lost.pop(holder, None)
        self._issuing.add(holder)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="pause-leases")
        try:
            yield
        finally:
            self._issuing.discard(holder)

    def release(self, holder: str) -> None:
        """Stop renewing `holder`'s pause (it was resumed, or re-issued without a lease)."""
        self.held.pop(holder, None)
        self.lost.pop(holder, None)

    async def check(self, holder: str) -> str | None:
        """Renew `holder`'s pause now: None while it is held, else why not (for a caller about to act on it)."""
        lease_s = self.held.get(holder)
        if lease_s is None:
            return self.lost.get(holder, f"no leased pause of {holder} is held here")
        if not await self._renew(holder, lease_s):
            self._lose(holder, lease_s)
        return self.lost.get(holder)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _lose(self, holder: str, lease_s: float) -> None:
        self.held.pop(holder, None)
        self.lost[holder] = (
            f"the pause of {holder} is no longer held: it was resumed elsewhere, or its {lease_s:g} s lease lapsed "
            "before a renewal reached Redis (this process stalled, or Redis was away), so the fleet may be serving"
        )
        log.warning("%s", self.lost[holder])

    async def _loop(self) -> None:
        while self.held:
            await asyncio.sleep(min(self.held.values()) / RENEWALS_PER_LEASE)
            for holder, lease_s in list(self.held.items()):
                try:
                    held = await self._renew(holder, lease_s)
                except (RedisError, OSError) as exc:  # the next renewal tries again; the lease covers two misses
                    log.warning("renewing the pause lease of %s failed (%s); retrying", holder, exc)
                    continue
                if not held and holder not in self._issuing and self.held.get(holder) == lease_s:
                    self._lose(holder, lease_s)
