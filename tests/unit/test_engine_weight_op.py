"""The worker's side of vLLM's native weight transfer (`WeightSyncOrder` transport `engine`): each call reaches the
engine with this worker's rank offset, `finish` switches the worker to the order's version, and a refusal or vLLM's
error comes back as the reason the barrier names. The engine here records calls: the real one needs NCCL on CUDA
(tests/e2e/test_skyrl_weights_gpu.py); what `serve` makes of the answers is tests/integration/test_skyrl_weights.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_svc.config import Settings
from rollout_svc.errors import InvalidRequestError
from rollout_svc.keys import OK
from rollout_svc.protocol import EngineWeightOp, WeightSyncOrder
from workers.inflight import InFlightIndex
from workers.state import WorkerState
from workers.weight_receiver import WeightReceiver


class RecordingEngine:
    """Records each native weight call; `fail` raises on that op (as vLLM would), `refuse` as an engine without
    the backend does."""

    def __init__(self, fail: str = "", refuse: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail, self.refuse, self.resets = fail, refuse, 0

    async def engine_weight_op(self, op: str, info: dict[str, Any]) -> None:
        if self.refuse:
            raise InvalidRequestError("no weight transfer engine here")
        if op == self.fail:
            raise RuntimeError("NCCL error: unhandled system error")
        self.calls.append((op, info))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.resets += 1
        return True


def receiver(engine: RecordingEngine, worker_id: str = "w1") -> WeightReceiver:
    settings = Settings(redis_url="redis://127.0.0.1:1/0", advertise_addr="127.0.0.1")
    state = WorkerState(base_id=worker_id)
    return WeightReceiver(settings, None, None, engine, state, InFlightIndex(engine), lambda: None)  # type: ignore[arg-type]


def order(op: str, version: int = 3, **fields: Any) -> WeightSyncOrder:
    return WeightSyncOrder(
        sync_id=f"engine-{op}",
        version=version,
        transport="engine",
        members=["w0", "w1"],
        engine_op=EngineWeightOp(op=op, **fields),  # type: ignore[arg-type]
    )


async def test_init_gives_each_worker_its_own_rank_offset():
    engine = RecordingEngine()
    info = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 4}
    outcome = await receiver(engine)._engine_op(order("init", info=info, rank_offsets={"w0": 1, "w1": 2}))
    assert outcome == OK
    assert engine.calls == [("init", {**info, "rank_offset": 2})]
    missing = await receiver(engine, "w9")._engine_op(order("init", info=info, rank_offsets={"w0": 1}))
    assert missing == "the order assigns this worker no rank" and len(engine.calls) == 1


async def test_update_passes_the_trainers_update_info_and_finish_switches_the_version():
    engine = RecordingEngine()
    worker = receiver(engine)
    update_info = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[4, 2]], "packed": True}
    assert await worker._engine_op(order("start")) == OK
    assert await worker._engine_op(order("update", info=update_info)) == OK
    assert worker.state.weight_version == 0 and engine.resets == 0  # not switched until finish
    assert await worker._engine_op(order("finish", version=4)) == OK
    assert [op for op, _ in engine.calls] == ["start", "update", "finish"] and engine.calls[1][1] == update_info
    assert worker.state.weight_version == 4 and engine.resets == 1  # the prefix cache of the old weights is gone


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        (RecordingEngine(refuse=True), "no weight transfer engine here"),
        (RecordingEngine(fail="finish"), "vLLM's finish failed: RuntimeError: NCCL error"),
    ],
)
async def test_a_refused_or_failed_call_is_the_reason_and_keeps_the_version(engine, expected):
    worker = receiver(engine)
    outcome = await worker._engine_op(order("finish", version=5))
    assert outcome.startswith(expected) and worker.state.weight_version == 0 and engine.resets == 0
