"""OpenAI's Files and Batch API on the RQ batch jobs of `rollout_svc.batch`: `POST /v1/files`, `GET /v1/files/{id}`,
`GET /v1/files/{id}/content`, `POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel` (https://platform.openai.com/docs/api-reference/batch). A `rollout-svc batch-worker`
runs the batches; files and batches live in Redis, so any `serve` process answers for any batch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from rollout_svc.batch.jobs import submit_batch
from rollout_svc.batch.store import BatchStore
from rollout_svc.errors import InvalidRequestError
from rollout_svc.openai.errors import APIError


class BatchBody(BaseModel):
    """`POST /v1/batches`: OpenAI's fields; `completion_window` is 24h (not enforced: batches run to the end)."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=256)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)


def batch_router(store: BatchStore) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["batch"])

    @router.post("/files")
    async def create_file(
        file: Annotated[UploadFile, File(description="A JSONL file of OpenAI Batch lines.")],
        purpose: Annotated[str, Form(description="`batch`.")],
    ) -> dict[str, Any]:
        """Upload a batch input file (purpose `batch`); returns OpenAI's file object."""
        if purpose != "batch":
            raise APIError(400, f"purpose {purpose!r} is not supported; use `batch`", param="purpose")
        content = await file.read(store.settings.batch.batch_max_file_bytes + 1)
        try:
            file_id = await store.create_file(content, file.filename or "upload.jsonl", purpose)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="file") from exc
        found = await store.file(file_id)
        assert found is not None
        return found

    @router.get("/files/{file_id}")
    async def get_file(file_id: str) -> dict[str, Any]:
        """OpenAI's file object."""
        found = await store.file(file_id)
        if found is None:
            raise APIError(404, f"No such file: {file_id}", param="file_id", code="file_not_found")
        return found

    @router.get("/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        """A file's bytes (a batch's output: one JSON line per request)."""
        content = await store.file_content(file_id)
        if content is None:
            raise APIError(404, f"No such file: {file_id}", param="file_id", code="file_not_found")
        return Response(content, media_type="application/jsonl")

    @router.post("/batches")
    async def create_batch(body: BatchBody) -> dict[str, Any]:
        """Create a batch from an uploaded file; every line's `url` must be `endpoint`. Runs on a batch worker."""
        try:
            batch_id = await submit_batch(store, body.input_file_id, body.endpoint, metadata=body.metadata)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="input_file_id") from exc
        return await _batch(batch_id)

    @router.get("/batches")
    async def list_batches(limit: Annotated[int, Field(ge=1, le=100)] = 20) -> dict[str, Any]:
        """The most recent batches, newest first."""
        data = [store.render(meta) for meta in await store.list_batches(limit)]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": False}

    @router.get("/batches/{batch_id}")
    async def get_batch(batch_id: str) -> dict[str, Any]:
        """OpenAI's batch object: status and `request_counts` (completed: answered; failed: answered with an error)."""
        return await _batch(batch_id)

    @router.post("/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict[str, Any]:
        """Cancel a batch: `cancelling` until its unfinished requests are cancelled, then `cancelled`."""
        if await store.batch(batch_id) is None:
            raise APIError(404, f"No such batch: {batch_id}", param="batch_id", code="batch_not_found")
        try:
            return store.render(await store.cancel(batch_id))
        except InvalidRequestError as exc:
            raise APIError(409, str(exc), param="batch_id") from exc

    async def _batch(batch_id: str) -> dict[str, Any]:
        meta = await store.batch(batch_id)
        if meta is None:
            raise APIError(404, f"No such batch: {batch_id}", param="batch_id", code="batch_not_found")
        return store.render(meta)

    return router
