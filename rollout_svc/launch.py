"""The Ray worker group's first import path, kept working: `from rollout_svc.launch import RayWorkerGroup`.

Ray worker groups are deployment code and live in `rollout_svc.deploy.ray`. This alias loads that module when one
of its names is first asked for, so importing the runtime never loads deployment code (or Ray)."""

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    return getattr(importlib.import_module("rollout_svc.deploy.ray"), name)
