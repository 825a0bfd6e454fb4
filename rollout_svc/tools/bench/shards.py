"""`rollout-svc bench`, scaling over shards: one producer's rate as the echo fleet spreads over 1, 2, 3 shards of a
local 3-primary Redis Cluster (g0, g1, g2 hash to three different primaries), with the CPU each request costs Redis
(INFO cpu, summed over the primaries), the workers (psutil) and the client (this process); optionally `producers`
producer processes at once (`python -m rollout_svc.tools.bench.shards producer N`), and S=1 on one plain redis-server.
At each point every node is flushed and the workers start afresh (`LocalCluster` on the running cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import EngineSettings, Settings, settings_env
from rollout_svc.connections.urls import redis_sync
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.deploy.processes import die_with_parent
from rollout_svc.deploy.redis_cluster import RedisClusterServers, free_cluster_ports
from rollout_svc.tools.bench.router import HOP_PROMPT, CpuMeter, cpu_of, read_meters
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import private_settings

PRIMARIES = 3
WORKER_CAPACITY = 4096  # echo max_num_seqs per worker
PAPER_SHARDS = (1, 4, 16, 64)
ROLES = ("redis", "workers", "client")
PRODUCER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ShardsPlan:
    shard_counts: tuple[int, ...] = (1, 2, 3)
    workers_per_shard: int = 2
    requests: int = 20_000  # per `generate` call
    runs: int = 2  # best of
    producers: int = 2  # producer processes run at once (each one call of `requests`); 0: not measured
    plain_redis: bool = True  # S=1 on one plain redis-server too


@dataclass
class ShardPoint:
    where: str  # "cluster" or "one redis-server"
    shards: int
    workers: int
    requests: int
    elapsed_s: float  # the best run
    cpu_us: dict[str, float]  # redis, workers, client, machine -> CPU microseconds per request (the best run)
    served: dict[str, int]  # shard -> requests its workers answered (every run)
    producers_rate: float | None = None  # `producers` processes together, requests/s
    producers_busy: float | None = None  # CPU cores busy on the whole machine while they ran

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s

    @property
    def cores_busy(self) -> float:  # the CPU cores Redis, the workers and the client kept busy during the best run
        return self.requests_per_s * sum(self.cpu_us[role] for role in ROLES) / 1e6

    @property
    def machine_busy(self) -> float:  # the same for the whole machine (every process, ours or not)
        return self.requests_per_s * self.cpu_us["machine"] / 1e6


@dataclass
class ShardsFigures:
    plan: ShardsPlan
    command: str
    cluster: list[ShardPoint]  # one per plan.shard_counts
    plain: ShardPoint | None = None


def run_shards_bench(
    console: Console, log_dir: Path | None = None, plan: ShardsPlan | None = None, command: str = "rollout-svc bench"
) -> ShardsFigures:
    """Measure every point (see the module); always on a private Redis Cluster (and a private redis-server), whatever
    `--redis-url` says. Every process it started is stopped on return."""
    plan = plan or ShardsPlan()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rollout-bench-shards-"))
    if max(plan.shard_counts) > PRIMARIES:
        raise ValueError(f"at most {PRIMARIES} shards (one per primary), not {max(plan.shard_counts)}")
    engine = EngineSettings(engine="echo", max_num_seqs=WORKER_CAPACITY)
    points = []
    ports = free_cluster_ports(PRIMARIES)
    with RedisClusterServers("127.0.0.1", ports, PRIMARIES, fresh=True) as servers, contextlib.ExitStack() as stack:
        settings = Settings(redis_url=servers.url, key_prefix="bench-shards")
        nodes = [stack.enter_context(servers.client(port)) for port in servers.ports]
        for shards in plan.shard_counts:
            for node in nodes:
                node.flushall()
            workers = shards * plan.workers_per_shard
            cluster = LocalCluster(settings, workers, engine, log_dir=log_dir / f"s{shards}", redis_cluster=shards)
            with Progress(None, f"bench (s) shards: {shards} shards, {workers} echo workers"):
                points.append(_measure(cluster, "cluster", nodes, plan))
            console.print(points[-1])
    plain = None
    if plan.plain_redis:
        one = private_settings(None, "bench-shards").copy_with(redis_data_dir=log_dir / "redis")
        cluster = LocalCluster(one, plan.workers_per_shard, engine, log_dir=log_dir / "plain")
        with Progress(None, f"bench (s) shards: one redis-server, {plan.workers_per_shard} echo workers"):
            plain = _measure(cluster, "one redis-server", None, plan)
        console.print(plain)
    return ShardsFigures(plan, command, points, plain)


def _redis_cpu(nodes: list[redis.Redis]) -> CpuMeter:
    """The Redis servers' own CPU seconds together (INFO cpu: user + system, every thread)."""

    def read() -> float:
        infos: list[Any] = [node.info("cpu") for node in nodes]
        return sum(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]) for info in infos)

    return read


