"""Redis connections from one URL, for every process: `redis://`, `rediss://` (TLS), `unix://`, and Sentinel.

A Sentinel URL names the sentinels and the monitored primary's service name; the connection follows the primary
that the sentinels name, across a failover:

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name[/db]
    rediss+sentinel://...   (TLS to the primary; sentinel port default 26379)

The password (and user) are the primary's; `?sentinel_password=...` gives the sentinels' if they have one. Other
URLs go to redis-py's `from_url` unchanged (its query options too, e.g. `rediss://host:6380/0?ssl_ca_certs=ca.pem`).

`eviction_warning` is what every process logs at start when Redis may evict keys: with a `maxmemory-policy` other
than `noeviction`, Redis silently deletes keys (streams, pending entries, control state) under memory pressure.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlparse, urlunparse

import redis
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollout_svc.errors import RolloutError

log = logging.getLogger("rollout_svc.connections.urls")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelURL:
    """A parsed Sentinel URL: the sentinels' (host, port)s, the primary's service name, db and credentials."""

    sentinels: list[tuple[str, int]]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    def primary_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"db": self.db, "username": self.username, "password": self.password}
        if self.ssl:
            kwargs["ssl"] = True
        return kwargs

    def sentinel_kwargs(self) -> dict[str, Any]:
        return {"password": self.sentinel_password} if self.sentinel_password else {}


def is_sentinel(url: str) -> bool:
    return urlparse(url).scheme in SENTINEL_SCHEMES


def redacted(url: str) -> str:
    """`url` for messages and logs: its credentials, if any, replaced by `***` (host, port, db and options kept)."""
    parsed = urlparse(url)
    credentials, _, address = parsed.netloc.rpartition("@")
    return urlunparse(parsed._replace(netloc=f"***@{address}")) if credentials else url


def parse_sentinel(url: str) -> SentinelURL:
    """Parse a Sentinel URL (module docstring). Raises `ValueError` saying what is missing."""
    parsed = urlparse(url)
    if parsed.scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL (redis+sentinel://...): {url!r}")
    credentials, _, hosts = parsed.netloc.rpartition("@")
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.strip().rpartition(":") if ":" in host else (host.strip(), "", "")
        if not name:
            raise ValueError(f"a Sentinel URL needs host[:port] entries, comma-separated: {url!r}")
        sentinels.append((name, int(port) if port else DEFAULT_SENTINEL_PORT))
    parts = [p for p in parsed.path.split("/") if p]
    if not parts:
        raise ValueError(f"a Sentinel URL needs the primary's service name as its path (.../mymaster/0): {url!r}")
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    return SentinelURL(
        sentinels=sentinels,
        service_name=unquote(parts[0]),
        db=int(parts[1]) if len(parts) > 1 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        sentinel_password=query.pop("sentinel_password", None),
        ssl=parsed.scheme == "rediss+sentinel",
        extra=query,
    )


# A command whose connection turns out dead (Redis restarted since it was pooled; a failover) is sent again on a fresh
# one, up to 3 times with a short backoff. Only connection errors: a timeout may come after Redis ran the command.
RETRIES = 3
# What a Redis that is away (restarting, failing over, cut off) raises. Our own errors are not among them, though some
# are TimeoutErrors and so OSErrors: `retry_while_away` raises those at once.
REDIS_AWAY = (RedisConnectionError, RedisTimeoutError, OSError)
T = TypeVar("T")


def _retry(retry_class: Any) -> Any:
    """redis-py's `Retry` (`redis.retry.Retry`, or the asyncio one) with this module's policy."""
    from redis.backoff import ExponentialBackoff

    return retry_class(ExponentialBackoff(cap=0.5, base=0.05), RETRIES, supported_errors=(RedisConnectionError,))


def _retry_async() -> Any:
    from redis.asyncio.retry import Retry

    return _retry(Retry)


def _retry_sync() -> Any:
    from redis.retry import Retry

    return _retry(Retry)


def _sentinel_kwargs(spec: SentinelURL, kwargs: dict[str, Any], retry: Any) -> dict[str, Any]:
    """How to reach the sentinels: their password, this module's retries (not redis-py's default, which backs off for
    seconds), and the caller's socket timeouts."""
    timeouts = {k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout")}
    return {**spec.sentinel_kwargs(), "retry": retry, **timeouts}


# Every connection times out and probes an idle peer, so a link cut without a reset (a host dropped off the network,
# a firewall that forgets the flow) raises instead of hanging a worker or a client. Our blocking reads block for
# `read_block_ms` (100 ms) at a time, far inside the timeout; RQ raises the timeout of its own connection for its
# longer blocking pops.
SOCKET_TIMEOUT_S = 10.0  # a reply (or, on a blocking read, its block time plus this) slower than this raises
CONNECT_TIMEOUT_S = 5.0
KEEPALIVE_OPTIONS = {  # an idle connection's peer is probed after 5 s, every 1 s; gone after 3 unanswered probes
    option: value
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3))
    if (option := getattr(socket, name, None)) is not None
}


