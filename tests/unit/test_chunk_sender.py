"""The chunk sender of a streaming request (workers/serve.py `ChunkSender`): when it sends a `TrajectoryChunk` and
what the chunk holds, driven token by token with a clock the test moves. No Redis, no engine."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_svc.config import Settings
from rollout_svc.protocol import RolloutRequest, SamplingParams, TrajectoryChunk
from workers.engine import Completion
from workers.serve import ChunkSender
from workers.state import WorkerState
from workers.totals import ServedTotals

INTERVAL_S = 0.0625  # exact in binary: the clock adds and halves it without rounding
CHUNK_TOKENS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Server:
    """What a ChunkSender uses of its `RequestServer`: the settings, the worker's id, and `send_chunk` (recorded)."""

    def __init__(self) -> None:
        self.settings = Settings(stream_interval_s=INTERVAL_S, stream_chunk_tokens=CHUNK_TOKENS)
        self.state = WorkerState("w-1")
        self.totals = ServedTotals()
        self.sent: list[tuple[str, TrajectoryChunk]] = []

    async def send_chunk(self, reply_to: str, chunk: TrajectoryChunk) -> None:
        self.sent.append((reply_to, chunk))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def server() -> Server:
    return Server()


def sender(server: Server, clock: Clock, offset: int = 0, logprobs: int | None = None) -> ChunkSender:
    params = SamplingParams(max_tokens=64, logprobs=logprobs)
    request = RolloutRequest(request_id="r-1", prompt_token_ids=[1], reply_to="results-p", sampling_params=params)
    return ChunkSender(server, request, offset, clock=clock)  # type: ignore[arg-type]


def delta(*token_ids: int, tops: bool = False) -> Completion:
    extra: Any = ([[(t, chr(t), -0.5)] for t in token_ids], [chr(t) for t in token_ids]) if tops else (None, None)
    return Completion([], list(token_ids), [-0.5] * len(token_ids), "", "".join(chr(t) for t in token_ids), *extra)


def sent_tokens(server: Server) -> list[tuple[int, list[int]]]:
    return [(chunk.offset, chunk.token_ids) for _, chunk in server.sent]


async def test_the_first_token_goes_at_once_then_a_chunk_once_it_holds_stream_chunk_tokens(
    server: Server, clock: Clock
):
    send = sender(server, clock)
    await send(delta(64))  # no time passes: the first token goes anyway (time to first token)
    assert sent_tokens(server) == [(0, [64])]
    assert server.totals.first_tokens == 1  # counted once for the heartbeat, at the first chunk only
    for token in range(65, 65 + 2 * CHUNK_TOKENS - 1):  # then only a full chunk is sent
        await send(delta(token))
    assert sent_tokens(server) == [(0, [64]), (1, [65, 66, 67, 68])]
    await send(delta(72))
    assert sent_tokens(server) == [(0, [64]), (1, [65, 66, 67, 68]), (5, [69, 70, 71, 72])]
    assert server.totals.first_tokens == 1


async def test_a_delta_of_many_tokens_is_sent_whole(server: Server, clock: Clock):
    send = sender(server, clock)
    await send(delta(65, 66))
    await send(delta(67, 68, 69, 70, 71))
    assert sent_tokens(server) == [(0, [65, 66]), (2, [67, 68, 69, 70, 71])]


async def test_after_an_interval_two_tokens_are_enough(server: Server, clock: Clock):
    send = sender(server, clock)
    await send(delta(64))  # the first, at once
    clock.now += INTERVAL_S
    await send(delta(65))
    assert len(server.sent) == 1  # one token: wait for a second, not an entry per token
    await send(delta(66))
    assert sent_tokens(server) == [(0, [64]), (1, [65, 66])]
    clock.now += INTERVAL_S / 2
    await send(delta(67))
    await send(delta(68))
    assert len(server.sent) == 2  # the interval counts from the last send
    clock.now += INTERVAL_S / 2
    await send(delta(69))
    assert sent_tokens(server) == [(0, [64]), (1, [65, 66]), (3, [67, 68, 69])]


async def test_after_four_intervals_one_token_is_sent(server: Server, clock: Clock):
    send = sender(server, clock)
    await send(delta(64))  # the first, at once
    clock.now += 4 * INTERVAL_S - 0.001
    await send(delta(65))
    assert len(server.sent) == 1
    clock.now += 0.001
    await send(delta(66))  # would go with 2 tokens anyway: check a single token on the next
    clock.now += 4 * INTERVAL_S
    await send(delta(67))
    assert sent_tokens(server) == [(0, [64]), (1, [65, 66]), (3, [67])]


async def test_what_is_gathered_at_the_end_is_not_sent_and_flush_of_nothing_sends_nothing(server: Server, clock: Clock):
    send = sender(server, clock)
    await send(delta(64))
    await send(delta(65))
    assert sent_tokens(server) == [(0, [64])]  # the final trajectory holds 65
    await send.flush()
    await send.flush()
    assert sent_tokens(server) == [(0, [64]), (1, [65])]


async def test_a_continuation_gathers_from_the_start_and_a_chunk_holds_the_joined_deltas(server: Server, clock: Clock):
    send = sender(server, clock, offset=10, logprobs=1)  # a continuation: 10 tokens kept, its caller has them
    await send(delta(104, 105, tops=True))
    await send(delta(33, tops=True))
    await send(delta(33, tops=True))
    [(reply_to, chunk)] = server.sent
    assert reply_to == "results-p"
    assert (chunk.request_id, chunk.worker_id, chunk.offset) == ("r-1", "w-1", 10)
    assert chunk.token_ids == [104, 105, 33, 33] and chunk.logprobs == [-0.5] * 4 and chunk.text == "hi!!"
    assert chunk.tokens == ["h", "i", "!", "!"]
    assert [[tuple(top) for top in position] for position in chunk.top_logprobs or []] == [
        [(104, "h", -0.5)],
        [(105, "i", -0.5)],
        [(33, "!", -0.5)],
        [(33, "!", -0.5)],
    ]
    assert send.offset == 14
