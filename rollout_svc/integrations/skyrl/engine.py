"""SkyRL's `InferenceEngineInterface` over `RolloutClient` (`RolloutServiceEngine`): a SkyRL trainer or generator
drives the fleet in-process, with no HTTP hop.

The class subclasses SkyRL's abstract one, so it is built, importing SkyRL, on first access
(`rollout_svc.integrations.skyrl.RolloutServiceEngine`, `engine_class`). Checked against SkyRL 0.3.0's
`skyrl/backends/skyrl_train/inference_servers/base.py` (16 abstract members).

Example::

    from rollout_svc import RolloutClient
    from rollout_svc.integrations.skyrl import RolloutServiceEngine

    engine = RolloutServiceEngine(RolloutClient(redis_url="redis://127.0.0.1:6379/0"), model_name="my-model")
    out = await engine.generate({"prompt_token_ids": [[1, 2, 3]], "sampling_params": {"max_tokens": 8}})
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.errors import RolloutError
from rollout_svc.integrations.skyrl.modules import BASE, skyrl_module
from rollout_svc.integrations.skyrl.tokens import render_chat, vllm_sampling_params
from rollout_svc.integrations.skyrl.weights import EngineWeightTransfer
from rollout_svc.openai.errors import APIError, from_exception, invalid_body
from rollout_svc.openai.plans import Plan, chat_plan, completion_plan, raise_for
from rollout_svc.openai.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("rollout_svc.integrations.skyrl")
HOLDER = "skyrl"  # the pause holder of the adapter's pause_generation / pause


class _Engine:
    """The methods of `RolloutServiceEngine` (mixed into SkyRL's `InferenceEngineInterface` on first use).

    `client`: the fleet; `model_name`: the served model's name (what requests' `model` must be); `endpoint_url`: a
    `rollout-svc serve` URL for generators that point HTTP clients at the fleet (`get_endpoint_url`).
    `owns_client`: `teardown` closes the client. Pauses are held as holder `skyrl`.
    """

    def __init__(
        self, client: RolloutClient, model_name: str, *, endpoint_url: str | None = None, owns_client: bool = True
    ) -> None:
        self.client, self._model_name, self.owns_client = client, model_name, owns_client
        self.endpoint_url, self._weight_version = endpoint_url, 0
        self._engine_weights: EngineWeightTransfer | None = None  # made at the first weight call

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def weight_version(self) -> int:
        """SkyRL's client-side count of weight syncs (its trainers call `increment_weight_version` after each);
        the fleet's own committed version is `RolloutClient.fleet_state().weight_version`."""
        return self._weight_version

    def increment_weight_version(self) -> None:
        self._weight_version += 1

    def get_endpoint_url(self) -> str:
        if self.endpoint_url is None:
            raise RuntimeError("no HTTP endpoint: pass endpoint_url, the URL of a `rollout-svc serve` of this fleet")
        return self.endpoint_url

    # --- data plane ------------------------------------------------------------------------------------------

    async def generate(self, input_batch: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        """SkyRL's `InferenceEngineInput` -> `InferenceEngineOutput`: token-id prompts (`prompt_token_ids`) or
        conversations (`prompts`), vLLM's `sampling_params`, `session_ids` pinning each to one worker. Raises
        `ValueError` for what is not served (n > 1, as SkyRL's own client; multimodal features; a `model` that is
        neither the fleet's model nor a loaded LoRA adapter) and `GenerationError` for a failed generation. `model`
        naming a loaded adapter generates with it (vLLM's convention). `cache_salt` (SkyRL's `use_cache_salt`) is
        accepted, as over HTTP, and changes nothing: a weight sync resets every prefix cache."""
        adapter = model if model and model != self.model_name else None
        token_ids, conversations = input_batch.get("prompt_token_ids"), input_batch.get("prompts")
        if (token_ids is None) == (conversations is None):
            raise ValueError("give exactly one of prompt_token_ids and prompts")
        if input_batch.get("mm_features"):
            raise ValueError("mm_features (multimodal inputs) are not served by rollout-svc: send text or token ids")
        try:
            params, n = vllm_sampling_params(input_batch.get("sampling_params") or {})
        except APIError as exc:
            raise ValueError(exc.message) from exc
        if n != 1:
            raise ValueError("n > 1 is not supported: use `config.generator.n_samples_per_prompt` (as SkyRL's client)")
        prompts = token_ids if token_ids is not None else conversations
        sessions = input_batch.get("session_ids")
        ids = [str(s) if s is not None else None for s in sessions] if sessions else None
        trajectories = await self._run(prompts, params, ids, adapter)
        return {
            "responses": [t.text for t in trajectories],
            "response_ids": [t.completion_token_ids for t in trajectories],
            "stop_reasons": [t.finish_reason for t in trajectories],
            "response_logprobs": [t.logprobs for t in trajectories] if params.logprobs is not None else None,
            # per prompt position, the prompt token's logprob (None at position 0, as SkyRL's `sample` gives)
            "prompt_logprobs": [[row[0][2] if row else None for row in t.prompt_logprobs or []] for t in trajectories]
            if params.prompt_logprobs is not None
            else None,
            "rollout_expert_indices": None,
        }

    async def _run(
        self, prompts: Any, params: Any, sessions: list[str | None] | None, adapter: str | None = None
    ) -> list[Any]:
        requests = await self.client.rollout_requests(prompts, params, sessions, adapter=adapter)
        return await self.client.run(requests, raise_on_error=True)

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's chat completion of `{"json": body, "headers": {...}}`: the response, or an error response
        (`{"error": {...}}`), as vLLM's server answers. Not streamed."""
        return await self._openai(request_payload, chat=True)

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's (legacy) completion of `{"json": body, "headers": {...}}`, as `chat_completion`."""
        return await self._openai(request_payload, chat=False)

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        """vLLM's render of a chat request (its token ids and sampling params, nothing generated), or an error."""
        try:
            body, session = _body(request_payload, ChatCompletionRequest)
            self._check_model(body.model, http=True)
            default_max_tokens = self.client.settings.api.api_default_max_tokens
            return await render_chat(self.client, body, self.model_name, session, default_max_tokens)
        except (APIError, RolloutError) as exc:
            return from_exception(exc).body()

    async def _openai(self, request_payload: dict[str, Any], chat: bool) -> dict[str, Any]:
        try:
            plan: Plan
            if chat:
                body, session = _body(request_payload, ChatCompletionRequest)
                plan = chat_plan(body, self.model_name, session, self.client.settings.api.api_default_max_tokens)
            else:
                body, session = _body(request_payload, CompletionRequest)
                plan = completion_plan(body, self.model_name, session)
            self._check_model(body.model, http=True)
            if plan.stream:
                raise APIError(400, "stream is not served in process: use `rollout-svc serve`", param="stream")
            requests = await self.client.rollout_requests(
                plan.prompts,
                plan.params,
                [plan.session_id] * len(plan.prompts) if plan.session_id else None,
                group_ids=plan.group_ids,
                tools=plan.tools,
                parse_tool_calls=plan.parse_tool_calls,
                chat_template_kwargs=plan.chat_template_kwargs,
            )
            trajectories = await self.client.run(requests)
            for t in trajectories:
                raise_for(t)
            return plan.reply.response(trajectories, plan.prompt_indices)
        except (APIError, RolloutError) as exc:
            return from_exception(exc).body()

    def _check_model(self, model: str | None, http: bool = False) -> None:
        if model and model != self.model_name:
            message = f"The model `{model}` does not exist; this fleet serves {self.model_name}"
            raise APIError(404, message, param="model", code="model_not_found") if http else ValueError(message)

    async def finish_session(self, session_id: str) -> None:
        """Unpin a session (best effort, as SkyRL's: a failure is logged, never raised)."""
        try:
            await self.client.finish_session(str(session_id))
        except (RolloutError, OSError) as exc:
            log.warning("finish_session(%r) failed: %s", session_id, exc)

    # --- control plane: fleet-wide, every worker acknowledging ----------------------------------------------

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> dict[str, Any]:
        """SkyRL's client's pause (`keep`, `abort` or `wait`), held as holder `skyrl`."""
        mode = getattr(mode, "value", mode).lower()
        epoch = await self.client.pause(mode, holder=HOLDER)  # type: ignore[arg-type]
        if clear_cache and mode != "keep":
            epoch = await self.client.reset_prefix_cache()
        return {"status": "paused", "epoch": epoch}

    async def resume(self) -> dict[str, Any]:
        return {"status": "resumed", "epoch": await self.client.resume(holder=HOLDER)}

    async def pause_generation(self) -> None:
        """Keep-mode pause: in-flight requests freeze and continue on `resume_generation`."""
        await self.pause("keep")

    async def resume_generation(self) -> None:
        await self.resume()

    async def sleep(self, level: int = 2, tags: list[str] | None = None, **_: Any) -> dict[str, Any]:
        """Every engine to sleep at `level` (`tags` is not read, as vLLM's /sleep does not)."""
        return {"status": "sleeping", "level": level, "epoch": await self.client.sleep(level)}

    async def wake_up(self, tags: list[str] | None = None, **_: Any) -> dict[str, Any]:
        return {"status": "awake", "tags": tags, "epoch": await self.client.wake_up(tags or None)}

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> dict[str, Any]:
        return {"success": True, "epoch": await self.client.reset_prefix_cache(reset_running_requests)}

    async def get_world_size(self) -> tuple[int, int]:
        """`(total, per server)` weight-transfer ranks: the fleet is one server, so both are every engine's ranks."""
        total = sum(w.weight_ranks for w in await self.client.workers())
        return total, total

    # --- LoRA adapters (SkyRL 0.4's interface) --------------------------------------------------------------

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load the adapter at `lora_path` (peft's `save_pretrained` folder, under the workers' checkpoint root) on
        every worker as `lora_name`; a loaded name gets a new version in place (requests on the old one finish on
        it). Returns `{"lora_name", "version"}`. Raises `ControlCommandError` naming each worker whose load failed."""
        return {"lora_name": lora_name, "version": await self.client.load_adapter(lora_name, lora_path)}

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Drop adapter `lora_name` on every worker (running requests finish on it)."""
        return {"lora_name": lora_name, "epoch": await self.client.unload_adapter(lora_name)}

    # --- weights ---------------------------------------------------------------------------------------------

    async def init_weight_update_communicator(self, init_info: Any) -> dict[str, int]:
        """SkyRL's init of the trainer-led broadcast, as its `RemoteInferenceClient` makes it over HTTP: every live
        worker's vLLM engine joins the trainer's NCCL group (`EngineWeightTransfer.init`). `init_info`: SkyRL's
        `BroadcastInitInfo` (its `for_servers` and `to_api_payload`; the fleet is one server) or vLLM's init_info
        dict. Returns each worker's first rank. Raises `WeightSyncError` naming each worker that could not join."""
        if hasattr(init_info, "to_api_payload"):
            _, per_server = await self.get_world_size()
            [init_info] = init_info.for_servers(per_server, 1)
            init_info = init_info.to_api_payload()
        if not isinstance(init_info, dict):
            raise TypeError(f"init_info: SkyRL's BroadcastInitInfo or vLLM's init_info dict, not {type(init_info)}")
        return await self._transfer().init(init_info)

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """vLLM's `start_weight_update` on every worker of the last init (checkpoint-format weights only)."""
        if not is_checkpoint_format:
            raise ValueError("is_checkpoint_format=False (kernel-format weights) is not served: send checkpoint format")
        await self._transfer().start()

    async def update_named_weights(self, request: Any) -> None:
        """vLLM's `update_weights` on every worker of the last init: `request` is vLLM's update_info dict (`names`,
        `dtype_names`, `shapes`, `packed`, ...), received while the trainer broadcasts."""
        if not isinstance(request, dict):
            raise TypeError(
                "update_named_weights takes vLLM's update_info dict (SkyRL's new inference path); CUDA IPC handles "
                "are pickled and never accepted here: use the NCCL broadcast or rollout_svc.WeightSender"
            )
        await self._transfer().update(request)

    update_weights_nccl = update_named_weights

    async def finish_weight_update(self) -> int:
        """vLLM's `finish_weight_update` on every worker, then the next weight version committed; returns it."""
        return await self._transfer().finish()

    def _transfer(self) -> EngineWeightTransfer:
        if self._engine_weights is None:
            self._engine_weights = EngineWeightTransfer(self.client.settings)
        return self._engine_weights

    async def teardown(self) -> None:
        if self._engine_weights is not None:
            await self._engine_weights.close()
        if self.owns_client:
            await self.client.close()


def _body(request_payload: dict[str, Any], model: type[Any]) -> tuple[Any, str | None]:
    """The validated body of `{"json": body, "headers": {...}}` and its session (`X-Session-ID`, else `session_id`).
    Raises `APIError` 400 for a bad body."""
    try:
        body = model.model_validate(request_payload.get("json") or {})
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from exc
    headers = {k.lower(): v for k, v in (request_payload.get("headers") or {}).items()}
    return body, headers.get("x-session-id") or body.session_id


_ENGINE: type[Any] | None = None


def engine_class() -> type[Any]:
    """`RolloutServiceEngine`: SkyRL's `InferenceEngineInterface` with `_Engine`'s methods (imports SkyRL)."""
    global _ENGINE
    if _ENGINE is None:
        base = skyrl_module(BASE).InferenceEngineInterface
        where = {"__module__": "rollout_svc.integrations.skyrl", "__doc__": _Engine.__doc__}  # where users find it
        _ENGINE = type("RolloutServiceEngine", (_Engine, base), where)
    return _ENGINE
