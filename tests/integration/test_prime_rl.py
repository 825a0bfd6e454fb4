"""prime-rl's calls to its inference server, replayed against `rollout-svc serve` over 2 echo workers and a real
redis-server, exactly as prime-rl's own client makes them (PrimeIntellect-ai/prime-rl at
559b44772e471d1538537b8805cc77f3824a5e64, `src/prime_rl/utils/client.py`: `update_weights`, `_pause_engines`,
`_resume_engines`, `load_lora_adapter`; `src/prime_rl/orchestrator/envs.py`: `cache_salt` in `extra_body`).

A weight step: `POST /pause?mode=keep&clear_cache=false`, `POST /update_weights {"weight_dir": ...}` (a Hugging Face
folder its trainer wrote under `broadcasts/step_N/`, sharded with an index, then a `STABLE` file), `POST /resume`.
The echo engine loads the checkpoint's bytes; that the real model's output changes is tests/e2e/test_trainers_vllm.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_svc.config import Settings
from tests.support import SYNC_ECHO_ARGS, SYNC_HEARTBEAT_TTL_S, WorkerProcs, serve

ADMIN_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=60.0, pool=10.0)  # prime-rl's per-attempt bounds


@pytest.fixture
def prime(settings: Settings, tmp_path: Path) -> Iterator[tuple[str, Path, Settings]]:
    """2 echo workers with a checkpoint root, and `serve --open-control` (prime-rl's admin client sends no token)."""
    root = tmp_path / "outputs"
    root.mkdir()
    ws = settings.copy_with(checkpoint_root=root, weight_sync_timeout_s=15.0, heartbeat_ttl_s=SYNC_HEARTBEAT_TTL_S)
    procs = WorkerProcs(ws, tmp_path)
    try:
        procs.start_ready(["echo-0", "echo-1"], "--engine", "echo", *SYNC_ECHO_ARGS)
        with serve(ws, tmp_path / "serve.log", "--open-control") as base:
            yield base, root, ws
    finally:
        procs.stop_all()


def sharded_checkpoint(folder: Path, shards: dict[str, bytes], *, stable: bool = True) -> Path:
    """A folder as prime-rl's trainer writes one: shards, `model.safetensors.index.json` naming them, then `STABLE`.
    (The echo engine reads bytes: the shards' contents need not be safetensors here.)"""
    folder.mkdir(parents=True)
    for name, data in shards.items():
        (folder / name).write_bytes(data)
    weight_map = {f"layer.{i}.weight": name for i, name in enumerate(shards)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if stable:
        (folder / "STABLE").touch()
    return folder


def weight_step(base: str, weight_dir: Path, **fields: Any) -> httpx.Response:
    """prime-rl's `update_weights` (no LoRA): pause keep without clearing the cache, update, resume (in `finally`)."""
    with httpx.Client(base_url=base, timeout=ADMIN_TIMEOUT) as admin:
        admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}).raise_for_status()
        try:
            return admin.post("/update_weights", json={"weight_dir": weight_dir.as_posix(), **fields})
        finally:
            admin.post("/resume").raise_for_status()


def versions(base: str) -> tuple[str, set[int], set[str]]:
    """The committed version (vLLM's `/weight_info`), each worker's version and state."""
    committed = httpx.get(f"{base}/weight_info").json()["weight_version"]
    workers = httpx.get(f"{base}/health").json()
    assert workers["status"] == "ok", workers
    status = httpx.get(f"{base}/get_server_info").json()["engines"]
    return committed, {e["weight_version"] for e in status}, {e["worker_id"] for e in status}


def test_a_prime_rl_weight_step_loads_a_sharded_checkpoint_on_every_worker(prime):
    base, root, _ = prime
    step = sharded_checkpoint(
        root / "broadcasts" / "step_1",
        {"model-00001-of-00002.safetensors": b"a" * 64, "model-00002-of-00002.safetensors": b"b" * 64},
    )
    answer = weight_step(base, step)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["status"] == "ok" and sorted(body["loaded"]) == ["echo-0", "echo-1"] and body["weight_version"] == 1
    assert versions(base)[:2] == ("1", {1})
    # the fleet serves again after the step's /resume, on the new version
    done = httpx.post(f"{base}/v1/completions", json={"model": "echo", "prompt": "hi", "max_tokens": 2})
    assert done.status_code == 200 and done.json()["choices"][0]["text"] == "hi"


