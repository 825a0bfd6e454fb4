"""Every process on every kind of Redis URL: TLS (`rediss://`, a real redis-server with a certificate of our own CA)
and Sentinel (`redis+sentinel://`, a real sentinel); the eviction-policy warning; `up --redis-bind` refusals."""

from __future__ import annotations

import gc
import logging
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rollout_svc import RolloutClient
from rollout_svc.client import rollout_client as client
from rollout_svc.config import Settings
from rollout_svc.connections.urls import redis_async, redis_sync
from tests.support import ROOT, WorkerProcs, free_port, settings_env

pytestmark = pytest.mark.skipif(not shutil.which("openssl"), reason="openssl makes the test certificates")


def _openssl(command: str, cwd: Path) -> None:
    """`openssl COMMAND` in `cwd` (COMMAND as a shell would split it); raises CalledProcessError if it fails."""
    subprocess.run(["openssl", *shlex.split(command)], cwd=cwd, check=True, capture_output=True)


def _wait_ping(client: redis.Redis, what: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            assert time.monotonic() < deadline, f"{what} did not start"
            time.sleep(0.05)


@pytest.fixture
def tls_url(tmp_path: Path) -> Iterator[str]:
    """A redis-server that speaks only TLS, with a server certificate for 127.0.0.1 signed by a CA made here."""
    _openssl("req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 -subj /CN=rollout-test-ca", tmp_path)
    _openssl("req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1", tmp_path)
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 1 -extfile ext.cnf",
        tmp_path,
    )
    port = free_port()
    args = ["--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--tls-cert-file", "server.pem", "--tls-key-file", "server.key", "--tls-ca-cert-file", "ca.pem"]
    args += ["--tls-auth-clients", "no"]
    process = subprocess.Popen(["redis-server", *args], cwd=tmp_path, stdout=subprocess.DEVNULL)
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={tmp_path / 'ca.pem'}"
    client = redis_sync(url)
    _wait_ping(client, "the TLS redis-server")
    client.close()
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def sentinel_url(redis_url: str, rds: redis.Redis, tmp_path: Path) -> Iterator[str]:
    """A real sentinel monitoring the test's redis-server as `testprimary`."""
    port, primary = free_port(), redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\nsentinel monitor testprimary 127.0.0.1 {primary} 1\n")
    process = subprocess.Popen(["redis-server", str(conf), "--sentinel"], cwd=tmp_path, stdout=subprocess.DEVNULL)
    sentinel = redis.Redis(port=port)
    _wait_ping(sentinel, "the sentinel")
    sentinel.close()
    yield f"redis+sentinel://127.0.0.1:{port}/testprimary/0"
    process.terminate()
    process.wait(timeout=10)


CLIENT_SCRIPT = """
from rollout_svc import SyncRolloutClient
with SyncRolloutClient() as client:
    prompts = [list(f"over {i}".encode()) for i in range(20)]
    trajectories = client.generate(prompts, {"max_tokens": 6})
    assert [t.completion_token_ids for t in trajectories] == [p[:6] for p in prompts]
    print(len(trajectories), "echoed by", ",".join(sorted({t.worker_id for t in trajectories})))
"""


# `_serve_through`'s own bounds (30 s to register, 60 s for the client, 30 s for status) are over pytest's 30 s
# default: a loaded CI machine took 30 s before the worker had registered.
ROUND_TRIP_TIMEOUT = pytest.mark.timeout(150)
# The worker's heartbeat TTL: 10 s, not the tests' 2 s. A 2 s stall of this shared machine gives the worker up for dead
# and it serves on as a new incarnation (a CI run got "20 echoed by echo-url~1"), which the exact answer refuses.
ROUND_TRIP_HEARTBEAT = pytest.mark.heartbeat_ttl(10.0)


