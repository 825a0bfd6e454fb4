"""`rollout-svc bench --only beside`: the hop's cost beside an earlier commit of this project, in one run.

What a change to the data plane costs Redis and the workers is read against the code before it, measured the same
way in the same run (these machines are shared and noisy): the earlier commit's tree is taken out of this checkout's
git history (`git archive`) and both trees run in turn, each with its own code end to end: its `rollout-svc up` (W
echo workers, no token delay) on a private redis-server, and one `RolloutClient` process of its own keeping K
single-prompt `generate` calls in flight (8 prompt tokens, 16 out) for N requests after a warm-up. Per request:
Redis CPU (`INFO cpu`, user + system), Redis commands and their microseconds (`INFO commandstats`, a script's inner
calls included), the workers' CPU (user + system, every worker process) and the client's. At the largest fleet this
tree is measured again at larger read-aheads (`ROLLOUT_READ_AHEAD`: a woken worker takes that many entries before
its share is weighed), so the price of spreading the requests over the workers is read in the same run; and the
earlier tree again with each worker's capacity at K / W (`--max-num-seqs`, "split"): every worker then holds its
share of what is in flight, as a balanced placement spreads it, which is what the split alone costs the earlier
code. Then, in a pass of its own (logging costs Redis time), what the commands' time goes to by script: SLOWLOG
logging every command, each script call's time (its inner calls included), inner calls and the requests it carried.

The measuring program is version-agnostic: it uses only `RolloutClient(redis_url=...)` and `generate`, which every
commit since the first slice has.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import psutil
from rich.console import Console

from rollout_svc.deploy.local import PrivateRedis
from rollout_svc.deploy.processes import free_port
from rollout_svc.tools.progress import Progress

HEADING = "## (p) The hop's cost beside an earlier commit"
DEFAULT_COMMIT = "ed982d0"  # the code before placement by cost (issue 43's measure)
LEAST_CALLS = 0.002  # calls a request: a script called less (twice in 1,000 requests) is left out of (p)'s table
SPLIT = "earlier/split"  # the earlier tree, each worker's capacity at in_flight / W (`BesidePlan.split`)
FIGURES = ("requests_per_s", "redis_us", "commands", "command_us", "scripts", "workers_us", "client_us")

# Run in each tree's own interpreter path: argv url, requests, in flight; env WORKER_PIDS. Prints one JSON line.
CLIENT = r"""
import asyncio, json, os, sys, time
import psutil, redis
from rollout_svc import RolloutClient

url, requests, in_flight, profiled = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rds = redis.Redis.from_url(url)
workers = [psutil.Process(int(p)) for p in os.environ["WORKER_PIDS"].split(",")]
prompt, params = list(range(1, 9)), {"max_tokens": 16}


def redis_cpu():
    info = rds.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def workers_cpu():
    return sum(t.user + t.system for t in (w.cpu_times() for w in workers))


def script_names():
    # {sha1: name} of every data-plane script this tree has (`X_LUA` strings of its modules, wherever they live)
    import hashlib, importlib
    names = {}
    for module in ("rollout_svc.dataplane.take", "rollout_svc.dataplane.scripts", "rollout_svc.dataplane.placement",
                   "rollout_svc.stream_scripts"):
        try:
            found = vars(importlib.import_module(module))
        except ImportError:
            continue
        for name, text in found.items():
            if name.endswith("_LUA") and isinstance(text, str):
                names[hashlib.sha1(text.encode()).hexdigest()] = name[:-4].lower()
    return names


def by_script(log, sent):
    # {script: [calls, microseconds, inner calls] per request} from SLOWLOG entries, oldest first: a script's time
    # includes its inner calls', which are logged just before it, from no client address ("?:0"). "plain": the
    # commands sent on their own.
    names, found, inner = script_names(), {}, 0
    for e in sorted(log, key=lambda e: e["id"]):
        words = e["command"].split()
        if e.get("client_address") == b"?:0":
            inner += 1
            continue
        if words[0].upper() == b"SLOWLOG":
            continue
        name = names.get(words[1].decode(), "other script") if words[0].upper() == b"EVALSHA" else "plain"
        figures = found.setdefault(name, [0.0, 0.0, 0.0])
        figures[0] += 1 / sent
        figures[1] += e["duration"] / sent
        figures[2] += inner / sent
        inner = 0
    return found


