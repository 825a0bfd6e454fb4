"""rollout-svc: a Redis-Streams rollout service for RL of LLMs. Never imports vllm or torch (`WeightSender` and
`SyncReport` are imported from `rollout_svc.client.weight_sender` on first use; a broadcast imports torch)."""

from typing import TYPE_CHECKING, Any

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.client.sync_client import SyncRolloutClient
from rollout_svc.config import Settings
from rollout_svc.errors import (
    AccessDeniedError,
    ControlCommandError,
    ControlTimeoutError,
    EngineDeadError,
    GenerationError,
    InvalidRequestError,
    ProtocolError,
    QueueFullError,
    RequestTimeoutError,
    RolloutError,
    WeightSyncError,
)
from rollout_svc.protocol import SamplingParams, Trajectory, WorkerStatus

if TYPE_CHECKING:  # torch is imported only when WeightSender is used
    from rollout_svc.client.weight_sender import SyncReport, WeightSender

__all__ = [
    "AccessDeniedError",
    "ControlCommandError",
    "ControlTimeoutError",
    "EngineDeadError",
    "GenerationError",
    "InvalidRequestError",
    "ProtocolError",
    "QueueFullError",
    "RequestTimeoutError",
    "RolloutClient",
    "RolloutError",
    "SamplingParams",
    "Settings",
    "SyncReport",
    "SyncRolloutClient",
    "Trajectory",
    "WeightSender",
    "WeightSyncError",
    "WorkerStatus",
]


def __getattr__(name: str) -> Any:
    if name in ("WeightSender", "SyncReport"):
        from rollout_svc.client import weight_sender as weights

        return getattr(weights, name)
    raise AttributeError(f"module 'rollout_svc' has no attribute {name!r}")


__version__ = "0.1.0"
