"""`rollout-svc batch submit|status|cancel|download` and `rollout-svc batch-worker` (see `rollout_svc.batch`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from rollout_svc.batch.jobs import submit_batch
from rollout_svc.cli.common import DEFAULT_REDIS_URL, RedisUrl
from rollout_svc.config import Settings

batch_app = typer.Typer(no_args_is_help=True, help="Offline batch rollouts: OpenAI Batch JSONL files run as RQ jobs.")
POLL_S = 0.5


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(1)


async def _with_store(redis_url: str, work: Any) -> Any:
    from rollout_svc.batch.store import BatchStore

    store = BatchStore(Settings(redis_url=redis_url))
    try:
        return await work(store)
    finally:
        await store.close()


def _run(redis_url: str, work: Any) -> Any:
    """Run `work(store)`; bad input and an unreachable Redis end the command with a clear message (exit 1)."""
    from redis.exceptions import RedisError

    from rollout_svc.connections.topology import refuse_cluster
    from rollout_svc.errors import InvalidRequestError

    try:
        refuse_cluster(redis_url, "batch jobs")
        return asyncio.run(_with_store(redis_url, work))
    except InvalidRequestError as exc:
        raise _fail(str(exc)) from None
    except (RedisError, OSError) as exc:
        raise _fail(f"Redis at {redis_url} is unreachable ({exc}); is `rollout-svc up` running?") from None


@batch_app.command("submit")
def submit(
    input_file: Annotated[Path, typer.Argument(help="OpenAI Batch JSONL: {custom_id, method, url, body} per line.")],
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Where the output JSONL goes when the batch ends.")
    ] = None,
    wait: Annotated[bool, typer.Option(help="Wait for the end, showing progress, and write the output.")] = False,
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
) -> None:
    """Submit a batch; a `rollout-svc batch-worker` runs it. Prints the batch id as the last word (or, with --wait,
    waits and exits 0 once it completed). The output path is written by the batch worker that finishes the batch
    (and by this command with --wait); `batch download` fetches it from Redis on any host."""
    if not input_file.is_file():
        raise _fail(f"{input_file} is not a file")
    content = input_file.read_bytes()
    first = next((line for line in content.splitlines() if line.strip()), b"")
    try:
        endpoint = json.loads(first).get("url", "/v1/chat/completions")
    except (ValueError, AttributeError):
        endpoint = "/v1/chat/completions"  # parse_lines names the bad line below
    out = str(output.resolve()) if output else None

    async def create(store: Any) -> tuple[str, int]:
        file_id = await store.create_file(content, input_file.name, "batch")
        batch_id = await submit_batch(store, file_id, endpoint, output_path=out)
        meta = await store.batch(batch_id)
        return batch_id, int(meta["total"])

    batch_id, total = _run(redis_url, create)
    from rollout_svc.batch.jobs import batch_workers

    if not batch_workers(Settings(redis_url=redis_url)):
        typer.secho(
            "warning: no batch worker is running; the batch waits in the queue until `rollout-svc batch-worker` starts",
            fg=typer.colors.YELLOW,
            err=True,
        )
    if not wait:
        typer.echo(
            f"submitted {total} requests ({endpoint}); `rollout-svc batch status ID` follows it. Batch: {batch_id}"
        )
        return
    typer.echo(f"submitted {total} requests as batch {batch_id}; waiting (Ctrl-C stops waiting, not the batch)")
    meta = _wait(redis_url, batch_id, total)
    if output is not None and meta.get("output_file_id"):
        _download(redis_url, meta["output_file_id"], output)
    typer.echo(_summary(meta))
    if meta["status"] != "completed":
        raise typer.Exit(1)


def _wait(redis_url: str, batch_id: str, total: int) -> dict[str, str]:
    from rollout_svc.batch.store import TERMINAL
    from rollout_svc.tools.progress import Progress

    async def poll(store: Any) -> dict[str, str]:
        with Progress(total, f"batch {batch_id}") as progress:
            while True:
                meta = await store.batch(batch_id)
                if meta is None:
                    raise _fail(f"batch {batch_id} disappeared from Redis")
                progress.update(int(meta["completed"]) + int(meta["failed"]))
                if meta["status"] in TERMINAL:
                    return meta
                await asyncio.sleep(POLL_S)

    result: dict[str, str] = _run(redis_url, poll)
    return result


def _download(redis_url: str, file_id: str, path: Path) -> None:
    from rollout_svc.batch.store import write_atomically

    content = _run(redis_url, lambda store: store.file_content(file_id))
    if content is None:
        raise _fail(f"the output file {file_id} has expired (batch_retention_s)")
    write_atomically(path, iter([content]))


def _summary(meta: dict[str, str]) -> str:
    return (
        f"batch {meta['id']}: {meta['status']}, {meta['completed']} of {meta['total']} completed, "
        f"{meta['failed']} failed" + (f", output {meta['output_path']}" if meta.get("output_path") else "")
    )


@batch_app.command("status")
def status(
    batch_id: Annotated[str, typer.Argument(help="The batch id `batch submit` printed.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print OpenAI's batch object.")] = False,
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
) -> None:
    """A batch's status and counts (validating, in_progress, finalizing, completed, cancelling, cancelled, failed)."""

    async def read(store: Any) -> dict[str, Any] | None:
        meta = await store.batch(batch_id)
        return None if meta is None else {"meta": meta, "object": store.render(meta)}

    found = _run(redis_url, read)
    if found is None:
        raise _fail(f"no batch {batch_id} (batches expire batch_retention_s after they end)")
    typer.echo(json.dumps(found["object"], indent=2) if as_json else _summary(found["meta"]))


@batch_app.command("cancel")
def cancel(
    batch_id: Annotated[str, typer.Argument(help="The batch id `batch submit` printed.")],
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
) -> None:
    """Cancel a batch: lines not finished are cancelled on the workers; finished ones stay in its output."""
    meta = _run(redis_url, lambda store: store.cancel(batch_id))
    typer.echo(_summary(meta))


@batch_app.command("download")
def download(
    batch_id: Annotated[str, typer.Argument(help="The batch id `batch submit` printed.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the output JSONL.")],
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
) -> None:
    """Write a finished batch's output (kept in Redis for batch_retention_s) to a file."""
    meta = _run(redis_url, lambda store: store.batch(batch_id))
    if meta is None:
        raise _fail(f"no batch {batch_id}")
    if not meta.get("output_file_id"):
        raise _fail(f"batch {batch_id} is {meta['status']}: its output is written when it ends")
    _download(redis_url, meta["output_file_id"], output)
    typer.echo(f"wrote {output}")


def batch_worker(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    burst: Annotated[bool, typer.Option(help="Exit once the queue is empty.")] = False,
) -> None:
    """Run batch jobs (an RQ worker on the batch queue, with the abandoned-job check); start one or more per host.
    Other `ROLLOUT_*` settings (batch_concurrency, request_timeout_s, ...) come from the environment."""
    from rollout_svc.batch.jobs import run_batch_worker

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rollout_svc.errors import InvalidRequestError

    started = time.monotonic()
    try:
        run_batch_worker(Settings(redis_url=redis_url), burst=burst)
    except InvalidRequestError as exc:  # a Redis Cluster URL
        typer.echo(f"batch-worker: {exc}", err=True)
        raise typer.Exit(2) from exc
    logging.getLogger("rollout_svc.batch").info("batch worker stopped after %.0f s", time.monotonic() - started)
