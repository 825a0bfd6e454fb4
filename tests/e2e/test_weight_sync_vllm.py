"""Weight sync on the real engine: two float32 vLLM workers, the trainer sends SmolLM2's own tensors.

On the session's `TWO_FLOAT32` fleet (tests/e2e/conftest.py): two workers (one CPU core each) under a checkpoint root.
Greedy float32 outputs are compared token for token: perturbed weights change them on both workers, the original weights
restore them, a checkpoint of the perturbed weights gives the same output as their broadcast, a keep-pause across a
sync splits a generation exactly at the token it was frozen at (or, with `max_staleness=0`, cuts it there and the new
weights generate it whole); a checkpoint or a broadcast loaded but never committed
gives way to the committed broadcast version the engines still hold. The last test restarts one worker after a sync it
missed: it catches up from its peer and generates exactly what the peer generates. Every test ends on the model's own
weights, for the modules that share the fleet.
"""

from __future__ import annotations

import signal

import pytest
import redis
import torch
from safetensors.torch import load_file, save_file

from rollout_svc import RolloutClient
from rollout_svc.client.weight_sender import SyncReport, WeightSender
from rollout_svc.config import Settings
from rollout_svc.protocol import WeightSyncOrder
from tests.e2e.conftest import TWO_FLOAT32, Fleet, perturb_weights
from tests.support import Streaming, async_wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_fleet(TWO_FLOAT32)]

MiB = 2**20
GREEDY = {"temperature": 0.0, "max_tokens": 16}
SESSIONS = [f"s{i}" for i in range(4)]  # least-loaded placement spreads 4 sessions over both workers


@pytest.fixture(scope="module")
def fleet(vllm_fleet: Fleet) -> Settings:
    """The session's two float32 vLLM workers (tests/e2e/conftest.py), under its checkpoint root; a sync's pause
    lease outlasts a minute's freeze of this shared machine, as the fleet's heartbeat TTL does."""
    return vllm_fleet.settings.copy_with(request_timeout_s=300, pause_lease_s=240)


