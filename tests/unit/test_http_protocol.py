"""`rollout-svc serve`'s HTTP protocol (rollout_svc.api.http): the writes of one event-loop iteration reach the socket
as one, in order, and nothing buffered is lost at close. Served end to end (streams, disconnects) by
tests/integration/test_api.py, whose `serve` runs it."""

from __future__ import annotations

import asyncio

from rollout_svc.api.http import CoalescingTransport, http_protocol


class Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 8000) if name == "sockname" else default


async def test_writes_of_one_iteration_go_out_as_one_in_order() -> None:
    real = Recorder()
    transport = CoalescingTransport(real, asyncio.get_running_loop())
    transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    transport.write(memoryview(b"{}"))
    assert real.writes == []  # nothing yet: the iteration has not ended
    await asyncio.sleep(0)
    assert real.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    transport.write(b"a")  # a later iteration: a write of its own (a stream's next chunk)
    await asyncio.sleep(0)
    transport.writelines([b"b", b"c"])
    await asyncio.sleep(0)
    assert real.writes[1:] == [b"a", b"bc"]
    assert transport.get_extra_info("sockname") == ("127.0.0.1", 8000)  # the rest is the real transport's


async def test_close_sends_what_is_buffered_first_and_a_closed_socket_gets_nothing() -> None:
    real = Recorder()
    transport = CoalescingTransport(real, asyncio.get_running_loop())
    transport.write(b"last bytes")
    transport.close()
    assert real.writes == [b"last bytes"] and real.closed
    transport.write(b"after close")
    await asyncio.sleep(0)
    assert real.writes == [b"last bytes"]


def test_serve_runs_uvicorns_httptools_protocol_through_it() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    protocol = http_protocol()
    assert issubclass(protocol, HttpToolsProtocol) and protocol is not HttpToolsProtocol
