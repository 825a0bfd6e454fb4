"""Peer catch-up: a worker that missed a broadcast loads the committed version from a live peer, without the trainer.

A worker that starts after a broadcast sync (a crash replaced by `up` or Ray), or missed one, is `stale`: it takes
no work. If the committed version came from a broadcast (the state holds its digest, `StateField.WEIGHT_DIGEST`),
it catches up on its own (a checkpoint's version it loads from the checkpoint, `workers.weight_receiver`):

1. it picks a live peer of the same model that serves the committed version (the least loaded), listens for a
   transfer group of two engines (the peer's first rank as rank 0, its own ranks after), and writes a
   `CatchUpOrder` naming the peer (`Keys.weight_catch_ups`), nudging the weights channel;
2. the peer answers (`CatchUpAnswer`) with the manifest of the version its engine holds, as it received it (the
   engine keeps those bytes on the CPU, `weightsync.transfer.ReceivingEnd.held`), or why it cannot (it loaded the
   version from a checkpoint, or has since started receiving a newer one); then it sends, in a thread of its
   engine's process, between its own steps: the fleet is not paused, the peer keeps generating;
3. the learner receives into buffers of its own, checks the digest of what arrived against the committed one, and
   loads it (it has no work to pause), resets its prefix cache and switches: it takes work from then on.

A refusal, a peer that does not answer within the heartbeat TTL, a failed transfer or a wrong digest: the learner
asks another peer at its next step (the one that failed is left alone for a heartbeat TTL). The trainer's next
sync may start meanwhile and wins: both ends take part in it as usual (its transfer uses other buffers, another
group and another thread), a peer's sending is unaffected by its own receive, and a catch-up that ends after the
learner loaded a newer version, or after another version was committed, is dropped unloaded. Nothing waits on
the other, so the two cannot deadlock.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable

from rollout_svc.config import Settings
from rollout_svc.errors import EngineDeadError
from rollout_svc.protocol import CatchUpAnswer, CatchUpOrder, TransferGroup, WeightManifest
from rollout_svc.weightsync.plane import WeightSyncPlane
from workers.engine import Engine
from workers.state import WorkerState

log = logging.getLogger("rollout_svc.worker")
SERVABLE = ("serving", "paused", "sleeping")  # labels of a peer that may serve (not starting, stale, draining)
MAX_SERVES = 2  # catch-ups one peer sends at once; it refuses more (the learner asks another)
GRACE_S = 5.0  # beyond a transfer's own timeouts, before it counts as failed


class PeerCatchUp:
    """Both sides of peer catch-up for one worker: `learn` (it is stale), `serve_orders` (it may be a peer).

    `held`: the manifest of the version this worker's engine holds as received (set by the weight receiver after a
    load from a transfer, cleared when it loads a checkpoint or starts receiving another). `load(version, manifest)`
    loads what `receive_from_peer` got, as the weight receiver does: "ok", or why not.
    """

    def __init__(
        self,
        settings: Settings,
        plane: WeightSyncPlane,
        engine: Engine,
        state: WorkerState,
        host: str,
        load: Callable[[int], Awaitable[str]],
    ) -> None:
        self.settings, self.plane, self.engine, self.state, self.host = settings, plane, engine, state, host
        self._load = load
        self.held: WeightManifest | None = None
        self._learning: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._answered: dict[str, float] = {}  # catch-up ids this worker answered, with when (monotonic)
        self._avoid: dict[str, float] = {}  # peers that failed a catch-up, until when (monotonic)
        self._no_peer: int | None = None  # the version for which "no peer" was logged
        self._dead: EngineDeadError | None = None  # met by a background catch-up or send
        self.caught_up = 0  # catch-ups this worker loaded

    @property
    def ttl_s(self) -> float:
        return float(self.settings.heartbeat_ttl_s)

    def check(self) -> None:
        """Re-raise an `EngineDeadError` a background catch-up or send met (the worker then stops)."""
        if self._dead is not None:
            raise self._dead

    async def close(self) -> None:
        for task in [self._learning, *self._serving]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    # --- the learner's side -----------------------------------------------------------------------------------

    def learn(self, version: int, digest: str) -> None:
        """Catch up to the committed `version` (whose digest is `digest`) in the background, unless already at it."""
        if self._learning is None or self._learning.done():
            self._learning = asyncio.create_task(self._learn(version, digest), name="catch-up")

    async def _learn(self, version: int, digest: str) -> None:
        try:
            await self._catch_up(version, digest)
        except EngineDeadError as exc:
            self._dead = exc
        except Exception as exc:  # Redis away, say: the next step tries again
            log.warning("catching up to weight version %d failed: %s", version, exc)

    async def _catch_up(self, version: int, digest: str) -> None:
        peer = await self._pick_peer(version)
        if peer is None:
            if self._no_peer != version:
                self._no_peer = version
                log.warning("weight version %d: no live peer holds it to catch up from; stale until one does", version)
            return
        # torch, imported in a thread: loading it holds the GIL for seconds, which would stall the heartbeat
        transfer = await asyncio.to_thread(importlib.import_module, "rollout_svc.weightsync.transfer")
        catch_up_id, worker_id = uuid.uuid4().hex, self.state.worker_id
        timeout_s = self.settings.weight_sync.weight_sync_timeout_s
        store = await asyncio.to_thread(transfer.open_store, self.host, 1 + self.engine.weight_ranks, self.ttl_s)
        group = TransferGroup(
            group_id=catch_up_id,
            master_addr=self.host,
            master_port=int(store.port),
            token=secrets.token_hex(16),
            world_size=1 + self.engine.weight_ranks,
            timeout_s=timeout_s,
            join_timeout_s=self.ttl_s,
            ranks={peer: 0, worker_id: 1},
        )
        started = time.monotonic()
        order = CatchUpOrder(catch_up_id=catch_up_id, version=version, learner=worker_id, peer=peer, group=group)
        await self.plane.order_catch_up(order)
        try:
            why, manifest = await self._receive(order, digest)
        finally:
            await self.plane.end_catch_up(worker_id)
            del store
        if why or manifest is None:
            self._avoid[peer] = time.monotonic() + self.ttl_s
            log.warning("catching up to weight version %d from %s failed: %s; asking another peer", version, peer, why)
            return
        outcome = await self._load(version)
        if outcome == "ok":
            self.held, self.caught_up = manifest, self.caught_up + 1
            log.info("caught up to weight version %d from %s in %.2f s", version, peer, time.monotonic() - started)
        elif outcome:
            log.warning("weight version %d came from %s but was not loaded: %s", version, peer, outcome)
        else:  # a sync brought this worker to it, or past it, while it came: the trainer's sync wins
            log.info("weight version %d came from %s after a sync had loaded it or a newer one: dropped", version, peer)

    async def _receive(self, order: CatchUpOrder, digest: str) -> tuple[str, WeightManifest | None]:
        """Wait for the peer's answer and receive what it sends: ("", its manifest) once received with the right
        digest, else (why not, None)."""
        answer = await self.plane.catch_up_answer(order.catch_up_id, self.ttl_s)
        if answer is None:
            return "it did not answer", None
        if answer.refused or answer.manifest is None:
            return f"it refused: {answer.refused}", None
        if answer.manifest.version != order.version:
            return f"it offered version {answer.manifest.version}", None
        receive = self.engine.receive_from_peer(order.group, 1, self.host, answer.manifest)
        try:
            got = await asyncio.wait_for(receive, order.group.timeout_s + self.ttl_s + GRACE_S)
        except EngineDeadError:
            raise
        except Exception as exc:
            return f"the transfer failed: {type(exc).__name__}: {exc}", None
        if got != digest:
            return f"what arrived has digest {got}, the committed version's is {digest}: dropped", None
        return "", answer.manifest

    async def _pick_peer(self, version: int) -> str | None:
        """The least loaded live peer of this model that serves `version` (None: none)."""
        now = time.monotonic()
        self._avoid = {w: until for w, until in self._avoid.items() if until > now}
        registry = self.plane.registry
        statuses = await registry.statuses(await registry.live_ids())
        peers = [
            s
            for w, s in statuses.items()
            if s is not None
            and w != self.state.worker_id
            and w not in self._avoid
            and s.state in SERVABLE
            and s.weight_version == version
            and s.model == self.engine.model_name
        ]
        if not peers:
            return None
        return min(peers, key=lambda s: (s.in_flight / max(1, s.capacity), s.worker_id)).worker_id

    # --- the peer's side --------------------------------------------------------------------------------------

    async def serve_orders(self) -> None:
        """Answer the catch-up orders naming this worker, and start sending where it can."""
        now = time.monotonic()
        self._answered = {c: at for c, at in self._answered.items() if now - at < 4 * self.ttl_s}
        for order in await self.plane.catch_up_orders():
            if order.peer != self.state.worker_id or order.catch_up_id in self._answered:
                continue
            if time.time() - order.issued_at > 2 * self.ttl_s:
                continue  # its learner gave up on it (it waits one TTL for the answer)
            self._answered[order.catch_up_id] = now
            why = self._refusal(order.version)
            answer = CatchUpAnswer(catch_up_id=order.catch_up_id, manifest=None if why else self.held, refused=why)
            await self.plane.answer_catch_up(answer)
            if why:
                log.info("catch-up of %s to version %d refused: %s", order.learner, order.version, why)
                continue
            task = asyncio.create_task(self._send(order), name="catch-up-send")
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    def _refusal(self, version: int) -> str:
        if self.state.weight_version != version:
            return f"this worker serves version {self.state.weight_version}"
        if self.held is None or self.held.version != version:
            return f"this worker holds no transferred copy of version {version} (a checkpoint's, or a newer receive)"
        if len(self._serving) >= MAX_SERVES:
            return f"this worker is sending {len(self._serving)} catch-ups already"
        return ""

    async def _send(self, order: CatchUpOrder) -> None:
        try:
            send = self.engine.serve_weights(order.group, self.host)
            sent = await asyncio.wait_for(send, order.group.timeout_s + self.ttl_s + GRACE_S)
        except EngineDeadError as exc:
            self._dead = exc
            return
        except Exception as exc:
            log.warning("sending weight version %d to %s failed: %s", order.version, order.learner, exc)
            return
        log.info("sent weight version %d to %s in %.2f s", order.version, order.learner, sent["send_s"])
