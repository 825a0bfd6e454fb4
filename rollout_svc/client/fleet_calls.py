"""The fleet calls of `RolloutClient`: control commands (pause, resume, abort, sleep, wake-up, prefix-cache reset),
sessions, and the live workers. A mixin: `RolloutClient` gives it its connection."""

from __future__ import annotations

from collections.abc import Sequence

from rollout_svc.client.connection import Connection
from rollout_svc.control.lora import AdapterSpec
from rollout_svc.control.plane import DEFAULT_HOLDER, FleetState
from rollout_svc.errors import ModelNotFoundError
from rollout_svc.protocol import PauseMode, WorkerStatus


class FleetCalls:
    """What `RolloutClient` does to the fleet rather than with requests."""

    async def _connect(self) -> Connection:
        raise NotImplementedError  # RolloutClient's

    # --- control ----------------------------------------------------------------------------------------

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
        connection = await self._connect()
        lease_s = connection.settings.client.pause_lease_s if lease_s is None else lease_s
        return await connection.control.pause(mode, holder=holder, timeout_s=timeout_s, lease_s=lease_s, renew=renew)

    async def resume(self, *, holder: str = DEFAULT_HOLDER, timeout_s: float | None = None) -> int:
        """Release `holder`'s pause; kept requests continue, queued ones start. Returns the epoch once acked."""
        return await (await self._connect()).control.resume(holder=holder, timeout_s=timeout_s)

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
        return await (await self._connect()).control.abort(request_ids, session_id, all, timeout_s=timeout_s)

    async def sleep(self, level: int = 1, mode: PauseMode = "abort", *, timeout_s: float | None = None) -> int:
        """Put every engine to sleep (vLLM sleep mode; on CPU no memory is freed: `WorkerStatus.memory_released`).

        A sleeping worker takes no rollout requests; in-flight ones are first paused as `mode` says.
        """
        return await (await self._connect()).control.sleep(level, mode, timeout_s=timeout_s)

    async def wake_up(self, tags: Sequence[str] | None = None, *, timeout_s: float | None = None) -> int:
        """Wake the engines (all memory, or only the pools `tags` names); the pause state from before returns."""
        return await (await self._connect()).control.wake_up(tags, timeout_s=timeout_s)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, *, timeout_s: float | None = None) -> int:
        """Drop every engine's prefix cache (`ControlCommandError` names workers whose engine refused)."""
        control = (await self._connect()).control
        return await control.reset_prefix_cache(reset_running_requests, timeout_s=timeout_s)

    async def fleet_state(self) -> FleetState:
        """The fleet's desired control state: epoch, pause holders and mode, sleep level."""
        return await (await self._connect()).control.state()

    # --- LoRA adapters ----------------------------------------------------------------------------------

    async def load_adapter(
        self, name: str, path: str, *, version: int | None = None, timeout_s: float | None = None
    ) -> int:
        """Load the LoRA adapter in directory `path` (peft's `save_pretrained` output, under the workers'
        checkpoint root) as `name` on every worker, or a new version of `name`: requests on the old version finish
        on it, new ones take the new one, nothing pauses. Returns the version (default: the newest + 1) once every
        live worker loaded it. Raises `ControlCommandError` naming each worker whose load failed and why."""
        return await (await self._connect()).control.load_adapter(name, path, version=version, timeout_s=timeout_s)

    async def unload_adapter(self, name: str, *, timeout_s: float | None = None) -> int:
        """Drop adapter `name` fleet-wide (requests running on it finish); requests for it then raise
        `ModelNotFoundError`. Returns the epoch."""
        return await (await self._connect()).control.unload_adapter(name, timeout_s=timeout_s)

    async def adapters(self) -> dict[str, AdapterSpec]:
        """The adapters the fleet holds: name -> its newest version and directory."""
        return (await self.fleet_state()).adapters

    async def _check_adapter(self, name: str | None) -> None:
        """Raise `ModelNotFoundError` unless the fleet holds adapter `name` (None: the base model, always)."""
        if name is not None and name not in (held := await self.adapters()):
            raise ModelNotFoundError(name, sorted(held))

    # --- sessions and fleet -----------------------------------------------------------------------------

    async def finish_session(self, session_id: str) -> bool:
        """Unpin a session: its next request is placed anew. Returns whether it was pinned."""
        return await (await self._connect()).session_streams(session_id).finish_session(session_id)

    async def session_worker(self, session_id: str) -> str | None:
        """The worker a session is pinned to, or None."""
        return await (await self._connect()).session_streams(session_id).pinned_worker(session_id)

    async def workers(self) -> list[WorkerStatus]:
        """Live workers (heartbeat not expired), sorted by id, with their control state (`state`, `applied_epoch`)."""
        return await (await self._connect()).registry.live_workers()

    async def named_models(self) -> list[str]:
        """The named models whose workers ever registered in this deployment (`Settings.model_name`; each has queues
        and control state of its own: address one with `RolloutClient(settings, model_name=...)`)."""
        return await (await self._connect()).fleet.named_models()

    async def world_size(self) -> int:
        """GPUs (ranks) behind the live workers: each worker's tensor x pipeline x data parallel size, summed (1 per
        echo or sim engine). `len(await workers())` counts worker processes."""
        return sum(w.weight_ranks for w in await self.workers())
