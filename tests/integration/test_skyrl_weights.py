"""vLLM's native weight transfer routes on `serve`, as SkyRL's trainer calls them (its `RemoteInferenceClient`,
unmodified), over 2 echo workers and a real redis-server.

The echo engine has no vLLM weight transfer engine, so here every call that reaches the workers is refused by both,
by name, and nothing changes: what is checked is the fan-out, the answers, and what is refused before any worker is
asked. The calls on the real engine (NCCL, CUDA) are tests/e2e/test_skyrl_weights_gpu.py; the worker's side of each
call is tests/unit/test_engine_weight_op.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_svc.config import Settings
from rollout_svc.integrations.skyrl import skyrl_module
from tests.support import serve

CLIENT = "skyrl.backends.skyrl_train.inference_servers.remote_inference_client"


@dataclass
class InitInfo:
    """The two methods SkyRL's client calls on its `BroadcastInitInfo` (skyrl 0.3.0's, copied: its module imports
    Ray and torch at the top)."""

    master_addr: str
    master_port: int
    rank_offset: int
    world_size: int

    def for_servers(self, world_size_per_server: int, num_servers: int, dp_size: int = 1) -> list[InitInfo]:
        result, rank_offset = [], self.rank_offset
        for i in range(num_servers):
            result.append(replace(self, rank_offset=rank_offset))
            if (i + 1) % dp_size == 0:
                rank_offset += world_size_per_server
        return result

    def to_api_payload(self) -> dict[str, Any]:
        return {
            "master_address": self.master_addr,
            "master_port": self.master_port,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
        }


@pytest.fixture
def fleet(settings: Settings, echo_workers, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    echo_workers(2)
    with serve(settings, tmp_path / "serve.log", "--open-control") as base:
        client = skyrl_module(CLIENT).RemoteInferenceClient(
            proxy_url=base, server_urls=[base], data_parallel_size=1, model_name="echo"
        )
        yield base, client


def call(client: Any, method: str, *args: Any) -> Any:
    """One call of SkyRL's client on a fresh event loop (its session is made per loop); the HTTP error it raises."""

    async def made() -> Any:
        try:
            return await getattr(client, method)(*args)
        except Exception as exc:  # aiohttp's ClientResponseError, raised by SkyRL's raise_for_status
            return exc
        finally:
            await client.teardown()

    return asyncio.run(made())


@pytest.mark.timeout(60)
@pytest.mark.skyrl03  # 0.4.0's client left the weight-sync calls to its trainer's own client
def test_skyrls_weight_sync_calls_reach_every_worker_and_name_each_refusal(fleet):
    base, client = fleet
    with httpx.Client(base_url=base, timeout=30) as http:
        check(client, http)


def check(client: Any, http: httpx.Client) -> None:
    assert call(client, "get_world_size") == (2, 2)  # what SkyRL sizes the trainer's group with: 1 + 2 ranks

    # SkyRL's init: one server, rank_offset 1 (the trainer is rank 0). Both workers are asked, both refuse.
    refused = call(client, "init_weight_update_communicator", InitInfo("127.0.0.1", 29500, 1, 3))
    assert getattr(refused, "status", None) == 409
    answer = http.post(
        "/init_weight_transfer_engine", json={"init_info": InitInfo("127.0.0.1", 29500, 1, 3).to_api_payload()}
    ).json()["error"]["message"]
    assert "echo-0" in answer and "echo-1" in answer and "no vLLM weight transfer engine" in answer

    # Before a successful init, the update calls are refused without asking any worker.
    for method in ("start_weight_update", "finish_weight_update"):
        before = call(client, method)
        assert getattr(before, "status", None) == 400, (method, before)
    assert "before init_weight_transfer_engine" in http.post("/start_weight_update").text
    update_info = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "packed": True}
    assert getattr(call(client, "update_weights_nccl", update_info), "status", None) == 400

    # init_info that cannot be right is refused before any worker is asked.
    for info, why in (
        ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}, "exceed world_size 2"),
        ({"master_address": "127.0.0.1", "master_port": 1, "world_size": 3}, "init_info.rank_offset"),
        ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": True, "world_size": 3}, "rank_offset"),
    ):
        bad = http.post("/init_weight_transfer_engine", json={"init_info": info})
        assert bad.status_code == 400 and why in bad.text, (info, bad.text)

    # collective_rpc serves SkyRL's three wrapped methods only; IPC handles are pickled: refused, never unpickled.
    ipc = http.post("/collective_rpc", json={"method": "update_weights_ipc", "kwargs": {"update_info": {}}})
    assert ipc.status_code == 400 and "pickled" in ipc.text
    other = http.post("/collective_rpc", json={"method": "reload_weights"})
    assert other.status_code == 400 and "skyrl_start_weight_update" in other.text
    kernel = http.post(
        "/collective_rpc", json={"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": False}}
    )
    assert kernel.status_code == 400 and "is_checkpoint_format" in kernel.text
    assert http.post("/finish_weight_update", json={"weight_version": "v2"}).status_code == 400

    # Nothing of the above moved the committed version.
    assert http.get("/weight_info").json() == {"weight_version": "0"}


@pytest.mark.timeout(120)
def test_a_fleet_counted_twice_or_changed_since_it_was_counted_is_refused_at_init(settings, echo_workers, tmp_path):
    """SkyRL sums `/get_world_size` over its `server_urls` (per deployment of `data_parallel_size` servers) and
    caches it at the first call. Two `serve` replicas of one fleet listed as two deployments count every GPU twice:
    the second's init (at rank 1 + 2) is refused, naming the fix, as the fleet already joins that trainer's group
    (at rank 1) through the first. Listed as the DP servers of one deployment (SkyRL 0.4 sends each the same init),
    the second follows: it answers the calls the first makes. A fleet that grew after it was counted is refused at
    the next init, saying so, before NCCL would wait for ranks that never join."""
    echo_workers(2)
    with (
        serve(settings, tmp_path / "a.log", "--open-control") as a,
        serve(settings, tmp_path / "b.log", "--open-control") as b,
    ):
        info = InitInfo("127.0.0.1", 29511, 1, 5).to_api_payload()
        assert httpx.get(f"{a}/get_world_size").json() == {"world_size": 2}
        first = httpx.post(f"{a}/init_weight_transfer_engine", json={"init_info": info}, timeout=60)
        assert first.status_code == 409, first.text  # the echo engines refuse: the join at rank 1 is recorded
        twice = httpx.post(f"{b}/init_weight_transfer_engine", json={"init_info": info | {"rank_offset": 3}})
        assert twice.status_code == 400 and "data-parallel servers of one deployment" in twice.text, twice.text
        follows = httpx.post(f"{b}/init_weight_transfer_engine", json={"init_info": info})
        assert follows.status_code == 200 and follows.json()["rank_offsets"] == {"echo-0": 1, "echo-1": 2}
        assert httpx.post(f"{b}/start_weight_update").status_code == 200  # made by the leader, not again here
        echo_workers(1)
        grown = info | {"master_port": 29512, "world_size": 4}
        changed = httpx.post(f"{a}/init_weight_transfer_engine", json={"init_info": grown}, timeout=60)
        assert changed.status_code == 400 and "counted a fleet that has changed" in changed.text, changed.text
        assert httpx.get(f"{a}/get_world_size").json() == {"world_size": 3}  # counted again: the init goes on
        again = httpx.post(f"{a}/init_weight_transfer_engine", json={"init_info": grown}, timeout=60)
        assert again.status_code == 409 and "echo-2" in again.text, again.text
