"""GPU bundles for a Ray worker group, on CPUs: a custom resource (`fake_gpu`) stands in for GPUs, as Ray's docs
suggest for testing placement. Two echo workers, 2 fake GPUs each (what a worker of TP=2 asks for by default:
tests/unit/test_launch.py), on a node of 4: the placement group holds all 4 in two bundles, each actor holds 2 of
them, and a killed actor's replacement holds 2 again: with every fake GPU in the group, and the other bundle held by
the survivor, only its own bundle can hold it."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator

import pytest
import ray
from ray.util.placement_group import placement_group_table

from rollout_svc.config import EngineSettings
from rollout_svc.deploy.ray import RayWorkerGroup, WorkerInfo
from tests.support import wait_until

MiB = 2**20


@pytest.fixture
def local_ray() -> Iterator[None]:
    """A Ray instance of this test's own: 2 CPUs and 4 fake GPUs, torn down afterwards."""
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    if ray.is_initialized():  # another module of this process left one: ours needs its own resources
        ray.shutdown()
    ray.init(
        num_cpus=2,
        resources={"fake_gpu": 4},
        include_dashboard=False,
        object_store_memory=100 * MiB,
        _temp_dir=temp_dir,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def replaced(group: RayWorkerGroup, victim: WorkerInfo) -> WorkerInfo | None:
    info = group.info(timeout_s=2)[0]
    return info if info and info.actor_pid != victim.actor_pid and info.alive else None


@pytest.mark.timeout(180)
def test_each_worker_holds_a_bundle_of_its_gpus_and_a_killed_actor_is_replaced_in_its_bundle(local_ray, settings):
    engine = EngineSettings(engine="echo")
    with RayWorkerGroup(
        2, 2, cpus_per_worker=0.5, settings=settings, engine=engine, gpu_resource="fake_gpu", name="tp2"
    ) as group:
        assert group.bundles == [{"CPU": 0.5, "fake_gpu": 2.0}] * 2
        group.wait_ready(120)
        table = placement_group_table(group.placement_group)
        assert list(table["bundles"].values()) == [{"CPU": 0.5, "fake_gpu": 2.0}] * 2 and table["state"] == "CREATED"
        first = group.info()
        assert all(i is not None and i.resources == {"CPU": 0.5, "fake_gpu": 2.0} for i in first), first
        assert ray.available_resources().get("fake_gpu", 0) == 0  # the group holds all 4
        victim, survivor = first
        assert victim is not None and survivor is not None
        os.kill(victim.actor_pid, signal.SIGKILL)
        replacement = wait_until(lambda: replaced(group, victim), 120, "a new actor in the killed one's slot")
        assert replacement.worker_id == victim.worker_id == "tp2-0"
        assert replacement.resources == {"CPU": 0.5, "fake_gpu": 2.0}
        group.wait_ready(120)
        now = group.info()[1]
        assert now is not None and (now.actor_pid, now.restarts) == (survivor.actor_pid, 0)
