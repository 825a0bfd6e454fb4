"""Brings one worker to the fleet's desired control state: the worker's side of the control plane.

Level-triggered: `converge()` reads the state hash and the commands logged since the last one it saw, applies
the one-shot commands (abort, prefix-cache reset) in epoch order, loads and unloads LoRA adapters, then moves the
engine to the desired level (paused in a mode, asleep, serving). It returns True once everything is applied, and
the worker acknowledges the epoch; it returns False while in-flight requests must finish first (pause `wait`, or
aborted requests still returning their partial output), and the worker calls it again when one finishes or a
nudge arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from rollout_svc.control.plane import ControlPlane, FleetState
from rollout_svc.errors import EngineDeadError
from rollout_svc.protocol import ControlCommand, PauseMode
from workers.engine import Engine
from workers.inflight import AbortRules, InFlight, InFlightIndex
from workers.state import WorkerState

log = logging.getLogger("rollout_svc.worker")


class Converger:
    """Applies desired control state to one worker's engine and in-flight requests."""

    def __init__(
        self,
        control: ControlPlane,
        engine: Engine,
        index: InFlightIndex,
        state: WorkerState,
        rules: AbortRules,
        stop_taking: Callable[[], Awaitable[None]],
    ) -> None:
        self.control, self.engine, self.index, self.state, self.rules = control, engine, index, state, rules
        self._stop_taking = stop_taking  # returns once no read is in progress (what it took is in the index)
        self._seen_epoch: int | None = None  # the newest logged command handled; None: not converged yet
        self._applied: FleetState | None = None  # what was last applied, to write back if Redis forgets it
        self._engine_paused: PauseMode | None = None
        self._engine_asleep = False
        self._woken: set[str] = set()
        self._awaiting: set[InFlight] = set()  # aborted by a command, must return before the ack
        self._adapter_failed: set[tuple[str, int]] = set()  # (name, version) whose load failed here: not retried

    async def cancel_tombstoned(self) -> None:
        """Read the tombstones written since the last read; abort the in-flight requests they name (those taken
        later are answered unrun, see `AbortRules`)."""
        new = self.rules.add_tombstones(await self.control.tombstones(self.rules.tombstones_seen))
        if new:
            await self.index.cancel_all(self.index.by_request_ids(new), "user")

    def restart(self) -> None:
        """A new incarnation: converge from scratch (the engine keeps its pause state)."""
        self._seen_epoch = None

    async def converge(self) -> bool:
        """Apply what is new; True when all of it is (acknowledge `state.applied_epoch` then)."""
        desired, commands = await self.control.read(self._seen_epoch)
        if desired is None:
            desired = await self._reseed()
        self.state.committed_version = desired.weight_version
        first = self._seen_epoch is None
        for command in commands:
            if command.kind == "abort":
                self.rules.add(command)  # on a first read too: queued requests it hits may still come
            if not first:
                await self._one_shot(command)
        self._seen_epoch = max([desired.epoch, *(c.epoch for c in commands)])
        done = await self._apply(desired)
        self.state.passed(self._seen_epoch)
        self._awaiting = {r for r in self._awaiting if r in self.index}
        if not done or self._awaiting:
            return False
        self.state.applied_epoch, self._applied = desired.epoch, desired
        return True

    async def _reseed(self) -> FleetState:
        """The state hash is missing (a Redis that forgot): write back what this worker last applied."""
        if self._applied is None or self._applied.epoch == 0:
            return FleetState()
        if await self.control.reseed(self._applied):
            log.warning("the control state was missing from Redis: wrote back epoch %d", self._applied.epoch)
        desired, _ = await self.control.read(self._seen_epoch)
        return desired or self._applied

    async def _one_shot(self, command: ControlCommand) -> None:
        try:
            if command.kind == "abort":
                hit = self.index.hit_by(command)
                await self.index.cancel_all(hit, "user")
                self._awaiting.update(hit)
            elif command.kind == "reset_prefix_cache" and not await self.engine.reset_prefix_cache(
                bool(command.args.get("reset_running_requests"))
            ):
                self.state.fail(command.epoch, "the engine refused: running requests hold KV blocks (pause first)")
        except EngineDeadError:
            raise
        except Exception as exc:  # the command failed here: say so in the ack, keep serving
            log.exception("control command %s (epoch %d) failed", command.kind, command.epoch)
            self.state.fail(command.epoch, f"{type(exc).__name__}: {exc}")

    async def _apply(self, desired: FleetState) -> bool:
        try:
            if not desired.sleeping and (desired.adapters or self.state.adapters.current):
                await self._adapters(desired)
            if desired.sleeping:
                return await self._sleep(desired)
            if self._engine_asleep:
                await self.engine.wake_up(None)  # vLLM resumes its scheduler once fully awake
                self._engine_asleep, self._engine_paused = False, None
                self.state.sleep_level = 0
            if desired.paused:
                assert desired.pause_mode is not None
                return await self._pause(desired.pause_mode)
            if self.state.weight_version != desired.weight_version:
                return await self._stale()
            if self._engine_paused is not None:
                await self.engine.resume()
                self._engine_paused = None
            self.state.pause_mode = None
            self.state.set_label("serving")
            return True
        except EngineDeadError:
            raise
        except Exception as exc:
            log.exception("applying control epoch %d failed", desired.epoch)
            self.state.fail(desired.epoch, f"{type(exc).__name__}: {exc}")
            return True

    async def _adapters(self, desired: FleetState) -> None:
        """Load the adapters the fleet holds and this engine lacks, drop the others. A failed load fails this epoch
        here (the issuer's `ControlCommandError` names this worker and why) and is not tried again for that
        version: the trainer loads a fixed one as a new version."""
        wanted = {n: s for n, s in desired.adapters.items() if (n, s.version) not in self._adapter_failed}
        root = self.control.settings.weight_sync.checkpoint_root
        errors = await self.state.adapters.apply(wanted, self.engine, root)
        if errors:
            self._adapter_failed |= {(name, wanted[name].version) for name in errors}
            self.state.fail(desired.epoch, "; ".join(errors.values()))

    async def _pause(self, mode: PauseMode) -> bool:
        """Stop taking; keep freezes in-flight requests, abort cuts them, wait lets them finish first."""
        self.state.set_label("paused")
        self.state.pause_mode = mode
        await self._stop_taking()
        if mode == "abort":
            await self._abort_generation()  # every pass: also a request taken just as the pause landed
        if self._engine_paused != mode:
            if mode == "wait":
                if self._engine_paused == "keep":
                    await self.engine.resume()  # frozen requests must run to finish
                    self._engine_paused = None
                if self.index.generating:
                    return False
            await self.engine.pause(mode)
            self._engine_paused = mode
        return mode == "keep" or self.index.generating == 0

    async def _stale(self) -> bool:
        """This worker's weights are not the committed version: take no work, and cut what it runs (the client
        resubmits it, token-exact, to a worker with the committed weights). It never serves an old version."""
        self.state.set_label("stale")
        self.state.pause_mode = None
        await self._stop_taking()
        await self.index.cancel_all([r for r in self.index.records() if r.generation], "stale")
        return True

    async def _sleep(self, desired: FleetState) -> bool:
        self.state.set_label("sleeping")
        self.state.sleep_level = desired.sleep_level
        await self._stop_taking()
        mode = desired.sleep_mode
        if mode == "abort":
            await self._abort_generation()
        if not self._engine_asleep:
            if mode == "wait" and self.index.generating:
                return False
            await self.engine.sleep(desired.sleep_level, mode)
            self._engine_asleep, self._engine_paused, self._woken = True, mode, set()
        if new := desired.awake_tags - self._woken:
            await self.engine.wake_up(sorted(new))
            self._woken |= new
        return mode == "keep" or self.index.generating == 0

    async def _abort_generation(self) -> None:
        await self.index.cancel_all([r for r in self.index.records() if r.generation], "pause")
