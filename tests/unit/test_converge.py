"""The converger (workers/converge.py) driven by an in-memory control plane and a recording engine: no Redis, no
process. Each test issues commands as `ControlPlane` would (the state hash changed, the command logged under its
epoch), converges, and checks what the engine was told, the worker's state, and whether it may acknowledge."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from rollout_svc.control.plane import FleetState
from rollout_svc.dataplane.streams import Entry
from rollout_svc.errors import EngineDeadError
from rollout_svc.protocol import ControlCommand, PauseMode, RolloutRequest, TokenizeRequest
from workers.converge import Converger
from workers.inflight import AbortRules, InFlight, InFlightIndex
from workers.state import WorkerState


class Control:
    """The two `ControlPlane` methods the converger calls, over a state and a command log held here. The issuing
    methods change the state and log a command under the next epoch, as `ControlPlane`'s issue script does."""

    def __init__(self) -> None:
        self.state: FleetState | None = FleetState()
        self.log: list[ControlCommand] = []

    async def read(self, after_epoch: int | None) -> tuple[FleetState | None, list[ControlCommand]]:
        return self.state, [c for c in self.log if after_epoch is None or c.epoch > after_epoch]

    async def reseed(self, state: FleetState) -> bool:
        if self.state is not None:
            return False
        self.state = state
        return True

    def issue(self, kind: str, args: dict[str, Any] | None = None, **changes: Any) -> int:
        assert self.state is not None
        epoch = self.state.epoch + 1
        self.state = dataclasses.replace(self.state, epoch=epoch, **changes)
        self.log.append(ControlCommand(command_id=f"c-{epoch}", kind=kind, args=args or {}, epoch=epoch))
        return epoch

    def pause(self, mode: PauseMode, holder: str = "operator") -> int:
        assert self.state is not None
        return self.issue("pause", {"mode": mode, "holder": holder}, holders={**self.state.holders, holder: mode})

    def resume(self, holder: str = "operator") -> int:
        assert self.state is not None
        holders = {h: m for h, m in self.state.holders.items() if h != holder}
        return self.issue("resume", {"holder": holder}, holders=holders)

    def sleep(self, level: int, mode: PauseMode) -> int:
        changes = {"sleep_level": level, "sleep_mode": mode, "awake_tags": frozenset()}
        return self.issue("sleep", {"level": level, "mode": mode}, **changes)

    def wake_up(self, tags: list[str] | None = None) -> int:
        assert self.state is not None
        if tags:
            return self.issue("wake_up", {"tags": tags}, awake_tags=self.state.awake_tags | set(tags))
        return self.issue("wake_up", {"tags": None}, sleep_level=0, awake_tags=frozenset())

    def abort(self, **args: Any) -> int:
        return self.issue("abort", {"request_ids": [], "session_id": None, "all": False} | args)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> int:
        return self.issue("reset_prefix_cache", {"reset_running_requests": reset_running_requests})


class Engine:
    """Records the control calls a worker makes on its engine; `refuse_reset` and `raises` make them fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refuse_reset = False
        self.raises: dict[str, Exception] = {}

    def _call(self, *call: Any) -> None:
        self.calls.append(call)
        if call[0] in self.raises:
            raise self.raises[call[0]]

    async def pause(self, mode: PauseMode) -> None:
        self._call("pause", mode)

    async def resume(self) -> None:
        self._call("resume")

    async def abort(self, request_id: str) -> None:
        self._call("abort", request_id)

    async def sleep(self, level: int, mode: PauseMode) -> None:
        self._call("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None) -> bool:
        self._call("wake_up", tags)
        return True

    async def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        self._call("reset_prefix_cache", reset_running_requests)
        return not self.refuse_reset


class Worker:
    """One worker's converger with the fakes around it; `stops` counts the calls to stop taking requests."""

    def __init__(self) -> None:
        self.control, self.engine = Control(), Engine()
        self.index = InFlightIndex(self.engine)  # type: ignore[arg-type]
        self.state, self.rules = WorkerState("w"), AbortRules()
        self.stops = 0
        self.converger = Converger(self.control, self.engine, self.index, self.state, self.rules, self._stop)  # type: ignore[arg-type]

    async def _stop(self) -> None:
        self.stops += 1

    async def converge(self) -> bool:
        return await self.converger.converge()

    def take(self, request_id: str, session_id: str | None = None, epoch: int = 0, generation: bool = True) -> InFlight:
        """A request taken and running in the engine (a tokenize request when not `generation`)."""
        entry = Entry("requests", request_id.encode(), b"", 1, session_id, epoch)
        record = self.index.add(entry, generation)
        if generation:
            request: Any = RolloutRequest(request_id=request_id, prompt_token_ids=[1, 2], reply_to="results")
        else:
            request = TokenizeRequest(request_id=request_id, text="hi", reply_to="results")
        self.index.decoded(record, request)
        record.in_engine = generation
        return record


