"""Weight transfer's tensor code, shared by both ends: buckets, the transfer process group, the receiving end.

Imports torch. The trainer's side (`client.weight_sender.WeightSender`) packs and broadcasts; the receiving end
(`ReceivingEnd`) lives in vLLM's worker process (`workers.weight_extension`) or in the echo engine. A bucket is one
uint8 tensor holding several tensors' raw bytes at aligned offsets, as a `WeightManifest` describes them.
"""

from __future__ import annotations

import datetime
import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy
import torch

from rollout_svc.errors import ProtocolError
from rollout_svc.protocol import TensorSpec, TransferGroup, WeightManifest

ALIGN_BYTES = 64  # every tensor starts at a multiple of this inside its bucket (any dtype's view is aligned)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` ("float32", "bfloat16", ...). Raises `ProtocolError` for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ProtocolError(f"unknown tensor dtype {name!r} in a weight manifest")
    return dtype


def plan_buckets(
    tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> tuple[list[list[TensorSpec]], list[int]]:
    """Pack tensors, in order, into buckets of at most `bucket_bytes` bytes (a larger tensor gets one of its own).

    Returns each bucket's tensor specs and its size in bytes. Offsets are aligned to `ALIGN_BYTES`.
    """
    buckets: list[list[TensorSpec]] = [[]]
    sizes = [0]
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        offset = -(-sizes[-1] // ALIGN_BYTES) * ALIGN_BYTES
        if buckets[-1] and offset + nbytes > bucket_bytes:
            buckets.append([])
            sizes.append(0)
            offset = 0
        spec = TensorSpec(
            name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), offset=offset, nbytes=nbytes
        )
        buckets[-1].append(spec)
        sizes[-1] = offset + nbytes
    if not buckets[-1]:
        buckets.pop()
        sizes.pop()
    return buckets, sizes


def fill_into(buffer: torch.Tensor, specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Write the tensors' raw bytes at their offsets into `buffer` (uint8); returns it.

    On the CPU each tensor is copied by one thread (numpy's memcpy), not by torch's intra-op (OpenMP) pool: the pack
    runs in a worker thread while the fleet generates, and the first parallel region of a thread starts an OpenMP
    team on cores the engines keep busy. Measured here (2 cores, SmolLM2's 538 MB): beside two busy torch
    processes, torch's copy from a fresh thread 1.7 s (0.06 s once warm), numpy's 0.09 s; in a sync beside two
    generating vLLM workers the pack took 4-7 s with torch's copy, 0.1 s with this."""
    cpu = buffer.device.type == "cpu"
    out = buffer.numpy() if cpu else None
    for spec, tensor in zip(specs, tensors, strict=True):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if out is not None and raw.device.type == "cpu":
            out[spec.offset : spec.offset + spec.nbytes] = raw.numpy()
        else:
            buffer[spec.offset : spec.offset + spec.nbytes].copy_(raw)
    return buffer


def unpack_bucket(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """The tensors a received bucket holds, as views of `buffer` (named, typed and shaped by the manifest)."""
    out = []
    for spec in specs:
        raw = buffer[spec.offset : spec.offset + spec.nbytes]
        out.append((spec.name, raw.view(torch_dtype(spec.dtype)).reshape(spec.shape)))
    return out


# --- the transfer group ---------------------------------------------------------------------------------------


def open_store(host: str, world_size: int, timeout_s: float) -> Any:
    """The trainer's rendezvous: a `TCPStore` listening on a fresh port of `host` (read it from `.port`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return torch.distributed.TCPStore(host, 0, world_size, True, timeout=timeout, wait_for_workers=False)


def join_group(spec: TransferGroup, rank: int, host: str, store: Any = None) -> Any:
    """Join the transfer group as `rank` (blocks until every rank has; at most `spec.join_timeout_s`, else
    `spec.timeout_s`; the group's collectives then time out after `spec.timeout_s`).

    `host`: this process's own address (gloo binds there). `store`: the trainer passes the one it opened; the
    other ranks connect to `spec.master_addr:spec.master_port`. Returns the process group (its `broadcast`).
    Raises what torch raises when a peer does not come (a `DistStoreError` or `RuntimeError` naming a timeout).
    """
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    joining = datetime.timedelta(seconds=spec.join_timeout_s or spec.timeout_s)
    dist: Any = torch.distributed
    if store is None:
        store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False, timeout=joining)
    prefixed = dist.PrefixStore(f"rollout-svc/{spec.token}/", store)
    if spec.backend == "nccl":  # NCCL connects at its first collective: one timeout for both
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = joining  # gloo connects the full mesh here, within this
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    group = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, options)
    group.set_timeout(timeout)  # the collectives' own
    return group


class BucketBuffers:
    """Bucket buffers kept from one sync to the next (same sizes: the same model), on the CPU only: up to `KEPT`
    sets, so a receiver writes a new version into one while the other holds the version its engine loaded (which a
    failed receive must not destroy: late peers catch up from it).

    A fresh buffer costs a page fault per 4 KiB page on first write, which on a small host took longer than the
    transfer itself; a kept one costs nothing. On a GPU the caching allocator already reuses memory, and keeping a
    second copy of the model there would be a waste, so CUDA buffers are never kept.
    """

    KEPT = 2

    def __init__(self) -> None:
        self._sizes: list[int] = []
        self._sets: list[list[torch.Tensor]] = []

    def get(
        self, sizes: Sequence[int], device: torch.device, avoid: Sequence[list[torch.Tensor]] = ()
    ) -> list[torch.Tensor]:
        """Buffers of `sizes` bytes on `device`: a kept set that is none of `avoid` (the sets in use: held, or lent
        to a sender), or new ones (CUDA; other sizes; every kept set in use: then not kept)."""
        if device.type != "cpu":
            return [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        if list(sizes) != self._sizes:
            self._sets, self._sizes = [], list(sizes)  # freed before the new ones are made, unless in use
        for kept in self._sets:
            if not any(kept is used for used in avoid):
                return kept
        buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        if len(self._sets) < self.KEPT:
            self._sets.append(buffers)
        return buffers


def receive_buckets(
    group: Any, manifest: WeightManifest, targets: Sequence[torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Receive every bucket of `manifest` from rank 0 into `targets` (one broadcast each); the named tensors, in
    order, as views of the targets."""
    tensors: list[tuple[str, torch.Tensor]] = []
    for buffer, specs in zip(targets, manifest.buckets, strict=True):
        group.broadcast(buffer, 0).wait()
        tensors += unpack_bucket(buffer, specs)
    return tensors


def receive_device(backend: str) -> torch.device:
    """Where a receiver puts what it receives: its CUDA device for NCCL, the CPU for gloo."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


DIGEST_BLOCK_BYTES = 4096


def weights_digest(buckets: Sequence[torch.Tensor]) -> str:
    """The digest of a version as sent: its buckets (uint8 tensors, in order, on any device) -> 32 hex digits.

    BLAKE2b-128 over, per bucket, its size and the wrapping 64-bit sums of its 4 KiB blocks (the tail as bytes).
    The sums are computed where the buckets are, in one pass at memory bandwidth (on the CPU by numpy in one thread,
    as `fill_into` copies: 20 ms for 540 MB, 50 ms beside two busy processes where torch's took 90 ms; on a GPU by
    torch; a byte hash of the same took 350-700 ms), and integer sums are the same on a CPU and a GPU. It catches a
    corrupt, short or mixed-up transfer (another version, blocks out of order); it is not a cryptographic hash of
    the bytes (whoever can forge a bucket in the token-gated transfer group could forge a matching one).
    """
    digest = hashlib.blake2b(digest_size=16)
    for bucket in buckets:
        flat = bucket.reshape(-1)
        whole = flat.numel() // DIGEST_BLOCK_BYTES * DIGEST_BLOCK_BYTES
        digest.update(flat.numel().to_bytes(8, "little"))
        if whole and flat.device.type == "cpu":  # one thread, as `fill_into` copies: no OpenMP team to start
            blocks_np = flat[:whole].numpy()
            if blocks_np.ctypes.data % 8:
                blocks_np = blocks_np.copy()  # an int64 view needs 8-byte alignment
            per_block = blocks_np.view(numpy.int64).reshape(-1, DIGEST_BLOCK_BYTES // 8)
            digest.update(per_block.sum(axis=1, dtype=numpy.int64).tobytes())  # wraps as torch's int64 sum does
        elif whole:
            blocks = flat[:whole]
            if blocks.storage_offset() % 8:
                blocks = blocks.clone()  # an int64 view needs 8-byte alignment
            sums = blocks.view(torch.int64).view(-1, DIGEST_BLOCK_BYTES // 8).sum(dim=1)
            digest.update(sums.cpu().numpy().tobytes())
        digest.update(flat[whole:].cpu().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Held:
    """A version's buckets as received, on the CPU, with the manifest that describes them and their digest."""

    manifest: WeightManifest
    buckets: list[torch.Tensor]
    digest: str
    pooled: bool = True  # in kept bucket buffers (a CPU receive); False: a host copy of CUDA buffers, made for it


class ReceivingEnd:
    """A receiver's side of the transfer: the group it is in, bucket buffers kept between syncs, and the buckets of
    the version its engine loaded last (`held`), which it can send to a late peer (`serve`).

    Used by vLLM's worker process (`workers.weight_extension`) and by the echo engine. A failed receive leaves the
    group (a failed collective leaves it unusable: the trainer builds a new one). On CUDA, what it received is also
    copied to the host, once every bucket arrived (outside the pause; host memory the size of the model): that copy is
    what a late peer gets.
    """

    def __init__(self) -> None:
        self.group: Any = None
        self.backend = "gloo"
        self._buffers = BucketBuffers()
        self._lock = threading.Lock()  # a receive and a serve run in threads of their own
        self._lent: list[list[torch.Tensor]] = []  # the buckets of the serves in progress
        self.received: Held | None = None  # the last complete receive
        self.held: Held | None = None  # the last receive the engine loaded
        # The one it had loaded before `held`, until a receive takes its buffers: loaded again if `held`, received
        # for a sync whose trainer died before committing it, is never committed.
        self.previous: Held | None = None

    def join(self, spec: TransferGroup, rank: int, host: str) -> None:
        """Join the group `spec` as `rank` (blocks until every rank has; at most the spec's timeout)."""
        self.group = None
        self.group = join_group(spec, rank, host)
        self.backend = spec.backend

    def leave(self) -> None:
        self.group = None

    def receive(self, manifest: WeightManifest) -> list[tuple[str, torch.Tensor]]:
        """Every announced tensor, received from rank 0 (views of kept buffers, valid until a later receive), into
        buffers other than the held version's and those being sent: what is held survives, a failed receive too.
        Raises `RuntimeError` outside a group, and what torch raises when a collective fails."""
        if self.group is None:
            raise RuntimeError("not in a weight transfer group: join one first")
        device = receive_device(self.backend)
        with self._lock:
            in_use = [*self._lent, *([self.held.buckets] if self.held is not None else [])]
            targets = self._buffers.get(manifest.bucket_nbytes, device, avoid=in_use)
            self.received = None
            if self.previous is not None and self.previous.buckets is targets:
                self.previous = None
        try:
            tensors = receive_buckets(self.group, manifest, targets)
        except Exception:
            self.group = None
            raise
        kept = targets if device.type == "cpu" else [b.cpu() for b in targets]
        self.received = Held(manifest, kept, weights_digest(kept), pooled=device.type == "cpu")
        return tensors

    def catch_up(self, spec: TransferGroup, rank: int, host: str, manifest: WeightManifest) -> list[tuple[str, Any]]:
        """Join a late worker's group `spec` as `rank`, receive `manifest` from its peer (rank 0), leave. The tensors
        (`received.digest` says what arrived); raises what `join` and `receive` raise."""
        self.join(spec, rank, host)
        try:
            return self.receive(manifest)
        finally:
            self.leave()

    def hold(self) -> None:
        """The engine loaded what this end received last: keep it to serve (until a receive overwrites it); what
        was held before becomes `previous`."""
        with self._lock:
            if self.received is not self.held:
                # kept only in the pooled buffers, which cost nothing more; a CUDA receive's host copy would be a
                # second copy of the model in host memory for as long as no sync comes
                self.previous = self.held if self.held is not None and self.held.pooled else None
            self.held = self.received

    def restore_previous(self) -> None:
        """The engine loaded `previous` again (`held` was never committed): it is held once more, to serve."""
        with self._lock:
            if self.previous is None:
                raise RuntimeError("no previous received version is kept here")
            self.held, self.previous = self.previous, None

    def held_tensors(self, which: Literal["held", "previous"] = "held") -> list[tuple[str, torch.Tensor]]:
        """The held (or previous) version's tensors (views of its buckets), to load it again: after the engine
        loaded a version that was never committed. Raises `RuntimeError` if there is none (or a receive overwrote
        it)."""
        held = self.held if which == "held" else self.previous
        if held is None:
            raise RuntimeError(
                f"no {'' if which == 'held' else 'previous '}received version is held here to load again"
            )
        tensors: list[tuple[str, torch.Tensor]] = []
        for bucket, specs in zip(held.buckets, held.manifest.buckets, strict=True):
            tensors += unpack_bucket(bucket, specs)
        return tensors

    def serve(self, spec: TransferGroup, host: str) -> float:
        """Send the held version to the other ranks of `spec`, as its rank 0 (over gloo: what is held is on the
        CPU): join, one broadcast per bucket. Blocks (run it in a thread); a receive meanwhile gets other buffers, so
        what is sent stays whole. Returns seconds sending. Raises `RuntimeError` if nothing is held, and what torch
        raises when a peer does not come or goes."""
        with self._lock:
            held = self.held
            if held is None:
                raise RuntimeError("no loaded weights are held here to send")
            self._lent.append(held.buckets)
        try:
            group = join_group(spec, 0, host)
            started = time.perf_counter()
            for bucket in held.buckets:
                group.broadcast(bucket, 0).wait()
            return time.perf_counter() - started
        finally:
            with self._lock:
                self._lent = [lent for lent in self._lent if lent is not held.buckets]


class LoadedFrom:
    """Which receiving end's version an engine loaded, for the engines that load from `ReceivingEnd`s (vLLM's worker
    extension, the echo engine): `loaded`, whose held version the engine serves (None after a checkpoint or vLLM's
    own transfer: nothing to send a late peer); `held_end`, the end loaded last (kept across a checkpoint, to load
    its version again if the checkpoint is never committed); and the version loaded before that one (an end and its
    `Held`), to load again if the last received version is never committed.
    """

    def __init__(self) -> None:
        self.loaded: ReceivingEnd | None = None
        self.held_end: ReceivingEnd | None = None
        self._before: tuple[ReceivingEnd, Held] | None = None

    def again(self, which: Literal["held", "previous"]) -> tuple[ReceivingEnd, list[tuple[str, torch.Tensor]]]:
        """The end and tensors to load again: `held`, the version loaded last from a transfer; `previous`, the one
        loaded before it. Raises `RuntimeError` if none is kept (a receive since took its buffers)."""
        if which == "held":
            if self.held_end is None:
                raise RuntimeError("no received version is held here to load again")
            return self.held_end, self.held_end.held_tensors()
        end, before = self._before or (None, None)
        if end is None or before is None or not (end.held is before or end.previous is before):
            raise RuntimeError("no previous received version is kept here to load again")
        return end, end.held_tensors("held" if end.held is before else "previous")

    def switched(self, end: ReceivingEnd, source: str) -> None:
        """The engine loaded from `end`: again (`source` held, previous), or what it received (any other source)."""
        if source == "previous":
            if self._before is not None and end.previous is self._before[1]:
                end.restore_previous()
            self._before = None
        elif source != "held":
            prior = self.loaded
            self._before = (prior, prior.held) if prior is not None and prior.held is not None else None
            end.hold()
            if prior is end and end.previous is None:
                self._before = None  # a CUDA receive: the version before is not kept
        self.loaded = self.held_end = end

    def checkpoint_loaded(self) -> None:
        """The engine loaded a checkpoint (or vLLM's own transfer): no received version is loaded now."""
        self.loaded = None