@pytest.fixture(scope="module")
def weights(vllm_fleet: Fleet) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's own tensors, and the same perturbed (`perturb_weights`, as SkyRL's module perturbs them)."""
    original = load_file(str(vllm_fleet.model_dir / "model.safetensors"))
    return original, perturb_weights(original)


async def outputs(client: RolloutClient, prompt: list[int], version: int) -> list[list[int]]:
    """Greedy outputs of `prompt` on both workers (two sessions each), once both serve `version`: a worker that
    missed a sync (a loaded machine can time out its part) catches up from its peer first. The sessions are placed
    anew each time (a session pinned to the only worker serving at one moment would stay there)."""

    async def both_serving() -> bool:
        workers = await client.workers()
        return sorted((w.state, w.weight_version) for w in workers) == [("serving", version)] * 2

    await async_wait_until(both_serving, 300, f"both workers serving weight version {version}", 0.2)
    for session in SESSIONS:
        await client.finish_session(session)
    trajectories = await client.generate([prompt] * 4, GREEDY, session_ids=SESSIONS)
    placed = sorted((t.worker_id, t.interruptions) for t in trajectories)
    assert len({t.worker_id for t in trajectories}) == 2, f"the sessions did not reach both workers: {placed}"
    assert all(t.weight_version >= version and t.weight_versions == [(version, 0)] for t in trajectories)
    return [t.completion_token_ids for t in trajectories]


async def next_version(
    sender: WeightSender, client: RolloutClient, tensors: dict[str, torch.Tensor], question: str
) -> tuple[list[int], int, SyncReport]:
    """Sync `tensors` as the next weight version: the chat prompt of `question`, that version and its sync report."""
    [prompt] = await client.apply_chat_template([[{"role": "user", "content": question}]])
    version = await sender.committed_version() + 1
    return prompt, version, await sender.update(tensors.items(), version=version)


async def test_updates_change_and_restore_greedy_output_by_broadcast_and_by_checkpoint(fleet, weights):
    original, perturbed = weights
    async with WeightSender(settings=fleet) as sender, RolloutClient(fleet) as client:
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "What is the capital of France?"}]])
        version = await sender.committed_version()
        base = await outputs(client, prompt, version)
        assert all(o == base[0] for o in base)
        report = await sender.update(perturbed.items(), version=version + 1)
        assert sorted(report.loaded) == ["vllm-0", "vllm-1"] and report.bytes > 500 * MiB and report.gb_per_s > 0
        changed = await outputs(client, prompt, version + 1)
        assert all(c != b for c, b in zip(changed, base, strict=True)), "perturbed weights did not change both"
        inside = await sender.update(original.items(), version=version + 2, pause_during_transfer=True)
        assert inside.paused_during_transfer and not report.paused_during_transfer
        assert await outputs(client, prompt, version + 2) == base, "the original weights did not restore the output"

        checkpoint = fleet.weight_sync.checkpoint_root / "weight-sync-perturbed"  # SkyRL's module has a "perturbed"
        checkpoint.mkdir()
        save_file(perturbed, str(checkpoint / "model.safetensors"))
        report = await sender.update_from_checkpoint(str(checkpoint), version=version + 3)
        assert report.transport == "checkpoint" and sorted(report.loaded) == ["vllm-0", "vllm-1"]
        assert await outputs(client, prompt, version + 3) == changed, "checkpoint and broadcast of one set differ"
        await sender.update(original.items(), version=version + 4)
        assert await outputs(client, prompt, version + 4) == base
        # The transfer inside the pause, as before: the same weights give the same greedy output as outside it.
        await sender.update(perturbed.items(), version=version + 5, pause_during_transfer=True)
        assert await outputs(client, prompt, version + 5) == changed, "inside and outside the pause differ"
        await sender.update(original.items(), version=version + 6)
        assert await outputs(client, prompt, version + 6) == base


async def test_a_keep_pause_across_a_sync_splits_the_generation_at_the_frozen_token(fleet, weights):
    """A greedy generation frozen by the sync's keep-pause goes on with the new weights from the token it reached:
    its first `cut` tokens are the old weights' greedy output, the rest is exactly what the new weights generate
    after the prompt and those `cut` tokens. An index off by one would fail one half or the other."""
    original, perturbed = weights
    long = {"temperature": 0.0, "max_tokens": 96, "ignore_eos": True}
    async with WeightSender(settings=fleet) as sender, RolloutClient(fleet) as client:
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "Tell me a long story."}]])
        old = await sender.committed_version()
        [reference] = await client.generate([prompt], long)
        run = Streaming(client, [prompt], long)
        [before_sync] = await run.streamed(8, 120)  # generating, some tokens in
        # Held frozen across the sync: its transfer runs outside the sync's own pause, long enough for a 96-token
        # generation to end on a loaded machine before the load; frozen, it is in flight when the weights switch.
        await client.pause("keep", holder="test")
        await sender.update(perturbed.items(), version=old + 1, pause_mode="keep")
        await client.resume(holder="test")
        [split] = await run.task
        [(v0, zero), (v1, cut)] = split.weight_versions
        assert (v0, zero, v1) == (old, 0, old + 1), split.weight_versions
        assert 8 <= before_sync <= cut < 96, (before_sync, split.weight_versions)  # what it had made was the old's
        assert split.staleness == 1 and split.weight_version == old + 1
        tokens = split.completion_token_ids
        assert tokens[:cut] == reference.completion_token_ids[:cut], "the tokens before the cut are the old model's"
        after = {**long, "max_tokens": 96 - cut}
        [continued] = await client.generate([prompt + tokens[:cut]], after)
        assert continued.completion_token_ids == tokens[cut:], "the tokens after the cut are the new model's"
        await sender.update(original.items(), version=old + 2)


async def test_a_sync_cuts_a_generation_it_makes_too_stale_and_the_new_weights_generate_it_whole(fleet, weights):
    """With `max_staleness=0` the generation frozen across the sync is aborted in the paused engine at the load, not
    generated on: it comes back once, whole, from the new weights, exactly their greedy output, and the tokens the
    old weights had made are counted as discarded."""
    original, perturbed = weights
    long = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}
    async with WeightSender(settings=fleet) as sender, RolloutClient(fleet, max_staleness=0) as client:
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "Tell me a long story."}]])
        old = await sender.committed_version()
        run = Streaming(client, [prompt], long)
        [before_sync] = await run.streamed(8, 120)
        await client.pause("keep", holder="test")
        await sender.update(perturbed.items(), version=old + 1, pause_mode="keep")
        await client.resume(holder="test")
        [whole] = await run.task
        assert client.stats.regenerated == 1 and client.stats.stale_tokens >= before_sync
        assert whole.weight_versions == [(old + 1, 0)] and whole.staleness == 0
        [reference] = await client.generate([prompt], long)  # the new weights, uninterrupted
        assert whole.completion_token_ids == reference.completion_token_ids
        await sender.update(original.items(), version=old + 2)


async def test_a_checkpoint_never_committed_gives_way_to_the_broadcast_version_the_engines_still_hold(fleet, weights):
    """A trainer pauses the fleet, has it load a checkpoint of other weights, and dies before committing: once its
    pause lapses each engine loads again the committed broadcast version it holds as received (`reload_weights` from
    the bytes it kept) and generates exactly what that version generated; no peer or trainer is needed."""
    original, perturbed = weights
    async with WeightSender(settings=fleet) as sender, RolloutClient(fleet) as client:
        prompt, version, _ = await next_version(sender, client, perturbed, "Name a famous painter.")
        committed = await outputs(client, prompt, version)
        checkpoint = fleet.weight_sync.checkpoint_root / "weight-sync-never-committed"
        checkpoint.mkdir()
        save_file(original, str(checkpoint / "model.safetensors"))
        await client.pause("keep", holder="weight-sync", lease_s=2.0, renew=False)  # the trainer's, then it dies
        order = WeightSyncOrder(
            sync_id="never-committed",
            version=version + 1,
            transport="checkpoint",
            members=["vllm-0", "vllm-1"],
            path=str(checkpoint),
        )
        await sender.plane.publish(order)
        loaded = await sender.plane.await_barrier(order.sync_id, "loaded", order.members, 300)
        assert sorted(loaded.ok) == ["vllm-0", "vllm-1"], "both engines loaded the checkpoint over the version"
        assert await outputs(client, prompt, version) == committed, "back on the committed version, exactly"
        assert await sender.committed_version() == version
        await sender.update(original.items(), version=version + 2)


async def test_a_broadcast_never_committed_gives_way_to_the_version_received_before_it(fleet, weights, monkeypatch):
    """The trainer broadcasts other weights, both engines load them, and it dies before committing: each engine
    loads again the committed version it received before (kept in its other set of bucket buffers) and generates
    exactly what that version generated."""
    original, perturbed = weights
    async with WeightSender(settings=fleet) as sender, RolloutClient(fleet) as client:
        prompt, version, _ = await next_version(sender, client, perturbed, "Name a large ocean.")
        committed = await outputs(client, prompt, version)

        async def died(*_: object) -> None:
            raise RuntimeError("the trainer died before its commit")

        monkeypatch.setattr(sender.control, "commit_weights", died)
        with pytest.raises(RuntimeError, match="died before its commit"):
            await sender.update(original.items(), version=version + 1)
        assert await outputs(client, prompt, version) == committed, "back on the committed version, exactly"
        monkeypatch.undo()
        await sender.update(original.items(), version=version + 1)


async def test_a_late_worker_caught_up_from_its_peer_generates_exactly_what_its_peer_generates(
    fleet, vllm_fleet, weights
):
    settings, procs = fleet, vllm_fleet.procs
    original, perturbed = weights
    rds = redis.Redis.from_url(settings.redis_url)
    procs.kill("vllm-1", signal.SIGTERM)  # it drains and deregisters: the sync goes on without it
    procs.procs["vllm-1"].wait(timeout=120)
    async with WeightSender(settings=settings) as sender, RolloutClient(settings) as client:
        prompt, version, report = await next_version(sender, client, perturbed, "Name three rivers in Europe.")
        assert report.loaded == ["vllm-0"] and report.digest
        peer = await client.generate([prompt] * 2, GREEDY)
        assert {t.worker_id for t in peer} == {"vllm-0"}
        assert peer[0].completion_token_ids == peer[1].completion_token_ids
        # Restarted, it loads SmolLM2's own weights from disk (version 0), is stale, and catches up from vllm-0.
        vllm_fleet.start_worker("vllm-1")
        caught_up = [b"serving", str(version).encode(), report.digest.encode()]
        fields = ("state", "weight_version", "weight_digest")
        await async_wait_until(
            lambda: rds.hmget(settings.keys.worker("vllm-1"), *fields) == caught_up, 600, "vllm-1 caught up and serving"
        )
        assert f"caught up to weight version {version} from vllm-0" in procs.log("vllm-1")
        late = await outputs(client, prompt, version)  # both workers, two sessions each
        assert all(o == peer[0].completion_token_ids for o in late), "the caught-up worker generates otherwise"
        await sender.update(original.items(), version=version + 1)
    rds.close()