def _timeouts(url: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The caller's kwargs with this module's socket timeouts and TCP keepalive where the caller set none."""
    kwargs.setdefault("socket_timeout", SOCKET_TIMEOUT_S)
    kwargs.setdefault("socket_connect_timeout", CONNECT_TIMEOUT_S)
    if urlparse(url).scheme != "unix":  # a Unix socket has no keepalive (and redis-py refuses the options)
        kwargs.setdefault("socket_keepalive", True)
        kwargs.setdefault("socket_keepalive_options", KEEPALIVE_OPTIONS)
    return kwargs


def redis_async(url: str, **kwargs: Any) -> redis.asyncio.Redis:
    """An asyncio Redis client for `url` (any scheme above); `kwargs` go to the client (decode_responses, ...).

    Every connection gets socket timeouts and TCP keepalive (`SOCKET_TIMEOUT_S`, `KEEPALIVE_OPTIONS`) unless
    `kwargs` set them; a command whose connection died is retried on a fresh one (`RETRIES`)."""
    _timeouts(url, kwargs)
    kwargs.setdefault("retry", _retry_async())
    if not is_sentinel(url):
        kwargs.setdefault("connection_class", reconnecting(_scheme_connection_class(url)))
        pool_class = kwargs.pop("connection_pool_class", None)
        if pool_class is None:
            return redis.asyncio.Redis.from_url(url, **kwargs)
        return redis.asyncio.Redis.from_pool(pool_class.from_url(url, **kwargs))  # the client closes the pool
    from redis.asyncio.sentinel import (
        Sentinel,
        SentinelConnectionPool,
        SentinelManagedConnection,
        SentinelManagedSSLConnection,
    )

    spec = parse_sentinel(url)
    sentinel = Sentinel(spec.sentinels, sentinel_kwargs=_sentinel_kwargs(spec, kwargs, _retry_async()))
    managed = SentinelManagedSSLConnection if spec.ssl else SentinelManagedConnection
    kwargs.setdefault("connection_class", reconnecting(managed))
    single = kwargs.pop("single_connection_client", False)
    kwargs.pop("connection_pool_class", None)  # a Sentinel pool follows the primary; it does not block
    kwargs.pop("timeout", None)
    pool = SentinelConnectionPool(spec.service_name, sentinel, **spec.primary_kwargs(), **kwargs)
    client = _SentinelRedis(connection_pool=pool, single_connection_client=single)
    client.auto_close_connection_pool = True  # as `Redis.from_pool`: the pool is this client's own
    client.sentinel = sentinel
    return client


class _ReconnectsClosedTransport:
    """A redis-py asyncio connection that, before it writes, reconnects if the event loop has closed its transport.

    Why: uvloop (which `serve` runs on, through uvicorn) closes a transport whose socket failed (reset, or timed out
    by keepalive while idle) and then raises `RuntimeError` ("unable to perform operation on <TCPTransport
    closed=True>; the handler is closed") on the next write, an error that neither redis-py's retry nor our loops
    take for Redis trouble: a request failed with a 500 after serve's connection to Redis was reset. asyncio's own
    loop drops such a write, and the read that follows raises `ConnectionError`. Here the write goes out on a fresh
    connection instead, as it does on a connection redis-py knows to be disconnected."""

    _writer: Any

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        writer = self._writer
        if writer is not None and writer.transport.is_closing():
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
        await super().send_packed_command(command, check_health)  # type: ignore[misc]


@functools.cache
def reconnecting(base: type) -> type:
    """`base` (a redis-py asyncio connection class) with `_ReconnectsClosedTransport` mixed in (one class per base;
    `base` itself when it has it already)."""
    if issubclass(base, _ReconnectsClosedTransport):
        return base
    return type(f"Reconnecting{base.__name__}", (_ReconnectsClosedTransport, base), {})


def _scheme_connection_class(url: str) -> type:
    """The connection class redis-py's `from_url` picks for `url`'s scheme (TLS, a Unix socket, else TCP)."""
    from redis.asyncio.connection import Connection, parse_url

    chosen: type = parse_url(url).get("connection_class", Connection)
    return chosen


def redis_async_bounded(url: str, max_connections: int, wait_s: float, **kwargs: Any) -> redis.asyncio.Redis:
    """`redis_async` whose pool holds `max_connections` at most: past that, a command waits up to `wait_s` for one
    (then redis-py raises `ConnectionError("No connection available.")`), where redis-py's default pool refuses it
    at once with "Too many connections", which reads as Redis being away."""
    pool = {"connection_pool_class": redis.asyncio.BlockingConnectionPool, "max_connections": max_connections}
    return redis_async(url, **pool, timeout=wait_s, **kwargs)


async def wait_for_redis(url: str, logger: logging.Logger, interval_s: float = 0.5) -> None:
    """Block until Redis at `url` answers a PING, logging a warning every 10 tries (every 5 s): a process may start
    before its Redis."""
    failures = 0
    probe = redis_async(url, decode_responses=False)
    try:
        while True:
            try:
                await probe.ping()
                return
            except REDIS_AWAY as exc:  # a refusal (a wrong password) is raised
                failures += 1
                if failures % 10 == 1:
                    logger.warning("waiting for Redis at %s (%s); check --redis-url", redacted(url), exc)
                await asyncio.sleep(interval_s)
    finally:
        await probe.aclose()


class _SentinelRedis(redis.asyncio.Redis):
    """A client of the primary whose `aclose()` closes its connections to the primary (its own pool) and to the
    sentinels; redis-py's leaves both to the garbage collector (a ResourceWarning for each socket)."""

    sentinel: Any = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for client in self.sentinel.sentinels if self.sentinel is not None else []:
            await client.aclose()


def redis_sync(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking Redis client for `url` (any scheme above), with the same timeouts, keepalive and retries."""
    _timeouts(url, kwargs)
    kwargs.setdefault("retry", _retry_sync())
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    from redis.sentinel import Sentinel, SentinelConnectionPool

    spec = parse_sentinel(url)
    sentinel = Sentinel(spec.sentinels, sentinel_kwargs=_sentinel_kwargs(spec, kwargs, _retry_sync()))
    single = kwargs.pop("single_connection_client", False)
    pool = SentinelConnectionPool(spec.service_name, sentinel, **spec.primary_kwargs(), **kwargs)
    client = _SentinelRedisSync(connection_pool=pool, single_connection_client=single)
    client.auto_close_connection_pool = True  # as `Redis.from_pool`: the pool is this client's own
    client.sentinel = sentinel
    return client


class _SentinelRedisSync(redis.Redis):
    """`_SentinelRedis` for the blocking client: `close()` closes its connections to the primary (its own pool) and
    to the sentinels; redis-py's leaves both to the garbage collector (a ResourceWarning for each socket)."""

    sentinel: Any = None

    def close(self) -> None:
        super().close()
        for client in self.sentinel.sentinels if self.sentinel is not None else []:
            client.close()


async def retry_while_away(
    attempt: Callable[[], Awaitable[T]], outage_s: float, what: str, stop: Callable[[], bool] = lambda: False
) -> T:
    """`attempt()`, made again while Redis is away (`REDIS_AWAY`) for up to `outage_s` seconds, backing off from 0.1 s
    to 1 s and logging once; then, or once `stop()` is true, its error is raised. Any other error, our own
    (`RolloutError`) included, is raised at once. An attempt whose reply was lost may have been applied: the caller
    must tolerate it running twice."""
    deadline, failures = time.monotonic() + outage_s, 0
    while True:
        try:
            return await attempt()
        except RolloutError:
            raise
        except REDIS_AWAY as exc:
            failures += 1
            if time.monotonic() >= deadline or stop():
                raise
            if failures == 1:
                log.warning("%s: Redis is away (%s); trying again for up to %.0f s", what, exc, outage_s)
            await asyncio.sleep(min(1.0, 0.05 * 2**failures))


async def server_run_id(client: redis.asyncio.Redis) -> str | None:
    """The Redis server's `run_id` (INFO server): a new one after every restart and every failover, which is how a
    process notices that Redis may have lost recent writes. None if Redis will not say (INFO renamed or refused)."""
    try:
        info: Any = await client.info("server")
    except redis.exceptions.ResponseError:
        return None
    run_id = info.get("run_id")
    return run_id.decode() if isinstance(run_id, bytes) else run_id


async def next_message(pubsub: Any, timeout_s: float, **kwargs: Any) -> Any:
    """`pubsub.get_message(timeout=timeout_s)`, raising `ConnectionError` where redis-py would spin.

    When TCP keepalive gives up on a subscription's idle connection, the socket fails with ETIMEDOUT, which Python
    raises as the built-in `TimeoutError`, the same class as `asyncio.TimeoutError`: redis-py (8.1) takes it for its
    own read timeout, and from then on `get_message` returns None at once, forever, never yielding to the event loop
    (found by cutting a worker host off the network). A None that came back in under half the timeout, twice in a
    row, is that failure: raised as a connection error, the caller resubscribes."""
    for _ in range(2):
        started = time.monotonic()
        message = await pubsub.get_message(timeout=timeout_s, **kwargs)
        if message is not None or time.monotonic() - started >= timeout_s / 2:
            return message
    raise RedisConnectionError("the subscription's connection failed (get_message returned at once)")


def eviction_warning(policy: str | None, maxmemory: int) -> str | None:
    """The warning for Redis's `maxmemory-policy` (None: fine, or unknown)."""
    if policy is None or policy == "noeviction":
        return None
    limit = f"maxmemory {maxmemory} bytes" if maxmemory else "maxmemory 0 (no limit yet)"
    return (
        f"Redis's maxmemory-policy is {policy} ({limit}): under memory pressure Redis silently deletes keys, "
        "streams of queued requests and results included. Set `maxmemory-policy noeviction` (redis.conf, or "
        "CONFIG SET maxmemory-policy noeviction): then a full Redis refuses writes, which rollout-svc reports."
    )


def _policy(reply: Any) -> tuple[str | None, int]:
    def text(value: Any) -> str | None:
        return value.decode() if isinstance(value, bytes) else value

    items = {text(k): text(v) for k, v in dict(reply).items()}
    return items.get("maxmemory-policy"), int(items.get("maxmemory") or 0)


async def warn_if_evicting(client: redis.asyncio.Redis | redis.asyncio.RedisCluster, who: str) -> str | None:
    """Log (once per call) and return the eviction warning; None if fine or if Redis will not say (CONFIG refused
    to this user, or renamed by a managed Redis)."""
    reply: Any
    try:
        reply = await client.config_get("maxmemory*")
    except (RedisError, OSError) as exc:
        reply = exc
    return _log_eviction(reply, who)


def warn_if_evicting_sync(client: redis.Redis, who: str) -> str | None:
    """`warn_if_evicting` for a blocking client."""
    reply: Any
    try:
        reply = client.config_get("maxmemory*")
    except (RedisError, OSError) as exc:
        reply = exc
    return _log_eviction(reply, who)


def _log_eviction(reply: Any, who: str) -> str | None:
    if isinstance(reply, Exception):
        log.debug("%s: could not read maxmemory-policy (%s)", who, reply)
        return None
    warning = eviction_warning(*_policy(reply))
    if warning:
        log.warning("%s: %s", who, warning)
    return warning


def is_loopback(host: str) -> bool:
    """Whether a host name or address is this machine's loopback (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
