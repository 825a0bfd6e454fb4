"""`python -m workers`: run one worker process (one engine replica) until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import shlex
import signal
import sys

from rollout_svc import tracing
from rollout_svc.config import EngineSettings, Settings
from rollout_svc.errors import EngineDeadError
from workers.echo import EchoEngine
from workers.engine import Engine
from workers.metrics import WorkerMetrics
from workers.state import default_worker_id
from workers.worker import Worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workers", description="Run one rollout-svc worker (one engine).")
    p.add_argument("--redis-url", help="Redis URL (env ROLLOUT_REDIS_URL; default redis://127.0.0.1:6379/0)")
    p.add_argument("--model-name", help="the served model name (env ROLLOUT_MODEL_NAME; default: the fleet's model)")
    p.add_argument("--worker-id", help="stable id (default: host-pid-random)")
    p.add_argument("--drain-timeout-s", type=float, default=5.0, help="on stop: let in-flight requests finish")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0: none)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics server binds")
    EngineSettings.add_arguments(p)
    p.epilog = "Everything after -- goes to vLLM as its engine flags, as `vllm serve` takes them."
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = p.parse_args(ours)
    if flags:
        args.vllm_args = " ".join(part for part in (args.vllm_args, shlex.join(flags)) if part)
    return args


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    """The engine `args` describe, its vLLM flags checked by vLLM's parser and folded into the fields they stand
    for (`workers.vllm_flags.resolve`); exits with status 2 and vLLM's message for a flag vLLM does not take."""
    engine = EngineSettings.from_args(args)
    if not (engine.vllm_args or engine.vllm_config):
        return engine
    from workers.vllm_flags import resolve

    try:
        return resolve(engine)
    except ValueError as exc:  # VLLMFlagError among them
        print(f"python -m workers: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def build_engine(settings: Settings) -> Engine:
    """The engine `settings.engine` describes (the real vLLM one by default; the model prepared if none is named),
    answering to `settings.model_name` where one is given (in its heartbeat, `status`, `/v1/models`)."""
    engine = _engine(settings)
    if settings.model_name:
        engine.model_name = settings.model_name
    return engine


def _engine(settings: Settings) -> Engine:
    engine = settings.engine
    if engine.engine == "echo":
        return EchoEngine(
            capacity=engine.capacity,
            max_model_len=engine.context_len,
            token_delay_s=engine.echo_token_delay_s,
            load_delay_s=engine.echo_load_delay_s,
            preload_weight_transfer=engine.echo_preload_weight_transfer,
        )
    if engine.engine == "sim":
        return build_sim_engine(engine)
    from rollout_svc.model import prepare_model
    from workers.vllm_engine import VLLMEngine

    model = engine.model or str(prepare_model(settings.cache_dir))
    return VLLMEngine(model, tool_call_parser=engine.tool_call_parser or None, **engine.vllm_kwargs())


def build_sim_engine(engine: EngineSettings) -> Engine:
    """The simulated GPU engine of `engine`'s `sim_*` settings (workers.sim); ValueError for a profile it lacks."""
    from workers.sim.engine import sim_engine

    return sim_engine(engine)


def start_metrics(port: int, host: str) -> WorkerMetrics | None:
    """The worker's metrics, served at http://host:port/metrics from a thread; None (nothing counted) if port is 0."""
    if not port:
        return None
    metrics = WorkerMetrics()
    metrics.serve_http(port, host)
    return metrics


async def serve(args: argparse.Namespace, engine: EngineSettings) -> None:
    settings = Settings(
        engine=engine,
        **({"redis_url": args.redis_url} if args.redis_url else {}),
        **({"model_name": args.model_name} if args.model_name else {}),
    )
    workers = [
        Worker(
            settings,
            build_engine(settings),
            worker_id,
            args.drain_timeout_s,
            start_metrics(args.metrics_port, args.metrics_host) if i == 0 else None,
        )
        for i, worker_id in enumerate(replica_ids(args.worker_id, settings.engine))
    ]
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        for worker in workers:
            worker.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all)
    loop.add_signal_handler(signal.SIGUSR1, log_tasks)
    results = await asyncio.gather(*(worker.run() for worker in workers), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def log_tasks() -> None:
    """`kill -USR1 PID`: log where each of the worker's tasks is waiting (a worker that looks stuck)."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}", file=out)
        task.print_stack(limit=12, file=out)
    logging.getLogger("rollout_svc.worker").warning("asyncio tasks on SIGUSR1:\n%s", out.getvalue())


def replica_ids(worker_id: str | None, engine: EngineSettings) -> list[str | None]:
    """The worker ids this process serves: one, or for `--sim-engines N` N simulated GPUs, each a worker of its
    own: `ID` and `ID.1` .. `ID.{N-1}` (a default id where none is given)."""
    if engine.engine != "sim" or engine.sim_engines == 1:
        return [worker_id]
    base = worker_id or default_worker_id()
    return [base, *(f"{base}.{i}" for i in range(1, engine.sim_engines))]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = engine_settings(args)
    tracing.setup("worker")  # spans of traced requests (rollout_svc.tracing): off unless an OTLP endpoint is set
    try:
        asyncio.run(serve(args, engine))
    except EngineDeadError as exc:
        logging.getLogger("rollout_svc.worker").error("engine died: %s; its requests were requeued", exc)
        return 1
    except Exception:
        logging.getLogger("rollout_svc.worker").exception("worker failed; its requests were requeued")
        return 1
    finally:
        tracing.shutdown()  # what is buffered, exported
    return 0


if __name__ == "__main__":
    sys.exit(main())
