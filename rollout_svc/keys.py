"""Every Redis key, and every name that crosses a process boundary through Redis: stream-entry fields, hash
fields, worker states, barrier phases, nudges, script replies; and `lua`, which renders those names into Lua.

A name is spelled once, here. Python reads and writes it through these constants; Lua scripts name it as a
placeholder (`'${HeartbeatField.STATE}'`) that `lua` fills in when the script's module is imported, so renaming
a field here renames it on both sides, at no cost per call (tests/unit/test_scripts.py checks that no script
spells a name itself).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from string import Template
from types import MappingProxyType
from typing import Literal, get_args

WORKERS_GROUP = "workers"  # the consumer group on every requests stream
# Fields of a request entry. Only `m` is the message; the others let Redis-side code (placement, requeue,
# abort sweeps) act on an entry without decoding it. A result or streamed chunk has `m` alone.
PAYLOAD_FIELD = b"m"  # the msgpack envelope (rollout_svc.protocol)
SESSION_FIELD = b"s"  # the request's session id, absent without one
EPOCH_FIELD = b"e"  # the control epoch when the request was first enqueued (abort scope)
DELIVERIES_FIELD = b"d"  # deliveries before this entry was requeued (a dead worker had it), absent if none
COST_FIELD = b"c"  # the work the request brings, in tokens (`RolloutRequest.cost_tokens`), absent if unknown
PINNED_SUFFIX = ":pinned"  # `Keys.loads`: field WORKER_ID + this holds the tokens placed in its pinned stream, untaken
HOLDS_SUFFIX = ":holds"  # `Keys.loads`: field WORKER_ID + this holds "kv-cache-tokens max-model-len" of its engine
WIDEST_FIELD = "*" + HOLDS_SUFFIX  # `Keys.loads`: the widest context (max-model-len) any worker has said
NARROWEST_FIELD = "*:narrowest"  # `Keys.loads`: the narrowest context any worker has said
# The open workers' sums, kept in `Keys.loads` by every change of a load (`dataplane.levels`), so that a take and a
# new session's placement read them in O(1), not by walking every worker:
IN_SUFFIX = ":in"  # field WORKER_ID + this: "load weight kv at-ms" as the sums count it, present while it is open
SUM_FIELD = "*:sum"  # the open workers' loads (tokens held plus tokens placed in their pinned streams)
WEIGHTS_FIELD = "*:weights"  # the open workers' weights (their KV caches in tokens; see `dataplane.levels`)
KV_SUM_FIELD = "*:kv"  # the KV caches of the open workers that said theirs, in tokens
KV_COUNT_FIELD = "*:kvn"  # how many open workers said their KV cache
QUEUED_FIELD = "*:queued"  # the tokens queued in the shared stream, not delivered yet
# The largest cost placement counts for one request, in tokens: a load is summed in Lua numbers (doubles, exact to
# 2^53) and kept with HINCRBY (64-bit integers), so a request asking for 10^30 tokens must not reach either as such.
MAX_COST = 1 << 40


# Weight-sync barrier phases (`Keys.weight_barrier`) and the value a worker writes there when a phase went well.
# `received`: a staged sync's tensors arrived (the worker keeps them, still generating on its old weights).
JOINED, RECEIVED, LOADED = "joined", "received", "loaded"
OK = "ok"


class HeartbeatField:
    """Fields of a heartbeat hash (`Keys.worker`) that code names one by one (the placement script reads them).

    The hash as a whole is `protocol.WorkerStatus.to_hash()`, so its field names are that model's attribute names;
    tests/unit/test_scripts.py checks that each name here is one (renaming the attribute alone fails there).
    """

    STATE = "state"  # a `WorkerLabel`
    APPLIED_EPOCH = "applied_epoch"  # the control epoch the worker applied: its acknowledgement


# A worker's state, the value of `HeartbeatField.STATE` (and `protocol.WorkerStatus.state`): starting (not yet
# converged on the control state), serving, paused, sleeping, draining (stopping), or stale (its weight version is
# not the committed one: it takes no work). A script names one as `${WorkerLabel.SERVING}` (`LUA_NAMES`).
WorkerLabel = Literal["starting", "serving", "paused", "sleeping", "draining", "stale"]


class StateField:
    """Fields of the control state hash (`Keys.state`; read and written whole by `control.plane.FleetState`)."""

    EPOCH = "epoch"  # bumped by every control command
    SLEEP_LEVEL = "sleep_level"  # 0: awake
    SLEEP_MODE = "sleep_mode"  # the pause mode a sleep applies to in-flight requests
    WEIGHT_VERSION = "weight_version"  # the committed weight version
    WEIGHT_CHECKPOINT = "weight_checkpoint"  # the checkpoint it was loaded from ("": a broadcast)
    WEIGHT_DIGEST = "weight_digest"  # a broadcast version's digest (`weightsync.transfer.weights_digest`), else ""
    HOLDER_PREFIX = "pause:"  # field pause:{holder} = its pause mode, one per holder of a pause
    LEASE_PREFIX = "lease:"  # field lease:{holder} = when its pause lapses (unix ms, Redis' clock); none: held
    LAPSED_PREFIX = "lapsed:"  # field lapsed:{holder} = when a leased pause of it lapsed (unix ms), kept for `status`
    AWAKE_PREFIX = "awake:"  # field awake:{tag} = 1, per memory pool a partial wake-up restored
    ADAPTER_PREFIX = "adapter:"  # field adapter:{name} = "{version}:{path}", per LoRA adapter loaded fleet-wide
    ADAPTER_LAST_PREFIX = "adapter_last:"  # field adapter_last:{name} = its newest version ever (kept on unload)

    @staticmethod
    def adapter(name: str) -> str:
        """The field of a LoRA adapter the fleet holds (`adapter:{name}`)."""
        return StateField.ADAPTER_PREFIX + name

    @staticmethod
    def adapter_last(name: str) -> str:
        """The field of an adapter's newest version ever given (`adapter_last:{name}`): versions only go up."""
        return StateField.ADAPTER_LAST_PREFIX + name

    @staticmethod
    def holder(name: str) -> str:
        """The field of a pause holder (`pause:{name}`)."""
        return StateField.HOLDER_PREFIX + name

    @staticmethod
    def lease(name: str) -> str:
        """The field of a pause holder's lease (`lease:{name}`)."""
        return StateField.LEASE_PREFIX + name

    @staticmethod
    def lapsed(name: str) -> str:
        """The field recording when a pause holder's lease lapsed (`lapsed:{name}`)."""
        return StateField.LAPSED_PREFIX + name

    @staticmethod
    def awake(tag: str) -> str:
        """The field of a memory pool a partial wake-up restored (`awake:{tag}`)."""
        return StateField.AWAKE_PREFIX + tag


