"""One connection held by one sequential user, its commands written and read on it directly: the hot paths."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import hiredis
import redis.asyncio
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

BLOCKING_READS = ("XREADGROUP", "XREAD", b"XREADGROUP", b"XREAD")  # what `DirectConnection.execute` times longer


class DirectConnection:
    """A connection out of `client`'s pool, held by one sequential user (a worker's take loop or its publisher, a
    producer's submitter or its result reader), or `borrowed` for one call, and used directly: `execute` writes its
    commands in one send and reads their replies in order.

    Why: redis-py's per-command path (a pool checkout and release, its retry wrapper, a task per write, response
    callbacks) costs about 50 us of CPU per command on this machine's 2 cores (a PING: 165 us through the client,
    115 us here), and one request crosses four commands on its way (enqueue, the worker's read, its publish, the
    producer's read of the result); at one request in flight that CPU is latency.

    Replies are as Redis sends them (RESP3 maps where Redis sends maps; `stream_records` reads stream replies), not
    passed through redis-py's response callbacks. A connection error, a timeout or a cancellation mid-call
    disconnects it (a reply may be left unread) and is raised, not retried: the callers' loops retry, and the next
    call checks out a fresh connection. Not for concurrent use.
    """

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        self._connection: Any = None
        self.known_client_id: int | None = None  # its connection's CLIENT ID, once asked (`client_id`)

    async def execute(self, *commands: Sequence[Any]) -> list[Any]:
        """Send `commands` (each a command and its arguments: str, bytes, int or float) in one write; their replies,
        in order. A command that Redis answered with an error has the `ResponseError` as its reply (as redis-py's
        pipeline with `raise_on_error=False`): one failed command does not lose the others' replies.

        The whole call gets the client's socket timeout, once (redis-py arms one per write and per reply), plus
        the longest block of its blocking stream reads (`XREAD` / `XREADGROUP ... BLOCK ms`), as
        `connections.urls.SOCKET_TIMEOUT_S` says: a read may block longer than the socket timeout. Raises redis-py's
        `ConnectionError`, or its `TimeoutError` past that timeout, if Redis is away."""
        connection = self._connection
        if connection is not None and _transport_closed(connection):
            await self.aclose()  # its socket died while it was idle: a fresh connection (and CLIENT ID) instead
            connection = None
        if connection is None:
            connection = self._connection = await self.client.connection_pool.get_connection()
        timeout_s = connection.socket_timeout
        if timeout_s is not None:
            timeout_s += _block_s(commands)
        try:
            async with asyncio.timeout(timeout_s):
                await self._send(connection, _packed(commands))
                replies = []
                for _ in commands:
                    try:
                        replies.append(await connection.read_response(timeout=math.inf))  # timed above
                    except ResponseError as exc:
                        replies.append(exc)
                return replies
        except BaseException as exc:
            await self.aclose()
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"no reply from Redis within {timeout_s} s") from exc
            raise

    @staticmethod
    async def _send(connection: Any, packed: bytes) -> None:
        """Write `packed` as redis-py does but without its `wait_for` (the caller times the call), which on Python
        3.11 runs each write in a task of its own (a loop iteration later, and ~20 us of CPU)."""
        timeout, connection.socket_timeout = connection.socket_timeout, None
        try:
            await connection.send_packed_command(packed, check_health=False)
        finally:
            connection.socket_timeout = timeout

    async def scripts(self, script: AsyncScript, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> list[Any]:
        """EVALSHA `script` (`register_script`'s) once per (keys, args) of `calls`, in one round trip; their replies.
        A Redis without the script (it restarted: NOSCRIPT) is given it (SCRIPT LOAD) and the calls are sent again.
        Raises the first call's error."""
        for _ in range(2):
            replies = await self.execute(*(("EVALSHA", script.sha, len(keys), *keys, *args) for keys, args in calls))
            if any(isinstance(reply, NoScriptError) for reply in replies):
                [sha] = await self.execute(("SCRIPT", "LOAD", script.script))
                script.sha = sha.decode() if isinstance(sha, bytes) else sha
                continue
            if errors := [reply for reply in replies if isinstance(reply, ResponseError)]:
                raise errors[0]
            return replies
        raise NoScriptError("the script was not loaded; Redis lost it twice in a row")

    async def client_id(self) -> int:
        """This connection's client id in Redis (CLIENT ID, asked once per connection): the one `CLIENT UNBLOCK`
        names; `known_client_id` holds it until the connection is given up."""
        if self.known_client_id is None or self._connection is None:
            [reply] = await self.execute(("CLIENT", "ID"))
            self.known_client_id = int(reply)
        return self.known_client_id

    async def release(self) -> None:
        """Give the connection back to its pool as it is (connected, every reply read), for the next user."""
        connection, self._connection, self.known_client_id = self._connection, None, None
        if connection is not None:
            await self.client.connection_pool.release(connection)

    async def aclose(self) -> None:
        """Give the connection back to its pool, disconnected."""
        connection, self._connection, self.known_client_id = self._connection, None, None
        if connection is not None:
            try:
                await connection.disconnect()
            finally:
                await self.client.connection_pool.release(connection)


@contextlib.asynccontextmanager
async def borrowed(client: redis.asyncio.Redis) -> AsyncIterator[DirectConnection]:
    """A `DirectConnection` for one call of a shared client (any number at once, each on a connection of its own
    from the pool), given back to the pool when the call is done."""
    direct = DirectConnection(client)
    try:
        yield direct
    finally:
        await direct.release()


def _transport_closed(connection: Any) -> bool:
    """Whether the event loop has closed `connection`'s transport (its socket failed: reset, or timed out by
    keepalive), which redis-py notices only on its next read (`connections.urls.reconnecting` says why it matters)."""
    writer = getattr(connection, "_writer", None)
    return writer is not None and writer.transport.is_closing()


def _block_s(commands: Sequence[Sequence[Any]]) -> float:
    """The longest block, in seconds, of the blocking stream reads among `commands`; 0 if none blocks."""
    longest = 0.0
    for command in commands:
        if command[0] in BLOCKING_READS:
            for at, arg in enumerate(command[:-1]):
                if arg in (b"BLOCK", "BLOCK"):
                    longest = max(longest, int(command[at + 1]) / 1000)
    return longest


def _packed(commands: Sequence[Sequence[Any]]) -> bytes:
    """`commands` in the Redis protocol, packed by hiredis (in C: ~6x faster than redis-py's packer, same bytes)."""
    return b"".join(hiredis.pack_command(tuple(command)) for command in commands)


def stream_records(reply: Any) -> list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """An XREAD or XREADGROUP reply as Redis sends it (RESP3: {stream: [[id, [field, value, ...]], ...]}; RESP2: the
    same as [[stream, [...]], ...]) as [(stream, [(entry id, {field: value}), ...]), ...]; an entry deleted while
    pending (its fields nil) has no fields."""
    if not reply:
        return []
    pairs = reply.items() if isinstance(reply, dict) else reply
    return [
        (
            stream,
            [(entry_id, dict(zip(flat[::2], flat[1::2], strict=True)) if flat else {}) for entry_id, flat in records],
        )
        for stream, records in pairs
    ]
