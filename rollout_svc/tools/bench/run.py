"""`rollout-svc bench`: queue overhead (echo engine), generation efficiency (service vs direct vLLM), the
control path (`bench.control`), weight sync (`bench.weights`), the HTTP API beside the Python client (`bench.api`),
batch jobs (`bench.batch`), the hop beside vllm-router (`bench.hop`) and scaling over the shards of a Redis Cluster
(`bench.shards`).

Writes BENCHMARKS.md with the command that produced every figure. Figures are compared as ratios
within one run: these machines are shared and noisy. Each section prints a progress line (`rollout_svc.tools.progress`)
when it starts and ends, and every 5 s while it runs where stdout is not a terminal.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.deploy.local import LocalCluster
from rollout_svc.deploy.processes import cpu_sets
from rollout_svc.tools import dataset
from rollout_svc.tools.bench import api as bench_api
from rollout_svc.tools.bench import batch as bench_batch
from rollout_svc.tools.bench import beside as bench_beside
from rollout_svc.tools.bench import control as bench_control
from rollout_svc.tools.bench import hop as bench_hop
from rollout_svc.tools.bench import scale as bench_scale
from rollout_svc.tools.bench import shards as bench_shards
from rollout_svc.tools.bench import simpublished as bench_published
from rollout_svc.tools.bench import simsessions as bench_sessions
from rollout_svc.tools.bench import simstep as bench_step
from rollout_svc.tools.bench import skyrl as bench_skyrl
from rollout_svc.tools.progress import Progress
from rollout_svc.tools.runs import percentile, private_settings

ECHO_PROMPT = list(range(1, 17))  # 16 tokens in, 16 out
LATENCY_RATE_PER_S = 1000
LATENCY_DURATION_S = 5.0


@dataclass
class QueueFigures:
    workers: int
    requests: int
    requests_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    latency_rate_per_s: float


@dataclass
class GenerationFigures:
    run: int
    service_tokens_per_s: float
    direct_tokens_per_s: float

    @property
    def ratio(self) -> float:
        return self.service_tokens_per_s / self.direct_tokens_per_s


def run_bench(
    redis_url: str | None,
    output: Path,
    model: Path | None,
    requests: int,
    prompts: int,
    max_tokens: int,
    command: str,
    control_cycles: int = 200,
    api_requests: int = 3000,
    api_in_flight: int = 32,
    batch_lines: int = 2000,
) -> None:
    console = Console()
    queue = [_queue_overhead(redis_url, workers, requests, console) for workers in (1, 2)]
    control = [
        bench_control.control_latency(redis_url, workers, control_cycles, _log_dir(), console)
        for workers in bench_control.CONTROL_WORKERS
    ]
    frozen = bench_control.frozen_beyond_pause(redis_url, 10, _log_dir(), console)
    api = bench_api.api_overhead(redis_url, api_requests, api_in_flight, _log_dir(), console)
    batch = bench_batch.batch_overhead(redis_url, batch_lines, _log_dir(), console)
    hop = bench_hop.run_hop_bench(redis_url, console, _log_dir(), command=command)
    skyrl = bench_skyrl.run_skyrl_bench(redis_url, console, _log_dir(), command=command)
    shards_plan = bench_shards.ShardsPlan(requests=requests)
    shards = bench_shards.run_shards_bench(console, _log_dir(), shards_plan, command=command)
    step = bench_step.run_step_bench(redis_url, console, _log_dir(), command=command)
    _draw_timeline(step, output)
    sessions = bench_sessions.run_sessions_bench(redis_url, console, _log_dir(), command=command)
    generation: list[GenerationFigures] = []
    weights: list[str] = []
    if model is not None:
        generation = _generation_efficiency(redis_url, model, prompts, max_tokens, console)
        from rollout_svc.tools.bench import weights as bench_weights  # imports torch

        weights = bench_weights.report(bench_weights.weight_sync(redis_url, model, _log_dir(), console), command)
    text = _report(command, queue, generation, prompts, max_tokens, requests)
    sections = bench_control.report(control, frozen) + weights + bench_api.report(api)
    text += "\n".join(sections + bench_batch.report(batch, command)) + "\n"
    rendered = bench_hop.render_hop(hop) + bench_skyrl.render_skyrl(skyrl) + bench_shards.render_shards(shards)
    rendered += bench_step.render_step(step) + bench_sessions.render_sessions(sessions)
    rendered += bench_published.render_published(bench_published.run_published_bench(), command)
    from rollout_svc.tools.bench import gpu as bench_gpu  # imports torch

    rendered += bench_gpu.render_gpu(bench_gpu.run_gpu_bench(), command)
    output.write_text(text + rendered)
    console.print(f"wrote {output}")


# what `--only` can measure alone: the heading starting its section
SECTIONS = {
    "queue": "## (a) ",
    "hop": "## (h) ",
    "skyrl": "## (i) ",
    "step": "## (j) ",
    "simfit": "## (k) ",
    "sessions": "## (l) ",
    "published": "## (m) ",
    "weights": "## (e) ",
    "gpu": "## (n) ",
    "scale": "## (o) ",
    "beside": "## (p) ",
}


def run_section(
    redis_url: str | None,
    output: Path,
    section: str,
    command: str,
    requests: int = 20_000,
    *,
    scale: bench_scale.ScalePlan | None = None,
    beside: bench_beside.BesidePlan | None = None,
) -> None:
    """Measure one section (`SECTIONS`) and put it in `output` in place of the same section (or after the last one),
    keeping every other section as it was; the section names its own command, and a line under it names the date and
    commit of this run. Raises `ValueError` for an unknown section."""
    if section not in SECTIONS:
        raise ValueError(f"unknown section {section!r}: choose from {', '.join(sorted(SECTIONS))}")
    console = Console()
    if section == "queue":  # `requests` per throughput run, as in the whole report
        queue = [_queue_overhead(redis_url, workers, requests, console) for workers in (1, 2)]
        body = "\n".join(queue_section(queue, requests, command)) + "\n"
    elif section == "hop":
        body = bench_hop.render_hop(bench_hop.run_hop_bench(redis_url, console, _log_dir(), command=command))
    elif section == "step":
        step = bench_step.run_step_bench(redis_url, console, _log_dir(), command=command)
        _draw_timeline(step, output)
        body = bench_step.render_step(step)
    elif section == "sessions":
        run = bench_sessions.run_sessions_bench(redis_url, console, _log_dir(), command=command)
        body = bench_sessions.render_sessions(run)
    elif section == "scale":  # `scale`: the fleets (default `ScalePlan()`)
        fleet = bench_scale.run_scale_bench(redis_url, console, _log_dir(), scale, command=command)
        fleet.plot = _draw_beside(output, lambda path: bench_scale.draw_scale(fleet, path), bench_scale.PLOT)
        body = bench_scale.render_scale(fleet)
    elif section == "beside":  # `beside`: the earlier commit (default `BesidePlan()`)
        body = bench_beside.render_beside(bench_beside.run_beside_bench(console, _log_dir(), beside, command=command))
    elif section == "published":
        body = bench_published.render_published(bench_published.run_published_bench(), command)
    elif section == "weights":
        from rollout_svc.model import prepare_model
        from rollout_svc.tools.bench import weights as bench_weights  # imports torch

        model = prepare_model(Settings().cache_dir)
        figures = bench_weights.weight_sync(redis_url, model, _log_dir(), console)
        body = "\n".join(bench_weights.report(figures, command)) + "\n"
    elif section == "gpu":
        from rollout_svc.tools.bench import gpu as bench_gpu  # imports torch

        body = bench_gpu.render_gpu(bench_gpu.run_gpu_bench(), command)
    elif section == "simfit":
        from rollout_svc.model import prepare_model
        from rollout_svc.tools.bench import simfit as bench_simfit

        model = prepare_model(Settings().cache_dir)
        fit = bench_simfit.run_fit_bench(redis_url, model, console, _log_dir(), command=command)
        body = bench_simfit.render_fit(fit)
    else:
        body = bench_skyrl.render_skyrl(bench_skyrl.run_skyrl_bench(redis_url, console, _log_dir(), command=command))
    when = f"Measured alone on {time.strftime('%Y-%m-%d')} at commit `{_commit()}`, {platform.machine()} with"
    body = body.replace("\nCommand:", f"\n{when} {os.cpu_count()} CPUs.\nCommand:", 1)
    output.write_text(replace_section(output.read_text() if output.exists() else "", SECTIONS[section], body))
    console.print(f"wrote {output} (section {section})")


def _draw_timeline(step: bench_step.StepFigures, output: Path) -> None:
    """Draw the step's timelines beside `output` (and the docs: `_draw_beside`)."""
    step.timeline = _draw_beside(output, lambda path: bench_step.draw_timeline(step, path), "step-timeline.png")


