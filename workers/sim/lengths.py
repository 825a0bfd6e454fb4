"""How long a simulated sample runs before its end-of-sequence token: a long-tailed length drawn per sample."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

Z_99 = 2.3263  # the standard normal's 99th percentile


@dataclass(frozen=True)
class OutputLengths:
    """Log-normal output lengths with median `median` and 99th percentile `p99` (tokens), where the samples of one
    prompt are alike: `group_share` of the log-variance is the prompt's (drawn once per prompt), the rest each
    sample's. Samples of a prompt having similar lengths is Seer's observation ("Seer: Online
    Context Learning for Fast Synchronous LLM Reinforcement Learning", 2025); the log-normal tail is the usual fit of
    reasoning-length distributions. Deterministic: a length is a function of (prompt, sample)."""

    median: int
    p99: int
    group_share: float = 0.7

    def __post_init__(self) -> None:
        if not 0 < self.median < self.p99:
            raise ValueError(f"output lengths need 0 < median < p99, got median {self.median}, p99 {self.p99}")

    def length(self, prompt_key: int, sample_key: int) -> int:
        """The output length (>= 1) of sample `sample_key` of the prompt `prompt_key` (both any ints)."""
        sigma = math.log(self.p99 / self.median) / Z_99
        group = random.Random(prompt_key).gauss(0.0, sigma * math.sqrt(self.group_share))
        sample = random.Random(hash((prompt_key, sample_key))).gauss(0.0, sigma * math.sqrt(1 - self.group_share))
        return max(1, round(self.median * math.exp(group + sample)))
