"""Taking a worker's requests: its fair share of rollout requests while it serves, tokenize requests always, each
started on the request server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ResponseError

from rollout_svc.dataplane.streams import Entry
from rollout_svc.dataplane.worker_streams import TakeOptions
from workers.inflight import InFlight, Woken
from workers.liveness import Lease
from workers.serve import REDIS_ERRORS, RequestServer, backoff_s, idle
from workers.state import Wakes

log = logging.getLogger("rollout_svc.worker")
_T = TypeVar("_T")
TOKEN_CONCURRENCY = 256  # tokenize requests served at once
SHARE_WAIT_S = 0.02  # a worker that left queued work to others' shares reads again after this (or a slot freed)
IDLE_TAKE_S = 1.0  # a worker that holds nothing takes (which sets its load to 0) at least this often, looks or not


class Taker:
    """A worker's two reading loops: `take_loop` (rollout requests, while it serves and its lease holds) and
    `token_loop` (tokenize requests, always), each entry put in flight and served on `server`, whose settings,
    engine, state, in-flight index and streams it reads.

    `woken` carries what its reads took that no script counted yet; `wakes.slot_freed` wakes a take loop waiting for
    capacity; `released(record)` takes a record out of the index once its serve task ended unanswered.
    `stop_taking()` is what a pause calls."""

    def __init__(
        self,
        server: RequestServer,
        lease: Lease,
        woken: Woken,
        wakes: Wakes,
        released: Callable[[InFlight], None],
    ) -> None:
        self.server, self.lease, self.woken = server, lease, woken
        self.wakes, self.released = wakes, released
        self.settings, self.engine, self.state, self.index = server.settings, server.engine, server.state, server.index
        self.keys, self.streams, self.metrics = server.keys, server.streams, server.metrics
        # Its takes and blocking reads go over a connection of its own, which a pause can unblock at once, used
        # directly (`DirectConnection`): the request's hot path.
        own = self.streams.on_own_connection()
        assert own.connection.direct is not None  # `on_own_connection` gives one
        self._own, self._direct = own, own.connection.direct
        self._options: TakeOptions | None = None  # how it takes, for its current incarnation
        # In a take or a (blocking) read; that read returned.
        self._reading, self._read_returned = False, asyncio.Event()
        self._read_failures: dict[str, int] = {}  # loop name -> reads failed in a row
        self._left = False  # its last take left queued entries to other workers' shares
        self._idle_take_at = 0.0  # monotonic time of its last take made while it held nothing

    async def aclose(self) -> None:
        """Give back its own connection."""
        await self._own.aclose()

    async def take_loop(self) -> None:
        """Rollout requests, while it serves, its heartbeat says so and its lease holds, up to its free slots."""
        block_s = self.settings.read_block_ms / 1000
        while not self.wakes.stopping.is_set():
            if not self.state.resumed.is_set() or not self.lease.serving.is_set():
                self._left = False  # its first take once it serves again reopens it (`dataplane.levels`)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._resumed_and_announced(), block_s)
                continue
            if (
                self.state.fenced or not self.lease.ok()
            ):  # until the heartbeat loop renewed (Redis away) or re-registered
                await idle(self.wakes.stopping, block_s)
                continue
            free = self.engine.capacity - self.index.generating
            if free <= 0:
                self.wakes.slot_freed.clear()
                await self.wakes.slot_freed.wait()
                continue
            if (taken := await self._read("take", self._take(free))) is None:
                continue
            entries, left = taken
            self._left = left
            self._start(entries, generation=True)
            if entries:
                await asyncio.sleep(0)  # start the new requests before sending the next read
            if left:  # what waits is other workers' share: until one of ours ends, or a moment
                self.index.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.index.changed.wait(), SHARE_WAIT_S)

    async def _resumed_and_announced(self) -> None:
        """Until it serves and its heartbeat says so (`Lease.serving`)."""
        await self.state.resumed.wait()
        await self.lease.serving.wait()

    def _take_options(self) -> TakeOptions:
        """How it takes, built again once its id changes (a new incarnation) or its engine says what it holds."""
        options = self._options
        holds = (self.engine.kv_cache_tokens, self.engine.max_model_len)
        if options is None or options.worker_id != self.state.worker_id or holds != options.holds:
            ttl_ms, share = int(self.settings.heartbeat_ttl_s * 1e3), self.settings.worker.placement == "cost"
            options = self._options = TakeOptions(self.state.worker_id, ttl_ms, share, *holds)
        return options

    async def _take(self, free: int) -> tuple[list[Entry], bool]:
        """A take of its fair share (`WorkerStreams.take`); with nothing to take, one blocking read of the next
        entries, on the connection a pause can unblock, and where it found more waiting, its share of them taken at
        once (one batch: their answers go out together). Returns the entries and whether waiting ones were left to
        other workers' shares."""
        await self._direct.client_id()  # known to `stop_taking`
        # No await between the take loop's `resumed` check and here: a pause sees `_reading` and unblocks the read.
        self._reading = True
        try:
            options = self._take_options()
            # A take first, unless its last read found nothing more queued (to the next read at once), or it left
            # entries to other workers' shares and a look (plain commands) finds they took them all (it blocks; one
            # that holds nothing still takes every IDLE_TAKE_S, which sets its load right)
            if not self.woken.drained and not (self._may_look() and await self._own.shared_waiting() == 0):
                entries, left = await self._planned(options, free)
                if entries or left or free <= 0:
                    return entries, left
            worker_id = options.worker_id
            # narrower than another worker's context: no blocking read of the shared queue, which would take its next
            # entry whether it fits here or not; its take's share leaves it what only a wider worker holds
            shared = not 0 < options.max_model_len < self.state.widest_context
            block_ms, asked = self.settings.read_block_ms, min(free, self.settings.worker.read_ahead)
            pinned = self.keys.pinned_requests(worker_id)
            woken = await self._own.wait_for_entries(worker_id, block_ms, asked, shared)
            self.woken.add(woken, pinned, asked)  # counted by a take or publish
            if not woken or self.woken.drained or free <= len(woken):
                return woken, False
            if sum(e.stream != pinned for e in woken) < asked:  # more of its own sessions' only: no share to weigh
                more = await self._own.read_pinned(worker_id, free - len(woken))
                # drained where it read fewer than it asked, the shared stream having given less than asked already
                self.woken.add(more, pinned, free - len(woken), drained=len(more) < free - len(woken))
                return woken + more, False
            entries, left = await self._planned(options, free - len(woken))
            return woken + entries, left
        finally:
            self._reading = False
            self._read_returned.set()

    async def _planned(self, options: TakeOptions, free: int) -> tuple[list[Entry], bool]:
        """One take (`plan_take`, then `read_plan`), what it read beyond or short of its plan kept in `woken` for the
        next script call. Returns the entries and whether waiting ones were left to other workers' shares."""
        idle = self._idle()
        if idle:
            self._idle_take_at = time.monotonic()
        with self.woken.claimed() as carried:
            plan = await self._own.plan_take(options, free, carried, idle=idle)
        try:
            taken = await self._own.read_plan(plan)
        except BaseException:
            self.woken.unplanned((-plan.counted[0], -plan.counted[1]), drained=False)  # counted, not read
            raise
        self.woken.unplanned(taken.unplanned, taken.drained)
        return taken.entries, taken.left

    def _idle(self) -> bool:
        """It holds nothing: no generation in flight, no read's cost waiting to be counted."""
        return not (self.index.generating or self.woken.tokens)

    def _may_look(self) -> bool:
        """Its last take left entries to other workers' shares, and it need not take to set its load right."""
        return self._left and not (self._idle() and time.monotonic() - self._idle_take_at >= IDLE_TAKE_S)

    async def token_loop(self) -> None:
        """Tokenize, detokenize and chat-template requests: served while paused or asleep too."""
        while not self.wakes.stopping.is_set():
            free = TOKEN_CONCURRENCY - (len(self.index) - self.index.generating)
            if self.state.fenced or not self.lease.ok() or free <= 0:
                await idle(self.wakes.stopping, self.settings.read_block_ms / 1000)
                continue
            read = self.streams.read_tokens(self.state.worker_id, free, self.settings.read_block_ms)
            if (entries := await self._read("tokens", read)) is not None:
                self._start(entries, generation=False)

    async def _read(self, loop: str, read: Awaitable[_T]) -> _T | None:
        """One read of a take loop. None after an error it recovered from: consumer groups recreated (Redis lost
        its data: a restart without persistence), or Redis away (backed off, longer after each failure)."""
        try:
            entries = await read
        except ResponseError as exc:
            # NOGROUP: Redis lost the group (a restart without persistence). UNBLOCKED ... no longer exists: the
            # stream was deleted under a blocked read (a reaper draining this id's earlier process).
            if "NOGROUP" not in str(exc) and "no longer exists" not in str(exc):
                raise
            await self.streams.ensure_groups(self.state.worker_id)
            return None
        except REDIS_ERRORS as exc:
            self._read_failures[loop] = failures = self._read_failures.get(loop, 0) + 1
            log.warning("%s loop: reading requests failed (%s); retrying", loop, exc)
            await asyncio.sleep(backoff_s(failures))
            return None
        self._read_failures[loop] = 0
        return entries

    async def stop_taking(self) -> None:
        """Make the take loop stop at once (the state already says not to take): unblock a read in progress and
        wait until what it returned is in the in-flight index, so that a pause applies to it too."""
        deadline = time.monotonic() + self.settings.read_block_ms / 1000 + 1
        while self._reading and time.monotonic() < deadline:
            self._read_returned.clear()
            if (client_id := self._direct.known_client_id) is not None:
                with contextlib.suppress(ResponseError, *REDIS_ERRORS):  # an old Redis, or fakeredis: wait instead
                    await self.streams.redis.client_unblock(client_id)
            with contextlib.suppress(TimeoutError):  # not blocked yet (the command not sent): unblock again
                await asyncio.wait_for(self._read_returned.wait(), 0.005)

    def _start(self, entries: list[Entry], generation: bool) -> None:
        for entry in entries:
            if self.metrics is not None:
                self.metrics.taken(entry)
            record = self.index.add(entry, generation)
            record.task = asyncio.create_task(self.server.serve(record))
            record.task.add_done_callback(functools.partial(self._finished, record))

    def _finished(self, record: InFlight, _task: asyncio.Task[None]) -> None:
        """A serve task ended. An answered request stays in flight until its result is published (its entry is
        pending until then), so an acknowledgement that waits for in-flight requests also waits for their answers."""
        if not record.publishing:
            self.released(record)