def _draw_beside(output: Path, draw: Callable[[Path], str], name: str) -> str:
    """Draw a figure (`draw(path)` writes the PNG, returns its file name) beside `output` and, where the docs include
    it (`docs/benchmarks-report.md` includes BENCHMARKS.md whole, so its relative link resolves in `docs/`), beside
    the docs too. Returns the file name."""
    drawn = draw(output.parent / name)
    docs = output.parent / "docs"
    if docs.is_dir():
        shutil.copyfile(output.parent / drawn, docs / drawn)
    return drawn


def replace_section(report: str, heading: str, body: str) -> str:
    """`report` with the section starting at the line `heading...` replaced by `body` (up to the next `## ` heading);
    if there is none, `body` goes before the first section whose heading sorts after `heading` (`## (s)` after
    `## (i)`), or at the end."""
    lines = report.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        start = end = next((i for i, line in enumerate(lines) if line.startswith("## ") and line > heading), len(lines))
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    head, body = "".join(lines[:start]).rstrip("\n"), body.strip("\n") + "\n"  # one blank line either side
    return (head + "\n\n" if head else "") + body + ("\n" + "".join(lines[end:]) if end < len(lines) else "")


# --- (a) queue overhead --------------------------------------------------------------------------------------


def _queue_overhead(redis_url: str | None, workers: int, requests: int, console: Console) -> QueueFigures:
    settings = private_settings(redis_url, "bench")
    engine = EngineSettings(engine="echo", max_num_seqs=4096)
    cluster = LocalCluster(settings, workers, engine, log_dir=_log_dir())
    with Progress(None, f"bench (a) queue overhead, {workers} workers"), cluster.running(ready_timeout_s=60):
        figures = asyncio.run(_measure_queue(settings, workers, requests))
    console.print(figures)
    return figures


