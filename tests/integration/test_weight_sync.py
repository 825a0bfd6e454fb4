"""Weight sync on echo workers: real gloo transfers, real Redis barriers, real processes; the model is not the point.

Echo workers receive every bucket over the transfer group and keep a digest of what they got; they load a
checkpoint by reading it whole. What these tests check is the protocol: versions committed and carried on every
token, keep-pauses split at the right token, dead and stale workers, catch-up, staleness on the client.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import save_file

from rollout_svc import InvalidRequestError, RolloutClient, WeightSyncError
from rollout_svc.client.status import fleet_status
from rollout_svc.client.weight_sender import WeightSender
from rollout_svc.config import Settings
from rollout_svc.protocol import WeightSyncOrder
from tests.integration.test_metrics import api
from tests.support import ROOT, SYNC_ECHO_ARGS, SYNC_HEARTBEAT_TTL_S, Streaming, WorkerProcs, async_wait_until

PROMPT = list(range(1, 41))  # the echo engine answers with the prompt: 40 tokens at most


def tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=generator),
        "model.norm.weight": torch.randn(64, generator=generator).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(128, 64, generator=generator),
    }


def saved_checkpoint(settings: Settings, name: str, seed: int) -> Path:
    """A checkpoint folder `name` under the settings' checkpoint root, holding `tensors(seed)` as model.safetensors."""
    checkpoint = settings.weight_sync.checkpoint_root / name
    checkpoint.mkdir()
    save_file(tensors(seed), str(checkpoint / "model.safetensors"))
    return checkpoint


@pytest.fixture
def ws_settings(settings: Settings, tmp_path: Path) -> Settings:
    root = tmp_path / "checkpoints"
    root.mkdir()
    return settings.copy_with(
        checkpoint_root=root, weight_sync_timeout_s=15.0, control_timeout_s=15.0, heartbeat_ttl_s=SYNC_HEARTBEAT_TTL_S
    )


@pytest.fixture
def procs(ws_settings: Settings, tmp_path: Path):
    workers = WorkerProcs(ws_settings, tmp_path)
    yield workers
    workers.stop_all()


def start(procs: WorkerProcs, *ids: str, args: tuple[str, ...] = ()) -> None:
    for worker_id in ids:
        procs.start(worker_id, "--engine", "echo", *SYNC_ECHO_ARGS, *args)
    procs.wait_live(*ids)


async def statuses(client: RolloutClient) -> dict[str, object]:
    return {w.worker_id: w for w in await client.workers()}


@pytest.mark.timeout(60)
async def test_broadcast_commits_a_version_that_every_token_carries(ws_settings, procs, rds):
    start(procs, "w0", "w1")
    async with WeightSender(settings=ws_settings) as sender, RolloutClient(ws_settings) as client:
        before = await client.generate([PROMPT] * 4, {"max_tokens": 8})
        assert {t.weight_version for t in before} == {0} and all(t.weight_versions == [(0, 0)] for t in before)
        first = await sender.update(tensors(1).items(), version=1)
        assert first.loaded == ["w0", "w1"] and not first.stale and not first.dead and first.group_rebuilt
        assert first.bytes >= sum(t.numel() * t.element_size() for t in tensors(1).values()) and first.transfer_s > 0
        second = await sender.update(tensors(2).items(), version=2)
        assert not second.group_rebuilt, "the same members: the group is reused"
        assert await sender.committed_version() == 2
        assert {w.weight_version for w in await client.workers()} == {2}
        after = await client.generate([PROMPT] * 8, {"max_tokens": 8}, session_ids=[f"s{i}" for i in range(8)])
        assert {t.worker_id for t in after} == {"w0", "w1"}
        assert all(t.weight_version == 2 and t.weight_versions == [(2, 0)] and t.staleness == 0 for t in after)
        with pytest.raises(InvalidRequestError, match="not above the committed version 2"):
            await sender.update(tensors(3).items(), version=2)
        assert client.stats.staleness[0] == 12


@pytest.mark.timeout(60)
async def test_keep_pause_across_a_sync_splits_the_versions_at_the_frozen_token(ws_settings, procs):
    # A chunk per token, sent as it is made: the client sees how far the generation got.
    # torch preloaded: a cold `import torch` at its first join took past the join timeout on a loaded CI machine
    chunk_per_token = {"ROLLOUT_STREAM_CHUNK_TOKENS": "1"}
    procs.start("w0", "--engine", "echo", "--echo-token-delay-s", "0.05", *SYNC_ECHO_ARGS, env=chunk_per_token)
    procs.wait_live("w0")
    async with WeightSender(settings=ws_settings) as sender, RolloutClient(ws_settings) as client:
        run = Streaming(client, [PROMPT], {"max_tokens": 40})
        await run.streamed(5, 10)  # generating, 5 tokens in
        await client.pause("keep", holder="test")  # frozen: no token is generated until "test" resumes
        [at_pause] = run.tokens
        frozen = (await client.workers())[0]
        assert frozen.state == "paused" and frozen.in_flight == 1
        await asyncio.sleep(0.3)  # time passes while frozen: a request that was not would make 6 tokens meanwhile
        await sender.update(tensors(1).items(), version=1, pause_mode="keep")
        [before_resume] = run.tokens
        await client.resume(holder="test")
        [trajectory] = await run.task
        assert len(trajectory.completion_token_ids) == 40 and trajectory.finish_reason == "stop"
        [(old, zero), (new, cut)] = trajectory.weight_versions
        assert (old, zero, new) == (0, 0, 1) and 0 < cut < 40, trajectory.weight_versions
        assert trajectory.weight_version == 1 and trajectory.staleness == 1
        # The cut is the token the pause froze it at: what was streamed by then (the step under way when the pause
        # landed completes, and its chunk may still be on its way), and every token made before the resume.
        assert 5 <= at_pause <= cut <= at_pause + 2 and cut == before_resume, (at_pause, cut, before_resume)


