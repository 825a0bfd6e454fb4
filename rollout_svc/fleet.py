"""The shards of a deployment, seen from a producer, the control plane's issuer or the weight sender.

A shard is a group of workers whose keys share one Redis Cluster hash tag (`rollout_svc.keys`): its requests
streams, sessions, heartbeats, control state, weight-sync barriers and the producers' results streams for it. Every
per-shard object (`ProducerStreams`, `Registry`, `ControlPlane`, `WeightSyncPlane`) works within one shard, over a
connection to the primary serving its slot (`cluster_connect.shard_url`). This module holds one `ShardLink` per
shard and fans out what must reach every shard: control commands (`FleetControl`), the worker registry
(`FleetRegistry`) and weight sync (`FleetWeightPlane`). One Redis is the one-shard case: one link, `g0`.

Shards are discovered from the `{prefix}:shards` set, to which every worker adds its shard when it registers.
Sessions are placed on a shard by rendezvous hashing (highest random weight: Thaler and Ravishankar, "Using
name-based mappings to increase hit rates", IEEE/ACM ToN 1998) over the live shards, so adding or losing a shard
moves only the sessions that hashed to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.exceptions import RedisError

from rollout_svc import tracing
from rollout_svc.config import Settings
from rollout_svc.connections.topology import close_router, redis_router, shard_url
from rollout_svc.connections.urls import redis_async_bounded
from rollout_svc.control.commands import Command
from rollout_svc.control.leases import PauseLeases
from rollout_svc.control.plane import ControlPlane, FleetState
from rollout_svc.dataplane.producer_streams import ProducerStreams
from rollout_svc.dataplane.registry import Registry
from rollout_svc.errors import InvalidRequestError
from rollout_svc.keys import Keys
from rollout_svc.protocol import WeightManifest, WeightSyncOrder, WorkerStatus
from rollout_svc.weightsync.plane import BarrierOutcome, WeightSyncPlane

log = logging.getLogger("rollout_svc.fleet")
T = TypeVar("T")
SHARD_CONNECTIONS = 256  # connections a producer keeps to one shard at most; more calls at once wait for one
SHARD_CONNECTION_WAIT_S = 30.0  # then redis-py raises ConnectionError("No connection available.")


def rendezvous(session_id: str, shards: Sequence[str]) -> str:
    """The shard of `shards` (non-empty) with the highest hash of (shard, session id): stable while both live, and
    only the sessions of a shard that leaves (or the share a new shard wins) move."""
    return max(shards, key=lambda shard: hashlib.blake2b(f"{shard}\x00{session_id}".encode(), digest_size=8).digest())


@dataclass
class ShardLink:
    """One shard as a client sees it: its settings (`shard` set) and keys, a connection to its primary, and the
    per-shard planes on that connection (the control plane's own data plane and registry)."""

    name: str
    settings: Settings
    keys: Keys
    redis: Any
    control: ControlPlane
    weights: WeightSyncPlane
    workers: int = 0  # live workers, as last checked
    away_since: float | None = None  # monotonic time its Redis first failed to answer, None while it answers

    @classmethod
    async def open(cls, settings: Settings, name: str) -> ShardLink:
        """Connect to shard `name`'s primary. Raises `RuntimeError` or a Redis error if it cannot be found."""
        shard_settings = settings.copy_with(shard=name)
        url = await asyncio.to_thread(shard_url, settings.redis_url, name)
        # A producer's calls share this client: past SHARD_CONNECTIONS at once they wait for a connection (redis-py's
        # default pool refuses the 101st with "Too many connections", which read as the shard being away).
        redis = redis_async_bounded(url, SHARD_CONNECTIONS, SHARD_CONNECTION_WAIT_S, decode_responses=False)
        return cls(
            name=name,
            settings=shard_settings,
            keys=shard_settings.keys,
            redis=redis,
            control=ControlPlane(redis, shard_settings),
            weights=WeightSyncPlane(redis, shard_settings),
        )

    @property
    def streams(self) -> ProducerStreams:
        return self.control.streams

    @property
    def registry(self) -> Registry:
        return self.control.registry

    @property
    def live(self) -> bool:
        """A live worker heartbeats in it (as last checked)."""
        return self.workers > 0

    async def close(self) -> None:
        try:
            await self.control.close()
        finally:
            await self.redis.aclose()


class Fleet:
    """Every shard of one deployment (`settings.redis_url`, `settings.key_prefix`): discovered, connected, checked.

    `links` maps shard name -> `ShardLink`. `await refresh()` adds the shards workers have registered since; a
    shard whose primary cannot be reached is retried at the next refresh."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.router = redis_router(settings.redis_url, decode_responses=False)
        self.links: dict[str, ShardLink] = {}
        self._lock = asyncio.Lock()

    async def named_models(self) -> list[str]:
        """The named models whose workers registered in this deployment (`Settings.model_name`; `models_key`)."""
        members: Any = await self.router.smembers(self.settings.models_key)
        return sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)

    async def refresh(self) -> list[str]:
        """Connect to every registered shard (and the settings' own); returns the names found. Raises the Redis error
        if no shard at all can be reached."""
        async with self._lock:
            names = {self.settings.shard}
            try:
                members: Any = await self.router.smembers(self.settings.keys.shards)
                names |= {m.decode() if isinstance(m, bytes) else m for m in members}
            except (RedisError, OSError) as exc:  # a cluster node away: the shards known so far stay
                log.debug("reading the shard set failed (%s)", exc)
            error: BaseException | None = None
            for name in sorted(names - set(self.links)):
                link = None
                try:
                    link = await ShardLink.open(self.settings, name)
                    await link.control.load_scripts()
                except (RedisError, OSError, RuntimeError) as exc:
                    log.warning("shard %s cannot be reached yet (%s)", name, exc)
                    error = exc
                    if link is not None:
                        await link.redis.aclose()
                    continue
                self.links[name] = link
            if not self.links and error is not None:  # nothing reachable at all: say so rather than see no fleet
                raise error
            return sorted(self.links)

    def live(self) -> list[str]:
        """The shards a live worker heartbeats in (as last checked), by name."""
        return sorted(name for name, link in self.links.items() if link.live and link.away_since is None)

    async def check(self, link: ShardLink) -> None:
        """Record how many live workers heartbeat in `link`'s shard. Raises the Redis error if it is away."""
        link.workers = len(await link.registry.live_ids())

    async def each(self, call: Callable[[ShardLink], Awaitable[T]], names: Iterable[str] | None = None) -> dict[str, T]:
        """`call(link)` on every shard (or those named) at once. If any raise, the first error is raised once all
        are done, with a note naming its shard: the others' effects stand (a control command's desired state is
        written on every shard that answered, and a retry converges)."""
        links = [self.links[n] for n in (sorted(self.links) if names is None else names) if n in self.links]
        outcomes = await asyncio.gather(*(call(link) for link in links), return_exceptions=True)
        for link, outcome in zip(links, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                outcome.add_note(f"(on shard {link.name}; the other shards' part stands)")
                raise outcome
        return {link.name: outcome for link, outcome in zip(links, outcomes, strict=True)}  # type: ignore[misc]

    async def each_reachable(self, call: Callable[[ShardLink], Awaitable[T]]) -> dict[str, T]:
        """`call(link)` on every shard at once, leaving out (with a warning) the shards whose Redis is away: what a
        read of the whole fleet (its workers, its status) sees while one shard's primary is down."""
        links = [self.links[n] for n in sorted(self.links)]
        outcomes = await asyncio.gather(*(call(link) for link in links), return_exceptions=True)
        found: dict[str, T] = {}
        for link, outcome in zip(links, outcomes, strict=True):
            if isinstance(outcome, (RedisError, OSError)):
                log.warning("shard %s left out: its Redis is away (%s)", link.name, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                found[link.name] = outcome
        return found

    async def close(self) -> None:
        for link in self.links.values():
            try:
                await link.close()
            except (RedisError, OSError) as exc:
                log.debug("closing shard %s failed (%s)", link.name, exc)
        self.links.clear()
        await close_router(self.router)


def sorted_workers(by_shard: dict[str, list[WorkerStatus]]) -> list[WorkerStatus]:
    """Every shard's workers in one list, by worker id."""
    return sorted((w for ws in by_shard.values() for w in ws), key=lambda w: w.worker_id)


class FleetRegistry:
    """The worker registry of every shard: the subset of `Registry` that clients use."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def live_ids(self) -> list[str]:
        found = await self.fleet.each_reachable(lambda link: link.registry.live_ids())
        return sorted(w for ids in found.values() for w in ids)

    async def live_workers(self) -> list[WorkerStatus]:
        return sorted_workers(await self.live_workers_by_shard())

    async def live_workers_by_shard(self) -> dict[str, list[WorkerStatus]]:
        """shard -> its live workers, for every shard whose Redis answers."""
        return await self.fleet.each_reachable(lambda link: link.registry.live_workers())

    async def statuses(self, worker_ids: Sequence[str]) -> dict[str, WorkerStatus | None]:
        """Each worker's status (None: dead, unknown, or in a shard whose Redis is away), looked up in every shard."""
        found = await self.fleet.each_reachable(lambda link: link.registry.statuses(worker_ids))
        merged: dict[str, WorkerStatus | None] = dict.fromkeys(worker_ids)
        for statuses in found.values():
            merged.update({w: s for w, s in statuses.items() if s is not None})
        return merged

    async def shard_of(self, worker_ids: Sequence[str]) -> dict[str, str]:
        """worker id -> its shard, for the live workers among `worker_ids`."""
        found = await self.fleet.each_reachable(lambda link: link.registry.statuses(worker_ids))
        return {w: name for name, statuses in found.items() for w, s in statuses.items() if s is not None}


class FleetControl:
    """`ControlPlane`'s issuer side over every shard: a command is issued in every shard at once (`issue`) and
    returns once every shard's live workers acknowledged it (the largest epoch is returned). Errors as
    `ControlPlane`'s, with a note naming the shard. Leased pauses it issued with `renew` are renewed while it lives
    (`leases`)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.registry = FleetRegistry(fleet)
        self.leases = PauseLeases(self.renew_lease)

    async def load_scripts(self) -> None:
        await self.fleet.refresh()

    async def close(self) -> None:
        """Stop renewing leases (the pauses lapse after them unless resumed); the links are the fleet's."""
        await self.leases.close()

    async def issue(self, command: Command, *, timeout_s: float | None = None) -> int:
        """`command` (built by `control.commands`) issued in every shard at once (`ControlPlane.issue`); returns the
        largest epoch once every shard's live workers acknowledged it. A leased pause with `renew` is renewed while
        this object lives; a pause without, or a resume, of a holder stops its renewal here. Traced as
        `rollout.control.<kind>` (`rollout_svc.tracing`)."""
        with tracing.span(f"rollout.control.{command.kind}", **{"rollout.holder": command.args.get("holder")}):
            if command.renew:
                with self.leases.issuing(command.args["holder"], command.args["lease_s"]):
                    return await self._each(command, timeout_s)
            if command.kind in ("pause", "resume"):
                self.leases.release(command.args["holder"])
            return await self._each(command, timeout_s)

    async def _each(self, command: Command, timeout_s: float | None) -> int:
        await self.fleet.refresh()
        epochs = await self.fleet.each(lambda link: link.control.issue(command, timeout_s=timeout_s))
        return max(epochs.values(), default=0)

    async def renew_lease(self, holder: str, lease_s: float) -> bool:
        """Extend `holder`'s leased pause in every shard; whether every shard still holds it."""
        await self.fleet.refresh()
        held = await self.fleet.each(lambda link: link.control.renew_lease(holder, lease_s))
        return all(held.values())

    async def next_adapter_version(self, name: str, version: int | None = None) -> int:
        """The version a load of adapter `name` takes: `version`, or the newest any shard ever had + 1 (each shard's
        issue refuses one not above its own newest)."""
        if version is not None:
            return version
        await self.fleet.refresh()
        newest = await self.fleet.each(lambda link: link.control.newest_adapter_version(name))
        return max(newest.values(), default=0) + 1

    async def next_weight_version(self, version: int | None = None) -> int:
        """The version a weight sync commits: `version`, or the committed one plus one. Raises
        `InvalidRequestError` for a version not above the committed one (tokens' versions only ever grow)."""
        committed = (await self.state()).weight_version
        if version is None:
            return committed + 1
        if version <= committed:
            raise InvalidRequestError(f"weight version {version} is not above the committed version {committed}")
        return version

    async def commit_weights(self, version: int, checkpoint: str = "", digest: str = "") -> None:
        await self.fleet.refresh()
        await self.fleet.each(lambda link: link.control.commit_weights(version, checkpoint, digest))

    async def state(self) -> FleetState:
        """The desired state, as the first shard (by name) that answers holds it (every command writes all)."""
        await self.fleet.refresh()
        error: BaseException | None = None
        for name in sorted(self.fleet.links):
            try:
                return await self.fleet.links[name].control.state()
            except (RedisError, OSError) as exc:
                error = error or exc
        if error is not None:
            raise error
        return FleetState()


class FleetWeightPlane:
    """`WeightSyncPlane`'s sender side over every shard: an order and a manifest are written in every shard; a
    barrier is awaited in each member's shard."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.registry = FleetRegistry(fleet)

    async def publish(self, order: WeightSyncOrder) -> None:
        await self.fleet.each(lambda link: link.weights.publish(order))

    async def announce(self, manifest: WeightManifest) -> None:
        await self.fleet.each(lambda link: link.weights.announce(manifest))

    async def order_load(self, sync_id: str) -> None:
        await self.fleet.each(lambda link: link.weights.order_load(sync_id))

    async def await_barrier(self, sync_id: str, phase: str, members: Sequence[str], timeout_s: float) -> BarrierOutcome:
        """Each shard's part of the barrier at once; a member found in no shard is dead."""
        shard_of = await self.registry.shard_of(members)
        parts: dict[str, list[str]] = {}
        for member in members:
            parts.setdefault(shard_of.get(member, ""), []).append(member)
        lost = parts.pop("", [])
        found = await self.fleet.each(
            lambda link: link.weights.await_barrier(sync_id, phase, parts[link.name], timeout_s), parts
        )
        return BarrierOutcome.merge([*found.values()], dead=lost)
