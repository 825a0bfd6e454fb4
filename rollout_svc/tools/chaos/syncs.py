"""The chaos soak's weight syncs: a trainer process of its own that syncs every 1-3 s, the faults aimed at it, and
what the ledger checks of them.

The trainer (`python -m rollout_svc.tools.chaos.syncs`) runs a `WeightSender` over gloo, as a training loop would:
each sync the next version of a few small tensors, alternately keep and abort pauses, and every other pair with the
transfer inside the pause (`pause_during_transfer`); every third sync is a checkpoint sync instead (it writes
`model.safetensors` under the workers' checkpoint root, keeping the last three); it prints one JSON line per sync:
its version, the version committed when it began (`base`, read from Redis: so a commit whose trainer was killed
before it printed its line is known too), `committed` or `failed` with the typed error, and its seconds. The
nemesis' `kill_sender` SIGKILLs it at a random moment, mid-transfer as often as not, and starts a new one 0.5-2 s
later, as a trainer's supervisor would; its pause (leased, `SYNC_LEASE_S`) must lapse by itself.

Checks: every sync commits or fails with a typed error (ours, or Redis' while it restarts; any other crashes the
trainer) within `SYNC_DEADLINE_S`; every token of every answer was
sampled under a version a trainer committed (or 0, the weights the workers started with); a trainer that crashed
(rather than being killed) is a violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import time
from collections import Counter
from typing import Any

from rollout_svc.config import settings_env
from rollout_svc.protocol import PauseMode
from rollout_svc.tools.chaos.fleet import ChaosFleet, Journal
from rollout_svc.tools.chaos.ledger import Ledger

SYNC_LEASE_S = 3.0  # the trainer's pause lease: a killed trainer's pause lapses this long after its last renewal
SYNC_TIMEOUT_S = 15.0  # each barrier's and collective's
SYNC_DEADLINE_S = 4 * SYNC_TIMEOUT_S  # join, received, loaded, plus the pause: a sync ends within this, either way


class Syncer:
    """The trainer process and its record: `counts` (committed, failed, killed, crashed), `committed` versions,
    `violations`."""

    def __init__(self, fleet: ChaosFleet, journal: Journal) -> None:
        self.fleet, self.journal = fleet, journal
        self.process: asyncio.subprocess.Process | None = None
        self.counts: Counter[str] = Counter({"syncs_committed": 0, "syncs_failed": 0})
        self.committed: set[int] = {0}
        self.violations: list[dict[str, Any]] = []
        self._reader: asyncio.Task[None] | None = None
        self._killing = False

    async def start(self) -> None:
        env = {
            **os.environ,
            **settings_env(self.fleet.settings),
            "ROLLOUT_PAUSE_LEASE_S": str(SYNC_LEASE_S),
            "ROLLOUT_WEIGHT_SYNC_TIMEOUT_S": str(SYNC_TIMEOUT_S),
        }
        log = open(self.fleet.log_dir / "trainer.log", "ab")  # noqa: SIM115 (the child keeps it; closed below)
        try:
            args = [sys.executable, "-m", "rollout_svc.tools.chaos.syncs"]
            self.process = await asyncio.create_subprocess_exec(
                *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True
            )
        finally:
            log.close()
        self._reader = asyncio.create_task(self._read(self.process))
        self.journal("sync", f"trainer started (pid {self.process.pid})")

    async def kill(self, rng: random.Random) -> None:
        """The `kill_sender` fault: SIGKILL the trainer, start another 0.5-2 s later."""
        if self.process is None or self._killing:
            return
        self._killing = True
        try:
            pid = self.process.pid
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            await self.process.wait()
            self.counts["sender_killed"] += 1
            self.journal("kill_sender", f"trainer (pid {pid}): SIGKILL")
            await asyncio.sleep(rng.uniform(0.5, 2.0))
            await self.start()
        finally:
            self._killing = False

    async def finish(self, timeout_s: float) -> None:
        """After the faults: let the trainer commit one more sync (it includes every live worker, so a replacement
        still `stale`, one no peer could send the committed version to, serves again), then stop it. A sync that
        does not come within `timeout_s` is a violation."""
        committed, deadline = self.counts["syncs_committed"], time.monotonic() + timeout_s
        while self.counts["syncs_committed"] == committed and time.monotonic() < deadline:
            if self.process is None or self.process.returncode is not None:
                await self.start()
            await asyncio.sleep(0.2)
        if self.counts["syncs_committed"] == committed:
            what = f"no sync committed within {timeout_s:g} s after the faults ended"
            self.violations.append({"check": "sync", "what": what})
        else:
            self.journal("sync", "a sync after the faults committed: every live worker has the committed weights")
        await self.stop()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 20)
            except TimeoutError:
                os.killpg(self.process.pid, signal.SIGKILL)
                await self.process.wait()
        if self._reader is not None:
            await asyncio.wait([self._reader], timeout=5)

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            try:
                sync = json.loads(raw)
            except ValueError:
                continue
            self._record(sync)
        code = await process.wait()
        if code not in (0, -signal.SIGKILL, -signal.SIGTERM) and not self._killing:
            self.counts["trainer_crashed"] += 1
            self.violations.append({"check": "sync", "what": f"the trainer exited with {code} (see trainer.log)"})

    def _record(self, sync: dict[str, Any]) -> None:
        version, seconds, base = int(sync["version"]), float(sync["s"]), int(sync["base"])
        if base not in self.committed:  # committed by a trainer killed before it printed its line
            self.committed.add(base)
            self.journal("sync", f"version {base} found committed (its trainer was killed before it said so)")
        transfer = "from a checkpoint" if sync["transfer"] == "checkpoint" else f"{sync['transfer']} the pause"
        how = f"version {version} {sync['outcome']} in {seconds:.2f} s ({sync['mode']}, {transfer})"
        if sync["outcome"] == "committed":
            self.counts["syncs_committed"] += 1
            self.committed.add(version)
            self.journal("sync", f"{how}, paused {sync['paused_s']:.2f} s")
        else:
            self.counts["syncs_failed"] += 1
            self.journal("sync", f"{how}: {sync['error']}")
        if seconds > SYNC_DEADLINE_S:
            self.violations.append({"check": "sync", "what": f"{how}: past its {SYNC_DEADLINE_S:g} s deadline"})

    def check_versions(self, ledger: Ledger) -> None:
        """Every token of every answer under a committed version (or 0): none under a version loaded and never
        committed (a sync abandoned after its load)."""
        for request_id, answers in ledger.answers.items():
            for answer in answers:
                t = answer.trajectory
                if t is None:
                    continue
                for version, first in t.weight_versions:
                    if version not in self.committed:
                        what = f"{request_id}: tokens from {first} under version {version}, never committed"
                        self.violations.append({"check": "sync", "what": what})


async def _train() -> None:
    """The trainer: sync forever, one JSON line per sync (see the module docstring)."""
    import torch
    from redis.exceptions import RedisError
    from safetensors.torch import save_file

    from rollout_svc.client.weight_sender import WeightSender
    from rollout_svc.errors import RolloutError

    rng, i = random.Random(os.getpid()), 0
    sender = WeightSender(bucket_bytes=256 * 1024)
    root = sender.settings.weight_sync.checkpoint_root
    while True:
        await asyncio.sleep(rng.uniform(0.2, 2.0))
        try:  # Redis may be restarting: a trainer waits for it, as it would for its own storage
            base = await sender.committed_version()
        except (RedisError, OSError):
            continue
        version = base + 1
        mode: PauseMode = "abort" if i % 2 else "keep"
        inside = (i // 2) % 2 == 1
        checkpoint = root is not None and i % 3 == 2
        tensors = {f"layer.{k}.weight": torch.full((256, 256), float(version)) for k in range(8)}
        how = "checkpoint" if checkpoint else "inside" if inside else "outside"
        line: dict[str, Any] = {"version": version, "base": base, "mode": mode, "transfer": how}
        started = time.monotonic()
        try:
            if checkpoint and root is not None:
                path = root / f"v{version}-{os.getpid()}"
                path.mkdir(exist_ok=True)
                await asyncio.to_thread(save_file, tensors, str(path / "model.safetensors"))
                for old in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime)[:-3]:
                    shutil.rmtree(old, ignore_errors=True)
                report = await sender.update_from_checkpoint(str(path), version, mode)
            else:
                report = await sender.update(tensors.items(), version, mode, pause_during_transfer=inside)
            line |= {"outcome": "committed", "paused_s": report.paused_s}
        except (RolloutError, RedisError, OSError) as exc:  # typed: anything else crashes the trainer
            line |= {"outcome": "failed", "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(line | {"s": time.monotonic() - started}), flush=True)
        i += 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_train())
