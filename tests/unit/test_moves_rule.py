"""Which generation a straggler move takes (workers/moves.py): the one that has made the most tokens, not the
oldest, and only where its expected rest is worth a re-prefill. The hand-over itself runs on echo workers in
tests/integration/test_moves.py."""

from __future__ import annotations

import asyncio

from rollout_svc.config import Settings, WorkerSettings
from rollout_svc.dataplane.streams import Entry
from rollout_svc.protocol import Continuation, RolloutRequest
from workers.inflight import InFlight
from workers.moves import REPREFILL_RATIO, StragglerMover


class Engine:
    def __init__(self, made: dict[str, int]) -> None:
        self.made = made

    def output_tokens(self, request_id: str) -> int | None:
        return self.made.get(request_id)


class Index:
    """The part of `InFlightIndex` the mover reads: records, the engine, and the cancel path."""

    def __init__(self, records: list[InFlight], made: dict[str, int]) -> None:
        self._records, self.engine, self.cancelled = records, Engine(made), []

    def records(self) -> list[InFlight]:
        return self._records

    async def cancel(self, record: InFlight, cause: str) -> None:
        record.abort_cause = cause  # type: ignore[assignment]
        self.cancelled.append((record.request.request_id, cause, record.move_to))  # type: ignore[union-attr]


class Streams:
    def __init__(self, idle: list[str]) -> None:
        self.idle = idle

    async def idle_workers(self, worker_id: str, ttl_ms: int) -> list[str]:
        return self.idle


def record(request_id: str, entered_at: float, prompt: int = 100, max_tokens: int = 4000, kept: int = 0) -> InFlight:
    continuation = None
    if kept:
        continuation = Continuation(
            token_ids=[7] * kept, logprobs=[-1.0] * kept, retry_of=f"{request_id}-first", interruptions=1
        )
    request = RolloutRequest(
        request_id=request_id,
        prompt_token_ids=[5] * prompt,
        sampling_params={"max_tokens": max_tokens},
        reply_to="results",
        continuation=continuation,
    )
    return InFlight(Entry("s", b"1-0", b"", 1), generation=True, request=request, in_engine=True, entered_at=entered_at)


def moves(records: list[InFlight], made: dict[str, int], idle: list[str]) -> list[tuple[str, str, str | None]]:
    settings = Settings(worker=WorkerSettings(move_stragglers=True, move_after_s=0.01, placement="cost"))
    index = Index(records, made)
    mover = StragglerMover(settings, "busy", index, Streams(idle), None)  # type: ignore[arg-type]
    asyncio.run(mover.check())
    return index.cancelled


def test_the_generation_with_the_most_tokens_moves_first_not_the_oldest():
    records = [record("oldest", 1.0), record("longest", 2.0), record("middle", 3.0)]
    made = {"oldest": 40, "longest": 900, "middle": 300}
    assert moves(records, made, ["idle-1"]) == [("longest", "migrate", "idle-1")]
    # two idle workers: the two that made the most, and one stays here
    records = [record("oldest", 1.0), record("longest", 2.0), record("middle", 3.0)]
    assert moves(records, made, ["idle-1", "idle-2"]) == [
        ("longest", "migrate", "idle-1"),
        ("middle", "migrate", "idle-2"),
    ]


def test_tokens_made_before_an_interruption_count():
    records = [record("fresh", 1.0), record("continued", 5.0, kept=600)]
    assert moves(records, {"fresh": 500, "continued": 50}, ["idle-1"])[0][0] == "continued"


def test_no_move_where_the_re_prefill_outweighs_the_expected_rest():
    # 10 tokens made: an expected rest of 10 is not worth prefilling 4,000 prompt tokens again
    records = [record("long-prompt", 1.0, prompt=4000), record("other", 2.0, prompt=4000)]
    assert moves(records, {"long-prompt": 10, "other": 10}, ["idle-1"]) == []
    # nearly at max_tokens: little rest left, whatever it made
    records = [record("done-soon", 1.0, max_tokens=1000), record("other", 2.0, max_tokens=1000)]
    assert moves(records, {"done-soon": 995, "other": 1}, ["idle-1"]) == []
    # enough made: the rest is worth it
    rest = (4000 + 300) // REPREFILL_RATIO + 1
    records = [record("worth", 1.0, prompt=4000), record("other", 2.0, prompt=4000)]
    assert moves(records, {"worth": max(300, rest), "other": 10}, ["idle-1"]) == [("worth", "migrate", "idle-1")]
