"""A batch's state in Redis: its input and output files, its state hash, the lines it recorded, its lease
(see `rollout_svc.batch`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis

from rollout_svc.batch.scripts import LEASE_LUA, RECORD_LUA
from rollout_svc.config import Settings
from rollout_svc.connections.urls import redis_async
from rollout_svc.errors import InvalidRequestError
from rollout_svc.keys import BatchField

log = logging.getLogger("rollout_svc.batch")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
TERMINAL = ("completed", "failed", "cancelled", "expired")
RUNNING = ("in_progress", "finalizing", "cancelling")  # states a live run holds the lease in
COMPLETION_WINDOW_S = 24 * 3600
STORE_CONNECTIONS = 16


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
        limit = self.settings.batch.batch_max_file_bytes
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
        """Validate the input file's lines and record the batch (`validating` until a run starts it); its run is
        enqueued by `rollout_svc.batch.jobs.submit_batch`. Returns the batch id (`batch_...`). Raises
        `InvalidRequestError` (no such file, a bad line)."""
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
            BatchField.COMPLETED: 0,
            BatchField.FAILED: 0,
            "metadata": json.dumps(metadata or {}),
            "output_path": output_path or "",
        }
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), mapping=fields)
        pipe.zadd(self.keys.batches, {batch_id: now})
        pipe.zremrangebyscore(
            self.keys.batches, "-inf", now - self.settings.batch.batch_retention_s - COMPLETION_WINDOW_S
        )
        await pipe.execute()
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
            counter = BatchField.FAILED if line["error"] is not None else BatchField.COMPLETED
            pipe.eval(RECORD_LUA, 2, *keys, custom_id, json.dumps(line), counter)
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
        ttl_ms = int(self.settings.batch.batch_lease_ttl_s * 1000)
        return bool(await self.redis.set(self.keys.batch_lease(batch_id), token, nx=True, px=ttl_ms))

    async def refresh_lease(self, batch_id: str, token: str, release: bool = False) -> bool:
        ttl_ms = 0 if release else int(self.settings.batch.batch_lease_ttl_s * 1000)
        return bool(await self.redis.eval(LEASE_LUA, 1, self.keys.batch_lease(batch_id), token, ttl_ms))

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
                "completed": int(meta.get(BatchField.COMPLETED, 0)),
                "failed": int(meta.get(BatchField.FAILED, 0)),
            },
            "metadata": json.loads(meta.get("metadata") or "{}") or None,
        }


# --- RQ ------------------------------------------------------------------------------------------------------


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