class DeadLetterField:
    """Fields of a dead letter (`Keys.dead`): written by `RecoveryStreams.dead_letter`, read by `DeadLetters`."""

    PAYLOAD = b"payload"  # the request's msgpack envelope as it was queued
    REASON = b"reason"  # an `ErrorCode`: undecodable or max_deliveries
    STREAM = b"stream"  # the stream it was queued in
    ENTRY_ID = b"entry_id"  # its entry id there
    DELIVERIES = b"deliveries"
    WORKER_ID = b"worker_id"  # who dead-lettered it ('' for a reaper)
    MESSAGE = b"message"  # why, in words


class BatchField:
    """Fields of a batch's state hash (`Keys.batch`) that the record script increments (it gets one in ARGV)."""

    COMPLETED = "completed"  # lines answered
    FAILED = "failed"  # lines that failed


class Nudge:
    """Messages on the pub/sub channels: what a worker may tell apart on one connection."""

    COMMAND = b"command"  # on `Keys.control_channel`: re-read the control state
    CANCEL = b"cancel"  # on `Keys.cancel_channel`: read new tombstones
    WEIGHT_ORDER = b"order"  # on `Keys.weights_channel`: a weight sync order was written
    WEIGHT_MANIFEST = b"manifest"  # ... a broadcast's tensors were announced
    WEIGHT_LOAD = b"load"  # ... a staged sync's members may load what they received (the fleet is paused)
    WEIGHT_COMMIT = b"commit"  # ... a weight version was committed
    CATCH_UP = b"catch-up"  # ... a stale worker asks a peer for the committed version (`Keys.weight_catch_ups`)


class ScriptReply:
    """The first element of a placement script's reply (`dataplane.scripts`)."""

    OK = b"ok"
    FULL = b"full"  # a target stream is over the admission limit: nothing was added


class StreamSyntax:
    """Redis Streams' own spellings the scripts use: XREADGROUP's "new entries", XRANGE's exclusive start, the
    first id, and the fields of XINFO GROUPS they read."""

    NEW = ">"
    EXCLUSIVE = "("
    FIRST_ID = "0-0"
    GROUP_NAME = "name"
    LAST_DELIVERED_ID = "last-delivered-id"
    PENDING = "pending"


