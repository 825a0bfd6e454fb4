"""`python -m workers`: run one worker process (one engine replica) until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from rollout_svc.config import EngineSettings, Settings
from rollout_svc.errors import EngineDeadError
from workers.echo import EchoEngine
from workers.engine import Engine
from workers.worker import Worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workers", description="Run one rollout-svc worker (one engine).")
    p.add_argument("--redis-url", help="Redis URL (env ROLLOUT_REDIS_URL; default redis://127.0.0.1:6379/0)")
    p.add_argument("--worker-id", help="stable id (default: host-pid-random)")
    p.add_argument("--drain-timeout-s", type=float, default=5.0, help="on stop: let in-flight requests finish")
    p.add_argument("--log-level", default="INFO")
    EngineSettings.add_arguments(p)
    return p.parse_args(argv)


def build_engine(engine: EngineSettings, settings: Settings) -> Engine:
    if engine.engine == "echo":
        return EchoEngine(
            capacity=engine.capacity,
            max_model_len=engine.max_model_len,
            token_delay_s=engine.echo_token_delay_s,
            load_delay_s=engine.echo_load_delay_s,
        )
    from rollout_svc.model import prepare_model
    from workers.engine import VLLMEngine

    return VLLMEngine(engine.model or str(prepare_model(settings.cache_dir)), **engine.vllm_kwargs())


async def serve(args: argparse.Namespace) -> None:
    settings = Settings(**({"redis_url": args.redis_url} if args.redis_url else {}))
    worker = Worker(
        settings, build_engine(EngineSettings.from_args(args), settings), args.worker_id, args.drain_timeout_s
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    await worker.run()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(args))
    except EngineDeadError as exc:
        logging.getLogger("rollout_svc.worker").error("engine died: %s; its requests were requeued", exc)
        return 1
    except Exception:
        logging.getLogger("rollout_svc.worker").exception("worker failed; its requests were requeued")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
