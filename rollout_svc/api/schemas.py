"""Bodies of the admin routes (`/admin/*`): the control plane's commands and a checkpoint load, over HTTP."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout_svc.config import MAX_LEASE_S
from rollout_svc.openai.schemas import Body


class PauseBody(Body):
    mode: Literal["keep", "abort", "wait"] = "keep"
    holder: str = Field("operator", min_length=1)
    timeout_s: float | None = Field(None, gt=0)
    lease_s: float = Field(
        0.0, ge=0, le=MAX_LEASE_S, description="> 0: the pause lapses this long after it was issued unless resumed"
    )


class ResumeBody(Body):
    holder: str = Field("operator", min_length=1)
    timeout_s: float | None = Field(None, gt=0)


class AbortBody(Body):
    request_ids: list[str] | None = None
    session_id: str | None = None
    all: bool = False
    timeout_s: float | None = Field(None, gt=0)


class SleepBody(Body):
    level: int = Field(1, ge=1, le=2)
    mode: Literal["keep", "abort", "wait"] = "abort"
    timeout_s: float | None = Field(None, gt=0)


class WakeUpBody(Body):
    tags: list[Literal["weights", "kv_cache"]] | None = None
    timeout_s: float | None = Field(None, gt=0)


class ResetPrefixCacheBody(Body):
    reset_running_requests: bool = False
    timeout_s: float | None = Field(None, gt=0)


class CheckpointBody(Body):
    """`POST /admin/weights/checkpoint`: every worker loads `path` (a directory holding `model.safetensors`, under
    their `ROLLOUT_CHECKPOINT_ROOT`) as weight `version`, paused as `pause_mode` says meanwhile."""

    path: str = Field(min_length=1)
    version: int = Field(ge=1, lt=2**63)
    pause_mode: Literal["keep", "abort", "wait"] = "keep"
