"""The fleet as rich renderables, from `fleet_status`'s report: what `rollout-svc status` prints once and
`rollout-svc top` redraws."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.table import Table

WORKER_COLUMNS = (
    "worker", "state", "epoch", "engine", "model", "GPUs (TPxPPxDP)", "in flight", "work (tokens)", "capacity",
    "context / KV (tokens)", "served", "weight version", "adapters",
)  # fmt: skip


def fleet_line(report: dict[str, Any], now: float | None = None) -> str:
    """One line: serving, paused (by whom, in which mode, until when its lease lapses), asleep; lapsed pauses; the
    control epoch, the committed weight version and checkpoint, the LoRA adapters."""
    now = time.time() if now is None else now
    if report["paused"]:
        leases = report["pause_leases"]
        until = {h: f"lease lapses in {when - now:.0f} s" for h, when in leases.items()}
        holders = ", ".join(
            f"{h} ({m}, {until.get(h, 'held until resumed')})" for h, m in report["pause_holders"].items()
        )
        fleet = f"fleet: paused ({report['pause_mode']}) by {holders}"
    else:
        fleet = "fleet: asleep" if report["sleep_level"] else "fleet: serving"
    for holder, when in report["lapsed_pauses"].items():
        ago = f"{now - when:.0f} s ago ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))})"
        fleet += f"; the pause of {holder} lapsed {ago}: its holder stopped renewing its lease (it died or hung)"
    adapters = ", ".join(f"{name} v{a['version']}" for name, a in report.get("adapters", {}).items())
    return (
        f"{fleet}; control epoch {report['epoch']}; weight version {report['weight_version']}"
        + (f" (from {report['weight_checkpoint']})" if report["weight_checkpoint"] else "")
        + (f"; LoRA adapters: {adapters}" if adapters else "")
    )


def status_view(report: dict[str, Any], rates: dict[str, float] | None = None) -> Group:
    """The fleet line, a table of the workers (with a "requests/s" column where `rates` gives each worker's served
    requests a second, `FleetHistory.worker_rates`), a table of the streams, dead letters and named steps."""
    columns = WORKER_COLUMNS + (("requests/s",) if rates is not None else ())
    gpus = sum(w["weight_ranks"] for w in report["workers"])
    workers = Table(*columns, title=f"{len(report['workers'])} worker processes, {gpus} GPUs (ranks)")
    for w in report["workers"]:
        layout = f"{w['tensor_parallel_size']}x{w['pipeline_parallel_size']}x{w['data_parallel_size']}"
        row = [
            w["worker_id"], w["state"], str(w["applied_epoch"]), w["engine"], w["model"],
            f"{w['weight_ranks']} ({layout})", str(w["in_flight"]), str(report["loads"].get(w["worker_id"], 0)),
            str(w["capacity"]), f"{w.get('max_model_len', 0):,} / {w.get('kv_cache_tokens', 0):,}", str(w["served"]),
            str(w["weight_version"]), w.get("adapters", "") or "-",
        ]  # fmt: skip
        if rates is not None:
            row.append(f"{rates.get(w['worker_id'], 0.0):,.1f}")
        workers.add_row(*row)
    streams = Table("stream", "length", "queued", "pending")
    for name, depth in report["streams"].items():
        streams.add_row(name, str(depth["length"]), str(depth["queued"]), str(depth["pending"]))
    return Group(
        fleet_line(report),
        workers,
        streams,
        f"dead letters: {report['dead_letters']}; named steps: {report['steps']['live']} live, "
        f"{report['steps']['expired']} expired unattached (their results uncollected)",
    )
