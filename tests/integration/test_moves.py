"""Straggler moves (workers/moves.py): a worker running several generations while another holds nothing cuts its
oldest one and hands the continuation to the idle worker, token-exact; the producer sees one trajectory, moved once."""

from __future__ import annotations

import asyncio
import time

from rollout_svc import RolloutClient

PARAMS = {"max_tokens": 1000, "temperature": 0.0}  # the echo engine returns the prompt
ECHO = ("--engine", "echo", "--echo-token-delay-s", "0.01")
MOVES = {"ROLLOUT_MOVE_STRAGGLERS": "1", "ROLLOUT_MOVE_AFTER_S": "0.5", "ROLLOUT_MOVE_CHECK_S": "0.2"}


def long(i: int) -> list[int]:
    return [(40 + i + k) % 200 + 1 for k in range(500)]  # 500 tokens: 5 s at 10 ms a token


async def running_on(client: RolloutClient, worker_id: str, count: int) -> None:
    deadline = time.monotonic() + 20
    while not any(w.worker_id == worker_id and w.in_flight >= count for w in await client.workers()):
        assert time.monotonic() < deadline, f"{count} requests never ran on {worker_id}"
        await asyncio.sleep(0.05)


async def test_a_straggler_moves_to_a_worker_that_joins_idle(settings, workers):
    workers.start_ready(["echo-0"], *ECHO, env=MOVES)
    prompts = [long(i) for i in range(3)]
    async with RolloutClient(settings) as client:
        call = asyncio.create_task(client.generate(prompts, PARAMS))
        await running_on(client, "echo-0", 3)
        workers.start_ready(["echo-1"], *ECHO, env=MOVES)  # idle: echo-0 moves its oldest generation there
        out = await call
        report = await client.step_report()
    assert [t.completion_token_ids for t in out] == prompts  # token-exact, wherever they ran
    assert all(t.finish_reason == "stop" for t in out)
    moved = [t for t in out if t.worker_id == "echo-1"]
    assert len(moved) == 1 and moved[0].interruptions == 1, [(t.worker_id, t.interruptions) for t in out]
    assert all(t.interruptions == 0 for t in out if t.worker_id == "echo-0")
    assert report.moves == 1


async def test_no_move_for_a_lone_generation_nor_for_a_session(settings, workers):
    workers.start_ready(["echo-0"], *ECHO, env=MOVES)
    async with RolloutClient(settings) as client:
        # one generation alone on its worker, and two of one session: none moves to the idle worker
        call = asyncio.create_task(client.generate([long(0)], PARAMS))
        await running_on(client, "echo-0", 1)
        workers.start_ready(["echo-1"], *ECHO, env=MOVES)
        [alone] = await call
        assert alone.worker_id == "echo-0" and alone.interruptions == 0
        sessions = ["s-1", "s-1"]
        out = await client.generate([long(1), long(2)], PARAMS, session_ids=sessions)
        assert {t.worker_id for t in out} == {out[0].worker_id} and all(t.interruptions == 0 for t in out)
