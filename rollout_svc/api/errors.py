"""How the FastAPI app answers errors: every one in OpenAI's shape (`rollout_svc.openai.errors`), as a JSON response."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_svc.errors import (
    RolloutError,
)
from rollout_svc.openai.errors import APIError, from_exception, invalid_body

log = logging.getLogger("rollout_svc.api")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape: ours, bad bodies (400, naming the field), unknown routes (404)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return json_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return json_response(invalid_body(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return json_response(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    # The library's own errors and Redis' are answered where they are raised (Starlette's handler for Exception
    # runs outside the middleware and re-raises after answering).
    for known in (RolloutError, RedisError, OSError):
        app.add_exception_handler(known, _answer)

    @app.exception_handler(Exception)
    async def unhandled(_: Request, exc: Exception) -> JSONResponse:
        return json_response(from_exception(exc))


async def _answer(_: Request, exc: Exception) -> JSONResponse:
    return json_response(from_exception(exc))


def json_response(error: APIError) -> JSONResponse:
    """The HTTP response for an API error: its status, OpenAI's error body and its headers (Retry-After)."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
