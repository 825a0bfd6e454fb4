"""SkyRL's weight routes on `serve`, fleet-wide: load a checkpoint, drive vLLM's native trainer-led transfer, and
read the committed weight version.

`POST /fetch_weights` (a body `{"path", "weight_version"?, "pause_mode"?, "stable_wait_s"?}`): every live worker
loads the checkpoint at `path` (a directory holding `model.safetensors`, or shards and their
`model.safetensors.index.json`, under the workers' `ROLLOUT_CHECKPOINT_ROOT`; a path outside it is refused by each
worker, as for `WeightSender.update_from_checkpoint`), the fleet paused meanwhile (`keep` by default), and the version
is committed once every worker loaded it; with `stable_wait_s`, each worker first waits that long for the folder's
`STABLE` marker and refuses it without. `POST /update_weights {"weight_dir", ...}` is the same, as prime-rl's
inference server takes it. `GET /weight_info`: vLLM 0.32's, the committed version as a string.

vLLM 0.32's native weight transfer, as SkyRL's trainer drives it (`EngineWeightTransfer`; the workers' engines need
`--weight-transfer-backend nccl`, on CUDA): `POST /init_weight_transfer_engine` `{init_info}`,
`/start_weight_update`, `/update_weights` `{update_info}`, `/finish_weight_update` `{weight_version?}` (commits the
next version), `/shutdown_weight_transfer_engine`, and `/collective_rpc` for the three methods of SkyRL's worker
extension that wrap them (`skyrl_start_weight_update`, `update_weights_nccl`, `skyrl_finish_weight_update`). Any other
method is refused (400), `update_weights_ipc` among them: its CUDA IPC handles are pickled, and nothing that crossed
a process boundary is unpickled here. A call that a worker failed (an engine without the backend, vLLM's error, a
worker that died) answers 409 naming each worker.

Behind the same rule as the control routes (the admin token, or `serve --open-control` on loopback).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body
from pydantic import BaseModel, ValidationError

from rollout_svc.api.admin import sync_from_checkpoint
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.errors import WeightSyncError
from rollout_svc.integrations.skyrl.shapes import (
    SKYRL_RPC,
    CheckpointWeightsBody,
    CollectiveRpcBody,
    FetchWeightsBody,
    FinishWeightUpdateBody,
    InitWeightTransferBody,
    UpdateWeightsBody,
)
from rollout_svc.integrations.skyrl.weights import EngineWeightTransfer
from rollout_svc.openai.errors import APIError, invalid_body

M = TypeVar("M", bound=BaseModel)


def parsed(model: type[M], body: dict[str, Any]) -> M:
    """`body` as `model`. Raises `APIError` 400 naming each bad field, as for a body FastAPI validates."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from exc


