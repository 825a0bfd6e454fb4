"""Offline batch rollouts: OpenAI Batch files run as RQ jobs through `RolloutClient`.

A batch is a JSONL file of OpenAI Batch lines (`{"custom_id", "method": "POST", "url", "body"}`, `url` one of
`/v1/chat/completions` and `/v1/completions`), kept in Redis with the batch's state (`BatchStore`). Submitting one
enqueues an RQ job (`run_batch`, JSON-serialized: RQ's `JSONSerializer`, never pickle) that `rollout-svc
batch-worker` runs: it feeds the lines through a `RolloutClient` with at most `Settings.batch_concurrency` in flight
and records each line's output (`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`,
OpenAI's batch output format) as it completes; when all are done the output becomes a file (`output_file_id`) and,
if the batch was given a path, is written there too.

Nothing is lost when a batch worker dies (even `kill -9`), and no finished line is generated again:

- a line's requests carry the ids `batch:{id}:{custom_id}` (`:{j}` for the j-th of `n` choices) and their results
  go to the batch's own results stream (a named producer, `batch-{id}`), which outlives the run;
- a line's output is written once (`HSETNX` on custom_id, with the counters in the same script), so a run that
  resumes skips finished lines and a line answered twice is counted once;
- a line whose requests reached Redis is marked submitted: a resumed run awaits its results on that stream
  instead of sending it again (if none comes within the request timeout, it is sent again);
- the live run holds a lease (`batch_lease_ttl_s`) and refreshes it; a run that loses it exits at once. The batch
  worker requeues a running batch whose lease expired (the abandoned-job check, every second), and RQ's `Retry`
  runs a job again after it raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.asyncio import BlockingConnectionPool, Redis

from rollout_svc.cluster_connect import refuse_cluster
from rollout_svc.config import Settings
from rollout_svc.connect import redis_async, redis_sync, warn_if_evicting_sync
from rollout_svc.errors import InvalidRequestError

log = logging.getLogger("rollout_svc.batch")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
TERMINAL = ("completed", "failed", "cancelled", "expired")
RUNNING = ("in_progress", "finalizing", "cancelling")  # states a live run holds the lease in
COMPLETION_WINDOW_S = 24 * 3600
STORE_CONNECTIONS = 16

# Record a line's output once: HSETNX, and count it only if it was new. KEYS: output hash, batch hash.
_RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""
# Refresh (ARGV[2] ms) or release (ARGV[2] = 0) a lease only if this run holds it. KEYS: the lease.
_LEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) else redis.call('DEL', KEYS[1]) end
return 1
"""


@dataclass(frozen=True)
class BatchLine:
    """One input line: its position, `custom_id`, endpoint (`url`) and request body."""

    index: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_lines(content: bytes, endpoint: str | None = None) -> list[BatchLine]:
    """The lines of an OpenAI Batch input file. Raises `InvalidRequestError` naming the first bad line (1-based):
    not a JSON object, no string `custom_id` (or one seen before), `method` other than POST, an unsupported `url`
    or one other than `endpoint`, a `body` that is not an object."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError as exc:
            raise InvalidRequestError(f"line {number} is not JSON: {exc}") from None
        if not isinstance(line, dict):
            raise InvalidRequestError(f"line {number} is not a JSON object")
        custom_id, url, body = line.get("custom_id"), line.get("url"), line.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            raise InvalidRequestError(f"line {number}: `custom_id` must be a non-empty string")
        if custom_id in seen:
            raise InvalidRequestError(f"line {number}: custom_id {custom_id!r} is used twice; each must be unique")
        if line.get("method", "POST") != "POST":
            raise InvalidRequestError(f"line {number}: `method` must be POST")
        if url not in ENDPOINTS or (endpoint is not None and url != endpoint):
            allowed = endpoint or " or ".join(ENDPOINTS)
            raise InvalidRequestError(f"line {number}: `url` is {url!r}; this batch takes {allowed}")
        if not isinstance(body, dict):
            raise InvalidRequestError(f"line {number}: `body` must be a JSON object")
        seen.add(custom_id)
        lines.append(BatchLine(len(lines), custom_id, url, body))
    if not lines:
        raise InvalidRequestError("the file has no lines")
    return lines


def output_line(custom_id: str, status: int, body: dict[str, Any], error: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's batch output line. A failed line has its HTTP status and error body in `response`, and `error`."""
    request_id = str(body.get("id", "")) if status == 200 else ""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": error,
    }


