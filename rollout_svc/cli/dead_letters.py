"""`rollout-svc dead-letters list|replay`: show the dead-letter stream and requeue what it holds (see
`rollout_svc.dataplane.dead_letters`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from rollout_svc.cli.common import DEFAULT_REDIS_URL, RedisUrl
from rollout_svc.config import Settings
from rollout_svc.keys import DEFAULT_SHARD

if TYPE_CHECKING:
    from rollout_svc.dataplane.dead_letters import DeadLetter, DeadLetters, ReplayReport

T = TypeVar("T")
dead_letters_app = typer.Typer(
    no_args_is_help=True,
    help="Dead letters (requests no worker could serve: undecodable, or over max_deliveries): list, replay.",
)
Shard = Annotated[str, typer.Option(help="The shard (worker group) whose dead letters these are; `status` lists them.")]


def _run(settings: Settings, work: Callable[[DeadLetters], Awaitable[T]]) -> T:
    """Run `work(dead_letters)` on a fresh connection; an unreachable Redis ends the command (exit 2)."""
    from redis.exceptions import RedisError, ResponseError

    from rollout_svc.connections.topology import shard_url
    from rollout_svc.connections.urls import redis_async
    from rollout_svc.dataplane.dead_letters import DeadLetters

    async def run() -> T:
        redis = redis_async(await asyncio.to_thread(shard_url, settings.redis_url, settings.shard))
        try:
            return await work(DeadLetters(redis, settings))
        finally:
            await redis.aclose()

    try:
        return asyncio.run(run())
    except ResponseError as exc:  # NOPERM and the like: Redis answers, the user may not do this
        typer.echo(f"Redis at {settings.redis_url} refused: {exc}; an operator connects as the admin user", err=True)
        raise typer.Exit(2) from exc
    except (OSError, RedisError) as exc:
        typer.echo(
            f"cannot reach Redis at {settings.redis_url}: {exc}; start a cluster with `rollout-svc up`", err=True
        )
        raise typer.Exit(2) from exc


@dead_letters_app.command("list")
def list_dead_letters(
    count: Annotated[int, typer.Option(min=1, help="Show at most this many, newest first.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line, newest first.")] = False,
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    shard: Shard = DEFAULT_SHARD,
) -> None:
    """List one shard's dead letters, newest first (`rollout-svc status` counts every shard's).

    Columns: dead-letter id, time, request id, producer (the id in its results stream's name), session, reason,
    message, worker ('(reaper)' if a reaper wrote it), deliveries. An undecodable payload is listed with why it does
    not decode.
    """

    async def read(dead: DeadLetters) -> tuple[list[DeadLetter], int]:
        return await dead.newest(count), await dead.count()

    settings = Settings(redis_url=redis_url, shard=shard)
    letters, total = _run(settings, read)
    if as_json:
        for letter in letters:
            typer.echo(json.dumps(letter.to_json()))
        return
    _print_table(letters, total, settings.keys.results(""))


def _print_table(letters: list[DeadLetter], total: int, producers_prefix: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"dead letters: {len(letters)} of {total}, newest first")
    table.add_column("dead letter", no_wrap=True)  # what `replay` takes: never cut
    for name in ("time", "request", "producer", "session", "reason", "message", "worker", "deliveries"):
        table.add_column(name, overflow="fold")  # wrapped, never cut to an ellipsis
    for letter in letters:
        producer = letter.reply_to.removeprefix(producers_prefix) if letter.reply_to else "-"
        table.add_row(
            letter.entry_id, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(letter.dead_at)),
            letter.request_id or "(undecodable)", producer, letter.session_id or "-", letter.reason, letter.message,
            letter.worker_id or "(reaper)", str(letter.deliveries),
        )  # fmt: skip
    Console().print(table)


@dead_letters_app.command("replay")
def replay(
    entry_ids: Annotated[
        list[str] | None,
        typer.Argument(metavar="ENTRY_ID", help="Dead-letter ids, as `dead-letters list` shows them."),
    ] = None,
    all_letters: Annotated[bool, typer.Option("--all", help="Every dead letter, oldest first.")] = False,
    keep: Annotated[bool, typer.Option("--keep", help="Leave the replayed ones in the dead-letter stream.")] = False,
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    shard: Shard = DEFAULT_SHARD,
) -> None:
    """Requeue one shard's dead letters as new requests (in that shard), then delete them from its dead-letter stream.

    They are enqueued as producers enqueue (sessions placed, admission checked, a fresh delivery count), then
    deleted unless --keep. Prints what was replayed and what was not, and why; exits 1 if anything named (or, with
    --all, anything at all) was not replayed. At-least-once: a crash between the requeue and the delete leaves
    both, so a later replay sends it twice; producers drop the duplicate result by request id.
    """
    if bool(entry_ids) == all_letters:
        typer.echo("give dead-letter ids or --all (not both)", err=True)
        raise typer.Exit(2)
    ids = entry_ids or []
    report = _run(
        Settings(redis_url=redis_url, shard=shard),
        lambda dead: dead.replay_all(keep) if all_letters else dead.replay(ids, keep),
    )
    _print_report(report)
    if report.skipped or report.queue_full is not None:
        raise typer.Exit(1)


def _print_report(report: ReplayReport) -> None:
    now = time.time()
    for done in report.replayed:
        letter, request = done.letter, done.letter.request
        late = request is not None and request.deadline is not None and request.deadline <= now
        typer.echo(
            f"replayed {letter.entry_id}: request {letter.request_id} -> {done.placed.stream} "
            f"{done.placed.entry_id.decode()}"
            + (" (its deadline has passed: a worker will answer it unrun)" if late else "")
        )
    for skipped in report.skipped:
        typer.echo(f"not replayed {skipped.entry_id}: {skipped.why}", err=True)
    if report.queue_full is not None:
        typer.echo(f"stopped: {report.queue_full}; what was not replayed stays a dead letter", err=True)
    kept = "; kept in the dead-letter stream (--keep)" if report.kept and report.replayed else ""
    typer.echo(f"{len(report.replayed)} replayed, {len(report.skipped)} not{kept}")
