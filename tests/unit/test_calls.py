"""A call's results by position: first answer wins, completion order, streamed events, and the merge of a request's
attempts (retries and regenerations) into the one trajectory its caller sees."""

from __future__ import annotations

import asyncio
from typing import Any

from rollout_svc.client.calls import Call
from rollout_svc.protocol import RolloutRequest, Trajectory, TrajectoryChunk


def requests(count: int) -> list[RolloutRequest]:
    return [RolloutRequest(request_id=f"r-{i}", prompt_token_ids=[1], reply_to="results") for i in range(count)]


def trajectory(request_id: str, **fields: Any) -> Trajectory:
    values: dict[str, Any] = {"request_id": request_id, "prompt_token_ids": [1], "finish_reason": "stop"}
    return Trajectory(**(values | fields))


def drain(queue: asyncio.Queue[Any]) -> list[Any]:
    return [queue.get_nowait() for _ in range(queue.qsize())]


async def test_a_position_keeps_its_first_result_and_the_call_is_done_when_every_position_has_one():
    call = Call(requests(2), asyncio.get_running_loop())
    first, second = trajectory("r-1", text="first"), trajectory("r-1", text="second")
    call.set(1, first)
    call.set(1, second)  # a late duplicate
    assert call.results == [None, first] and call.remaining == 1 and call.unfinished() == [0]
    assert not call.done.done()
    call.set(0, trajectory("r-0"))
    assert call.done.done() and call.remaining == 0 and call.unfinished() == []
    assert Call([], asyncio.get_running_loop()).done.done()  # nothing to await


async def test_completed_gives_positions_finished_before_the_first_look_then_the_rest_as_they_finish():
    call = Call(requests(4), asyncio.get_running_loop())
    call.set(2, trajectory("r-2"))
    call.set(0, trajectory("r-0"))
    assert drain(call.completed) == [0, 2]  # those finished before, in position order
    call.set(3, trajectory("r-3"))
    call.set(1, trajectory("r-1"))
    assert drain(call.completed) == [3, 1]  # then in finishing order


async def test_events_carry_a_streaming_positions_chunks_then_its_end_and_nothing_after():
    call = Call(requests(2), asyncio.get_running_loop(), chunks=True)
    assert call.events is not None and Call(requests(1), asyncio.get_running_loop()).events is None
    chunk = TrajectoryChunk(request_id="r-1", offset=0, token_ids=[5])
    call.chunk(1, chunk)
    call.set(1, trajectory("r-1"))
    call.chunk(1, TrajectoryChunk(request_id="r-1", offset=1, token_ids=[6]))  # after its end: dropped
    assert drain(call.events) == [(1, chunk), (1, None)]


async def test_a_request_answered_at_its_first_attempt_is_returned_as_it_is():
    call = Call(requests(1), asyncio.get_running_loop())
    answer = trajectory("r-0", queue_time_s=0.5)
    assert call.merged(0, answer) is answer  # no copy on the common path


async def test_a_retried_request_is_answered_under_its_own_id_with_the_times_of_every_attempt():
    call = Call(requests(1), asyncio.get_running_loop())
    cut = trajectory("r-0", finish_reason="abort", abort_cause="pause", queue_time_s=0.5, generation_time_s=1.0)
    call.renew(0, "r-7", cut)
    cut_again = trajectory("r-7", finish_reason="abort", abort_cause="pause", queue_time_s=0.25, generation_time_s=2.0)
    call.renew(0, "r-8", cut_again)
    [position] = call.positions
    assert position.attempt_id == "r-8" and position.partial == cut_again and position.regenerations == 0

    last = trajectory("r-8", interruptions=2, queue_time_s=0.125, generation_time_s=4.0)
    merged = call.merged(0, last)
    assert merged.request_id == "r-0" and merged.interruptions == 2
    assert (merged.queue_time_s, merged.generation_time_s) == (0.875, 7.0)
    assert call.merged(0, last, finish_reason="length").finish_reason == "length"  # the update applies


async def test_a_regenerated_request_is_answered_under_its_own_id_with_the_times_of_its_last_generation():
    call = Call(requests(1), asyncio.get_running_loop())
    call.renew(0, "r-5", trajectory("r-0", finish_reason="abort", abort_cause="pause", generation_time_s=1.0))
    call.renew(0, "r-6", None)  # dropped as stale: starts over
    [position] = call.positions
    assert position.attempt_id == "r-6" and position.partial is None and position.regenerations == 1

    merged = call.merged(0, trajectory("r-6", queue_time_s=0.5, generation_time_s=2.0, staleness=0))
    assert merged.request_id == "r-0" and (merged.queue_time_s, merged.generation_time_s) == (0.5, 2.0)
    assert merged.staleness == 0


async def test_a_position_whose_retry_could_not_be_sent_ends_with_its_partial_tokens_as_an_abort():
    call = Call(requests(1), asyncio.get_running_loop())
    cut = trajectory(
        "r-0", completion_token_ids=[7], logprobs=[-0.5], finish_reason="abort", abort_cause="pause", interruptions=1
    )
    call.renew(0, "r-3", cut.model_copy(update={"request_id": "r-2", "queue_time_s": 0.5, "generation_time_s": 1.0}))
    call.end_with_partial(0)
    [ended] = call.results
    assert ended.request_id == "r-0" and ended.completion_token_ids == [7] and ended.finish_reason == "abort"
    assert ended.abort_cause == "pause" and ended.interruptions == 2  # the cut that was not retried counts
    assert (ended.queue_time_s, ended.generation_time_s) == (0.5, 1.0)  # the partial's own, counted once


async def test_expire_ends_only_the_positions_being_retried_with_their_partial_tokens_and_cause_deadline():
    call = Call(requests(3), asyncio.get_running_loop())
    done = trajectory("r-0")
    call.set(0, done)
    call.renew(
        1,
        "r-9",
        trajectory("r-1", completion_token_ids=[4], logprobs=[0.0], finish_reason="abort", abort_cause="shutdown"),
    )
    call.expire()
    assert call.results[0] is done and call.results[2] is None and call.unfinished() == [2]
    expired = call.results[1]
    assert expired.request_id == "r-1" and expired.completion_token_ids == [4]
    assert (expired.finish_reason, expired.abort_cause, expired.interruptions) == ("abort", "deadline", 1)
