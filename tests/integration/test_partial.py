"""Partial rollouts: a completion target (or a time) ends a call early, the unfinished requests come back cut with
their tokens so far (`abort_cause="partial"`), and a later `generate` continues them token-exact; the step report."""

from __future__ import annotations

import pytest

from rollout_svc import RolloutClient
from rollout_svc.errors import InvalidRequestError

PARAMS = {"max_tokens": 1000, "temperature": 0.0}  # the echo engine returns the prompt: its length is the output's


def short(i: int) -> list[int]:
    return [20 + i % 50] * 10  # 10 tokens: 0.1 s at 10 ms a token


def long(i: int) -> list[int]:
    return [(30 + i + k) % 200 + 1 for k in range(600)]  # 600 tokens: 6 s


def assert_continues(partial, whole, prompt) -> None:
    assert partial.finish_reason == "abort" and partial.abort_cause == "partial", partial
    assert partial.completion_token_ids == prompt[: len(partial.completion_token_ids)]  # a prefix of the echo
    assert whole.finish_reason == "stop" and whole.completion_token_ids == prompt  # token-exact, whole
    assert whole.interruptions == partial.interruptions >= 1
    assert len(whole.weight_versions) >= 1


async def test_a_completion_target_cuts_the_tail_and_a_later_call_continues_it(settings, echo_workers):
    echo_workers(2, "--echo-token-delay-s", "0.01")
    prompts = [short(i) for i in range(18)] + [long(0), long(1)]
    async with RolloutClient(settings) as client:
        out = await client.generate(prompts, PARAMS, completion_target=0.9)
        assert [t.finish_reason for t in out[:18]] == ["stop"] * 18
        assert all(t.completion_token_ids == p for t, p in zip(out[:18], prompts, strict=False))
        cut = out[18:]
        assert all(0 < len(t.completion_token_ids) < 600 for t in cut), [len(t.completion_token_ids) for t in cut]
        report = await client.step_report()
        assert report.requests == 20 and report.cut == 2 and report.finished == 18
        assert report.cut_tokens == sum(len(t.completion_token_ids) for t in cut)
        assert set(report.busy_s) == {"echo-0", "echo-1"} and 0 <= report.idle_fraction < 1

        again = await client.generate(cut, PARAMS)  # the next step carries them on
    for partial, whole, prompt in zip(cut, again, prompts[18:], strict=True):
        assert_continues(partial, whole, prompt)


async def test_a_cut_after_a_time_answers_queued_requests_unrun(settings, echo_workers):
    # One worker running 2 at a time: 2 of the 4 long requests are in flight at the cut, 2 still queued (deleted from
    # the queue and answered by the client, unrun).
    echo_workers(1, "--echo-token-delay-s", "0.01", "--max-num-seqs", "2")
    prompts = [long(i) for i in range(4)]
    async with RolloutClient(settings) as client:
        out = await client.generate(prompts, PARAMS, cut_after_s=1.0)
        assert all(t.abort_cause == "partial" for t in out), [t.finish_reason for t in out]
        made = sorted(len(t.completion_token_ids) for t in out)
        assert made[:2] == [0, 0] and made[2] > 0, made
        again = await client.generate(out, PARAMS)
    for partial, whole, prompt in zip(out, again, prompts, strict=True):
        assert_continues(partial, whole, prompt)


async def test_a_sampled_step_counts_whole_groups(settings, echo_workers):
    echo_workers(2, "--echo-token-delay-s", "0.01")
    prompts = [short(i) for i in range(9)] + [long(0)]
    async with RolloutClient(settings) as client:
        sampled = await client.sample(prompts, 2, PARAMS, completion_target=0.9)
    # 9 of 10 groups finished whole; the long prompt's two samples were cut, and keep their group id
    assert all(t.finish_reason == "stop" for group in sampled[:9] for t in group)
    tail = sampled[9]
    assert [t.abort_cause for t in tail] == ["partial", "partial"]
    assert tail[0].group_id == tail[1].group_id is not None


async def test_as_completed_yields_the_cut_ones_last(settings, echo_workers):
    echo_workers(2, "--echo-token-delay-s", "0.01")
    prompts = [short(i) for i in range(9)] + [long(0)]
    async with RolloutClient(settings) as client:
        seen = [(i, t) async for i, t in client.as_completed(prompts, PARAMS, completion_target=0.9)]
        assert sorted(i for i, _ in seen) == list(range(10))
        assert seen[-1][0] == 9 and seen[-1][1].abort_cause == "partial"
        [whole] = await client.generate([seen[-1][1]], PARAMS)
    assert whole.completion_token_ids == prompts[9]


async def test_bad_targets_and_finished_trajectories_are_refused(settings, echo_workers):
    echo_workers(1)
    async with RolloutClient(settings) as client:
        for target in (0, 1.5, -0.1):
            with pytest.raises(InvalidRequestError, match="completion_target"):
                await client.generate([short(0)], PARAMS, completion_target=target)
        with pytest.raises(InvalidRequestError, match="cut_after_s"):
            await client.generate([short(0)], PARAMS, cut_after_s=0)
        with pytest.raises(InvalidRequestError, match="no generation call yet"):
            await client.step_report()
        [done] = await client.generate([short(0)], PARAMS)
        with pytest.raises(InvalidRequestError, match="finished"):
            await client.generate([done], PARAMS)
