"""`rollout-svc bench`, section (o): one Redis for a fleet of W simulated GPUs, W from 4 to 1,024, and the largest
fleet again over the shards of a Redis Cluster.

Each row starts a fresh fleet of sim-engine workers (`--engine sim`, workers/sim: `per_process` simulated H100s to a
worker process, each a worker of its own, a simulated second lasting 1 / `time_scale` s) on a private Redis, and
measures what the fleet costs the one process every producer and worker shares:
- Redis CPU per request: the Redis process's CPU time (`INFO cpu`, user + system) over a run of `requests` requests
  (half of them new sessions, half without one: one `generate` call of each kind at a time), less what the idle
  fleet costs it over as long (the heartbeats, measured just before), over the requests; and the Redis commands a
  request costs (`INFO commandstats`, scripts' inner calls included). The requests a second one Redis primary could
  serve at that cost is 10^6 / that.
- The idle fleet's cost (heartbeats, load reports, blocked reads): Redis cores and commands a second.
- Control: `cycles` keep-pauses and resumes, each timed from the call to the last worker's acknowledgement (p50,
  p99).
- A weight version committed by checkpoint (`WeightSender.update_from_checkpoint` of a one-tensor checkpoint: the
  sim engines load it as the echo engine does, by reading it whole), timed from the call to the commit (median of
  `syncs`).
- Placement of an under-capacity batch: 2 x W equal requests in one call; the most any worker served over the even
  share (max / ideal).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import struct
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rich.console import Console

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.client.weight_sender import WeightSender
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.deploy.redis_cluster import cluster_ports, free_cluster_ports
from rollout_svc.tools.bench.control import pause_cycles
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import percentile, private_settings

HEADING = "## (o) Fleet scale: one Redis for up to 1,024 simulated GPUs"
PLOT = "fleet-scale.png"


@dataclass(frozen=True)
class ScalePlan:
    """The fleets a run measures. `cluster_shards`: the largest fleet again on a Redis Cluster of that many
    primaries (0: not)."""

    fleets: tuple[int, ...] = (4, 64, 256, 1024)
    per_process: int = 64
    requests: int = 1000
    batch: int = 50  # requests a call
    cycles: int = 10
    syncs: int = 2
    cluster_shards: int = 3
    time_scale: float = 100.0
    max_tokens: int = 16
    idle_s: float = 4.0
    # An idle worker's blocking reads end this often to look around: at the default 100 ms, 1,024 simulated workers'
    # wake-ups alone held this 2-core host's 16 worker processes busy (a request took seconds). A blocked read returns
    # at once when an entry comes, and a pause unblocks it (`CLIENT UNBLOCK`): what it costs is only idle polling.
    read_block_ms: int = 1000
    heartbeat_interval_s: float = 3.0  # 1 s by default: 1,024 workers' heartbeats, load reports and reap passes
    heartbeat_ttl_s: float = 30.0


@dataclass
class ScaleRow:
    workers: int
    shards: int
    us_new_session: float  # Redis CPU microseconds a request, idle cost taken off
    us_plain: float
    commands_new_session: float
    commands_plain: float
    idle_cores: float  # Redis CPU seconds a second of the idle fleet
    idle_commands_per_s: float
    pause_p50_ms: float
    pause_p99_ms: float
    resume_p50_ms: float
    resume_p99_ms: float
    commit_s: float
    max_over_ideal: float
    # The idle fleet's cost over the run's duration came to what the run measured, or more (its worker processes,
    # not Redis, set the pace on a host too small for the fleet): the figures are the run's whole cost then.
    uncorrected: bool = False

    @property
    def requests_per_s(self) -> float:
        """What one Redis primary (one core) could serve at this cost, new sessions and plain requests half each."""
        us = (self.us_new_session + self.us_plain) / 2 / max(self.shards, 1)
        return 1e6 / us if us > 0 else float("inf")


@dataclass
class ScaleRun:
    plan: ScalePlan
    rows: list[ScaleRow] = field(default_factory=list)
    command: str = ""
    plot: str = ""
    failed: list[tuple[int, int, str]] = field(default_factory=list)  # (workers, shards, what went wrong)


class _RedisMeter:
    """CPU seconds and commands of the Redis servers behind a deployment (each node of a cluster)."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [redis.Redis.from_url(url) for url in urls]

    def read(self) -> tuple[float, int]:
        cpu, calls = 0.0, 0
        for client in self.clients:
            info = client.info("cpu")
            cpu += info["used_cpu_user"] + info["used_cpu_sys"]
            calls += sum(v["calls"] for v in client.info("commandstats").values())
        return cpu, calls

    def close(self) -> None:
        for client in self.clients:
            client.close()


