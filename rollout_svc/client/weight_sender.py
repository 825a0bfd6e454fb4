"""Weight sync, the trainer's side: `WeightSender` (the tensor code both ends share: `weightsync.transfer`).
Imports torch at its first broadcast only: importing it, and a sync from a checkpoint (`update_from_checkpoint`, the
admin route), need none.

A broadcast sync (DESIGN.md section 5, with the transfer moved out of the pause): publish the sync order -> barrier
`joined` -> announce the tensors -> transfer, the workers generating on their old weights meanwhile and keeping what
they receive -> barrier `received` -> pause the fleet (keep or abort, the trainer's choice) -> the load order ->
workers load and reset their prefix cache -> barrier `loaded` -> commit the version in the state hash -> resume.
`pause_during_transfer=True` pauses first instead, as before; a checkpoint sync pauses first (its load is its
transfer). The transfer is a `torch.distributed` process group
made for it alone from a `TCPStore` (never the default group): gloo for CPU tensors, NCCL for CUDA ones, one code
path. Rank 0 is the trainer; each worker takes as many ranks as its engine has (TP x PP), assigned here and
published in Redis. The group is built once and reused; it is rebuilt when the live workers change, and after a
failed collective. Each build listens on a fresh port behind a one-time token (the store's key prefix) that only
readers of Redis know: `TCPStore` and gloo are unauthenticated.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rollout_svc import tracing
from rollout_svc.config import Settings
from rollout_svc.control import commands
from rollout_svc.errors import InvalidRequestError, WeightSyncError
from rollout_svc.fleet import Fleet, FleetControl, FleetWeightPlane
from rollout_svc.keys import JOINED, LOADED, RECEIVED
from rollout_svc.protocol import PauseMode, TensorSpec, TransferGroup, WeightManifest, WeightSyncOrder
from rollout_svc.weightsync.plane import SYNC_HOLDER, BarrierOutcome, advertise_address

if TYPE_CHECKING:
    import torch

    from rollout_svc.weightsync.transfer import BucketBuffers

log = logging.getLogger("rollout_svc.client.weight_sender")
MAX_ATTEMPTS = 3  # a sync whose group failed is retried with the members still alive, this many times in all


@dataclass
class SyncReport:
    """What one sync did. Times in seconds; `transfer_s` runs from the first bucket to the last (its GB/s is
    `bytes / transfer_s / 1e9`), `pause_s` is the pause command, `paused_s` how long the fleet was paused (from the
    pause command to the resume's acknowledgements), `join_s` the join barrier (building the group if it changed),
    `pack_s` packing the buckets, `load_s` the wait for every load and prefix-cache reset after the transfer (after
    the load order, for a transfer outside the pause), `total_s` the whole `update` call. `loaded`: workers now
    serving `version`; `stale`: live workers that failed (with why; they take no work until a later sync includes
    them); `dead`: left out, dead. `paused_during_transfer`: the fleet was paused before the transfer. `digest`:
    a broadcast version's digest (`weightsync.transfer.weights_digest`), committed with it: a worker that catches
    up from a peer checks what it got against it. `ranks`: the broadcast's receiving ranks (each worker's tensor x
    pipeline x data parallel size, summed; the transfer group is these and the trainer's rank 0)."""

    version: int
    transport: Literal["broadcast", "checkpoint"]
    loaded: list[str]
    stale: dict[str, str] = field(default_factory=dict)
    dead: list[str] = field(default_factory=list)
    bytes: int = 0
    buckets: int = 0
    pause_s: float = 0.0
    paused_s: float = 0.0
    join_s: float = 0.0
    pack_s: float = 0.0
    transfer_s: float = 0.0
    load_s: float = 0.0
    total_s: float = 0.0
    attempts: int = 1
    group_rebuilt: bool = False
    paused_during_transfer: bool = False
    digest: str = ""
    ranks: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


@dataclass
class _Group:
    spec: TransferGroup
    members: dict[str, int]  # worker id -> its rank count
    process_group: Any


class WeightSender:
    """Pushes new weights from a torch training loop into every rollout worker, and commits their version.

    Example::

        sender = WeightSender(redis_url="redis://127.0.0.1:6379/0")
        await sender.init()
        report = await sender.update(model.named_parameters(), version=step + 1)   # pause, send, load, resume
        await sender.update_from_checkpoint("/ckpts/step-7", version=8)             # holds model.safetensors
        await sender.close()

    Nothing needs calling on the workers: they follow the orders in Redis. `update` raises `InvalidRequestError`
    for a version not above the committed one, `WeightSyncError` if no live worker loaded the weights (the old
    version stays committed) and `ControlTimeoutError` if the fleet did not pause. Workers that failed are named
    in the returned `SyncReport` (`stale`): they take no work until a later sync includes them.

    `bucket_bytes` (default `Settings.weight_sync.weight_bucket_bytes`) sizes the broadcasts; `timeout_s` (default
    `Settings.weight_sync.weight_sync_timeout_s`) bounds each barrier and collective.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        settings: Settings | None = None,
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        settings = settings or Settings()
        if redis_url is not None:
            settings = settings.copy_with(redis_url=redis_url)
        self.settings = settings
        self.bucket_bytes = bucket_bytes or settings.weight_sync.weight_bucket_bytes
        self.timeout_s = timeout_s or settings.weight_sync.weight_sync_timeout_s
        self._fleet: Fleet | None = None  # the shards, once connected
        self._group: _Group | None = None
        self._lock: asyncio.Lock | None = None
        self._buffers: BucketBuffers | None = None  # made at the first broadcast (torch is imported there)

    async def __aenter__(self) -> WeightSender:
        await self.init()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def init(self) -> None:
        """Connect to Redis (idempotent). Workers need no matching call: the group is built at the first update."""
        if self._fleet is not None:
            return
        fleet = Fleet(self.settings)
        await fleet.refresh()  # every shard: the order, the barriers and the commit reach each one
        self.control = FleetControl(fleet)
        self.plane = FleetWeightPlane(fleet)
        self._fleet = fleet
        self._lock = asyncio.Lock()

    async def committed_version(self) -> int:
        """The fleet's committed weight version (0 before the first sync)."""
        await self.init()
        return (await self.control.state()).weight_version

    async def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        pause_mode: PauseMode = "keep",
        *,
        pause_during_transfer: bool = False,
    ) -> SyncReport:
        """Broadcast `named_tensors` (names as in the model's checkpoint; any dtype; CPU or CUDA) as `version`.

        The workers receive while they go on generating with the old weights; the fleet pauses only for the load.
        `pause_mode` keep freezes in-flight requests during the load (they go on afterwards, and their
        `weight_versions` record the switch); abort cuts them (the client resubmits them token-exact).
        `pause_during_transfer=True`: pause before the transfer (the workers hold no second copy of the weights while
        they generate; the fleet is paused for the whole transfer).
        """
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not tensors:
            raise InvalidRequestError("update() got no tensors; pass model.named_parameters() or a state dict's items")
        return await self._sync(version, pause_mode, tensors=tensors, staged=not pause_during_transfer)

    async def update_from_checkpoint(
        self, path: str, version: int, pause_mode: PauseMode = "keep", *, stable_wait_s: float | None = None
    ) -> SyncReport:
        """Make every worker load the checkpoint at `path` (a directory holding `model.safetensors`, or Hugging
        Face's shards with their `model.safetensors.index.json`, under the workers' `checkpoint_root`) as `version`.
        Workers refuse a path outside their root. `stable_wait_s`: each worker waits up to that for the folder's
        `STABLE` marker (prime-rl's trainer writes it last) and refuses the folder without it; it must be shorter
        than this sender's `timeout_s`, which bounds the load. Raises `InvalidRequestError` otherwise."""
        if stable_wait_s is not None and not 0 <= stable_wait_s < self.timeout_s:
            raise InvalidRequestError(
                f"stable_wait_s must be >= 0 and under the sync timeout ({self.timeout_s:g} s), got {stable_wait_s}"
            )
        return await self._sync(version, pause_mode, path=str(path), stable_wait_s=stable_wait_s)

    async def close(self) -> None:
        """Leave the transfer group and disconnect. The committed version stays."""
        self._group = None
        if self._fleet is not None:
            await self.control.close()
            await self._fleet.close()
            self._fleet = None

    # --- one sync ------------------------------------------------------------------------------------------

    async def _sync(
        self,
        version: int,
        pause_mode: PauseMode,
        tensors: list[tuple[str, torch.Tensor]] | None = None,
        path: str | None = None,
        staged: bool = False,
        stable_wait_s: float | None = None,
    ) -> SyncReport:
        await self.init()
        assert self._lock is not None
        transport = "broadcast" if tensors is not None else "checkpoint"
        async with self._lock:
            with tracing.span("rollout.weight_sync", **{"rollout.transport": transport}) as span:
                return await self._synced(span, version, pause_mode, tensors, path, staged, stable_wait_s)

    async def _synced(
        self,
        span: Any,
        version: int,
        pause_mode: PauseMode,
        tensors: list[tuple[str, torch.Tensor]] | None,
        path: str | None,
        staged: bool,
        stable_wait_s: float | None,
    ) -> SyncReport:
        """One sync, under the sender's lock, traced by `span` (None: untraced)."""
        started = time.monotonic()
        version = await self.control.next_weight_version(version)
        if span is not None:
            span.set_attribute("rollout.weight_version", version)
        pause = _Pause(self.control, pause_mode, self.settings.client.pause_lease_s, self.timeout_s)
        try:
            if not staged:
                await pause.hold()
            if tensors is not None:
                report = await self._broadcast(version, tensors, pause if staged else None)
            else:
                assert path is not None
                report = await self._checkpoint(version, path, stable_wait_s)
            if not report.loaded:
                failed = {**report.stale, **dict.fromkeys(report.dead, "dead")}
                raise WeightSyncError(version, "no worker loaded the weights; the old version stays committed", failed)
            if (lapsed := await pause.lapsed()) is not None:
                failed = dict.fromkeys(report.loaded, "loaded, not committed: stale until the next sync")
                raise WeightSyncError(version, f"not committed: {lapsed}; the old version stays committed", failed)
            await self.control.commit_weights(version, path or "", report.digest)
        finally:
            await pause.release()
        report.pause_s, report.paused_s, report.total_s = pause.pause_s, pause.paused_s, time.monotonic() - started
        report.paused_during_transfer = not staged
        if report.stale or report.dead:
            log.warning("weight version %d: stale %s, dead %s", version, report.stale or "none", report.dead or "none")
        return report

    async def _members(self) -> dict[str, int]:
        """The live workers that can take part, with their rank counts."""
        statuses = await self.control.registry.statuses(await self.control.registry.live_ids())
        return {w: s.weight_ranks for w, s in statuses.items() if s is not None and s.state != "draining"}

    async def _checkpoint(self, version: int, path: str, stable_wait_s: float | None) -> SyncReport:
        members = sorted(await self._members())
        if not members:
            raise WeightSyncError(version, "no live worker")
        sync_id = f"v{version}-{uuid.uuid4().hex[:8]}"
        order = WeightSyncOrder(
            sync_id=sync_id,
            version=version,
            transport="checkpoint",
            members=members,
            path=path,
            stable_wait_s=stable_wait_s,
        )
        await self.plane.publish(order)
        started = time.monotonic()
        outcome = await self.plane.await_barrier(sync_id, LOADED, members, self.timeout_s)
        report = _report(version, "checkpoint", outcome)
        report.load_s = time.monotonic() - started
        return report

    async def _broadcast(
        self, version: int, tensors: list[tuple[str, torch.Tensor]], pause: _Pause | None
    ) -> SyncReport:
        """`pause`: the transfer runs outside the pause (a staged sync), which this holds once the workers received;
        None: the fleet is paused already."""
        from rollout_svc.weightsync.transfer import BucketBuffers, join_group, plan_buckets  # torch: a broadcast only

        if self._buffers is None:
            self._buffers = BucketBuffers()
        buckets, sizes = plan_buckets(tensors, self.bucket_bytes)
        lost: dict[str, str] = {}  # failed or died in an earlier attempt of this sync
        dead: list[str] = []
        for attempt in range(1, MAX_ATTEMPTS + 1):
            members = {w: n for w, n in (await self._members()).items() if w not in lost}
            if not members:
                # the workers that failed or died in earlier attempts say why (a CI run got this naming nobody)
                raise WeightSyncError(version, "no live worker to send to", lost | dict.fromkeys(dead, "dead"))
            sync_id = f"v{version}-{uuid.uuid4().hex[:8]}"
            started = time.monotonic()
            rebuilt = self._group is None or self._group.members != members
            if rebuilt:
                self._group = None
                backend: Literal["gloo", "nccl"] = "nccl" if tensors[0][1].is_cuda else "gloo"
                spec, store = await self._open_group(members, backend)
                group_task = asyncio.ensure_future(asyncio.to_thread(join_group, spec, 0, spec.master_addr, store))
            else:
                assert self._group is not None
                spec = self._group.spec
            names = sorted(members)
            order = WeightSyncOrder(
                sync_id=sync_id,
                version=version,
                transport="broadcast",
                members=names,
                group=spec,
                staged=pause is not None,
            )
            await self.plane.publish(order)
            joined = await self.plane.await_barrier(sync_id, JOINED, names, self.timeout_s)
            if rebuilt:
                try:
                    self._group = _Group(spec, dict(members), await group_task)
                except Exception as exc:  # a member did not come: rebuild without it
                    log.warning("building the weight transfer group failed (%s)", exc)
                    self._group = None
            dead += joined.dead
            # A member that died before joining fails every join with it (each waits for it, up to the join timeout,
            # the heartbeat TTL): the others, which answered, go on into the next attempt; only those that did not
            # answer at all are left out.
            collateral = set(joined.arrived) if joined.dead and self._group is None else set()
            lost |= {
                w: f"did not join the transfer group: {why}"
                for w, why in joined.failures.items()
                if w not in joined.dead and w not in collateral
            }
            if self._group is None or joined.failures:
                self._group = None
                continue
            join_s = time.monotonic() - started
            manifest = WeightManifest(sync_id=sync_id, version=version, bucket_nbytes=sizes, buckets=buckets)
            await self.plane.announce(manifest)
            try:
                pack_s, transfer_s, digest = await asyncio.to_thread(
                    self._send, self._group, buckets, sizes, tensors, self._buffers
                )
            except Exception as exc:  # a peer died mid-transfer: the group is broken
                log.warning("weight transfer of version %d failed (%s); rebuilding the group", version, exc)
                self._group = None
                phase = LOADED if pause is None else RECEIVED
                outcome = await self.plane.await_barrier(sync_id, phase, names, min(self.timeout_s, 10.0))
                dead += outcome.dead
                continue
            failed: dict[str, str] = {}
            if pause is not None:  # every bucket went out while the fleet served: pause now, for the loads
                received = await self.plane.await_barrier(sync_id, RECEIVED, names, self.timeout_s)
                dead += received.dead
                failed = received.live_failures
                names = received.ok
                if names:
                    await pause.hold()
                    await self.plane.order_load(sync_id)
            loading = time.monotonic()
            outcome = await self.plane.await_barrier(sync_id, LOADED, names, self.timeout_s)
            report = _report(version, "broadcast", outcome)
            report.stale |= lost | failed
            report.dead = sorted(set(report.dead) | set(dead))
            report.bytes, report.buckets = sum(sizes), len(sizes)
            report.join_s, report.pack_s, report.transfer_s = join_s, pack_s, transfer_s
            report.digest = digest
            report.ranks = sum(self._group.members.values()) if self._group is not None else 0
            report.load_s = time.monotonic() - loading
            report.attempts, report.group_rebuilt = attempt, rebuilt
            if outcome.dead or outcome.missing or failed:
                self._group = None  # its membership changed: the next sync builds a new one
            return report
        raise WeightSyncError(
            version, f"the transfer group failed {MAX_ATTEMPTS} times", lost | dict.fromkeys(dead, "dead")
        )

    async def _open_group(self, members: dict[str, int], backend: Literal["gloo", "nccl"]) -> tuple[TransferGroup, Any]:
        """A fresh rendezvous (new port, new token) for `members`, ranks assigned in worker-id order."""
        from rollout_svc.weightsync.transfer import open_store

        host = advertise_address(self.settings)
        world_size = 1 + sum(members.values())
        store = await asyncio.to_thread(open_store, host, world_size, self.timeout_s)
        ranks, next_rank = {}, 1
        for worker_id in sorted(members):
            ranks[worker_id], next_rank = next_rank, next_rank + members[worker_id]
        spec = TransferGroup(
            group_id=uuid.uuid4().hex,
            master_addr=host,
            master_port=int(store.port),
            token=secrets.token_hex(16),
            world_size=world_size,
            backend=backend,
            timeout_s=self.timeout_s,
            join_timeout_s=min(self.timeout_s, self.settings.heartbeat_ttl_s),
            ranks=ranks,
        )
        return spec, store

    @staticmethod
    def _send(
        group: _Group,
        buckets: list[list[TensorSpec]],
        sizes: list[int],
        tensors: list[tuple[str, torch.Tensor]],
        buffers: BucketBuffers,
    ) -> tuple[float, float, str]:
        """Pack, then broadcast every bucket from rank 0 (runs in a thread). Returns (seconds packing, seconds from
        the first bucket to the last, the digest of what was sent; computed after the last bucket went out, while
        the workers finish receiving). A bucket holding one contiguous tensor is sent from the tensor's own memory;
        the others are packed into buffers kept from the last sync (no page faults)."""
        import torch

        from rollout_svc.weightsync.transfer import fill_into, weights_digest

        started = time.perf_counter()
        device = tensors[0][1].device if group.spec.backend == "nccl" else torch.device("cpu")
        targets = buffers.get(sizes, device)
        by_position = iter(t for _, t in tensors)
        packed = []
        for specs, target in zip(buckets, targets, strict=True):
            held = [next(by_position) for _ in specs]
            if len(held) == 1 and held[0].is_contiguous() and held[0].device == device:
                packed.append(held[0].reshape(-1).view(torch.uint8))
            else:
                packed.append(fill_into(target, specs, held))
        sending = time.perf_counter()
        for buffer in packed:
            group.process_group.broadcast(buffer, 0).wait()
        sent = time.perf_counter()
        return sending - started, sent - sending, weights_digest(packed)


