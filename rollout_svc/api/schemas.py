"""Bodies of the admin routes (`/admin/*`): the control plane's commands and a checkpoint load, over HTTP."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

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


class FetchWeightsBody(Body):
    """`POST /fetch_weights` (SkyRL's surface): every worker loads the checkpoint at `path` (a directory holding
    `model.safetensors`, under their `ROLLOUT_CHECKPOINT_ROOT`) as `weight_version` (default: the committed version
    plus one), paused as `pause_mode` says meanwhile. Unknown fields are refused (a misspelt version must not load as
    the next one)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(min_length=1)
    weight_version: int | None = Field(None, ge=1, lt=2**63)
    pause_mode: Literal["keep", "abort", "wait"] = "keep"


class InitWeightTransferBody(Body):
    """`POST /init_weight_transfer_engine` (vLLM 0.32's): `init_info` as vLLM's NCCL backend takes it
    (`master_address`, `master_port`, `rank_offset`, `world_size`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    init_info: dict[str, Any]


class UpdateWeightsBody(Body):
    """`POST /update_weights` (vLLM 0.32's): `update_info` as vLLM's NCCL backend takes it (`names`, `dtype_names`,
    `shapes`, `packed`, ...)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    update_info: dict[str, Any]


class FinishWeightUpdateBody(Body):
    """`POST /finish_weight_update`: the version the new weights are committed as (default: the committed one plus
    one)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    weight_version: int | str | None = None  # vLLM's is a string: ours are integers, given as one or as its digits

    @field_validator("weight_version")
    @classmethod
    def _integer(cls, value: int | str | None) -> int | None:
        if value is None:
            return None
        if (isinstance(value, str) and not value.isdigit()) or int(value) < 1 or int(value) >= 2**63:
            raise ValueError("weight_version must be a positive integer (or its digits, as vLLM sends it)")
        return int(value)


class CollectiveRpcBody(Body):
    """`POST /collective_rpc` (vLLM's): `method` called on every worker with `args` and `kwargs`. Only SkyRL's
    weight-sync methods are served (see `rollout_svc.api.skyrl_weights`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    method: str = Field(min_length=1)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None
