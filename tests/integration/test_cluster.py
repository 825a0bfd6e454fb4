"""`rollout-svc up` and `status` as a user runs them, and the worker's crash-only behaviour."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollout_svc import RolloutClient
from rollout_svc.deploy.local import PrivateRedis, redis_answers
from tests.support import ROOT, async_wait_until, free_port


def status(url: str) -> dict:
    """`rollout-svc status --json`; no workers while Redis does not answer yet (exit code 2)."""
    out = subprocess.run(
        [sys.executable, "-m", "rollout_svc", "status", "--redis-url", url, "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode == 2 and "cannot reach Redis" in out.stderr:
        return {"workers": []}
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@contextlib.contextmanager
def rollout_up(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`rollout-svc up ARGS` in the background, its log in `tmp_path/up.log`; killed on leaving if it still runs."""
    with open(tmp_path / "up.log", "wb") as log:  # the child keeps its own descriptor
        up = subprocess.Popen(
            [sys.executable, "-m", "rollout_svc", "up", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log
        )
    try:
        yield up
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def start_up(
    url: str, tmp_path: Path, env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """`rollout_up` with 2 echo workers on `url`."""
    return rollout_up(tmp_path, "--redis-url", url, "--workers", "2", "--engine", "echo", env=env)


def ctrl_c(up: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGINT to `up`, as Ctrl-C sends it; asserts that it exits 0 within `timeout_s`."""
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=timeout_s) == 0


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(150)  # its own waits: 60 s for the workers, 30 s for the restart, 30 s for the exit
def test_up_restarts_a_killed_worker_and_ctrl_c_leaves_nothing_behind(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with start_up(url, tmp_path) as up:
        workers = wait_for(lambda: len(status(url)["workers"]) == 2 and status(url)["workers"], 60, "2 workers")
        first_pids = {w["pid"] for w in workers}
        os.kill(workers[0]["pid"], signal.SIGKILL)
        # The dead worker's heartbeat expires (10 s) while its replacement registers under a new id.
        restarted = wait_for(lambda: {w["pid"] for w in status(url)["workers"]} - first_pids, 30, "a restarted worker")
        assert restarted
        pids = {w["pid"] for w in status(url)["workers"]}
        ctrl_c(up, 30)
    assert not [pid for pid in pids if alive(pid)]
    try:
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
        raise AssertionError("the private Redis is still running")
    except redis.ConnectionError:
        pass
    assert "starting it again" in (tmp_path / "up.log").read_text()


def test_a_worker_whose_loop_fails_exits_rather_than_hold_requests(settings, workers, echo_workers, rds):
    echo_workers(1)
    # An operator mistake: the requests stream replaced by a string. XREADGROUP now fails with WRONGTYPE.
    rds.delete(settings.keys.requests)
    rds.set(settings.keys.requests, "not a stream")
    proc = workers.procs["echo-0"]
    assert proc.wait(timeout=10) == 1
    assert "a worker loop failed" in workers.log("echo-0")


@pytest.mark.timeout(120)  # its own bounds (60 s for the workers, 30 s for up to exit) outlast pytest's 30 s default
async def test_up_without_redis_server_falls_back_to_fakeredis(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # no redis-server on this PATH
    with start_up(url, tmp_path, env) as up:
        wait_for(lambda: len(status(url)["workers"]) == 2, 60, "2 workers on fakeredis")
        async with RolloutClient(redis_url=url, request_timeout_s=30) as client:
            trajectories = await client.generate([[i + 1, 2] for i in range(50)], {"max_tokens": 2})
            sessions = await client.generate([[1]] * 4, {"max_tokens": 1}, ["a", "b", "c", "d"])
        assert [t.prompt_token_ids for t in trajectories] == [[i + 1, 2] for i in range(50)]
        assert len({t.worker_id for t in sessions}) == 2
        ctrl_c(up, 30)
    assert "using fakeredis, which is for trying things out" in (tmp_path / "up.log").read_text()


def test_kill_9_of_up_takes_its_redis_and_workers_down(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    with start_up(url, tmp_path) as up:
        workers = wait_for(lambda: len(status(url)["workers"]) == 2 and status(url)["workers"], 60, "2 workers")
        up.kill()  # no chance to clean up: its children must not live on as orphans
        up.wait()
    wait_for(lambda: not [w for w in workers if alive(w["pid"])], 30, "the workers to exit")
    wait_for(lambda: status(url) == {"workers": []}, 30, "the private Redis to exit")


@pytest.mark.timeout(120)
async def test_restarting_up_keeps_the_requests_queued_when_it_stopped(tmp_path):
    """`up`'s private Redis keeps an append-only file: requests queued (the fleet paused) when `up` stops are still
    there when it starts again on the same data dir, and are served once the fleet resumes; the caller's call, which
    waited across the restart, gets every result."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {**os.environ, "ROLLOUT_REDIS_DATA_DIR": str(tmp_path / "redis-data")}

    async def workers_live(count: int) -> None:
        await async_wait_until(lambda: len(status(url)["workers"]) >= count, 60, f"{count} workers", interval_s=0.2)

    with start_up(url, tmp_path, env) as first:
        await workers_live(2)
        async with RolloutClient(redis_url=url, request_timeout_s=90) as client:
            await client.pause(mode="keep", holder="test")
            prompts = [list(f"queued {i:03d}".encode()) for i in range(40)]
            call = asyncio.ensure_future(client.generate(prompts, {"max_tokens": 4}))
            rds = redis.Redis.from_url(url)
            await async_wait_until(lambda: rds.xlen("rollout:{g0}:requests") == 40, 10, "40 queued requests")
            first.send_signal(signal.SIGINT)
            assert await asyncio.to_thread(first.wait, 60) == 0
            assert not redis_answers(url), "up left its Redis running"
            with start_up(url, tmp_path, env) as second:
                try:
                    await workers_live(2)
                    assert rds.xlen("rollout:{g0}:requests") == 40, "the queued requests did not survive the restart"
                    assert not call.done()
                    await client.resume(holder="test")
                    trajectories = await asyncio.wait_for(call, 60)
                    assert [t.completion_token_ids for t in trajectories] == [p[:4] for p in prompts]
                finally:
                    second.send_signal(signal.SIGINT)
                    second.wait(60)
            rds.close()


def test_a_private_redis_waits_out_a_port_held_for_a_moment_and_names_what_redis_said_otherwise(tmp_path):
    """`up`'s private Redis on a port another socket holds: held for a moment (an outgoing connection that took it
    between `free_port` and the bind, as a CI run saw), Redis starts once it is let go; held throughout, the error
    carries Redis's own words, not a guess."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    threading.Timer(1.5, holder.close).start()
    server = PrivateRedis(url)
    try:
        server.start(timeout_s=10)
        assert redis_answers(url)
    finally:
        server.stop()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.raises(RuntimeError, match="already in use"):  # 5 s: a CI run's loaded host took 2 s to start it
            PrivateRedis(url).start(timeout_s=5)
