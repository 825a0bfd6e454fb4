"""SkyRL on rollout-svc: its protocol's shapes, token rendering and weight calls, and its engine interface in Python.

SkyRL 0.3.0's inference stack speaks vLLM's server protocol; this package holds that protocol without HTTP (the
routes are `rollout_svc.api.skyrl`), one module per role:

- `shapes.py`: the request bodies (vLLM's `GenerateRequest`; the weight routes' bodies);
- `tokens.py`: vLLM's token-in, token-out generate: sampling params as vLLM takes them, rollout requests, and
  trajectories rendered as vLLM's `GenerateResponse`;
- `weights.py`: vLLM's native weight-transfer calls made fleet-wide (`EngineWeightTransfer`);
- `engine.py`: SkyRL's `InferenceEngineInterface` over `RolloutClient` (`RolloutServiceEngine`, no HTTP hop);
- `modules.py`: loading SkyRL's own modules, unmodified (`skyrl_module`).

SkyRL is imported only when used: `import rollout_svc.integrations.skyrl` works without it installed (nor does it
import torch), and `RolloutServiceEngine` (a subclass of SkyRL's abstract class) is built on first access.

Example::

    from rollout_svc import RolloutClient
    from rollout_svc.integrations.skyrl import RolloutServiceEngine

    engine = RolloutServiceEngine(RolloutClient(redis_url="redis://127.0.0.1:6379/0"), model_name="my-model")
    out = await engine.generate({"prompt_token_ids": [[1, 2, 3]], "sampling_params": {"max_tokens": 8}})
"""

from __future__ import annotations

from typing import Any

from rollout_svc.integrations.skyrl.modules import BASE, skyrl_module

__all__ = ["BASE", "RolloutServiceEngine", "skyrl_module"]


def __getattr__(name: str) -> Any:
    if name == "RolloutServiceEngine":
        from rollout_svc.integrations.skyrl.engine import engine_class

        return engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
