"""The bodies of SkyRL's calls as vLLM's server takes them: token-in, token-out generate, and the weight routes.

Sources: vLLM 0.32's `entrypoints/scale_out/token_in_token_out/protocol.py` (`GenerateRequest`) and
`entrypoints/rl/online/api_router.py` (the weight transfer routes); SkyRL 0.3.0's `remote_inference_client.py` (what
it sends) and its worker extension (`NewInferenceWorkerWrap`: the `collective_rpc` methods). Each body refuses a
field it does not know, by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from rollout_svc.openai.schemas import Body, TokenId

# SkyRL's worker extension methods (`NewInferenceWorkerWrap`) that wrap vLLM's native calls: served as those calls
SKYRL_RPC = ("skyrl_start_weight_update", "update_weights_nccl", "skyrl_finish_weight_update")


class GenerateBody(Body):
    """`POST /inference/v1/generate` (vLLM's `GenerateRequest`, the fields SkyRL sends and a few more; any other
    field is refused by name)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    session_id: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    stream: bool | None = False
    return_token_ids: bool | None = None
    output_mode: str = "tokens"
    priority: int = 0
    features: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class FetchWeightsBody(Body):
    """`POST /fetch_weights` (SkyRL's surface): every worker loads the checkpoint at `path` (a directory holding
    `model.safetensors`, under their `ROLLOUT_CHECKPOINT_ROOT`) as `weight_version` (default: the committed version
    plus one), paused as `pause_mode` says meanwhile. Unknown fields are refused (a misspelt version must not load as
    the next one)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(min_length=1)
    weight_version: int | None = Field(None, ge=1, lt=2**63)
    pause_mode: Literal["keep", "abort", "wait"] = "keep"
    stable_wait_s: float | None = Field(None, ge=0, allow_inf_nan=False)  # wait for the folder's STABLE marker

    @model_validator(mode="before")
    @classmethod
    def _not_a_delta(cls, data: Any) -> Any:
        if isinstance(data, dict) and "target_version" in data and "path" not in data:
            raise ValueError(
                "SkyRL 0.4's checkpoint-delta fetch (target_version, sync_dir, uri) is not served: write a whole "
                "checkpoint under the workers' checkpoint root and send {path, weight_version}, or sync by NCCL"
            )
        return data


class CheckpointWeightsBody(Body):
    """`POST /update_weights` as prime-rl's inference server takes it: `weight_dir`, a Hugging Face folder (one
    `model.safetensors`, or shards and their index) every worker loads; ours besides, as `/fetch_weights`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    weight_dir: str = Field(min_length=1)
    weight_version: int | None = Field(None, ge=1, lt=2**63)
    pause_mode: Literal["keep", "abort", "wait"] = "keep"
    stable_wait_s: float | None = Field(None, ge=0, allow_inf_nan=False)


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
    weight-sync methods are served (`SKYRL_RPC`; see `rollout_svc.api.skyrl.weight_routes`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    method: str = Field(min_length=1)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None
