"""LoRA adapter routes, as vLLM's server and SkyRL's server actor answer them: `POST /v1/load_lora_adapter`,
`/skyrl/v1/load_lora_adapter` (SkyRL 0.3's client calls this one), `/load_lora_adapter` (prime-rl's server's) and
`/v1/unload_lora_adapter`, fleet-wide
through the control plane (`RolloutClient.load_adapter`: acknowledged by every live worker before the answer).

Loading a name that is loaded already makes a new version of it (SkyRL's in-place reload; vLLM's own route would
refuse without `load_inplace`): requests running on the old version finish on it, new ones take the new one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.openai.errors import APIError


class LoadLoRABody(BaseModel):
    """vLLM's `LoadLoRAAdapterRequest`: the adapter's name and its directory (under the workers' checkpoint root)."""

    model_config = ConfigDict(extra="ignore", strict=True)  # strict: 0.0 is no `load_inplace`, as the schema says
    lora_name: str
    lora_path: str | None = None
    load_inplace: bool = False
    in_memory: bool = False  # SkyRL 0.4's lora.sync_mode=memory: refused (no tensors are staged in the workers)

    def path(self) -> str:
        """The adapter's folder. Raises `APIError` 400 for SkyRL 0.4's `in_memory` load, or no path."""
        if self.in_memory:
            raise APIError(
                400,
                "in_memory adapters (SkyRL's lora.sync_mode=memory) are not served: save the adapter with peft's "
                "save_pretrained under the workers' checkpoint root and load it by lora_path (lora.sync_mode=disk)",
                param="in_memory",
            )
        if not self.lora_path:
            raise APIError(400, "lora_path is required: the adapter's folder", param="lora_path")
        return self.lora_path


class UnloadLoRABody(BaseModel):
    """vLLM's `UnloadLoRAAdapterRequest`."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str
    lora_int_id: int | None = None


def adapter_router(client: RolloutClient) -> APIRouter:
    router = APIRouter(tags=["lora", "control"])

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRABody) -> str:
        """vLLM's: load the adapter on every worker (again: a new version). Answers vLLM's text; 400 for a bad
        name, 409 naming each worker whose load failed."""
        await client.load_adapter(body.lora_name, body.path())
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @router.post("/skyrl/v1/load_lora_adapter")
    async def skyrl_load_lora_adapter(body: LoadLoRABody) -> dict[str, Any]:
        """SkyRL's server actor's: load or reload in place (here: a new version). `lora_int_id` is the version."""
        version = await client.load_adapter(body.lora_name, body.path())
        return {"status": "success", "lora_name": body.lora_name, "lora_int_id": version}

    @router.post("/load_lora_adapter")
    async def prime_rl_load_lora_adapter(body: LoadLoRABody) -> dict[str, str]:
        """prime-rl's inference server's: vLLM's load, a loaded name reloaded in place (here: a new version)."""
        await client.load_adapter(body.lora_name, body.path())
        return {"status": "ok"}

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRABody) -> str:
        """vLLM's: drop the adapter fleet-wide (running requests finish on it). 404 if the fleet holds none of
        that name."""
        await client.unload_adapter(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    return router
