"""Shared fixtures: a private redis-server per test session (flushed per test) and worker subprocesses."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from rollout_svc.config import Settings
from tests.support import WorkerProcs, free_port

VLLM_TIMEOUT_S = 900  # a vLLM test module starts its engines inside its first test's time


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The default per-test timeout is 30 s (pyproject); tests on the real engine get longer."""
    for item in items:
        if item.get_closest_marker("vllm") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(VLLM_TIMEOUT_S))


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of our own on a free port, so tests can stop and restart it."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not on PATH: install Redis >= 6.2 (apt install redis-server)"
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield url
    client.close()
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def rds(redis_url: str) -> Iterator[redis.Redis]:
    """A sync Redis client on the private server, flushed before each test."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def settings(redis_url: str, rds: redis.Redis) -> Settings:
    """Fast heartbeats so death is noticed within ~2 s; short blocks so tests stay quick."""
    return Settings(
        redis_url=redis_url,
        key_prefix="test",
        heartbeat_interval_s=0.2,
        heartbeat_ttl_s=2.0,
        read_block_ms=50,
        request_timeout_s=60,
    )


@pytest.fixture
def workers(settings: Settings, tmp_path: Path) -> Iterator[WorkerProcs]:
    procs = WorkerProcs(settings, tmp_path)
    yield procs
    procs.stop_all()


@pytest.fixture
def echo_workers(workers: WorkerProcs) -> Callable[..., list[str]]:
    """Start N echo workers with the given worker args and wait until they are live; returns their ids."""

    def start(count: int, *args: str) -> list[str]:
        ids = [f"echo-{len(workers.procs) + i}" for i in range(count)]
        for worker_id in ids:
            workers.start(worker_id, "--engine", "echo", *args)
        workers.wait_live(*ids)
        return ids

    return start