async def main():
    async with RolloutClient(redis_url=url) as client:
        await client.generate([prompt] * 200, params)
        for _ in range(300):
            await client.generate([prompt], params)
        rds.config_resetstat()
        before = (redis_cpu(), workers_cpu(), time.process_time(), time.perf_counter())
        sent = 0

        async def lane(limit):
            nonlocal sent
            while sent < limit:
                sent += 1
                [trajectory] = await client.generate([prompt], params)
                assert trajectory.finish_reason in ("stop", "length"), trajectory

        await asyncio.gather(*(lane(requests) for _ in range(in_flight)))
        after = (redis_cpu(), workers_cpu(), time.process_time(), time.perf_counter())
        stats = rds.info("commandstats")
        measured, sent = sent, 0
        rds.config_set("slowlog-max-len", 1000000)
        rds.config_set("slowlog-log-slower-than", 0)  # every command logged: a pass of its own, after the measure
        rds.slowlog_reset()
        await asyncio.gather(*(lane(profiled) for _ in range(in_flight)))
        rds.config_set("slowlog-log-slower-than", 10000)
        scripts = by_script(rds.slowlog_get(1000000), sent)
        sent = measured
        us = 1e6 / sent
        print(json.dumps({
            "by_script": scripts,
            "requests_per_s": sent / (after[3] - before[3]),
            "redis_us": (after[0] - before[0]) * us,
            "commands": sum(v["calls"] for k, v in stats.items() if "config" not in k) / sent,
            "command_us": sum(v["usec"] for k, v in stats.items() if "config" not in k) / sent,
            "scripts": stats.get("cmdstat_evalsha", {}).get("calls", 0) / sent,
            "workers_us": (after[1] - before[1]) * us,
            "client_us": (after[2] - before[2]) * us,
        }))


