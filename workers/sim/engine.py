"""SimEngine: the Engine protocol on a simulated GPU, whose steps take the time the cost model gives them."""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from rollout_svc.config import CPU_KV_CACHE_BYTES, EngineSettings
from rollout_svc.errors import InvalidRequestError
from rollout_svc.protocol import PauseMode, SamplingParams
from workers.echo import EchoEngine, _bytes_text, _prompt_logprobs, _tops
from workers.engine import Completion, Generation, OnDelta
from workers.sim.blocks import BlockPool
from workers.sim.cost import StepCost
from workers.sim.lengths import OutputLengths
from workers.sim.profiles import GPUS, GPUProfile, ModelProfile, gpu_profile, model_profile
from workers.sim.scheduler import Scheduler, Sequence, Step

ACTIVATION_RESERVE_BYTES = 2e9  # what vLLM's memory profiling keeps back for activations (an estimate, 7B class)
MAX_REPEATS = 256  # decode steps simulated as one sleep, at most
MAX_SLEEP_S = 0.05  # and at most this much wall clock: streams and progress advance at least 20 times a second
# How far behind its simulated clock an engine may fall (wall s) and still catch up (`_elapse`).
MAX_LAG_S = 0.5
PRINTABLE = 95  # generated tokens are printable ASCII bytes (32..126): the echo vocabulary has text for them


def default_kv_cache_bytes(gpu: GPUProfile, model: ModelProfile, gpu_memory_utilization: float = 0.9) -> float:
    """The KV cache vLLM sizes on one `gpu`: its memory at `gpu_memory_utilization`, less the weights and the
    activation reserve (bytes; negative where the model does not fit)."""
    return gpu.memory_bytes * gpu_memory_utilization - model.weight_bytes - ACTIVATION_RESERVE_BYTES


@dataclass
class SimStats:
    """What one engine did: simulated seconds busy, and steps run."""

    busy_s: float = 0.0
    steps: int = 0


class _Run:
    """A request in the engine: its sequence, whether it was aborted, and a signal per change."""

    __slots__ = ("aborted", "changed", "ended", "finished", "seq")

    def __init__(self, seq: Sequence) -> None:
        self.seq, self.aborted, self.finished = seq, False, False
        self.changed = asyncio.Event()  # new tokens, or the end
        self.ended = asyncio.Event()


