"""The chaos soak's checks, fed made-up histories: each violation it should see, it sees; a clean history is clean."""

from __future__ import annotations

from typing import Any

from rollout_svc.protocol import Trajectory
from rollout_svc.tools.chaos.ledger import Answer, Ledger, Submitted, check

T0 = 1_000_000.0
PROMPT = [72, 101, 108, 108, 111, 33]  # "Hello!"


def submit(
    ledger: Ledger,
    request_id: str,
    at: float = T0,
    session_id: str | None = None,
    max_tokens: int = 4,
    max_staleness: int | None = None,
) -> None:
    ledger.submit(Submitted(request_id, PROMPT, max_tokens, at, session_id, f"call of {request_id}", max_staleness))


def echo(request_id: str, max_tokens: int = 4, **fields: Any) -> Trajectory:
    """What the echo engine answers: the prompt, cut at max_tokens."""
    values: dict[str, Any] = {
        "request_id": request_id,
        "prompt_token_ids": PROMPT,
        "completion_token_ids": PROMPT[:max_tokens],
        "finish_reason": "length" if len(PROMPT) > max_tokens else "stop",
        "worker_id": "w0",
        "queue_time_s": 0.01,
        "generation_time_s": 0.1,
    }
    return Trajectory(**(values | fields))


def answer(ledger: Ledger, trajectory: Trajectory, at: float = T0 + 1) -> None:
    ledger.answer(trajectory.request_id, Answer(at, trajectory=trajectory))


def checks(ledger: Ledger) -> list[str]:
    return [v["check"] for v in check(ledger).violations]


def test_a_clean_history_has_no_violations_and_counts_its_outcomes():
    ledger = Ledger(T0)
    submit(ledger, "a")
    answer(ledger, echo("a"))
    submit(ledger, "b", max_tokens=10)
    answer(ledger, echo("b", max_tokens=10))
    submit(ledger, "c")
    ledger.answer("c", Answer(T0 + 1, refused="ConnectionError: Redis away"))
    submit(ledger, "d")
    answer(ledger, echo("d", finish_reason="error", completion_token_ids=[], error_code="max_deliveries"))
    verdict = check(ledger)
    assert verdict.violations == []
    assert verdict.outcomes == {"ok": 2, "refused": 1, "dead_letter": 1}


def test_a_request_never_answered_or_answered_twice_is_a_violation():
    ledger = Ledger(T0)
    submit(ledger, "lost")
    submit(ledger, "twice")
    answer(ledger, echo("twice"))
    answer(ledger, echo("twice"))
    answer(ledger, echo("stranger"))
    violations = check(ledger).violations
    assert [(v["check"], v["request_id"]) for v in violations] == [
        ("exactly_once", "lost"),
        ("exactly_once", "twice"),
        ("exactly_once", "stranger"),
    ]


def test_late_and_wrong_answers_are_violations_naming_the_faults_near_them():
    ledger = Ledger(T0)
    ledger.fault("redis_restart", "SIGKILL", T0 - 1)
    ledger.fault("stall", "w1", T0 + 100)  # after the answer: not named
    submit(ledger, "late")
    ledger.answer("late", Answer(T0 + 30, late=True))
    submit(ledger, "short")
    answer(ledger, echo("short", completion_token_ids=PROMPT[:3]))
    submit(ledger, "misrouted")
    answer(ledger, echo("someone-else"))
    ledger.answers["misrouted"] = ledger.answers.pop("someone-else")
    submit(ledger, "failed")
    answer(ledger, echo("failed", finish_reason="error", completion_token_ids=[], error_code="engine_error"))
    violations = {v["request_id"]: v for v in check(ledger).violations}
    assert {k: v["check"] for k, v in violations.items()} == {
        "late": "late",
        "short": "wrong_answer",
        "misrouted": "wrong_answer",
        "failed": "wrong_answer",
    }
    assert violations["late"]["faults_near"] == ["-1.0 s redis_restart SIGKILL"]


