"""TRL's own `VLLMClient` (trl 1.16.0, unmodified: `GRPOTrainer(vllm_mode="server")`'s client) against `rollout-svc
serve` over 2 echo workers and a real redis-server, and the vLLM fields it sends, on the wire.

The echo engine echoes its prompt (its tokenizer: one token per byte, logprob 0), so every answer is known exactly.
What depends on a real model (TRL's token ids equal to `RolloutClient.generate`'s) is in
tests/e2e/test_trainers_vllm.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_svc.api.server_info import fleet_vllm_config
from rollout_svc.config import Settings
from rollout_svc.protocol import WorkerStatus
from tests.support import serve

NEWER_VLLM = "ignore:TRL currently supports vLLM versions:UserWarning"  # TRL 1.16 tested vLLM up to 0.31; we run 0.32
with warnings.catch_warnings():
    warnings.filterwarnings(*NEWER_VLLM.split(":")[:2], category=UserWarning)
    from trl.generation.vllm_client import VLLMClient

pytestmark = [pytest.mark.filterwarnings(NEWER_VLLM), pytest.mark.imports_vllm]  # TRL's client checks vLLM is there


@pytest.fixture
def trl(settings: Settings, echo_workers, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """2 echo workers, `serve --open-control`, and TRL's client on it."""
    echo_workers(2)
    with serve(settings, tmp_path / "serve.log", "--open-control") as base:
        yield base, VLLMClient(base_url=base, connection_timeout=30)


def test_trls_generate_reads_prompt_ids_completion_ids_and_a_logprob_per_token(trl):
    """Text prompts, n=2, `logprobs=0` (TRL's default): TRL parses each position's logprobs from `"token_id:N"`
    tokens (`return_tokens_as_token_ids`) and its `top_logprobs`, which hold the sampled token as vLLM's do."""
    _, client = trl
    r = client.generate(["hello there", "good morning"], n=2, max_tokens=8, temperature=1.0, logprobs=0)
    assert r["prompt_ids"] == [list(b"hello there"), list(b"good morning")]
    assert r["completion_ids"] == [list(b"hello th")] * 2 + [list(b"good mor")] * 2  # prompt-major, n each
    assert r["logprob_token_ids"] == [[[t] for t in ids] for ids in r["completion_ids"]]
    assert r["logprobs"] == [[[0.0]] * 8] * 4


def test_trls_generate_from_token_ids_without_logprobs(trl):
    _, client = trl
    r = client.generate([[72, 101, 108, 108, 111]], max_tokens=8, logprobs=None)
    assert r["prompt_ids"] == [[72, 101, 108, 108, 111]] and r["completion_ids"] == [[72, 101, 108, 108, 111]]
    assert r["logprobs"] is None and r["logprob_token_ids"] is None


def test_trls_chat_reads_the_templated_prompt_and_token_id_logprobs(trl):
    _, client = trl
    r = client.chat([[{"role": "user", "content": "hi"}]], max_tokens=8)
    [prompt], [completion] = r["prompt_ids"], r["completion_ids"]
    assert bytes(prompt).startswith(b"<|user|>") and completion == prompt[:8]  # echo: the templated prompt
    assert r["logprob_token_ids"] == [[[t] for t in completion]]


def test_trls_sequence_logprobs_read_prompt_logprobs(trl):
    """`get_sequence_logprobs` (TRL's teacher scoring) reads vLLM's `prompt_logprobs`: per position, the prompt
    token's id, logprob and rank (the echo is certain of every prompt token)."""
    _, client = trl
    r = client.get_sequence_logprobs([[5, 6, 7, 8, 9]], prompt_lengths=[2], top_logprobs=2)
    assert r["actual_token_ids"] == [[[7], [8], [9]]] and r["actual_logprobs"] == [[[0.0]] * 3]
    assert [[ids[0] for ids in row] for row in r["logprob_token_ids"]] == [[7, 8, 9]]


