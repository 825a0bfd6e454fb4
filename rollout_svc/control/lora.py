"""LoRA adapters as fleet state: what the control state hash holds of them, and how a worker finds one on disk.

The desired set of adapters is part of the control state (`Keys.state`, fields `adapter:{name}` =
`{version}:{path}`): `ControlPlane.load_adapter` and `unload_adapter` change it as commands, acknowledged by every
live worker once it loaded (or dropped) the adapter; a worker that starts later converges to it like to a pause.
Loading a name again with a new directory is a new version of that adapter: requests running on the old version
finish on it, new ones take the new one, and nothing pauses (vLLM runs several LoRA adapters in one batch).
Versions only go up (`adapter_last:{name}` keeps the newest ever given, across an unload).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rollout_svc.errors import InvalidRequestError

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
ADAPTER_FILES = ("adapter_config.json",)  # what peft's `save_pretrained` writes beside the weights


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter the fleet should hold: its newest `version` (from 1) and the directory it loads from (`path`,
    as the caller gave it: each worker resolves it under its own checkpoint root)."""

    version: int
    path: str

    def to_field(self) -> str:
        return f"{self.version}:{self.path}"

    @classmethod
    def from_field(cls, value: str) -> AdapterSpec:
        version, _, path = value.partition(":")
        return cls(int(version), path)


def check_adapter_name(name: str) -> str:
    """`name` if it can name an adapter (a letter or digit, then letters, digits, `.`, `_`, `-`; at most 128
    characters: it is the `model` of an OpenAI request); raises `InvalidRequestError` otherwise."""
    if not ADAPTER_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"adapter name {name!r} is not allowed: use 1 to 128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it is what requests give as `model`)"
        )
    return name


def adapter_dir(root: Path | None, path: str) -> Path:
    """The adapter directory `path` resolved (symlinks followed), if it lies under `root` (the worker's checkpoint
    root) and holds `adapter_config.json` (peft's format, which vLLM loads). Raises `InvalidRequestError` otherwise,
    as for checkpoints: a forged command cannot make a worker read arbitrary files."""
    if root is None:
        raise InvalidRequestError(
            "this worker has no checkpoint root, so it loads no adapter: set ROLLOUT_CHECKPOINT_ROOT to the directory "
            "the trainer writes adapters under"
        )
    base, resolved = Path(root).resolve(), Path(path).resolve()
    if not resolved.is_relative_to(base):
        raise InvalidRequestError(f"adapter {path} is outside this worker's checkpoint root {base}: refused")
    missing = [name for name in ADAPTER_FILES if not (resolved / name).is_file()]
    if missing:
        raise InvalidRequestError(f"adapter {path} holds no {', '.join(missing)} (save it with peft's save_pretrained)")
    return resolved
