"""What every group of subcommands shares: the `--redis-url` and `--timeout-s` options, and running a command
against every shard's control plane with the CLI's exit codes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from redis.exceptions import RedisError

from rollout_svc.config import Settings

if TYPE_CHECKING:
    from rollout_svc.fleet import FleetControl

T = TypeVar("T")
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
RedisUrl = Annotated[
    str, typer.Option("--redis-url", envvar="ROLLOUT_REDIS_URL", help="Redis URL (env ROLLOUT_REDIS_URL).")
]
TimeoutS = Annotated[
    float | None, typer.Option("--timeout-s", help="Wait this long for every live worker's ack (default 60 s).")
]


def run_on_fleet(redis_url: str, what: str, work: Callable[[FleetControl], Awaitable[T]]) -> T:
    """`work` against every shard's control plane (the model `ROLLOUT_MODEL_NAME` names, or the default); its
    result. Exit 1 saying what failed (the workers that did not ack, or failed, and why; a bad request; a user who
    may not), 2 if Redis is away."""
    from rollout_svc.errors import AccessDeniedError, ControlCommandError, ControlTimeoutError, InvalidRequestError
    from rollout_svc.fleet import Fleet, FleetControl

    async def run() -> T:
        fleet = Fleet(Settings(redis_url=redis_url))
        try:
            return await work(FleetControl(fleet))  # the issuer's verbs, in every shard
        finally:
            await fleet.close()

    try:
        return asyncio.run(run())
    except (ControlTimeoutError, ControlCommandError, InvalidRequestError, AccessDeniedError) as exc:
        typer.echo(f"{what} failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    except (OSError, RedisError) as exc:
        typer.echo(f"cannot reach Redis at {redis_url}: {exc}; start a cluster with `rollout-svc up`", err=True)
        raise typer.Exit(2) from exc
