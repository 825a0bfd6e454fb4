"""A LoRA adapter updated to a new version while 100 requests run on the old one, on the real engine (a long run,
~1-2 min, so in `make test-long`; `make test` runs the adapter's equality with vLLM's in
tests/e2e/test_lora_vllm.py). Two versions of a `peft` adapter (rank 8 on `q_proj`/`v_proj`, trained here on
different sentences), one float32 vLLM worker: none of the 100 is paused, aborted or retried, each trajectory
records the version it ran under and generates that version's output; the next requests take the new version.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout_svc import RolloutClient
from tests.e2e.conftest import Fleet, vllm_fleet, vllm_fleets  # noqa: F401 - fixtures
from tests.e2e.test_lora_vllm import GREEDY, LORA_WORKER, adapter_root, fleet, model_dir  # noqa: F401 - fixtures
from tests.support import async_wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_fleet(LORA_WORKER)]

# The 100 requests run 64 tokens, so all of them are in flight for seconds (at 12, the first ones finished before the
# last were taken on a loaded CI machine); their first 12 tokens are what is compared.
LONG = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}


@pytest.fixture(scope="module")
def root(vllm_fleet: Fleet) -> Path:  # noqa: F811 - the fleet's, with v2
    """The workers' checkpoint root, holding adapter versions v1 and v2."""
    return adapter_root(vllm_fleet, ["v1", "v2"])


async def test_a_new_version_while_100_requests_run_on_the_old_one_pauses_and_aborts_nothing(fleet, root):  # noqa: F811
    settings, _ = fleet
    async with RolloutClient(settings) as client:
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "Tell me about the moon."}]])
        old = await client.load_adapter("policy", str(root / "v1"))
        [reference_old] = await client.generate([prompt], LONG, adapter="policy")
        running = asyncio.create_task(client.generate([prompt] * 100, LONG, adapter="policy"))

        async def all_running() -> bool:
            return sum(w.in_flight for w in await client.workers()) == 100

        await async_wait_until(all_running, 120, "100 requests on the old version in flight")
        epoch = (await client.fleet_state()).epoch
        new = await client.load_adapter("policy", str(root / "v2"))
        assert new == old + 1 and not running.done()
        trajectories = await running
        assert {(t.finish_reason, t.interruptions, t.abort_cause) for t in trajectories} == {("length", 0, None)}
        assert {tuple(t.adapter_versions) for t in trajectories} == {((old, 0),)}
        first = reference_old.completion_token_ids[:12]
        assert all(t.completion_token_ids[:12] == first for t in trajectories)
        [after] = await client.generate([prompt], GREEDY, adapter="policy")
        assert after.adapter_versions == [(new, 0)]
        assert after.completion_token_ids != first, "the new version changed nothing"
        state = await client.fleet_state()
        assert state.epoch == epoch + 1 and not state.paused and state.adapters["policy"].version == new
        await client.unload_adapter("policy")  # the fleet as it found it, for a module after
