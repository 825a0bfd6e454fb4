"""The LoRA adapters one worker holds: which version of each name new requests take, and which old versions still
have requests running on them (unloaded from the engine once none has).

The converger (`workers.converge`) brings the table to the fleet's desired adapters (`control.lora`) at every
control epoch; the serve path (`workers.serve`) takes an adapter for a request as it enters the engine
(`acquire`) and gives it back when the attempt ends (`release`). A version is one engine adapter: vLLM's
`LoRARequest(lora_name="{name}@{version}", lora_int_id=..., lora_path=...)`, its id unique in this engine.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_svc.control.lora import AdapterSpec, adapter_dir
from rollout_svc.errors import InvalidRequestError

if TYPE_CHECKING:
    from workers.engine import Engine

log = logging.getLogger("rollout_svc.worker")


@dataclass(frozen=True)
class AdapterRef:
    """One loaded version of an adapter: what a request runs with (`lora_id` is the engine's id for it)."""

    name: str
    version: int
    lora_id: int
    path: str

    @property
    def engine_name(self) -> str:
        return f"{self.name}@{self.version}"


class AdapterTable:
    """Adapters loaded in one engine: the current version of each name, old versions still in use."""

    def __init__(self) -> None:
        self.current: dict[str, AdapterRef] = {}
        self._loaded: dict[int, AdapterRef] = {}  # lora_id -> ref, current and draining versions
        self._in_use: Counter[int] = Counter()
        self._ids = itertools.count(1)

    def summary(self) -> str:
        """`name@version,...` of the current versions (the heartbeat's `adapters`)."""
        return ",".join(ref.engine_name for _, ref in sorted(self.current.items()))

    async def apply(self, desired: dict[str, AdapterSpec], engine: Engine, root: Path | None) -> dict[str, str]:
        """Load what `desired` names and this engine lacks (each name's version, from its directory resolved under
        `root`), retire what it no longer names. Returns why each adapter that failed to load failed, by name; the
        others are applied."""
        errors: dict[str, str] = {}
        for name, spec in sorted(desired.items()):
            held = self.current.get(name)
            if held is not None and held.version >= spec.version:
                continue
            try:
                path = str(adapter_dir(root, spec.path))
                ref = AdapterRef(name, spec.version, next(self._ids), path)
                await engine.add_adapter(ref.engine_name, ref.lora_id, ref.path)
            except InvalidRequestError as exc:
                errors[name] = f"adapter {name} v{spec.version}: {exc}"
                continue
            except Exception as exc:  # the engine refused it (rank too large, LoRA not enabled, bad files)
                log.exception("loading adapter %s v%d failed", name, spec.version)
                errors[name] = f"adapter {name} v{spec.version}: {type(exc).__name__}: {exc}"
                continue
            self.current[name], self._loaded[ref.lora_id] = ref, ref
            log.info("adapter %s version %d loaded from %s", name, ref.version, ref.path)
        for name in [n for n in self.current if n not in desired]:
            del self.current[name]
            log.info("adapter %s unloaded: new requests for it are refused", name)
        await self.collect(engine)
        return errors

    def acquire(self, name: str) -> AdapterRef | None:
        """The current version of `name` for a request entering the engine (None: not held here)."""
        ref = self.current.get(name)
        if ref is not None:
            self._in_use[ref.lora_id] += 1
        return ref

    async def release(self, ref: AdapterRef, engine: Engine) -> None:
        """A request on `ref` ended; an old version nothing runs on any more leaves the engine."""
        self._in_use[ref.lora_id] -= 1
        if self._in_use[ref.lora_id] <= 0:
            del self._in_use[ref.lora_id]
            await self.collect(engine)

    async def collect(self, engine: Engine) -> None:
        """Remove from the engine every loaded version that is neither current nor in use."""
        current = {ref.lora_id for ref in self.current.values()}
        for lora_id in [i for i in self._loaded if i not in current and not self._in_use[i]]:
            ref = self._loaded.pop(lora_id)
            try:
                await engine.remove_adapter(lora_id)
            except Exception:  # it stays in vLLM's cache, which evicts it when full: log, serve on
                log.exception("removing adapter %s from the engine failed", ref.engine_name)
