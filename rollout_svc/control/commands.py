"""The control commands an issuer builds: one builder per verb checks its arguments and says what the command changes
in the desired state; `ControlPlane.issue` (one shard) and `FleetControl.issue` (every shard) send any of them.

A `Command` carries what is logged and applied (its `kind` and `args`, as the workers read them from the
`ControlCommand` logged under its epoch: DESIGN.md section 4, "Control semantics") and what its issue script writes
into the state hash. Example::

    await fleet_control.issue(commands.pause("keep", holder="trainer", lease_s=20.0), timeout_s=30)
    await fleet_control.issue(commands.abort(session_id="s-1"))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from rollout_svc.config import MAX_LEASE_S
from rollout_svc.control.lora import AdapterSpec, check_adapter_name
from rollout_svc.errors import InvalidRequestError
from rollout_svc.keys import StateField
from rollout_svc.protocol import PauseMode

SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's memory pools: asleep until both are woken
DEFAULT_HOLDER = "operator"


@dataclass(frozen=True)
class Command:
    """A control command on its way. `kind` and `args`: what is logged and what the workers apply. `set_fields` and
    `del_fields`: what its issue writes into the state hash, and removes; `lease`: a field the issue script sets to
    Redis' now plus that many ms (a leased pause). `sweep`: its issue answers, unrun, the queued requests it hits (an
    abort of a session or of all). `renew`: a leased pause its issuer renews while it lives (`PauseLeases`)."""

    kind: str
    args: dict[str, Any]
    set_fields: dict[str, str] = field(default_factory=dict)
    del_fields: list[str] = field(default_factory=list)
    lease: tuple[str, int] = ("", 0)
    sweep: bool = False
    renew: bool = False


def pause(
    mode: PauseMode = "keep", *, holder: str = DEFAULT_HOLDER, lease_s: float = 0.0, renew: bool = True
) -> Command:
    """Stop taking requests; in-flight ones are frozen (`keep`), aborted (`abort`) or finished (`wait`); the fleet
    stays paused while any holder holds a pause. `lease_s` > 0: the pause lapses that long after it was issued or
    last renewed (`renew`: its issuer renews it while it lives); 0: it is held until `resume`. Its issue returns once
    every live worker applied it (for `wait`, once their in-flight requests finished). Raises `InvalidRequestError`
    for an unknown mode or a lease outside 0 to `MAX_LEASE_S`."""
    _check_mode(mode)
    if not 0 <= lease_s <= MAX_LEASE_S:
        raise InvalidRequestError(
            f"a pause's lease must be 0 (none) to {MAX_LEASE_S:g} seconds, got {lease_s}; to hold a pause until "
            "resume, give none"
        )
    lease_ms = int(lease_s * 1000)
    unset = [StateField.lapsed(holder)] + ([StateField.lease(holder)] if lease_ms <= 0 else [])
    args: dict[str, Any] = {"mode": mode, "holder": holder}
    if lease_ms <= 0:
        return Command("pause", args, {StateField.holder(holder): mode}, unset)
    lease = (StateField.lease(holder), lease_ms)
    args["lease_s"] = lease_s
    return Command("pause", args, {StateField.holder(holder): mode}, unset, lease, renew=renew)


def resume(*, holder: str = DEFAULT_HOLDER) -> Command:
    """Release `holder`'s pause; the fleet serves again once no holder holds one."""
    return Command("resume", {"holder": holder}, del_fields=[StateField.holder(holder), StateField.lease(holder)])


def abort(
    request_ids: Sequence[str] | None = None, *, session_id: str | None = None, all_requests: bool = False
) -> Command:
    """Abort requests without pausing: in-flight ones return partial trajectories, queued ones are answered unrun, all
    with `finish_reason="abort"`, `abort_cause="user"`, and neither is retried. Exactly one scope: `request_ids`
    (also hits their retries), `session_id`, or `all_requests`; a session or all abort hits requests enqueued before
    the command (later ones run). Raises `InvalidRequestError` unless exactly one scope is given."""
    if sum((request_ids is not None, session_id is not None, bool(all_requests))) != 1:
        raise InvalidRequestError("abort needs exactly one of request_ids, session_id or all=True")
    args = {"request_ids": list(request_ids or []), "session_id": session_id, "all": bool(all_requests)}
    return Command("abort", args, sweep=session_id is not None or bool(all_requests))


