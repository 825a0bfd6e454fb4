"""A worker's reconcile after a Redis restart (workers/liveness.py), driven with stand-ins for Redis and the
worker's parts: what it does when the reconcile is cut short."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import BusyLoadingError

from rollout_svc.config import Settings
from workers import liveness as liveness_module
from workers.liveness import Liveness
from workers.state import Wakes


class Streams:
    """`WorkerStreams.ensure_groups`, refused while Redis still loads its append-only file."""

    def __init__(self, refusals: int) -> None:
        self.redis, self.refusals, self.ensured = object(), refusals, 0

    async def ensure_groups(self, worker_id: str) -> None:
        if self.refusals > 0:
            self.refusals -= 1
            raise BusyLoadingError("Redis is loading the dataset in memory")
        self.ensured += 1


class Reaper:
    async def requeue_orphans(self, worker_id: str) -> int:
        return 0

    async def pending_keys(self, worker_id: str, streams: Any, count: int) -> set[tuple[str, bytes]]:
        return set()


class Router:
    async def sadd(self, key: str, *members: str) -> int:
        return 1


def _liveness(streams: Streams) -> Liveness:
    index = SimpleNamespace(records=list, cancel_all=None)
    return Liveness(
        Settings(),
        SimpleNamespace(worker_id="w1"),
        index,
        SimpleNamespace(),
        Wakes(),
        streams=streams,
        reaper=Reaper(),
        registry=SimpleNamespace(),
        router=Router(),
        converger=SimpleNamespace(),
        status=lambda: None,
        load_after=lambda released: ("w1", 0),
        holds=lambda: (0, 0),
    )


async def test_a_reconcile_cut_short_is_tried_again_at_the_next_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis came back under a new run_id but still loads its append-only file: INFO answers, the reconcile's first
    command is refused. The next check reconciles again (the run_id was not kept), and only a done reconcile starts
    the look for entries pending here that the worker no longer holds (a chaos run's double restart lost a request
    when the new run_id was kept before the reconcile failed: nothing looked again)."""

    async def run_id(client: object) -> str:
        return "b" * 40

    monkeypatch.setattr(liveness_module, "server_run_id", run_id)
    streams = Streams(refusals=1)
    liveness = _liveness(streams)
    liveness.redis_run_id = "a" * 40
    with pytest.raises(BusyLoadingError):
        await liveness.check_redis()
    assert liveness.redis_run_id == "a" * 40 and not liveness._forgotten_check
    await liveness.check_redis()
    assert streams.ensured == 1 and liveness.redis_run_id == "b" * 40 and liveness._forgotten_check
    await liveness.check_redis()  # the same run_id: nothing to reconcile
    assert streams.ensured == 1