def test_an_explicit_abort_is_an_answer_only_if_an_abort_of_its_session_came_after_it_was_sent():
    ledger = Ledger(T0)
    aborted = {"finish_reason": "abort", "abort_cause": "user", "completion_token_ids": PROMPT[:2]}
    submit(ledger, "hit", session_id="s1")
    answer(ledger, echo("hit", **aborted))
    ledger.session_aborted("s1", T0 + 0.5)
    submit(ledger, "unexplained", at=T0 + 1, session_id="s1")  # sent after the only abort of s1
    answer(ledger, echo("unexplained", **aborted), at=T0 + 2)
    submit(ledger, "garbled", session_id="s1")
    answer(ledger, echo("garbled", **(aborted | {"completion_token_ids": [1, 2]})))
    verdict = check(ledger)
    assert verdict.outcomes["aborted_by_user"] == 1
    assert {v["request_id"]: v["check"] for v in verdict.violations} == {
        "unexplained": "unexplained_abort",
        "garbled": "wrong_answer",
    }


def test_one_session_on_two_workers_at_once_is_a_violation_but_not_one_after_the_other():
    ledger = Ledger(T0)
    for request_id, worker_id, queue_time_s in [("a", "w0", 0.0), ("b", "w1", 0.05), ("c", "w1", 0.2)]:
        submit(ledger, request_id, session_id="s1")
        answer(ledger, echo(request_id, worker_id=worker_id, queue_time_s=queue_time_s, generation_time_s=0.1))
    # "a" runs on w0 over [0, 0.1], "b" on w1 over [0.05, 0.15]: at once. "c" on w1 over [0.2, 0.3]: after both.
    verdict = check(ledger)
    assert [(v["check"], v["request_id"]) for v in verdict.violations] == [("sessions", "b")]
    assert "served by w0 and w1 at once" in verdict.violations[0]["what"]
    assert verdict.sessions["moves"] == 1


def test_trajectories_retried_after_an_abort_are_not_timed():
    ledger = Ledger(T0)
    submit(ledger, "a", session_id="s1")
    answer(ledger, echo("a", worker_id="w0"))
    submit(ledger, "b", session_id="s1")
    answer(ledger, echo("b", worker_id="w1", interruptions=1))  # its summed times say nothing of when it ran where
    verdict = check(ledger)
    assert verdict.violations == []
    assert verdict.sessions["untimed"] == 1 and verdict.sessions["timed_requests"] == 1


def test_a_late_request_is_excused_only_while_no_worker_could_serve_it():
    """Unanswered within its 30 s timeout: a violation if the fleet could take work for 10 s or more of its wait
    (lost, or hung), excused and counted apart if it could not (every worker stale with no peer holding the
    committed version, the fleet paused, Redis away)."""
    ledger = Ledger(T0)
    submit(ledger, "waited-out")
    ledger.answer("waited-out", Answer(T0 + 30, late=True))
    ledger.could_not_serve(T0 - 5, T0 + 12)
    ledger.could_not_serve(T0 + 14, T0 + 40)  # 2 s of 30 serviceable
    assert ledger.serviceable_s(T0, T0 + 30) == 2.0
    verdict = check(ledger)
    assert verdict.violations == [] and verdict.outcomes == {"late_excused": 1}
    ledger = Ledger(T0)
    submit(ledger, "lost")
    ledger.answer("lost", Answer(T0 + 30, late=True))
    ledger.could_not_serve(T0, T0 + 19)  # 11 s of 30 serviceable
    [violation] = check(ledger).violations
    assert violation["check"] == "late" and "11.0 s of it serviceable" in violation["what"]


def test_a_workers_answer_that_the_deadline_passed_is_judged_as_a_late_request():
    """A worker that takes a request past its deadline answers it `abort` (cause `deadline`) unrun, and the call
    returns that rather than raising `RequestTimeoutError`: the same outcome, judged the same way (a 10-minute soak
    counted 24 such answers as wrong)."""
    unrun = {"completion_token_ids": [], "finish_reason": "abort", "abort_cause": "deadline"}
    ledger = Ledger(T0)
    submit(ledger, "excused")
    answer(ledger, echo("excused", **unrun), at=T0 + 30)
    ledger.could_not_serve(T0, T0 + 25)  # 5 s of 30 serviceable
    verdict = check(ledger)
    assert verdict.violations == [] and verdict.outcomes == {"late_excused": 1}
    ledger = Ledger(T0)
    submit(ledger, "late")
    answer(ledger, echo("late", **unrun), at=T0 + 30)
    [violation] = check(ledger).violations
    assert violation["check"] == "late" and violation["what"].startswith("answered abort (deadline)")


