"""EchoEngine: a deterministic, zero-compute engine with vLLM's pause, abort and sleep (queue tests, benchmarks)."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollout_svc.errors import InvalidRequestError
from rollout_svc.protocol import PauseMode, PromptLogprob, SamplingParams, TransferGroup, WeightManifest
from rollout_svc.weightsync.plane import checkpoint_files
from workers.engine import ChatMessages, Completion, Generation, OnDelta, ParallelSizes, ToolSpecs


class _EchoRun:
    """One request the echo engine is generating; `aborted` is set to stop it. `stepping`: a token of it is under
    way (a pause lets it complete before it returns, as vLLM's does)."""

    __slots__ = ("aborted", "produced", "stepping")

    def __init__(self) -> None:
        self.aborted = asyncio.Event()
        self.produced = 0
        self.stepping = False


class EchoEngine:
    """Deterministic, zero-compute engine for queue tests and overhead benchmarks. Never the default.

    Its vocabulary is bytes: text tokenizes to its UTF-8 bytes. A completion echoes the prompt back,
    cut at `max_tokens` (finish reason `length`, else `stop`), each token with logprob 0.0; a continuation
    (`prior` tokens already generated) goes on where the uninterrupted echo would be, so a retried request
    equals an uninterrupted one token for token. `token_delay_s` makes it generate one token per that many
    seconds, to stand in for a long generation; pause, abort, sleep and wake-up behave as vLLM's do.

    Weight sync is real up to the model: it joins the transfer group (gloo, in a thread), receives every announced
    bucket, and "loads" them by keeping their SHA-256 (`weights_digest`); a checkpoint is read whole the same way.
    It sends what it loaded to a late peer, and catches up from one, as vLLM's worker extension does.
    Its output does not depend on the weights. `load_delay_s` stands in for a slow load.
    """

    memory_released = False
    weight_ranks = 1
    parallel = ParallelSizes()
    engine_config = ""

    def __init__(
        self,
        model_name: str = "echo",
        capacity: int = 1024,
        max_model_len: int = 2048,
        token_delay_s: float = 0.0,
        load_delay_s: float = 0.0,
        preload_weight_transfer: bool = False,
    ) -> None:
        self.model_name, self.capacity = model_name, capacity
        self.max_model_len, self.token_delay_s, self.load_delay_s = max_model_len, token_delay_s, load_delay_s
        self.preload_weight_transfer = preload_weight_transfer
        self.weights_digest = ""
        self.adapters: dict[int, str] = {}  # lora_id -> the adapter's engine name
        self._end: Any = None  # a rollout_svc.weightsync.transfer.ReceivingEnd, made at the first join
        self._peer_end: Any = None  # ... for catching up from a peer
        self._loads: Any = None  # a rollout_svc.weightsync.transfer.LoadedFrom, made with the first end
        self._received: dict[str, list[Any] | None] = {"trainer": None, "peer": None}  # received, not yet loaded
        self._runs: dict[str, _EchoRun] = {}
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._idle = asyncio.Event()  # no run in progress
        self._idle.set()

    @property
    def kv_cache_tokens(self) -> int:
        """No cache to run out of: every sequence it runs at once at full length."""
        return self.capacity * self.max_model_len

    async def start(self) -> None:
        if self.preload_weight_transfer:  # before the worker registers: no heartbeat yet to stall
            await asyncio.to_thread(importlib.import_module, "rollout_svc.weightsync.transfer")

    async def generate(self, generation: Generation, on_delta: OnDelta | None = None) -> Completion:
        request_id, params, prior = generation.request_id, generation.params, generation.prior
        prompt_token_ids = generation.prompt_token_ids
        if generation.lora_id is not None and generation.lora_id not in self.adapters:
            raise InvalidRequestError(f"no adapter was loaded under id {generation.lora_id}")
        if len(prompt_token_ids) + len(prior) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_token_ids) + len(prior)} tokens; this model's context is {self.max_model_len}"
            )
        tail = prompt_token_ids[len(prior) :] if prior else prompt_token_ids  # what the echo has yet to say
        if not self.token_delay_s and self._unpaused.is_set():  # done at once: nothing to pause or abort
            done = self._completion(prompt_token_ids, prior, tail, min(params.max_tokens, len(tail)), params, False)
            if on_delta is not None and done.completion_token_ids:
                await on_delta(done)
            return done
        run = self._runs[request_id] = _EchoRun()  # registered before any await: an abort always finds it
        self._idle.clear()

        async def produced_one(index: int) -> None:  # a delta per generated token, as vLLM's per step
            if on_delta is not None:
                token = tail[index]
                await on_delta(Completion([], [token], [0.0], "", _bytes_text([token]), *_tops([token], params)))

        try:
            produced = await self._produce(run, min(params.max_tokens, len(tail)), produced_one)
        finally:
            del self._runs[request_id]
            if not self._runs:
                self._idle.set()
        return self._completion(prompt_token_ids, prior, tail, produced, params, run.aborted.is_set())

    def _completion(
        self,
        prompt_token_ids: list[int],
        prior: Sequence[int],
        tail: list[int],
        produced: int,
        params: SamplingParams,
        aborted: bool,
    ) -> Completion:
        completion = tail[:produced]
        if aborted and produced < min(params.max_tokens, len(tail)):
            finish_reason = "abort"
        else:
            finish_reason = "length" if len(tail) > params.max_tokens else "stop"
        text = _bytes_text(completion)
        prompt = [*prompt_token_ids, *prior] if prior else prompt_token_ids
        tops, texts = _tops(completion, params)
        return Completion(
            prompt,
            completion,
            [0.0] * len(completion),
            finish_reason,
            text,
            tops,
            texts,
            _prompt_logprobs(prompt, params),
        )

    async def _produce(self, run: _EchoRun, count: int, produced_one: Any = None) -> int:
        """Generate `count` tokens, one per `token_delay_s`, frozen while paused; returns how many were made."""
        if not self._unpaused.is_set():
            await self._unfrozen(run)
        if not self.token_delay_s:
            return 0 if run.aborted.is_set() else count
        # On a schedule (token i is due i delays after the start, plus the time spent frozen), so timing noise
        # does not accumulate: a generation takes count * token_delay_s plus its pauses.
        loop = asyncio.get_running_loop()
        due, produced = loop.time(), 0
        while produced < count and not run.aborted.is_set():
            due += self.token_delay_s
            run.stepping = True
            await asyncio.sleep(max(0.0, due - loop.time()))
            produced += 1  # a step that started completes, as in vLLM
            run.produced, run.stepping = produced, False
            if produced_one is not None:
                await produced_one(produced - 1)
            if not self._unpaused.is_set():
                frozen_at = loop.time()
                await self._unfrozen(run)
                due += loop.time() - frozen_at
        return produced

    async def _unfrozen(self, run: _EchoRun) -> None:
        """Wait while paused: until resumed, or aborted."""
        waits = [asyncio.ensure_future(self._unpaused.wait()), asyncio.ensure_future(run.aborted.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def abort(self, request_id: str) -> None:
        run = self._runs.get(request_id)
        if run is not None:
            run.aborted.set()

    async def pause(self, mode: PauseMode) -> None:
        if mode == "wait":
            await self._idle.wait()
        elif mode == "abort":
            for run in self._runs.values():
                run.aborted.set()
        self._unpaused.clear()
        # As vLLM's pause, which returns once the step under way has sent its output: what a run reports then is
        # all it makes until resumed (a weight sync's version marks and staleness cuts read it).
        while any(run.stepping for run in self._runs.values()):
            await asyncio.sleep(self.token_delay_s / 4)

    async def resume(self) -> None:
        self._unpaused.set()

    async def sleep(self, level: int, mode: PauseMode) -> None:
        await self.pause(mode)

    async def wake_up(self, tags: list[str] | None) -> bool:
        await self.resume()
        return True

    async def add_adapter(self, name: str, lora_id: int, path: str) -> None:
        """Holds the adapter's name (it generates as without one: the queue's adapter handling is what it tests)."""
        self.adapters[lora_id] = name

    async def remove_adapter(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)

    async def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        return True

    async def chat_prompt(
        self, messages: ChatMessages, tools: ToolSpecs | None = None, chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """`<|role|>content` a line per message, then `<|assistant|>`; `chat_template_kwargs`'
        `add_generation_prompt: False` leaves that out, `continue_final_message: True` also leaves the last message
        open (no line end), as Hugging Face templates do. Any other template keyword is ignored."""
        kwargs = chat_template_kwargs or {}
        rendered = "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in messages)
        if kwargs.get("continue_final_message"):
            rendered = rendered.removesuffix("\n")
        elif kwargs.get("add_generation_prompt", True):
            rendered += "<|assistant|>"
        return await self.tokenize(rendered, add_special_tokens=False)

    def parse_tool_calls(self, text: str, tools: ToolSpecs) -> tuple[str | None, list[dict[str, Any]]]:
        return text, []  # the echo model calls no tools

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(text.encode())

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return _bytes_text(token_ids)

    async def close(self) -> None:
        if self._end is not None:
            self._end.leave()

    async def join_weight_group(self, spec: TransferGroup, first_rank: int, host: str) -> None:
        # Importing torch takes seconds, and holds the GIL for much of them (loading libtorch): in a thread it stalls
        # the heartbeat less, and not at all where `preload_weight_transfer` imported it at start.
        module = await asyncio.to_thread(importlib.import_module, "rollout_svc.weightsync.transfer")
        if self._end is None:
            self._end, self._loads = module.ReceivingEnd(), self._loads or module.LoadedFrom()
        await asyncio.to_thread(self._end.join, spec, first_rank, host)

    async def leave_weight_group(self) -> None:
        if self._end is not None:
            self._end.leave()

    async def receive_weights(self, manifest: WeightManifest) -> dict[str, Any]:
        if self._end is None:
            raise RuntimeError("not in a weight transfer group: join one first")
        end = self._end

        def receive() -> tuple[list[Any], str]:
            tensors = end.receive(manifest)
            return tensors, end.received.digest

        started = time.perf_counter()
        self._received["trainer"] = None
        self._received["trainer"], digest = await asyncio.to_thread(receive)
        return {"receive_s": time.perf_counter() - started, "digest": digest}

    async def load_received(self, source: str = "trainer") -> dict[str, float]:
        import torch

        if source in ("held", "previous"):  # a version loaded from a transfer, again (see `Engine.load_received`)
            if self._loads is None:
                raise RuntimeError("no received version is held here to load again")
            end, tensors = self._loads.again(source)
        else:
            tensors, self._received[source] = self._received[source], None
            end = self._end if source == "trainer" else self._peer_end
        if tensors is None:
            raise RuntimeError("no weights were received to load")
        started = time.perf_counter()
        digest = hashlib.sha256()
        for name, tensor in tensors:
            digest.update(name.encode())
            digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        await asyncio.sleep(self.load_delay_s)
        self.weights_digest = digest.hexdigest()
        self._loads.switched(end, source)
        return {"load_s": time.perf_counter() - started}

    async def serve_weights(self, spec: TransferGroup, host: str) -> dict[str, float]:
        end = self._loads.loaded if self._loads is not None else None
        if end is None or end.held is None:
            raise RuntimeError("no loaded weights are held here to send")
        return {"send_s": await asyncio.to_thread(end.serve, spec, host)}

    async def receive_from_peer(self, spec: TransferGroup, first_rank: int, host: str, manifest: WeightManifest) -> str:
        module = await asyncio.to_thread(importlib.import_module, "rollout_svc.weightsync.transfer")
        if self._peer_end is None:
            self._peer_end, self._loads = module.ReceivingEnd(), self._loads or module.LoadedFrom()
        end = self._peer_end

        def catch_up() -> tuple[list[Any], str]:
            tensors = end.catch_up(spec, first_rank, host, manifest)
            return tensors, end.received.digest

        self._received["peer"] = None
        self._received["peer"], digest = await asyncio.to_thread(catch_up)
        return str(digest)

    async def load_checkpoint(self, path: str) -> dict[str, float]:
        started = time.perf_counter()

        def read() -> bytes:  # one file or the shards, in order: their digest is the weights'
            return b"".join(f.read_bytes() for f in checkpoint_files(Path(path)))

        data = await asyncio.to_thread(read)
        await asyncio.sleep(self.load_delay_s)
        self.weights_digest = hashlib.sha256(data).hexdigest()
        if self._loads is not None:
            self._loads.checkpoint_loaded()
        return {"load_s": time.perf_counter() - started}

    async def engine_weight_op(self, op: str, info: dict[str, Any]) -> None:
        raise InvalidRequestError(
            "the echo engine has no vLLM weight transfer engine (a trainer-led NCCL broadcast needs a vLLM worker "
            "started with --weight-transfer-backend nccl, on CUDA): sync it with WeightSender or /fetch_weights"
        )

    def output_tokens(self, request_id: str) -> int | None:
        run = self._runs.get(request_id)
        return None if run is None else run.produced


def _prompt_logprobs(prompt: list[int], params: SamplingParams) -> list[list[PromptLogprob]] | None:
    """Prompt logprobs where asked for: the echo is certain of each prompt token (logprob 0, rank 1); none at 0."""
    if params.prompt_logprobs is None:
        return None
    return [[]] + [[(t, _bytes_text([t]), 0.0, 1)] for t in prompt[1:]]


def _tops(token_ids: list[int], params: SamplingParams) -> tuple[list[list[tuple[int, str, float]]] | None, Any]:
    """Top logprobs and token texts where asked for: the echo's one token per position, certain (logprob 0)."""
    if params.logprobs is None:
        return None, None
    texts = [_bytes_text([t]) for t in token_ids]
    return [[(t, text, 0.0)][: params.logprobs] for t, text in zip(token_ids, texts, strict=True)], texts


def _bytes_text(token_ids: list[int]) -> str:
    """The echo vocabulary: token ids are bytes (ids >= 256 have no text)."""
    try:
        return bytes(token_ids).decode(errors="replace")
    except ValueError:
        return bytes(t for t in token_ids if t < 256).decode(errors="replace")
