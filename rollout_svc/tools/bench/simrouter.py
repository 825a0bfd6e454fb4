"""`rollout-svc bench`, section (j)'s peer rows: the same simulated GPU engines (workers/sim) served over vLLM's HTTP
completions API, one port per engine, with vllm-router 0.1.17 in front of them under one of its policies, and the
step's requests sent through the router at once.

A backend process (`python -m rollout_svc.tools.bench.simrouter --ports P1,P2,... --engine JSON`) runs one
`SimEngine` per port (the `EngineSettings` the rollout-svc rows' workers get) and answers `POST /v1/completions`
(`prompt` as token ids, `max_tokens`, `temperature`, `seed`: the sim's output depends on the prompt and the seed
only, so the router rows serve the same workload as `RolloutClient.sample`'s), `GET /health` and `GET /v1/models`.
Each completion also carries `worker_id` (its port's engine) and `generation_time_s` (time in the engine), from which
the row's step report is made as for the rollout-svc rows (`client/steps.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path
from typing import Any

from rollout_svc.client.steps import StepReport, step_report
from rollout_svc.config import EngineSettings
from rollout_svc.deploy.processes import free_port
from rollout_svc.protocol import SamplingParams, Trajectory
from rollout_svc.tools.bench.router import Spawned, backend_app

MODEL = "sim"
CHECK = {"model": MODEL, "prompt": [65, 66, 67], "max_tokens": 1}
BACKEND_STARTS = 3  # tries at starting the backends, each on newly picked ports


def router_step(
    engine: EngineSettings,
    requests: list[tuple[list[int], int]],
    max_tokens: int,
    gpus: int,
    per_process: int,
    policy: str,
    log_dir: Path,
) -> tuple[StepReport, list[Trajectory]]:
    """Serve `requests` ((prompt ids, seed) each) at once through vllm-router (`policy`) in front of `gpus` simulated
    engines, `per_process` to a backend process. Returns the step report (wall-clock s; the caller scales it) over
    all engines, and the trajectories (prompt, completion, engine, times). Raises `RuntimeError` if a process does
    not start or a request fails."""
    with Spawned(log_dir) as spawned:
        for attempt in range(BACKEND_STARTS):
            # A port free when picked may be taken by another process before the backend binds it (EADDRINUSE,
            # seen once in 64 here): stop them all and pick new ones.
            ports = [free_port() for _ in range(gpus)]
            try:
                for i in range(0, gpus, per_process):
                    chunk = ports[i : i + per_process]
                    args = ["--ports", ",".join(map(str, chunk)), "--engine", engine.model_dump_json()]
                    module = "rollout_svc.tools.bench.simrouter"
                    backend = spawned.spawn([sys.executable, "-m", module, *args], f"sim-http-{i}")
                    for port in chunk:
                        spawned.wait_answering(f"http://127.0.0.1:{port}/health", None, backend)
                break
            except RuntimeError:
                spawned.stop()
                if attempt == BACKEND_STARTS - 1:
                    raise
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        url, _, _ = spawned.start_router(urls, CHECK, policy, f"vllm-router-{policy}")
        return asyncio.run(_send_all(url, requests, max_tokens, [f"port-{p}" for p in ports]))


async def _send_all(
    url: str, requests: list[tuple[list[int], int]], max_tokens: int, engines: list[str]
) -> tuple[StepReport, list[Trajectory]]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        started = time.time()

        async def one(prompt: list[int], seed: int) -> Trajectory:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed}
            async with http.post(f"{url}/v1/completions", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"vllm-router answered {response.status}: {await response.text()}")
                answer = await response.json()
            ended, choice = time.time(), answer["choices"][0]
            generation_s = float(answer["generation_time_s"])
            return Trajectory(
                request_id=answer["id"],
                prompt_token_ids=prompt,
                completion_token_ids=choice["token_ids"],
                finish_reason=choice["finish_reason"],
                worker_id=answer["worker_id"],
                queue_time_s=max(0.0, ended - generation_s - started),
                generation_time_s=generation_s,
            )

        trajectories = await asyncio.gather(*(one(prompt, seed) for prompt, seed in requests))
        ended = time.time()
    return step_report(trajectories, started, ended, engines), list(trajectories)


# --- the backend process -----------------------------------------------------------------------------------------


async def _serve(ports: list[int], settings: EngineSettings) -> None:
    from aiohttp import web

    from workers.engine import Generation
    from workers.sim.engine import sim_engine

    numbers = itertools.count()
    runners = []
    for port in ports:
        engine = sim_engine(settings)
        await engine.start()
        name = f"port-{port}"

        async def completions(request: web.Request, engine: Any = engine, name: str = name) -> web.Response:
            body = await request.json()
            params = SamplingParams(
                max_tokens=int(body.get("max_tokens") or 16),
                temperature=float(body.get("temperature", 1.0)),
                seed=body.get("seed"),
            )
            request_id = f"cmpl-{name}-{next(numbers)}"
            started = time.time()
            completion = await engine.generate(Generation(request_id, list(body["prompt"]), params))
            generation_s = time.time() - started
            choice = {
                "index": 0,
                "text": "",
                "token_ids": completion.completion_token_ids,
                "logprobs": None,
                "finish_reason": completion.finish_reason,
            }
            tokens = len(completion.completion_token_ids)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}
            answer = {"id": request_id, "object": "text_completion", "created": 0, "model": MODEL}
            extra = {"worker_id": name, "generation_time_s": generation_s}
            return web.json_response({**answer, "choices": [choice], "usage": usage, **extra})

        runner = web.AppRunner(backend_app(MODEL, {"/v1/completions": completions}), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="simulated GPU engines behind vLLM's completions API, one per port")
    parser.add_argument("--ports", required=True, help="comma-separated ports, one engine each")
    parser.add_argument("--engine", required=True, help="the EngineSettings, as JSON")
    args = parser.parse_args(argv)
    ports = [int(p) for p in args.ports.split(",")]
    asyncio.run(_serve(ports, EngineSettings.model_validate_json(args.engine)))


if __name__ == "__main__":
    main()