def weights_router(client: RolloutClient, transfer: EngineWeightTransfer) -> APIRouter:
    """`transfer`: the server's one `EngineWeightTransfer` (it holds the members of the last init, and the world size
    `/get_world_size` last answered)."""
    router = APIRouter(tags=["skyrl", "control"])  # "control": the admin token's routes, outside /admin

    async def call(name: str, made: Awaitable[Any]) -> Any:
        try:
            return await made
        except WeightSyncError as exc:
            raise APIError(409, f"{name}: {exc}", code="weight_sync_failed") from exc

    async def answer(name: str, made: Awaitable[None], message: str) -> dict[str, str]:
        """vLLM's answer to a call that returns nothing: `{"message"}` once every member made it."""
        await call(name, made)
        return {"message": message}

    async def fetch(path: str, body: FetchWeightsBody | CheckpointWeightsBody) -> dict[str, Any]:
        version = body.weight_version or (await client.fleet_state()).weight_version + 1
        report = await sync_from_checkpoint(client, path, version, body.pause_mode, body.stable_wait_s)
        return {"message": "Weights fetched", "weight_version": version, **dataclasses.asdict(report)}

    @router.post("/fetch_weights")
    async def fetch_weights(body: FetchWeightsBody) -> dict[str, Any]:
        """Every live worker loads the checkpoint `path` as `weight_version` (default: the committed version plus
        one); answers once the version is committed, with the sync's report (`loaded`, `stale`, `dead`, seconds).
        400: the version is not above the committed one; 409: no worker loaded it (the old version stays
        committed), naming each worker's reason (a path outside the checkpoint root, no weights in it, no `STABLE`
        marker within `stable_wait_s`)."""
        return await fetch(body.path, body)

    @router.get("/weight_info")
    async def weight_info() -> dict[str, str]:
        """vLLM's: the committed weight version (a string in vLLM's API; ours are integers, 0 before any sync)."""
        return {"weight_version": str((await client.fleet_state()).weight_version)}

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitWeightTransferBody) -> dict[str, Any]:
        """vLLM's: every live worker joins the trainer's NCCL group, from `init_info.rank_offset` on in worker-id
        order (`rank_offsets` in the answer). Blocks until each joined (the trainer joins concurrently). 400: bad
        `init_info`; 409: a worker could not join (its engine has no weight transfer backend, vLLM's error)."""
        offsets = await call("init_weight_transfer_engine", transfer.init(body.init_info))
        return {"message": "Weight transfer initialized", "rank_offsets": offsets}

    @router.post("/start_weight_update")
    async def start_weight_update() -> dict[str, str]:
        """vLLM's: every member of the last init starts a weight update. 400 before an init."""
        return await answer("start_weight_update", transfer.start(), "Weight update started")

    @router.post("/update_weights")
    async def update_weights(body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        """Dispatched on the body: `update_info`, vLLM's: every member receives the tensors it names from the
        trainer's broadcast; `weight_dir`, prime-rl's: every worker loads that checkpoint folder (as
        `/fetch_weights`; `status: ok` added, as prime-rl's server answers). 400 for anything else, naming both."""
        if "update_info" in body:
            update = parsed(UpdateWeightsBody, body)
            return await answer("update_weights", transfer.update(update.update_info), "Weights updated")
        if "weight_dir" in body:
            checkpoint = parsed(CheckpointWeightsBody, body)
            return {"status": "ok", **await fetch(checkpoint.weight_dir, checkpoint)}
        raise APIError(
            400,
            f"update_weights takes update_info (vLLM's NCCL transfer) or weight_dir (a checkpoint folder, as "
            f"prime-rl sends it); got {sorted(body) or 'an empty body'}",
            param="body",
        )

    @router.post("/finish_weight_update")
    async def finish_weight_update(body: FinishWeightUpdateBody | None = None) -> dict[str, Any]:
        """vLLM's: every member finishes the update; the new weights are committed as `weight_version` (default
        the committed one plus one: every token after this is tagged with it)."""
        wanted = int(body.weight_version) if body and body.weight_version is not None else None  # digits: validated
        version = await call("finish_weight_update", transfer.finish(wanted))
        return {"message": "Weight update finished", "weight_version": version}

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict[str, str]:
        """vLLM's: every member leaves the trainer's group."""
        return await answer("shutdown_weight_transfer_engine", transfer.shutdown(), "Weight transfer shut down")

    @router.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcBody) -> dict[str, Any]:
        """vLLM's, for SkyRL's weight-sync methods only: `skyrl_start_weight_update` (kwargs
        `is_checkpoint_format`: true, the default), `update_weights_nccl` (kwargs `update_info`),
        `skyrl_finish_weight_update`. Answers `{"results": [null per member]}` as vLLM's route does."""
        if body.method not in SKYRL_RPC:
            why = (
                " (its CUDA IPC handles are pickled, and this server unpickles nothing: send with the NCCL "
                "broadcast, WeightSender, or /fetch_weights)"
                if body.method == "update_weights_ipc"
                else ""
            )
            served = ", ".join(SKYRL_RPC)
            raise APIError(400, f"collective_rpc {body.method!r} is not served{why}; served: {served}", param="method")
        if body.args:
            raise APIError(
                400, f"collective_rpc {body.method}: pass keyword arguments (kwargs), not args", param="args"
            )
        kwargs = dict(body.kwargs)
        checkpoint_format = kwargs.pop("is_checkpoint_format", True) if body.method == SKYRL_RPC[0] else True
        update_info = kwargs.pop("update_info", None) if body.method == SKYRL_RPC[1] else {}
        if kwargs:
            raise APIError(400, f"collective_rpc {body.method}: unknown kwargs {sorted(kwargs)}", param="kwargs")
        if checkpoint_format is not True:
            why = "is_checkpoint_format=false (kernel-format weights) is not served: send the checkpoint-format tensors"
            raise APIError(400, why, param="kwargs.is_checkpoint_format")
        if not isinstance(update_info, dict):
            raise APIError(400, "update_weights_nccl needs kwargs.update_info (an object)", param="kwargs")
        made = (
            transfer.start()
            if body.method == SKYRL_RPC[0]
            else transfer.update(update_info)
            if body.method == SKYRL_RPC[1]
            else transfer.finish()
        )
        await call(body.method, made)
        return {"results": [None] * len(transfer.members)}

    return router
