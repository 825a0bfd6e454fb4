"""A worker's own state: who it is, what it has applied of the fleet's control state, and whether it takes work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout_svc.keys import WorkerLabel
from rollout_svc.protocol import PauseMode, WorkerStatus
from workers.lora_table import AdapterTable
from workers.totals import ServedTotals

log = logging.getLogger("rollout_svc.worker")

if TYPE_CHECKING:
    from workers.engine import Engine


def default_worker_id() -> str:
    """A worker id unique on this host: `{hostname}-{pid}-{4 hex digits}`."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


@dataclass
class Wakes:
    """The events a worker's loops wait on, each set by what gives its loop something to do."""

    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # set once: the loops end, the worker drains
    slot_freed: asyncio.Event = field(default_factory=asyncio.Event)  # a generation left the index: the take loop looks
    control: asyncio.Event = field(default_factory=asyncio.Event)  # a nudge or a reconnect: the control loop converges
    weights: asyncio.Event = field(default_factory=asyncio.Event)  # a weights nudge or a reconnect: the weights loop

    def stop(self) -> None:
        """Every loop sees the stop at once (a take loop waiting for capacity too)."""
        for event in (self.stopping, self.slot_freed, self.control, self.weights):
            event.set()

    def nudges_lost(self) -> None:
        """Nudges may have been lost (a reconnect, a reconcile): the control and weights loops look."""
        self.control.set()
        self.weights.set()


@dataclass
class WorkerState:
    """Read by the take loop (`resumed`), written by the converger and the heartbeat (fencing).

    `worker_id` changes when a worker presumed dead comes back as a new incarnation. `applied_epoch` is the
    control epoch it acknowledged; `error_epoch` / `error` the last command that failed here.
    """

    base_id: str
    incarnation: int = 0
    label: WorkerLabel = "starting"
    applied_epoch: int = 0
    weight_version: int = 0
    weight_digest: str = ""  # of the weights loaded, as received (`weightsync.transfer.weights_digest`; "": not known)
    committed_version: int = 0  # the fleet's committed weight version, as this worker last read it
    pause_mode: PauseMode | None = None
    sleep_level: int = 0
    error_epoch: int = 0
    error: str = ""
    fenced_results: int = 0
    fenced: bool = False  # presumed dead while it lived: it takes nothing until it is back as a new incarnation
    # the widest context a worker of the fleet has said (`WorkerStreams.report_load`): a worker of a narrower one
    # waits on its pinned stream only, and takes shared work by its take's share, which leaves it what it cannot hold
    widest_context: int = 0
    resumed: asyncio.Event = field(default_factory=asyncio.Event)  # set while it takes rollout requests
    # the newest control epoch the converger applied (a pass over it: a pause cuts what it holds then); None: no
    # converger runs here, and requests do not wait for one (`control_applied`)
    passed_epoch: int | None = None
    _epoch_passed: asyncio.Event = field(default_factory=asyncio.Event)  # replaced at each pass, the old one set
    _waited_in_vain: int = -1  # the last epoch a request waited for in vain (`control_applied` logs it once)
    adapters: AdapterTable = field(default_factory=AdapterTable)  # the LoRA adapters its engine holds

    @property
    def worker_id(self) -> str:
        return self.base_id if self.incarnation == 0 else f"{self.base_id}~{self.incarnation}"

    def set_label(self, label: WorkerLabel) -> None:
        """Move to `label`; a draining worker stays draining. Only `serving` takes rollout requests."""
        if self.label == "draining":
            return
        self.label = label
        if label == "serving":
            self.resumed.set()
        else:
            self.resumed.clear()

    def status(
        self, engine: Engine, in_flight: int, started_at: float, totals: ServedTotals | None = None
    ) -> WorkerStatus:
        """The heartbeat of a worker in this state, running `engine` (`in_flight` entries taken and not answered, up
        since `started_at`, unix s; `totals`: what it served, summed; none yet by default)."""
        totals = totals or ServedTotals()
        return WorkerStatus(
            generated_tokens=totals.generated_tokens,
            generation_s=round(totals.generation_s, 6),
            first_tokens=totals.first_tokens,
            first_token_s=round(totals.first_token_s, 6),
            worker_id=self.worker_id,
            state=self.label,
            engine=type(engine).__name__,
            model=engine.model_name,
            capacity=engine.capacity,
            in_flight=in_flight,
            served=totals.served,
            weight_version=self.weight_version,
            weight_digest=self.weight_digest,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=started_at,
            heartbeat_at=time.time(),
            applied_epoch=self.applied_epoch,
            pause_mode=self.pause_mode or "",
            sleep_level=self.sleep_level,
            memory_released=engine.memory_released,
            fenced_results=self.fenced_results,
            incarnation=self.incarnation,
            error_epoch=self.error_epoch,
            error=self.error,
            weight_ranks=engine.weight_ranks,
            tensor_parallel_size=engine.parallel.tensor,
            pipeline_parallel_size=engine.parallel.pipeline,
            data_parallel_size=engine.parallel.data,
            adapters=self.adapters.summary(),
            max_num_seqs=engine.capacity // engine.parallel.data,
            max_model_len=engine.max_model_len,
            kv_cache_tokens=engine.kv_cache_tokens,
            engine_config=engine.engine_config,
        )

    def passed(self, epoch: int) -> None:
        """The converger applied the control state up to `epoch` (one pass over it): wake what waits for it."""
        self.passed_epoch = epoch
        event, self._epoch_passed = self._epoch_passed, asyncio.Event()
        event.set()

    async def control_applied(self, epoch: int, timeout_s: float) -> bool:
        """Wait until the converger applied the control state up to `epoch`, for at most `timeout_s`; True at once
        where no converger runs. A request enqueued after a control command (its entry's epoch) that this worker has
        not applied yet waits so before it runs: a pause that cut the request on another worker then cuts its retry
        here before it starts, and a weight version committed before it was enqueued is known here. A wait in vain
        is logged once an epoch: every request taken meanwhile waits alike."""
        deadline = time.monotonic() + timeout_s
        while self.passed_epoch is not None and self.passed_epoch < epoch:
            left = deadline - time.monotonic()
            if left <= 0:
                if epoch != self._waited_in_vain:
                    self._waited_in_vain = epoch
                    log.warning(
                        "a request waited %.1f s for worker %s to apply control epoch %d (applied: %d); served so "
                        "until it does",
                        timeout_s,
                        self.worker_id,
                        epoch,
                        self.passed_epoch,
                    )
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._epoch_passed.wait(), left)
        return True

    def fail(self, epoch: int, message: str) -> None:
        self.error_epoch, self.error = epoch, message