class SimEngine(EchoEngine):
    """A simulated GPU serving one model: vLLM v1's scheduler (`workers.sim.scheduler`) over paged KV blocks, each
    step lasting `StepCost.step_s` simulated seconds, `time_scale` simulated seconds per second of wall clock.

    Tokens: the echo engine's vocabulary (bytes). A request's first output token depends on its prompt and seed (no
    seed: its request id), each later one on the prompt and the first, so a continuation (`prior`) goes on token
    for token as the uninterrupted request would. It stops after `lengths.length(prompt, first token)` tokens
    (finish reason `stop`; never with `ignore_eos`, or without `lengths`), else at `max_tokens` (`length`).
    Pause modes, abort, sleep and weight sync (as digests) are the echo engine's, at step boundaries as vLLM's.
    Decode steps that change nothing else run as one sleep (up to `MAX_REPEATS`), so 64 engines fit one process.
    """

    def __init__(
        self,
        gpu: GPUProfile,
        model: ModelProfile,
        *,
        capacity: int = 1024,
        max_model_len: int = 32768,
        max_num_batched_tokens: int = 8192,
        chunked_prefill: bool = True,
        block_size: int = 16,
        kv_cache_bytes: float | None = None,
        gpu_memory_utilization: float = 0.9,
        time_scale: float = 1.0,
        lengths: OutputLengths | None = None,
        load_delay_s: float = 0.0,
        preload_weight_transfer: bool = False,
    ) -> None:
        super().__init__(model.name, capacity, max_model_len, 0.0, load_delay_s, preload_weight_transfer)
        if kv_cache_bytes is None:
            kv_cache_bytes = default_kv_cache_bytes(gpu, model, gpu_memory_utilization)
        if kv_cache_bytes < block_size * model.kv_bytes_per_token:
            raise ValueError(
                f"{model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) leaves no KV cache on one {gpu.name}: "
                "choose a smaller model or a GPU with more memory"
            )
        if not chunked_prefill:  # as vLLM requires: a whole prompt fits one step
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        self.cost, self.time_scale, self.lengths = StepCost(gpu, model), time_scale, lengths
        pool = BlockPool(int(kv_cache_bytes // (block_size * model.kv_bytes_per_token)), block_size)
        self.scheduler = Scheduler(pool, capacity, max_num_batched_tokens, chunked_prefill)
        self.stats = SimStats()
        self.adapters: dict[int, str] = {}  # lora_id -> the adapter's engine name (simulated at the base's cost)
        self._live: dict[str, _Run] = {}
        self._held: list[Sequence] = []  # added while paused: scheduled on resume
        self._paused = self._holding = False
        self._wake = asyncio.Event()
        self._between_steps = asyncio.Event()
        self._between_steps.set()
        self._loop_task: asyncio.Task[None] | None = None
        self._clock: float | None = None  # the loop time its simulated clock stands at (a step's end); None: idle

    @property
    def kv_cache_tokens(self) -> int:
        """Its paged KV cache in tokens: blocks x block size."""
        return self.scheduler.pool.num_blocks * self.scheduler.pool.block_size

    async def generate(self, generation: Generation, on_delta: OnDelta | None = None) -> Completion:
        request_id, params, prior = generation.request_id, generation.params, generation.prior
        prompt_token_ids = generation.prompt_token_ids
        if generation.lora_id is not None and generation.lora_id not in self.adapters:
            raise InvalidRequestError(f"no adapter was loaded under id {generation.lora_id}")
        prompt = [*prompt_token_ids, *prior]
        if len(prompt) >= min(self.max_model_len, self.kv_cache_tokens):
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens; this model's context is {self.max_model_len} and its KV cache "
                f"{self.kv_cache_tokens} tokens"
            )
        run = _Run(self._sequence(request_id, prompt_token_ids, params, prior))
        self._live[request_id] = run
        (self._held if self._holding else self.scheduler.waiting).append(run.seq)
        self._ensure_loop()
        self._wake.set()
        try:
            sent = await self._follow(run, on_delta)
        finally:
            if not run.finished:  # the caller went away: the engine drops it, as vLLM does an abort
                self._drop(run)
        output = run.seq.output
        if on_delta is not None and len(output) > sent:
            await on_delta(self._delta(output[sent:]))
        aborted = run.aborted and not run.seq.done
        reason = "abort" if aborted else ("length" if len(output) >= params.max_tokens else "stop")
        tops, texts = _tops(output, params)
        return Completion(
            prompt,
            list(output),
            [0.0] * len(output),
            reason,
            _bytes_text(output),
            tops,
            texts,
            _prompt_logprobs(prompt, params),
            run.seq.cached_tokens,
        )

    def _sequence(self, request_id: str, prompt: list[int], params: SamplingParams, prior: Seq[int]) -> Sequence:
        """The sequence of a request: its tokens are a function of (prompt, first token); see the class."""
        prompt_key = hash(tuple(prompt))
        first = (
            prior[0]
            if prior
            else 32 + hash((prompt_key, params.seed if params.seed is not None else request_id)) % PRINTABLE
        )
        length = params.max_tokens + len(prior)
        if self.lengths is not None and not params.ignore_eos:
            length = min(length, max(self.lengths.length(prompt_key, first), params.min_tokens + len(prior)))
        target = max(0, length - len(prior))

        def token_at(index: int) -> int:
            at = index + len(prior)
            return first if at == 0 else 32 + hash((prompt_key, first, at)) % PRINTABLE

        return Sequence(request_id, [*prompt, *prior], target, token_at)

    async def _follow(self, run: _Run, on_delta: OnDelta | None) -> int:
        """Wait for `run` to finish, passing its new tokens to `on_delta` as steps make them; returns how many."""
        sent = 0
        while not run.finished:
            await run.changed.wait()
            run.changed.clear()
            output = run.seq.output
            if on_delta is not None and len(output) > sent and not run.finished:
                new, sent = output[sent:], len(output)
                await on_delta(self._delta(new))
        return sent

    @staticmethod
    def _delta(tokens: list[int]) -> Completion:
        return Completion([], list(tokens), [0.0] * len(tokens), "", _bytes_text(tokens))

    # --- the step loop ---

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._run_steps(), name=f"sim-{self.model_name}")

    async def _run_steps(self) -> None:
        scheduler = self.scheduler
        while True:
            # 1. Wait for work, and for no pause.
            while self._paused or not (scheduler.running or scheduler.waiting):
                self._wake.clear()
                self._clock = None  # idle: simulated time stands still until there is work
                await self._wake.wait()
            # 2. Plan a step, and how many times it repeats unchanged.
            step = scheduler.schedule()
            if not step.items:  # the one running sequence preempted itself for blocks: it is admitted again next
                assert step.preempted, "the simulated scheduler planned an empty step with nothing preempted"
                continue
            repeats = scheduler.repeatable(step, MAX_REPEATS)
            durations_s = self._durations_s(step, repeats)
            # 3. Let the steps' time pass; a wake-up (new request, abort, pause) ends the run after its current step.
            self._between_steps.clear()
            done = await self._elapse(durations_s)
            # 4. Apply them, then hand out what changed.
            finished = scheduler.commit(step, done)
            self.stats.busy_s += sum(durations_s[:done])
            self.stats.steps += done
            self._between_steps.set()
            for seq, _ in step.items:
                run = self._live.get(seq.request_id)
                if run is not None and run.seq is seq:
                    run.changed.set()
            for seq in finished:
                self._finish(seq.request_id)
            self._finish_aborted()

    def _durations_s(self, step: Step, repeats: int) -> list[float]:
        """Simulated seconds of each run of `step`, up to `repeats` runs or `MAX_SLEEP_S` of wall clock (a repeated
        decode's context grows a token a run)."""
        new, context, attended, sequences = step.cost_inputs()
        durations_s, total_s = [], 0.0
        for k in range(repeats):
            durations_s.append(self.cost.step_s(new, context + k * new, attended + k * new, sequences))
            total_s += durations_s[-1]
            if total_s / self.time_scale >= MAX_SLEEP_S:
                break
        return durations_s

    async def _elapse(self, durations_s: list[float]) -> int:
        """Sleep the steps' time (scaled); returns how many completed: all, or up to the one running at a wake-up.

        The steps start where the last one ended on the simulated clock, not when this is called: the time the event
        loop took between them (this process's other engines, the worker, a loaded machine) is caught up, so a busy
        process does not stretch simulated time, as long as it falls no more than `MAX_LAG_S` behind."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = self._clock if self._clock is not None and now - self._clock < MAX_LAG_S else now
        ends = [start + end for end in itertools.accumulate(d / self.time_scale for d in durations_s)]
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), max(0.0, ends[-1] - now))
        except TimeoutError:
            self._clock = ends[-1]
            return len(ends)
        now = loop.time()
        index = min(bisect.bisect_right(ends, now), len(ends) - 1)  # the step running now completes
        await asyncio.sleep(max(0.0, ends[index] - now))
        self._clock = ends[index]
        return index + 1

    def _finish(self, request_id: str) -> None:
        run = self._live.pop(request_id, None)
        if run is not None:
            run.finished = True
            run.changed.set()
            run.ended.set()

    def _finish_aborted(self) -> None:
        for run in [r for r in self._live.values() if r.aborted]:
            self._drop(run)

    def _drop(self, run: _Run) -> None:
        """Out of the engine with what it generated (aborted, or its caller gone)."""
        if run.seq in self._held:
            self._held.remove(run.seq)
        else:
            self.scheduler.remove(run.seq)
        self._finish(run.seq.request_id)

    # --- control, at step boundaries as vLLM's ---

    async def abort(self, request_id: str) -> None:
        run = self._live.get(request_id)
        if run is None:
            return
        run.aborted = True
        if self._between_steps.is_set():
            self._drop(run)
        else:
            self._wake.set()  # dropped once the current step completes

    async def pause(self, mode: PauseMode) -> None:
        if mode == "wait":
            self._holding = True  # what arrives now waits for `resume`; what is in the engine finishes
            for run in [r for r in self._live.values() if r.seq not in self._held]:
                await run.ended.wait()
        elif mode == "abort":
            for request_id in list(self._live):
                await self.abort(request_id)
        self._holding = self._paused = True
        self._wake.set()
        await self._between_steps.wait()

    async def resume(self) -> None:
        self._holding = self._paused = False
        self.scheduler.waiting.extend(self._held)
        self._held.clear()
        if self._live:
            self._ensure_loop()
        self._wake.set()

    async def add_adapter(self, name: str, lora_id: int, path: str) -> None:
        """Holds the adapter's name (it generates as without one: the queue's adapter handling is what it tests)."""
        self.adapters[lora_id] = name

    async def remove_adapter(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)

    async def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        return self.scheduler.pool.reset()

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        await super().close()

    def output_tokens(self, request_id: str) -> int | None:
        run = self._live.get(request_id)
        return None if run is None else len(run.seq.output)


def sim_engine(engine: EngineSettings) -> SimEngine:
    """The simulated GPU engine of `engine`'s `sim_*` settings; ValueError for a profile it lacks."""
    lengths = None
    if engine.sim_length_median or engine.sim_length_p99:
        lengths = OutputLengths(engine.sim_length_median, engine.sim_length_p99)
    return SimEngine(
        gpu_profile(engine.sim_gpu),
        model_profile(engine.sim_model),
        capacity=engine.capacity,
        max_model_len=engine.context_len,
        max_num_batched_tokens=engine.sim_max_num_batched_tokens,
        chunked_prefill=engine.sim_gpu in GPUS,  # a fitted CPU profile: off, as vLLM on CPU runs here
        kv_cache_bytes=None if engine.sim_gpu in GPUS else engine.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES,
        time_scale=engine.sim_time_scale,
        lengths=lengths,
        load_delay_s=engine.echo_load_delay_s,
        preload_weight_transfer=engine.echo_preload_weight_transfer,
    )
