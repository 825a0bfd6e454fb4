"""The Python examples of README.md and docs/*.md run as tests (pytest-markdown-docs), each against a fleet of its own
session: a private redis-server, two echo workers, `rollout-svc serve` and a batch worker.

The examples are written as a user would write them: `RolloutClient()` reads `ROLLOUT_REDIS_URL` and `OpenAI()`
reads `OPENAI_BASE_URL` and `OPENAI_API_KEY`, so the fixture sets those and nothing in an example is rewritten. Each
example runs in a fresh temporary directory (the files it writes go there). A fence whose info string says `notest`
(`{.python notest}`) is shown and not run: only where it needs vLLM, a GPU, Ray or a trainer. The root conftest.py
imports the hooks and fixtures below, so `python -m pytest` (testpaths: tests, docs, README.md) runs the examples.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pytest_markdown_docs.plugin import MarkdownInlinePythonItem, MarkdownTextFile

from rollout_svc import SyncRolloutClient
from rollout_svc.config import Settings
from tests.support import ROOT, SYNC_ECHO_ARGS, WorkerProcs, free_port, redis_server, settings_env, wait_until

API_KEY, ADMIN_TOKEN = "data-key", "admin-token"  # the ones the OpenAI API page exports
EXAMPLE_TIMEOUT_S = 120


def pytest_configure(config: pytest.Config) -> None:
    # The docs are built with pymdownx.superfences, which renders `{.python notest}` as Python: parse fences so.
    config.option.markdowndocs_syntax = "superfences"


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """README.md and every page under docs/ (unless `--markdown-docs` is given: the plugin collects them then)."""
    if file_path.suffix != ".md" or parent.config.option.markdowndocs:
        return None
    if file_path == ROOT / "README.md" or (ROOT / "docs") in file_path.parents:
        return MarkdownTextFile.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """An example's time includes the fleet's start (the first one) or torch's import (weight sync): on a loaded
    2-core machine that can pass the default 30 s."""
    for item in items:
        if isinstance(item, MarkdownInlinePythonItem) and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(EXAMPLE_TIMEOUT_S))


@dataclass
class DocsFleet:
    redis_url: str
    api_base: str


@pytest.fixture(scope="session")
def docs_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocsFleet]:
    """Redis, two echo workers, the API and a batch worker, started together once for all the examples."""
    logs = tmp_path_factory.mktemp("docs-fleet")
    with redis_server(logs) as url:
        # Workers load checkpoints from under the pytest temporary root: every example's working directory.
        settings = Settings(redis_url=url, checkpoint_root=tmp_path_factory.getbasetemp())
        workers = WorkerProcs(settings, logs)
        env = {**settings_env(settings), "ROLLOUT_API_KEYS": f'["{API_KEY}"]', "ROLLOUT_ADMIN_TOKEN": ADMIN_TOKEN}
        port = free_port()
        with (
            rollout_process(["serve", "--port", str(port)], env, logs / "serve.log") as api,
            rollout_process(["batch-worker"], env, logs / "batch-worker.log"),
        ):
            try:
                for worker_id in ("echo-0", "echo-1"):
                    workers.start(worker_id, "--engine", "echo", *SYNC_ECHO_ARGS)  # examples sync weights
                workers.wait_live("echo-0", "echo-1")
                base = f"http://127.0.0.1:{port}"
                wait_until(lambda: _answers(api, f"{base}/health", logs / "serve.log"), 30, "rollout-svc serve")
                yield DocsFleet(url, f"{base}/v1")
            finally:
                workers.stop_all()


@pytest.fixture(autouse=True)
def docs_env(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For an example of the docs (no other test): the fleet's addresses in the environment, a temporary working
    directory, and afterwards a fleet that is neither paused nor asleep (an example must leave it serving)."""
    if not isinstance(request.node, MarkdownInlinePythonItem):
        yield
        return
    fleet: DocsFleet = request.getfixturevalue("docs_fleet")
    monkeypatch.setenv("ROLLOUT_REDIS_URL", fleet.redis_url)
    monkeypatch.setenv("OPENAI_BASE_URL", fleet.api_base)
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("ROLLOUT_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.chdir(tmp_path)
    yield
    with SyncRolloutClient(redis_url=fleet.redis_url) as client:
        state = client.fleet_state()
    assert not state.paused and not state.sleeping, f"the example left the fleet paused or asleep: {state}"


@contextlib.contextmanager
def rollout_process(
    args: list[str], env: dict[str, str], log: Path, stop_signal: int = signal.SIGTERM, stop_timeout_s: float = 10.0
) -> Iterator[subprocess.Popen[bytes]]:
    """`rollout-svc ARGS` in a session of its own, its output appended to `log`. On leaving, `stop_signal` to its
    process group, SIGKILL to the process after `stop_timeout_s`, then to what is left of the group (RQ's work
    horse)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_svc", *args],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, stop_signal)
        try:
            proc.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a work horse left behind


def _answers(proc: subprocess.Popen[bytes], url: str, log: Path) -> bool:
    assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1).status_code == 200
    return False
