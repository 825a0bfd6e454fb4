"""The dashboard in a real browser, as an operator opens it: Debian's Chromium, headless, driven by Playwright with
`executable_path` pointed at it (no browser download), on a fleet of 2 echo workers under load. A screenshot is kept
in ROLLOUT_TEST_ARTIFACTS (default `.artifacts/` at the project root)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rollout_svc import RolloutClient, WeightSender
from tests.support import ROOT, SYNC_ECHO_ARGS, SYNC_HEARTBEAT_TTL_S, WorkerProcs, serve

pytestmark = pytest.mark.timeout(180)
TOKEN = "dashboard-admin-token"
CHROMIUM = os.environ.get("ROLLOUT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("ROLLOUT_TEST_ARTIFACTS", ROOT / ".artifacts"))


@pytest.fixture
def api(settings, tmp_path) -> Iterator[str]:
    with serve(settings, tmp_path / "serve.log", env={"ROLLOUT_ADMIN_TOKEN": TOKEN}) as base:
        yield base


@contextlib.contextmanager
def load(settings) -> Iterator[None]:
    """Batches of streamed and plain requests, back to back, until the block ends."""
    stop = threading.Event()

    async def run() -> None:
        async with RolloutClient(settings=settings) as client:
            while not stop.is_set():
                plain = client.generate([[1, 2, 3, 4]] * 16, {"max_tokens": 8})
                await asyncio.gather(plain, _drain(client.stream([[5, 6, 7]] * 4, {"max_tokens": 8})))

    runner = threading.Thread(target=asyncio.run, args=(run(),))
    runner.start()
    try:
        yield
    finally:
        stop.set()
        runner.join(60)


def test_dashboard_in_a_real_browser(settings, echo_workers, api):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}: `make install` installs Debian's (as root)"
    ids = echo_workers(2, "--echo-token-delay-s", "0.002")
    requested: list[str] = []
    with load(settings), sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.on("request", lambda request: requested.append(request.url))
            # signed out: the sign-in form; the admin token signs in (a cookie), and the page loads
            page.goto(f"{api}/dashboard")
            page.fill("input[name=token]", TOKEN)
            page.click("button[type=submit]")
            page.wait_for_selector("#workers td.worker-id", timeout=15_000)
            for worker_id in ids:
                row = page.locator("#workers tr", has_text=worker_id)
                row.wait_for(timeout=10_000)
                assert row.locator("td").nth(3).inner_text() == "0"  # its weight version
            # the throughput chart drew a series with traffic in it
            page.wait_for_function(
                "() => { const c = window.rolloutDashboard.charts.throughput;"
                " return c && c.data[1].some((v) => v > 0); }",
                timeout=20_000,
            )
            assert page.locator("#chart-throughput canvas").bounding_box()["width"] > 300
            # what the heartbeats carry: tokens and engine time from every worker, streamed first tokens from some
            last = page.evaluate("() => window.rolloutDashboard.last")
            assert all(w["generated_tokens"] > 0 and w["generation_s"] > 0 for w in last["report"]["workers"])
            assert any(w["first_tokens"] > 0 for w in last["report"]["workers"]), last["report"]["workers"]
            assert any(v for v in last["history"]["tpot_ms"]), last["history"]
            _off_the_loop(_pause(settings, "night-shift"))
            page.locator("#control", has_text="pause held by night-shift").wait_for(timeout=3_000)
            assert "paused (keep) by night-shift" in page.locator("#fleet").inner_text()
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        finally:
            browser.close()
            _off_the_loop(_resume(settings, "night-shift"))
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    outside = [url for url in requested if not url.startswith(api)]
    assert requested and outside == [], outside  # the page loads nothing from outside this server


def _off_the_loop(call: Coroutine[Any, Any, None]) -> None:
    """Run `call` on a loop of its own in a thread (Playwright's sync API holds this thread's loop)."""
    runner = threading.Thread(target=asyncio.run, args=(call,))
    runner.start()
    runner.join(60)


async def _drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass


async def _pause(settings, holder: str) -> None:
    async with RolloutClient(settings=settings) as client:
        await client.pause("keep", holder=holder)


async def _resume(settings, holder: str) -> None:
    async with RolloutClient(settings=settings) as client:
        await client.resume(holder=holder)


def test_dashboard_needs_the_admin_token(settings, api):
    with httpx.Client(base_url=api) as http:
        page = http.get("/dashboard")
        assert page.status_code == 401 and 'name="token"' in page.text  # the sign-in form, not the fleet
        assert http.get("/dashboard/data").status_code == 401
        assert http.post("/dashboard/login", data={"token": "wrong"}).status_code == 401
        assert http.get("/dashboard/data", headers={"Authorization": "Bearer not-admin"}).status_code == 401
        data = http.get("/dashboard/data", headers={"Authorization": f"Bearer {TOKEN}"})
        assert data.status_code == 200 and set(data.json()) == {"now", "report", "sync", "history"}
        signed = http.post("/dashboard/login", data={"token": TOKEN})
        assert signed.status_code == 303 and TOKEN not in signed.headers["set-cookie"]  # an HMAC, not the token
        assert "HttpOnly" in signed.headers["set-cookie"] and "SameSite=strict" in signed.headers["set-cookie"]
        assert http.get("/dashboard/data").status_code == 200  # by the cookie
        assert http.get("/dashboard/static/vendor/uplot-1.6.32/uPlot.iife.min.js").status_code == 200


def test_dashboard_is_off_without_an_admin_token(settings, tmp_path):
    with serve(settings, tmp_path / "serve.log") as base:
        page = httpx.get(f"{base}/dashboard")
        assert page.status_code == 403 and "ROLLOUT_ADMIN_TOKEN" in page.text


def test_dashboard_data_follows_a_weight_sync(settings, tmp_path):
    """A checkpoint sync on 2 echo workers: the data names it, its members and each one's barriers, and the version
    the fleet committed."""
    root = tmp_path / "checkpoints"
    (root / "step-3").mkdir(parents=True)
    tensors = {"model.norm.weight": torch.ones(64), "model.embed_tokens.weight": torch.zeros(300, 64)}
    save_file(tensors, str(root / "step-3" / "model.safetensors"))
    synced = settings.copy_with(checkpoint_root=root, weight_sync_timeout_s=15.0, heartbeat_ttl_s=SYNC_HEARTBEAT_TTL_S)
    procs = WorkerProcs(synced, tmp_path)
    try:
        for worker_id in ("w-a", "w-b"):
            procs.start(worker_id, "--engine", "echo", *SYNC_ECHO_ARGS)
        procs.wait_live("w-a", "w-b")
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with serve(synced, tmp_path / "serve.log", env={"ROLLOUT_ADMIN_TOKEN": TOKEN}) as base:
            assert httpx.get(f"{base}/dashboard/data", headers=headers).json()["sync"] is None

            async def sync() -> None:
                async with WeightSender(settings=synced) as sender:
                    await sender.update_from_checkpoint(str(root / "step-3"), version=3)

            asyncio.run(sync())
            time.sleep(1.0)  # the dashboard reads the fleet at most once a second
            data = httpx.get(f"{base}/dashboard/data", headers=headers).json()
    finally:
        procs.stop_all()
    shown = data["sync"]
    assert shown["version"] == 3 and shown["transport"] == "checkpoint" and sorted(shown["members"]) == ["w-a", "w-b"]
    assert shown["phases"]["loaded"] == {"w-a": "ok", "w-b": "ok"}, shown
    assert data["report"]["weight_version"] == 3