@pytest.fixture
async def worker() -> Worker:
    w = Worker()
    assert await w.converge() is True  # the first convergence: serving, nothing told to the engine
    assert (w.state.label, w.state.applied_epoch, w.engine.calls) == ("serving", 0, [])
    assert w.state.resumed.is_set()
    return w


async def test_one_shot_commands_apply_once_each_in_epoch_order(worker: Worker):
    control, engine = worker.control, worker.engine
    first = control.reset_prefix_cache()
    control.reset_prefix_cache(reset_running_requests=True)
    last = control.reset_prefix_cache()
    assert await worker.converge() is True
    assert engine.calls == [("reset_prefix_cache", False), ("reset_prefix_cache", True), ("reset_prefix_cache", False)]
    assert worker.state.applied_epoch == last == first + 2
    assert await worker.converge() is True  # read again (a heartbeat): nothing new, nothing applied twice
    assert len(engine.calls) == 3 and worker.state.error_epoch == 0


async def test_a_worker_joining_applies_no_command_logged_before_it_but_keeps_the_abort_rules():
    w = Worker()
    w.control.reset_prefix_cache()
    epoch = w.control.abort(session_id="s")
    assert await w.converge() is True
    assert w.engine.calls == [] and w.state.applied_epoch == epoch
    late = w.take("queued-before", session_id="s", epoch=epoch - 1)  # a queued request the abort hit, taken now
    assert w.rules.hits(late)
    assert not w.rules.hits(w.take("enqueued-after", session_id="s", epoch=epoch))


async def test_restart_converges_from_scratch_without_applying_old_commands_again(worker: Worker):
    worker.control.reset_prefix_cache()
    assert await worker.converge() is True and len(worker.engine.calls) == 1
    worker.converger.restart()  # a new incarnation
    assert await worker.converge() is True
    assert len(worker.engine.calls) == 1


async def test_an_abort_command_cuts_what_it_hits_and_is_acknowledged_once_they_returned(worker: Worker):
    hit, other = worker.take("r-1", session_id="s"), worker.take("r-2", session_id="t")
    before = worker.state.applied_epoch
    epoch = worker.control.abort(request_ids=["r-1"])
    assert await worker.converge() is False  # r-1 still returns its partial output: no ack yet
    assert worker.engine.calls == [("abort", "r-1")]
    assert (hit.abort_cause, other.abort_cause) == ("user", None)
    assert worker.state.applied_epoch == before and worker.state.label == "serving"
    worker.index.remove(hit)
    assert await worker.converge() is True
    assert worker.state.applied_epoch == epoch and worker.engine.calls == [("abort", "r-1")]  # aborted once


async def test_keep_pause_freezes_in_flight_requests_and_resume_continues_them(worker: Worker):
    running = worker.take("r-1")
    epoch = worker.control.pause("keep")
    assert await worker.converge() is True  # keep does not wait for in-flight requests
    assert worker.engine.calls == [("pause", "keep")] and running.abort_cause is None
    assert (worker.state.label, worker.state.pause_mode, worker.state.applied_epoch) == ("paused", "keep", epoch)
    assert worker.stops == 1 and not worker.state.resumed.is_set()
    assert await worker.converge() is True and worker.engine.calls == [("pause", "keep")]  # paused once
    epoch = worker.control.resume()
    assert await worker.converge() is True
    assert worker.engine.calls == [("pause", "keep"), ("resume",)]
    assert (worker.state.label, worker.state.pause_mode, worker.state.applied_epoch) == ("serving", None, epoch)
    assert worker.state.resumed.is_set()


