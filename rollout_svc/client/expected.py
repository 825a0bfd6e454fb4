"""Expected output lengths per prompt, learned from the groups a client has sampled: the samples of one prompt run
to similar lengths (Seer's observation: "Seer: Online Context Learning for Fast Synchronous LLM Reinforcement
Learning", 2025), and an RL job samples the same prompts again every epoch.

`RolloutClient.sample` uses them twice (`expected_lengths=True`, the default): each request of a group carries its
prompt's expected length (`RolloutRequest.expected_tokens`), which placement by cost counts in place of `max_tokens`,
so a worker's share is the work it is expected to do, not the most it might; and the groups are enqueued longest
expected first (unknown ones first of all: they may be long), so in a queue longer than the fleet the long groups
start first (longest processing time first: Graham 1969, "Bounds on multiprocessing timing anomalies").
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from rollout_svc.protocol import Trajectory

# How much a new group's mean moves the expectation: an exponential moving average over the epochs that sampled it.
NEW_WEIGHT = 0.5


class ExpectedLengths:
    """Output tokens expected of a sample of a prompt (token ids), from the finished samples of earlier groups of
    it: a moving average of the groups' mean length (weight `NEW_WEIGHT` for the newest). At most `capacity`
    prompts are remembered, the least recently sampled forgotten first. Not thread-safe (one event loop)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._by_prompt: OrderedDict[bytes, float] = OrderedDict()

    @staticmethod
    def _key(prompt: Sequence[int]) -> bytes:
        return hashlib.blake2b(array("q", prompt).tobytes(), digest_size=16).digest()

    def expected(self, prompt: Sequence[int]) -> int | None:
        """Expected output tokens of one sample of `prompt` (>= 1), or None if no sample of it finished yet."""
        value = self._by_prompt.get(self._key(prompt))
        return None if value is None else max(1, round(value))

    def order(self, prompts: Sequence[Sequence[int]], by_length: bool = True) -> list[tuple[int, int | None]]:
        """(index, expected length) of each of `prompts`, longest expected first: unknown ones (None) first, in
        input order, then by expected length, longest first (ties in input order). Without `by_length`: each in
        input order with None (nothing looked up)."""
        if not by_length:
            return [(i, None) for i in range(len(prompts))]
        expected = [(i, self.expected(p)) for i, p in enumerate(prompts)]
        return sorted(expected, key=lambda pair: (pair[1] is not None, -(pair[1] or 0)))

    def observe(self, prompt: Sequence[int], group: Sequence[Trajectory]) -> None:
        """Learn from one group of `prompt`: the mean completion length of its samples that ran (finished or cut:
        a cut sample's length is a lower bound, taken as it is); errors and unrun samples say nothing."""
        lengths = [len(t.completion_token_ids) for t in group if t.finish_reason != "error" and t.completion_token_ids]
        if not lengths:
            return
        key, mean = self._key(prompt), sum(lengths) / len(lengths)
        old = self._by_prompt.pop(key, None)
        self._by_prompt[key] = mean if old is None else (1 - NEW_WEIGHT) * old + NEW_WEIGHT * mean
        while len(self._by_prompt) > self.capacity:
            self._by_prompt.popitem(last=False)

    def __len__(self) -> int:
        return len(self._by_prompt)
