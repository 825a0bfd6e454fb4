"""`rollout-svc adapter load|unload|list`: LoRA adapters as fleet state (`rollout_svc.control.lora`)."""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING, Annotated

import typer

from rollout_svc.cli.common import DEFAULT_REDIS_URL, RedisUrl, TimeoutS, run_on_fleet
from rollout_svc.control import commands

if TYPE_CHECKING:
    from rollout_svc.fleet import FleetControl

adapter_app = typer.Typer(
    no_args_is_help=True,
    help="LoRA adapters, fleet-wide: load (or load a new version), unload, list. Requests name one as `model`.",
)


@adapter_app.command("load")
def load(
    name: Annotated[str, typer.Argument(help="The adapter's name: what requests give as `model`.")],
    path: Annotated[
        str, typer.Argument(help="Its directory (peft's save_pretrained output, under the workers' checkpoint root).")
    ],
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    version: Annotated[int | None, typer.Option(min=1, help="Its version (default: the newest one + 1).")] = None,
    timeout_s: TimeoutS = None,
) -> None:
    """Load a LoRA adapter on every worker, or a new version of one: requests running on the old version finish on
    it, new requests take the new one, nothing pauses."""

    async def load_at(control: FleetControl) -> int:
        chosen = await control.next_adapter_version(name, version)
        await control.issue(commands.load_adapter(name, path, chosen), timeout_s=timeout_s)
        return chosen

    loaded = run_on_fleet(redis_url, f"loading adapter {name}", load_at)
    typer.echo(f"adapter {name} version {loaded} loaded from {path} by every live worker")


@adapter_app.command("unload")
def unload(
    name: Annotated[str, typer.Argument(help="The adapter's name.")],
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    timeout_s: TimeoutS = None,
) -> None:
    """Unload a LoRA adapter fleet-wide (requests running on it finish); requests for it then get 404."""
    command = partial(commands.unload_adapter, name)
    what = f"unloading adapter {name}"
    epoch = run_on_fleet(redis_url, what, lambda control: control.issue(command(), timeout_s=timeout_s))
    typer.echo(f"adapter {name} unloaded: control epoch {epoch}, acknowledged by every live worker")


@adapter_app.command("list")
def list_adapters(
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The adapters the fleet holds: name, newest version, directory."""

    async def adapters(control: FleetControl) -> dict[str, dict[str, object]]:
        state = await control.state()
        return {name: {"version": s.version, "path": s.path} for name, s in sorted(state.adapters.items())}

    held = run_on_fleet(redis_url, "listing adapters", adapters)
    if as_json:
        typer.echo(json.dumps(held))
        return
    if not held:
        typer.echo("no adapters loaded (load one with `rollout-svc adapter load NAME PATH`)")
    for name, spec in held.items():
        typer.echo(f"{name}  version {spec['version']}  {spec['path']}")