class _Pause:
    """A sync's pause (holder `weight-sync`, leased): held at most once (`hold`), released at most once (`release`),
    timed: `pause_s` the pause command, `paused_s` from it to the resume's acknowledgements."""

    def __init__(self, control: FleetControl, mode: PauseMode, lease_s: float, timeout_s: float) -> None:
        self.control, self.mode, self.lease_s, self.timeout_s = control, mode, lease_s, timeout_s
        self.held_at: float | None = None
        self.pause_s = self.paused_s = 0.0

    async def hold(self) -> None:
        if self.held_at is not None:
            return
        self.held_at = time.monotonic()
        command = commands.pause(self.mode, holder=SYNC_HOLDER, lease_s=self.lease_s)  # renewed while it is held
        await self.control.issue(command, timeout_s=self.timeout_s)
        self.pause_s = time.monotonic() - self.held_at

    async def lapsed(self) -> str | None:
        """None while the pause is held (renewed now), else why not (it lapsed: the fleet may have served)."""
        if self.held_at is None or self.lease_s <= 0:
            return None
        return await self.control.leases.check(SYNC_HOLDER)

    async def release(self) -> None:
        if self.held_at is None:
            return
        try:
            await self.control.issue(commands.resume(holder=SYNC_HOLDER), timeout_s=self.timeout_s)
        finally:
            self.paused_s, self.held_at = time.monotonic() - self.held_at, None


def _report(version: int, transport: Literal["broadcast", "checkpoint"], outcome: BarrierOutcome) -> SyncReport:
    stale = outcome.live_failures
    return SyncReport(version=version, transport=transport, loaded=outcome.ok, stale=stale, dead=list(outcome.dead))
