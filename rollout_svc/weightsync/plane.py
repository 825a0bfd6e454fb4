"""Weight sync's Redis side: the sync order, the tensor announcement and the barriers (no torch here).

A sync (DESIGN.md section 5) is coordinated in Redis, never over the transfer itself:

- the trainer publishes a `WeightSyncOrder` (`Keys.weight_sync`): its version, transport, members, and for a
  broadcast the transfer group (rank assignment, rendezvous address, one-time token);
- barrier `joined`: each member writes "ok" (or its error) once it is in the transfer group;
- the announcement: the trainer writes the `WeightManifest` (names, dtypes, shapes, buckets; msgpack);
- for a staged sync (`WeightSyncOrder.staged`, the transfer outside the pause), barrier `received`: each member
  writes "ok" once every bucket arrived (it keeps them, generating on its old weights meanwhile); the trainer then
  pauses the fleet and writes the load order (`Keys.weight_load`);
- barrier `loaded`: each member writes "ok" once it loaded the weights and reset its prefix cache, or the error
  it met (then it is `stale`).

Peer catch-up (`workers.catch_up`), without the trainer: a stale worker writes a `CatchUpOrder` naming a peer that
serves the committed version (`Keys.weight_catch_ups`); the peer answers (`CatchUpAnswer`: the manifest it sends,
or why not) and sends it over a transfer group of their own.

A barrier waits for every member with a timeout; a member whose heartbeat expires meanwhile is dropped as dead,
and the rest are named as missing. Every value is msgpack or a plain string: nothing is pickled.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from redis.asyncio import Redis

from rollout_svc.config import Settings
from rollout_svc.dataplane.registry import Registry
from rollout_svc.errors import InvalidRequestError, ProtocolError
from rollout_svc.keys import OK, Nudge
from rollout_svc.protocol import CatchUpAnswer, CatchUpOrder, WeightManifest, WeightSyncOrder, decode, encode

BARRIER_POLL_S = 0.02  # how often a barrier re-reads its hash (a sync takes seconds; this is noise)
LIVENESS_POLL_S = 0.5  # how often it checks that the members it waits for are alive
SYNC_KEYS_TTL_S = 3600  # barriers and manifests expire an hour after their sync
SYNC_HOLDER = "weight-sync"  # the pause holder of a sync (leased: it lapses if the trainer dies mid-sync)


@dataclass
class BarrierOutcome:
    """Who reached a barrier: `arrived` maps each member to "ok" or its error; `dead` lost its heartbeat on the
    way; `missing` were alive but did not arrive within the timeout."""

    arrived: dict[str, str] = field(default_factory=dict)
    dead: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> list[str]:
        return sorted(w for w, outcome in self.arrived.items() if outcome == OK)

    @property
    def live_failures(self) -> dict[str, str]:
        """The members that lived and did not reach the barrier in good order, with why (the dead left out)."""
        return {w: why for w, why in self.failures.items() if w not in self.dead}

    @property
    def failures(self) -> dict[str, str]:
        """Every member that did not reach the barrier in good order, with why."""
        failed = {w: outcome for w, outcome in self.arrived.items() if outcome != OK}
        failed |= dict.fromkeys(self.dead, "dead: its heartbeat expired during the sync")
        return failed | dict.fromkeys(self.missing, "did not reach the barrier in time")

    @classmethod
    def merge(cls, parts: Sequence[BarrierOutcome], dead: Sequence[str] = ()) -> BarrierOutcome:
        """One outcome of several shards' parts of a barrier; `dead`: members found in no shard."""
        merged = cls(dead=list(dead))
        for part in parts:
            merged.arrived |= part.arrived
            merged.dead += part.dead
            merged.missing += part.missing
        merged.dead.sort()
        merged.missing.sort()
        return merged


def advertise_address(settings: Settings) -> str:
    """The address peers reach this process at: `settings.weight_sync.advertise_addr`, else that of the interface which
    routes to Redis (a host that reaches Redis reaches the trainer the same way)."""
    if settings.weight_sync.advertise_addr:
        return settings.weight_sync.advertise_addr
    url = urlparse(settings.redis_url)
    host = url.hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, url.port or 6379))  # UDP: no packet is sent, the kernel only picks a route
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


SINGLE_FILE, SHARD_INDEX = "model.safetensors", "model.safetensors.index.json"  # Hugging Face's two layouts
STABLE_MARKER = "STABLE"  # prime-rl's trainer writes it into a checkpoint folder once every file is written
STABLE_POLL_S = 0.2


