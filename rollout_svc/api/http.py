"""uvicorn's httptools protocol with one socket write per response: what `rollout-svc serve` runs.

uvicorn writes a response's status line and headers when the app sends `http.response.start`, and its body when the
app sends `http.response.body`: two `send` system calls, and two wake-ups of a client waiting for the response (it
reads the headers, then waits again for the body). aiohttp's server and vllm-router send a small response in one.
Here every write the protocol makes within one event-loop iteration is joined into one, made at the end of that
iteration (`loop.call_soon`): a JSON response (start and body sent in one step of the app) goes out whole; a stream's
chunks still go out as the app yields them. Measured in BENCHMARKS.md (i) (SkyRL's client at 1 in flight).
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescingTransport:
    """A transport whose writes in one event-loop iteration reach the socket as one write, in order; `close()` sends
    what is buffered first. Everything else (flow control, `get_extra_info`, `is_closing`) is the wrapped transport's.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._buffer: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._buffer:
            self._loop.call_soon(self._flush)
        self._buffer.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def _flush(self) -> None:
        if not self._buffer:
            return
        data = self._buffer[0] if len(self._buffer) == 1 else b"".join(self._buffer)
        self._buffer.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def http_protocol() -> Any:
    """The `http` argument for `uvicorn.run`: uvicorn's httptools protocol writing through a `CoalescingTransport`,
    or "auto" (uvicorn's choice, unchanged) where httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # uvicorn without httptools: its h11 protocol, as is
        return "auto"

    class CoalescingHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            wrapped: Any = CoalescingTransport(transport, self.loop)
            super().connection_made(wrapped)

    return CoalescingHttpToolsProtocol