def _decode(fields: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in fields.items()}


class BatchStore:
    """Files and batches in Redis (async), and the RQ queue their jobs go to.

    Files: `create_file`, `file`, `file_content`. Batches: `create_batch`, `batch`, `render`, `cancel`,
    `list_batches`; what a run does: `record`, `mark_submitted`, the lease. Raises redis-py's errors if Redis is
    away, `InvalidRequestError` for bad input.
    """

    def __init__(self, settings: Settings, client: Redis | None = None) -> None:
        self.settings, self.keys = settings, settings.keys
        self._owns_client = client is None
        if client is None:  # a run's many lines write at once: they wait for one of a few connections
            client = redis_async(
                settings.redis_url,
                connection_pool_class=BlockingConnectionPool,
                max_connections=STORE_CONNECTIONS,
                timeout=None,
            )
        self.redis: Any = client  # bytes replies

    async def close(self) -> None:
        if self._owns_client:
            await self.redis.aclose()

    # --- files ----------------------------------------------------------------------------------------

    async def create_file(self, content: bytes, filename: str, purpose: str, expire_s: float | None = None) -> str:
        """Store a file; returns its id (`file-...`). Raises `InvalidRequestError` over `batch_max_file_bytes`."""
        limit = self.settings.batch_max_file_bytes
        if len(content) > limit:
            raise InvalidRequestError(f"the file is {len(content)} bytes; the limit is {limit} (batch_max_file_bytes)")
        file_id = f"file-{uuid.uuid4().hex}"
        fields = {
            "content": content,
            "filename": filename,
            "purpose": purpose,
            "bytes": len(content),
            "created_at": int(time.time()),
        }
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.file(file_id), mapping=fields)  # type: ignore[arg-type]
        if expire_s is not None:
            pipe.expire(self.keys.file(file_id), int(expire_s))
        await pipe.execute()
        return file_id

    async def file(self, file_id: str) -> dict[str, Any] | None:
        """OpenAI's file object, or None if there is no such file."""
        fields = await self.redis.hmget(self.keys.file(file_id), ["filename", "purpose", "bytes", "created_at"])
        if fields[0] is None:
            return None
        filename, purpose, size, created = (f.decode() for f in fields)
        return {
            "id": file_id,
            "object": "file",
            "bytes": int(size),
            "created_at": int(created),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }

    async def file_content(self, file_id: str) -> bytes | None:
        content: bytes | None = await self.redis.hget(self.keys.file(file_id), "content")
        return content

    # --- batches --------------------------------------------------------------------------------------

    async def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        *,
        output_path: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> str:
        """Validate the input file's lines, record the batch (`validating` until a run starts it) and enqueue its
        RQ job. Returns the batch id (`batch_...`). Raises `InvalidRequestError` (no such file, a bad line)."""
        if endpoint not in ENDPOINTS:
            raise InvalidRequestError(f"endpoint {endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}")
        content = await self.file_content(input_file_id)
        if content is None:
            raise InvalidRequestError(f"no file {input_file_id!r}: upload it first (POST /v1/files)")
        lines = parse_lines(content, endpoint)
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        fields: dict[str, Any] = {
            "id": batch_id,
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "created_at": now,
            "expires_at": now + COMPLETION_WINDOW_S,
            "total": len(lines),
            "completed": 0,
            "failed": 0,
            "metadata": json.dumps(metadata or {}),
            "output_path": output_path or "",
        }
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), mapping=fields)
        pipe.zadd(self.keys.batches, {batch_id: now})
        pipe.zremrangebyscore(self.keys.batches, "-inf", now - self.settings.batch_retention_s - COMPLETION_WINDOW_S)
        await pipe.execute()
        await asyncio.to_thread(enqueue_job, self.settings, batch_id)
        return batch_id

    async def batch(self, batch_id: str) -> dict[str, str] | None:
        """A batch's state hash (strings), or None if there is no such batch."""
        fields = _decode(await self.redis.hgetall(self.keys.batch(batch_id)))
        return fields or None

    async def list_batches(self, limit: int = 20) -> list[dict[str, str]]:
        """The most recent batches, newest first."""
        ids = await self.redis.zrevrange(self.keys.batches, 0, limit - 1)
        batches = [await self.batch(i.decode()) for i in ids]
        return [b for b in batches if b is not None]

    async def cancel(self, batch_id: str) -> dict[str, str]:
        """Cancel a batch: one not started yet is `cancelled` at once, a running one `cancelling` until its run has
        cancelled its requests. Returns its state. Raises `InvalidRequestError` for an unknown or finished batch."""
        key = self.keys.batch(batch_id)
        meta = await self.batch(batch_id)
        if meta is None:
            raise InvalidRequestError(f"no batch {batch_id!r}")
        if meta["status"] in TERMINAL:
            raise InvalidRequestError(f"batch {batch_id} is already {meta['status']}")
        now = int(time.time())
        if meta["status"] == "validating" and not await self.redis.exists(self.keys.batch_lease(batch_id)):
            await self.redis.hset(key, mapping={"status": "cancelled", "cancelled_at": now, "cancelling_at": now})
        elif meta["status"] != "cancelling":
            await self.redis.hset(key, mapping={"status": "cancelling", "cancelling_at": now})
        return await self.batch(batch_id) or meta

    async def mark(self, batch_id: str, **fields: Any) -> None:
        await self.redis.hset(self.keys.batch(batch_id), mapping=fields)

    async def record(self, batch_id: str, outputs: list[tuple[str, dict[str, Any]]]) -> list[bool]:
        """Record lines' outputs `(custom_id, line)` once each (counted as completed, or failed if it has an error), in
        one round trip; False for a line that was there already."""
        keys = [self.keys.batch_output(batch_id), self.keys.batch(batch_id)]
        pipe = self.redis.pipeline(transaction=False)
        for custom_id, line in outputs:
            counter = "failed" if line["error"] is not None else "completed"
            pipe.eval(_RECORD, 2, *keys, custom_id, json.dumps(line), counter)
        return [bool(added) for added in await pipe.execute()]

    async def outputs(self, batch_id: str) -> dict[str, bytes]:
        """custom_id -> output line (JSON bytes) of every finished line."""
        raw = await self.redis.hgetall(self.keys.batch_output(batch_id))
        return {k.decode(): v for k, v in raw.items()}

    async def done_ids(self, batch_id: str) -> set[str]:
        return {k.decode() for k in await self.redis.hkeys(self.keys.batch_output(batch_id))}

    async def submitted_ids(self, batch_id: str) -> set[str]:
        return {k.decode() for k in await self.redis.smembers(self.keys.batch_submitted(batch_id))}

    async def mark_submitted(self, batch_id: str, custom_ids: list[str]) -> None:
        await self.redis.sadd(self.keys.batch_submitted(batch_id), *custom_ids)

    async def acquire_lease(self, batch_id: str, token: str) -> bool:
        ttl_ms = int(self.settings.batch_lease_ttl_s * 1000)
        return bool(await self.redis.set(self.keys.batch_lease(batch_id), token, nx=True, px=ttl_ms))

    async def refresh_lease(self, batch_id: str, token: str, release: bool = False) -> bool:
        ttl_ms = 0 if release else int(self.settings.batch_lease_ttl_s * 1000)
        return bool(await self.redis.eval(_LEASE, 1, self.keys.batch_lease(batch_id), token, ttl_ms))

    def render(self, meta: dict[str, str]) -> dict[str, Any]:
        """OpenAI's batch object of a state hash."""

        def stamp(name: str) -> int | None:
            value = meta.get(name)
            return int(value) if value else None

        errors = json.loads(meta["errors"]) if meta.get("errors") else None
        return {
            "id": meta["id"],
            "object": "batch",
            "endpoint": meta["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": meta["input_file_id"],
            "completion_window": meta.get("completion_window", "24h"),
            "status": meta["status"],
            "output_file_id": meta.get("output_file_id") or None,
            "error_file_id": None,
            "created_at": int(meta["created_at"]),
            **{
                f"{name}_at": stamp(f"{name}_at")
                for name in ("in_progress", "expires", "finalizing", "completed", "failed", "expired", "cancelling")
            },
            "cancelled_at": stamp("cancelled_at"),
            "request_counts": {
                "total": int(meta.get("total", 0)),
                "completed": int(meta.get("completed", 0)),
                "failed": int(meta.get("failed", 0)),
            },
            "metadata": json.loads(meta.get("metadata") or "{}") or None,
        }


# --- RQ ------------------------------------------------------------------------------------------------------


def _queue(settings: Settings, connection: redis.Redis) -> Any:
    from rq import Queue
    from rq.serializers import JSONSerializer

    return Queue(settings.keys.batch_queue, connection=connection, serializer=JSONSerializer)


def enqueue_job(settings: Settings, batch_id: str, attempt: int = 0) -> str:
    """Enqueue a run of a batch on RQ (JSON arguments; retried up to 3 times if it raises). Returns the job id."""
    from rq import Retry

    refuse_cluster(settings.redis_url, "batch jobs")
    connection = redis_sync(settings.redis_url)
    try:
        job = _queue(settings, connection).enqueue(
            "rollout_svc.batch.run_batch",
            batch_id,
            job_id=f"{batch_id}-{attempt}",
            retry=Retry(max=3, interval=[2, 10, 30]),
            job_timeout=-1,  # a batch runs as long as it needs; the lease, not RQ's timeout, tells a dead run
            result_ttl=int(settings.batch_retention_s),
            failure_ttl=int(settings.batch_retention_s),
            description=f"rollout-svc batch {batch_id}",
        )
    finally:
        connection.close()
    return str(job.id)


def batch_workers(settings: Settings) -> int:
    """How many RQ workers (`rollout-svc batch-worker`) listen on this deployment's batch queue."""
    from rq import Worker

    connection = redis_sync(settings.redis_url)
    try:
        return int(Worker.count(connection=connection, queue=_queue(settings, connection)))
    finally:
        connection.close()


def run_batch(batch_id: str) -> str:
    """The RQ job: run (or resume) one batch with this process's settings (env `ROLLOUT_*`). Returns how it ended."""
    from rollout_svc.batch_run import BatchRun

    return asyncio.run(BatchRun(Settings(), batch_id).run())


def requeue_abandoned(settings: Settings, connection: redis.Redis) -> list[str]:
    """The abandoned-job check: enqueue a new run of every running batch whose lease expired (its run died), at most
    once per three lease lifetimes. Returns the batch ids requeued."""
    keys, now = settings.keys, time.time()
    rds: Any = connection  # bytes replies
    requeued = []
    ids = [raw.decode() for raw in rds.zrange(keys.batches, 0, -1)]
    pipe = rds.pipeline(transaction=False)  # every batch's state and lease in one round trip, not two per batch
    for batch_id in ids:
        pipe.hmget(keys.batch(batch_id), ["status", "requeued_at", "attempts"])
        pipe.exists(keys.batch_lease(batch_id))
    replies = pipe.execute()
    for batch_id, (status, requeued_at, attempts), leased in zip(ids, replies[::2], replies[1::2], strict=True):
        if status is None or status.decode() not in RUNNING or leased:
            continue
        if requeued_at is not None and now - float(requeued_at) < 3 * settings.batch_lease_ttl_s:
            continue
        attempt = int(attempts or 0) + 1
        rds.hset(keys.batch(batch_id), mapping={"requeued_at": now, "attempts": attempt})
        enqueue_job(settings, batch_id, attempt)
        log.warning("batch %s was %s with no live run: enqueued run %d", batch_id, status.decode(), attempt)
        requeued.append(batch_id)
    return requeued


def run_batch_worker(settings: Settings, burst: bool = False, check_interval_s: float = 1.0) -> None:
    """`rollout-svc batch-worker`: an RQ worker on the batch queue (RQ's `JSONSerializer`), with the abandoned-job
    check in a thread. Its jobs read their settings from this process's environment."""
    from rq import Worker
    from rq.serializers import JSONSerializer

    from rollout_svc.cluster import settings_env

    refuse_cluster(settings.redis_url, "batch workers")
    os.environ.update(settings_env(settings))  # the work horse (a fork) builds its Settings from these
    connection = redis_sync(settings.redis_url)
    warn_if_evicting_sync(connection, "batch worker")
    stop = threading.Event()

    def check() -> None:
        while not stop.wait(check_interval_s):
            try:
                requeue_abandoned(settings, connection)
            except redis.RedisError as exc:
                log.warning("abandoned-batch check failed (%s); retrying", exc)

    checker = threading.Thread(target=check, name="abandoned-batches", daemon=True)
    checker.start()
    try:
        queue = _queue(settings, connection)
        worker = Worker([queue], connection=connection, serializer=JSONSerializer, maintenance_interval=60)
        worker.work(burst=burst, with_scheduler=True, logging_level="INFO")
    finally:
        stop.set()
        checker.join()
        connection.close()


# --- output files ---------------------------------------------------------------------------------------------


def write_atomically(path: Path, chunks: Iterator[bytes]) -> None:
    """Write a file through a temporary one in its folder and a rename, so readers never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
