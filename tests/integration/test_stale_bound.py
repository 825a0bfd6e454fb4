"""The staleness bound travels with the request (`RolloutRequest.max_staleness`, `min_weight_version`): workers check
it when they take a request and at every weight sync, so no token is generated that the bound would throw away.

Echo workers, a real Redis, real checkpoint syncs (the echo engine reads the checkpoint whole); what is checked is
which weight version each token comes from, and the tokens discarded, counted by the workers and the client alike.
"""

from __future__ import annotations

import asyncio

import pytest

from rollout_svc import RolloutClient
from rollout_svc.client.steps import StepReport
from rollout_svc.client.weight_sender import WeightSender
from rollout_svc.config import Settings
from rollout_svc.protocol import Trajectory
from tests.integration.test_metrics import fleet_counter
from tests.integration.test_weight_sync import saved_checkpoint
from tests.support import SYNC_HEARTBEAT_TTL_S, WorkerProcs, free_port

PROMPT = list(range(1, 41))  # the echo engine answers with the prompt: 40 tokens at most
STEP = 200


@pytest.fixture
def bound_settings(settings: Settings, tmp_path) -> Settings:
    root = tmp_path / "checkpoints"
    root.mkdir()
    return settings.copy_with(
        checkpoint_root=root, weight_sync_timeout_s=30.0, control_timeout_s=30.0, heartbeat_ttl_s=SYNC_HEARTBEAT_TTL_S
    )


@pytest.fixture
def fleet(bound_settings: Settings, tmp_path):
    """Two echo workers, 16 requests at a time each, 10 ms a token, their metrics served: the ports."""
    procs, ports = WorkerProcs(bound_settings, tmp_path), [free_port(), free_port()]
    for i, port in enumerate(ports):
        args = ("--echo-token-delay-s", "0.01", "--max-num-seqs", "16", "--metrics-port", str(port))
        procs.start(f"w{i}", "--engine", "echo", *args)
    procs.wait_live("w0", "w1")
    yield ports
    procs.stop_all()


def discarded(ports: list[int]) -> float:
    """Tokens the workers generated and then dropped as too stale for their requests' bounds."""
    return fleet_counter(ports, "rollout_worker_stale_discarded_tokens_total")


async def step_across_a_commit(settings: Settings, mode: str) -> tuple[list[Trajectory], StepReport, int]:
    """A step of 200 requests with `max_staleness=0`; once a few have answered, a checkpoint sync (pause `mode`)
    commits the next version. Returns the trajectories, the step's report and the version committed."""
    checkpoint = saved_checkpoint(settings, f"step-{mode}", seed=1)
    async with WeightSender(settings=settings) as sender, RolloutClient(settings, max_staleness=0) as client:
        version = await sender.committed_version() + 1
        step = asyncio.create_task(client.generate([PROMPT] * STEP, {"max_tokens": 30}))
        await asyncio.sleep(0.75)  # 2 of ~7 waves of 0.3 s answered, the third half made, the rest queued
        assert not step.done()
        await sender.update_from_checkpoint(str(checkpoint), version, pause_mode=mode)  # type: ignore[arg-type]
        trajectories = await step
        report = await client.step_report()
        assert (report.stale_tokens, report.regenerated) == (client.stats.stale_tokens, client.stats.regenerated)
    return trajectories, report, version


def check_no_stale_token(trajectories: list[Trajectory], version: int) -> None:
    """Every trajectory from one version (none continued under the new weights from an old first token), at
    staleness 0 when it arrived, whole; some of each version: the commit fell inside the step."""
    assert len(trajectories) == STEP
    assert all(len(t.completion_token_ids) == 30 and t.finish_reason == "length" for t in trajectories)
    spans = [t.weight_versions for t in trajectories]
    mixed = [(t.request_id, t.worker_id, t.weight_versions) for t in trajectories if len(t.weight_versions) != 1]
    assert not mixed, (len(mixed), mixed[:20])
    assert all(t.staleness == 0 for t in trajectories)
    versions = {s[0][0] for s in spans}
    assert versions == {version - 1, version}, versions