@pytest.mark.timeout(60)
async def test_max_staleness_drops_and_regenerates_or_marks(ws_settings, procs):
    start(procs, "w0", args=("--echo-token-delay-s", "0.02"))
    async with WeightSender(settings=ws_settings) as sender:
        for policy, expect_regenerated in (("regenerate", 1), ("mark", 0)):
            version = await sender.committed_version() + 1
            async with RolloutClient(ws_settings, max_staleness=0, stale_policy=policy) as client:
                run = Streaming(client, [PROMPT], {"max_tokens": 30})
                await run.streamed(2, 10)  # a few tokens in: its first token is the old version's
                # Frozen across the sync, so it is still in flight when the new version commits: the transfer runs
                # outside the sync's own pause, and on a loaded machine a 0.6 s generation ended before the commit.
                await client.pause("keep", holder="test")
                await sender.update(tensors(version).items(), version=version, pause_mode="keep")
                await client.resume(holder="test")
                [trajectory] = await run.task
                assert client.stats.regenerated == expect_regenerated
                # The bound travels with the request: the worker cut it at the sync, before a token under the new
                # weights, rather than generating it to the end to be thrown away.
                if policy == "regenerate":  # generated again, from its first token on the new version
                    assert trajectory.weight_versions == [(version, 0)] and trajectory.staleness == 0
                    assert len(trajectory.completion_token_ids) == 30
                    assert 2 <= client.stats.stale_tokens < 30
                else:  # returned at the cut, marked by its staleness
                    assert trajectory.weight_versions == [(version - 1, 0)] and trajectory.staleness == 1
                    assert trajectory.finish_reason == "abort" and trajectory.abort_cause == "staleness"
                    assert 2 <= len(trajectory.completion_token_ids) < 30


@pytest.mark.timeout(90)
async def test_a_worker_killed_during_a_sync_is_left_out_and_named(ws_settings, procs, rds: redis.Redis):
    start(procs, "w0", "w1", args=("--echo-load-delay-s", "3"))
    async with WeightSender(settings=ws_settings) as sender, RolloutClient(ws_settings) as client:
        syncing = asyncio.ensure_future(sender.update(tensors(1).items(), version=1))

        def both_joined() -> bool:
            return any(len(rds.hkeys(k)) == 2 for k in rds.keys(ws_settings.keys.weight_barrier("*", "joined")))

        await async_wait_until(both_joined, 20, "both workers joined the transfer group")
        procs.kill("w1")  # while it loads
        report = await syncing
        assert report.loaded == ["w0"] and report.dead == ["w1"] and not report.stale
        assert await sender.committed_version() == 1
        # A worker started afterwards: version 0 where 1 is committed by broadcast, so it is stale, takes no work,
        # and catches up from w0 (workers/catch_up.py). When it does depends on the host's load (a CI run once saw it
        # serving before this generate ended), so what is asserted is what holds either way: no token of version 0.
        start(procs, "w2")
        await async_wait_until(
            lambda: rds.hget(ws_settings.keys.worker("w2"), "state") == b"stale", 10, "w2 labelled stale"
        )
        served = await client.generate([PROMPT] * 6, {"max_tokens": 4}, session_ids=[f"k{i}" for i in range(6)])
        assert {t.weight_version for t in served} == {1} and all(t.weight_versions == [(1, 0)] for t in served)
        await wait_serving(
            rds, ws_settings, "w2", 20, "w2 caught up to version 1 from w0", version=1, digest=report.digest
        )
        assert "caught up to weight version 1 from w0" in procs.log("w2")
        status = await fleet_status(ws_settings)  # what `rollout-svc status --json` prints
        assert status["weight_version"] == 1 and status["weight_checkpoint"] is None
        assert {w["worker_id"]: w["state"] for w in status["workers"]} == {"w0": "serving", "w2": "serving"}


