"""LoRA adapters' parts without a server: the state hash's fields, names and directories a worker accepts, the engine
arguments, and a worker's adapter table (versions in use stay loaded until their last request ends)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_svc.config import EngineSettings
from rollout_svc.control.lora import AdapterSpec, adapter_dir, check_adapter_name
from rollout_svc.control.plane import FleetState
from rollout_svc.errors import InvalidRequestError
from rollout_svc.protocol import WorkerStatus
from workers.echo import EchoEngine
from workers.lora_table import AdapterTable
from workers.serve import adapter_spans


def peft_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return path


def test_the_state_hash_holds_adapters_and_reads_them_back():
    state = FleetState(epoch=3, adapters={"math": AdapterSpec(2, "/ckpt/a:b/step-2"), "judge": AdapterSpec(1, "/j")})
    fields = {k.encode(): v.encode() for k, v in state.to_hash().items()}
    assert fields[b"adapter:math"] == b"2:/ckpt/a:b/step-2"
    assert FleetState.from_hash(fields).adapters == state.adapters


@pytest.mark.parametrize("name", ["math", "policy-v2", "Qwen2.5_lora", "a" * 128])
def test_adapter_names_that_can_be_a_model_are_accepted(name):
    assert check_adapter_name(name) == name


@pytest.mark.parametrize("name", ["", "-x", "with space", "a/b", "a" * 129, "ünï"])
def test_other_adapter_names_are_refused_saying_what_is_allowed(name):
    with pytest.raises(InvalidRequestError, match="letters, digits"):
        check_adapter_name(name)


def test_a_worker_loads_adapters_only_from_under_its_checkpoint_root(tmp_path):
    root = tmp_path / "root"
    good = peft_dir(root / "math")
    assert adapter_dir(root, str(good)) == good.resolve()
    outside = peft_dir(tmp_path / "elsewhere")
    with pytest.raises(InvalidRequestError, match="outside this worker's checkpoint root"):
        adapter_dir(root, str(outside))
    (root / "link").symlink_to(outside)  # a symlink out of the root is outside too
    with pytest.raises(InvalidRequestError, match="outside"):
        adapter_dir(root, str(root / "link"))
    (root / "empty").mkdir()
    with pytest.raises(InvalidRequestError, match=r"adapter_config\.json"):
        adapter_dir(root, str(root / "empty"))
    with pytest.raises(InvalidRequestError, match="ROLLOUT_CHECKPOINT_ROOT"):
        adapter_dir(None, str(good))


@pytest.mark.imports_vllm
@pytest.mark.imports_vllm
def test_lora_settings_reach_vllms_engine_arguments_only_when_enabled():
    from workers.vllm_args import vllm_engine_args

    lora = EngineSettings(enable_lora=True, max_loras=3, max_lora_rank=8)
    args = vllm_engine_args("/no/model", **lora.vllm_kwargs())
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 3, 8)
    assert lora.to_args() == ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
    assert not vllm_engine_args("/no/model", **EngineSettings(max_loras=3).vllm_kwargs()).enable_lora


def test_a_heartbeat_lists_each_adapters_newest_version():
    status = WorkerStatus.from_hash({b"worker_id": b"w", b"adapters": b"judge@1,policy@12"})
    assert status.adapter_versions == {"judge": 1, "policy": 12}
    assert WorkerStatus(worker_id="w").adapter_versions == {}


async def test_an_old_version_stays_loaded_until_its_last_request_ends(tmp_path):
    engine, table, root = EchoEngine(), AdapterTable(), tmp_path
    assert await table.apply({"p": AdapterSpec(1, str(peft_dir(root / "v1")))}, engine, root) == {}
    first = table.acquire("p")
    assert first is not None and first.version == 1
    assert await table.apply({"p": AdapterSpec(2, str(peft_dir(root / "v2")))}, engine, root) == {}
    second = table.acquire("p")
    assert second is not None and second.version == 2 and second.lora_id != first.lora_id
    assert set(engine.adapters) == {first.lora_id, second.lora_id}  # v1 still runs a request
    await table.release(first, engine)
    assert set(engine.adapters) == {second.lora_id} and table.summary() == "p@2"
    assert await table.apply({}, engine, root) == {}  # unloaded: new requests refused, the running one finishes
    assert table.acquire("p") is None and set(engine.adapters) == {second.lora_id}
    await table.release(second, engine)
    assert engine.adapters == {}


async def test_a_failed_load_is_reported_and_the_other_adapters_load(tmp_path):
    engine, table = EchoEngine(), AdapterTable()
    errors = await table.apply(
        {"bad": AdapterSpec(1, str(tmp_path / "missing")), "ok": AdapterSpec(1, str(peft_dir(tmp_path / "ok")))},
        engine,
        tmp_path,
    )
    assert list(errors) == ["bad"] and errors["bad"].startswith("adapter bad v1:")
    assert "adapter_config.json" in errors["bad"]
    assert table.summary() == "ok@1"


def test_adapter_spans_follow_a_retry_onto_a_new_version():
    class Ref:
        def __init__(self, version: int) -> None:
            self.version = version

    assert adapter_spans([], Ref(3), 0, [1, 2]) == [(3, 0)]  # type: ignore[arg-type]
    assert adapter_spans([(3, 0)], Ref(4), 5, list(range(9))) == [(3, 0), (4, 5)]  # type: ignore[arg-type]
    assert adapter_spans([(3, 0)], Ref(3), 5, list(range(9))) == [(3, 0)]  # type: ignore[arg-type]
    assert adapter_spans([(3, 0)], Ref(4), 5, list(range(5))) == [(3, 0)]  # type: ignore[arg-type]
    assert adapter_spans([], None, 0, [1]) == []


def test_a_named_model_has_keys_of_its_own_and_the_default_keeps_todays():
    from pydantic import ValidationError

    from rollout_svc.config import Settings

    default, policy = Settings(), Settings(model_name="policy")
    assert default.keys.requests == "rollout:{g0}:requests"
    assert policy.keys.requests == "rollout:model:policy:{g0}:requests"
    assert policy.keys.state != default.keys.state and policy.keys.shards != default.keys.shards
    assert policy.models_key == default.models_key == "rollout:models"
    with pytest.raises(ValidationError):
        Settings(model_name="no spaces")