def run_scale_bench(
    redis_url: str | None, console: Console, log_dir: Path, plan: ScalePlan | None = None, command: str = ""
) -> ScaleRun:
    """Measure every fleet of `plan` (and the largest on a cluster), each on a fresh private Redis."""
    plan = plan or ScalePlan()
    run = ScaleRun(plan, command=command)
    shapes = [(w, 1) for w in plan.fleets] + ([(max(plan.fleets), plan.cluster_shards)] if plan.cluster_shards else [])
    for workers, shards in shapes:
        try:
            with Progress(None, f"bench (o) fleet scale, {workers} simulated GPUs on {shards} Redis"):
                row = _measure_fleet(redis_url, plan, workers, shards, log_dir / f"scale-{workers}-{shards}")
        except Exception as exc:  # a fleet this host could not run: said in the section, the other rows kept
            run.failed.append((workers, shards, f"{type(exc).__name__}: {exc}"))
            console.print(f"fleet of {workers} on {shards} Redis did not finish: {exc!r}")
            continue
        console.print(row)
        run.rows.append(row)
    return run


def _measure_fleet(redis_url: str | None, plan: ScalePlan, workers: int, shards: int, log_dir: Path) -> ScaleRow:
    settings = private_settings(None if shards > 1 else redis_url, "bench-scale")
    urls = [settings.redis_url]
    if shards > 1:  # the cluster's bus ports (+10000) must stay under 65536
        urls = [f"redis://127.0.0.1:{port}/0" for port in cluster_ports(free_cluster_ports(shards), shards)]
        settings = settings.copy_with(redis_url=urls[0])
    root = Path(tempfile.mkdtemp(prefix="rollout-scale-"))
    settings = settings.copy_with(
        checkpoint_root=root,
        control_timeout_s=120.0,
        weight_sync_timeout_s=120.0,
        read_block_ms=plan.read_block_ms,
        heartbeat_interval_s=plan.heartbeat_interval_s,
        heartbeat_ttl_s=plan.heartbeat_ttl_s,
    )
    per_process = min(plan.per_process, workers)
    processes = -(-workers // per_process)
    engine = EngineSettings(engine="sim", sim_engines=per_process, sim_time_scale=plan.time_scale)
    cluster = LocalCluster(settings, processes, engine, log_dir=log_dir, redis_cluster=shards if shards > 1 else 0)
    with cluster.running(ready_timeout_s=600):
        meter = _RedisMeter(urls)
        try:
            return asyncio.run(_measure(settings, plan, workers, shards, meter, root))
        finally:
            meter.close()


async def _measure(
    settings: Settings, plan: ScalePlan, workers: int, shards: int, meter: _RedisMeter, root: Path
) -> ScaleRow:
    params = {"max_tokens": plan.max_tokens, "temperature": 0.0}
    async with RolloutClient(settings) as client:
        deadline = time.monotonic() + 300
        while len(await client.workers()) < workers and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await client.generate([[1, 2, 3]] * plan.batch, params)  # warm-up: scripts, connections
        cpu, calls = meter.read()
        await asyncio.sleep(plan.idle_s)
        idle_cpu, idle_calls = meter.read()
        idle_cores, idle_rate = (idle_cpu - cpu) / plan.idle_s, (idle_calls - calls) / plan.idle_s
        us, commands, uncorrected = {}, {}, False
        for kind in ("session", "plain"):
            cpu, calls = meter.read()
            started = time.monotonic()
            for start in range(0, plan.requests // 2, plan.batch):
                sessions = [f"{kind}-{start}-{i}" for i in range(plan.batch)] if kind == "session" else None
                await client.generate([[1, 2, 3, start % 97]] * plan.batch, params, sessions)
            elapsed = time.monotonic() - started
            cpu_after, calls_after = meter.read()
            n = plan.requests // 2
            us[kind] = max(0.0, (cpu_after - cpu) - idle_cores * elapsed) / n * 1e6
            commands[kind] = max(0.0, (calls_after - calls) - idle_rate * elapsed) / n
            if commands[kind] <= 0 or us[kind] <= 0:  # the idle fleet's cost over as long swamps the run's
                us[kind], commands[kind] = (cpu_after - cpu) / n * 1e6, (calls_after - calls) / n
                uncorrected = True
        pauses, resumes = await pause_cycles(client, plan.cycles)
        batch = await client.generate([[7, 8, 9]] * (2 * workers), params)
        served = Counter(t.worker_id for t in batch)
        max_over_ideal = max(served.values()) / (len(batch) / workers)
    commits = []
    async with WeightSender(settings=settings) as sender:
        base = await sender.committed_version()
        for k in range(plan.syncs):
            checkpoint = _checkpoint(root / f"step-{k}", float(k))
            started = time.perf_counter()
            await sender.update_from_checkpoint(str(checkpoint), version=base + k + 1)
            commits.append(time.perf_counter() - started)
    return ScaleRow(
        workers=workers,
        shards=shards,
        us_new_session=us["session"],
        us_plain=us["plain"],
        commands_new_session=commands["session"],
        commands_plain=commands["plain"],
        idle_cores=idle_cores,
        idle_commands_per_s=idle_rate,
        pause_p50_ms=_ms(pauses, 50),
        pause_p99_ms=_ms(pauses, 99),
        resume_p50_ms=_ms(resumes, 50),
        resume_p99_ms=_ms(resumes, 99),
        commit_s=statistics.median(commits) if commits else float("nan"),
        max_over_ideal=max_over_ideal,
        uncorrected=uncorrected,
    )


def _ms(seconds: list[float], q: int) -> float:
    """Percentile `q` of `seconds`, in milliseconds."""
    return percentile(sorted(seconds), q) * 1000.0


def _checkpoint(folder: Path, value: float) -> Path:
    """A one-tensor checkpoint (`model.safetensors`, written by hand: the format is 8 bytes of header length, the
    JSON header, the data; no torch needed)."""
    folder.mkdir(parents=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<f", value))
    return folder


def draw_scale(run: ScaleRun, path: Path) -> str:
    """Each figure of the one-Redis rows against W (log scale), one panel each; writes the PNG at `path` (matplotlib,
    Agg) and returns its file name. Raises ImportError without matplotlib (the dev extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in run.rows if r.shards == 1]
    ws = [r.workers for r in rows]
    panels: list[tuple[str, list[tuple[float, ...]], tuple[str, ...]]] = [
        ("Redis CPU us / request", [(r.us_new_session, r.us_plain) for r in rows], ("new session", "no session")),
        ("Redis commands / request", [(r.commands_new_session, r.commands_plain) for r in rows], ("new", "none")),
        ("pause ack ms (p50, p99)", [(r.pause_p50_ms, r.pause_p99_ms) for r in rows], ("p50", "p99")),
        ("idle fleet: Redis cores", [(r.idle_cores,) for r in rows], ("heartbeats",)),
        ("version commit s", [(r.commit_s,) for r in rows], ("checkpoint",)),
        ("placement max / ideal", [(r.max_over_ideal,) for r in rows], ("2W requests",)),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (title, values, labels) in zip(axes.flat, panels, strict=True):
        for i, label in enumerate(labels):
            ax.plot(ws, [v[i] for v in values], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ws, [str(w) for w in ws])
        ax.set_title(title)
        ax.set_xlabel("simulated GPUs (workers) on one Redis")
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name


def render_scale(run: ScaleRun) -> str:
    """The section's markdown."""
    p = run.plan
    lines = [
        HEADING,
        "",
        f"Sim-engine workers (`--engine sim`: {p.per_process} simulated H100s to a worker process, each a worker of "
        f"its own; a simulated second lasts 1/{p.time_scale:g} s), a fresh fleet and a private Redis per row. Redis "
        f"CPU per request: the Redis process's CPU time (`INFO cpu`) over {p.requests:,} requests ({p.batch} a "
        "`generate` call, half of them new sessions), less the idle fleet's over as long, over the requests; "
        "commands from `INFO commandstats` (scripts' inner calls included). Requests a second: what one Redis "
        f"primary (one core) serves at that cost. Pause and resume: {p.cycles} keep-pauses, from the call to the last "
        "worker's acknowledgement. Commit: `update_from_checkpoint` of a one-tensor checkpoint, call to commit "
        f"(median of {p.syncs}). Placement: 2 x W equal requests in one call, the most any worker served over the "
        f"even share. Blocking reads of {p.read_block_ms} ms (`read_block_ms`; 100 by default) and heartbeats every "
        f"{p.heartbeat_interval_s:g} s (1 by default): at the defaults, 1,024 simulated workers' idle wake-ups alone "
        "kept this host's worker processes busy.",
        "",
        "| simulated GPUs | Redis | Redis us per request (new session / none) | commands per request (new / none) "
        "| requests/s one primary serves | idle fleet: Redis cores, commands/s | pause ack p50 / p99 ms "
        "| resume p50 / p99 ms | version commit s | placement max/ideal |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in run.rows:
        where = "one" if r.shards == 1 else f"{r.shards}-shard cluster"
        primaries = "" if r.shards == 1 else f" ({r.shards} primaries)"
        mark = " (whole)" if r.uncorrected else ""
        lines.append(
            f"| {r.workers:,} | {where} | {r.us_new_session:.0f} / {r.us_plain:.0f}{mark} "
            f"| {r.commands_new_session:.1f} / {r.commands_plain:.1f}{mark} | {r.requests_per_s:,.0f}{primaries} "
            f"| {r.idle_cores:.2f}, {r.idle_commands_per_s:,.0f} | {r.pause_p50_ms:.0f} / {r.pause_p99_ms:.0f} "
            f"| {r.resume_p50_ms:.0f} / {r.resume_p99_ms:.0f} | {r.commit_s:.2f} | {r.max_over_ideal:.2f} |"
        )
    for workers, shards, what in run.failed:
        where = "one Redis" if shards == 1 else f"a {shards}-shard cluster"
        lines.append(f"| {workers:,} | {where}: did not finish on this host ({what}) | | | | | | | | |")
    if any(r.uncorrected for r in run.rows):
        lines += [
            "",
            "(whole): the idle fleet's cost over the run's duration came to what the run measured or more (the host's "
            "worker processes, not Redis, set the pace): the run's whole cost per request, idle polling included.",
        ]
    single = [r for r in run.rows if r.shards == 1]
    if len(single) >= 2:
        small, large = single[0], single[-1]
        ratio_new = large.us_new_session / small.us_new_session if small.us_new_session else float("nan")
        ratio_plain = large.us_plain / small.us_plain if small.us_plain else float("nan")
        if large.uncorrected or small.uncorrected:
            ratio_line = (
                f"Redis us per request at {large.workers:,} workers over {small.workers:,}: not comparable in this run "
                "(a row marked (whole) holds the idle fleet's polling too; goal: within 1.5x)."
            )
        else:
            ratio_line = (
                f"Redis us per request at {large.workers:,} workers over {small.workers:,}: {ratio_new:.2f}x for new "
                f"sessions, {ratio_plain:.2f}x without (goal: within 1.5x; the idle fleet's own cost is taken off)."
            )
        lines += ["", ratio_line]
    if run.plot:
        lines += ["", f"![each figure against the fleet's size]({run.plot}) ([{run.plot}]({run.plot}))"]
    lines += ["", f"Command: `{run.command or 'rollout-svc bench --only scale'}`", ""]
    return "\n".join(lines)
