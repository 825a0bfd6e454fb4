"""`/dashboard`: the fleet in a browser, read-only, behind the admin token.

One static page (`static/dashboard.html`, its script and style, and uPlot 1.6.32 vendored from the npm registry under
`static/vendor/`: nothing is fetched from outside this server, and nothing is built) polls `GET /dashboard/data`
every second: the fleet's report as `rollout-svc status --json` gives it, the current weight sync with each member's
progress through its barriers, and the figures of the last minutes (`FleetHistory`). Reports are taken only while
someone watches, at most one a second whoever asks (one `fleet_status` read: each worker's heartbeat, each stream's
depth).

The page and its data need the admin token: `Authorization: Bearer <token>` (a proxy or a test may send it), or a
cookie the sign-in form sets (`POST /dashboard/login`): an HMAC of the token, not the token, HttpOnly and SameSite
strict. With no admin token configured the dashboard is off (403, saying to set `ROLLOUT_ADMIN_TOKEN`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Form, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from redis.exceptions import RedisError

from rollout_svc.api.auth import Auth, bearer
from rollout_svc.client.fleet_history import FleetHistory
from rollout_svc.config import Settings
from rollout_svc.openai.errors import APIError

STATIC = Path(__file__).parent / "static"
COOKIE = "rollout_dashboard"


class Dashboard:
    """The dashboard's data: the latest report (taken again once it is `FleetHistory.min_interval_s` old, one read at
    a time) and its history."""

    def __init__(self, settings: Settings) -> None:
        self.settings, self.history = settings, FleetHistory()
        self._latest: dict[str, Any] | None = None
        self._reading = asyncio.Lock()

    async def data(self) -> dict[str, Any]:
        """{"now": unix s, "report": `fleet_status`'s report, "sync": `client.status.sync_status` (None: no sync
        yet), "history": `FleetHistory.series()`}. Raises `APIError` 503 while Redis is away."""
        from rollout_svc.client.status import fleet_and_sync_status

        async with self._reading:
            if self._latest is None or self.history.due():
                try:
                    report, sync = await fleet_and_sync_status(self.settings)
                except (OSError, RedisError) as exc:
                    raise APIError(503, f"cannot read the fleet from Redis: {exc}", code="redis_unavailable") from exc
                self.history.add(report)
                self._latest = {"now": time.time(), "report": report, "sync": sync}
            return {**self._latest, "history": self.history.series()}


def mount_dashboard(app: FastAPI, settings: Settings, auth: Auth) -> None:
    """The page, its sign-in and its data (`dashboard_router`), and its static files, on `app`."""
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")
    app.include_router(dashboard_router(settings, auth))


def dashboard_router(settings: Settings, auth: Auth) -> APIRouter:
    """The page, its sign-in and its data (module docstring)."""
    router = APIRouter(prefix="/dashboard", include_in_schema=False)
    dashboard = Dashboard(settings)

    def signed_in(request: Request) -> bool:
        cookie, token = request.cookies.get(COOKIE), auth.admin_token
        by_cookie = cookie is not None and token is not None and hmac.compare_digest(cookie, _cookie_of(token))
        return by_cookie or auth.is_admin(bearer(request))

    @router.get("")
    async def page(request: Request) -> Response:
        if signed_in(request):
            return FileResponse(STATIC / "dashboard.html", headers={"Cache-Control": "no-store"})
        return _sign_in(auth, request)

    @router.post("/login")
    async def login(request: Request, token: str = Form("")) -> Response:
        if not auth.is_admin(token):
            return _sign_in(auth, request, "That is not the admin token.")
        done = RedirectResponse(str(request.url_for("page")), status_code=303)
        secure = request.url.scheme == "https"
        done.set_cookie(COOKIE, _cookie_of(token), httponly=True, samesite="strict", path="/dashboard", secure=secure)
        return done

    @router.get("/data")
    async def data(request: Request) -> dict[str, Any]:
        if not signed_in(request):
            auth.admin(request)  # raises the admin routes' 401 or 403, saying what is missing
            raise APIError(401, "sign in at /dashboard first", code="missing_token")
        return await dashboard.data()

    return router


def _cookie_of(token: str) -> str:
    return hmac.new(token.encode(), b"rollout-svc dashboard", hashlib.sha256).hexdigest()


def _sign_in(auth: Auth, request: Request, error: str = "") -> HTMLResponse:
    """The sign-in page (401), or, with no admin token configured, a page saying the dashboard is off (403)."""
    if auth.admin_token is None:
        body = "<p>The dashboard is off: set <code>ROLLOUT_ADMIN_TOKEN</code> for <code>rollout-svc serve</code>.</p>"
        return HTMLResponse(_page(request, body), status_code=403)
    action = html.escape(str(request.url_for("login")))
    said = f'<p class="error">{html.escape(error)}</p>' if error else ""
    body = (
        f"<p>The dashboard needs the admin token (<code>ROLLOUT_ADMIN_TOKEN</code>).</p>{said}"
        f'<form method="post" action="{action}"><input type="password" name="token" autofocus '
        'placeholder="admin token"> <button type="submit">Sign in</button></form>'
    )
    return HTMLResponse(_page(request, body), status_code=401)


def _page(request: Request, body: str) -> str:
    style = html.escape(str(request.url_for("dashboard-static", path="dashboard.css")))
    return (
        '<!doctype html><html><head><meta charset="utf-8"><title>rollout-svc dashboard</title>'
        f'<link rel="stylesheet" href="{style}"></head><body><h1>rollout-svc</h1>{body}</body></html>'
    )