def test_a_bounded_request_cut_for_staleness_is_an_answer_if_its_tokens_are_a_prefix_of_the_echo():
    """With `max_staleness=0` and `stale_policy="mark"` a request a commit made too stale comes back `abort` (cause
    `staleness`) with its tokens so far, all from its first version: an answer, counted apart. Cut with tokens that
    are not the echo's, it is a wrong answer; a cut of a request that carries no bound is unexplained, as before."""
    cut = {"finish_reason": "abort", "abort_cause": "staleness"}
    ledger = Ledger(T0)
    submit(ledger, "cut", max_staleness=0)
    answer(ledger, echo("cut", **cut, completion_token_ids=PROMPT[:2], weight_versions=[(3, 0)], weight_version=4))
    submit(ledger, "cut-unrun", max_staleness=0)  # a continuation taken after the commit: cut before the engine
    answer(ledger, echo("cut-unrun", **cut, completion_token_ids=[], weight_versions=[], weight_version=4))
    submit(ledger, "whole", max_staleness=0)  # finished before the load, received after the commit: not cut
    answer(ledger, echo("whole", weight_versions=[(3, 0)], staleness=1))
    submit(ledger, "garbled", max_staleness=0)
    answer(ledger, echo("garbled", **cut, completion_token_ids=[1, 2], weight_versions=[(3, 0)]))
    submit(ledger, "unbounded")
    answer(ledger, echo("unbounded", **cut, completion_token_ids=PROMPT[:2], weight_versions=[(3, 0)]))
    verdict = check(ledger)
    assert verdict.outcomes == {"cut_for_staleness": 2, "ok": 1, "wrong_answer": 2}
    assert {v["request_id"]: v["check"] for v in verdict.violations} == {
        "garbled": "wrong_answer",
        "unbounded": "wrong_answer",
    }
    assert verdict.bounds == {
        "bounded_requests": 4,
        "cut_for_staleness": 3,  # the garbled one was cut too (and is a wrong answer)
        "answered_whole": 1,
        "whole_stale_at_receipt": 1,
    }


def test_a_bounded_trajectory_generated_across_a_sync_is_a_violation_but_not_an_unbounded_one():
    """Under a bound of 0 every token must come from its first token's version: spans `[(3, 0), (4, 2)]` are tokens
    a worker generated on after the load of version 4 made the request too stale (`stale_generated`), whether it came
    back whole or cut later. A span that holds no token (a sync at its very end), and a version below the first (a
    load never committed giving way to the committed one), are not. An unbounded request may span versions."""
    ledger = Ledger(T0)
    spans = {
        "across": ([(3, 0), (4, 2)], {}),
        "cut-across": ([(3, 0), (4, 2)], {"finish_reason": "abort", "abort_cause": "staleness"}),
        "empty-last-span": ([(3, 0), (4, 4)], {}),
        "back-down": ([(4, 0), (3, 2)], {}),
        "within-bound": ([(3, 0), (4, 2)], {}),
        "unbounded-across": ([(3, 0), (4, 2)], {}),
    }
    bounds = {"within-bound": 1, "unbounded-across": None}
    for request_id, (weight_versions, fields) in spans.items():
        submit(ledger, request_id, max_staleness=bounds.get(request_id, 0))
        tokens = PROMPT[:3] if fields else PROMPT[:4]
        answer(ledger, echo(request_id, completion_token_ids=tokens, weight_versions=weight_versions, **fields))
    verdict = check(ledger)
    assert [(v["check"], v["request_id"]) for v in verdict.violations] == [
        ("stale_generated", "across"),
        ("stale_generated", "cut-across"),
    ]
    assert "spans [(3, 0), (4, 2)] of 4 tokens, the first under version 3" in verdict.violations[0]["what"]
    assert verdict.bounds["bounded_requests"] == 5 and verdict.bounds["cut_for_staleness"] == 1
    assert check(Ledger(T0)).bounds == {}  # no bounded request: no figures (the soak without syncs)


