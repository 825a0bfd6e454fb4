"""The chaos soak's `step_restart`: a trainer killed mid-step and a new process attaching to its step
(`RolloutClient.attach_step`), and what is checked of it.

Each fault:

  1. a trainer process (`python -m rollout_svc.tools.chaos.step_restarts train STEP_ID`, the soak's settings in its
     environment) builds `STEP_REQUESTS` requests under ids of its own (`STEP_ID-r<i>`), alternately short
     (`SHORT_MAX_TOKENS`) and long (`LONG_MAX_TOKENS`), prompts of printable-ASCII token ids drawn from the step id
     (`plan`), and runs them as the named step STEP_ID (`run(requests, step_id=)`);
  2. once the step's record (`Keys.step`) exists and its results stream (`Keys.results` of `step-<STEP_ID>`) holds
     2-8 entries (the short requests answer first: 20-80 ms each at 10 ms a token, the long ones take 0.6-1.5 s), the
     nemesis SIGKILLs the trainer (an OOM kill, a preempted node);
  3. a second process (`... attach STEP_ID`) calls `attach_step(STEP_ID)` and prints each trajectory (JSON).

Checks (violations `step_restart`): the attach returns within `ATTACH_TIMEOUT_S` of the kill, without raising;
exactly `STEP_REQUESTS` trajectories, under the trainer's request ids, in its order, each once; each the echo of its
prompt (its tokens cut at max_tokens, `stop` or `length`, as the ledger's `judge` has it: an error or an abort is a
violation); the step's record and results stream are gone once the attaching process called `finish_step`. While a
fault runs (`busy`) the nemesis does not restart Redis (its SIGKILL may lose the last second of the step's record);
workers are killed and stalled and the fleet paused meanwhile: answers may come through token-exact retries, the dead
trainer's or the attaching process's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.client.step_store import COLLECTED_FIELD, step_producer
from rollout_svc.config import settings_env
from rollout_svc.connections.urls import redis_async
from rollout_svc.deploy.processes import die_with_parent
from rollout_svc.errors import RolloutError
from rollout_svc.protocol import Trajectory
from rollout_svc.tools.chaos.fleet import DEATH_SIGNAL, ChaosFleet, Journal
from rollout_svc.tools.chaos.ledger import LATE_SERVICE_S, Answer, Ledger, Submitted, judge

STEP_REQUESTS = 24
SHORT_MAX_TOKENS = (2, 8)  # 20-80 ms at the soak's 10 ms a token: the first results of the step
LONG_MAX_TOKENS = (60, 150)  # 0.6-1.5 s: still generating when the trainer is killed
PROMPT_TOKENS = (32, 126)  # printable ASCII, as the soak's load: the echo's text reads as its prompt
KILL_AFTER_RESULTS = (2, 8)  # entries in the step's results stream before the SIGKILL
UNDER_WAY_TIMEOUT_S = 45.0  # the trainer's start (imports: ~1 s idle, several on make test's loaded host) and queue
ATTACH_TIMEOUT_S = 60.0  # from the kill: the attaching process's start and every answer of the step
POLL_S = 0.02
SHOWN_PER_STEP = 3  # wrong answers reported per step (the rest are counted in the first one's text)
KIND = "step_restart"


class StepRestarts:
    """The trainers and attaching processes the `step_restart` fault starts, and their record: `violations`,
    `counts` (steps restarted, trajectories collected, results in the stream at the kill, trajectories retried),
    `busy` while a fault runs."""

    def __init__(self, fleet: ChaosFleet, ledger: Ledger, journal: Journal) -> None:
        self.fleet, self.ledger, self.journal = fleet, ledger, journal
        self.violations: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter(
            {"steps_restarted": 0, "trajectories_collected": 0, "results_before_kill": 0, "trajectories_retried": 0}
        )
        self.busy = False
        self._steps = 0

    async def restart(self, rng: random.Random, record: Callable[..., None]) -> str:
        """The fault of the module docstring; `record(kind, target, applied=...)` notes it (applied: the trainer was
        killed with its step's record in Redis). Returns '' once checked, else why the fault did not apply."""
        self.busy = True
        self._steps += 1
        step_id = f"chaos-step-{self._steps}"
        started_at = time.time()
        trainer = await self._spawn("train", step_id)
        redis = redis_async(self.fleet.redis_url)
        try:
            results = await self._under_way(redis, trainer, step_id, rng.randint(*KILL_AFTER_RESULTS))
            if results is None:
                return f"{step_id}: the trainer did not get its step under way; see step-trainers.log"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(trainer.pid, signal.SIGKILL)
            await trainer.wait()
            killed_at = time.time()
            record_key = self.fleet.settings.keys.step(step_id)
            mid_step = bool(await redis.exists(record_key)) and not await redis.hexists(record_key, COLLECTED_FIELD)
            record(KIND, step_id, applied=mid_step)
            if not mid_step:
                return f"{step_id}: the trainer collected its step before the SIGKILL"
            when = f"{killed_at - started_at:.1f} s after its start, {results} results in"
            self.journal(KIND, f"{step_id}: trainer (pid {trainer.pid}) SIGKILL {when}")
            self.counts["steps_restarted"] += 1
            self.counts["results_before_kill"] += results
            await self._attach(redis, step_id, started_at, killed_at)
            return ""
        finally:
            with contextlib.suppress(ProcessLookupError):
                trainer.kill()
            await trainer.wait()
            await redis.aclose()
            self.busy = False

    async def _spawn(self, role: str, step_id: str) -> asyncio.subprocess.Process:
        """A trainer (`train`) or an attaching process (`attach`) for `step_id`, the soak's settings in its
        environment; stderr (and a trainer's stdout) to `step-trainers.log`."""
        args = [sys.executable, "-m", "rollout_svc.tools.chaos.step_restarts", role, step_id]
        env = {**os.environ, **settings_env(self.fleet.settings)}
        log = open(self.fleet.log_dir / "step-trainers.log", "ab")  # noqa: SIM115 (the child keeps it; closed below)
        try:
            stdout = asyncio.subprocess.PIPE if role == "attach" else log
            return await asyncio.create_subprocess_exec(
                *die_with_parent(args, DEATH_SIGNAL), env=env, stdout=stdout, stderr=log, start_new_session=True
            )
        finally:
            log.close()

    async def _under_way(
        self, redis: Redis, trainer: asyncio.subprocess.Process, step_id: str, results: int
    ) -> int | None:
        """Wait until the step's record exists and its results stream holds `results` entries; how many it holds
        then. None if the trainer exited first or `UNDER_WAY_TIMEOUT_S` passed."""
        keys, deadline = self.fleet.settings.keys, time.monotonic() + UNDER_WAY_TIMEOUT_S
        stream = keys.results(step_producer(step_id))
        while time.monotonic() < deadline and trainer.returncode is None:
            with contextlib.suppress(RedisError, OSError):
                held = int(await redis.xlen(stream))
                if held >= results and await redis.exists(keys.step(step_id)):
                    return held
            await asyncio.sleep(POLL_S)
        return None

    async def _attach(self, redis: Redis, step_id: str, started_at: float, killed_at: float) -> None:
        """Attach from a new process, bounded by `ATTACH_TIMEOUT_S`, and check what it collected."""
        attacher = await self._spawn("attach", step_id)
        try:
            out, _ = await asyncio.wait_for(attacher.communicate(), ATTACH_TIMEOUT_S)
        except TimeoutError:
            self._violation(f"attach_step({step_id!r}) did not return within {ATTACH_TIMEOUT_S:g} s", killed_at)
            return
        finally:
            with contextlib.suppress(ProcessLookupError):
                attacher.kill()
            await attacher.wait()
        lines = out.decode(errors="replace").splitlines()
        said = lines[-1] if lines else f"nothing (exit status {attacher.returncode})"
        if not said.startswith("attached"):
            self._failed(step_id, said, started_at, killed_at)
            return
        trajectories = [Trajectory.model_validate_json(line) for line in lines[:-1]]
        self._check(step_id, trajectories, started_at, killed_at)
        keys = self.fleet.settings.keys
        left = int(await redis.exists(keys.step(step_id), keys.results(step_producer(step_id))))
        if left:
            self._violation(f"{step_id}: collected, yet {left} of its record and results stream are left", killed_at)
        retried = sum(t.interruptions > 0 for t in trajectories)
        self.counts["trajectories_retried"] += retried
        self.journal(KIND, f"{step_id}: {said}: {len(trajectories)} trajectories, {retried} retried token-exact")

    def _failed(self, step_id: str, said: str, started_at: float, killed_at: float) -> None:
        """A violation, unless the step timed out while the fleet could serve for less than `LATE_SERVICE_S` of it
        (the ledger excuses a late request so: every worker had lost the committed version, or the fleet paused)."""
        if "RequestTimeoutError" in said and self.ledger.serviceable_s(started_at, time.time()) < LATE_SERVICE_S:
            self.counts["steps_late_excused"] += 1
            self.journal(KIND, f"{step_id}: {said[:200]} (excused: the fleet could not serve meanwhile)")
            return
        self._violation(f"attach_step({step_id!r}) returned no step: {said[:300]}", killed_at)

    def _check(self, step_id: str, trajectories: list[Trajectory], started_at: float, killed_at: float) -> None:
        """Every request of the step once, in order, under its own id, each the echo of its prompt."""
        planned = plan(step_id, started_at)
        ids = [t.request_id for t in trajectories]
        if ids != [p.request_id for p in planned]:
            twice = sorted({i for i in ids if ids.count(i) > 1})
            what = f"{step_id}: {len(ids)} trajectories, not the trainer's {len(planned)} ids in order"
            self._violation(f"{what} (twice: {twice[:5]}; first ids {ids[:4]})", killed_at)
            return
        received_at, wrong = time.time(), []
        for request, trajectory in zip(planned, trajectories, strict=True):
            outcome, problem = judge(request, Answer(received_at, trajectory=trajectory), self.ledger)
            if outcome == "ok":
                self.counts["trajectories_collected"] += 1
            elif outcome != "late_excused":  # past its deadline while no worker could serve, as the ledger excuses
                wrong.append(f"{request.request_id}: {outcome}: {problem}")
        for what in wrong[:SHOWN_PER_STEP]:
            self._violation(f"{what} ({len(wrong)} wrong in {step_id})", killed_at)

    def _violation(self, what: str, killed_at: float) -> None:
        self.journal(KIND, what)
        near = self.ledger.faults_near(killed_at - 1.0, time.time())
        self.violations.append({"check": KIND, "what": f"{what} (see step-trainers.log)", "faults_near": near})


def plan(step_id: str, submitted_at: float = 0.0) -> list[Submitted]:
    """The step's requests, drawn from `step_id` (the trainer and the checks draw the same): `STEP_REQUESTS` of them,
    ids `<step_id>-r<i>`, alternately long and short; prompts up to 6 tokens longer or 2 shorter than max_tokens (the
    echo answers `length` or `stop`)."""
    rng, planned = random.Random(step_id), []
    for i in range(STEP_REQUESTS):
        max_tokens = rng.randint(*(LONG_MAX_TOKENS if i % 2 == 0 else SHORT_MAX_TOKENS))
        prompt = [rng.randint(*PROMPT_TOKENS) for _ in range(max(1, max_tokens + rng.randint(-2, 6)))]
        planned.append(Submitted(f"{step_id}-r{i}", prompt, max_tokens, submitted_at, None, f"step {step_id}"))
    return planned


async def _train(step_id: str) -> None:
    """The trainer: run the step `plan(step_id)` as the named step `step_id`, then say `collected` (if not killed)."""
    planned = plan(step_id)
    async with RolloutClient() as client:
        params = [{"max_tokens": p.max_tokens, "temperature": 0.0} for p in planned]
        ids = [p.request_id for p in planned]
        requests = await client.rollout_requests([p.prompt for p in planned], params, request_ids=ids)
        print(f"{step_id}: running {len(requests)} requests", flush=True)
        await client.run(requests, step_id=step_id)
        await client.finish_step(step_id)  # used: a trainer says so once it trained on them
    print(f"{step_id}: collected", flush=True)


async def _attach(step_id: str) -> None:
    """The new process: attach to the step `step_id`; print each trajectory (JSON, one a line), then
    `attached in S s`; or `failed: ...` if attaching raised."""
    started = time.monotonic()
    try:
        async with RolloutClient() as client:
            trajectories = await client.attach_step(step_id)
            await client.finish_step(step_id)
    except (RolloutError, RedisError, OSError) as exc:
        print(f"failed after {time.monotonic() - started:.2f} s: {type(exc).__name__}: {exc}", flush=True)
        return
    for trajectory in trajectories:
        print(trajectory.model_dump_json())
    print(f"attached in {time.monotonic() - started:.2f} s", flush=True)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_train(sys.argv[2]) if sys.argv[1] == "train" else _attach(sys.argv[2]))