class EnqueueKind:
    """The kind of an item of the enqueue script (`dataplane.scripts.ENQUEUE_LUA`): which stream it goes to."""

    ROLLOUT = "g"  # a rollout request: the shared stream, or its session's worker's pinned stream
    FORWARD = "f"  # a session's request sent on to the worker holding the session: there even while it drains
    TOKENS = "t"  # a tokenize, detokenize or chat-template request: the token requests stream


_MODULE_NAMES = {
    "PAYLOAD_FIELD": PAYLOAD_FIELD,
    "SESSION_FIELD": SESSION_FIELD,
    "EPOCH_FIELD": EPOCH_FIELD,
    "DELIVERIES_FIELD": DELIVERIES_FIELD,
    "COST_FIELD": COST_FIELD,
    "PINNED_SUFFIX": PINNED_SUFFIX,
    "HOLDS_SUFFIX": HOLDS_SUFFIX,
    "WIDEST_FIELD": WIDEST_FIELD,
    "NARROWEST_FIELD": NARROWEST_FIELD,
    "IN_SUFFIX": IN_SUFFIX,
    "SUM_FIELD": SUM_FIELD,
    "WEIGHTS_FIELD": WEIGHTS_FIELD,
    "KV_SUM_FIELD": KV_SUM_FIELD,
    "KV_COUNT_FIELD": KV_COUNT_FIELD,
    "QUEUED_FIELD": QUEUED_FIELD,
    "MAX_COST": str(MAX_COST),
    "JOINED": JOINED,
    "LOADED": LOADED,
    "OK": OK,
}
_GROUPS = (HeartbeatField, StateField, DeadLetterField, BatchField, Nudge, ScriptReply, EnqueueKind, StreamSyntax)
# Every name above by what a script calls it (`PAYLOAD_FIELD`, `HeartbeatField.STATE`), as text.
LUA_NAMES: Mapping[str, str] = MappingProxyType(
    {
        name: value.decode() if isinstance(value, bytes) else value
        for name, value in [
            *_MODULE_NAMES.items(),
            *((f"{g.__name__}.{a}", v) for g in _GROUPS for a, v in vars(g).items() if a.isupper()),
            *((f"WorkerLabel.{label.upper()}", label) for label in get_args(WorkerLabel)),
        ]
    }
)


class _LuaTemplate(Template):
    idpattern = r"(?:[A-Z][A-Za-z]*\.)?[A-Z][A-Z_]*"
    flags = re.RegexFlag(0)  # case-sensitive: a placeholder is exactly a name of LUA_NAMES


def lua(template: str) -> str:
    """A Lua script with its names filled in: `${HeartbeatField.STATE}` becomes `state` (a name of `LUA_NAMES`);
    `$$` is a `$`. Raises KeyError for a name this module does not define, ValueError for a stray `$`."""
    return _LuaTemplate(template).substitute(LUA_NAMES)


