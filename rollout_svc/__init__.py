"""rollout-svc: a Redis-Streams rollout service for RL of LLMs. Never imports vllm or torch."""

from rollout_svc.client import RolloutClient, SyncRolloutClient
from rollout_svc.config import Settings
from rollout_svc.errors import (
    ControlCommandError,
    ControlTimeoutError,
    EngineDeadError,
    GenerationError,
    InvalidRequestError,
    ProtocolError,
    QueueFullError,
    RequestTimeoutError,
    RolloutError,
)
from rollout_svc.protocol import SamplingParams, Trajectory, WorkerStatus

__all__ = [
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
    "SyncRolloutClient",
    "Trajectory",
    "WorkerStatus",
]
__version__ = "0.1.0"