def _machine_busy() -> float:
    """CPU seconds the whole machine has been busy (every CPU, every process: all but idle and iowait)."""
    import psutil

    times = psutil.cpu_times()._asdict()  # on Linux, user and nice include guest and guest_nice
    return sum(times.values()) - sum(times.get(k, 0.0) for k in ("idle", "iowait", "guest", "guest_nice"))


def _measure(cluster: LocalCluster, where: str, nodes: list[redis.Redis] | None, plan: ShardsPlan) -> ShardPoint:
    """Start `cluster` (its Redis too when `nodes`, the Redis servers to meter, is None), run the batched calls, then
    the producer processes; stop what it started."""
    with cluster.running(ready_timeout_s=60), contextlib.ExitStack() as stack:
        shard_of_pid = {p.pid: s for p, s in zip(cluster.processes, cluster.worker_shards(), strict=True)}
        nodes = nodes or [stack.enter_context(redis_sync(cluster.settings.redis_url))]
        meters = {"redis": _redis_cpu(nodes), "workers": cpu_of(list(shard_of_pid)), "client": time.process_time}
        meters["machine"] = _machine_busy  # last: read next to the run's clock at both ends (`_batched_runs`)
        elapsed_s, cpu, served = asyncio.run(_batched_runs(cluster.settings, shard_of_pid, meters, plan))
        producers = _parallel_producers(cluster.settings, plan) if plan.producers else (None, None)
    shards = len(set(shard_of_pid.values()))
    per_request = {role: seconds / plan.requests * 1e6 for role, seconds in cpu.items()}
    return ShardPoint(where, shards, len(shard_of_pid), plan.requests, elapsed_s, per_request, served, *producers)


async def _batched_runs(
    settings: Settings, shard_of_pid: dict[int, str], meters: dict[str, CpuMeter], plan: ShardsPlan
) -> tuple[float, dict[str, float], dict[str, int]]:
    """Best of `plan.runs` batched calls: its duration and CPU seconds by role; requests answered by each shard."""
    params = {"max_tokens": len(HOP_PROMPT)}
    served: Counter[str] = Counter()
    best: tuple[float, dict[str, float]] = (float("inf"), {})
    async with RolloutClient(settings) as client:
        shard_of = {w.worker_id: shard_of_pid.get(w.pid, "?") for w in await client.workers()}
        await client.generate([HOP_PROMPT] * 100, params)  # warm-up: connections, scripts loaded
        for _ in range(plan.runs):
            before, started = read_meters(meters), time.perf_counter()
            trajectories = await client.generate([HOP_PROMPT] * plan.requests, params)
            # Read back in reverse, so the whole machine's meter (read last before) is read first after: both next to
            # the clock. Read after Redis's INFO (which can take 100 ms on a loaded host), it counted the machine's
            # busy time over a window that long beyond the run's, more than its cores could give over the run alone.
            elapsed_s, after = time.perf_counter() - started, read_meters(dict(reversed(meters.items())))
            assert all(t.finish_reason == "stop" for t in trajectories), "an echo request did not finish"
            served.update(shard_of.get(t.worker_id, "?") for t in trajectories)
            if elapsed_s < best[0]:
                best = (elapsed_s, {role: after[role] - before[role] for role in meters})
    return best[0], best[1], dict(served)