asyncio.run(main())
"""


@dataclass(frozen=True)
class BesidePlan:
    """The earlier commit, the fleets (echo workers), requests in flight, requests per measure and rounds (the two
    trees in turn, the earlier one first in odd rounds)."""

    commit: str = DEFAULT_COMMIT
    workers: tuple[int, ...] = (2, 4)
    in_flight: int = 64
    requests: int = 4000
    rounds: int = 3
    profiled: int = 1000  # requests of the SLOWLOG pass after each measure (what each script costs)
    # This tree again at the largest fleet, at each of these read-aheads (`ROLLOUT_READ_AHEAD`: entries a woken worker
    # takes before its share is weighed; 2 by default): what spreading the requests over the workers costs per request.
    read_aheads: tuple[int, ...] = (16, 64)
    # The earlier tree again at the largest fleet, each worker's capacity at in_flight / W (`--max-num-seqs`): every
    # worker holds its share of what is in flight, as a balanced placement spreads it ("earlier/split").
    split: bool = True

    def sides(self, workers: int) -> list[str]:
        """The sides measured at `workers`, in a round's order: the earlier tree, this one, and at the largest fleet
        this one at each read-ahead (`"this@16"`) and the earlier one split (`"earlier/split"`)."""
        largest = workers == max(self.workers)
        extra = [f"this@{n}" for n in self.read_aheads] if largest else []
        extra += [SPLIT] if largest and self.split else []
        return ["earlier", "this", *extra]

    def capacity(self, side: str, workers: int) -> int:
        """Each worker's capacity on `side` at `workers`: in_flight / W (rounded up) split, else 0 (its default)."""
        return -(-self.in_flight // workers) if side == SPLIT else 0


@dataclass
class BesideRun:
    """Each side's rounds at each fleet: {"this", "earlier" or "this@N" (read-ahead N): {workers: [figures per
    round]}}, and what each round's commands' time went to by script (`scripts`, the same shape)."""

    plan: BesidePlan
    command: str
    this_commit: str
    earlier_commit: str
    rounds: dict[str, dict[int, list[dict[str, float]]]] = field(default_factory=dict)
    scripts: dict[str, dict[int, list[dict[str, list[float]]]]] = field(default_factory=dict)  # by round, as rounds

    def median_of(self, side: str, workers: int, figure: str) -> float:
        return median(r[figure] for r in self.rounds[side][workers])

    def scripts_of(self, side: str, workers: int) -> dict[str, list[float]]:
        """{script: [calls, microseconds, inner calls] per request}, each the median of the rounds (0 in a round
        that did not call it)."""
        rounds = self.scripts[side][workers]
        names = sorted({name for r in rounds for name in r})
        return {name: [median(r.get(name, [0.0] * 3)[i] for r in rounds) for i in range(3)] for name in names}

    def ratios(self, workers: int, figure: str, side: str = "this", against: str = "earlier") -> list[float]:
        """`side`'s figure over `against`'s (the earlier tree's, by default), round by round."""
        pairs = zip(self.rounds[side][workers], self.rounds[against][workers], strict=True)
        return [mine[figure] / theirs[figure] for mine, theirs in pairs if theirs[figure]]


def project_root() -> Path:
    """The checkout this package runs from (its git history holds the earlier commit). `RuntimeError` if it is not
    a git checkout (an installed wheel): run the bench from a clone."""
    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        raise RuntimeError(f"{root} is not a git checkout: run `rollout-svc bench --only beside` from a clone")
    return root


def resolve(root: Path, commit: str) -> str:
    """`commit`'s full id in the checkout at `root`. `RuntimeError` naming it if the history lacks it."""
    found = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise RuntimeError(f"commit {commit!r} is not in {root}'s history (a shallow clone? `git fetch --unshallow`)")
    return found.stdout.strip()


def export_tree(root: Path, commit: str, into: Path) -> Path:
    """`commit`'s files (`git archive`) extracted under `into`. Returns the tree's root."""
    tree = into / commit[:12]
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", commit], capture_output=True, check=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(tree, filter="data")
    return tree


def run_beside_bench(
    console: Console, log_dir: Path, plan: BesidePlan | None = None, command: str = "rollout-svc bench"
) -> BesideRun:
    """Measure this tree and `plan.commit`'s in turn (`BesidePlan`). Every process it starts is stopped on return."""
    plan = plan or BesidePlan()
    root = project_root()
    earlier = resolve(root, plan.commit)
    this = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout[:7]
    # changes not committed yet, other than what the bench writes itself (an earlier section of the same run)
    changed = ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "."]
    dirty = subprocess.run([*changed, ":!BENCHMARKS.md", ":!*.png"], capture_output=True)
    this += "+" if dirty.stdout.strip() else ""
    sides = {side for workers in plan.workers for side in plan.sides(workers)}
    run = BesideRun(plan, command, this, earlier[:7], {s: {} for s in sides}, {s: {} for s in sides})
    with tempfile.TemporaryDirectory(prefix="rollout-bench-beside-") as tmp:
        trees = {"this": root, "earlier": export_tree(root, earlier, Path(tmp))}
        for n in range(plan.rounds):
            for workers in plan.workers:
                order = plan.sides(workers)
                for side in order if n % 2 == 0 else order[::-1]:
                    tree, read_ahead = tree_of(side), read_ahead_of(side)
                    title = f"bench (p) beside {run.earlier_commit}: round {n + 1}, {workers} workers, {side} tree"
                    with Progress(None, title):
                        log = log_dir / f"{side.replace('@', '-ra').replace('/', '-')}-{workers}-{n}.log"
                        capacity = plan.capacity(side, workers)
                        figures = measure(trees[tree], workers, plan, log, read_ahead, capacity)
                    run.scripts[side].setdefault(workers, []).append(figures.pop("by_script"))
                    run.rounds[side].setdefault(workers, []).append(figures)
    console.print(render_beside(run))
    return run


