"""A request's hot path on a real Redis: its own connections (`DirectConnection`: replies in order, errors as
replies, a script Redis lost is loaded again, a broken call gives the connection up, the streams' reads parse as the
client's do), an idle worker's answer sent before its next take with its load counted exactly, and a caller's answer
sent before the results reader's next read."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from rollout_svc.client.results import ResultRouter
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import Settings
from rollout_svc.connections.urls import redis_async
from rollout_svc.dataplane.direct import DirectConnection, stream_records
from rollout_svc.dataplane.producer_streams import ProducerStreams
from rollout_svc.dataplane.streams import StreamConnection
from rollout_svc.dataplane.worker_streams import WorkerStreams
from rollout_svc.keys import PAYLOAD_FIELD, PINNED_SUFFIX, WORKERS_GROUP


def test_replies_come_in_order_with_an_error_in_its_place(redis_url: str, rds: redis.Redis) -> None:
    async def main() -> list:
        client = redis_async(redis_url, decode_responses=False)
        direct = DirectConnection(client)
        try:
            return await direct.execute(("SET", "k", "v"), ("HGET", "k", "f"), ("GET", "k"))
        finally:
            await direct.aclose()
            await client.aclose()

    ok, error, value = asyncio.run(main())
    assert ok in (b"OK", "OK", True)
    assert isinstance(error, ResponseError) and "WRONGTYPE" in str(error)
    assert value == b"v"  # the reply after an error is not lost


def test_a_script_redis_lost_is_loaded_again(redis_url: str, rds: redis.Redis) -> None:
    async def main() -> list:
        client = redis_async(redis_url, decode_responses=False)
        direct = DirectConnection(client)
        script = client.register_script("return {KEYS[1], ARGV[1]}")
        try:
            [first] = await direct.scripts(script, [(["a"], [1])])
            rds.script_flush()  # as after a restart: NOSCRIPT for the next EVALSHA
            [second] = await direct.scripts(script, [(["b"], [2])])
            with pytest.raises(ResponseError):
                await direct.scripts(client.register_script("return redis.call('HGET', KEYS[1], 'f')"), [(["k"], [])])
            return [first, second]
        finally:
            await direct.aclose()
            await client.aclose()

    rds.set("k", "v")
    assert asyncio.run(main()) == [[b"a", b"1"], [b"b", b"2"]]


def test_a_call_cut_short_gives_up_its_connection_and_the_next_uses_a_fresh_one(
    redis_url: str, rds: redis.Redis
) -> None:
    async def main() -> tuple[int, int, int]:
        client = redis_async(redis_url, decode_responses=False)
        direct = DirectConnection(client)
        try:
            before = await direct.client_id()
            blocked = asyncio.create_task(direct.execute(("BLPOP", "never", 5)))
            await asyncio.sleep(0.2)
            blocked.cancel()  # a reply left unread: the connection cannot be used again
            with pytest.raises(asyncio.CancelledError):
                await blocked
            after = await direct.client_id()
            rds.client_kill_filter(_id=after)
            with pytest.raises((RedisConnectionError, ConnectionError)):
                await direct.execute(("PING",))
            return before, after, await direct.client_id()
        finally:
            await direct.aclose()
            await client.aclose()

    before, after, again = asyncio.run(main())
    assert len({before, after, again}) == 3, (before, after, again)


def test_a_blocking_read_may_block_longer_than_the_socket_timeout(redis_url: str, rds: redis.Redis) -> None:
    # Found with ROLLOUT_READ_BLOCK_MS=10000: every worker read failed "no reply from Redis within 10.0 s".
    rds.xgroup_create("s", WORKERS_GROUP, id="0", mkstream=True)

    async def main() -> list[Any]:
        client = redis_async(redis_url, decode_responses=False, socket_timeout=0.3)
        direct = DirectConnection(client)
        try:
            read = ("XREADGROUP", "GROUP", WORKERS_GROUP, "w", "COUNT", 1, "BLOCK", 600, "STREAMS", "s", ">")
            replies = await direct.execute(read)  # blocks 0.6 s, twice the socket timeout: answered empty
            with pytest.raises(redis.exceptions.TimeoutError, match=r"within 0\.3 s"):
                await direct.execute(("BLPOP", "never", 1))  # not a stream read: the socket timeout holds
            return replies
        finally:
            await direct.aclose()
            await client.aclose()

    replies = asyncio.run(main())
    assert replies in ([None], [{}], [[]]), replies


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_the_next_command_after_a_socket_died_goes_out_on_a_fresh_connection(
    redis_url: str, rds: redis.Redis, run: Callable[[Any], Any]
) -> None:
    """A socket that failed while its connection was idle (reset; timed out by keepalive) leaves the event loop's
    transport closed. On uvloop, which serve runs on, the next write raised `RuntimeError` ("the handler is closed")
    and serve answered a 500 after its Redis connections were reset; on asyncio's loop the write was dropped and its
    read raised `ConnectionError`. Now the next command, through redis-py's client or a `DirectConnection`,
    reconnects first (`connections.urls.reconnecting`) and goes through."""

    async def main() -> tuple[int, int]:
        client = redis_async(redis_url, decode_responses=False)
        direct = DirectConnection(client)
        try:
            assert await client.ping()
            before = await direct.client_id()
            idle = [direct._connection, *client.connection_pool._available_connections]
            for connection in idle:
                connection._writer.transport.abort()  # as the loop does with a socket that failed
            await asyncio.sleep(0.05)
            assert await client.ping()
            [pong] = await direct.execute(("PING",))
            assert pong in (b"PONG", "PONG")
            [actual] = await direct.execute(("CLIENT", "ID"))
            assert await direct.client_id() == actual  # the id CLIENT UNBLOCK names is the new connection's
            return before, actual
        finally:
            await direct.aclose()
            await client.aclose()

    before, after = run(main())
    assert before != after  # a fresh connection


def test_stream_replies_parse_as_the_clients_do(settings: Settings, rds: redis.Redis) -> None:
    """A worker's blocking read and a producer's read of results over its own connection give what the client's
    (redis-py's callbacks) give."""
    keys = settings.keys
    stream = keys.requests

    async def main() -> tuple:
        client = redis_async(settings.redis_url, decode_responses=False)
        shared = StreamConnection(client, keys, settings.session_ttl_s)
        own = shared.on_own_connection()
        try:
            for name in (stream, keys.pinned_requests("w-direct"), keys.pinned_requests("w-client")):
                await shared.ensure_group(name)
            for i in range(3):
                await client.xadd(stream, {PAYLOAD_FIELD: f"p{i}".encode()})
            direct_read = await WorkerStreams(own).wait_for_entries("w-direct", 100)
            client_read = await WorkerStreams(shared).wait_for_entries("w-client", 100)
            await client.xadd("results", {PAYLOAD_FIELD: b"r0"})
            direct_results = await ProducerStreams(own).read_results("results", b"0-0", [], 100, keys.state)
            client_results = await ProducerStreams(shared).read_results("results", b"0-0", [], 100, keys.state)
            return direct_read, client_read, direct_results, client_results
        finally:
            await own.aclose()
            await client.aclose()

    direct_read, client_read, direct_results, client_results = asyncio.run(main())
    assert [e.payload for e in direct_read] == [b"p0"] and [e.payload for e in client_read] == [b"p1"]
    assert direct_read[0].stream == client_read[0].stream == stream
    assert direct_results[0] == [tuple(r) for r in client_results[0]] and direct_results[1:] == client_results[1:]
    assert dict(direct_results[0][0][1]) == {PAYLOAD_FIELD: b"r0"}
    assert rds.xpending(stream, WORKERS_GROUP)["pending"] == 2


def test_stream_records_reads_both_protocols() -> None:
    resp3 = {b"s": [[b"1-0", [b"a", b"1", b"b", b"2"]], [b"2-0", None]]}
    resp2 = [[b"s", [[b"1-0", [b"a", b"1", b"b", b"2"]], [b"2-0", None]]]]
    expected = [(b"s", [(b"1-0", {b"a": b"1", b"b": b"2"}), (b"2-0", {})])]
    assert stream_records(resp3) == stream_records(resp2) == expected
    assert stream_records(None) == stream_records({}) == []


async def test_a_worker_counts_no_work_once_its_answer_arrives(settings: Settings, echo_workers, rds) -> None:
    """An idle worker woken by a session's turn (read from its pinned stream by the blocking read) publishes the answer
    before its next take; that publish counts what the read took (`Woken`), so when the answer arrives its load and
    its pinned tokens are 0, and the next session is placed by the true loads (here: a tie, so the lower id)."""
    [first, second] = echo_workers(2)
    loads = settings.keys.loads
    async with RolloutClient(settings) as client:
        seen = []
        for turn in range(20):
            [t] = await client.generate([[1, 2, 3]], {"max_tokens": 3}, ["s"])
            held = rds.hmget(loads, [t.worker_id, t.worker_id + PINNED_SUFFIX])
            seen.append((turn, t.worker_id, held))
        assert {worker for _, worker, _ in seen} == {first}, seen  # sticky
        # turn 0 came from the shared stream; a field never written (nothing added to it yet) is 0 too
        assert all([int(x or 0) for x in held] == [0, 0] for _, _, held in seen[1:]), seen
        [t] = await client.generate([[1, 2, 3]], {"max_tokens": 3}, ["another"])
        assert t.worker_id == second  # the fewest sessions breaks the tie of loads


async def test_a_caller_answers_before_the_reader_sends_its_next_read(
    settings: Settings, echo_workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader that routes a result to its caller yields the loop until the caller has run and what it wrote in
    that turn has gone out (`serve` joins a response's writes at the end of a turn: rollout_svc.api.http) before it
    sends its next read: at 1 in flight the read's write and Redis's wake-up are not in the way of the answer.
    With one turn (`CALLER_TURNS` 1) each answer came after the next read."""
    echo_workers(1)
    events: list[str] = []
    read_results, route = ProducerStreams.read_results, ResultRouter.route

    async def logged_read(self: ProducerStreams, *args: object, **kwargs: object) -> object:
        events.append("read")
        return await read_results(self, *args, **kwargs)

    def logged_route(self: ResultRouter, payload: bytes) -> None:
        events.append("result")
        route(self, payload)

    monkeypatch.setattr(ProducerStreams, "read_results", logged_read)
    monkeypatch.setattr(ResultRouter, "route", logged_route)
    loop = asyncio.get_running_loop()
    async with RolloutClient(settings) as client:
        for i in range(5):
            await client.generate([[1, 2, 3]], {"max_tokens": 3})
            loop.call_soon(events.append, f"answer {i}")  # as a write joined at the end of this turn goes out
            await asyncio.sleep(0.05)
    after = [events[i + 1] for i, event in enumerate(events) if event == "result"]
    assert after == [f"answer {i}" for i in range(5)], events
