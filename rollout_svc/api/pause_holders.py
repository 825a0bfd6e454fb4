"""Who holds an HTTP pause, and its lease: every `POST /pause` belongs to its caller and lapses unless renewed.

A caller is named by its `X-Rollout-Holder` header (say `trainer-a`), else by its bearer secret (an API key or the
admin token, as a digest: the secret itself is never stored), else by its address: the pause's holder is
`http:<that>`. A pause is held under a lease (`serve --pause-lease-s`, `ROLLOUT_API_PAUSE_LEASE_S`, 600 s by
default): every later call of the same holder to this `serve` (any route but the two of the hot lane, SkyRL's
generate and detokenize) renews it, at most every quarter lease, so a trainer between its `/pause` and its
`/resume` (a weight sync's calls included) keeps it, and one killed in between (OOM, a preempted node, Ctrl-C)
leaves the fleet paused for the lease at most, then one heartbeat until the workers see it lapsed. `/resume`
releases the caller's own pause. A lapse is logged with its holder and counted
(`rollout_api_pause_lapses_total`). The control plane enforces the lease (`control/plane.py`): a `serve` that dies
too lets the pauses it took lapse.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_svc.openai.errors import APIError

log = logging.getLogger("rollout_svc.api")
HOLDER_HEADER = "x-rollout-holder"
HOLDER_MAX = 128  # characters of a named holder
RENEW_FRACTION = 0.25  # a holder's calls renew its lease once this much of it has passed since the last renewal
WATCH_S = 1.0  # how often the lapses of holders gone quiet are looked for


def holder_of(headers: Headers, client: tuple[str, int] | None) -> str:
    """The pause holder of a request: `http:<X-Rollout-Holder>`, else `http:key-<digest of its bearer secret>`, else
    `http:<client address>`. Raises `APIError` 400 for a holder name that is empty or over 128 characters."""
    named = headers.get(HOLDER_HEADER)
    if named is not None:
        if not 0 < len(named.strip()) <= HOLDER_MAX:
            raise APIError(400, f"X-Rollout-Holder must be 1 to {HOLDER_MAX} characters", param="X-Rollout-Holder")
        return f"http:{named.strip()}"
    scheme, _, secret = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and secret.strip():
        return f"http:key-{hashlib.sha256(secret.strip().encode()).hexdigest()[:12]}"
    return f"http:{client[0] if client else 'unknown'}"


@dataclass
class _Held:
    lease_s: float
    renewed_at: float  # time.monotonic() of the pause or its last renewal


class PauseHolders:
    """The leased pauses this `serve` took, by holder, renewed on their holders' calls (`touch`) and watched for
    lapses (`watch`). `renew(holder, lease_s)`: the control plane's renewal; False when the pause is no longer held
    (resumed elsewhere, or lapsed). `in_force()`: the holders whose pause is in force now (another `serve` of the
    fleet may have renewed one). `on_lapse(holder)`: called once per lapse seen (the metric)."""

    def __init__(
        self,
        renew: Callable[[str, float], Awaitable[bool]],
        in_force: Callable[[], Awaitable[set[str]]],
        on_lapse: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.renew, self.in_force, self.on_lapse = renew, in_force, on_lapse
        self.held: dict[str, _Held] = {}
        self._renewing: dict[str, asyncio.Task[None]] = {}  # held here: the loop keeps only weak references
        self._watch: asyncio.Task[None] | None = None

    def paused(self, holder: str, lease_s: float) -> None:
        """`holder` paused under `lease_s` (0: held until resumed, nothing to renew)."""
        if lease_s > 0:
            self.held[holder] = _Held(lease_s, time.monotonic())
            if self._watch is None or self._watch.done():
                self._watch = asyncio.get_running_loop().create_task(self.watch())
        else:
            self.held.pop(holder, None)

    def resumed(self, holder: str) -> None:
        self.held.pop(holder, None)

    def touch(self, holder: str) -> None:
        """A call of `holder`: renew its lease in the background if a quarter of it has passed (never delays the
        call)."""
        held = self.held.get(holder)
        if held is None or holder in self._renewing:
            return
        if time.monotonic() - held.renewed_at >= held.lease_s * RENEW_FRACTION:
            self._renewing[holder] = asyncio.get_running_loop().create_task(self._renew(holder, held))

    async def _renew(self, holder: str, held: _Held) -> None:
        try:
            if await self.renew(holder, held.lease_s):
                held.renewed_at = time.monotonic()
            elif self.held.get(holder) is held:
                self.lapsed(holder, "it was resumed elsewhere or its lease lapsed before this call renewed it")
        except Exception as exc:  # Redis away: the next call tries again
            log.warning("renewing the pause of %s failed (%s): the next call retries", holder, exc)
        finally:
            self._renewing.pop(holder, None)

    async def watch(self) -> None:
        """Log and count each held pause whose lease passed without a renewal here, unless it is still in force
        (its holder's calls went to another `serve`, which renewed it)."""
        while self.held:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            quiet = [h for h, held in self.held.items() if now - held.renewed_at > held.lease_s]
            if not quiet:
                continue
            try:
                still = await self.in_force()
            except Exception as exc:  # Redis away: look again at the next round
                log.warning("reading the pauses in force failed (%s)", exc)
                continue
            for holder in quiet:
                held = self.held.get(holder)
                if held is not None and holder in still:  # renewed elsewhere, or lapsing: look again next round
                    held.renewed_at = time.monotonic() - held.lease_s
                elif held is not None:
                    self.lapsed(holder, f"no call from it renewed its {held.lease_s:g} s lease (it died or hung)")

    def lapsed(self, holder: str, why: str) -> None:
        """Log and count the lapse of `holder`'s pause (no longer held here)."""
        self.held.pop(holder, None)
        log.warning("the pause of %s lapsed: %s; the fleet serves unless another holder pauses it", holder, why)
        self.on_lapse(holder)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch


class RenewOnCall:
    """ASGI middleware: each HTTP request of a holder with a leased pause here renews it (`PauseHolders.touch`).
    Costs a dict lookup per request while no pause is held: none."""

    def __init__(self, app: ASGIApp, holders: PauseHolders) -> None:
        self.app, self.holders = app, holders

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.holders.held:
            with contextlib.suppress(APIError):  # a bad holder name is the route's to refuse
                self.holders.touch(holder_of(Headers(scope=scope), scope.get("client")))
        await self.app(scope, receive, send)