DEFAULT_SHARD = "g0"  # the shard of one Redis, and of a worker that names none


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix (default `rollout`), so several deployments can share a Redis, and of one shard.

    A shard is a group of workers whose keys share one Redis Cluster hash tag: `{prefix}:{{shard}}:...` (e.g.
    `rollout:{g3}:requests`), so every key a script touches, and every multi-key command, stays in one slot. Keys
    outside every shard (the shard set, batch jobs and files) carry no tag. One Redis is the one-shard case (`g0`).
    """

    prefix: str = "rollout"
    shard: str = DEFAULT_SHARD

    @property
    def tagged(self) -> str:
        """The prefix of this shard's keys: `{prefix}:{{shard}}` (Redis Cluster hashes only the part in braces)."""
        return f"{self.prefix}:{{{self.shard}}}"

    def of_shard(self, shard: str) -> Keys:
        """The same prefix's keys of another shard."""
        return Keys(self.prefix, shard)

    @property
    def shards(self) -> str:
        """Set of every shard a worker registered in (untagged: one key for the whole deployment)."""
        return f"{self.prefix}:shards"

    # --- data plane -------------------------------------------------------------------------------------

    @property
    def requests(self) -> str:
        """Stream of rollout requests any worker may take."""
        return f"{self.tagged}:requests"

    def pinned_requests(self, worker_id: str) -> str:
        """Stream of rollout requests pinned to one worker (their session lives there)."""
        return f"{self.tagged}:requests:{worker_id}"

    @property
    def loads(self) -> str:
        """Hash: field ID -> the work worker ID holds (tokens to prefill and to generate), ID:pinned -> the tokens
        placed in its pinned stream that it has not taken, ID:holds -> what its engine holds:
        what a take's fair share (`take.TAKE_LUA`) and a new session's worker (`placement.PLACE_LUA`) come from,
        with the open workers' sums (`dataplane.levels`)."""
        return f"{self.tagged}:loads"

    @property
    def levels(self) -> str:
        """Sorted set: each open worker (said it has a free slot) scored by its level, its load over its weight
        (`dataplane.levels`): the least loaded is the first, read in O(log W)."""
        return f"{self.tagged}:levels"

    @property
    def open_at(self) -> str:
        """Sorted set: each open worker scored by when it last said so (unix ms, Redis's clock): the silent ones are
        found first, to be closed once their word is older than the heartbeat TTL."""
        return f"{self.tagged}:open-at"

    @property
    def queued_costs(self) -> str:
        """List: "entry-id cost" of each entry added to the shared requests stream and not yet taken, in stream order
        (the enqueue script pushes, takes trim): a take weighs its share by these without reading the entries
        (`take.TAKE_LUA`, which rebuilds it from the entries when it stops matching them)."""
        return f"{self.tagged}:queued-costs"

    @property
    def token_requests(self) -> str:
        """Stream of tokenize / detokenize / chat-template requests: served even while the fleet is paused."""
        return f"{self.tagged}:token-requests"

    def results(self, producer_id: str) -> str:
        """Stream of results for one producer."""
        return f"{self.tagged}:results:{producer_id}"

    def session(self, session_id: str) -> str:
        """String, with TTL: the worker a session is pinned to."""
        return f"{self.tagged}:session:{session_id}"

    @property
    def dead(self) -> str:
        """Stream of dead letters: undecodable entries and entries over `max_deliveries`."""
        return f"{self.tagged}:dead"

    # --- batch jobs (RQ) and their files ----------------------------------------------------------------------

    def file(self, file_id: str) -> str:
        """Hash: an uploaded or produced JSONL file (`content`, `filename`, `purpose`, `bytes`, `created_at`)."""
        return f"{self.prefix}:file:{file_id}"

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's state (status, counts, timestamps, input and output file ids, output path)."""
        return f"{self.prefix}:batch:{batch_id}"

    def batch_output(self, batch_id: str) -> str:
        """Hash: custom_id -> its output line (JSON); written once per custom_id, which makes lines exactly-once."""
        return f"{self.prefix}:batch:{batch_id}:output"

    def batch_submitted(self, batch_id: str) -> str:
        """Set: the custom_ids marked just before their requests are sent (a resumed run awaits those Redis holds)."""
        return f"{self.prefix}:batch:{batch_id}:submitted"

    def batch_lease(self, batch_id: str) -> str:
        """String, with TTL: held by the one run of a batch that is alive (its token), refreshed while it runs."""
        return f"{self.prefix}:batch:{batch_id}:lease"

    @property
    def batches(self) -> str:
        """Sorted set: every batch id, scored by its creation time (unix s)."""
        return f"{self.prefix}:batches"

    @property
    def batch_queue(self) -> str:
        """The RQ queue name that batch jobs go to (RQ keeps its own keys under `rq:`)."""
        return f"{self.prefix}-batches"

    # --- the Responses API's stored responses (`api.response_store`) ----------------------------------------

    def response(self, response_id: str) -> str:
        """String (JSON), with TTL: a stored response of `POST /v1/responses`, its conversation and its session."""
        return f"{self.prefix}:response:{response_id}"

    # --- named steps (`RolloutClient.generate(..., step_id=)`) ------------------------------------------------

    def step(self, step_id: str) -> str:
        """Hash, with TTL: a named step's requests (`requests`: a msgpack list of their envelopes, in order) and the
        attempt each position is awaited under (`a:<index>` -> request id), for a client that attaches to it."""
        return f"{self.prefix}:step:{step_id}"

    @property
    def steps(self) -> str:
        """Sorted set: every named step, scored by when its record expires unless renewed (unix s)."""
        return f"{self.prefix}:steps"

    @property
    def steps_expired(self) -> str:
        """String: how many named steps expired unattached, their results left uncollected (a counter)."""
        return f"{self.prefix}:steps:expired"

    # --- workers ----------------------------------------------------------------------------------------

    def worker(self, worker_id: str) -> str:
        """Hash, with TTL: a worker's heartbeat and applied control state. Its existence is the worker's liveness."""
        return f"{self.tagged}:worker:{worker_id}"

    def worker_sessions(self, worker_id: str) -> str:
        """Sorted set: the sessions pinned to a worker, scored by their expiry (unix ms)."""
        return f"{self.tagged}:worker-sessions:{worker_id}"

    @property
    def workers(self) -> str:
        """Set of every worker id that registered and has not been reaped yet (live or dead)."""
        return f"{self.tagged}:workers"

    def reap_lock(self, worker_id: str) -> str:
        """String, with TTL: held by the live worker that reclaims a dead worker's requests."""
        return f"{self.tagged}:reap:{worker_id}"

    @property
    def reap_turn(self) -> str:
        """String, with TTL (most of a heartbeat interval): held by the one live worker whose turn it is to look for
        dead workers, so that the fleet looks once an interval, not once per worker (W^2 reads of heartbeats)."""
        return f"{self.tagged}:reap-turn"

    @property
    def load_keys(self) -> list[str]:
        """The loads hash, the open workers' two sorted sets and the queued costs, in the order
        `dataplane.levels.with_levels` binds them: what every script that changes a load declares."""
        return [self.loads, self.levels, self.open_at, self.queued_costs]

    @property
    def fleet(self) -> list[str]:
        """The keys a placement script declares: the state hash, the loads hash, the two sorted sets of open
        workers (`levels`, `open_at`) and the queued costs. The keys of the one worker it places on (its heartbeat
        hash, session set and pinned stream) it builds from `worker_stems`: they share this shard's hash tag, so one
        slot holds them all."""
        return [self.state, *self.load_keys]

    @property
    def worker_stems(self) -> list[str]:
        """What a worker's heartbeat hash, session set and pinned stream are named by, less the worker id."""
        return [self.worker(""), self.worker_sessions(""), self.pinned_requests("")]

    # --- control plane ----------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """Hash: the fleet's desired control state (epoch, pause holders, sleep level)."""
        return f"{self.tagged}:state"

    @property
    def commands(self) -> str:
        """Sorted set: the recent control commands (msgpack), scored by the epoch each produced."""
        return f"{self.tagged}:commands"

    @property
    def cancelled(self) -> str:
        """Sorted set: tombstones of request ids their producer cancelled, scored by expiry (unix ms)."""
        return f"{self.tagged}:cancelled"

    @property
    def control_channel(self) -> str:
        """Pub/sub channel that nudges workers to re-read the control state (at most once: a nudge only)."""
        return f"{self.tagged}:control"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel on which a producer nudges workers to read new tombstones (apart from `control_channel`,
        so that a producer's Redis user may cancel without being able to nudge the control plane)."""
        return f"{self.tagged}:cancel"

    # --- weight sync ------------------------------------------------------------------------------------------
    # The committed weight version (and the checkpoint it came from, or its digest) are fields of `state`.

    @property
    def weight_sync(self) -> str:
        """String: the current weight sync order (msgpack `WeightSyncOrder`), kept until the next one."""
        return f"{self.tagged}:weight-sync"

    def engine_group(self, master: str) -> str:
        """String, with TTL (the sync timeout): the `rank_offset` at which a `serve` made the fleet join the NCCL group
        of the trainer at `master` (`address:port`), so that a second `serve` of the same fleet asked to join it
        again (SkyRL given two replicas in `server_urls`) is refused rather than join every engine twice."""
        return f"{self.tagged}:engine-group:{master}"

    def weight_manifest(self, sync_id: str) -> str:
        """String, with TTL: the tensors a broadcast sync announces (msgpack `WeightManifest`)."""
        return f"{self.tagged}:weight-sync:{sync_id}:manifest"

    def weight_barrier(self, sync_id: str, phase: str) -> str:
        """Hash, with TTL: one field per worker that reached `phase` (joined, received, loaded) of a sync; "ok" or
        the error it met."""
        return f"{self.tagged}:weight-sync:{sync_id}:{phase}"

    def weight_load(self, sync_id: str) -> str:
        """String: written once the fleet is paused for a staged sync (`WeightSyncOrder.staged`): load now."""
        return f"{self.tagged}:weight-sync:{sync_id}:load"

    @property
    def weight_catch_ups(self) -> str:
        """Hash: one field per stale worker catching up from a peer (`workers.catch_up`), its msgpack
        `CatchUpOrder`; the worker deletes it once done."""
        return f"{self.tagged}:weight-catch-ups"

    def weight_catch_up_answer(self, catch_up_id: str) -> str:
        """String, with TTL: a peer's answer to a catch-up order (msgpack `CatchUpAnswer`)."""
        return f"{self.tagged}:weight-catch-up:{catch_up_id}"

    @property
    def weights_channel(self) -> str:
        """Pub/sub channel: a nudge that a weight sync order, manifest or commit was written (at most once)."""
        return f"{self.tagged}:weights"

    @property
    def acks_channel(self) -> str:
        """Pub/sub channel on which workers announce the epoch they applied (issuers also poll the hashes)."""
        return f"{self.tagged}:acks"
