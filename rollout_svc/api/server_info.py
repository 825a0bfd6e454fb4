"""vLLM's `GET /server_info` (a dev route of `vllm serve`), as TRL reads it: the fleet's engines as one `VllmConfig`.

TRL 1.16's `VLLMClient.get_server_info` reads `vllm_config.weight_transfer_config` (None: no weight-transfer engine,
and `init_communicator` raises its own error naming the flag), `model_config.dtype` and `logprobs_mode`, `lora_config`
and `parallel_config.data_parallel_size`. vLLM dumps its whole resolved config (`PydanticVllmConfig.dump_python(...,
mode="json")`, `vllm/entrypoints/serve/dev/server_info/api_router.py`); here each worker's heartbeat carries the
settings it resolved (`WorkerStatus.engine_config`) and this route puts the live ones together.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from rollout_svc.api.served import ServedModels
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.openai.errors import APIError
from rollout_svc.protocol import WorkerStatus


def engine_settings(worker: WorkerStatus) -> dict[str, str]:
    """A worker's `engine_config` (`dtype=bfloat16 quantization=none ...`) as a dict; {} for the echo and sim engines,
    which resolve none."""
    return dict(item.partition("=")[::2] for item in worker.engine_config.split() if "=" in item)


def fleet_vllm_config(workers: list[WorkerStatus], served_name: str | None) -> dict[str, Any]:
    """The `vllm_config` a `vllm serve` of these engines would report, as JSON: the first engine's model settings,
    the largest tensor and pipeline parallel sizes, every data-parallel replica of the fleet in
    `data_parallel_size` (each engine is one or more: a request reaches one, a control call all), a LoRA config
    only where every engine serves LoRA (the smallest rank and slot count), and a weight-transfer config only where
    every engine was started with vLLM's NCCL engine (`--weight-transfer-backend nccl`)."""
    settings = [engine_settings(w) for w in workers]
    first = settings[0]
    loras = [s.get("lora", "none") for s in settings]
    lora_config = None
    if all(lora != "none" for lora in loras):
        ranks, slots = zip(*(tuple(int(x) for x in lora.split("x")) for lora in loras), strict=True)
        lora_config = {"max_lora_rank": min(ranks), "max_loras": min(slots)}
    transfers = {s.get("weight_transfer", "none") for s in settings}
    tp = max(w.tensor_parallel_size for w in workers)
    pp = max(w.pipeline_parallel_size for w in workers)
    return {
        "model_config": {
            "model": workers[0].model,
            "served_model_name": served_name,
            "dtype": f"torch.{first['dtype']}" if "dtype" in first else None,
            "quantization": None if first.get("quantization", "none") == "none" else first["quantization"],
            "max_model_len": max(w.max_model_len for w in workers),
            "logprobs_mode": first.get("logprobs_mode", "raw_logprobs"),
        },
        "parallel_config": {
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "data_parallel_size": sum(w.data_parallel_size for w in workers),
            "world_size": tp * pp,
        },
        "cache_config": {"enable_prefix_caching": first.get("prefix_caching", "on") == "on"},
        "scheduler_config": {"max_num_seqs": max(w.max_num_seqs for w in workers)},
        "lora_config": lora_config,
        "weight_transfer_config": {"backend": "nccl"} if transfers == {"nccl"} else None,
    }


def server_info_router(client: RolloutClient, served: ServedModels) -> APIRouter:
    """`GET /server_info?config_format=json|text`: `{"vllm_config", "vllm_env", "system_env"}` as vLLM answers it
    (`vllm_env` and `system_env` empty: the engines' environments are their hosts'), its `served_model_name` the
    name `/v1/models` lists first. 503 while no worker is live."""
    router = APIRouter()

    @router.get("/server_info")
    async def server_info(config_format: Annotated[Literal["text", "json"], Query()] = "text") -> dict[str, Any]:
        workers = await client.workers()
        if not workers:
            raise APIError(503, "no live worker: start one with `rollout-svc worker`", code="no_worker")
        config = fleet_vllm_config(workers, await served.first())
        shown: Any = config if config_format == "json" else str(config)
        return {"vllm_config": shown, "vllm_env": {}, "system_env": {}}

    return router
