"""Stored responses of the Responses API, in Redis: any `serve` replica continues a conversation by
`previous_response_id`, after a restart too, and cancels a response another replica is generating.

One key per response, `Keys.response(id)` (a string: the record as JSON), with a TTL (`Settings.api.response_ttl_s`,
renewed at each write). The record holds the response object as `GET /v1/responses/{id}` answers it, the
conversation it ends (chat messages, without instructions: what a continuation's prompt starts with), this turn's
input items, the rendered prompt's token ids, the session the conversation runs under (its turns stay on one worker
and reuse its prefix cache) and, while it runs, the request ids to abort on a cancel. Written as `in_progress` when
generation starts (only when `store` is true, OpenAI's default) and whole when it ends; the API's Redis user is
`admin`, which owns every key under the prefix (docs/acl.md).
"""

from __future__ import annotations

import json
from typing import Any

from rollout_svc.config import Settings
from rollout_svc.connections.topology import redis_router
from rollout_svc.openai.errors import APIError


class ResponseStore:
    """Responses by id in Redis. Raises redis-py's errors when Redis is away (answered 503 by the app)."""

    def __init__(self, settings: Settings) -> None:
        self.keys, self.ttl_s = settings.keys, settings.api.response_ttl_s
        self.redis: Any = redis_router(settings.redis_url, decode_responses=True)

    async def close(self) -> None:
        await self.redis.aclose()

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        """Write `record` whole (its `response`, `conversation`, `input`, `prompt_token_ids`, `session_id`,
        `request_ids`), with a fresh TTL."""
        data = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        await self.redis.set(self.keys.response(response_id), data, px=int(self.ttl_s * 1000))

    async def get(self, response_id: str) -> dict[str, Any]:
        """The record of a stored response. Raises `APIError` 404 for one never stored, deleted or expired."""
        data = await self.redis.get(self.keys.response(response_id))
        if data is None:
            raise self.not_found(response_id)
        record: dict[str, Any] = json.loads(data)
        return record

    def not_found(self, response_id: str) -> APIError:
        """The 404 of a response that is not stored, saying why it may not be."""
        return APIError(
            404,
            f"Response with id '{response_id}' not found: it was not stored (store: false), was deleted, or "
            f"expired (responses are kept {self.ttl_s:g} s: ROLLOUT_RESPONSE_TTL_S)",
            param="response_id",
            code="response_not_found",
        )

    async def set_status(self, response_id: str, status: str) -> dict[str, Any] | None:
        """Mark a stored response `status` (cancelled); its record before, None if it is not stored. A race with
        the end of its generation is settled by the later write: the generation's own status says how it ended."""
        data = await self.redis.get(self.keys.response(response_id))
        if data is None:
            return None
        record: dict[str, Any] = json.loads(data)
        await self.put(response_id, {**record, "response": {**record["response"], "status": status}})
        return record

    async def delete(self, response_id: str) -> bool:
        """Delete a stored response; False if there was none."""
        return bool(await self.redis.delete(self.keys.response(response_id)))
