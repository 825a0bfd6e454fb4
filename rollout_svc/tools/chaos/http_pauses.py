"""The chaos soak's `http_pause_kill`: a trainer killed between its HTTP `/pause` and its `/resume`, through a
`rollout-svc serve` of the soak's own, and what is checked of it.

`serve` starts with the fleet (`--open-control --pause-lease-s 3`, on a free loopback port; its log `serve.log`).
Each fault:

  1. a trainer process (`python -m rollout_svc.tools.chaos.http_pauses URL HOLDER`) sends `POST /pause?mode=keep`
     as `X-Rollout-Holder: chaos-trainer-<n>`, prints `paused in S s` once answered, and sleeps, never resuming
     (the answer waits for every live worker's ack: a stalled worker's, until it is reaped, may take longer than
     the lease, which runs from the pause's write);
  2. agents send `AGENT_CHATS` chats through serve (`POST /v1/chat/completions`, the model `GET /v1/models` names,
     no holder header: they must not renew the trainer's lease), which wait behind its pause;
  3. the nemesis SIGKILLs the trainer 0-1 s later (an OOM kill, a preempted node), before any `/resume`.

Checks (violations `http_pause`): every chat answers 200 with a choice (each bounded by the service's request
timeout, the pause's lapse included); the dead trainer's holder is gone from `GET /is_paused` within the lease plus
a heartbeat interval plus `SLACK_S` of the kill; serve's `rollout_api_pause_lapses_total` counts each lapse within
the lease plus two of its watch rounds plus `SLACK_S`. While a fault runs (`busy`) the nemesis neither pauses through
its control plane (whose pause would hold the fleet past the lapse) nor restarts Redis (which would refuse the chats
and may drop the pause itself); a worker may be killed or stalled meanwhile, and a trainer's sync may pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from typing import Any

from rollout_svc.deploy.processes import die_with_parent, free_port
from rollout_svc.tools.chaos.fleet import DEATH_SIGNAL, ChaosFleet, Journal, exited
from rollout_svc.tools.chaos.ledger import Ledger

HTTP_PAUSE_LEASE_S = 3.0  # serve's --pause-lease-s: a dead trainer's pause lapses this long after its `/pause`
HOLDER_PREFIX = "chaos-trainer-"  # X-Rollout-Holder of each trainer; `GET /is_paused` names it `http:<that>`
AGENT_CHATS = 4  # chats sent through serve while the trainer's pause holds
CHAT_MAX_TOKENS = 8
KILL_DELAY_S = (0.0, 1.0)  # from `paused` to the SIGKILL: within the lease
SLACK_S = 5.0  # a loaded host's scheduling delays (make test's run queue reaches 10-25 on 2 cores)
WATCH_S = 1.0  # serve's round for lapses (`api/pause_holders.py`)
PAUSE_TIMEOUT_S = 30.0  # the trainer's `/pause`: acknowledged by every live worker (a stalled one once reaped)
START_TIMEOUT_S = 45.0  # serve answering (its imports take ~1 s on an idle host)
POLL_S = 0.1
KIND = "http_pause_kill"


class HttpPauses:
    """serve, the trainers the `http_pause_kill` fault starts and kills, and their record: `violations`, `counts`
    (pauses killed, lapses seen, chats answered), `busy` while a fault runs."""

    def __init__(self, fleet: ChaosFleet, ledger: Ledger, journal: Journal) -> None:
        self.fleet, self.ledger, self.journal = fleet, ledger, journal
        self.base_url = ""
        self.model = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.violations: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter({"http_pauses_killed": 0, "http_pause_lapses": 0, "agent_chats_ok": 0})
        self.busy = False
        self._trainers = 0

    # --- serve ----------------------------------------------------------------------------------------------

    async def start(self, attempts: int = 3) -> None:
        """Start serve on a free port (another port if that one was taken before serve bound it) and wait until it
        answers and lists the workers' model. Raises `RuntimeError`, naming its log, if it does not."""
        for attempt in range(attempts):
            port = free_port()
            self._spawn(port)
            if await self._answering(f"http://127.0.0.1:{port}"):
                break
            if attempt == attempts - 1:
                raise RuntimeError(f"rollout-svc serve did not answer; see {self.fleet.log_dir}/serve.log")
        self.base_url = f"http://127.0.0.1:{port}"
        self.model = await self._model()
        self.journal("serve", f"{self.base_url} up (pause lease {HTTP_PAUSE_LEASE_S:g} s), model {self.model}")

    def _spawn(self, port: int) -> None:
        args = [sys.executable, "-m", "rollout_svc", "serve", "--redis-url", self.fleet.redis_url]
        args += ["--port", str(port), "--open-control", "--pause-lease-s", str(HTTP_PAUSE_LEASE_S)]
        self.process = self.fleet.child(args, "serve.log")

    async def _answering(self, base_url: str) -> bool:
        """Whether serve answers `/metrics` before `START_TIMEOUT_S` (False: it exited, say its port was taken)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            if (await asyncio.to_thread(_http, "GET", f"{base_url}/metrics", timeout_s=1.0))[0] == 200:
                return True
            await asyncio.sleep(POLL_S)
        return False

    async def _model(self) -> str:
        """The first model `GET /v1/models` lists (the workers are live: their heartbeats name it)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            status, body = await asyncio.to_thread(_http, "GET", f"{self.base_url}/v1/models")
            with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                if status == 200:
                    return str(json.loads(body)["data"][0]["id"])
            await asyncio.sleep(POLL_S)
        raise RuntimeError(f"{self.base_url}/v1/models listed no model; see {self.fleet.log_dir}/serve.log")

    async def close(self) -> None:
        """Stop serve (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        if not await exited(self.process, 10.0):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await exited(self.process, 5.0)

    # --- the fault ------------------------------------------------------------------------------------------

    async def kill_holder(self, rng: random.Random, record: Callable[..., None]) -> str:
        """The fault of the module docstring; `record(kind, target, applied=...)` notes it (applied: the trainer's
        pause was answered 200). Returns what the trainer said of its `/pause` ('' if nothing within
        `PAUSE_TIMEOUT_S`): `paused ...`, or `failed: ...`."""
        self.busy = True
        self._trainers += 1
        holder = f"{HOLDER_PREFIX}{self._trainers}"
        trainer = await self._start_trainer(holder)
        try:
            said = await _first_line(trainer, PAUSE_TIMEOUT_S + 5)
            paused = said.startswith("paused")
            chats = asyncio.gather(*(asyncio.to_thread(self._chat, i) for i in range(AGENT_CHATS)))
            await asyncio.sleep(rng.uniform(*KILL_DELAY_S))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(trainer.pid, signal.SIGKILL)
            killed_at = time.time()
            record(KIND, holder, applied=paused)
            self.journal(KIND, f"{holder} (pid {trainer.pid}) said {said!r}; SIGKILL before its /resume")
            if paused:
                self.counts["http_pauses_killed"] += 1
            await self._check_lapse(holder, killed_at)
            if paused:
                await self._check_metric(killed_at)
            self._check_chats(await chats, killed_at)
            return said
        finally:
            with contextlib.suppress(ProcessLookupError):
                trainer.kill()
            await trainer.wait()
            self.busy = False

    async def _start_trainer(self, holder: str) -> asyncio.subprocess.Process:
        args = [sys.executable, "-m", "rollout_svc.tools.chaos.http_pauses", self.base_url, holder]
        log = open(self.fleet.log_dir / "http-trainers.log", "ab")  # noqa: SIM115 (the child keeps it; closed below)
        try:
            return await asyncio.create_subprocess_exec(
                *die_with_parent(args, DEATH_SIGNAL), stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True
            )
        finally:
            log.close()

    async def _check_lapse(self, holder: str, killed_at: float) -> None:
        """The dead holder leaves `GET /is_paused` within the lease + a heartbeat interval + `SLACK_S` of the kill."""
        bound_s = HTTP_PAUSE_LEASE_S + self.fleet.settings.worker.heartbeat_interval_s + SLACK_S
        while time.time() - killed_at < bound_s:
            status, body = await asyncio.to_thread(_http, "GET", f"{self.base_url}/is_paused")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                if status == 200 and f"http:{holder}" not in json.loads(body)["holders"]:
                    self.journal(KIND, f"{holder}'s pause gone {time.time() - killed_at:.2f} s after the kill")
                    return
            await asyncio.sleep(POLL_S)
        self._violation(f"{holder}'s pause still held (GET /is_paused) {bound_s:g} s after it was killed", killed_at)

    async def _check_metric(self, killed_at: float) -> None:
        """serve's `rollout_api_pause_lapses_total` reaches the pauses killed so far, within the lease, two watch
        rounds and `SLACK_S` of the kill."""
        bound_s, lapses = HTTP_PAUSE_LEASE_S + 2 * WATCH_S + SLACK_S, 0.0
        while time.time() - killed_at < bound_s:
            status, body = await asyncio.to_thread(_http, "GET", f"{self.base_url}/metrics")
            lapses = _metric(body, "rollout_api_pause_lapses_total") if status == 200 else lapses
            if lapses >= self.counts["http_pauses_killed"]:
                self.counts["http_pause_lapses"] = int(lapses)
                return
            await asyncio.sleep(POLL_S)
        killed = self.counts["http_pauses_killed"]
        what = f"serve's rollout_api_pause_lapses_total is {lapses:g}, not {killed}, {bound_s:g} s after the kill"
        self._violation(what, killed_at)

    def _check_chats(self, answers: list[tuple[int, str]], killed_at: float) -> None:
        ok = [status for status, _ in answers if status == 200]
        self.counts["agent_chats_ok"] += len(ok)
        self.journal(KIND, f"{len(ok)} of {len(answers)} agent chats answered 200")
        for status, text in answers:
            if status != 200:
                self._violation(f"an agent's chat through serve answered {status}: {text[:200]}", killed_at)

    def _chat(self, number: int) -> tuple[int, str]:
        """One agent's chat (blocking: run in a thread). (HTTP status, or 0 if none came; the body or the error)."""
        content = f"chaos agent {number}: say something while a trainer holds the fleet"
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": CHAT_MAX_TOKENS}
        timeout_s = self.fleet.settings.client.request_timeout_s + PAUSE_TIMEOUT_S
        status, text = _http("POST", f"{self.base_url}/v1/chat/completions", body, timeout_s=timeout_s)
        with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
            if status == 200 and json.loads(text)["choices"][0]["message"] is not None:
                return status, text
        return (status, text) if status != 200 else (0, f"200 without a choice: {text[:200]}")

    def _violation(self, what: str, killed_at: float) -> None:
        self.journal(KIND, what)
        near = self.ledger.faults_near(killed_at - 1.0, time.time())
        self.violations.append({"check": "http_pause", "what": f"{what} (see serve.log)", "faults_near": near})