async def _measure_queue(settings: Settings, workers: int, requests: int) -> QueueFigures:
    params = {"max_tokens": len(ECHO_PROMPT)}
    async with RolloutClient(settings) as client:
        await client.generate([ECHO_PROMPT] * 100, params)  # warm-up: connections, scripts loaded
        best_s = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            trajectories = await client.generate([ECHO_PROMPT] * requests, params)
            best_s = min(best_s, time.perf_counter() - started)
            assert len(trajectories) == requests and all(t.finish_reason == "stop" for t in trajectories)
        latencies_s, achieved = await _open_loop(client, params, LATENCY_RATE_PER_S, LATENCY_DURATION_S)
    latencies_s.sort()
    return QueueFigures(
        workers,
        requests,
        requests / best_s,
        percentile(latencies_s, 50) * 1000,
        percentile(latencies_s, 99) * 1000,
        achieved,
    )


async def _open_loop(client: RolloutClient, params: dict, rate_per_s: float, duration_s: float) -> tuple[list, float]:
    """Send one request every 1/rate s regardless of replies; return each one's added latency and the rate.

    Added latency = end-to-end latency minus the engine's generation time (echo: microseconds).
    """
    latencies_s: list[float] = []

    async def one() -> None:
        started = time.perf_counter()
        [trajectory] = await client.generate([ECHO_PROMPT], params)
        latencies_s.append(time.perf_counter() - started - trajectory.generation_time_s)

    loop = asyncio.get_running_loop()
    count = int(rate_per_s * duration_s)
    start = loop.time()
    tasks = []
    for i in range(count):
        delay = start + i / rate_per_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    achieved = count / (loop.time() - start)
    await asyncio.gather(*tasks)
    return latencies_s, achieved


# --- (b) generation efficiency ---------------------------------------------------------------------------------


def _generation_efficiency(
    redis_url: str | None, model: Path, prompts: int, max_tokens: int, console: Console, repeats: int = 2
) -> list[GenerationFigures]:
    """Service vs direct AsyncLLM, same settings and prompts; alternated so drift hits both alike."""
    engine = EngineSettings(model=str(model), max_num_seqs=prompts)
    conversations = dataset.first_turns(prompts)
    prompt_ids: list[list[int]] = []
    figures = []
    with Progress(2 * repeats, "bench (b) generation efficiency, service and direct vLLM runs") as progress:
        for run in range(1, repeats + 1):
            service, prompt_ids = _service_run(redis_url, engine, conversations, max_tokens)
            progress.advance()
            direct = _direct_run(engine, prompt_ids, max_tokens)
            progress.advance()
            figures.append(GenerationFigures(run, service, direct))
            console.print(figures[-1], f"ratio {figures[-1].ratio:.3f}")
    return figures


def _service_run(
    redis_url: str | None, engine: EngineSettings, conversations: list[list[dict]], max_tokens: int
) -> tuple[float, list[list[int]]]:
    settings = private_settings(redis_url, "bench")
    with LocalCluster(settings, 1, engine, log_dir=_log_dir()).running(ready_timeout_s=900):
        return asyncio.run(_measure_service(settings, conversations, max_tokens))