def _parallel_producers(settings: Settings, plan: ShardsPlan) -> tuple[float, float]:
    """`plan.producers` producer processes, each connected and warmed up, then released at once to run one call of
    `plan.requests`: all their requests over the span from the first start to the last end, and the whole machine's
    busy cores over that span."""
    env = {**os.environ, **settings_env(settings)}
    args = die_with_parent([sys.executable, "-m", "rollout_svc.tools.bench.shards", "producer", str(plan.requests)])
    children = [
        subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(plan.producers)
    ]
    try:
        for child in children:
            if child.stdout is None or child.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a producer process failed to start (exit status {child.wait()})")
        for child in children:
            if child.stdin is not None:
                child.stdin.write("go\n")
                child.stdin.flush()
        spans = [json.loads(child.communicate(timeout=PRODUCER_TIMEOUT_S)[0]) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    first, last = min(spans, key=lambda s: s["start"]), max(spans, key=lambda s: s["end"])
    span_s = last["end"] - first["start"]
    return sum(s["requests"] for s in spans) / span_s, (last["busy_end"] - first["busy_start"]) / span_s


async def _producer(requests: int) -> None:
    """One producer process (settings from `ROLLOUT_*`): connect, warm up, say `ready`, wait for a line on stdin,
    run one batched call, print its span (unix seconds) and the machine's busy CPU seconds at both ends as JSON."""
    params = {"max_tokens": len(HOP_PROMPT)}
    async with RolloutClient(Settings()) as client:
        await client.generate([HOP_PROMPT] * 100, params)
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        start, busy_start = time.time(), _machine_busy()
        trajectories = await client.generate([HOP_PROMPT] * requests, params)
        end, busy_end = time.time(), _machine_busy()
    assert all(t.finish_reason == "stop" for t in trajectories)
    span = {"requests": len(trajectories), "start": start, "end": end, "busy_start": busy_start, "busy_end": busy_end}
    print(json.dumps(span), flush=True)


# --- the report ----------------------------------------------------------------------------------------------------


def render_shards(f: ShardsFigures) -> str:
    """The report's shards section (markdown): the command, the setup, the table and what the figures mean."""
    plan, base, last, cpus = f.plan, f.cluster[0], f.cluster[-1], os.cpu_count() or 1
    producers = f" Then {plan.producers} producer processes run one such call each, released at once (their requests"
    producers = producers + " over the span from the first start to the last end)." if plan.producers else ""
    lines = [
        "",
        "## (s) Scaling over shards",
        "",
        f"Command: `{f.command}`. One local Redis Cluster of {PRIMARIES} primaries (always private; append-only, fsync"
        " every second; g0, g1, g2",
        f"hash to three different primaries). At S shards: every node flushed, then {plan.workers_per_shard} echo"
        f" workers (16 token ids in, 16 out, capacity {WORKER_CAPACITY:,})",
        "started in each of g0..g(S-1); one `RolloutClient` in this process (unkeyed requests round robin over the"
        " live shards) runs one batched `generate` of",
        f"{plan.requests:,} prompts, best of {plan.runs}.{producers} The last row is S=1 on one plain (non-cluster)"
        " redis-server, same settings.",
        "CPU µs per request over the best call: Redis from INFO cpu (user + system, summed over every primary, idle"
        " ones included), the workers",
        "summed (psutil), the client (this process). Cores busy: requests/s x those three; the machine's: every"
        " process's, ours or not.",
        "",
        "| shards | workers | requests/s | ratio to 1 shard | Redis µs/request | workers µs/request | client µs/request"
        " | cores busy (ours / machine) |"
        + (f" {plan.producers} producers: req/s (machine cores busy) |" if plan.producers else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if plan.producers else ""),
    ]
    for p in [*f.cluster, *([f.plain] if f.plain else [])]:
        lines.append(
            f"| {p.shards if p.where == 'cluster' else f'{p.shards} (one redis-server)'} | {p.workers} |"
            f" {p.requests_per_s:,.0f} | {p.requests_per_s / base.requests_per_s:.2f} | {p.cpu_us['redis']:.1f} |"
            f" {p.cpu_us['workers']:.1f} | {p.cpu_us['client']:.1f} | {p.cores_busy:.2f} / {p.machine_busy:.2f} |"
            + (f" {p.producers_rate or 0:,.0f} ({p.producers_busy or 0:.2f}) |" if plan.producers else "")
        )
    redis_us, others_us = base.cpu_us["redis"], base.cpu_us["workers"] + base.cpu_us["client"]
    ceiling = 1e6 / redis_us
    busy, machine = [p.cores_busy for p in f.cluster], [p.machine_busy for p in f.cluster]
    lines += [
        "",
        f"Measured per-shard cost: one shard's Redis spent {redis_us:.1f} µs of CPU per request (S=1 on the cluster),"
        " so one primary on one core",
        f"tops out near 1e6 / {redis_us:.1f} = {ceiling:,.0f} requests/s. Shards share no keys: what N shards carry on"
        " paper, one primary per core, is N x that:",
        ", ".join(f"N={n}: {n * ceiling:,.0f}" for n in PAPER_SHARDS) + " requests/s, as long as producers and"
        " workers scale out on cores of",
        f"their own: here they cost {others_us:.1f} µs per request together ({others_us / redis_us:.1f}x Redis), one"
        f" client process {base.cpu_us['client']:.1f} µs",
        f"({1e6 / base.cpu_us['client']:,.0f} requests/s per producer core at most). Measured: {last.shards} shards"
        f" gave {last.requests_per_s / base.requests_per_s:.2f}x one shard's rate.",
    ]
    ran = [p for p in f.cluster if p.producers_rate and p.producers_busy]
    full = max(machine + [p.producers_busy or 0.0 for p in ran]) >= 0.9 * cpus
    lines.append(
        f"On this {cpus}-CPU machine the client, the workers and {PRIMARIES} Redis primaries share {cpus} cores: one"
        f" producer kept {min(busy):.2f} to {max(busy):.2f} of them busy with our processes, {min(machine):.2f} to"
        f" {max(machine):.2f} with everything."
    )
    if ran:
        rates, used = [p.producers_rate or 0.0 for p in ran], [p.producers_busy or 0.0 for p in ran]
        lines.append(
            f"{plan.producers} producer processes at once reached {min(rates):,.0f} to {max(rates):,.0f} requests/s"
            f" ({(ran[-1].producers_rate or 0.0) / ran[-1].requests_per_s:.2f}x one producer at {ran[-1].shards}"
            f" shards), the machine {min(used):.2f} to {max(used):.2f} cores busy."
        )
    lines.append(
        "The cores are full, so the ratio is CPU-bound: it shows contention, not the design's limit."
        if full
        else "The cores are not all busy, so more than CPU contention bounds these rates (a producer's own pace among"
        " it): the ratio shows this machine and this load, not the design's limit."
    )
    if f.plain is not None:
        lines.append(
            f"Cluster mode's own cost: {redis_us:.1f} µs of Redis CPU per request on one shard of the cluster vs"
            f" {f.plain.cpu_us['redis']:.1f} on one redis-server"
            f" ({redis_us / f.plain.cpu_us['redis']:.2f}x); rate {base.requests_per_s / f.plain.requests_per_s:.2f}x."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__" and sys.argv[1:2] == ["producer"]:
    with contextlib.suppress(BrokenPipeError):
        asyncio.run(_producer(int(sys.argv[2])))
