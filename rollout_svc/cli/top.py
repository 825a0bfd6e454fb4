"""`rollout-svc top`: the fleet in the terminal, redrawn every second (rich's `Live`), for hosts without a browser."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Annotated, Any
from urllib.parse import urlparse

import typer
from redis.exceptions import RedisError
from rich.console import Console, Group
from rich.live import Live

from rollout_svc.cli.common import DEFAULT_REDIS_URL, RedisUrl
from rollout_svc.cli.fleet_view import status_view
from rollout_svc.client.fleet_history import FleetHistory
from rollout_svc.config import Settings


def top(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    interval_s: Annotated[float, typer.Option("--interval", min=0.2, help="Seconds between refreshes.")] = 1.0,
    duration_s: Annotated[
        float, typer.Option("--duration", min=0.0, help="Quit after this many seconds (0: run until Ctrl-C).")
    ] = 0.0,
) -> None:
    """The fleet, refreshing: `status` redrawn every `--interval` seconds, with each worker's served requests a
    second and the fleet's. While Redis is away it says so and keeps trying. Ctrl-C quits."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_top(redis_url, interval_s, duration_s))


async def _top(redis_url: str, interval_s: float, duration_s: float) -> None:
    from rollout_svc.client.status import fleet_status

    settings, history, console = Settings(redis_url=redis_url), FleetHistory(), Console(highlight=False)
    parsed = urlparse(redis_url)
    where = f"{parsed.hostname}:{parsed.port or 6379}{parsed.path}"  # no user or password on the screen
    deadline = time.monotonic() + duration_s if duration_s else None
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while deadline is None or time.monotonic() < deadline:
            try:
                report = await fleet_status(settings)
            except (OSError, RedisError) as exc:
                live.update(f"cannot reach Redis at {where}: {exc}; retrying every {interval_s:g} s", refresh=True)
            else:
                served = history.add(report)["requests_per_s"]
                live.update(_frame(report, history.worker_rates(), served, where), refresh=True)
            await asyncio.sleep(interval_s)


def _frame(report: dict[str, Any], rates: dict[str, float], served: float, where: str) -> Group:
    """One refresh: a header (where, when, the fleet's requests a second: `served`), the default model's view with
    each worker's (`rates`), each named model's."""
    header = f"rollout-svc top: {where}, {time.strftime('%H:%M:%S')}; {served:,.1f} requests/s served"
    parts: list[Any] = [header, status_view(report, rates)]
    for name, named in report["named_models"].items():
        parts += [f"model {name}:", status_view(named)]
    return Group(*parts)
