"""Weight sync on GPUs (skipped here, with the reason): NCCL between a trainer and a worker on two GPUs, and a
GPU engine receiving over gloo from a CPU trainer on one GPU. The same code path as on CPU: only the tensors'
device picks the backend."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_svc import RolloutClient
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.model import prepare_model
from tests.support import WorkerProcs

MiB = 2**20
GREEDY = {"temperature": 0.0, "max_tokens": 16}


def cuda_devices() -> int:
    torch = pytest.importorskip("torch")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture
def gpu_worker(request: pytest.FixtureRequest, redis_url: str, rds, tmp_path: Path) -> Iterator[tuple[Settings, Path]]:
    """One float32 vLLM worker on the last GPU (the trainer keeps cuda:0 when there are two); a test marked
    `native_transfer` gets it with vLLM's own NCCL weight transfer engine (`--weight-transfer-backend nccl`)."""
    if request.node.get_closest_marker("gpu2") and cuda_devices() < 2:
        pytest.skip("needs two CUDA GPUs: NCCL needs the trainer and the worker on different GPUs")
    if cuda_devices() < 1:
        pytest.skip("needs a CUDA GPU: a GPU engine receiving over gloo from a CPU trainer")
    model = prepare_model(Settings().cache_dir)
    settings = Settings(redis_url=redis_url, key_prefix="gpu-weights", heartbeat_ttl_s=30, control_timeout_s=120)
    native = "nccl" if request.node.get_closest_marker("native_transfer") else "none"
    engine = EngineSettings(
        model=str(model),
        dtype="float32",
        max_num_seqs=8,
        kv_cache_memory_bytes=512 * MiB,
        weight_transfer_backend=native,
    )
    procs = WorkerProcs(settings, tmp_path)
    device = str(cuda_devices() - 1)
    procs.start("gpu-0", *engine.to_args(), env={"CUDA_VISIBLE_DEVICES": device})
    try:
        procs.wait_live("gpu-0", timeout_s=600)
        yield settings, model
    finally:
        procs.stop_all()


async def round_trip(settings: Settings, model: Path, device: str) -> None:
    import torch
    from safetensors.torch import load_file

    from rollout_svc.client.weight_sender import WeightSender

    original = {n: t.to(device) for n, t in load_file(str(model / "model.safetensors")).items()}
    noise = torch.Generator(device=device).manual_seed(0)
    perturbed = {
        n: t + 0.1 * t.std() * torch.randn(t.shape, generator=noise, device=device) for n, t in original.items()
    }
    async with WeightSender(settings=settings) as sender, RolloutClient(settings) as client:
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "What is the capital of France?"}]])
        [base] = await client.generate([prompt], GREEDY)
        await sender.update(perturbed.items(), version=1)
        [changed] = await client.generate([prompt], GREEDY)
        assert changed.weight_version == 1 and changed.completion_token_ids != base.completion_token_ids
        await sender.update(original.items(), version=2)
        [restored] = await client.generate([prompt], GREEDY)
        assert restored.completion_token_ids == base.completion_token_ids


@pytest.mark.gpu
@pytest.mark.vllm
async def test_a_gpu_engine_receives_over_gloo_from_a_cpu_trainer(gpu_worker):
    await round_trip(*gpu_worker, device="cpu")


@pytest.mark.gpu2
@pytest.mark.vllm
async def test_nccl_from_a_trainer_on_one_gpu_to_a_worker_on_another(gpu_worker):
    await round_trip(*gpu_worker, device="cuda:0")


@pytest.mark.gpu2
@pytest.mark.vllm
@pytest.mark.native_transfer
async def test_vllms_own_trainer_engine_sends_through_serve(gpu_worker, tmp_path):
    """vLLM 0.32's trainer side, unmodified (`NCCLWeightTransferEngine.trainer_init` and `send_weights` over its
    `HTTPVLLMWeightSyncClient`), pointed at `serve`: the worker joins the trainer's NCCL group through
    /init_weight_transfer_engine, receives the perturbed weights, and /finish_weight_update commits version 1."""
    import httpx
    import torch
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLWeightTransferEngine

    from tests.support import free_port, serve

    class StateDictSource(WeightSource):
        """The checkpoint's tensors under their own names, as a trainer's state dict holds them."""

        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            self.tensors = tensors

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(self.tensors.items())

    settings, model = gpu_worker
    noise = torch.Generator(device="cuda:0").manual_seed(0)
    original = {n: t.to("cuda:0") for n, t in load_file(str(model / "model.safetensors")).items()}
    weights = {
        n: t + 0.1 * t.std() * torch.randn(t.shape, generator=noise, device="cuda:0") for n, t in original.items()
    }
    with serve(settings, tmp_path / "serve.log", "--open-control") as base, httpx.Client(base_url=base) as http:
        world_size = 1 + http.get("/get_world_size").json()["world_size"]
        client = RolloutClient(settings)
        [prompt] = await client.apply_chat_template([[{"role": "user", "content": "What is the capital of France?"}]])
        [before] = await client.generate([prompt], GREEDY)
        engine = await asyncio.to_thread(
            NCCLWeightTransferEngine.trainer_init,
            NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=free_port(), world_size=world_size),
            client=HTTPVLLMWeightSyncClient(base, timeout=600),
            source=StateDictSource(weights),
        )
        await asyncio.to_thread(engine.send_weights)
        assert http.get("/weight_info").json() == {"weight_version": "1"}
        [after] = await client.generate([prompt], GREEDY)
        assert after.weight_version == 1 and after.completion_token_ids != before.completion_token_ids
        await client.close()