async def _first_line(process: asyncio.subprocess.Process, timeout_s: float) -> str:
    """The first line `process` prints, stripped; '' if none within `timeout_s` or it exited first."""
    assert process.stdout is not None
    with contextlib.suppress(TimeoutError):
        return (await asyncio.wait_for(process.stdout.readline(), timeout_s)).decode(errors="replace").strip()
    return ""


def _http(
    method: str,
    url: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 10.0,
) -> tuple[int, str]:
    """One HTTP call on loopback, never through a proxy (blocking). Returns (status, body text); (0, the error) if
    no answer came (refused, timed out)."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    sent = {"Content-Type": "application/json"} | (headers or {})
    request = urllib.request.Request(url, data=data, headers=sent, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as answer:
            return int(answer.status), answer.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:  # TimeoutError is an OSError
        return 0, f"{type(exc).__name__}: {exc}"


def _metric(text: str, name: str) -> float:
    """The value of an unlabelled Prometheus sample `name` in an exposition; 0 if absent."""
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def _hold(base_url: str, holder: str) -> None:
    """The trainer: pause the fleet as `holder`, say how it went (`paused in S s`, or `failed: ...`), then sleep
    until killed: it never resumes."""
    url, headers, started = f"{base_url}/pause?mode=keep", {"X-Rollout-Holder": holder}, time.monotonic()
    status, text = _http("POST", url, headers=headers, timeout_s=PAUSE_TIMEOUT_S)
    took_s = time.monotonic() - started
    print(f"paused in {took_s:.2f} s" if status == 200 else f"failed: HTTP {status}: {text[:200]}", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        _hold(sys.argv[1], sys.argv[2])
