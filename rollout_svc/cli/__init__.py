"""The `rollout-svc` command (entry point `rollout_svc.cli:app`): one module per group of subcommands."""

from rollout_svc.cli.main import app

__all__ = ["app"]
