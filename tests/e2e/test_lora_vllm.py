"""LoRA adapters on the real engine: adapters made here with `peft` on the CPU (rank 8 on `q_proj`/`v_proj`, a few
optimizer steps on one sentence, so the greedy output changes), loaded fleet-wide into a float32 vLLM worker
(SmolLM2-135M) through the control plane, and served by name.

- greedy output with the adapter, through the queue, equals vLLM called directly with the same adapter
  (`workers.direct --lora-path`), token for token, and differs from the base model's; unloaded, requests for it
  get 404 from the API (the official `openai` client) and `ModelNotFoundError` from the Python client;

A new version while 100 requests run on the old one (a long run, ~1-2 min): tests/long/test_lora_versions_vllm.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest
import torch

from rollout_svc import RolloutClient
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.errors import ModelNotFoundError
from tests.e2e.conftest import Fleet, WorkerSpec, fleet_spec, run_direct
from tests.support import serve

MiB = 2**20
ENGINE = {"dtype": "float32", "max_num_seqs": 128, "kv_cache_memory_bytes": 768 * MiB}
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
# One worker, on every core (this environment's binding, as `direct` runs vLLM).
LORA_WORKER = fleet_spec(WorkerSpec("lora-0"), **ENGINE, **LORA)
GREEDY = {"temperature": 0.0, "max_tokens": 12}
SENTENCES = {"v1": "The capital of France is Marseille, said the parrot.", "v2": "Bananas grow on the moon at night."}

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_fleet(LORA_WORKER)]


def train_adapter(model_dir: Path, sentence: str, out: Path, steps: int = 20) -> Path:
    """A peft LoRA adapter (rank 8, `q_proj`/`v_proj`) trained `steps` AdamW steps on `sentence`, saved to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(model, config)
    batch = tokenizer([sentence], return_tensors="pt")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    # One thread: with two, each step waits at torch's barriers for a thread the machine's other work has preempted
    # (20 steps: 8 s alone, 71 s beside one busy process, minutes under make test's load; one thread: 10-13 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            loss = model(**batch, labels=batch["input_ids"]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(vllm_fleet: Fleet) -> Path:
    return vllm_fleet.model_dir


@pytest.fixture(scope="module")
def root(vllm_fleet: Fleet) -> Path:
    """The workers' checkpoint root, holding adapter version v1."""
    return adapter_root(vllm_fleet, ["v1"])


def adapter_root(fleet: Fleet, versions: list[str]) -> Path:
    """The fleet's checkpoint root, holding the adapter `versions` of `SENTENCES` (each trained on its own sentence)."""
    root = fleet.settings.weight_sync.checkpoint_root
    assert root is not None
    for version in versions:
        if not (root / version).exists():  # trained once a session: the same sentence, seed and steps every time
            train_adapter(fleet.model_dir, SENTENCES[version], root / version)
    return root


@pytest.fixture(scope="module")
def fleet(vllm_fleet: Fleet, root: Path) -> tuple[Settings, Path]:
    """The worker's settings (a client's calls wait up to 10 min and its control commands 3), and its logs."""
    return vllm_fleet.settings.copy_with(request_timeout_s=600, control_timeout_s=180), vllm_fleet.logs


def direct(model_dir: Path, prompts: list[list[int]], lora_path: Path, tmp_path: Path) -> list[list[int]]:
    """Greedy completions from vLLM called directly (no queue), with the worker's engine settings and adapter."""
    args = [*EngineSettings(**ENGINE, **LORA).to_args(), "--max-tokens", str(GREEDY["max_tokens"])]
    args += ["--lora-path", str(lora_path)]
    result = run_direct(model_dir, prompts, tmp_path, args, env=dict(os.environ))  # the worker's thread binding
    return [o["completion_token_ids"] for o in result["outputs"]]


async def test_an_adapter_loaded_fleet_wide_generates_what_vllm_does_with_it_and_unloaded_answers_404(
    fleet, model_dir, root, tmp_path
):
    settings, _ = fleet
    async with RolloutClient(settings) as client:
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "What is the capital of France?"}]])
        version = await client.load_adapter("parrot", str(root / "v1"))
        assert {w.worker_id: w.adapter_versions for w in await client.workers()} == {"lora-0": {"parrot": version}}
        [adapted] = await client.generate([prompt], GREEDY, adapter="parrot")
        [base] = await client.generate([prompt], GREEDY)
        assert adapted.adapter == "parrot" and adapted.adapter_versions == [(version, 0)]
        assert adapted.completion_token_ids != base.completion_token_ids, "the adapter did not change the output"
        [with_adapter] = direct(model_dir, [prompt], root / "v1", tmp_path)  # base equality: test_service_vllm
        assert adapted.completion_token_ids == with_adapter, "the service's adapter output differs from vLLM's"
        with serve(settings, tmp_path / "serve.log") as url, openai.OpenAI(base_url=f"{url}/v1", api_key="-") as api:
            reply = api.completions.create(model="parrot", prompt=[prompt], max_tokens=12, temperature=0)
            assert reply.model == "parrot" and reply.choices[0].text == adapted.text
            await client.unload_adapter("parrot")
            with pytest.raises(openai.NotFoundError, match="parrot"):
                api.completions.create(model="parrot", prompt=[prompt], max_tokens=12, temperature=0)
        with pytest.raises(ModelNotFoundError):
            await client.generate([prompt], GREEDY, adapter="parrot")
        assert (await client.workers())[0].adapter_versions == {}
