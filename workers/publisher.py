"""Publishing a worker's results: answered requests' results and acks, batched into one script call."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rollout_svc import tracing
from rollout_svc.dataplane.worker_streams import WorkerStreams
from workers import traces
from workers.inflight import InFlight, Woken
from workers.serve import REDIS_ERRORS, backoff_s
from workers.state import WorkerState

log = logging.getLogger("rollout_svc.worker")


class Publisher:
    """The queue of answered requests, and the loop that publishes them (`WorkerStreams.publish`: each result into
    its producer's results stream, its entry acked and deleted, fenced if the entry is no longer this worker's).

    An answered request stays in flight until its result is published (its entry is pending until then); once it
    is, `released(record)` takes it out of the in-flight index."""

    def __init__(
        self,
        streams: WorkerStreams,
        state: WorkerState,
        results_ttl_s: float,
        released: Callable[[InFlight], None],
        load_after: Callable[[list[InFlight]], tuple[str, int]] | None = None,
        woken: Woken | None = None,
    ) -> None:
        self.streams, self.state, self.results_ttl_s, self.released = streams, state, results_ttl_s, released
        self.load_after = load_after  # (worker id, free slots) once a batch is released
        self.woken = woken or Woken()  # what the worker's reads took outside a plan: counted by a publish sent first
        self._queue: asyncio.Queue[InFlight | None] = asyncio.Queue()  # answered requests; None: stop

    def put(self, record: InFlight) -> None:
        """Queue an answered request (its `reply_to` and `payload` set; `reply_to` None: ack without an answer)."""
        record.publishing = True
        self._queue.put_nowait(record)

    def close(self) -> None:
        """Stop the loop once everything queued before this is published."""
        self._queue.put_nowait(None)

    async def run(self, stopping: asyncio.Event) -> None:
        """Batch whatever results are ready into one script call; under load this amortises the round trip. Once
        `stopping` is set, a batch is tried 3 times, then the loop fails (the entries stay pending: requeued)."""
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            ready = [item for item in batch if item is not None]
            if ready:
                await self.publish(ready, attempts=3 if stopping.is_set() else None)
            if len(ready) < len(batch):
                return  # the stop sentinel: everything before it is published

    async def publish(self, batch: list[InFlight], attempts: int | None = None) -> None:
        """Publish + ack; retried while Redis is away (the entries stay pending, so a crash loses nothing)."""
        failures = 0
        while True:
            try:
                items = [(r.entry, None if r.reply_to is None else (r.reply_to, r.payload)) for r in batch]
                load = None if self.load_after is None else self.load_after(batch)
                with self.woken.claimed(load is not None) as woken:
                    fenced = await self.streams.publish(items, self.results_ttl_s, load, woken)
                if fenced:
                    for position in fenced:
                        batch[position].fenced = True
                    self.state.fenced_results += len(fenced)
                    log.warning(
                        "dropped %d results: their requests were requeued while this worker was stalled", len(fenced)
                    )
                if tracing.enabled():
                    traces.published(batch, self.state.worker_id)
                for record in batch:
                    self.released(record)
                return
            except REDIS_ERRORS as exc:
                failures += 1
                if attempts is not None and failures >= attempts:
                    raise
                log.warning("publishing %d results failed (%s); retrying", len(batch), exc)
                await asyncio.sleep(backoff_s(failures))