def slow_link(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """This process's `WeightSender` on a slow link: each bucket's broadcast starts `delay_s` after the last."""
    send = WeightSender._send

    def slow_send(group, buckets, sizes, tensors, buffers):  # type: ignore[no-untyped-def]
        broadcast = group.process_group.broadcast

        class Slow:
            def broadcast(self, buffer, root):  # type: ignore[no-untyped-def]
                time.sleep(delay_s)
                return broadcast(buffer, root)

        return send(type(group)(group.spec, group.members, Slow()), buckets, sizes, tensors, buffers)

    monkeypatch.setattr(WeightSender, "_send", staticmethod(slow_send))


@pytest.mark.timeout(120)
async def test_a_transfer_outside_the_pause_keeps_200_requests_generating_until_the_load(
    ws_settings, procs, monkeypatch
):
    """200 requests stream while a sync's buckets travel for about 1.5 s: they keep making tokens through the
    transfer, and the fleet is paused only for the load (here 0.3 s of load per worker), after it. The old behaviour
    (`pause_during_transfer=True`) pauses them for the whole transfer. How long a request felt the pause is a figure
    of BENCHMARKS.md (e), not a test's: a loaded CI host stalled one for 1.1 s beyond the pause (the test process or a
    worker off its core), longer than the whole transfer."""
    args = ("--echo-token-delay-s", "0.05", "--echo-load-delay-s", "0.3", "--max-num-seqs", "128")
    for worker_id in ("w0", "w1"):  # a chunk every 0.2 s a request: 1,000 a second in all, light on a loaded CI host
        procs.start(worker_id, "--engine", "echo", *SYNC_ECHO_ARGS, *args, env={"ROLLOUT_STREAM_INTERVAL_S": "0.2"})
    procs.wait_live("w0", "w1")
    slow_link(monkeypatch, 0.3)
    tokens = 200  # the echo engine echoes the prompt: 10 s each, in flight through the baseline, transfer and load
    prompts = [[(i + j) % 200 + 1 for j in range(tokens)] for i in range(200)]
    weights = {f"layer.{i}.weight": torch.full((64, 64), float(i)) for i in range(5)}
    settings = ws_settings.copy_with(weight_sync_timeout_s=60.0)
    sender, client = WeightSender(settings=settings, bucket_bytes=64 * 64 * 4), RolloutClient(settings)
    async with sender, client:
        run = Streaming(client, prompts, {"max_tokens": tokens})
        await run.streamed(5, timeout_s=30)
        samples: list[tuple[float, list[int]]] = []

        async def sample() -> None:
            while True:
                samples.append((time.monotonic(), list(run.tokens)))
                await asyncio.sleep(0.05)

        def advanced(start: float, end: float) -> float:
            """The fraction of the requests unfinished at `end` that got a new token in [start, end]."""
            window = [made for t, made in samples if start <= t <= end]
            open_ = [i for i in range(len(prompts)) if window[-1][i] < tokens]
            assert open_, "every request had finished by the window's end"
            return sum(window[-1][i] > window[0][i] for i in open_) / len(open_)

        sampler = asyncio.ensure_future(sample())
        await asyncio.sleep(1.0)
        started = time.monotonic()
        report = await sender.update(weights.items(), version=1)
        await asyncio.sleep(0.5)
        sampler.cancel()
        trajectories = await run.task
        assert report.loaded == ["w0", "w1"] and not report.paused_during_transfer and report.buckets == 5
        assert report.transfer_s >= 1.2, report
        # The fleet pauses only after the group's set-up and the transfer, so it generates for at least `transfer_s`
        # from the sync's start, and a token made then reaches the stream within its 0.2 s chunk. Paused through the
        # transfer, it would make none from 0.3 s into the sync on.
        during = advanced(started + 0.3, started + report.transfer_s)
        assert during > 0.5, (during, report)
        switched = [t for t in trajectories if len(t.weight_versions) == 2]
        assert switched and all(t.weight_versions[0] == (0, 0) and t.weight_versions[1][0] == 1 for t in switched)
        assert all(len(t.completion_token_ids) == tokens for t in trajectories)
        old = await sender.update(weights.items(), version=2, pause_during_transfer=True)
        assert old.paused_during_transfer and old.paused_s > old.transfer_s >= 1.2, old
        # Paused for the load alone, against the whole transfer as well: compared within one run (a loaded CI host
        # once took 2.5 s to pause, load and resume, past that sync's 1.8 s transfer).
        assert report.paused_s < old.paused_s, (report, old)


# A trainer on a slow link: each bucket's broadcast starts 0.5 s after the last; it says when the first went out.
SLOW_TRAINER = """
import asyncio, sys, time
import torch
from rollout_svc.client.weight_sender import WeightSender

send = WeightSender._send

def slow_send(group, buckets, sizes, tensors, buffers):
    broadcast = group.process_group.broadcast
    sent = []

    class Slow:
        def broadcast(self, buffer, root):
            time.sleep(0.5)
            work = broadcast(buffer, root)
            sent.append(1)
            if len(sent) == 1:
                print("first bucket sent", flush=True)
            return work

    return send(type(group)(group.spec, group.members, Slow()), buckets, sizes, tensors, buffers)

WeightSender._send = staticmethod(slow_send)

async def main():
    async with WeightSender(bucket_bytes=64 * 1024) as sender:
        weights = {f"layer.{i}.weight": torch.full((128, 128), float(i)) for i in range(40)}
        await sender.update(weights.items(), version=2, pause_during_transfer=sys.argv[1] == "inside")

asyncio.run(main())
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transfer", ["inside", "outside"])
async def test_a_trainer_killed_mid_transfer_loses_its_pause_and_the_old_version_stays(
    ws_settings, procs, rds, transfer
):
    """The trainer dies (-9) with some of its buckets sent. Transfer inside the pause: the fleet is paused under its
    sync, nobody resumes, yet it serves again within the pause's lease plus a heartbeat, and the state says whose pause
    lapsed. Outside (the default): the fleet was never paused, and serves on. Either way on the version committed
    before: nothing of the cut transfer is loaded."""
    start(procs, "w0", "w1")
    lease_s = 2.0
    async with WeightSender(settings=ws_settings) as sender:
        await sender.update(tensors(1).items(), version=1)
    async with RolloutClient(ws_settings) as client:
        env = {
            **os.environ,
            "ROLLOUT_REDIS_URL": ws_settings.redis_url,
            "ROLLOUT_KEY_PREFIX": ws_settings.key_prefix,
            "ROLLOUT_PAUSE_LEASE_S": str(lease_s),
            "ROLLOUT_WEIGHT_SYNC_TIMEOUT_S": "15",
            "ROLLOUT_HEARTBEAT_TTL_S": str(SYNC_HEARTBEAT_TTL_S),
        }
        trainer = subprocess.Popen(
            [sys.executable, "-c", SLOW_TRAINER, transfer], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert trainer.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(trainer.stdout.readline), 40)
            assert line.strip() == "first bucket sent", line
            state = await client.fleet_state()
            paused = {"weight-sync": "keep"} if transfer == "inside" else {}
            assert state.holders == paused, state
            assert {w.state for w in await client.workers()} == {"paused" if paused else "serving"}
        finally:
            trainer.kill()
            trainer.wait()
            if trainer.stdout is not None:
                trainer.stdout.close()
        killed = time.monotonic()
        served = await client.generate([PROMPT] * 4, {"max_tokens": 4}, session_ids=[f"k{i}" for i in range(4)])
        waited = time.monotonic() - killed
        assert waited < lease_s + ws_settings.worker.heartbeat_interval_s + 1.5, waited
        assert {t.weight_version for t in served} == {1} and {t.finish_reason for t in served} == {"length"}
        state = await client.fleet_state()
        assert not state.paused and set(state.lapsed) == set(paused) and state.weight_version == 1
        assert {w.weight_version for w in await client.workers()} == {1}
    # What they hold as received (version 1) survived the cut receive: a worker started now catches up from them.
    start(procs, "late")
    await wait_serving(rds, ws_settings, "late", 15, "the late worker caught up to version 1 from a peer", version=1)


@pytest.mark.timeout(120)
async def test_a_worker_killed_before_joining_costs_the_sync_no_more_than_its_heartbeat_ttl(ws_settings, procs):
    """A member that dies after the sender counted it live and before it joined: every join waits for it only as long
    as the heartbeat TTL (the rendezvous' own timeout), then the group is built again without it and the sync
    commits; the 120 s collective timeout is not what anyone waits out."""
    settings = ws_settings.copy_with(weight_sync_timeout_s=120.0)
    start(procs, "w0", "w1", "w2")
    async with WeightSender(settings=settings) as sender, RolloutClient(settings) as client:
        procs.kill("w2")  # its heartbeat still fresh: it counts as live, and is named in the order
        started = time.monotonic()
        report = await sender.update(tensors(1).items(), version=1)
        took = time.monotonic() - started
        assert report.loaded == ["w0", "w1"] and report.dead == ["w2"] and not report.stale, report
        assert report.attempts == 2 and took < settings.heartbeat_ttl_s + 5.0, (took, report)
        assert await sender.committed_version() == 1
        served = await client.generate([PROMPT] * 4, {"max_tokens": 4}, session_ids=[f"k{i}" for i in range(4)])
        assert {t.weight_version for t in served} == {1}


async def test_a_sync_whose_only_worker_died_before_joining_fails_naming_it_dead(ws_settings, procs):
    """The one member dies after the sender counted it live: the next attempt finds no live worker, and the error
    says which worker died (it once named nobody), within the heartbeat TTL; the old version stays committed."""
    settings = ws_settings.copy_with(weight_sync_timeout_s=120.0)
    start(procs, "w0")
    async with WeightSender(settings=settings) as sender:
        procs.kill("w0")  # its heartbeat still fresh: it counts as live, and is named in the order
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"no live worker to send to \(w0: dead\)") as info:
            await sender.update(tensors(1).items(), version=1)
        assert info.value.failures == {"w0": "dead"}
        assert time.monotonic() - started < settings.heartbeat_ttl_s + 5.0
        assert await sender.committed_version() == 0


@pytest.mark.timeout(120)
async def test_a_sync_abandoned_before_its_announcement_holds_no_worker_and_no_catch_up(ws_settings, procs, rds):
    """A trainer that published its order and built its group, then died before announcing the tensors: its
    workers wait for the announcement only until a newer order replaces it (not the worker's 120 s), and meanwhile
    they still send a late worker the committed version."""
    from rollout_svc.weightsync.transfer import join_group

    settings = ws_settings.copy_with(weight_sync_timeout_s=120.0)
    start(procs, "w0")
    async with WeightSender(settings=settings) as sender:
        await sender.update(tensors(1).items(), version=1)
        spec, store = await sender._open_group({"w0": 1}, "gloo")  # what a trainer does, up to the announcement
        group = asyncio.ensure_future(asyncio.to_thread(join_group, spec, 0, spec.master_addr, store))
        order = WeightSyncOrder(sync_id="v2-dead", version=2, transport="broadcast", members=["w0"], group=spec)
        await sender.plane.publish(order)
        await asyncio.wait_for(group, 30)  # w0 joined: it now waits for tensors that never come
        start(procs, "late")  # w0 still sends it version 1, following the abandoned sync meanwhile
        await wait_serving(
            rds, settings, "late", 15, "the late worker caught up while its peer waited on a dead sync", version=1
        )
        sender._group = None
        started = time.monotonic()
        report = await sender.update(tensors(2).items(), version=2)  # a new trainer's order replaces the dead one
        assert report.loaded == ["late", "w0"] and time.monotonic() - started < 10, report


def heartbeat(rds: redis.Redis, settings: Settings, worker_id: str, *fields: str) -> list[str | None]:
    values = rds.hmget(settings.keys.worker(worker_id), *fields)
    return [None if v is None else v.decode() for v in values]


async def wait_serving(
    rds: redis.Redis,
    settings: Settings,
    worker_id: str,
    timeout_s: float,
    what: str,
    *,
    version: int | None = None,
    digest: str | None = None,
) -> None:
    """Wait until `worker_id`'s heartbeat says it serves, weight `version` and `digest` where given; AssertionError
    naming `what` after `timeout_s`."""
    expected = {"state": "serving"}
    if version is not None:
        expected["weight_version"] = str(version)
    if digest is not None:
        expected["weight_digest"] = digest
    fields, values = list(expected), list(expected.values())
    await async_wait_until(lambda: heartbeat(rds, settings, worker_id, *fields) == values, timeout_s, what)


@pytest.mark.timeout(120)
async def test_a_late_worker_catches_up_from_its_peer_with_no_sender_running(ws_settings, procs, rds):
    start(procs, "w0")
    async with WeightSender(settings=ws_settings) as sender:
        for version in (1, 2, 3):
            report = await sender.update(tensors(version).items(), version=version)
    digest = rds.hget(ws_settings.keys.state, "weight_digest").decode()
    assert digest == report.digest and len(digest) == 32
    assert heartbeat(rds, ws_settings, "w0", "weight_digest") == [digest], "w0 received what the trainer sent"
    # The trainer is gone. A worker started now loads version 3 from w0, verified against the committed digest.
    start(procs, "late")
    live = time.monotonic()
    await wait_serving(rds, ws_settings, "late", 10, "the late worker serving version 3", version=3)
    assert time.monotonic() - live < 5 + 1, "within its load time + 5 s (the echo loads in milliseconds)"
    assert heartbeat(rds, ws_settings, "late", "weight_digest") == [digest]
    assert "caught up to weight version 3 from w0" in procs.log("late")
    # w0 logs its side once its engine's send returns, which may be after the late worker logged and beat
    await async_wait_until(lambda: "sent weight version 3 to late" in procs.log("w0"), 5, "w0 to log the send")
    assert not rds.hgetall(ws_settings.keys.weight_catch_ups), "the order is cleaned up"
    async with RolloutClient(ws_settings) as client:
        served = await client.generate([PROMPT] * 8, {"max_tokens": 4}, session_ids=[f"b{i}" for i in range(8)])
    assert {t.worker_id for t in served} == {"w0", "late"} and {t.weight_version for t in served} == {3}
    # It now holds version 3 as received, so it can send it on: w0 gone, another late worker catches up from it.
    procs.kill("w0")
    start(procs, "later")
    await wait_serving(rds, ws_settings, "later", 15, "the second late worker caught up from the first", digest=digest)
    assert "caught up to weight version 3 from late" in procs.log("later")


@pytest.mark.timeout(120)
async def test_a_sync_during_a_catch_up_wins_and_neither_waits_for_the_other(ws_settings, procs, rds):
    big = {"model.embed_tokens.weight": torch.randn(4096, 8192)}  # 128 MiB: a catch-up that takes a while
    start(procs, "w0")
    async with WeightSender(settings=ws_settings) as sender:
        await sender.update(big.items(), version=1)
        start(procs, "late")
        await async_wait_until(lambda: rds.hexists(ws_settings.keys.weight_catch_ups, "late"), 15, "a catch-up")
        started = time.monotonic()
        report = await sender.update(tensors(2).items(), version=2)  # while late catches up to version 1
        assert report.loaded == ["late", "w0"] and time.monotonic() - started < 15
    await wait_serving(
        rds, ws_settings, "late", 15, "the late worker serving version 2", version=2, digest=report.digest
    )
    ended = ("weight version 1 came from", "catching up to weight version 1 from", "caught up to weight version 1")
    await async_wait_until(
        lambda: any(line in procs.log("late") for line in ended), 15, "the catch-up of version 1 to end"
    )  # dropped, not loaded over version 2 (or failed): its 128 MiB may arrive after version 2 was committed
    assert heartbeat(rds, ws_settings, "late", "weight_version", "weight_digest") == ["2", report.digest]


@pytest.mark.timeout(120)
async def test_a_late_worker_named_in_a_sync_that_waits_still_catches_up_from_its_peer(ws_settings, procs, rds):
    """A late worker that a new sync names before it caught up (the chaos soak's case: no peer at its first look, then
    a sync whose group waited for a member killed before joining) goes on catching up from a peer while its join
    waits: the group here waits 30 s for a trainer that never joins. It once stayed stale for the whole wait."""
    start(procs, "w0")
    async with WeightSender(settings=ws_settings) as sender:
        report = await sender.update(tensors(1).items(), version=1)
        spec, _store = await sender._open_group({"late": 1}, "gloo")  # rank 0 (the trainer) never joins
        spec = spec.model_copy(update={"join_timeout_s": 30.0})
        order = WeightSyncOrder(sync_id="v2-waiting", version=2, transport="broadcast", members=["late"], group=spec)
        await sender.plane.publish(order)
        start(procs, "late")
        live = time.monotonic()
        await wait_serving(
            rds,
            ws_settings,
            "late",
            20,
            "the late worker serving version 1 while its sync's join waits",
            digest=report.digest,
        )
        took = time.monotonic() - live
        log = procs.log("late")
        assert "weight sync v2-waiting: version 2 by broadcast" in log, "it follows the sync meanwhile"
        assert "caught up to weight version 1 from w0" in log and "joining weight transfer group" not in log, log
        assert took < 15, f"{took:.1f} s: within its load time + 5 s, on a slow host with margin, not the 30 s wait"


@pytest.mark.timeout(120)
async def test_a_late_worker_with_no_peer_stays_stale_until_included_and_catches_up_from_a_checkpoint(
    ws_settings, procs, rds
):
    start(procs, "w0")
    async with WeightSender(settings=ws_settings) as sender, RolloutClient(ws_settings) as client:
        for version in (1, 2, 3):
            await sender.update(tensors(version).items(), version=version)
        procs.kill("w0")  # the only worker that holds version 3
        await async_wait_until(lambda: not rds.exists(ws_settings.keys.worker("w0")), 15, "w0's heartbeat expired")
        start(procs, "late")
        await async_wait_until(
            lambda: rds.hget(ws_settings.keys.worker("late"), "state") == b"stale", 10, "the late worker stale"
        )
        await async_wait_until(lambda: "no live peer holds it" in procs.log("late"), 10, "the log says why")
        start(procs, "w0b")
        report = await sender.update(tensors(4).items(), version=4)
        assert report.loaded == ["late", "w0b"] and report.group_rebuilt, "the next update includes it"
        workers = await statuses(client)
        assert {w.state for w in workers.values()} == {"serving"} and {w.weight_version for w in workers.values()} == {
            4
        }
        served = await client.generate([PROMPT] * 8, {"max_tokens": 4}, session_ids=[f"b{i}" for i in range(8)])
        assert {t.worker_id for t in served} == {"w0b", "late"} and {t.weight_version for t in served} == {4}

        checkpoint = saved_checkpoint(ws_settings, "step-5", 5)
        report = await sender.update_from_checkpoint(str(checkpoint), version=5)
        assert report.loaded == ["late", "w0b"] and report.transport == "checkpoint"
        start(procs, "fresh")  # loads the committed checkpoint on its own, then serves
        await async_wait_until(
            lambda: rds.hmget(ws_settings.keys.worker("fresh"), "state", "weight_version") == [b"serving", b"5"],
            15,
            "the fresh worker serving version 5",
        )


@pytest.mark.timeout(90)
async def test_a_checkpoint_loaded_but_never_committed_gives_way_to_the_broadcast_version_held_here(
    ws_settings, procs, rds
):
    """The trainer pauses the fleet (its leased pause), orders a checkpoint, the workers load it, and the trainer
    dies before committing: no peer holds the committed version any longer (every worker loaded the checkpoint over
    it), and no trainer is left. Once the dead trainer's pause lapses each worker loads again the committed
    version's bytes it still holds as received, and serves it (before: stale until a trainer came back)."""
    start(procs, "w0", "w1")
    lease_s = 2.0
    checkpoint = saved_checkpoint(ws_settings, "step-2", 2)
    async with WeightSender(settings=ws_settings) as sender, RolloutClient(ws_settings) as client:
        report = await sender.update(tensors(1).items(), version=1)
        # What the trainer's `update_from_checkpoint` does up to its commit, and then nothing: it died.
        await client.pause("keep", holder="weight-sync", lease_s=lease_s, renew=False)
        order = WeightSyncOrder(
            sync_id="dead", version=2, transport="checkpoint", members=["w0", "w1"], path=str(checkpoint)
        )
        await sender.plane.publish(order)
        loaded = await sender.plane.await_barrier("dead", "loaded", order.members, 15)
        assert sorted(loaded.ok) == ["w0", "w1"], "both loaded the checkpoint over version 1"
        died = time.monotonic()
        served = await client.generate([PROMPT] * 4, {"max_tokens": 4}, session_ids=[f"d{i}" for i in range(4)])
        assert time.monotonic() - died < lease_s + SYNC_HEARTBEAT_TTL_S, "served within the lease and a heartbeat"
        assert {t.weight_version for t in served} == {1}
        # Each serves version 1 again within the lease and a heartbeat (the first to do so answers all four: a
        # stale worker hands the turns pinned to it to one that serves).
        for worker_id in ("w0", "w1"):
            await wait_serving(
                rds,
                ws_settings,
                worker_id,
                max(1.0, died + lease_s + SYNC_HEARTBEAT_TTL_S - time.monotonic()),
                f"{worker_id} serving version 1",
                version=1,
                digest=report.digest,
            )
            assert "ended without committing it" in procs.log(worker_id)
            assert "loaded again from the copy this worker received" in procs.log(worker_id)
        assert await sender.committed_version() == 1
        # It still holds version 1 as received, so a late worker can catch up from it.
        start(procs, "late")
        await wait_serving(
            rds, ws_settings, "late", 15, "the late worker caught up to version 1 from a peer", digest=report.digest
        )


@pytest.mark.timeout(90)
async def test_a_broadcast_loaded_but_never_committed_gives_way_to_the_version_received_before_it(
    ws_settings, procs, rds, monkeypatch
):
    """The trainer broadcasts version 2, the workers load it, and the trainer dies before committing: every worker
    loaded it over version 1, so no peer holds version 1 any longer. Each loads again version 1's bytes, kept in
    its other set of bucket buffers, and serves it (before: stale until a trainer came back)."""
    start(procs, "w0", "w1")
    async with WeightSender(settings=ws_settings) as sender, RolloutClient(ws_settings) as client:
        report = await sender.update(tensors(1).items(), version=1)

        async def died(*_: object) -> None:
            raise RuntimeError("the trainer died before its commit")

        monkeypatch.setattr(sender.control, "commit_weights", died)
        with pytest.raises(RuntimeError, match="died before its commit"):
            await sender.update(tensors(2).items(), version=2)  # loaded everywhere; its pause is released
        back = ["serving", "1", report.digest]
        await async_wait_until(
            lambda: all(
                heartbeat(rds, ws_settings, w, "state", "weight_version", "weight_digest") == back for w in ("w0", "w1")
            ),
            SYNC_HEARTBEAT_TTL_S + 5,
            "both workers serving version 1 again, within a heartbeat and a load",
        )
        served = await client.generate([PROMPT] * 4, {"max_tokens": 4}, session_ids=[f"d{i}" for i in range(4)])
        assert {t.weight_version for t in served} == {1} and {t.worker_id for t in served} == {"w0", "w1"}
        for worker_id in ("w0", "w1"):
            assert "ended without committing it" in procs.log(worker_id)
            assert "loaded again from the copy this worker received" in procs.log(worker_id)
        assert await sender.committed_version() == 1
        monkeypatch.undo()
        # The trainer back: its next sync goes on from version 1, into the buffers version 2 had.
        again = await sender.update(tensors(3).items(), version=2)
        assert again.loaded == ["w0", "w1"] and again.digest != report.digest
    for worker_id in ("w0", "w1"):
        assert heartbeat(rds, ws_settings, worker_id, "weight_version", "weight_digest") == ["2", again.digest]


@pytest.mark.timeout(60)
async def test_a_checkpoint_outside_the_root_is_refused_and_the_version_kept(ws_settings, procs, tmp_path):
    start(procs, "w0", "w1")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file(tensors(1), str(outside / "model.safetensors"))
    escape = ws_settings.weight_sync.checkpoint_root / "escape"
    escape.symlink_to(outside)  # a link inside the root to a directory outside it
    async with WeightSender(settings=ws_settings) as sender, RolloutClient(ws_settings) as client:
        await sender.update(tensors(1).items(), version=1)
        for path in (outside, escape, ws_settings.weight_sync.checkpoint_root / "missing"):
            with pytest.raises(WeightSyncError) as raised:
                await sender.update_from_checkpoint(str(path), version=2)
            assert set(raised.value.failures) == {"w0", "w1"}
            assert "outside" in str(raised.value) or "no model.safetensors" in str(raised.value)
        assert await sender.committed_version() == 1
        workers = await statuses(client)
        assert {w.state for w in workers.values()} == {"serving"} and {w.weight_version for w in workers.values()} == {
            1
        }


@pytest.mark.timeout(60)
async def test_the_admin_route_syncs_from_a_checkpoint(ws_settings, procs, tmp_path):
    start(procs, "w0", "w1")
    checkpoint = saved_checkpoint(ws_settings, "step-3", 3)
    admin = {"Authorization": "Bearer adm"}
    async with api(ws_settings.copy_with(admin_token="adm"), timeout_s=60) as http:
        route = "/admin/weights/checkpoint"
        assert (await http.post(route, json={"path": str(checkpoint), "version": 3})).status_code == 401
        report = (await http.post(route, json={"path": str(checkpoint), "version": 3}, headers=admin)).json()
        assert report["loaded"] == ["w0", "w1"] and report["transport"] == "checkpoint" and report["version"] == 3
        versions = (await http.get("/admin/weight_version", headers=admin)).json()
        assert versions == {"weight_version": 3, "weight_checkpoint": str(checkpoint), "workers": {"w0": 3, "w1": 3}}
        stale = await http.post(route, json={"path": str(checkpoint), "version": 2}, headers=admin)
        assert stale.status_code == 400 and "not above" in stale.json()["error"]["message"]
        outside = await http.post(route, json={"path": str(tmp_path), "version": 4}, headers=admin)
        assert outside.status_code == 409 and "w0" in outside.json()["error"]["message"]
        assert (await http.get("/admin/weight_version", headers=admin)).json()["weight_version"] == 3


@pytest.mark.timeout(60)
async def test_skyrls_fetch_weights_loads_a_checkpoint_as_the_next_version(ws_settings, procs, tmp_path):
    start(procs, "w0", "w1")
    checkpoint = saved_checkpoint(ws_settings, "step-1", 1)
    async with (
        api(ws_settings.copy_with(open_control=True), timeout_s=60) as http,  # SkyRL's client sends no admin token
        RolloutClient(ws_settings) as client,
    ):
        assert (await http.get("/weight_info")).json() == {"weight_version": "0"}
        fetched = (await http.post("/fetch_weights", json={"path": str(checkpoint)})).json()
        assert fetched["weight_version"] == 1 and fetched["loaded"] == ["w0", "w1"] and not fetched["stale"]
        assert (await http.get("/weight_info")).json() == {"weight_version": "1"}
        [trajectory] = await client.generate([PROMPT], {"max_tokens": 4})
        assert trajectory.weight_versions == [(1, 0)]
        again = await http.post("/fetch_weights", json={"path": str(checkpoint), "weight_version": 5})
        assert again.json()["weight_version"] == 5 and (await http.get("/weight_info")).json()["weight_version"] == "5"
        outside = await http.post("/fetch_weights", json={"path": str(tmp_path)})
        assert outside.status_code == 409 and "w0" in outside.json()["error"]["message"]
        typo = await http.post("/fetch_weights", json={"path": str(checkpoint), "version": 7})
        assert typo.status_code == 400 and "version" in typo.text  # SkyRL's name is weight_version: unknown is refused
        assert (await http.get("/weight_info")).json()["weight_version"] == "5"


@pytest.mark.timeout(90)
async def test_a_stale_worker_hands_the_requests_pinned_to_it_to_a_worker_that_serves(ws_settings, procs, rds):
    """A session's next turn waits in its worker's pinned stream while the fleet is paused; the sync that follows
    leaves that worker stale (its load ran past the sync's timeout). Stale, it takes no work until it has the
    committed version, so the turn goes to the worker that serves (before: it waited on the stale worker, in the
    chaos soak past its 30 s timeout)."""
    procs.start("w0", "--engine", "echo", *SYNC_ECHO_ARGS, "--echo-load-delay-s", "20")
    start(procs, "w1")
    procs.wait_ready("w0", "w1")  # not just live: sessions placed while w0 still starts all go to w1 (seen in CI)
    sender_settings = ws_settings.copy_with(weight_sync_timeout_s=4.0)
    async with WeightSender(settings=sender_settings) as sender, RolloutClient(ws_settings) as client:
        sessions = [f"s{i}" for i in range(8)]
        first = await client.generate([PROMPT] * 8, {"max_tokens": 4}, session_ids=sessions)
        on_w0 = [t.session_id for t in first if t.worker_id == "w0"]
        assert on_w0, "placement put no session on w0"
        await client.pause("keep", holder="test")
        turn = asyncio.ensure_future(client.generate([PROMPT], {"max_tokens": 4}, session_ids=on_w0[:1]))
        pinned = ws_settings.keys.pinned_requests("w0")
        await async_wait_until(lambda: rds.xlen(pinned) == 1, 10, "the turn pinned to w0")
        report = await sender.update(tensors(1).items(), version=1, pause_mode="keep")
        assert report.loaded == ["w1"] and list(report.stale) == ["w0"], report
        await client.resume(holder="test")
        [answered] = await asyncio.wait_for(turn, 15)
        assert answered.worker_id == "w1" and answered.weight_versions == [(1, 0)], answered
        assert rds.hget(ws_settings.keys.worker("w0"), "state") == b"stale"  # still loading: it served nothing
        moved = "w0 is stale: 1 requests pinned to it placed on workers that serve"
        await async_wait_until(lambda: moved in procs.log("w0"), 10, "w0's log line")  # written after the move
