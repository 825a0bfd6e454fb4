"""Every Redis key, stream field, consumer group and channel name that rollout-svc uses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WORKERS_GROUP = "workers"  # the consumer group on every requests stream
# Fields of a request entry. Only `m` is the message; the others let Redis-side code (placement, requeue,
# abort sweeps) act on an entry without decoding it.
PAYLOAD_FIELD = b"m"  # the msgpack envelope (rollout_svc.protocol)
SESSION_FIELD = b"s"  # the request's session id, absent without one
EPOCH_FIELD = b"e"  # the control epoch when the request was first enqueued (abort scope)
DELIVERIES_FIELD = b"d"  # deliveries before this entry was requeued (a dead worker had it), absent if none


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

    def fleet(self, worker_ids: Sequence[str]) -> list[str]:
        """The keys a placement script declares: the state hash, the workers set, then per worker (in the
        order given) its heartbeat hash, its session set and its pinned stream."""
        keys = [self.state, self.workers]
        for worker_id in worker_ids:
            keys += [self.worker(worker_id), self.worker_sessions(worker_id), self.pinned_requests(worker_id)]
        return keys

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
    # The committed weight version (and the checkpoint it came from) are fields of `state`.

    @property
    def weight_sync(self) -> str:
        """String: the current weight sync order (msgpack `WeightSyncOrder`), kept until the next one."""
        return f"{self.tagged}:weight-sync"

    def weight_manifest(self, sync_id: str) -> str:
        """String, with TTL: the tensors a broadcast sync announces (msgpack `WeightManifest`)."""
        return f"{self.tagged}:weight-sync:{sync_id}:manifest"

    def weight_barrier(self, sync_id: str, phase: str) -> str:
        """Hash, with TTL: one field per worker that reached `phase` (joined, loaded) of a sync; value "ok" or
        the error it met."""
        return f"{self.tagged}:weight-sync:{sync_id}:{phase}"

    @property
    def weights_channel(self) -> str:
        """Pub/sub channel: a nudge that a weight sync order, manifest or commit was written (at most once)."""
        return f"{self.tagged}:weights"

    @property
    def acks_channel(self) -> str:
        """Pub/sub channel on which workers announce the epoch they applied (issuers also poll the hashes)."""
        return f"{self.tagged}:acks"