def test_a_version_committed_by_a_trainer_killed_before_it_said_so_is_known_from_the_next_sync():
    """The trainer prints a line per sync; one SIGKILLed between its commit and its line leaves the ledger knowing
    only what the next sync read from Redis as committed (`base`). Tokens under it are fine; under a version never
    committed (nor read as committed) they are a violation (a 10-minute soak flagged 2,317 tokens of such a version)."""
    import io

    from rollout_svc.tools.chaos.fleet import Journal
    from rollout_svc.tools.chaos.syncs import Syncer

    out = io.StringIO()
    syncer = Syncer(None, Journal(out))  # type: ignore[arg-type]  # the fleet is only for starting a trainer
    syncer._record(
        {
            "version": 1,
            "base": 0,
            "mode": "keep",
            "transfer": "outside",
            "outcome": "committed",
            "paused_s": 0.1,
            "s": 0.5,
        }
    )
    # version 2 committed, its trainer killed; the next trainer read 2 as committed and failed to sync 3
    syncer._record(
        {
            "version": 3,
            "base": 2,
            "mode": "keep",
            "transfer": "outside",
            "outcome": "failed",
            "error": "ConnectionError: Redis restarting",
            "s": 1.0,
        }
    )
    assert syncer.committed == {0, 1, 2} and "version 2 found committed" in out.getvalue()
    ledger = Ledger(T0)
    for request_id, spans in (("r-ok", [(1, 0), (2, 2)]), ("r-bad", [(2, 0), (5, 1)])):
        submit(ledger, request_id)
        answer(ledger, echo(request_id, weight_versions=spans))
    syncer.check_versions(ledger)
    assert [v["what"] for v in syncer.violations] == ["r-bad: tokens from 1 under version 5, never committed"]


def test_a_late_worker_is_excused_by_a_stopped_peer_it_tried_to_catch_up_from_only(tmp_path):
    """Each peer that dies under a late worker's catch-up may cost it a heartbeat TTL (it waits that long for an
    answer, then asks another): a kill or stall of such a peer, from a TTL before it went live, excuses it; a kill
    of a worker it never asked does not (a 10-minute soak's late worker took 8.9 s, its first two peers killed)."""
    import time
    from types import SimpleNamespace

    from rollout_svc.config import Settings
    from rollout_svc.tools.chaos.fleet import Slot
    from rollout_svc.tools.chaos.sync_faults import SyncFaults

    settings = Settings(heartbeat_ttl_s=4.0)
    fleet = SimpleNamespace(log_dir=tmp_path, settings=settings, redis_url="redis://127.0.0.1:1/0")
    ledger = Ledger(T0)
    faults = SyncFaults(fleet, ledger, lambda *_: None, SimpleNamespace(counts={}))  # type: ignore[arg-type]
    (tmp_path / "late-38.log").write_text(
        "2026-11-28 13:10:11,905 WARNING rollout_svc.worker: catching up to weight version 44 from w1-r20 failed: it"
        " did not answer; asking another peer\n"
        "2026-11-28 13:10:16,015 WARNING rollout_svc.worker: catching up to weight version 44 from w2-r14~1 failed: it"
        " did not answer; asking another peer\n"
    )
    slot, live = Slot("late-38", "late-38"), time.time() - 20  # it went live 20 s ago
    ledger.fault("kill", "w0-r20", live + 1)  # never asked
    assert faults._peers_stopped(slot, live) == []
    ledger.fault("kill", "w1-r20", live - 3)  # killed just before it went live: still looked live when picked
    ledger.fault("stall", "w2-r14", live + 2)
    ledger.fault("kill", "w2-r14", live - 10)  # long before: not what held it back
    assert faults._peers_stopped(slot, live) == ["kill of its peer w1-r20", "stall of its peer w2-r14"]
    assert faults._peers_stopped(Slot("late-39", "late-39"), live) == [], "no log: nothing excused"


