"""Weight sync in `rollout-svc bench`: the whole model pushed into two float32 vLLM workers.

Measured in one run, alternating so drift hits both alike:

- `WeightSender.update` of SmolLM2's own tensors (keep-pause), the transfer outside the pause (the default) and
  inside it (`pause_during_transfer=True`, as before), alternated: total time, time paused, phases, and the effective
  GB/s of the transfer phase (bytes / seconds from the first bucket to the last);
- the peer: a bare `ProcessGroupGloo` broadcast of the same tensors, one broadcast per tensor, from rank 0 to two
  receiver processes (what a trainer would write by hand), timed the same way, into receiving tensors already
  written once (its best case);
- the pause an in-flight request feels: a greedy request streamed with a sync in its middle; felt = the longest
  time it went without a token, less its usual time per token (the same request alone just before); beside it, the
  latency the sync added to it. Goals: the time paused <= the load time + 50 ms; felt <= the time paused + 100 ms.

Imports torch (the CLI imports this module only for `bench`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from safetensors.torch import load_file

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.client.weight_sender import SyncReport, WeightSender
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.deploy.processes import free_port
from rollout_svc.protocol import TrajectoryChunk, TransferGroup
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import private_settings
from rollout_svc.weightsync.transfer import join_group

MiB = 2**20
SYNCS = 3
WORKERS = 2
FELT_TOKENS = 128  # long enough to span a sync whose transfer runs while it generates
FELT_PAIRS = 4
FELT_STREAM_INTERVAL_S = 0.01  # the workers send each token as it is made (a step here takes ~100 ms), so the gaps
# between the probe's chunks are the gaps between its tokens
BARE_TIMEOUT_S = 120.0
BARE_ROUNDS = 3


@dataclass
class WeightFigures:
    workers: int
    model_bytes: int
    tensors: int
    buckets: int
    syncs: int
    sync_s: float  # medians over the syncs (transfer outside the pause)
    paused_s: float
    pause_s: float
    join_s: float
    pack_s: float
    transfer_s: float
    load_s: float
    bare_s: float  # median bare broadcast of the same tensors
    unsynced_s: float  # median latency of the probe request without a sync
    felt_s: float  # median longest gap between the probe's tokens across a sync, less its usual time per token
    added_s: float  # median extra latency of the probe request with a sync in its middle
    token_s: float  # the probe's median time per token alone
    after_s: float  # median time from the sync's return (resumed) to the probe's next token
    felt_sync_s: float  # median time of those syncs
    felt_paused_s: float  # median time paused of those syncs
    inside_sync_s: float  # medians over the syncs with the transfer inside the pause
    inside_paused_s: float
    inside_transfer_s: float

    @property
    def gb_per_s(self) -> float:
        return self.model_bytes / self.transfer_s / 1e9

    @property
    def bare_gb_per_s(self) -> float:
        return self.model_bytes / self.bare_s / 1e9

    @property
    def ratio(self) -> float:
        return self.gb_per_s / self.bare_gb_per_s


def weight_sync(redis_url: str | None, model: Path, log_dir: Path, console: Console) -> WeightFigures:
    settings = private_settings(redis_url, "bench-weights").copy_with(stream_interval_s=FELT_STREAM_INTERVAL_S)
    engine = EngineSettings(model=str(model), dtype="float32", max_num_seqs=16, kv_cache_memory_bytes=256 * MiB)
    tensors = load_file(str(model / "model.safetensors"))
    cluster = LocalCluster(settings, WORKERS, engine, log_dir=log_dir)
    with Progress(None, "bench (e) weight sync, vLLM"), cluster.running(ready_timeout_s=900):
        figures = asyncio.run(_measure(settings, model, tensors))
    console.print(figures, f"transfer {figures.gb_per_s:.2f} GB/s, bare {figures.bare_gb_per_s:.2f} GB/s")
    return figures


async def _measure(settings: Settings, model: Path, tensors: dict[str, torch.Tensor]) -> WeightFigures:
    reports: list[SyncReport] = []
    inside: list[SyncReport] = []
    bare: list[float] = []
    async with WeightSender(settings=settings) as sender, RolloutClient(settings) as client:
        version = await sender.committed_version()
        for _ in range(SYNCS):
            bare.append(await asyncio.to_thread(bare_broadcast, model, WORKERS))
            version += 1
            reports.append(await sender.update(tensors.items(), version=version))
            version += 1
            inside.append(await sender.update(tensors.items(), version=version, pause_during_transfer=True))
        probes = await _felt(client, sender, tensors, version)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    return WeightFigures(
        workers=WORKERS,
        model_bytes=size,
        tensors=len(tensors),
        buckets=reports[-1].buckets,
        syncs=SYNCS,
        sync_s=_median([r.total_s for r in reports]),
        paused_s=_median([r.paused_s for r in reports]),
        pause_s=_median([r.pause_s for r in reports]),
        join_s=_median([r.join_s for r in reports]),
        pack_s=_median([r.pack_s for r in reports]),
        transfer_s=_median([r.transfer_s for r in reports]),
        load_s=_median([r.load_s for r in reports]),
        bare_s=_median(bare),
        unsynced_s=_median([p.alone_s for p in probes]),
        felt_s=_median([p.felt_s for p in probes]),
        added_s=_median([p.added_s for p in probes]),
        token_s=_median([p.token_s for p in probes]),
        after_s=_median([p.after_s for p in probes]),
        felt_sync_s=_median([p.sync.total_s for p in probes]),
        felt_paused_s=_median([p.sync.paused_s for p in probes]),
        inside_sync_s=_median([r.total_s for r in inside]),
        inside_paused_s=_median([r.paused_s for r in inside]),
        inside_transfer_s=_median([r.transfer_s for r in inside]),
    )


@dataclass
class _Probe:
    """One pair: the probe request alone, then with a sync in its middle."""

    alone_s: float  # its latency alone
    token_s: float  # its median gap between tokens alone
    felt_s: float  # with the sync: its longest gap between tokens, less token_s
    added_s: float  # with the sync: its latency less alone_s
    after_s: float  # with the sync: from the sync's return (resumed, committed) to its next token
    sync: SyncReport


async def _felt(
    client: RolloutClient, sender: WeightSender, tensors: dict[str, torch.Tensor], version: int
) -> list[_Probe]:
    """Pairs of a greedy probe request alone, then the same with a sync issued a third of the way in (interleaved,
    so drift hits both alike), each streamed: the pause the synced probe felt (its longest wait for a token, less
    its usual time per token alone) and the latency the sync added to it. Pairs whose probe did not span the sync
    are left out; raises `RuntimeError` if none did."""
    [prompt] = await client.apply_chat_template([[{"role": "user", "content": "Tell me a long story."}]])
    params = {"temperature": 0.0, "max_tokens": FELT_TOKENS, "ignore_eos": True}
    await client.generate([prompt], params)  # warm: the prompt's prefix cached, as in the runs that follow
    probes = []
    for _ in range(FELT_PAIRS):
        alone_s, alone_arrivals, _ = await _streamed(client, prompt, params)
        probe = asyncio.ensure_future(_streamed(client, prompt, params))
        await asyncio.sleep(alone_s / 3)
        version += 1
        report = await sender.update(tensors.items(), version=version, pause_mode="keep")
        returned = time.perf_counter()
        synced_s, arrivals, trajectory = await probe
        if len(trajectory.weight_versions) != 2:
            continue  # it finished before the pause, or started after the sync: not a probe of this
        token_s = _median(_gaps(alone_arrivals))
        after_s = min(a for a in arrivals if a > returned) - returned
        probes.append(_Probe(alone_s, token_s, max(_gaps(arrivals)) - token_s, synced_s - alone_s, after_s, report))
    if not probes:
        raise RuntimeError("no probe request was in flight across a sync; raise FELT_TOKENS")
    return probes


async def _streamed(client: RolloutClient, prompt: Any, params: dict[str, Any]) -> tuple[float, list[float], Any]:
    """One request streamed: its latency, when each of its chunks arrived (`time.perf_counter`; one token each at
    `FELT_STREAM_INTERVAL_S`), and its trajectory."""
    started = time.perf_counter()
    arrivals: list[float] = []
    trajectory = None
    async for _, event in client.stream([prompt], params):
        if isinstance(event, TrajectoryChunk):
            arrivals.append(time.perf_counter())
        else:
            trajectory = event
    if trajectory is None or len(arrivals) < 3:
        raise RuntimeError(f"the probe streamed {len(arrivals)} chunks; expected one a token")
    return time.perf_counter() - started, arrivals, trajectory


def _gaps(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(arrivals)]


def bare_broadcast(model: Path, receivers: int, rounds: int = BARE_ROUNDS) -> float:
    """Broadcast every tensor of `model`, one `ProcessGroupGloo.broadcast` each, from a root process to `receivers`
    processes, `rounds` times into the same receiving tensors; the median seconds from the first broadcast to the
    last of the rounds after the first (the root's view, as for a sync's transfer phase): warm buffers, the best
    case of a hand-written loop. Every rank is a process of its own, so the trainer's process is left as it was."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "rollout_svc.tools.bench.weights",
        str(model),
        str(port),
        str(receivers + 1),
        str(rounds),
    ]
    procs = [
        subprocess.Popen([*command, str(rank)], stdout=subprocess.PIPE, text=True) for rank in range(receivers + 1)
    ]
    outputs = [proc.communicate(timeout=BARE_TIMEOUT_S)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"the bare gloo broadcast failed (exit codes {[p.returncode for p in procs]})")
    times = json.loads(outputs[0])
    return _median(times[1:] or times)


