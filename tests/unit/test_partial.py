"""Completion targets count whole groups; the step report's busy time is a union of intervals."""

from __future__ import annotations

from rollout_svc.client.calls import GroupTarget
from rollout_svc.client.lifecycle import cut_fields
from rollout_svc.client.steps import step_report
from rollout_svc.protocol import RolloutRequest, Trajectory


def request(i: int, group: str | None = None, max_tokens: int = 16) -> RolloutRequest:
    return RolloutRequest(
        request_id=f"r{i}",
        group_id=group,
        prompt_token_ids=[1, 2],
        reply_to="x",
        sampling_params={"max_tokens": max_tokens},
    )


def test_a_target_counts_groups_finished_whole():
    requests = [request(i, f"g{i // 4}") for i in range(8)] + [request(8), request(9)]  # 2 groups of 4, 2 alone
    target = GroupTarget(requests, 0.5)  # 4 groups: 2 needed
    assert target.needed == 2
    for i in (0, 1, 2, 4, 5, 6):  # three of each group of 4: none whole
        target.finished(i)
    assert target.complete == 0 and not target.reached
    target.finished(8)
    assert target.complete == 1 and not target.reached
    target.finished(3)
    assert target.reached
    assert GroupTarget(requests[:1], 0.01).needed == 1  # at least one
    assert GroupTarget(requests, 0.9).needed == 4  # ceil(3.6)
    assert GroupTarget(requests, 1.0).needed == 4


def trajectory(worker: str, queue_s: float, generation_s: float, **fields) -> Trajectory:
    return Trajectory(
        request_id="r",
        prompt_token_ids=[1],
        finish_reason=fields.pop("finish_reason", "stop"),
        worker_id=worker,
        queue_time_s=queue_s,
        generation_time_s=generation_s,
        **fields,
    )


def test_the_step_report_unions_each_workers_intervals():
    ts = [
        trajectory("a", 0.0, 4.0, completion_token_ids=[1, 2]),
        trajectory("a", 1.0, 2.0),  # inside the first: adds nothing
        trajectory("a", 6.0, 2.0, interruptions=0),  # [6, 8]
        trajectory(
            "b", 0.0, 2.0, finish_reason="abort", abort_cause="partial", completion_token_ids=[5], interruptions=1
        ),
    ]
    report = step_report(ts, started_at=100.0, ended_at=110.0, workers=["a", "b", "c"])
    assert report.busy_s == {"a": 6.0, "b": 2.0, "c": 0.0}
    assert report.makespan_s == 10.0
    assert abs(report.idle_fraction - (1 - 8.0 / 30.0)) < 1e-9
    assert (report.requests, report.finished, report.cut, report.moves) == (4, 3, 1, 0)  # the cut's own: no move
    assert (report.output_tokens, report.cut_tokens) == (3, 1)
    assert report.scaled(10).makespan_s == 100.0 and report.scaled(10).busy_s["a"] == 60.0
    assert "idle fraction 0.73" in report.summary()


def test_a_cut_answer_is_partial_unless_it_finished_or_had_every_token():
    req = request(0, max_tokens=2)
    aborted = trajectory("a", 0, 0, finish_reason="abort", abort_cause="user", completion_token_ids=[1])
    assert cut_fields(req, aborted) == {"abort_cause": "partial", "interruptions": 1}
    full = aborted.model_copy(update={"completion_token_ids": [1, 2]})
    assert cut_fields(req, full) == {"finish_reason": "length", "abort_cause": None}
    assert cut_fields(req, trajectory("a", 0, 0)) == {}
