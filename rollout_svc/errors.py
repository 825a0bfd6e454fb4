"""The few errors of rollout-svc, each saying whether retrying can help."""

from __future__ import annotations


class RolloutError(Exception):
    """Base of every rollout-svc error.

    `recoverable` tells the caller whether the same call may succeed later (a full queue, a timeout)
    or will fail again until something is changed (bad input, a wrong model, a protocol mismatch).
    """

    recoverable: bool = False


class InvalidRequestError(RolloutError, ValueError):
    """The request is malformed (bad sampling params, empty prompt, prompt longer than the context).

    Fix the input; sending it again unchanged fails again.
    """

    recoverable = False


class ModelNotFoundError(InvalidRequestError):
    """The request names a model or LoRA adapter the fleet does not serve (HTTP 404, as vLLM answers). Load the
    adapter first (`rollout-svc adapter load`), or name one `rollout-svc adapter list` or `/v1/models` shows."""

    def __init__(self, name: str, known: list[str] | None = None) -> None:
        self.name = name
        served = f"; served: {', '.join(known)}" if known else ""
        super().__init__(f"the model `{name}` does not exist (no base model or loaded adapter of that name){served}")


class ProtocolError(RolloutError):
    """A message could not be decoded: not msgpack, unknown type, or another schema version."""

    recoverable = False


class QueueFullError(RolloutError):
    """Admission was refused: the requests stream already holds `max_queued_requests` entries.

    Back off and retry, or add workers. Maps to HTTP 429.
    """

    recoverable = True

    def __init__(self, stream: str, queued: int, limit: int) -> None:
        self.stream, self.queued, self.limit = stream, queued, limit
        super().__init__(
            f"{stream} holds {queued} queued requests (limit {limit}); retry later, add workers, "
            "or raise ROLLOUT_MAX_QUEUED_REQUESTS"
        )


class RequestTimeoutError(RolloutError, TimeoutError):
    """Some requests got no result within their timeout.

    `request_ids` names them; `completed` maps request id -> result for those that did finish,
    so a caller loses nothing that was generated.
    """

    recoverable = True

    def __init__(self, request_ids: list[str], timeout_s: float, completed: dict | None = None) -> None:
        self.request_ids, self.timeout_s = request_ids, timeout_s
        self.completed = completed or {}
        shown = ", ".join(request_ids[:5]) + (" ..." if len(request_ids) > 5 else "")
        super().__init__(
            f"{len(request_ids)} request(s) got no result within {timeout_s:g} s ({shown}); "
            "check that workers are running with `rollout-svc status`, or raise timeout_s"
        )


class GenerationError(RolloutError):
    """A worker answered a request with an error result (raised only when the caller asks for it)."""

    def __init__(self, request_id: str, code: str, message: str, recoverable: bool) -> None:
        self.request_id, self.code = request_id, code
        self.recoverable = recoverable
        super().__init__(f"request {request_id} failed ({code}): {message}")


class EngineDeadError(RolloutError):
    """The engine inside a worker died; the worker process must exit so its requests are reclaimed."""

    recoverable = False


class ControlTimeoutError(RolloutError, TimeoutError):
    """Some live workers did not acknowledge a control command in time.

    `workers` names them. The desired state stays written in Redis, so nothing is half applied unreported:
    retry the command (it converges), or wait until a stalled worker's heartbeat expires and it is reaped.
    """

    recoverable = True

    def __init__(self, kind: str, epoch: int, workers: list[str], timeout_s: float, heartbeat_ttl_s: float) -> None:
        self.kind, self.epoch, self.workers, self.timeout_s = kind, epoch, workers, timeout_s
        super().__init__(
            f"{kind} (epoch {epoch}) was not acknowledged within {timeout_s:g} s by {len(workers)} worker(s): "
            f"{', '.join(workers)}. The desired state stays written: retry the command, check those workers with "
            f"`rollout-svc status`, or wait {heartbeat_ttl_s:g} s (the heartbeat TTL) for a stalled one to be reaped"
        )


class ControlCommandError(RolloutError):
    """Some workers applied a control command and reported that it failed (say, a prefix-cache reset refused).

    `failures` maps worker id -> the worker's message.
    """

    recoverable = True

    def __init__(self, kind: str, epoch: int, failures: dict[str, str]) -> None:
        self.kind, self.epoch, self.failures = kind, epoch, failures
        detail = "; ".join(f"{w}: {message}" for w, message in sorted(failures.items()))
        super().__init__(f"{kind} (epoch {epoch}) failed on {len(failures)} worker(s): {detail}")


class WeightSyncError(RolloutError):
    """A weight sync failed: no live worker loaded the new weights (the old version stays committed), or the
    trainer's side of the transfer failed. `failures` maps each worker to what went wrong there ("dead" for one
    whose heartbeat expired during the sync)."""

    def __init__(self, version: int, message: str, failures: dict[str, str] | None = None) -> None:
        self.version, self.failures = version, dict(failures or {})
        named = "; ".join(f"{w}: {why}" for w, why in sorted(self.failures.items()))
        super().__init__(f"weight sync to version {version} failed: {message}" + (f" ({named})" if named else ""))


class ControlStateMissingError(RolloutError):
    """The control state hash is missing from Redis (it restarted without its data): the workers write back what they
    last applied within a heartbeat interval. Nothing was written; retry then."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(
            f"the control state {key} is missing from Redis (it restarted empty); the workers write it back within a "
            "heartbeat interval: retry then"
        )


class AccessDeniedError(RolloutError):
    """Redis refused a command for lack of permission: the Redis user of this connection (its URL's `user:`) may
    not do `action`; the `role` user may (see `rollout_svc.connections.acl`). Nothing was written.

    Retrying with the same credentials fails again: connect with the `role` user's URL.
    """

    recoverable = False

    def __init__(self, action: str, role: str, detail: str) -> None:
        self.action, self.role = action, role
        super().__init__(
            f"Redis refused {action}: the Redis user of this connection lacks the permission ({detail}). Only the "
            f"`{role}` user may do this: connect with its URL (`rollout-svc up --acl` writes it to its credentials "
            "file; see docs/acl.md, 'Redis ACL users')"
        )
