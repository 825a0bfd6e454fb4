"""`rollout-svc top` in a pseudo-terminal, as an operator runs it on a host without a browser: every worker shown,
the fleet's served requests a second once traffic flows, a pause with its holder; Redis away said, not a crash."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading

import pytest

from rollout_svc import RolloutClient
from rollout_svc.deploy.processes import free_port
from tests.support import ROOT

pytestmark = pytest.mark.timeout(120)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_top(redis_url: str, seconds: float, key_prefix: str = "rollout") -> tuple[int, str]:
    """`rollout-svc top --duration seconds` on a pseudo-terminal of 60 x 250; its exit code and all it drew, without
    the terminal's control sequences."""
    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 250, 0, 0))
    args = [sys.executable, "-m", "rollout_svc", "top", "--redis-url", redis_url, "--duration", str(seconds)]
    env = dict(os.environ, COLUMNS="250", LINES="60", ROLLOUT_KEY_PREFIX=key_prefix)
    top = subprocess.Popen(
        [*args, "--interval", "0.5"], stdin=terminal, stdout=terminal, stderr=terminal, cwd=ROOT, env=env
    )
    os.close(terminal)
    drawn = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every end of the terminal closed, top exited
                    break
                if not chunk:
                    break
                drawn += chunk
            elif top.poll() is not None:
                break
        return top.wait(30), ANSI.sub("", drawn.decode(errors="replace"))  # what the screen shows, colours aside
    finally:
        os.close(master)


def test_top_shows_each_worker_and_the_served_rate(settings, echo_workers):
    ids = echo_workers(2, "--echo-token-delay-s", "0.002")
    stop = threading.Event()

    async def traffic() -> None:
        async with RolloutClient(settings=settings) as client:
            while not stop.is_set():
                await client.generate([[1, 2, 3]] * 32, {"max_tokens": 8})

    runner = threading.Thread(target=asyncio.run, args=(traffic(),))
    runner.start()
    try:
        code, drawn = run_top(settings.redis_url, 4, settings.key_prefix)
    finally:
        stop.set()
        runner.join(30)
    assert code == 0, drawn[-2000:]
    for worker_id in ids:
        assert worker_id in drawn, drawn[-2000:]
    rates = [float(r.replace(",", "")) for r in re.findall(r"([\d,]+\.\d) requests/s served", drawn)]
    assert len(rates) >= 3 and max(rates) > 0, rates  # refreshed, and the traffic seen


def test_top_held_pause_shows_its_holder(settings, echo_workers):
    echo_workers(1)

    async def hold() -> None:
        async with RolloutClient(settings=settings) as client:
            await client.pause("keep", holder="night-shift")

    asyncio.run(hold())
    code, drawn = run_top(settings.redis_url, 1.5, settings.key_prefix)
    assert code == 0 and "paused (keep) by night-shift" in drawn, drawn[-2000:]


def test_top_says_redis_is_away_and_keeps_trying():
    code, drawn = run_top(f"redis://127.0.0.1:{free_port()}/0", 1.5)
    assert code == 0, drawn[-2000:]
    assert "cannot reach Redis at 127.0.0.1:" in drawn and "retrying every 0.5 s" in drawn, drawn[-2000:]
