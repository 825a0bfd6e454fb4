"""The real engine: `VLLMEngine`, one vLLM `AsyncLLM` driven as the `Engine` protocol says."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_svc.config import CPU_MAX_NUM_SEQS
from rollout_svc.errors import EngineDeadError, InvalidRequestError
from rollout_svc.protocol import EngineWeightOpName, PauseMode, TransferGroup, WeightManifest
from workers.engine import (
    ChatMessages,
    Completion,
    Generation,
    OnDelta,
    ParallelSizes,
    ReceivedFrom,
    ToolSpecs,
    joined,
)
from workers.vllm_args import shutdown_llm, usage_context, vllm_engine_args
from workers.vllm_outputs import completion_of, finish_reason_of, vllm_sampling_params

if TYPE_CHECKING:  # vllm is imported lazily: a worker running EchoEngine must not pay its import
    from vllm import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger("rollout_svc.worker")

# A transfer job in vLLM's worker process (`WeightSyncExtension`) says it ended by creating a marker file, watched every
# MARK_POLL_S; its outcome is then asked once (`rollout_poll`). The engine is asked anyway every JOB_POLL_S (a rank
# that died or errored): each ask is a message on vLLM's shared-memory queue, after which the worker's main thread
# spins (sched_yield) for vLLM's 1 s `busy_loop_s`. Asked every 50 ms, as before, those threads spun throughout a
# receive and the receive threads beside them starved: a TP=3 receive of SmolLM2's 540 MB took minutes, and even
# one rank's receive ran at a third of a bare gloo broadcast's rate here (top: VLLM::Worker at 60-100% CPU).
MARK_POLL_S = 0.01
JOB_POLL_S = 1.5

OUTPUTS_WAIT_S = 0.02  # vLLM's own sleep after a pause: what `_outputs_processed` waits where it cannot watch
OUTPUTS_DRAIN_MAX_S = 1.0  # the longest `_outputs_processed` waits for a handler it watches to become idle


async def _outputs_processed(llm: Any) -> None:
    """Return once `llm`'s output handler has processed every output its engine-core client has queued: the queue
    is empty and the handler waits on it for more (an `asyncio.Queue` getter), or there is no handler running (vLLM
    starts it with the first request: before that, no output exists). Where the vLLM client does not look as this
    expects (no `outputs_queue`), it waits `OUTPUTS_WAIT_S`, as vLLM's `pause_generation` does.

    The wait for a watched handler is bounded by `OUTPUTS_DRAIN_MAX_S` of wall clock, not by vLLM's 20 ms: the
    handler processes each output in a few loop turns, but on a loaded host the process can lose 20 ms to the
    scheduler with outputs still queued (a CI run returned with 2 of 5 processed), and a count read then would put
    tokens of the old weights in the new version's span. The handler never waits on anything but its queue for
    long (an abort's send to the engine core, a chunk boundary), so the bound is met only by a stalled process."""
    queue = getattr(llm.engine_core, "outputs_queue", None)
    if not isinstance(queue, asyncio.Queue):
        await asyncio.sleep(OUTPUTS_WAIT_S)
        return
    handler = getattr(llm, "output_handler", None)
    if handler is None or handler.done():
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + OUTPUTS_DRAIN_MAX_S
    while not (queue.empty() and getattr(queue, "_getters", None)):  # idle: waiting for outputs that are not there
        if loop.time() >= deadline:
            busy = OUTPUTS_DRAIN_MAX_S
            log.warning("vLLM's output handler still busy %.1f s after a pause: token counts may be short", busy)
            return
        await asyncio.sleep(0)


class VLLMEngine:
    """The real engine: one vLLM `AsyncLLM` (continuous batching; its engine core is a child process).

    Example (the engine core is spawned, so the entry point needs an `if __name__ == "__main__":` guard):

        engine = VLLMEngine(str(prepare_model(cache_dir)), dtype="float32")
        await engine.start()                       # ~15 s on CPU
        ids = await engine.chat_prompt([{"role": "user", "content": "Hi"}])
        done = await engine.generate(Generation("r1", ids, SamplingParams(temperature=0, max_tokens=32)))
        await engine.close()                       # joins the engine-core process

    `capacity` is `max_num_seqs` per data-parallel replica; the remaining arguments are those of `vllm_engine_args`
    (`tensor_parallel_size`, `pipeline_parallel_size`, `data_parallel_size` among them: the engine's ranks, each of
    which joins a weight transfer, `weight_ranks`).
    """

    def __init__(
        self,
        model: str,
        *,
        max_num_seqs: int | None = None,
        tool_call_parser: str | None = None,
        **engine_settings: Any,
    ) -> None:
        self.model_name = Path(model).name
        self.tool_call_parser = tool_call_parser
        self.parallel = ParallelSizes(
            int(engine_settings.get("tensor_parallel_size", 1)),
            int(engine_settings.get("pipeline_parallel_size", 1)),
            int(engine_settings.get("data_parallel_size", 1)),
        )
        self.capacity = (max_num_seqs or CPU_MAX_NUM_SEQS) * self.parallel.data  # until started: then vLLM's
        self.memory_released = False  # known once started: sleep frees memory only where sleep mode is on
        self.weight_ranks = self.parallel.ranks
        # vLLM's native weight transfer (`engine_weight_op`): `weight_transfer_config={"backend": "nccl"}`, or none
        self.weight_transfer_backend = str((engine_settings.get("weight_transfer_config") or {}).get("backend", ""))
        self._engine_kwargs: dict[str, Any] = {"max_num_seqs": max_num_seqs, **engine_settings}
        self.max_model_len = self.kv_cache_tokens = 0  # once started (`_read_config`)
        self.engine_config = ""
        self._model = model
        self._llm: AsyncLLM | None = None
        self._adapters: dict[int, Any] = {}  # lora_id -> vLLM's LoRARequest
        self._markers: tempfile.TemporaryDirectory[str] | None = None  # transfer jobs' end markers (`_job`)

    async def start(self) -> None:
        """Start the engine-core process and load the model (~15 s on CPU, plus ~5 s to import vLLM).

        Imported and built in a thread so the event loop (heartbeats) keeps running; AsyncLLM starts its
        output handler on the loop at the first request. Raises what vLLM raises for a bad folder or settings.
        """

        def build() -> None:
            from vllm.v1.engine.async_llm import AsyncLLM

            # Stored, not returned: the executor's futures keep a returned AsyncLLM alive after close(), and its
            # __del__ then runs again at interpreter exit, when vLLM's module globals are already gone.
            args = vllm_engine_args(self._model, **self._engine_kwargs)
            self._llm = AsyncLLM.from_engine_args(args, usage_context=usage_context())
            self.memory_released = bool(args.enable_sleep_mode)

        await asyncio.to_thread(build)
        self._read_config()

    def _read_config(self) -> None:
        """What the started engine holds, as vLLM resolved it (on a GPU, its defaults for the device): the capacity
        (`max_num_seqs` per data-parallel replica) and the context; a context shorter than the model's is logged."""
        config = self._running().vllm_config
        self.capacity = config.scheduler_config.max_num_seqs * self.parallel.data
        self.max_model_len = config.model_config.max_model_len
        self.kv_cache_tokens = (config.cache_config.num_gpu_blocks or 0) * config.cache_config.block_size
        self.engine_config = engine_config(config)
        model_len = getattr(config.model_config.hf_text_config, "max_position_embeddings", None)
        if isinstance(model_len, int) and model_len > self.max_model_len:
            log.info(
                "engine context %d tokens; the model holds %d (pass --max-model-len %d for all of it)",
                self.max_model_len,
                model_len,
                model_len,
            )

    async def generate(self, generation: Generation, on_delta: OnDelta | None = None) -> Completion:
        """Run one request to completion, after `prompt_token_ids + prior`; the Completion holds the new tokens.
        `lora_id`: with that adapter (`add_adapter`), vLLM's `lora_request`.

        With `on_delta` the request runs with vLLM's delta outputs (`RequestOutputKind.DELTA`) and each step's new
        tokens are awaited through it as they come; the final Completion still holds every new token.

        Cancelling the awaiting task aborts the request inside vLLM; `abort(request_id)` makes it return what it
        generated so far, with finish reason `abort`.

        Raises `InvalidRequestError` for input vLLM rejects (prompt longer than the context, a token id out
        of vocabulary, a sampling value vLLM refuses), with vLLM's message; `EngineDeadError` if the engine died.
        """
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import tokens_input
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDeadError
        from vllm.v1.engine.exceptions import EngineGenerateError

        llm = self._running()
        request_id, params = generation.request_id, generation.params
        sampling = vllm_sampling_params(params, delta=on_delta is not None)
        prompt = [*generation.prompt_token_ids, *generation.prior]
        final: RequestOutput | None = None
        parts: list[Completion] = []
        try:
            # FINAL_ONLY: the stream yields once, at the end (an abort's final output holds the tokens so far);
            # DELTA: once per step, each output holding that step's new tokens. On cancellation vLLM's generator
            # aborts the request.
            lora = None if generation.lora_id is None else self._adapters[generation.lora_id]
            # the worker's generation span as the parent of vLLM's own, where vLLM traces (`--otlp-traces-endpoint`)
            traced = getattr(getattr(llm, "observability_config", None), "otlp_traces_endpoint", None) is not None
            headers = generation.trace_headers if traced else None
            stream = llm.generate(tokens_input(prompt), sampling, request_id, lora_request=lora, trace_headers=headers)
            async for output in stream:
                final = output
                if on_delta is not None:
                    delta = completion_of(prompt, output, params.logprobs, delta=True, prompt_k=params.prompt_logprobs)
                    parts.append(delta)
                    if delta.completion_token_ids or delta.text:
                        await on_delta(delta)
        except VLLMClientError as exc:
            raise InvalidRequestError(f"vLLM rejected request {request_id}: {exc}") from exc
        except VLLMEngineDeadError as exc:
            raise EngineDeadError(f"the vLLM engine died while serving {request_id}; restart the worker") from exc
        except EngineGenerateError as exc:
            if isinstance(exc.__cause__, (ValueError, TypeError)):  # input processing refused the prompt
                raise InvalidRequestError(f"vLLM rejected request {request_id}: {exc.__cause__}") from exc
            if llm.errored:
                raise EngineDeadError(f"the vLLM engine died while serving {request_id}; restart the worker") from exc
            raise
        if final is None or not final.finished:
            raise RuntimeError(f"vLLM ended request {request_id} without a final output")
        if on_delta is not None:
            return replace(joined(parts, prompt, finish_reason_of(final)), cached_tokens=final.num_cached_tokens or 0)
        return completion_of(prompt, final, params.logprobs, prompt_k=params.prompt_logprobs)

    async def abort(self, request_id: str) -> None:
        """Abort a running request; its `generate` returns with finish reason `abort`. Unknown ids are ignored."""
        await self._running().abort(request_id)

    async def add_adapter(self, name: str, lora_id: int, path: str) -> None:
        """`AsyncLLM.add_lora(LoRARequest(name, lora_id, path))`; needs the engine started with `enable_lora`."""
        from vllm.lora.request import LoRARequest

        if not self._engine_kwargs.get("enable_lora"):
            raise InvalidRequestError("this worker's engine runs without LoRA: start it with --enable-lora")
        request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
        if not await self._running().add_lora(request):
            raise RuntimeError(f"vLLM did not load adapter {name} from {path}")
        self._adapters[lora_id] = request

    async def remove_adapter(self, lora_id: int) -> None:
        """`AsyncLLM.remove_lora(lora_id)`."""
        self._adapters.pop(lora_id, None)
        await self._running().remove_lora(lora_id)

    async def pause(self, mode: PauseMode) -> None:
        """What `AsyncLLM.pause_generation(mode=mode, clear_cache=False)` does (the prefix cache survives a pause:
        a kept request needs its KV blocks; an aborted one's retry finds its prefix cached), without its fixed
        20 ms sleep: the engine core pauses its scheduler and replies after the outputs of its last step, which
        its client queues in order before the reply; vLLM then sleeps 20 ms so that its output handler has
        probably processed them. This waits for exactly that instead (`_outputs_processed`): once it returns,
        `output_tokens` counts every token made before the pause (what a weight sync's version marks read)."""
        llm = self._running()
        await llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=False)
        await _outputs_processed(llm)

    async def resume(self) -> None:
        await self._running().resume_generation()

    async def sleep(self, level: int, mode: PauseMode) -> None:
        """vLLM sleep mode: pauses as `mode` says, then level 1 offloads the weights and drops the KV cache,
        level 2 drops both. On CPU vLLM pauses and frees nothing (`memory_released` is False)."""
        await self._running().sleep(level, mode)

    async def wake_up(self, tags: list[str] | None) -> bool:
        """Restore the memory pools `tags` names (None: all); returns whether the engine is fully awake."""
        return bool(await self._running().wake_up(tags))

    async def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        """Drop the prefix cache; False if vLLM refused (running requests hold blocks and are not to be reset)."""
        return bool(await self._running().reset_prefix_cache(reset_running_requests=reset_running_requests))

    async def chat_prompt(
        self, messages: ChatMessages, tools: ToolSpecs | None = None, chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """Token ids of `messages` rendered by the model's chat template, ending with the assistant's turn opener
        (unless `chat_template_kwargs` says `add_generation_prompt: False`, or `continue_final_message: True`, which
        leaves the last assistant message open; `chat_template` replaces the model's template).

        `tools` (OpenAI's `{"type": "function", "function": {...}}` list) and `chat_template_kwargs` are passed to
        the template (Hugging Face `apply_chat_template`), as vLLM's OpenAI server does.
        Raises `InvalidRequestError` if the template refuses the messages.
        """
        tokenizer: Any = self._running().get_tokenizer()  # Any: vLLM types messages as OpenAI's TypedDicts
        try:
            kwargs = {"add_generation_prompt": True, **(chat_template_kwargs or {})}  # the request's kwargs win
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
        except Exception as exc:  # jinja2 errors, or a template's own raise_exception()
            raise InvalidRequestError(f"the chat template of {self.model_name} refused the messages: {exc}") from exc
        # The template already wrote every special token; encoding must not add a BOS of its own.
        return tokenizer.encode(text, add_special_tokens=False)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._running().get_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def parse_tool_calls(self, text: str, tools: ToolSpecs) -> tuple[str | None, list[dict[str, Any]]]:
        """vLLM's tool-call parser named by `tool_call_parser` (see `workers.tools`); none configured: no calls."""
        from workers.tools import parse_tool_calls

        if not self.tool_call_parser:
            return text, []
        return parse_tool_calls(self.tool_call_parser, self._running().get_tokenizer(), text, tools)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self._running().get_tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens)

    async def join_weight_group(self, spec: TransferGroup, first_rank: int, host: str) -> None:
        """Every engine rank joins (`WeightSyncExtension.rollout_join_group`, in vLLM's worker processes)."""
        await self._running().collective_rpc("rollout_join_group", args=(spec.model_dump(), first_rank, host))

    async def leave_weight_group(self) -> None:
        await self._running().collective_rpc("rollout_leave_group")

    async def receive_weights(self, manifest: WeightManifest) -> dict[str, Any]:
        """Receive in vLLM's worker processes, in a thread of theirs (`rollout_receive_start`), so the engine goes on
        stepping; waited for by `_job`. Returns the first rank's seconds receiving and digest; raises `RuntimeError`
        with the first failing rank's error."""
        marker = self._marker("receive")
        await self._running().collective_rpc("rollout_receive_start", args=(manifest.model_dump(), marker))
        received = await self._job("receive", marker)
        return {"receive_s": received["seconds"], "digest": received["digest"]}

    async def load_received(self, source: ReceivedFrom = "trainer") -> dict[str, float]:
        """`reload_weights(weights_iterator=...)` of what every engine rank received (the engine is paused), or of
        the version it holds as received (source held)."""
        job = {"trainer": "receive", "peer": "catch-up", "held": "held", "previous": "previous"}[source]
        results = await self._running().collective_rpc("rollout_load_received", args=(job,))
        return dict(results[0])

    async def serve_weights(self, spec: TransferGroup, host: str) -> dict[str, float]:
        """The first engine rank sends (`rollout_serve_start`, a thread of vLLM's worker process), awaited (`_job`)."""
        marker = self._marker("serve")
        await self._running().collective_rpc("rollout_serve_start", args=(spec.model_dump(), host, marker))
        return {"send_s": (await self._job("serve", marker))["seconds"]}

    async def receive_from_peer(self, spec: TransferGroup, first_rank: int, host: str, manifest: WeightManifest) -> str:
        """Each engine rank receives (`rollout_catch_up_start`, a thread of vLLM's worker process), awaited (`_job`)."""
        marker = self._marker("catch-up")
        args = (spec.model_dump(), first_rank, host, manifest.model_dump(), marker)
        await self._running().collective_rpc("rollout_catch_up_start", args=args)
        return str((await self._job("catch-up", marker))["digest"])

    def _marker(self, job: str) -> str:
        """A fresh path for `job`'s end markers (`WeightSyncExtension._rollout_start` adds each rank)."""
        if self._markers is None:
            self._markers = tempfile.TemporaryDirectory(prefix="rollout-svc-jobs-")
        return os.path.join(self._markers.name, f"{job}-{uuid.uuid4().hex[:12]}")

    async def _job(self, job: str, marker: str) -> dict[str, Any]:
        """Wait for `job` on every engine rank; the first rank's outcome. Asks the engine (`rollout_poll`) when a
        rank created its end marker (`marker` + "." + rank), and every `JOB_POLL_S` anyway (never at once: the start
        call just made its threads spin). Raises `RuntimeError` with the first failing rank's error,
        `EngineDeadError` if the engine died."""
        llm, loop = self._running(), asyncio.get_running_loop()
        folder, prefix = os.path.dirname(marker), os.path.basename(marker) + "."
        seen = 0
        try:
            while True:
                asked = loop.time()
                while loop.time() - asked < JOB_POLL_S:
                    await asyncio.sleep(MARK_POLL_S)
                    ended = sum(1 for name in os.listdir(folder) if name.startswith(prefix))
                    if ended > seen:
                        seen = ended
                        break
                polls = await llm.collective_rpc("rollout_poll", args=(job,))
                failed = [p["error"] for p in polls if p.get("error")]
                if failed:
                    raise RuntimeError(f"weight {job} failed: {failed[0]}")
                if all(p["done"] for p in polls):
                    return dict(polls[0])
        finally:
            for name in os.listdir(folder):
                if name.startswith(prefix):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, name))

    async def load_checkpoint(self, path: str) -> dict[str, float]:
        """`reload_weights(weights_path=path)` on every engine rank."""
        results = await self._running().collective_rpc("rollout_load_checkpoint", args=(path,))
        return dict(results[0])

    async def engine_weight_op(self, op: EngineWeightOpName, info: dict[str, Any]) -> None:
        """`AsyncLLM`'s native weight transfer call for `op` (vLLM 0.32: `init_weight_transfer_engine`,
        `start_weight_update`, `update_weights`, `finish_weight_update`, `shutdown_weight_transfer_engine`). Needs
        the engine started with a weight transfer backend (`EngineSettings.weight_transfer_backend`, nccl: CUDA)."""
        if not self.weight_transfer_backend:
            raise InvalidRequestError(
                "this worker's vLLM engine has no weight transfer engine: start it with --weight-transfer-backend "
                "nccl (on CUDA) for a trainer-led broadcast, or sync with WeightSender or /fetch_weights"
            )
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

        llm = self._running()
        if op == "init":
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        elif op == "start":
            await llm.start_weight_update()
        elif op == "update":
            await llm.update_weights(WeightTransferUpdateRequest(update_info=info))
        elif op == "finish":
            await llm.finish_weight_update()
        else:
            await llm.shutdown_weight_transfer_engine()

    def output_tokens(self, request_id: str) -> int | None:
        """Output tokens vLLM's output processor has seen for `request_id` (in this process: exact once a pause
        returned, since the engine core sends every step's output before the pause's reply)."""
        processor: Any = self._running().output_processor
        internal = processor.external_req_ids.get(request_id)
        if not internal:
            return None
        states = [processor.request_states.get(i) for i in internal]
        return sum(s.detokenizer.num_output_tokens() for s in states if s is not None)

    def num_unfinished_requests(self) -> int:
        """Requests vLLM holds now (waiting or running); 0 after every `generate` returned or was cancelled."""
        return self._running().get_num_unfinished_requests()

    async def close(self) -> None:
        """Shut the engine down: aborts what is running and joins the engine-core process. Idempotent."""
        llm, self._llm = self._llm, None
        if llm is not None:
            shutdown_llm(llm)
            del llm
            gc.collect()
        if self._markers is not None:
            self._markers.cleanup()
            self._markers = None

    def _running(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("VLLMEngine is not running: call `await engine.start()` first")
        if self._llm.errored:
            raise EngineDeadError(f"the vLLM engine of {self.model_name} has died; restart the worker")
        return self._llm


def engine_config(config: Any) -> str:
    """A started engine's settings as vLLM resolved them (its `VllmConfig`), as the heartbeat carries them:
    `dtype=bfloat16 quantization=fp8 cuda_graphs=on prefix_caching=on speculative=eagle3 logprobs_mode=raw_logprobs
    lora=16x4 weight_transfer=nccl` ("none" where unset; `lora`: max rank x adapters at once). `/server_info` reads
    its `VllmConfig` back from them (`rollout_svc.api.server_info`)."""
    model = config.model_config
    graphs = getattr(config.compilation_config.cudagraph_mode, "name", "NONE") != "NONE" and not model.enforce_eager
    speculative = getattr(config.speculative_config, "method", None) or "none"
    lora = getattr(config, "lora_config", None)
    transfer = getattr(getattr(config, "weight_transfer_config", None), "backend", None)
    return " ".join(
        [
            f"dtype={str(model.dtype).removeprefix('torch.')}",
            f"quantization={model.quantization or 'none'}",
            f"cuda_graphs={'on' if graphs else 'off'}",
            f"prefix_caching={'on' if config.cache_config.enable_prefix_caching else 'off'}",
            f"speculative={speculative}",
            f"logprobs_mode={getattr(model, 'logprobs_mode', 'raw_logprobs')}",
            f"lora={f'{lora.max_lora_rank}x{lora.max_loras}' if lora is not None else 'none'}",
            f"weight_transfer={transfer or 'none'}",
        ]
    )