def measure(
    tree: Path, workers: int, plan: BesidePlan, log: Path, read_ahead: str = "", capacity: int = 0
) -> dict[str, Any]:
    """One measure of one tree (module docstring), its workers at `read_ahead` ('': their default) and `capacity`
    (`--max-num-seqs`; 0: their default). `RuntimeError` with the log's path if its fleet does not come up or its
    client fails."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("ROLLOUT_READ_AHEAD", None)
    if read_ahead:
        env["ROLLOUT_READ_AHEAD"] = read_ahead
    with _private_redis(url), _fleet(tree, url, workers, env, log, capacity) as pids:
        env["WORKER_PIDS"] = ",".join(map(str, pids))
        args = [sys.executable, "-c", CLIENT, url, str(plan.requests), str(plan.in_flight), str(plan.profiled)]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, cwd=tree)
        if done.returncode != 0:
            raise RuntimeError(f"the client of {tree} failed: {done.stderr.strip()[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _private_redis(url: str) -> Iterator[None]:
    redis_server = PrivateRedis(url)
    redis_server.start()
    try:
        yield
    finally:
        redis_server.stop()


@contextlib.contextmanager
def _fleet(
    tree: Path, url: str, workers: int, env: dict[str, str], log: Path, capacity: int = 0
) -> Iterator[list[int]]:
    """`rollout-svc up` of `tree` with `workers` echo workers (each of `capacity`, 0: the default); yields the worker
    processes' ids once each serves (its status lists them all, then a warm-up by the client)."""
    args = [sys.executable, "-m", "rollout_svc", "up", "--redis-url", url, "--workers", str(workers)]
    args += ["--engine", "echo", *(["--max-num-seqs", str(capacity)] if capacity else [])]
    with log.open("wb") as out:
        up = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=tree)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if up.poll() is not None:
                raise RuntimeError(f"`rollout-svc up` of {tree} exited: see {log}")
            status = [sys.executable, "-m", "rollout_svc", "status", "--redis-url", url, "--json"]
            said = subprocess.run(status, env=env, capture_output=True, text=True, cwd=tree)
            with contextlib.suppress(ValueError):
                report = json.loads(said.stdout or "null")
                listed = report.get("workers", []) if isinstance(report, dict) else report or []
                if len(listed) >= workers:
                    break
            time.sleep(1)
        else:
            raise RuntimeError(f"{workers} workers of {tree} did not come up in 180 s: see {log}")
        children = psutil.Process(up.pid).children(recursive=True)
        pids = [p.pid for p in children if any("worker" in part for part in p.cmdline())]
        yield pids
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def render_beside(run: BesideRun) -> str:
    """The section's markdown: each tree's median round at each fleet, and this tree's ratios to the earlier one."""
    p = run.plan
    lines = [
        HEADING,
        "",
        f"Command: `{run.command}`.",
        f"This tree (`{run.this_commit}`) beside commit `{run.earlier_commit}` (`--beside-commit`), each with its own "
        f"code end to end: its `rollout-svc up` with W echo workers (no token delay) on a private redis-server, one "
        f"`RolloutClient` process keeping {p.in_flight} single-prompt `generate` calls in flight (8 tokens in, 16 "
        f"out) for {p.requests:,} requests after a warm-up; the two trees in turn, {p.rounds} rounds (the earlier "
        "first in odd rounds): each figure is the median round, each ratio the median of the rounds' ratios (listed). "
        "Per request: Redis CPU (`INFO cpu`), Redis commands and their microseconds (`INFO commandstats`, scripts' "
        "inner calls included), script calls (EVALSHA: its requests per script call are the batches its enqueues, "
        "takes and publishes carry), the workers' CPU (all of them) and the client's.",
        "",
        "| workers | tree | requests/s | Redis CPU us | Redis commands | commands' us | script calls "
        "| workers' CPU us | client CPU us |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workers in p.workers:
        for side in p.sides(workers):
            name, m = side_name(run, side, workers), {f: run.median_of(side, workers, f) for f in FIGURES}
            lines.append(
                f"| {workers} | {name} | {m['requests_per_s']:,.0f} | {m['redis_us']:.1f} | {m['commands']:.2f} "
                f"| {m['command_us']:.1f} | {m['scripts']:.3f} | {m['workers_us']:.0f} | {m['client_us']:.0f} |"
            )
    lines += [
        "",
        "Each tree over another (the issue's goals: this tree's Redis CPU per request at most 1.0x the earlier one's "
        "at 4 workers, the workers' within 1.1x; at a read-ahead N a woken worker takes N entries before its share is "
        "weighed, `ROLLOUT_READ_AHEAD`, 2 by default; split: the earlier tree with each worker's capacity at "
        f"{p.in_flight} / W, so that every worker holds its share of what is in flight, as a balanced placement "
        "spreads it):",
        "",
        "| workers | tree | over | requests/s | Redis CPU per request | workers' CPU per request "
        "| client CPU per request |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for workers in p.workers:
        sides = p.sides(workers)
        pairs = [(side, "earlier") for side in sides[1:]] + ([("this", SPLIT)] if SPLIT in sides else [])
        for side, against in pairs:
            cells = []
            for figure in ("requests_per_s", "redis_us", "workers_us", "client_us"):
                ratios = run.ratios(workers, figure, side, against)
                cells.append(f"{median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})")
            mine, theirs = _ratio_name(run, side, workers), _ratio_name(run, against, workers)
            lines.append(f"| {workers} | {mine} | {theirs} | {' | '.join(cells)} |")
    return "\n".join(lines + render_scripts(run)) + "\n"


def _ratio_name(run: BesideRun, side: str, workers: int) -> str:
    """A side as the ratio table names it: "this" (at a read-ahead), the earlier commit, or it split."""
    if side == SPLIT:
        return f"`{run.earlier_commit}` split ({run.plan.capacity(side, workers)} a worker)"
    if side == "earlier":
        return f"`{run.earlier_commit}`"
    return f"this, read-ahead {read_ahead_of(side)}" if read_ahead_of(side) else "this"


def render_scripts(run: BesideRun) -> list[str]:
    """What Redis's time goes to, by script, in each tree: the lines under the ratios."""
    lines = [
        "",
        f"What the commands' time goes to, by script: after each measure, {run.plan.profiled:,} more requests the same "
        "way with SLOWLOG logging every command (its own pass: logging costs Redis time). A script's time includes "
        "its inner calls; \"plain\": commands sent on their own (the workers' reads, the client's result reads). "
        "Medians of the rounds.",
        "",
        "| workers | tree | what | calls per request | requests per call | inner calls per call | us per call "
        "| us per request |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for workers in run.plan.workers:
        for side in run.plan.sides(workers):
            name, scripts = side_name(run, side, workers), _called(run.scripts_of(side, workers))
            for what, (calls, us, inner) in sorted(scripts.items(), key=lambda kv: -kv[1][1]):
                lines.append(
                    f"| {workers} | {name} | {what} | {calls:.3f} | {1 / calls:.1f} | {inner / calls:.1f} "
                    f"| {us / calls:.1f} | {us:.1f} |"
                )
    if run.plan.workers:
        w = max(run.plan.workers)
        mine, theirs = run.scripts_of("this", w), run.scripts_of("earlier", w)
        logged = {
            side: sum(us for _, us, _ in scripts.values()) for side, scripts in (("this", mine), ("earlier", theirs))
        }
        called = _called(mine)
        costly = max(called, key=lambda k: called[k][1], default=None)
        if costly is not None and theirs:
            calls, us, inner = called[costly]
            lines += [
                "",
                f"At {w} workers the logged commands took {logged['this']:.1f} us per request here against "
                f"{logged['earlier']:.1f} in `{run.earlier_commit}`. The most of it went to `{costly}`: "
                f"{calls:.3f} calls per request ({1 / calls:.1f} requests a call), {us / calls:.1f} us and "
                f"{inner / calls:.1f} inner calls each. Requests a call, here against `{run.earlier_commit}`: "
                + ", ".join(
                    f"{what} {1 / called[what][0]:.1f} / {1 / earlier[0]:.1f}"
                    for what, earlier in sorted(_called(theirs).items())
                    if what in called and what != "plain"
                )
                + ".",
            ]
    return lines


def read_ahead_of(side: str) -> str:
    """The read-ahead a side's workers ran at: N of "this@N", '' (their default) for the others."""
    return side.partition("@")[2]


def tree_of(side: str) -> str:
    """The tree a side runs: "this" or "earlier"."""
    return side.partition("@")[0].partition("/")[0]


def side_name(run: BesideRun, side: str, workers: int) -> str:
    """How a side is named in the tables: the earlier commit (split: with each worker's capacity at `workers`),
    this one, or this one at a read-ahead."""
    if side == "earlier":
        return f"`{run.earlier_commit}`"
    if side == SPLIT:
        return f"`{run.earlier_commit}` (split: capacity {run.plan.capacity(side, workers)} a worker)"
    read_ahead = read_ahead_of(side)
    return f"`{run.this_commit}` (this{f', read-ahead {read_ahead}' if read_ahead else ''})"


def _called(scripts: dict[str, list[float]]) -> dict[str, list[float]]:
    """The scripts called at least `LEAST_CALLS` times a request (a heartbeat or a load report is not)."""
    return {what: figures for what, figures in scripts.items() if figures[0] >= LEAST_CALLS}
