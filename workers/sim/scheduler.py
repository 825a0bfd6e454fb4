"""vLLM v1's scheduler, simulated: continuous batching under a token budget per step, chunked prefill, paged KV
blocks and preemption by recompute (vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.sim.blocks import BlockPool, chain_hash

TokenAt = Callable[[int], int]  # output index -> token id


@dataclass(eq=False)
class Sequence:
    """One request in the simulated engine. `token_ids` are its prompt (with a continuation's earlier tokens) and
    then what it generated here; `num_computed` of them have their KV in `blocks`. It has generated `len(output)`
    tokens, and finishes at `target` (`token_at(i)` is its i-th output token)."""

    request_id: str
    token_ids: list[int]
    target: int
    token_at: TokenAt
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # of its full blocks, in order
    cached_blocks: int = 0  # its first blocks handed to the prefix cache
    cached_tokens: int = 0  # prompt tokens found in the prefix cache, over all its admissions
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.target


@dataclass
class Step:
    """What one step computes: `(sequence, new tokens)` in batch order. `decode_only`: every one computes its last
    token (a repeatable step, `Scheduler.repeatable`); `admitted`, `preempted`: sequences it moved."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    admitted: int = 0
    preempted: int = 0

    @property
    def decode_only(self) -> bool:
        return self.admitted == 0 and self.preempted == 0 and all(new == 1 for _, new in self.items)

    def cost_inputs(self) -> tuple[int, int, float, int]:
        """(new tokens, context tokens read, attended pairs, sequences) for `StepCost.step_s`."""
        new = sum(n for _, n in self.items)
        context = sum(s.num_computed + n for s, n in self.items)
        attended = sum(n * s.num_computed + n * (n + 1) / 2 for s, n in self.items)
        return new, context, attended, len(self.items)


class Scheduler:
    """Runs sequences as vLLM v1 does, one `schedule` + `commit` per step.

    A step first gives each running sequence, in order, its next tokens (one for a decode, the rest of its prompt up
    to the budget for a prefill), preempting the most recently admitted running sequence (its blocks freed, back to
    the front of the waiting queue, to recompute everything later) while the KV blocks do not suffice. Then, if
    nothing was preempted, it admits waiting sequences first come, first served while the token budget, `max_num_seqs`
    and the blocks allow, each after the longest prefix the cache holds. Without chunked prefill a prompt that does
    not fit the remaining budget waits for a later step.
    """

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool):
        self.pool, self.max_num_seqs = pool, max_num_seqs
        self.max_num_batched_tokens, self.chunked_prefill = max_num_batched_tokens, chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self.prompt_tokens = 0  # prompt tokens admitted (cached or computed)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out (finished or aborted), freeing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []

    def schedule(self) -> Step:
        step, budget = Step(), self.max_num_batched_tokens
        budget = self._schedule_running(step, budget)
        if not step.preempted:
            self._schedule_waiting(step, budget)
        return step

    def _schedule_running(self, step: Step, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            new = min(seq.num_tokens - seq.num_computed, budget)
            while self._blocks_needed(seq, new) > self.pool.free_blocks:
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                step.preempted += 1
                if victim is seq:
                    break
            else:
                seq.blocks += self.pool.allocate(self._blocks_needed(seq, new))
                step.items.append((seq, new))
                budget -= new
                index += 1
        return budget

    def _schedule_waiting(self, step: Step, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            new = seq.num_tokens - seq.num_computed - len(cached) * self.pool.block_size
            if new > budget and not self.chunked_prefill:
                break
            new = min(new, budget)
            if self._blocks_needed(seq, new + len(cached) * self.pool.block_size) > self.pool.free_blocks:
                break
            self.waiting.popleft()
            self._admit(seq, cached, new)
            step.items.append((seq, new))
            step.admitted += 1
            budget -= new

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks of `seq`'s prompt: at most all full blocks but the last token's (it must be computed)."""
        if seq.num_computed:
            return []
        self._hash_full_blocks(seq, seq.num_tokens - 1)
        return self.pool.cached_prefix(seq.hashes[: (seq.num_tokens - 1) // self.pool.block_size])

    def _admit(self, seq: Sequence, cached: list[int], new: int) -> None:
        self.pool.share(cached)
        seq.blocks, seq.cached_blocks = list(cached), len(cached)
        seq.num_computed = len(cached) * self.pool.block_size
        seq.blocks += self.pool.allocate(self._blocks_needed(seq, new))
        seq.cached_tokens += seq.num_computed
        self.cached_tokens += seq.num_computed
        self.prompt_tokens += seq.num_tokens
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.num_computed, seq.cached_blocks = [], 0, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _blocks_needed(self, seq: Sequence, new: int) -> int:
        """More blocks `seq` needs to hold its computed tokens and `new` more."""
        return max(0, -(-(seq.num_computed + new) // self.pool.block_size) - len(seq.blocks))

    def repeatable(self, step: Step, limit: int) -> int:
        """How many times (1 to `limit`) a decode-only `step` can run unchanged: until its first sequence finishes,
        while the free blocks hold every sequence's growth, and only if the waiting queue cannot be admitted
        meanwhile (empty, or `max_num_seqs` running)."""
        if not step.decode_only or (self.waiting and len(self.running) < self.max_num_seqs):
            return 1
        repeats = min([limit, *(seq.target - len(seq.output) for seq, _ in step.items)])
        while repeats > 1 and sum(self._blocks_needed(s, repeats) for s, _ in step.items) > self.pool.free_blocks:
            repeats //= 2
        return max(1, repeats)

    def commit(self, step: Step, repeats: int = 1) -> list[Sequence]:
        """Apply `step` run `repeats` times (more than once only as `repeatable` allows): computed tokens, one new
        token for each sequence that reached its last, full blocks cached. Returns the sequences now finished
        (removed, blocks freed)."""
        finished = []
        for seq, new in step.items:
            if repeats > 1:
                seq.blocks += self.pool.allocate(self._blocks_needed(seq, repeats))
            for _ in range(repeats):
                seq.num_computed += new
                if seq.num_computed == seq.num_tokens:  # the prompt done, or a decode: one token sampled
                    token = seq.token_at(len(seq.output))
                    seq.output.append(token)
                    seq.token_ids.append(token)
                new = 1
            self._cache_full_blocks(seq)
            if seq.done:
                finished.append(seq)
        for seq in finished:
            self.remove(seq)
        return finished

    def _cache_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed // self.pool.block_size
        self._hash_full_blocks(seq, full * self.pool.block_size)
        for index in range(seq.cached_blocks, full):
            self.pool.cache(seq.blocks[index], seq.hashes[index])
        seq.cached_blocks = max(seq.cached_blocks, full)

    def _hash_full_blocks(self, seq: Sequence, tokens: int) -> None:
        """Extend `seq.hashes` to the full blocks among its first `tokens` tokens."""
        size = self.pool.block_size
        for index in range(len(seq.hashes), tokens // size):
            previous = seq.hashes[-1] if seq.hashes else None
            seq.hashes.append(chain_hash(previous, seq.token_ids[index * size : (index + 1) * size]))