async def test_abort_pause_cuts_generations_and_acks_once_they_returned(worker: Worker):
    first, second, tokens = worker.take("r-1"), worker.take("r-2"), worker.take("t-1", generation=False)
    epoch = worker.control.pause("abort")
    assert await worker.converge() is False
    assert sorted(worker.engine.calls) == [("abort", "r-1"), ("abort", "r-2"), ("pause", "abort")]
    assert (first.abort_cause, second.abort_cause, tokens.abort_cause) == ("pause", "pause", None)
    assert worker.state.applied_epoch == 0 and worker.state.label == "paused"
    worker.index.remove(first)
    assert await worker.converge() is False  # one still returning
    worker.index.remove(second)
    assert await worker.converge() is True and worker.state.applied_epoch == epoch
    assert len(worker.engine.calls) == 3  # neither aborted nor paused twice
    late = worker.take("r-3")  # taken just as the pause landed: cut at the next pass
    assert await worker.converge() is False and late.abort_cause == "pause"


async def test_a_request_enqueued_after_a_command_waits_until_a_pass_applied_it(
    worker: Worker, caplog: pytest.LogCaptureFixture
):
    applied = worker.state.passed_epoch
    assert applied is not None and await worker.state.control_applied(applied, 0.0) is True  # applied: no wait
    epoch = worker.control.pause("abort")
    assert await worker.state.control_applied(epoch, 0.05) is False  # no pass over it yet: waited in vain
    assert await worker.state.control_applied(epoch, 0.0) is False
    vain = [r for r in caplog.records if "to apply control epoch" in r.getMessage()]
    assert len(vain) == 1 and f"epoch {epoch} (applied: {applied})" in vain[0].getMessage()  # once an epoch
    retry = worker.take("r-9", epoch=epoch)  # a retry of a request the pause cut on another worker, not started yet
    retry.in_engine = False
    waiting = asyncio.ensure_future(worker.state.control_applied(epoch, 5.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    assert await worker.converge() is False  # the pass cuts it before it reaches the engine
    assert await waiting is True and retry.abort_cause == "pause"
    assert ("abort", "r-9") not in worker.engine.calls
    assert await WorkerState("no-converger").control_applied(epoch, 0.0) is True  # no converger: nothing to wait for


async def test_wait_pause_acknowledges_only_after_in_flight_requests_finished(worker: Worker):
    running = worker.take("r-1")
    worker.take("t-1", generation=False)  # a tokenize request is not waited for
    epoch = worker.control.pause("wait")
    assert await worker.converge() is False
    assert worker.engine.calls == [] and worker.state.label == "paused" and worker.stops == 1
    assert worker.state.applied_epoch == 0 and running.abort_cause is None
    worker.index.remove(running)
    assert await worker.converge() is True
    assert worker.engine.calls == [("pause", "wait")] and worker.state.applied_epoch == epoch


async def test_a_wait_pause_over_a_keep_pause_lets_the_frozen_requests_finish_first(worker: Worker):
    running = worker.take("r-1")
    worker.control.pause("keep")
    assert await worker.converge() is True
    worker.control.pause("wait", holder="trainer")  # the strongest mode applies: wait
    assert await worker.converge() is False
    assert worker.engine.calls == [("pause", "keep"), ("resume",)]  # unfrozen, to finish
    worker.index.remove(running)
    assert await worker.converge() is True
    assert worker.engine.calls[-1] == ("pause", "wait") and worker.state.pause_mode == "wait"
    worker.control.resume(holder="trainer")
    assert await worker.converge() is True
    assert worker.state.pause_mode == "keep" and worker.state.label == "paused"  # the operator still holds keep


async def test_sleep_and_wake_up_restore_the_pause_state_from_before(worker: Worker):
    worker.control.pause("keep")
    assert await worker.converge() is True
    worker.control.sleep(1, "keep")
    assert await worker.converge() is True
    assert (worker.state.label, worker.state.sleep_level) == ("sleeping", 1)
    worker.control.wake_up(["weights"])  # partial: still asleep
    assert await worker.converge() is True
    assert worker.state.label == "sleeping"
    epoch = worker.control.wake_up()
    assert await worker.converge() is True
    assert worker.engine.calls == [
        ("pause", "keep"),
        ("sleep", 1, "keep"),
        ("wake_up", ["weights"]),
        ("wake_up", None),
        ("pause", "keep"),  # paused again, as before the sleep
    ]
    assert (worker.state.label, worker.state.pause_mode, worker.state.sleep_level) == ("paused", "keep", 0)
    assert worker.state.applied_epoch == epoch and not worker.state.resumed.is_set()


async def test_sleep_abort_cuts_in_flight_requests_and_waking_an_unpaused_fleet_serves(worker: Worker):
    running = worker.take("r-1")
    worker.control.sleep(2, "abort")
    assert await worker.converge() is False and running.abort_cause == "pause"
    worker.index.remove(running)
    assert await worker.converge() is True
    worker.control.wake_up()
    assert await worker.converge() is True
    assert worker.engine.calls == [("abort", "r-1"), ("sleep", 2, "abort"), ("wake_up", None)]
    assert worker.state.label == "serving" and worker.state.resumed.is_set()


async def test_a_refused_or_failing_command_is_recorded_in_the_ack(worker: Worker):
    worker.engine.refuse_reset = True
    refused = worker.control.reset_prefix_cache()
    assert await worker.converge() is True  # acknowledged, with the failure beside it
    assert worker.state.error_epoch == refused and "refused" in worker.state.error
    worker.engine.raises["reset_prefix_cache"] = RuntimeError("boom")
    failed = worker.control.reset_prefix_cache()
    assert await worker.converge() is True
    assert (worker.state.error_epoch, worker.state.error) == (failed, "RuntimeError: boom")
    worker.engine.raises["pause"] = RuntimeError("no pause")
    paused = worker.control.pause("keep")
    assert await worker.converge() is True and worker.state.applied_epoch == paused
    assert (worker.state.error_epoch, worker.state.error) == (paused, "RuntimeError: no pause")


async def test_a_dead_engine_is_not_recorded_but_raised(worker: Worker):
    worker.engine.raises["pause"] = EngineDeadError("gone")
    worker.control.pause("keep")
    with pytest.raises(EngineDeadError):
        await worker.converge()
    assert worker.state.error_epoch == 0


async def test_stale_weights_take_no_work_and_cut_what_runs(worker: Worker):
    running = worker.take("r-1")
    worker.control.state = dataclasses.replace(worker.control.state, weight_version=3)  # type: ignore[arg-type]
    assert await worker.converge() is True
    assert (worker.state.label, worker.state.committed_version) == ("stale", 3)
    assert running.abort_cause == "stale" and worker.engine.calls == [("abort", "r-1")]
    assert worker.stops == 1 and not worker.state.resumed.is_set()
    worker.state.weight_version = 3  # caught up
    assert await worker.converge() is True and worker.state.label == "serving"


async def test_a_missing_state_is_written_back_from_what_was_applied(worker: Worker):
    epoch = worker.control.pause("abort")
    assert await worker.converge() is True
    applied = worker.control.state
    worker.control.state = None  # Redis forgot the hash
    assert await worker.converge() is True
    assert worker.control.state == applied and worker.state.label == "paused"  # still paused, not resumed
    assert worker.state.applied_epoch == epoch


async def test_a_worker_that_applied_nothing_does_not_write_back_a_state():
    w = Worker()
    w.control.state = None
    assert await w.converge() is True
    assert w.control.state is None and w.state.label == "serving"