def _serve_through(settings: Settings, url: str, tmp_path: Path) -> None:
    """An echo worker and a client, both on `url`: 20 prompts come back echoed, and `status` lists the worker."""
    on_url = settings.copy_with(redis_url=url)
    procs = WorkerProcs(on_url, tmp_path)
    try:
        procs.start("echo-url", "--engine", "echo")
        deadline = time.monotonic() + 30
        check = redis_sync(url)
        while not check.exists(on_url.keys.worker("echo-url")):
            assert procs.procs["echo-url"].poll() is None, procs.log("echo-url")[-3000:]
            assert time.monotonic() < deadline, "the worker did not register"
            time.sleep(0.1)
        check.close()
        # The client in a process of its own, as a trainer's would be.
        out = subprocess.run(
            [sys.executable, "-c", CLIENT_SCRIPT],
            env=settings_env(on_url),
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=60,
        )
        assert out.returncode == 0 and out.stdout.strip() == "20 echoed by echo-url", out.stdout + out.stderr
        status = subprocess.run(
            [sys.executable, "-m", "rollout_svc", "status", "--redis-url", url, "--json"],
            env=settings_env(on_url),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert status.returncode == 0 and "echo-url" in status.stdout, status.stderr
    finally:
        procs.stop_all()


@ROUND_TRIP_TIMEOUT
@ROUND_TRIP_HEARTBEAT
def test_workers_clients_and_the_cli_over_tls(settings, tls_url, tmp_path):
    _serve_through(settings, tls_url, tmp_path)


@ROUND_TRIP_TIMEOUT
@ROUND_TRIP_HEARTBEAT
def test_workers_clients_and_the_cli_through_a_sentinel(settings, sentinel_url, tmp_path):
    _serve_through(settings, sentinel_url, tmp_path)


async def test_an_evicting_redis_is_reported_at_start(settings, rds, workers, caplog):
    """A `maxmemory-policy` other than noeviction is logged by the client and by a worker when they start."""
    rds.config_set("maxmemory-policy", "allkeys-lru")
    try:
        workers.start("echo-evict", "--engine", "echo")
        workers.wait_live("echo-evict")
        client._CHECKED_EVICTION.clear()  # once per process and URL: this test's client checks again
        with caplog.at_level(logging.WARNING, logger="rollout_svc.connections.urls"):
            async with RolloutClient(settings) as producer:
                await producer.workers()
        assert any("maxmemory-policy is allkeys-lru" in r.getMessage() for r in caplog.records)
        assert "maxmemory-policy is allkeys-lru" in workers.log("echo-evict")
    finally:
        rds.config_set("maxmemory-policy", "noeviction")


async def test_a_sentinel_client_closes_every_socket_it_opened(sentinel_url):
    """Closing a client of a `redis+sentinel://` URL (blocking or asyncio) closes its connections to the primary and to
    the sentinel: none is left for the garbage collector (whose ResourceWarning lands in whatever runs next)."""
    sync = redis_sync(sentinel_url)
    assert sync.set("sentinel-check", "1") and sync.get("sentinel-check") == b"1"
    sync.close()
    async_client = redis_async(sentinel_url)
    assert await async_client.get("sentinel-check") == b"1"
    await async_client.aclose()
    del sync, async_client
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]


def test_up_refuses_to_expose_a_redis_anyone_can_use(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    out = subprocess.run(
        [sys.executable, "-m", "rollout_svc", "up", "--redis-url", url, "--engine", "echo", "--redis-bind", "0.0.0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--acl" in out.stderr and "password" in out.stderr, out.stderr


def test_up_does_not_start_a_private_redis_for_a_tls_or_sentinel_url(tmp_path):
    """A TLS or Sentinel URL where nothing answers is a mistake to report, not a place to start a plain Redis."""
    for url in (f"rediss://127.0.0.1:{free_port()}/0", f"redis+sentinel://127.0.0.1:{free_port()}/primary/0"):
        out = subprocess.run(
            [sys.executable, "-m", "rollout_svc", "up", "--redis-url", url, "--engine", "echo"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 1 and "no Redis answers" in out.stderr, out.stderr
