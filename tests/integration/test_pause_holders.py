"""HTTP pauses have owners and leases (`rollout_svc/api/pause_holders.py`), over `serve --open-control
--pause-lease-s 2`, 2 echo workers and a real redis-server: a trainer killed between its `/pause` and its `/resume`
leaves the fleet paused for its lease at most; each holder's `/resume` releases its own pause only; a holder's calls
renew its lease; the admin token releases anyone's."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_svc.config import Settings
from tests.integration.test_metrics import parse
from tests.support import serve

ADMIN = "admin-token"
LEASE_S = 2.0


@pytest.fixture
def base(settings: Settings, echo_workers, tmp_path: Path) -> Iterator[str]:
    echo_workers(2, "--echo-token-delay-s", "0.01")
    args = ("--open-control", "--pause-lease-s", str(LEASE_S))
    with serve(settings, tmp_path / "serve.log", *args, env={"ROLLOUT_ADMIN_TOKEN": ADMIN}) as url:
        yield url


def post(base: str, path: str, holder: str | None = None, **headers: str) -> httpx.Response:
    sent = {"X-Rollout-Holder": holder} if holder else {}
    return httpx.post(base + path, headers=sent | headers, timeout=30)


def paused(base: str) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(f"{base}/is_paused", timeout=30).json()
    return answer


def lapses(base: str) -> float:
    return parse(httpx.get(f"{base}/metrics", timeout=30).text)[("rollout_api_pause_lapses_total", frozenset())]


def test_a_holder_killed_between_pause_and_resume_leaves_the_fleet_paused_for_its_lease_at_most(base):
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import httpx, sys, time\n"
            f"httpx.post('{base}/pause?mode=keep', headers={{'X-Rollout-Holder': 'trainer-a'}}, timeout=30)\n"
            "print('paused', flush=True); time.sleep(3600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert trainer.stdout is not None and trainer.stdout.readline().strip() == "paused"
    killed = time.monotonic()
    trainer.kill()
    trainer.wait()
    trainer.stdout.close()
    state = paused(base)
    assert state["is_paused"] and set(state["holders"]) == {"http:trainer-a"}
    assert state["holders"]["http:trainer-a"]["lease_until"] > time.time()  # when it lapses, unix s
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with ThreadPoolExecutor(20) as pool:  # agents on the same fleet, sent while the dead trainer's pause holds
        answers = list(pool.map(lambda _: httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60), range(20)))
    took = time.monotonic() - killed
    assert [a.status_code for a in answers] == [200] * 20
    assert LEASE_S * 0.8 < took < LEASE_S + 10, f"the dead holder's pause held the fleet {took:.1f} s"
    assert not paused(base)["is_paused"] and "http:trainer-a" in paused(base)["lapsed"]
    deadline = time.monotonic() + 5
    while lapses(base) < 1 and time.monotonic() < deadline:  # serve's watch sees it within a second
        time.sleep(0.2)
    assert lapses(base) == 1


def test_each_holder_releases_only_its_own_pause_and_the_admin_token_any(base):
    post(base, "/pause?mode=keep", "a")
    post(base, "/pause?mode=keep", "b")
    assert set(paused(base)["holders"]) == {"http:a", "http:b"}
    post(base, "/resume", "a")
    assert paused(base)["is_paused"] and set(paused(base)["holders"]) == {"http:b"}
    refused = post(base, "/resume?holder=http:b", "a")
    assert refused.status_code in (401, 403), refused.text
    assert paused(base)["is_paused"]
    released = post(base, "/resume?holder=http:b", Authorization=f"Bearer {ADMIN}")
    assert released.status_code == 200 and not paused(base)["is_paused"], released.text
    # no header: the caller's address (or key) is its holder
    post(base, "/pause?mode=keep")
    assert set(paused(base)["holders"]) == {"http:127.0.0.1"}
    post(base, "/resume")
    assert not paused(base)["is_paused"]


def test_a_holders_calls_renew_its_lease(base):
    """A trainer that keeps calling (its weight sync's routes, a status read) holds its pause past the lease; once
    it stops, the pause lapses within the lease."""
    post(base, "/pause?mode=keep", "trainer-b")
    started = time.monotonic()
    while time.monotonic() - started < LEASE_S * 2.5:
        httpx.get(f"{base}/weight_info", headers={"X-Rollout-Holder": "trainer-b"}, timeout=30)
        assert paused(base)["is_paused"], f"the lease lapsed {time.monotonic() - started:.1f} s in, though renewed"
        time.sleep(LEASE_S / 5)
    quiet = time.monotonic()
    while paused(base)["is_paused"]:
        assert time.monotonic() - quiet < LEASE_S + 5, "the pause outlived its lease once its holder went quiet"
        time.sleep(0.2)
    post(base, "/pause?mode=keep&lease_s=0", "trainer-c")  # lease_s=0: held until resumed
    time.sleep(LEASE_S + 1.5)
    assert paused(base)["holders"] == {"http:trainer-c": {"mode": "keep", "lease_until": None}}
    post(base, "/resume", "trainer-c")


def test_a_pause_that_lapses_before_every_worker_acknowledged_it_is_refused_and_counted(base):
    # A lease shorter than the acknowledgements take (a stalled worker's last until it is reaped): the holder is told
    # the fleet serves, not that it holds a pause (found by the chaos soak at a 3 s lease).
    answer = post(base, "/pause?mode=keep&lease_s=0.001", "hasty")
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["code"] == "pause_lapsed" and "longer lease_s" in error["message"]
    assert not paused(base)["is_paused"] and lapses(base) == 1
    assert post(base, "/pause?mode=keep", "patient").status_code == 200  # the default lease outlasts the acks
    assert paused(base)["is_paused"]
    assert post(base, "/resume", "patient").status_code == 200
