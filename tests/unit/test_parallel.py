"""Engine parallelism settings: tensor, pipeline and data parallel sizes reach vLLM's engine arguments, the worker's
capacity and ranks, every way a worker is started (`python -m workers`, `up`), and its CPU binding."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from rollout_svc.config import EngineSettings
from rollout_svc.deploy.processes import cpu_sets
from workers.__main__ import parse_args

PARALLEL = {"tensor_parallel_size": 3, "pipeline_parallel_size": 2, "data_parallel_size": 2}


@pytest.mark.imports_vllm
@pytest.mark.imports_vllm
def test_parallel_sizes_reach_vllms_engine_arguments():
    from workers.vllm_args import vllm_engine_args

    engine = EngineSettings(max_num_seqs=8, **PARALLEL)
    args = vllm_engine_args("/no/model", **engine.vllm_kwargs())
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (3, 2, 2)
    assert args.distributed_executor_backend == "mp"  # its own processes, also where Ray is initialized
    assert args.max_num_seqs == 8  # vLLM's is per data-parallel replica
    assert engine.capacity == 16 and engine.gpus == 12

    single = vllm_engine_args("/no/model", **EngineSettings().vllm_kwargs())
    assert (single.tensor_parallel_size, single.pipeline_parallel_size, single.data_parallel_size) == (1, 1, 1)
    assert single.distributed_executor_backend is None  # vLLM's own choice for one rank


@pytest.mark.imports_vllm
def test_the_vllm_engine_reports_its_ranks_and_capacity():
    from workers.vllm_engine import VLLMEngine

    engine = VLLMEngine("/no/model", **EngineSettings(max_num_seqs=8, **PARALLEL).vllm_kwargs())
    assert (engine.parallel.tensor, engine.parallel.pipeline, engine.parallel.data) == (3, 2, 2)
    assert engine.weight_ranks == 12 and engine.capacity == 16


def test_worker_and_up_options_carry_the_sizes():
    args = parse_args(["--tensor-parallel-size", "3", "--pipeline-parallel-size", "2", "--data-parallel-size", "2"])
    assert EngineSettings.from_args(args).gpus == 12
    assert EngineSettings(**PARALLEL).to_args() == [
        "--tensor-parallel-size",
        "3",
        "--pipeline-parallel-size",
        "2",
        "--data-parallel-size",
        "2",
    ]
    with pytest.raises(SystemExit):
        parse_args(["--tensor-parallel-size", "two"])


def test_sizes_below_one_or_on_engines_without_ranks_are_refused():
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        EngineSettings(tensor_parallel_size=0)
    with pytest.raises(ValidationError, match="vLLM's: the echo engine runs one rank"):
        EngineSettings(engine="echo", tensor_parallel_size=2)


def test_cpu_binding_gives_each_rank_its_set(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})
    assert cpu_sets(2) == ["0", "1"]
    assert cpu_sets(1) == ["0-1"]
    assert cpu_sets(1, 3) == ["0|1|0"]  # three ranks on two CPUs share them (vLLM's `|`-separated form)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)))
    assert cpu_sets(2, 2) == ["0-1|2-3", "4-5|6-7"]


@pytest.mark.imports_vllm
@pytest.mark.imports_vllm
def test_the_vllm_install_check_passes_here_and_names_what_a_release_lacks(monkeypatch: pytest.MonkeyPatch):
    from rollout_svc.tools import vllm_install_check

    assert vllm_install_check.check("cpu") == []
    real = vllm_install_check.vllm_imports
    monkeypatch.setattr(vllm_install_check, "vllm_imports", lambda roots: real(roots) | {("vllm", "NoSuchName")})
    [failure] = vllm_install_check.check("cpu")
    assert failure.startswith("from vllm import NoSuchName")


def test_up_gives_each_vllm_worker_its_own_gpus_and_refuses_too_few(monkeypatch):
    from rollout_svc.deploy.processes import gpu_sets, visible_gpus

    assert gpu_sets(8, 1, [str(i) for i in range(8)]) == [str(i) for i in range(8)]  # 8 x 7B at TP=1
    assert gpu_sets(2, 4, [str(i) for i in range(8)]) == ["0,1,2,3", "4,5,6,7"]  # 2 x 32B at TP=4
    with pytest.raises(ValueError, match="3 workers of 4 GPU\\(s\\) each need 12 GPUs; this host has 8"):
        gpu_sets(3, 4, [str(i) for i in range(8)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: a CPU host
    assert visible_gpus() == []


def test_a_local_cluster_hands_out_the_gpus_before_anything_starts(monkeypatch, tmp_path):
    from rollout_svc.config import Settings
    from rollout_svc.deploy.local import LocalCluster

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    cluster = LocalCluster(Settings(redis_url="redis://127.0.0.1:1/0"), 2, EngineSettings(tensor_parallel_size=2))
    monkeypatch.setattr(LocalCluster, "_start_redis_cluster", lambda self: pytest.fail("nothing may start"))
    children = []
    monkeypatch.setattr(LocalCluster, "_spawn", lambda self, child: children.append(child))
    monkeypatch.setattr("rollout_svc.deploy.local.redis_answers", lambda url: True)
    monkeypatch.setattr(LocalCluster, "_supervise", lambda self: None)
    cluster.start()
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children] == ["0,1", "2,3"]
    too_many = LocalCluster(Settings(redis_url="redis://127.0.0.1:1/0"), 3, EngineSettings(tensor_parallel_size=2))
    monkeypatch.setattr("rollout_svc.deploy.local.redis_answers", lambda url: pytest.fail("checked first"))
    with pytest.raises(ValueError, match="need 6 GPUs; this host has 4"):
        too_many.start()
