"""Settings per concern: flat names and env vars reach their concern; children get exactly the parent's settings;
every engine setting is an option of the commands that start workers."""

from __future__ import annotations

import pickle

import pydantic
import pytest
import typer

from rollout_svc import RolloutClient
from rollout_svc.cli import app
from rollout_svc.config import ClientSettings, EngineSettings, Settings, settings_env


def test_a_concerns_field_given_flat_or_by_env_lands_in_its_concern(monkeypatch):
    monkeypatch.setenv("ROLLOUT_MAX_STALENESS", "2")
    monkeypatch.setenv("ROLLOUT_BATCH_CONCURRENCY", "7")
    settings = Settings(heartbeat_interval_s=0.25, admin_token="t", key_prefix="p")
    assert settings.worker.heartbeat_interval_s == 0.25 and settings.api.admin_token == "t"
    assert settings.client.max_staleness == 2 and settings.batch.batch_concurrency == 7  # from env
    assert settings.key_prefix == "p" and settings.keys.prefix == "p"
    assert Settings(max_staleness=5).client.max_staleness == 5  # a keyword wins over env
    nested = Settings(client=ClientSettings(request_timeout_s=3), max_staleness=1)  # both ways at once
    assert (nested.client.request_timeout_s, nested.client.max_staleness) == (3, 1)


def test_an_unknown_or_bad_field_is_refused_and_names_it():
    with pytest.raises(pydantic.ValidationError, match="max_stalenes"):
        Settings(max_stalenes=1)
    with pytest.raises(pydantic.ValidationError, match="heartbeat_interval_s"):
        Settings(heartbeat_interval_s=-1)
    with pytest.raises(pydantic.ValidationError, match="request_timeout_s"):
        Settings().copy_with(request_timeout_s=0)


def test_copy_with_replaces_flat_fields_and_keeps_the_rest():
    base = Settings(redis_url="redis://a:1/0", max_abort_retries=3, api_keys=["k"])
    copy = base.copy_with(redis_url="redis://b:2/0", max_staleness=1)
    assert copy.redis_url == "redis://b:2/0" and copy.client.max_staleness == 1
    assert copy.client.max_abort_retries == 3 and copy.api.api_keys == ["k"]
    assert base.redis_url == "redis://a:1/0" and base.client.max_staleness is None  # unchanged
    assert base.model_copy(update={"max_staleness": 2}).client.max_staleness == 2  # pydantic's copy routes them too


def test_a_child_process_gets_exactly_the_parents_settings(monkeypatch):
    parent = Settings(key_prefix="x", heartbeat_ttl_s=4, max_staleness=1, api_keys=["a", "b"], batch_lease_ttl_s=2)
    env = settings_env(parent)
    assert env["ROLLOUT_MAX_STALENESS"] == "1" and env["ROLLOUT_API_KEYS"] == '["a", "b"]'
    assert not any(name.startswith("ROLLOUT_ENGINE") for name in env)  # a worker's engine comes by its options
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings() == parent


def test_a_client_pickles_with_its_settings_by_concern():
    client = RolloutClient(redis_url="redis://h:1/0", max_staleness=1, request_timeout_s=9)
    again = pickle.loads(pickle.dumps(client))
    assert again.settings == client.settings and again.settings.client.max_staleness == 1
    assert len(again.expected_lengths) == 0 and again._runner.last_step is None  # fresh state, as a new client's


def test_every_engine_setting_is_an_option_of_up_and_demo():
    commands = {command.name: command for command in typer.main.get_command(app).commands.values()}
    for name in ("up", "demo"):
        options = {option.name for option in commands[name].params}
        assert set(EngineSettings.model_fields) <= options, name
        assert "engine" in options and "workers" in options


@pytest.mark.parametrize(
    "engine",
    [
        EngineSettings(),
        EngineSettings(engine="echo", echo_preload_weight_transfer=True, echo_token_delay_s=0.5),
        EngineSettings(dtype="float32", max_num_seqs=8, enable_sleep_mode=False, tool_call_parser=""),
    ],
)
def test_engine_settings_survive_the_worker_command_line(engine: EngineSettings):
    from workers.__main__ import parse_args

    assert EngineSettings.from_args(parse_args(engine.to_args())) == engine