def test_trls_world_size_cache_reset_and_server_info(trl):
    """Each echo engine is one rank; `/server_info` reports the fleet as one vLLM config, with no weight-transfer
    engine on echo workers, so TRL's `init_communicator` refuses with its own error before any rendezvous."""
    base, client = trl
    assert client.get_world_size() == 2
    client.reset_prefix_cache()
    info = client.get_server_info()
    assert info["weight_transfer_config"] is None and info["lora_config"] is None
    assert info["model_config"]["max_model_len"] > 0 and info["parallel_config"]["data_parallel_size"] == 2
    with pytest.raises(RuntimeError, match="no weight-transfer engine"):
        client.init_communicator(device="cpu")
    text = httpx.get(f"{base}/server_info").json()  # vLLM's default format: the config as one string
    assert isinstance(text["vllm_config"], str) and "weight_transfer_config" in text["vllm_config"]
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == info["model_config"]["max_model_len"]


def test_vllm_fields_on_the_wire(trl):
    """What TRL sends, as vLLM answers it: `logprobs: 0` gives each position's `top_logprobs` holding the sampled
    token (not null); `structured_outputs` is vLLM's guided decoding (one of json, regex, choice, grammar,
    json_object), an option we do not serve refused by name, never dropped; `cache_salt` is accepted."""
    base, _ = trl
    body: dict[str, Any] = {"model": "echo", "prompt": "abc", "max_tokens": 3, "logprobs": 0}
    plain = httpx.post(f"{base}/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert plain["tokens"] == ["a", "b", "c"] and plain["top_logprobs"] == [{"a": 0.0}, {"b": 0.0}, {"c": 0.0}]
    ids = httpx.post(f"{base}/v1/completions", json=body | {"return_tokens_as_token_ids": True}).json()
    assert ids["choices"][0]["logprobs"]["top_logprobs"] == [
        {"token_id:97": 0.0},
        {"token_id:98": 0.0},
        {"token_id:99": 0.0},
    ]
    salted = httpx.post(f"{base}/v1/completions", json=body | {"cache_salt": "policy-3"})
    assert salted.status_code == 200, salted.text
    chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_salt": "s"}
    assert httpx.post(f"{base}/v1/chat/completions", json=chat).status_code == 200
    for fields, named in [
        (
            {"structured_outputs": {"regex": "[ab]+", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
    ]:
        refused = httpx.post(f"{base}/v1/completions", json=body | fields)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == named, refused.text
    both = chat | {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}
    refused = httpx.post(f"{base}/v1/chat/completions", json=both)
    assert refused.status_code == 400 and "not both" in refused.json()["error"]["message"]
    guided = httpx.post(f"{base}/v1/completions", json=body | {"structured_outputs": {"choice": ["yes", "no"]}})
    assert guided.status_code == 200, guided.text


def _worker(worker_id: str, engine_config: str, **fields: Any) -> WorkerStatus:
    return WorkerStatus(worker_id=worker_id, model="m", engine_config=engine_config, max_model_len=4096, **fields)


def test_server_info_reports_a_weight_transfer_engine_only_where_every_engine_has_one():
    """The fleet's `vllm_config`: NCCL weight transfer only when every live engine was started with it (TRL would
    otherwise join a group some engines cannot), LoRA only when every engine serves it (the smallest limits)."""
    nccl = "dtype=bfloat16 quantization=none cuda_graphs=on prefix_caching=on speculative=none"
    nccl += " logprobs_mode=processed_logprobs lora=16x4 weight_transfer=nccl"
    both = fleet_vllm_config([_worker("a", nccl), _worker("b", nccl.replace("16x4", "8x2"))], "m")
    assert both["weight_transfer_config"] == {"backend": "nccl"}
    assert both["lora_config"] == {"max_lora_rank": 8, "max_loras": 2}
    assert both["model_config"]["dtype"] == "torch.bfloat16"
    assert both["model_config"]["logprobs_mode"] == "processed_logprobs"
    mixed = fleet_vllm_config(
        [_worker("a", nccl), _worker("b", nccl.replace("nccl", "none").replace("16x4", "none"))], "m"
    )
    assert mixed["weight_transfer_config"] is None and mixed["lora_config"] is None
    echo = fleet_vllm_config([_worker("e", "", tensor_parallel_size=2, data_parallel_size=2)], "m")
    assert echo["model_config"]["dtype"] is None and echo["parallel_config"]["world_size"] == 2