def test_an_http_holders_pause_runs_alone_with_redis_up_and_only_where_serve_runs():
    """`http_pause_kill` is drawn neither while the nemesis pauses through its control plane (its pause would hold
    the fleet past the lapse) nor while Redis restarts (the chats would be refused), and blocks both while it runs."""
    from types import SimpleNamespace

    from rollout_svc.tools.chaos.fleet import ChaosConfig
    from rollout_svc.tools.chaos.soak import Nemesis

    http = SimpleNamespace(busy=False)
    parts = (SimpleNamespace(slots=[]), None, SimpleNamespace(current={}), Ledger(T0), lambda *_: None, ChaosConfig())
    nemesis = Nemesis(*parts, None, http)  # type: ignore[arg-type]
    kinds = ("http_pause_kill", "pause", "redis_restart")
    assert "http_pause_kill" in nemesis.kinds and all(nemesis._possible(kind) for kind in kinds)
    http.busy = True
    assert not any(nemesis._possible(kind) for kind in kinds)
    http.busy = False
    for flag in ("_pausing", "_redis_busy"):
        setattr(nemesis, flag, True)
        assert not nemesis._possible("http_pause_kill"), flag
        setattr(nemesis, flag, False)
    assert "http_pause_kill" not in Nemesis(*parts).kinds  # type: ignore[arg-type]


def test_a_step_restart_runs_with_redis_up_and_keeps_redis_up_while_it_runs():
    """`step_restart` is not drawn while Redis restarts (a SIGKILL restart may lose the last second of the step's
    record), blocks Redis restarts while it runs, lets pauses go on, and is absent where it is left out."""
    from types import SimpleNamespace

    from rollout_svc.tools.chaos.fleet import ChaosConfig
    from rollout_svc.tools.chaos.soak import Nemesis

    steps = SimpleNamespace(busy=False)
    parts = (SimpleNamespace(slots=[]), None, SimpleNamespace(current={}), Ledger(T0), lambda *_: None, ChaosConfig())
    nemesis = Nemesis(*parts, None, None, steps)  # type: ignore[arg-type]
    assert "step_restart" in nemesis.kinds and "http_pause_kill" not in nemesis.kinds
    assert nemesis._possible("step_restart") and nemesis._possible("redis_restart")
    steps.busy = True
    assert not nemesis._possible("step_restart") and not nemesis._possible("redis_restart")
    assert nemesis._possible("pause")
    steps.busy = False
    nemesis._redis_busy = True
    assert not nemesis._possible("step_restart")
    assert "step_restart" not in Nemesis(*parts).kinds  # type: ignore[arg-type]


def test_a_restarted_step_is_checked_whole_in_order_and_echoed():
    """What a new process collected of a dead trainer's step: the step's every request once, in order, each the echo
    of its prompt; anything else is a `step_restart` violation."""
    from types import SimpleNamespace

    from rollout_svc.tools.chaos.step_restarts import STEP_REQUESTS, StepRestarts, plan

    planned = plan("chaos-step-1")
    assert planned == plan("chaos-step-1") and len(planned) == STEP_REQUESTS  # the trainer's and the check's
    assert [p.request_id for p in planned][:2] == ["chaos-step-1-r0", "chaos-step-1-r1"]
    assert all(32 <= token <= 126 for p in planned for token in p.prompt)
    assert planned[0].max_tokens > 20 > planned[1].max_tokens  # long, then short: the short ones answer first

    def collected(*changes: tuple[int, dict[str, Any]]) -> tuple[list[str], Any]:
        restarts = StepRestarts(SimpleNamespace(), Ledger(T0), lambda *_: None)  # type: ignore[arg-type]
        trajectories = [
            Trajectory(
                request_id=p.request_id,
                prompt_token_ids=p.prompt,
                completion_token_ids=p.prompt[: p.max_tokens],
                finish_reason="length" if len(p.prompt) > p.max_tokens else "stop",
            )
            for p in planned
        ]
        for index, fields in changes:
            trajectories[index] = trajectories[index].model_copy(update=fields)
        restarts._check("chaos-step-1", trajectories, T0, T0 + 1)
        return [v["what"] for v in restarts.violations], restarts.counts

    violations, counts = collected()
    assert violations == [] and counts["trajectories_collected"] == STEP_REQUESTS
    assert collected((3, {"completion_token_ids": [33]}))[0][0].startswith("chaos-step-1-r3: wrong_answer")
    assert "wrong_answer" in collected((5, {"finish_reason": "error", "error": "boom"}))[0][0]
    assert "in order" in collected((0, {"request_id": "chaos-step-1-r1"}))[0][0]