def test_a_checkpoint_without_its_stable_marker_is_refused_when_asked_to_wait_for_one(prime):
    """`stable_wait_s`: each worker waits that long for `STABLE`; without it, the step fails naming the marker and
    the old version stays; a marker written while it waits is taken."""
    base, root, _ = prime
    shards = {"model-00001-of-00001.safetensors": b"c" * 32}
    half = sharded_checkpoint(root / "broadcasts" / "step_1", shards, stable=False)
    refused = weight_step(base, half, stable_wait_s=0.5)
    assert refused.status_code == 409 and "no STABLE marker after 0.5 s" in refused.json()["error"]["message"]
    assert versions(base)[:2] == ("0", {0})
    later = threading.Timer(0.5, (half / "STABLE").touch)
    later.start()
    taken = weight_step(base, half, stable_wait_s=10)
    later.join()
    assert taken.status_code == 200 and taken.json()["weight_version"] == 1, taken.text
    unmarked = weight_step(base, sharded_checkpoint(root / "broadcasts" / "step_2", shards, stable=False))
    assert unmarked.status_code == 200, "without stable_wait_s no marker is needed (prime-rl checks it itself)"
    # a folder still being written, no shard or index in it yet: waited for, not refused for holding no weights
    writing = root / "broadcasts" / "step_3"
    writing.mkdir()
    later = threading.Timer(0.5, lambda: (writing.rmdir(), sharded_checkpoint(writing, shards)))
    later.start()
    written = weight_step(base, writing, stable_wait_s=10)
    later.join()
    assert written.status_code == 200 and written.json()["weight_version"] == 3, written.text


def test_update_weights_dispatches_on_its_body_and_names_what_it_takes(prime):
    base, root, _ = prime
    for body, said in [
        ({}, "update_info (vLLM's NCCL transfer) or weight_dir"),
        ({"weights": "x"}, "got ['weights']"),
        ({"weight_dir": 3}, "weight_dir"),
        ({"weight_dir": str(root), "extra": 1}, "extra"),
    ]:
        answer = httpx.post(f"{base}/update_weights", json=body)
        assert answer.status_code == 400 and said in answer.json()["error"]["message"], answer.text
    broken = sharded_checkpoint(root / "broken", {"model-00001-of-00002.safetensors": b"d"})
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"]["layer.9.weight"] = "model-00002-of-00002.safetensors"  # a shard that is not there
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    missing = httpx.post(f"{base}/update_weights", json={"weight_dir": str(broken)}, timeout=ADMIN_TIMEOUT)
    assert missing.status_code == 409 and "lacks model-00002-of-00002.safetensors" in missing.text, missing.text
    # vLLM's own body still takes the NCCL path: before an init it is refused as that path refuses it
    nccl = httpx.post(f"{base}/update_weights", json={"update_info": {"names": []}})
    assert nccl.status_code == 400 and "before init_weight_transfer_engine" in nccl.text, nccl.text


def test_prime_rls_lora_reload_and_salted_rollouts(prime, tmp_path):
    """`/load_lora_adapter` with one name every step (prime-rl's `lora_name` is fixed): a new version each time;
    rollouts with `cache_salt` (the policy version) and `X-Session-ID` are served."""
    base, root, _ = prime
    adapter = root / "broadcasts" / "step_1" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))  # peft's save_pretrained
    for _ in range(2):
        answer = httpx.post(f"{base}/load_lora_adapter", json={"lora_name": "policy", "lora_path": adapter.as_posix()})
        assert answer.status_code == 200 and answer.json() == {"status": "ok"}, answer.text
    [policy] = [m for m in httpx.get(f"{base}/v1/models").json()["data"] if m["id"] == "policy"]
    assert policy["version"] == 2 and policy["root"] == adapter.as_posix()
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "cache_salt": "1"}
    salted = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Session-ID": "trajectory-7"})
    assert salted.status_code == 200 and salted.headers["X-Worker-ID"] in ("echo-0", "echo-1"), salted.text
