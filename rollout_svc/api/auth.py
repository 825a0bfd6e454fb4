"""Who may call what: data-plane API keys (`ROLLOUT_API_KEYS`) and the admin bearer token (`ROLLOUT_ADMIN_TOKEN`).

Both come as `Authorization: Bearer <secret>`, as OpenAI's clients send their `api_key`. With no data-plane keys
configured the data plane is open (`rollout-svc serve` refuses to listen beyond loopback that way). The admin
routes always need the admin token: none configured, they answer 403. `/health` and `/metrics` need nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Depends, Request

from rollout_svc.openai.errors import APIError


def bearer(request: Request) -> str | None:
    """The secret of the request's `Authorization: Bearer <secret>` header, or None."""
    header = request.headers.get("authorization", "")
    scheme, _, secret = header.partition(" ")
    return secret.strip() if scheme.lower() == "bearer" and secret.strip() else None


def _among(secret: str, secrets: list[str]) -> bool:
    return any(hmac.compare_digest(secret.encode(), s.encode()) for s in secrets)


class Auth:
    """Checks a request's bearer secret. Raises `APIError` 401 (missing or unknown secret) or 403 (a data-plane
    key on an admin route; admin routes disabled)."""

    def __init__(self, api_keys: list[str], admin_token: str | None) -> None:
        self.api_keys, self.admin_token = [k for k in api_keys if k], admin_token or None

    def data(self, request: Request) -> None:
        if not self.api_keys:
            return
        secret = bearer(request)
        if secret is None:
            raise APIError(401, "missing API key: send `Authorization: Bearer <key>`", code="missing_api_key")
        if not _among(secret, self.api_keys) and not (self.admin_token and _among(secret, [self.admin_token])):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    def admin(self, request: Request) -> None:
        secret = bearer(request)
        if secret is None:
            raise APIError(401, "the admin routes need `Authorization: Bearer <admin token>`", code="missing_token")
        if self.admin_token is None:
            raise APIError(403, "the admin routes are disabled: set ROLLOUT_ADMIN_TOKEN", code="admin_disabled")
        if _among(secret, [self.admin_token]):
            return
        if _among(secret, self.api_keys):
            raise APIError(403, "a data-plane API key cannot use the admin routes", code="not_admin")
        raise APIError(401, "invalid admin token", code="invalid_token")

    def is_admin(self, secret: str | None) -> bool:
        """Whether `secret` is the admin token (never where none is configured)."""
        return secret is not None and self.admin_token is not None and _among(secret, [self.admin_token])

    def data_dependency(self) -> Any:
        return Depends(_async(self.data))

    def admin_dependency(self) -> Any:
        return Depends(_async(self.admin))


def _async(check: Callable[[Request], None]) -> Callable[[Request], Coroutine[Any, Any, None]]:
    async def dependency(request: Request) -> None:  # async: FastAPI runs a sync dependency in a thread
        check(request)

    return dependency
