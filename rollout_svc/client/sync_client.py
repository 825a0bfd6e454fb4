"""`SyncRolloutClient`: `RolloutClient`'s methods, blocking, on a private event loop thread (for code that is not
async: a notebook, a synchronous trainer)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import Settings
from rollout_svc.protocol import Trajectory

T = TypeVar("T")


class SyncRolloutClient:
    """Blocking wrapper: the same methods as `RolloutClient`, run on a private event loop thread.

    Example::

        client = SyncRolloutClient(redis_url="redis://127.0.0.1:6379/0")
        trajectories = client.generate([[1, 2, 3]], {"max_tokens": 8})
        for index, trajectory in client.as_completed([[1, 2], [3]], {"max_tokens": 8}):
            print(index, trajectory.text)
        client.close()
    """

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        self.client = RolloutClient(settings, **overrides)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"client": self.client}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.client, self._loop, self._thread = state["client"], None, None

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)
        if not asyncio.iscoroutinefunction(method):
            return method
        return lambda *args, **kwargs: self._run(method(*args, **kwargs))

    def as_completed(self, *args: Any, **kwargs: Any) -> Iterator[tuple[int, Trajectory]]:
        """The blocking twin of `RolloutClient.as_completed`; leaving the loop early cancels the rest."""
        iterator = self.client.as_completed(*args, **kwargs)
        try:
            while True:
                try:
                    yield self._run(_next(iterator))
                except StopAsyncIteration:
                    return
        finally:
            self._run(iterator.aclose())  # type: ignore[attr-defined]

    def close(self) -> None:
        """Close the client, then stop and close the private event loop."""
        if self._loop is not None and self._thread is not None:
            self._run(self.client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _next(iterator: AsyncIterator[T]) -> T:
    return await anext(iterator)
