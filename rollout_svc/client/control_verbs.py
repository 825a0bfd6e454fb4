"""The control verbs of `RolloutClient` (pause, resume, abort, sleep, wake-up, prefix-cache reset, the fleet's desired
state): what steers the fleet, as opposed to what generates on it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from rollout_svc.client.connection import Connection
from rollout_svc.config import Settings
from rollout_svc.control import commands
from rollout_svc.control.commands import DEFAULT_HOLDER, Command
from rollout_svc.control.plane import FleetState
from rollout_svc.protocol import PauseMode


class ControlVerbs:
    """`RolloutClient`'s control commands, issued in every shard over the client's connection (`_connect`)."""

    settings: Settings
    _connect: Callable[[], Awaitable[Connection]]

    async def pause(
        self,
        mode: PauseMode = "keep",
        *,
        holder: str = DEFAULT_HOLDER,
        timeout_s: float | None = None,
        lease_s: float | None = None,
        renew: bool = True,
    ) -> int:
        """Pause the fleet: no worker takes rollout requests (they wait in the queue; deadlines keep running).

        `mode`: `keep` freezes in-flight requests with their KV cache until `resume`; `abort` cuts them (this
        client's own come back whole, retried token-exact after `resume`); `wait` returns once they finished.
        `holder` names who pauses (the fleet stays paused while any holder does). The pause is held under a lease
        of `lease_s` seconds (default `Settings.client.pause_lease_s`, 20 s) that this client renews while it is
        open: if this process dies, hangs or closes without `resume`, the pause lapses and the fleet serves again
        within the lease plus one heartbeat. `lease_s=0`: held until `resume`, whatever becomes of this process;
        `renew=False`: a timed pause, lapsing `lease_s` after it was issued. Returns the control epoch once every
        live worker acknowledged. Raises `ControlTimeoutError` naming those that did not within `timeout_s`
        (default `Settings.client.control_timeout_s`); the pause stays written, so a retry converges.
        """
        lease_s = self.settings.client.pause_lease_s if lease_s is None else lease_s
        return await self._issue(commands.pause(mode, holder=holder, lease_s=lease_s, renew=renew), timeout_s)

    async def renew_pause(self, holder: str, lease_s: float) -> bool:
        """Extend `holder`'s leased pause to `lease_s` from now (a pause taken with `renew=False` by another process,
        say `serve`'s for an HTTP holder). Returns False if it is no longer held: resumed, or lapsed already."""
        return await (await self._connect()).control.renew_lease(holder, lease_s)

    async def resume(self, *, holder: str = DEFAULT_HOLDER, timeout_s: float | None = None) -> int:
        """Release `holder`'s pause; kept requests continue, queued ones start. Returns the epoch once acked."""
        return await self._issue(commands.resume(holder=holder), timeout_s)

    async def pause_generation(self, mode: PauseMode = "keep", *, timeout_s: float | None = None) -> int:
        """SkyRL's name for `pause` (keep mode by default: in-flight requests freeze and continue on resume)."""
        return await self.pause(mode, timeout_s=timeout_s)

    async def resume_generation(self, *, timeout_s: float | None = None) -> int:
        """SkyRL's name for `resume`."""
        return await self.resume(timeout_s=timeout_s)

    async def is_paused(self, per_worker: bool = False) -> bool | dict[str, bool]:
        """Whether the fleet is paused (its desired state); `per_worker=True`: {worker id: paused or asleep}."""
        connection = await self._connect()
        if per_worker:
            return {w.worker_id: w.state in ("paused", "sleeping") for w in await connection.registry.live_workers()}
        return (await connection.control.state()).paused

    async def abort(
        self,
        request_ids: Sequence[str] | None = None,
        *,
        session_id: str | None = None,
        all: bool = False,
        timeout_s: float | None = None,
    ) -> int:
        """Abort requests without pausing: exactly one of `request_ids`, `session_id` or `all=True`.

        In-flight ones return partial trajectories and queued ones are answered unrun, all with
        `finish_reason="abort"`, `abort_cause="user"`; an explicit abort is final (not retried). A session or
        `all` abort hits requests enqueued before it; later ones run. Returns the epoch once every live worker
        acknowledged (`ControlTimeoutError` otherwise).
        """
        command = commands.abort(request_ids, session_id=session_id, all_requests=all)
        return await self._issue(command, timeout_s)

    async def sleep(self, level: int = 1, mode: PauseMode = "abort", *, timeout_s: float | None = None) -> int:
        """Put every engine to sleep (vLLM sleep mode; on CPU no memory is freed: `WorkerStatus.memory_released`).

        A sleeping worker takes no rollout requests; in-flight ones are first paused as `mode` says.
        """
        return await self._issue(commands.sleep(level, mode), timeout_s)

    async def wake_up(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None) -> int:
        """Wake the engines (all memory, or only the pools `tags` names); the pause state from before returns."""
        return await self._issue(commands.wake_up(tags), timeout_s)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, *, timeout_s: float | None = None) -> int:
        """Drop every engine's prefix cache (`ControlCommandError` names workers whose engine refused)."""
        return await self._issue(commands.reset_prefix_cache(reset_running_requests), timeout_s)

    async def _issue(self, command: Command, timeout_s: float | None) -> int:
        """Issue `command` in every shard; the epoch once every live worker acknowledged it (`FleetControl.issue`)."""
        return await (await self._connect()).control.issue(command, timeout_s=timeout_s)

    async def fleet_state(self) -> FleetState:
        """The fleet's desired control state: epoch, pause holders and mode, sleep level."""
        return await (await self._connect()).control.state()
