"""The control plane: desired state in a Redis hash, epoch-numbered commands, pub/sub nudges, acknowledged barriers.

The only module that spells the control keys' verbs (DESIGN.md section 4, "Control semantics"):

- Desired state lives in `Keys.state` (epoch, pause holders, sleep level and mode, woken tags). Every command
  (built by `control.commands`, sent by `issue`) bumps the epoch, updates the hash and is logged in `Keys.commands`
  under its epoch, in one script; a message on `Keys.control_channel` only nudges (pub/sub is at most once).
  Workers also read the hash before their first request, after a reconnect and at every heartbeat, so a lost nudge
  costs at most one heartbeat interval.
- A worker acknowledges by writing the epoch it applied (a watermark) and its state into its heartbeat hash in
  one step, and announcing it on `Keys.acks_channel`. The issuer waits until every worker that was live when it
  issued has applied epoch >= E; a worker whose heartbeat expires meanwhile is dropped (its requests are
  requeued). On timeout it raises `ControlTimeoutError` naming the rest; the desired state stays written.
- The fleet is paused while any holder holds a pause; `resume` releases only its own holder. With holders in
  different modes the strongest applies: abort > wait > keep.
- A pause may be held under a lease (`lease:{holder}`, when it lapses in Redis' clock) that its holder renews
  (`renew_lease`). A pause whose lease lapsed is not in force: every reader of the state (a worker converging at its
  next nudge or heartbeat, `state()`) leaves it out, so a dead holder's pause ends within its lease plus one
  heartbeat interval without anyone writing. The next command or renewal prunes it and records when it lapsed
  (`lapsed:{holder}`, for `status`).
- LoRA adapters are fleet state too (`control.lora`): `load_adapter` and `unload_adapter` are commands whose
  acknowledgement means every live worker holds (or dropped) the adapter; a late worker loads them as it converges.
- Cancel is not a command: a producer writes tombstones (`Keys.cancelled`, with a TTL) and nudges on
  `Keys.cancel_channel`; no barrier.
- Under Redis ACL users (`connections.acl`) only `admin` may issue commands; a refusal raises `AccessDeniedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from rollout_svc.config import Settings
from rollout_svc.connections.acl import ADMIN, permission_denied
from rollout_svc.connections.urls import next_message, retry_while_away
from rollout_svc.control.commands import SLEEP_TAGS, Command
from rollout_svc.control.lora import AdapterSpec
from rollout_svc.control.scripts import CANCEL_LUA, COMMIT_LUA, ISSUE_LUA, RENEW_LEASE_LUA, RESEED_LUA
from rollout_svc.dataplane.producer_streams import ProducerStreams, Sweep
from rollout_svc.dataplane.recovery_streams import RecoveryStreams
from rollout_svc.dataplane.registry import Registry
from rollout_svc.dataplane.streams import Entry, Placed, StreamConnection
from rollout_svc.errors import (
    AccessDeniedError,
    ControlCommandError,
    ControlStateMissingError,
    ControlTimeoutError,
    InvalidRequestError,
    ModelNotFoundError,
    ProtocolError,
)
from rollout_svc.keys import StateField
from rollout_svc.protocol import ControlCommand, PauseMode, RolloutRequest, decode, encode, unrun_trajectory

MODE_STRENGTH: dict[str, int] = {"keep": 0, "wait": 1, "abort": 2}
COMMAND_LOG_LEN = 1000  # commands kept in the log: a worker that far behind converges on the state alone
ACK_POLL_S = 0.1  # how often an issuer also reads the heartbeats (a lost announcement, a dead worker)
SWEEP_PAGE = 1000


@dataclass(frozen=True)
class FleetState:
    """The desired control state of the fleet, as held in `Keys.state`.

    `holders` maps each pause holder whose pause is in force to its mode; `leases` maps those held under a lease to
    when it lapses, `lapsed` each holder whose leased pause lapsed (not renewed: its process died or hung) to when it
    did (unix seconds, Redis' clock). `sleep_level` 0 is awake; `awake_tags` are the memory pools a partial
    `wake_up(tags)` restored (the fleet sleeps until all of `SLEEP_TAGS` are). `adapters`: the LoRA adapters every
    worker should hold, by name.
    """

    epoch: int = 0
    holders: dict[str, PauseMode] = field(default_factory=dict)
    leases: dict[str, float] = field(default_factory=dict)
    lapsed: dict[str, float] = field(default_factory=dict)
    sleep_level: int = 0
    sleep_mode: PauseMode = "abort"
    awake_tags: frozenset[str] = frozenset()
    weight_version: int = 0
    weight_checkpoint: str = ""  # the checkpoint directory the committed version was loaded from ("": broadcast)
    weight_digest: str = ""  # a broadcast version's digest (`weightsync.transfer.weights_digest`; "": none)
    adapters: dict[str, AdapterSpec] = field(default_factory=dict)

    @property
    def paused(self) -> bool:
        return bool(self.holders)

    @property
    def pause_mode(self) -> PauseMode | None:
        """The strongest mode among the holders (abort > wait > keep), or None when not paused."""
        return max(self.holders.values(), key=MODE_STRENGTH.__getitem__, default=None)

    @property
    def sleeping(self) -> bool:
        return self.sleep_level > 0 and not set(SLEEP_TAGS) <= self.awake_tags

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes], now_ms: int | None = None) -> FleetState:
        """The state in `fields` (the hash) at `now_ms` (Redis' clock, unix ms: pauses whose lease lapsed by then are
        `lapsed`, not `holders`; None: every lease counts as live)."""
        values = {k.decode(): v.decode() for k, v in fields.items()}
        awake = StateField.AWAKE_PREFIX

        def prefixed(prefix: str) -> dict[str, str]:
            return {k[len(prefix) :]: v for k, v in values.items() if k.startswith(prefix)}

        holders = prefixed(StateField.HOLDER_PREFIX)
        leases = {name: int(float(v)) for name, v in prefixed(StateField.LEASE_PREFIX).items()}
        lapsed = {name: int(float(v)) for name, v in prefixed(StateField.LAPSED_PREFIX).items()}
        for name, until in leases.items():
            if now_ms is not None and until <= now_ms and name in holders:
                del holders[name]
                lapsed[name] = until
        return cls(
            epoch=int(values.get(StateField.EPOCH, 0)),
            holders=holders,  # type: ignore[arg-type]
            leases={name: until / 1000 for name, until in leases.items() if name in holders},
            lapsed={name: when / 1000 for name, when in lapsed.items()},
            sleep_level=int(values.get(StateField.SLEEP_LEVEL, 0)),
            sleep_mode=values.get(StateField.SLEEP_MODE, "abort"),  # type: ignore[arg-type]
            awake_tags=frozenset(k[len(awake) :] for k in values if k.startswith(awake)),
            weight_version=int(values.get(StateField.WEIGHT_VERSION, 0)),
            weight_checkpoint=values.get(StateField.WEIGHT_CHECKPOINT, ""),
            weight_digest=values.get(StateField.WEIGHT_DIGEST, ""),
            adapters={name: AdapterSpec.from_field(v) for name, v in prefixed(StateField.ADAPTER_PREFIX).items()},
        )

    def to_hash(self) -> dict[str, str]:
        fields = {StateField.EPOCH: str(self.epoch), StateField.SLEEP_LEVEL: str(self.sleep_level)}
        fields |= {StateField.SLEEP_MODE: self.sleep_mode, StateField.WEIGHT_VERSION: str(self.weight_version)}
        fields |= {StateField.WEIGHT_CHECKPOINT: self.weight_checkpoint, StateField.WEIGHT_DIGEST: self.weight_digest}
        fields |= {StateField.holder(holder): mode for holder, mode in self.holders.items()}
        fields |= {StateField.lease(holder): str(int(until * 1000)) for holder, until in self.leases.items()}
        fields |= {StateField.lapsed(holder): str(int(when * 1000)) for holder, when in self.lapsed.items()}
        fields |= {StateField.adapter(name): spec.to_field() for name, spec in self.adapters.items()}
        return fields | {StateField.awake(tag): "1" for tag in self.awake_tags}


class ControlPlane:
    """Issue control commands and wait for every live worker's acknowledgement; read the desired state.

    Example::

        plane = ControlPlane(redis, settings)
        await plane.issue(commands.pause("keep"))   # returns once every live worker froze its in-flight requests
        await plane.issue(commands.resume())

    Issuing a command raises `ControlTimeoutError` (naming the workers that did not ack within `timeout_s`,
    default `Settings.client.control_timeout_s`), `ControlCommandError` (naming the workers that reported a failure) and
    `AccessDeniedError` (Redis refused: this connection's Redis user is not `admin`; the state is unchanged).
    """

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.redis, self.settings, self.keys = redis, settings, settings.keys
        self.registry = Registry(redis, self.keys, settings.heartbeat_ttl_s)
        self.streams = ProducerStreams(StreamConnection(redis, self.keys, settings.session_ttl_s))
        self.recovery = RecoveryStreams(self.streams.connection)
        self._issue = redis.register_script(ISSUE_LUA)
        self._reseed = redis.register_script(RESEED_LUA)
        self._renew = redis.register_script(RENEW_LEASE_LUA)
        self._commit = redis.register_script(COMMIT_LUA)
        self._cancel = redis.register_script(CANCEL_LUA)
        self._acks: PubSub | None = None  # subscribed to the acks channel from the first command on
        self._issuing = asyncio.Lock()  # one command at a time per plane: they share that subscription

    async def close(self) -> None:
        if self._acks is not None:
            acks, self._acks = self._acks, None
            await acks.aclose()

    async def load_scripts(self) -> None:
        """Load every script the control plane runs (its own, the registry's, the data plane's) once."""
        for script in (self._issue, self._reseed, self._renew, self._commit, self._cancel):
            script.sha = await self.redis.script_load(script.script)
        await self.registry.load_scripts()
        await self.streams.connection.load_scripts()

    # --- commands -------------------------------------------------------------------------------------------

    async def issue(self, command: Command, *, timeout_s: float | None = None) -> int:
        """Issue `command` (built by `control.commands`) and wait for every live worker's acknowledgement (for a
        session or all abort, sweep the queue of what it hits too). Returns the epoch.

        A load of an adapter at a version not above every earlier one of its name raises `InvalidRequestError`, an
        unload of one this shard does not hold `ModelNotFoundError`, both before anything is written. While Redis
        is away (restarting, failing over) the command is issued again for up to `redis_outage_s`, then the
        connection error is raised: a command issued twice is applied at its later epoch (the desired state is the
        same; an abort's scope grows by what was enqueued in between). A refusal by Redis' ACLs raises
        `AccessDeniedError`: it comes before the issue script wrote anything (the acks subscription) or from that
        script's first write, so the state is unchanged.
        """
        if command.kind in ("load_adapter", "unload_adapter"):
            await self._check_adapter(command)
        try:
            return await retry_while_away(
                lambda: self._issue_and_await(command, timeout_s), self.settings.client.redis_outage_s, command.kind
            )
        except ResponseError as exc:
            if permission_denied(exc):
                raise AccessDeniedError(command.kind, ADMIN, str(exc)) from exc
            raise

    async def _check_adapter(self, command: Command) -> None:
        """Refuse a load at a version not above every earlier one of the name, or an unload of a name not held."""
        name = command.args["name"]
        if command.kind == "unload_adapter":
            if not await self.redis.hexists(self.keys.state, StateField.adapter(name)):
                raise ModelNotFoundError(name, sorted((await self.state()).adapters))
            return
        newest = await self.newest_adapter_version(name)
        if command.args["version"] <= newest:
            raise InvalidRequestError(f"adapter {name} has had version {newest}: a new one must be above it")

    async def renew_lease(self, holder: str, lease_s: float) -> bool:
        """Extend `holder`'s leased pause to `lease_s` from now. Returns whether it still holds its pause (False:
        it was resumed, or its lease lapsed and the fleet may be serving: the holder must not act as if paused).
        Raises `AccessDeniedError` if this connection's Redis user is not `admin`."""
        try:
            args: list[str | int] = [StateField.holder(holder), StateField.lease(holder), int(lease_s * 1000)]
            return bool(await self._renew(keys=[self.keys.state], args=args))
        except ResponseError as exc:
            if permission_denied(exc):
                raise AccessDeniedError("renew a pause lease", ADMIN, str(exc)) from exc
            raise

    async def newest_adapter_version(self, name: str) -> int:
        """The newest version `name` has ever had here (0: none), loaded now or not."""
        current, last = await self.redis.hmget(self.keys.state, StateField.adapter(name), StateField.adapter_last(name))
        value = current.decode() if isinstance(current, bytes) else current
        return max(AdapterSpec.from_field(value).version if value else 0, int(last or 0))

    async def commit_weights(self, version: int, checkpoint: str = "", digest: str = "") -> None:
        """Record `version` as the fleet's committed weight version (loaded from `checkpoint`, "" for a broadcast,
        whose `digest` a late worker checks what it got from a peer against) and nudge the workers: one whose
        version differs takes no work until it has this one. No barrier: the weight sync waited for its loads
        already, and resumes (a command, acknowledged) right after.
        Raises `AccessDeniedError` if this connection's Redis user may not write the state (not `admin`), and
        `ControlStateMissingError` if the state hash is missing (Redis restarted empty: the workers write it back
        within a heartbeat; retry the sync then), committing nothing."""
        args = [str(version), checkpoint, self.keys.weights_channel, self.keys.control_channel, digest]
        try:
            committed = await self._commit(keys=[self.keys.state], args=args)
        except ResponseError as exc:
            if permission_denied(exc):
                raise AccessDeniedError("commit_weights", ADMIN, str(exc)) from exc
            raise
        if not committed:
            raise ControlStateMissingError(self.keys.state)

    async def state(self) -> FleetState:
        """The desired state now (pauses whose lease lapsed are `lapsed`, not in force)."""
        pipe = self.redis.pipeline(transaction=False)  # a producer may not MULTI; TIME read just after is close enough
        pipe.hgetall(self.keys.state)
        pipe.time()
        fields, now = await pipe.execute()
        return FleetState.from_hash(fields, _unix_ms(now))

    async def _issue_and_await(self, command: Command, timeout_s: float | None) -> int:
        timeout_s = self.settings.client.control_timeout_s if timeout_s is None else timeout_s
        async with self._issuing:
            acks = await self._subscribed()
            snapshot = await self.registry.live_ids()
            logged = ControlCommand(command_id=uuid.uuid4().hex, kind=command.kind, args=command.args)
            fields = [x for item in command.set_fields.items() for x in item]
            args: list[bytes | str | int] = [encode(logged), COMMAND_LOG_LEN, self.keys.control_channel]
            args += [*command.lease, len(command.set_fields), *fields]
            keys = [self.keys.state, self.keys.commands]
            epoch = int(await self._issue(keys=keys, args=[*args, *command.del_fields]))
            if command.sweep:
                await self._sweep_queued(epoch, command.args)
            failed = await self._await_acks(command.kind, epoch, snapshot, acks, timeout_s)
        if failed:
            statuses = await self.registry.statuses(sorted(failed))
            failures = {w: s.error for w, s in statuses.items() if s is not None and s.error_epoch == epoch}
            raise ControlCommandError(command.kind, epoch, failures or dict.fromkeys(failed, "failed"))
        return epoch

    async def _subscribed(self) -> PubSub:
        """The acks subscription, made live before the first command (so no announcement is missed)."""
        if self._acks is None or self._acks.connection is None or not self._acks.connection.is_connected:
            if self._acks is not None:
                await self._acks.aclose()
            self._acks = self.redis.pubsub()
            await self._acks.subscribe(self.keys.acks_channel)
            await self._acks.get_message(timeout=1.0)  # the confirmation: the subscription is live
        return self._acks

    async def _await_acks(self, kind: str, epoch: int, snapshot: list[str], acks: PubSub, timeout_s: float) -> set[str]:
        """Wait until each worker of `snapshot` applied `epoch` or died; returns those that reported a failure."""
        pending, failed = set(snapshot), set()
        deadline = time.monotonic() + timeout_s
        next_poll = time.monotonic() + ACK_POLL_S
        while pending:
            now = time.monotonic()
            if now >= next_poll or now >= deadline:
                for worker_id, status in (await self.registry.statuses(sorted(pending))).items():
                    if status is None or status.applied_epoch >= epoch:  # acked, or dead: dropped
                        pending.discard(worker_id)
                        if status is not None and status.error_epoch == epoch:
                            failed.add(worker_id)
                if pending and now >= deadline:
                    raise ControlTimeoutError(kind, epoch, sorted(pending), timeout_s, self.settings.heartbeat_ttl_s)
                next_poll = now + ACK_POLL_S
                continue
            try:
                message = await next_message(acks, min(next_poll, deadline) - now, ignore_subscribe_messages=True)
            except (RedisConnectionError, OSError):  # the subscription died with its connection (a Redis restart)
                with contextlib.suppress(RedisError, OSError):
                    await acks.aclose()
                self._acks = None  # a new subscription; the polls cover an ack announced in between
                acks = await self._subscribed()
                continue
            if message is not None:  # an announcement: "worker_id applied_epoch error_epoch" (of any command)
                worker_id, applied, error_epoch = [*message["data"].decode().split(), "0", "0"][:3]
                if int(applied) >= epoch and worker_id in pending:
                    pending.discard(worker_id)
                    if int(error_epoch) == epoch:
                        failed.add(worker_id)
        return failed

    async def _sweep_queued(self, epoch: int, args: dict[str, Any]) -> int:
        """Answer, unrun, the queued requests an abort(session_id | all) hits: enqueued before `epoch`, still
        undelivered. A request a worker takes meanwhile is that worker's to abort (it applies the same command)."""
        session_id = args.get("session_id")
        streams = [self.keys.requests] + [self.keys.pinned_requests(w) for w in await self.registry.worker_ids()]
        swept = 0
        for stream in streams:
            after: bytes | None = None
            while entries := await self.recovery.undelivered(stream, SWEEP_PAGE, after):
                after = entries[-1].entry_id
                hits = [e for e in entries if e.epoch < epoch and (session_id is None or e.session_id == session_id)]
                sweeps = [s for s in map(self._abort_answer, hits) if s is not None]
                if sweeps:
                    swept += len(await self.streams.sweep(stream, sweeps, self.settings.results_ttl_s))
        return swept

    @staticmethod
    def _abort_answer(entry: Entry) -> Sweep | None:
        try:
            request = decode(entry.payload)
        except (ProtocolError, InvalidRequestError):
            return None  # a worker dead-letters it, or answers it with its error
        if not isinstance(request, RolloutRequest):
            return None
        return Sweep(entry.entry_id, (request.reply_to, encode(unrun_trajectory(request, "user"))))

    # --- cancel (a producer's own requests) ------------------------------------------------------------------

    async def cancel(self, attempts: Sequence[tuple[str, Placed | None]]) -> set[tuple[str, bytes]]:
        """Cancel requests a producer no longer wants: tombstone their ids (workers abort them in flight, at the
        next nudge or heartbeat), and delete those still queued. No acknowledgement. Returns the entries deleted unrun,
        as (stream, entry id) (a cut answers those itself; a worker answers the others: in flight it aborts them, and
        answers unrun those it takes later)."""
        if not attempts:
            return set()
        ttl_ms = int(self.settings.results_ttl_s * 1000)
        ids = [request_id for request_id, _ in attempts]
        await self._cancel(keys=[self.keys.cancelled], args=[ttl_ms, self.keys.cancel_channel, *ids])
        by_stream: dict[str, list[Sweep]] = {}
        for _, placed in attempts:
            if placed is not None:
                by_stream.setdefault(placed.stream, []).append(Sweep(placed.entry_id))
        swept: set[tuple[str, bytes]] = set()
        for stream, sweeps in by_stream.items():
            swept.update((stream, e) for e in await self.streams.sweep(stream, sweeps, self.settings.results_ttl_s))
        return swept

    # --- the worker's side -----------------------------------------------------------------------------------

    async def subscribe(self) -> PubSub:
        """A worker's one pub/sub connection: the nudges on the control channel (`Nudge.COMMAND`), on the cancel
        channel (`Nudge.CANCEL`) and on the weights channel (a sync order, announcement or commit).

        redis-py reconnects it after a dropped connection and subscribes again; that confirmation arrives as a
        `subscribe` message, on which the worker converges (a nudge may have been lost meanwhile).
        """
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(self.keys.control_channel, self.keys.cancel_channel, self.keys.weights_channel)
        return pubsub

    async def read(self, after_epoch: int | None) -> tuple[FleetState | None, list[ControlCommand]]:
        """The desired state (None if the hash is missing) and the logged commands after `after_epoch`, oldest
        first (None: every command still in the log), in one round trip."""
        low = "-inf" if after_epoch is None else f"({after_epoch}"
        pipe = self.redis.pipeline(transaction=True)  # one snapshot: no command lands between the two reads
        pipe.hgetall(self.keys.state)
        pipe.zrangebyscore(self.keys.commands, low, "+inf", withscores=True)
        pipe.time()
        fields, logged, now = await pipe.execute()
        state = FleetState.from_hash(fields, _unix_ms(now)) if fields else None
        commands = []
        for payload, score in logged:
            try:
                command = decode(payload)
            except ProtocolError:
                continue  # written by another version: its state change still applies through the hash
            commands.append(command.model_copy(update={"epoch": int(score)}))
        return state, commands

    async def reseed(self, state: FleetState) -> bool:
        """Write `state` back if the state hash is missing (Redis lost it). Returns whether this call wrote it."""
        fields = [x for item in state.to_hash().items() for x in item]
        return bool(await self._reseed(keys=[self.keys.state], args=fields))

    async def tombstones(self, since: float) -> list[tuple[str, float]]:
        """The tombstones expiring at or after `since` (unix ms), as (request id, expiry): a worker reads from
        the latest expiry it saw, so each read returns about what was cancelled since (expiries only grow)."""
        found: Any = await self.redis.zrangebyscore(self.keys.cancelled, since, "+inf", withscores=True)
        return [(request_id.decode(), float(expiry)) for request_id, expiry in found]


def _unix_ms(time_reply: Any) -> int:
    """Redis' TIME reply (seconds, microseconds; redis-py gives a tuple of ints) in unix ms."""
    seconds, micros = time_reply
    return int(seconds) * 1000 + int(micros) // 1000