def _bare_rank(model: str, port: int, world_size: int, rounds: int, rank: int) -> None:
    """One rank of the bare broadcast; rank 0 prints its times (JSON)."""
    tensors = list(load_file(str(Path(model) / "model.safetensors")).values())
    if rank:
        tensors = [torch.empty_like(t) for t in tensors]
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, world_size, rank == 0, timeout=datetime.timedelta(seconds=BARE_TIMEOUT_S)
    )
    spec = TransferGroup(
        group_id="bare",
        master_addr="127.0.0.1",
        master_port=port,
        token="bare",
        world_size=world_size,
        timeout_s=BARE_TIMEOUT_S,
    )
    group = join_group(spec, rank, "127.0.0.1", store)
    times = []
    for _ in range(rounds):
        group.broadcast(torch.zeros(1), 0).wait()  # every rank is ready
        started = time.perf_counter()
        for tensor in tensors:
            group.broadcast(tensor, 0).wait()
        times.append(time.perf_counter() - started)
    if rank == 0:
        print(json.dumps(times))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def report(figures: WeightFigures, command: str = "rollout-svc bench") -> list[str]:
    """The report's weight-sync section (markdown lines), `command` the one that measured it."""
    f = figures
    goals = [
        ("time paused <= load + 50 ms (transfer outside the pause)", f.paused_s, f.load_s + 0.05),
        (
            "felt by an in-flight request (its longest wait for a token) <= time paused + 100 ms",
            f.felt_s,
            f.felt_paused_s + 0.1,
        ),
    ]
    return [
        "",
        "## (e) Weight sync, vLLM",
        "",
        f"Command: `{command}`.",
        f"`WeightSender.update` of SmolLM2-135M's own tensors ({f.tensors} tensors, {f.model_bytes / 1e6:.0f} MB in"
        f" float32, {f.buckets} buckets) into {f.workers} float32 vLLM workers over gloo, keep-pause, {f.syncs} syncs"
        " with the transfer outside the pause (the default: the workers receive while they generate, the fleet pauses"
        f" for the load) alternated with {f.syncs} with it inside (`pause_during_transfer=True`, as before);"
        " the peer is a bare `ProcessGroupGloo` broadcast of the same tensors (one broadcast per tensor) from rank 0 to"
        f" {f.workers} receiver processes (the median of {BARE_ROUNDS - 1} rounds into warm receiving tensors),"
        " alternated with the syncs in the same run. GB/s = bytes / seconds from the"
        " first broadcast to the last. Goal: transfer GB/s >= 0.8 x the bare broadcast's.",
        "",
        "| sync total (s) | paused (s) | paused / total | pause command (s) | join (s) | pack (s) | transfer (s)"
        " | load + prefix-cache reset (s) | transfer GB/s | bare gloo GB/s | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {f.sync_s:.2f} | {f.paused_s:.3f} | {f.paused_s / f.sync_s:.2f} | {f.pause_s:.3f} | {f.join_s:.3f} |"
        f" {f.pack_s:.3f} | {f.transfer_s:.3f} | {f.load_s:.2f} | {f.gb_per_s:.2f} | {f.bare_gb_per_s:.2f} |"
        f" {f.ratio:.2f} |",
        "",
        "The same syncs with the transfer inside the pause (`pause_during_transfer=True`), medians:",
        "",
        "| sync total (s) | paused (s) | paused / total | transfer (s) |",
        "|---:|---:|---:|---:|",
        f"| {f.inside_sync_s:.2f} | {f.inside_paused_s:.3f} | {f.inside_paused_s / f.inside_sync_s:.2f} |"
        f" {f.inside_transfer_s:.3f} |",
        "",
        f"The pause an in-flight request feels: a greedy request of {FELT_TOKENS} tokens ({f.unsynced_s:.2f} s alone,"
        f" {f.token_s * 1000:.0f} ms a token, medians), streamed a token at a time, with a sync issued a third of the"
        " way in, alternated with the same request alone. Felt = the longest it waited for a token across the sync"
        " (the pause's propagation, the time paused, and recomputing its KV cache under the new weights after the"
        " prefix-cache reset) less its time per token alone; added = its latency less that of the run alone just"
        " before (felt, plus the tokens made slower while the transfer shares the machine's 2 CPUs with"
        " generation); next token after the resume = from the sync's return (resumed and committed) to the request's"
        f" next token (its KV cache recomputed, then a step). Medians of {FELT_PAIRS} pairs.",
        "",
        "| felt by the request (s) | latency added (s) | its syncs' time (s) | their time paused (s)"
        " | felt - paused (ms) | next token after the resume (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {f.felt_s:.2f} | {f.added_s:.2f} | {f.felt_sync_s:.2f} | {f.felt_paused_s:.2f} |"
        f" {(f.felt_s - f.felt_paused_s) * 1000:.0f} | {f.after_s * 1000:.0f} |",
        "",
        "The issue's goals, beside the figures (not asserted):",
        "",
        "| goal | value (s) | bound (s) | met |",
        "|---|---:|---:|---|",
        *(
            f"| {what} | {value:.3f} | {bound:.3f} | {'yes' if value <= bound else 'no'} |"
            for what, value, bound in goals
        ),
        f"| transfer GB/s >= 0.8 x bare gloo | {f.ratio:.2f} (ratio) | 0.80 | {'yes' if f.ratio >= 0.8 else 'no'} |",
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one rank of the bare gloo broadcast of the weight-sync benchmark")
    parser.add_argument("model")
    parser.add_argument("port", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("rounds", type=int)
    parser.add_argument("rank", type=int)
    arguments = parser.parse_args()
    _bare_rank(arguments.model, arguments.port, arguments.world_size, arguments.rounds, arguments.rank)
