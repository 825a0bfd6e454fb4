"""Every Redis key, stream, consumer group and channel name that rollout-svc uses."""

from __future__ import annotations

from dataclasses import dataclass

WORKERS_GROUP = "workers"  # the consumer group on every requests stream
PAYLOAD_FIELD = b"m"  # the one field of every stream entry: a msgpack envelope


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix (default `rollout`), so several deployments can share a Redis."""

    prefix: str = "rollout"

    @property
    def requests(self) -> str:
        """Stream of requests any worker may take."""
        return f"{self.prefix}:requests"

    def pinned_requests(self, worker_id: str) -> str:
        """Stream of requests pinned to one worker (their session lives there)."""
        return f"{self.prefix}:requests:{worker_id}"

    def results(self, producer_id: str) -> str:
        """Stream of results for one producer."""
        return f"{self.prefix}:results:{producer_id}"

    def session(self, session_id: str) -> str:
        """String, with TTL: the worker a session is pinned to."""
        return f"{self.prefix}:session:{session_id}"

    @property
    def session_prefix(self) -> str:
        return f"{self.prefix}:session:"

    def worker(self, worker_id: str) -> str:
        """Hash, with TTL: a worker's heartbeat. Its existence is the worker's liveness."""
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def worker_prefix(self) -> str:
        return f"{self.prefix}:worker:"

    def worker_sessions(self, worker_id: str) -> str:
        """Sorted set: the sessions pinned to a worker, scored by their expiry (unix ms)."""
        return f"{self.prefix}:worker-sessions:{worker_id}"

    @property
    def worker_sessions_prefix(self) -> str:
        return f"{self.prefix}:worker-sessions:"

    @property
    def workers(self) -> str:
        """Set of every worker id that registered and has not been reaped yet (live or dead)."""
        return f"{self.prefix}:workers"

    def reap_lock(self, worker_id: str) -> str:
        """String, with TTL: held by the live worker that reclaims a dead worker's requests."""
        return f"{self.prefix}:reap:{worker_id}"

    @property
    def dead(self) -> str:
        """Stream of dead letters: undecodable entries and entries over `max_deliveries`."""
        return f"{self.prefix}:dead"
