"""Shared fixtures: a private redis-server per test session (flushed per test) and worker subprocesses."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from rollout_svc.config import Settings
from tests.support import WorkerProcs, redis_server

VLLM_TIMEOUT_S = 900  # a vLLM test module starts its engines inside its first test's time
# A cold `import vllm` (torch's inductor compiles its templates) took over 30 s in a loaded CI run; cut by the
# timeout, it left torch half-imported and every later vLLM import in that process failed ("duplicate template name").
VLLM_IMPORT_TIMEOUT_S = 300


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "vllm_fleet(spec): the module runs on the session's vLLM fleet of this FleetSpec (tests/e2e/conftest.py)",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The default per-test timeout is 30 s (pyproject); tests on the real engine, or importing it, get longer.

    Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`) a module's tests run on one worker, so module
    fixtures start once; every test on the real engine runs on one worker, grouped by the fleet it asks for
    (`by_fleet`), one fleet at a time; and the two that start a local Ray cluster run one after the other."""
    by_fleet(items)
    for item in items:
        vllm = item.get_closest_marker("vllm") is not None
        if not item.get_closest_marker("timeout"):
            if vllm:
                item.add_marker(pytest.mark.timeout(VLLM_TIMEOUT_S))
            elif item.get_closest_marker("imports_vllm"):
                item.add_marker(pytest.mark.timeout(VLLM_IMPORT_TIMEOUT_S))
        module = item.nodeid.split("::")[0]
        group = "vllm" if vllm else "ray" if "ray" in Path(module).stem.split("_") else module
        item.add_marker(pytest.mark.xdist_group(group))


def by_fleet(items: list[pytest.Item]) -> None:
    """Reorder the real-engine tests, in place among their own positions: the modules asking for one fleet spec (their
    `vllm_fleet` mark, tests/e2e/conftest.py) one after the other, in the order each spec is first asked for, the
    modules within a spec and the tests within a module in their order. A fleet then starts once and stops after its
    last module, before the next spec's start. A real-engine module without the mark is a group of its own."""
    slots = [i for i, item in enumerate(items) if item.get_closest_marker("vllm") is not None]
    first: dict[Any, int] = {}

    def group(item: pytest.Item) -> Any:
        mark = item.get_closest_marker("vllm_fleet")
        return mark.args[0] if mark is not None else item.nodeid.split("::")[0]

    engine_items = [items[i] for i in slots]
    for order, item in enumerate(engine_items):
        first.setdefault(group(item), order)
    engine_items.sort(key=lambda item: first[group(item)])  # stable: each group keeps its order
    for slot, item in zip(slots, engine_items, strict=True):
        items[slot] = item


ENGINE_NICE = 10  # the real engine's tests, beside the others under xdist: they yield the CPU


@pytest.hookimpl(tryfirst=True)  # before the item's fixtures start processes, which inherit the priority
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under pytest-xdist, a test on the real engine (and the engine processes it starts) runs at a lower priority
    than the others: the engines keep both cores busy for minutes, and the other worker's tests give a worker whose
    heartbeat is 2 s late up for dead. Alone (no xdist), and for the other tests, the priority is left as it is."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    wanted = ENGINE_NICE if item.get_closest_marker("vllm") else 0
    with contextlib.suppress(PermissionError):  # raising it back needs root (CAP_SYS_NICE): then it stays lower
        if os.getpriority(os.PRIO_PROCESS, 0) != wanted:
            os.setpriority(os.PRIO_PROCESS, 0, wanted)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of our own on a free port, so tests can stop and restart it."""
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
def rds(redis_url: str) -> Iterator[redis.Redis]:
    """A sync Redis client on the private server, flushed before each test. Its socket timeout is 30 s, not redis-py's
    5: it only observes, and this machine has stopped scheduling processes for a minute under make test's load (a CI
    run failed on its HGET there, while the code under test rode it out)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=30)
    client.flushall()
    yield client
    client.close()


WORKER_LOG_TAIL = 4000  # characters of each worker's log a failed test's report shows


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test that failed with worker processes running shows the end of each one's log in its report (a flaky
    failure in CI is then readable from CI's output alone)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    funcargs = getattr(item, "funcargs", {})
    procs = funcargs.get("workers") or getattr(funcargs.get("vllm_fleet"), "procs", None)  # a real-engine fleet's
    if report.when == "call" and report.failed and isinstance(procs, WorkerProcs):
        for worker_id in procs.procs:
            with contextlib.suppress(OSError):
                report.sections.append((f"worker {worker_id}'s log (end)", procs.log(worker_id)[-WORKER_LOG_TAIL:]))


@pytest.fixture
def settings(request: pytest.FixtureRequest, redis_url: str, rds: redis.Redis) -> Settings:
    """Fast heartbeats so death is noticed within ~2 s; short blocks so tests stay quick. A test marked
    `heartbeat_ttl(s)` gets that TTL instead: one that stops a worker for longer than 2 s and still needs it live."""
    ttl = request.node.get_closest_marker("heartbeat_ttl")
    return Settings(
        redis_url=redis_url,
        key_prefix="test",
        heartbeat_interval_s=0.2,
        heartbeat_ttl_s=ttl.args[0] if ttl else 2.0,
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
    """Start N echo workers with the given worker args and wait until they are live and converged on the fleet's
    control state (out of `starting`); returns their ids."""

    def start(count: int, *args: str) -> list[str]:
        return workers.start_ready([f"echo-{len(workers.procs) + i}" for i in range(count)], "--engine", "echo", *args)

    return start


@pytest.fixture
def sim_workers(workers: WorkerProcs) -> Callable[..., list[str]]:
    """Start N simulated-GPU workers (`--engine sim`, workers/sim) with the given worker args; returns their ids."""

    def start(count: int, *args: str) -> list[str]:
        return workers.start_ready([f"sim-{len(workers.procs) + i}" for i in range(count)], "--engine", "sim", *args)

    return start
