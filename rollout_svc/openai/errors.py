"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the HTTP status OpenAI's clients
map to their exceptions (400 BadRequestError, 401 AuthenticationError, 403 PermissionDeniedError, 404
NotFoundError, 429 RateLimitError, 5xx InternalServerError)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from rollout_svc.errors import (
    ControlCommandError,
    ControlTimeoutError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    RequestTimeoutError,
)

log = logging.getLogger("rollout_svc.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """An error the API answers with: HTTP `status`, OpenAI's error body, and extra `headers` (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception a route let through (what the client library raised, or Redis)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), code="model_not_found", param="model")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), code="invalid_request")
    if isinstance(exc, QueueFullError):
        return APIError(429, f"{exc}; retry later", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, (RequestTimeoutError, ControlTimeoutError)):
        return APIError(504, str(exc), code="deadline_exceeded")
    if isinstance(exc, ControlCommandError):
        return APIError(409, str(exc), code="command_failed")
    if isinstance(exc, (RedisError, OSError)):
        return APIError(503, f"Redis is unreachable ({type(exc).__name__}: {exc}); retry later", code="redis_error")
    log.exception("unhandled error", exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}); see the server's log", code="internal_error")


def invalid_body(errors: Sequence[Any]) -> APIError:
    """400 for a body that failed validation (pydantic's `errors()`): every error as `field: message`, the first
    one's field as `param` (FastAPI's `body` prefix left out)."""
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}" for e in errors)
    return APIError(400, message or "invalid request body", param=".".join(location) or None)
