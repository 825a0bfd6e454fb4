"""Loading SkyRL's own modules, unmodified, on Python 3.11 (`skyrl_module`), without importing SkyRL before use."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

_NAMESPACES = ("skyrl.backends", "skyrl.backends.skyrl_train", "skyrl.train.generators")
BASE = "skyrl.backends.skyrl_train.inference_servers.base"  # SkyRL's `InferenceEngineInterface`


def skyrl_module(name: str) -> Any:
    """Import SkyRL's module `name` (say `skyrl.backends.skyrl_train.inference_servers.remote_inference_client`),
    unmodified.

    On Python 3.11, SkyRL 0.3.0's `skyrl/backends/__init__.py` fails (it imports the Tinker types, which need 3.12's
    `TypedDict` under pydantic), as does `skyrl/train/generators/__init__.py` (through the VLM generator's renderer):
    those package modules are registered as plain namespace modules first, which loads `inference_servers` without
    torch, Ray or vLLM, and `skyrl.train.generators.skyrl_gym_generator` (`SkyRLGymGenerator`) with skyrl-gym, torch
    and loguru (the dev extra). Raises `ImportError` (saying how to install it) where SkyRL is not installed.
    """
    try:
        import skyrl
    except ImportError as exc:
        raise ImportError(
            "SkyRL is not installed: pip install --no-deps skyrl==0.3.0 aiohttp (Python 3.11), or skyrl==0.4.0 on "
            "Python 3.12 (docs/testing.md says how `make install` makes that venv)"
        ) from exc
    root = Path(skyrl.__file__).parent
    for package in _NAMESPACES if sys.version_info < (3, 12) else ():  # SkyRL 0.4 on 3.12 imports as it is
        if package not in sys.modules:
            module = types.ModuleType(package)
            module.__path__ = [str(root.joinpath(*package.split(".")[1:]))]
            sys.modules[package] = module
    return importlib.import_module(name)