def sleep(level: int = 1, mode: PauseMode = "abort") -> Command:
    """Put the engines to sleep (vLLM sleep mode: level 1 offloads weights and drops the KV cache, level 2 drops
    both). A sleeping worker takes no requests; in-flight ones are first paused as `mode` says. On CPU vLLM frees no
    memory: workers report `memory_released=False`. Raises `InvalidRequestError` for a level below 1 or an unknown
    mode."""
    _check_mode(mode)
    if level < 1:
        raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}; to pause use pause()")
    fields = {StateField.SLEEP_LEVEL: str(level), StateField.SLEEP_MODE: mode}
    return Command("sleep", {"level": level, "mode": mode}, fields, [StateField.awake(t) for t in SLEEP_TAGS])


def wake_up(tags: Sequence[str] | None = None) -> Command:
    """Restore engine memory: all of it, or only the pools `tags` names (`weights`, `kv_cache`). Once all are awake
    the fleet serves again, paused or not as it was before the sleep. Raises `InvalidRequestError` for unknown tags."""
    unknown = set(tags or ()) - set(SLEEP_TAGS)
    if unknown:
        raise InvalidRequestError(f"unknown wake-up tags {sorted(unknown)}; known: {', '.join(SLEEP_TAGS)}")
    if tags:
        return Command("wake_up", {"tags": list(tags)}, {StateField.awake(t): "1" for t in tags})
    fields = {StateField.SLEEP_LEVEL: "0"}
    return Command("wake_up", {"tags": None}, fields, [StateField.awake(t) for t in SLEEP_TAGS])


def reset_prefix_cache(reset_running_requests: bool = False) -> Command:
    """Drop every engine's cached prefixes. Without `reset_running_requests` vLLM refuses while requests hold KV
    blocks, and the command fails naming those workers (`ControlCommandError`)."""
    return Command("reset_prefix_cache", {"reset_running_requests": reset_running_requests})


def load_adapter(name: str, path: str, version: int) -> Command:
    """Load the LoRA adapter in directory `path` (peft's format, under every worker's checkpoint root) as `name`
    at `version` (above every earlier version of `name`: the issue checks, `FleetControl.next_adapter_version` gives
    the next one): the old version stays loaded until the requests running on it finish; new requests take the new
    one; nothing pauses. A worker whose load fails (a path outside its root, no `adapter_config.json`, a rank above
    the engine's `max_lora_rank`, LoRA not enabled) is named by the issue's `ControlCommandError`. Raises
    `InvalidRequestError` for a bad name or no path."""
    check_adapter_name(name)
    if not path:
        raise InvalidRequestError("load_adapter needs the adapter's directory (peft's save_pretrained output)")
    spec = AdapterSpec(version, str(path))
    fields = {StateField.adapter(name): spec.to_field(), StateField.adapter_last(name): str(version)}
    return Command("load_adapter", {"name": name, "path": str(path), "version": version}, fields)


def unload_adapter(name: str) -> Command:
    """Drop the adapter `name` from every worker (each once nothing runs on it); requests for it then fail with
    `unknown_adapter` (HTTP 404). Its issue raises `ModelNotFoundError` if the fleet holds no adapter of that name.
    Raises `InvalidRequestError` for a bad name."""
    check_adapter_name(name)
    return Command("unload_adapter", {"name": name}, del_fields=[StateField.adapter(name)])


def _check_mode(mode: str) -> None:
    if mode not in get_args(PauseMode):
        raise InvalidRequestError(f"unknown pause mode {mode!r}; use one of {', '.join(get_args(PauseMode))}")