async def _measure_service(
    settings: Settings, conversations: list[list[dict]], max_tokens: int
) -> tuple[float, list[list[int]]]:
    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}
    async with RolloutClient(settings) as client:
        prompt_ids = await client.apply_chat_template(conversations)
        await client.generate(prompt_ids[:2], {**params, "max_tokens": 4})  # the warm-up `direct --warmup` does
        started = time.perf_counter()
        trajectories = await client.generate(prompt_ids, params)
        elapsed_s = time.perf_counter() - started
    tokens = sum(len(t.completion_token_ids) for t in trajectories)
    return tokens / elapsed_s, prompt_ids


def _direct_run(engine: EngineSettings, prompt_ids: list[list[int]], max_tokens: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file, out_file = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        prompts_file.write_text(json.dumps(prompt_ids))
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpu_sets(1)[0])}
        args = [sys.executable, "-m", "workers.direct", *engine.to_args(), "--prompts-file", str(prompts_file)]
        args += ["--out", str(out_file), "--max-tokens", str(max_tokens), "--temperature", "0", "--ignore-eos"]
        log = Path(tmp) / "direct.log"
        with open(log, "wb") as out:
            done = subprocess.run([*args, "--warmup"], env=env, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode:
            raise RuntimeError(f"the direct vLLM run failed ({done.returncode}):\n{log.read_text()[-3000:]}")
        return float(json.loads(out_file.read_text())["output_tokens_per_s"])


def _log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="rollout-bench-"))


# --- the report ------------------------------------------------------------------------------------------------


def _commit() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return commit or "unknown"


def queue_section(queue: list[QueueFigures], requests: int, command: str = "") -> list[str]:
    """Section (a) of BENCHMARKS.md, as lines; `command` is named when the section was measured alone."""
    lines = ["## (a) Queue overhead, EchoEngine", ""]
    if command:
        lines.append(f"Command: `{command}`.")
    lines += [
        f"Throughput: one `RolloutClient.generate` call of {requests} requests (16 tokens in, 16 out), best of 3,",
        "client, workers and a private redis-server on this machine. Added latency: end-to-end latency minus the",
        f"engine's generation time, single-request calls sent open-loop at {LATENCY_RATE_PER_S} requests/s for"
        f" {LATENCY_DURATION_S:g} s.",
        "Goals: >= 20,000 requests/s with 2 workers; p50 added latency < 1 ms at 1k requests/s.",
        "",
        "| workers | requests/s | p50 added latency (ms) | p99 added latency (ms) | offered rate (req/s) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for f in queue:
        lines.append(
            f"| {f.workers} | {f.requests_per_s:,.0f} | {f.latency_p50_ms:.2f} | {f.latency_p99_ms:.2f} |"
            f" {f.latency_rate_per_s:,.0f} |"
        )
    return lines


def _report(
    command: str,
    queue: list[QueueFigures],
    generation: list[GenerationFigures],
    prompts: int,
    max_tokens: int,
    requests: int,
) -> str:
    commit = _commit()
    lines = [
        "# Benchmarks",
        "",
        f"Produced by `{command}` on {time.strftime('%Y-%m-%d')} at commit `{commit}`,",
        f"on {platform.machine()} with {os.cpu_count()} CPUs, Python {platform.python_version()}. Every figure",
        "below comes from that one run; compare them as ratios within it (the machine is shared and noisy).",
        "",
    ]
    lines += queue_section(queue, requests)
    if generation:
        lines += [
            "",
            "## (b) Generation efficiency, vLLM",
            "",
            f"{prompts} ShareGPT first-turn prompts (chat template applied by the worker), greedy, {max_tokens} output",
            "tokens each (`ignore_eos`), one engine with the same `AsyncLLM` settings both ways: through the service",
            "(one worker, `RolloutClient.generate` of the whole batch) and called directly",
            "(`python -m workers.direct`).",
            "Runs alternate service and direct. Goal: ratio >= 0.95.",
            "",
            "| run | service output tok/s | direct output tok/s | ratio |",
            "|---:|---:|---:|---:|",
        ]
        for g in generation:
            lines.append(f"| {g.run} | {g.service_tokens_per_s:.1f} | {g.direct_tokens_per_s:.1f} | {g.ratio:.3f} |")
        service = sum(g.service_tokens_per_s for g in generation) / len(generation)
        direct = sum(g.direct_tokens_per_s for g in generation) / len(generation)
        lines.append(f"| mean | {service:.1f} | {direct:.1f} | {service / direct:.3f} |")
    else:
        lines += ["", "## (b) Generation efficiency, vLLM", "", "Not run (`--skip-vllm`)."]
    return "\n".join(lines) + "\n"