def checkpoint_folder(root: Path | None, path: str) -> Path:
    """The checkpoint directory `path` resolved (symlinks followed), if it lies under `root`, whatever it holds yet.
    Raises `InvalidRequestError` otherwise (or with no root)."""
    if root is None:
        raise InvalidRequestError(
            "this worker has no checkpoint root, so it loads no checkpoint: set ROLLOUT_CHECKPOINT_ROOT to the "
            "directory the trainer writes checkpoints under"
        )
    base = Path(root).resolve()
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(base):
        raise InvalidRequestError(f"checkpoint {path} is outside this worker's checkpoint root {base}: refused")
    return resolved


def checkpoint_dir(root: Path | None, path: str) -> Path:
    """`checkpoint_folder`, if it also holds its weights under `root`: `model.safetensors`, or Hugging Face's sharded
    layout (`model.safetensors.index.json` and every shard its `weight_map` names). Raises `InvalidRequestError`
    otherwise: a forged sync order cannot make a worker load arbitrary files."""
    resolved = checkpoint_folder(root, path)
    assert root is not None  # checkpoint_folder refuses a worker without one
    base = Path(root).resolve()
    for weights in checkpoint_files(resolved):
        if not weights.resolve().is_relative_to(base):
            raise InvalidRequestError(f"checkpoint {path} is outside this worker's checkpoint root {base}: refused")
        if not weights.is_file():
            raise InvalidRequestError(f"checkpoint {path} lacks {weights.name}, which its shard index names")
    return resolved


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of the checkpoint in `folder`, in order: `model.safetensors`, else the shards
    `model.safetensors.index.json` names (sorted). Raises `InvalidRequestError` if it holds neither, or a bad index."""
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    index = folder / SHARD_INDEX
    if not index.is_file():
        raise InvalidRequestError(f"checkpoint {folder} holds no {SINGLE_FILE} and no {SHARD_INDEX}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted({str(name) for name in weight_map.values()})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidRequestError(f'{index} is not a safetensors shard index ({{"weight_map": ...}}): {exc}') from exc
    if not shards or any("/" in name or name.startswith(".") for name in shards):
        raise InvalidRequestError(f"{index} names no shard, or one outside its folder")
    return [folder / name for name in shards]


async def await_stable(path: str, wait_s: float) -> None:
    """Return once `path` holds the `STABLE` marker (prime-rl's trainer writes it after the checkpoint), polling
    for up to `wait_s` seconds. Raises `InvalidRequestError` if it never appears: the folder may be half written."""
    marker = Path(path) / STABLE_MARKER
    deadline = time.monotonic() + wait_s
    while not await asyncio.to_thread(marker.is_file):
        if time.monotonic() >= deadline:
            raise InvalidRequestError(
                f"checkpoint {path} has no {STABLE_MARKER} marker after {wait_s:g} s: its trainer has not finished "
                "writing it (the old weights stay); retry once the marker is there, or sync without stable_wait_s"
            )
        await asyncio.sleep(STABLE_POLL_S)


class WeightSyncPlane:
    """The weight-sync keys' verbs, shared by the trainer (`client.weight_sender.WeightSender`) and the workers."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis, self.settings, self.keys = redis, settings, settings.keys
        self.registry = Registry(redis, self.keys, settings.heartbeat_ttl_s)

    # --- the trainer's side -----------------------------------------------------------------------------------

    async def publish(self, order: WeightSyncOrder) -> None:
        """Write the current sync order and nudge the workers."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.weight_sync, encode(order))
        pipe.publish(self.keys.weights_channel, Nudge.WEIGHT_ORDER)
        await pipe.execute()

    async def announce(self, manifest: WeightManifest) -> None:
        """The `announced` barrier: the tensors of a broadcast sync, written once every member joined."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.weight_manifest(manifest.sync_id), encode(manifest), ex=SYNC_KEYS_TTL_S)
        pipe.publish(self.keys.weights_channel, Nudge.WEIGHT_MANIFEST)
        await pipe.execute()

    async def order_load(self, sync_id: str) -> None:
        """A staged sync's load order: the fleet is paused, the members may load what they received."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.weight_load(sync_id), OK, ex=SYNC_KEYS_TTL_S)
        pipe.publish(self.keys.weights_channel, Nudge.WEIGHT_LOAD)
        await pipe.execute()

    async def await_barrier(self, sync_id: str, phase: str, members: Sequence[str], timeout_s: float) -> BarrierOutcome:
        """Wait until every member reached `phase` of `sync_id` or died, at most `timeout_s` seconds."""
        outcome = BarrierOutcome()
        waiting = set(members)
        deadline = time.monotonic() + timeout_s
        next_liveness = time.monotonic() + LIVENESS_POLL_S
        key = self.keys.weight_barrier(sync_id, phase)
        while waiting:
            arrived: Any = await self.redis.hgetall(key)
            for worker, value in arrived.items():
                worker_id = worker.decode()
                if worker_id in waiting:
                    outcome.arrived[worker_id] = value.decode()
                    waiting.discard(worker_id)
            if not waiting:
                break
            now = time.monotonic()
            if now >= next_liveness or now >= deadline:
                statuses = await self.registry.statuses(sorted(waiting))
                for worker_id, status in statuses.items():
                    if status is None:
                        outcome.dead.append(worker_id)
                        waiting.discard(worker_id)
                next_liveness = now + LIVENESS_POLL_S
                if now >= deadline:
                    break
            await asyncio.sleep(BARRIER_POLL_S)
        outcome.missing = sorted(waiting)
        outcome.dead.sort()
        return outcome

    # --- the workers' side ------------------------------------------------------------------------------------

    async def order(self) -> WeightSyncOrder | None:
        """The current sync order, or None (none yet, or one this build cannot read)."""
        data: Any = await self.redis.get(self.keys.weight_sync)
        if data is None:
            return None
        try:
            order = decode(data)
        except ProtocolError:
            return None
        return order if isinstance(order, WeightSyncOrder) else None

    async def manifest(self, sync_id: str, timeout_s: float) -> WeightManifest | None:
        """Wait for the announcement of `sync_id`; None if it did not come within `timeout_s` seconds, or a newer
        sync order replaced this one (its trainer gave up on it, or died and another started)."""
        data = await self._await_key(self.keys.weight_manifest(sync_id), sync_id, timeout_s)
        manifest = None if data is None else decode(data)
        return manifest if isinstance(manifest, WeightManifest) else None

    async def load_ordered(self, sync_id: str, timeout_s: float) -> bool:
        """Wait for the load order of staged sync `sync_id`: True once written; False if it did not come within
        `timeout_s` seconds, or a newer sync order replaced this one."""
        return await self._await_key(self.keys.weight_load(sync_id), sync_id, timeout_s) is not None

    async def _await_key(self, key: str, sync_id: str | None, timeout_s: float) -> bytes | None:
        """The value of `key` once written; None after `timeout_s` seconds, or once the sync order is no longer
        `sync_id`'s (checked every `LIVENESS_POLL_S`; None: not checked)."""
        deadline = time.monotonic() + timeout_s
        next_order_check = time.monotonic() + LIVENESS_POLL_S
        while time.monotonic() < deadline:
            data: Any = await self.redis.get(key)
            if data is not None:
                return bytes(data)
            if sync_id is not None and time.monotonic() >= next_order_check:
                order = await self.order()
                if order is not None and order.sync_id != sync_id:
                    return None
                next_order_check = time.monotonic() + LIVENESS_POLL_S
            await asyncio.sleep(BARRIER_POLL_S)
        return None

    # --- peer catch-up ---------------------------------------------------------------------------------------

    async def order_catch_up(self, order: CatchUpOrder) -> None:
        """A stale worker's order to its peer (replacing any earlier one of it), and the nudge."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.weight_catch_ups, order.learner, encode(order))
        pipe.publish(self.keys.weights_channel, Nudge.CATCH_UP)
        await pipe.execute()

    async def catch_up_orders(self) -> list[CatchUpOrder]:
        """The catch-up orders outstanding (ones this build cannot read are skipped)."""
        found: Any = await self.redis.hgetall(self.keys.weight_catch_ups)
        orders = []
        for data in found.values():
            try:
                order = decode(data)
            except ProtocolError:
                continue
            if isinstance(order, CatchUpOrder):
                orders.append(order)
        return orders

    async def end_catch_up(self, learner: str) -> None:
        await self.redis.hdel(self.keys.weight_catch_ups, learner)

    async def answer_catch_up(self, answer: CatchUpAnswer) -> None:
        await self.redis.set(self.keys.weight_catch_up_answer(answer.catch_up_id), encode(answer), ex=SYNC_KEYS_TTL_S)

    async def catch_up_answer(self, catch_up_id: str, timeout_s: float) -> CatchUpAnswer | None:
        """Wait for the peer's answer to `catch_up_id`; None if none came within `timeout_s` seconds."""
        data = await self._await_key(self.keys.weight_catch_up_answer(catch_up_id), None, timeout_s)
        answer = None if data is None else decode(data)
        return answer if isinstance(answer, CatchUpAnswer) else None

    async def arrive(self, sync_id: str, phase: str, worker_id: str, outcome: str = OK) -> None:
        """Reach `phase` of `sync_id`: "ok", or the error this worker met."""
        key = self.keys.weight_barrier(sync_id, phase)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, worker_id, outcome)
        pipe.expire(key, SYNC_KEYS_TTL_S)
        await pipe.execute()
