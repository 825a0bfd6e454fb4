"""`up --model-group NAME=N[:MODEL]` without processes: the form it reads, and each worker's model and name."""

from __future__ import annotations

import pytest

from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy.local import LocalCluster, ModelGroup


def test_a_model_group_reads_name_count_and_model():
    assert ModelGroup.parse("policy=2") == ModelGroup("policy", 2)
    assert ModelGroup.parse(" judge=1:/models/judge-7b ") == ModelGroup("judge", 1, "/models/judge-7b")
    assert ModelGroup.parse("ref.v2=3:org/model:rev") == ModelGroup("ref.v2", 3, "org/model:rev")
    for bad in ("policy", "policy=0", "=2", "-x=1", "policy=two", "a b=1"):
        with pytest.raises(ValueError, match="NAME=N or NAME=N:MODEL"):
            ModelGroup.parse(bad)


def test_each_worker_serves_its_groups_model_under_its_name():
    groups = [ModelGroup("policy", 2), ModelGroup("judge", 1, "/models/judge")]
    cluster = LocalCluster(Settings(), 0, EngineSettings(engine="echo", model="/models/base"), groups=groups)
    children = cluster._worker_children({"ROLLOUT_MODEL_NAME": "", "OTHER": "x"})
    assert cluster.worker_count == 3 and [c.name for c in children] == ["policy-0", "policy-1", "judge-0"]
    assert [c.env["ROLLOUT_MODEL_NAME"] for c in children] == ["policy", "policy", "judge"]
    models = [c.args[c.args.index("--model") + 1] for c in children]
    assert models == ["/models/base", "/models/base", "/models/judge"] and children[0].env["OTHER"] == "x"
    with pytest.raises(ValueError, match="a name of its own"):
        LocalCluster(Settings(), 0, EngineSettings(engine="echo"), groups=[ModelGroup("a", 1), ModelGroup("a", 2)])


def test_without_groups_the_workers_keep_their_names_and_the_settings_model_name():
    children = LocalCluster(Settings(model_name="policy"), 2, EngineSettings(engine="echo"))._worker_children({})
    assert [(c.name, c.env["ROLLOUT_MODEL_NAME"]) for c in children] == [("worker-0", "policy"), ("worker-1", "policy")]
