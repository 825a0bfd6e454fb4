"""What one `serve` process keeps between SkyRL's calls: the generate requests in flight by the caller's id (for
`/abort_requests`) and the texts of recent completions (for the `/detokenize` SkyRL sends after each)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.protocol import Trajectory


class InFlight:
    """The requests this `serve` process has in flight for `/inference/v1/generate`, by the caller's `request_id`
    (vLLM's id), so `/abort_requests` can name them: external id -> our request ids, each with the client (the named
    model's) that runs it."""

    def __init__(self) -> None:
        self.ids: dict[str, list[tuple[str, RolloutClient]]] = {}

    def add(self, external: str, ours: list[str], client: RolloutClient) -> None:
        self.ids.setdefault(external, []).extend((o, client) for o in ours)

    def remove(self, external: str, ours: list[str]) -> None:
        left = [(o, c) for o, c in self.ids.get(external, []) if o not in ours]
        if left:
            self.ids[external] = left
        else:
            self.ids.pop(external, None)

    def ours(self, external: list[str]) -> dict[RolloutClient, list[str]]:
        """Our request ids of the `external` ones, by the client that runs them."""
        by_client: dict[RolloutClient, list[str]] = {}
        for e in external:
            for o, client in self.ids.get(e, []):
                by_client.setdefault(client, []).append(o)
        return by_client


class DetokenizedTexts:
    """The text of each completion `/inference/v1/generate` returned lately, as a worker's `/detokenize` gives it (the
    workers decode it so: `RolloutRequest.text_as_detokenized`), so the `/detokenize` SkyRL's `generate` sends after
    each is answered here, without a worker round trip. Keyed by model and a BLAKE2b digest of the token ids, with a
    count (equal completions, as greedy samples often are, are each asked for once); each is taken once; at most
    `capacity` keys, the oldest dropped first (a caller that never asks leaves nothing behind). A miss goes to a
    worker as before."""

    def __init__(self, capacity: int = 16384) -> None:
        self.capacity = capacity
        self.texts: OrderedDict[tuple[str, bytes], tuple[str, int]] = OrderedDict()

    @staticmethod
    def _key(model: str, token_ids: Sequence[int]) -> tuple[str, bytes]:
        return model, hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).digest()

    def put(self, model: str, trajectories: Sequence[Trajectory]) -> None:
        for t in trajectories:
            if t.completion_token_ids and t.finish_reason != "abort":
                key = self._key(model, t.completion_token_ids)
                _, count = self.texts.pop(key, ("", 0))
                self.texts[key] = (t.text, count + 1)
        while len(self.texts) > self.capacity:
            self.texts.popitem(last=False)

    def take(self, model: str, token_ids: Sequence[int]) -> str | None:
        key = self._key(model, token_ids)
        text, count = self.texts.get(key, ("", 0))
        if count == 0:
            return None
        if count == 1:
            del self.texts[key]
        else:
            self.texts[key] = (text, count - 1)
        return text