@pytest.mark.timeout(120)
async def test_a_step_with_max_staleness_0_across_a_commit_generates_nothing_stale(bound_settings, fleet):
    trajectories, report, version = await step_across_a_commit(bound_settings, "wait")
    check_no_stale_token(trajectories, version)
    # What was in flight finished before the load; what was queued was taken after it, under the new weights: no
    # worker generated a token it then dropped. (Trajectories finished before the commit but received after it are
    # staler than 0 by the client's measure and generated again, whole: 30 tokens each, none cut.)
    assert discarded(fleet) == 0
    assert report.stale_tokens == 30 * report.regenerated


@pytest.mark.timeout(120)
async def test_a_keep_sync_cuts_requests_it_makes_too_stale_before_they_generate_on(bound_settings, fleet):
    trajectories, report, version = await step_across_a_commit(bound_settings, "keep")
    check_no_stale_token(trajectories, version)
    # Frozen mid-generation across the load, each was cut there (not generated to its end under the new weights and
    # thrown away at receipt, as before): what it had made is all that was discarded, counted on both sides. The
    # client also dropped those that finished before the commit and arrived after it, whole (30 tokens each).
    cut_tokens = discarded(fleet)
    assert 0 < cut_tokens < 30 * 2 * 16
    assert report.stale_tokens >= cut_tokens and (report.stale_tokens - cut_tokens) % 30 == 0


@pytest.mark.timeout(60)
async def test_a_continuation_staler_than_its_bound_is_answered_at_once_not_generated(bound_settings, fleet):
    checkpoint = saved_checkpoint(bound_settings, "next", seed=2)
    async with WeightSender(settings=bound_settings) as sender:
        version = await sender.committed_version() + 1
        report = await sender.update_from_checkpoint(str(checkpoint), version)
        assert report.loaded == ["w0", "w1"], report
    # A partial rollout cut under the version before: carried over by a trainer, then continued.
    old = version - 1
    partial = Trajectory(
        request_id="p",
        prompt_token_ids=PROMPT,
        completion_token_ids=PROMPT[:5],
        logprobs=[0.0] * 5,
        finish_reason="abort",
        abort_cause="partial",
        weight_versions=[(old, 0)],
        weight_version=old,
    )
    async with RolloutClient(bound_settings, max_staleness=0, stale_policy="mark") as client:
        [marked] = await client.generate([partial], {"max_tokens": 20})
    assert marked.abort_cause == "staleness" and marked.completion_token_ids == PROMPT[:5]
    assert marked.staleness == 1 and marked.generation_time_s == 0
    async with RolloutClient(bound_settings, max_staleness=0) as client:
        [fresh] = await client.generate([partial], {"max_tokens": 20})
        assert client.stats.stale_tokens == 5 and client.stats.regenerated == 1
    # generated again from its prompt, under the new weights
    assert fresh.weight_versions == [(version, 0)] and fresh.completion_token_ids == PROMPT[:20]
    # within the bound, the continuation goes on
    async with RolloutClient(bound_settings, max_staleness=1) as client:
        [continued] = await client.generate([partial], {"max_tokens": 20})
    assert continued.weight_versions == [(old, 0), (version, 5)] and continued.staleness == 1
    assert discarded(fleet) == 10  # the two continuations dropped when taken


@pytest.mark.timeout(60)
async def test_a_request_for_weights_newer_than_the_fleets_is_answered_at_once(bound_settings, fleet):
    async with RolloutClient(bound_settings, stale_policy="mark") as client:
        [request] = await client.rollout_requests([PROMPT], {"max_tokens": 10})
        ahead = request.model_copy(update={"min_weight_version": 99})
        [answer] = await client.run([ahead])
    assert answer.finish_reason == "abort" and answer.abort_cause == "staleness"
    assert answer.completion_token_ids == [] and answer.generation_time_s == 0
