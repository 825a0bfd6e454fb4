"""Redis Cluster: whether a URL points at one, and the primary that serves a shard's hash slot.

A `redis://` (or `rediss://`) URL that names any node of a Redis Cluster is a cluster URL: the node is asked once
(`INFO cluster`: `cluster_enabled:1`). Each shard's keys share one hash tag (`rollout_svc.keys`), so all of them, and
every script, multi-key command, transaction and subscription of the shard, live on the one primary serving that tag's
slot (CRC16 of the tag mod 16384, Redis Cluster specification, "Keys distribution model"). A worker and a producer's
per-shard link therefore talk to that primary over a plain connection (`shard_url`), and only the keys outside every
shard (the shard set, batch jobs, files) go through `redis.asyncio.cluster.RedisCluster` (`redis_router`), which
follows the slot map. One Redis is the one-shard case: every URL below is then the URL given.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any
from urllib.parse import urlparse, urlunparse

import redis
import redis.asyncio
from redis.cluster import key_slot
from redis.exceptions import RedisError

from rollout_svc.connections.urls import (
    CONNECT_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    _timeouts,
    is_sentinel,
    reconnecting,
    redacted,
    redis_async,
    redis_sync,
)
from rollout_svc.errors import InvalidRequestError

log = logging.getLogger("rollout_svc.connections.topology")
_CLUSTER_URLS: dict[str, bool] = {}  # url -> whether it is a cluster's (cached once a node answered)


def probe_cluster(url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether the Redis answering at `url` runs in cluster mode (`INFO cluster`: `cluster_enabled:1`). Raises
    `redis.ConnectionError` (and the like) if none answers; a Sentinel or Unix-socket URL is never a cluster's."""
    if is_sentinel(url) or urlparse(url).scheme == "unix":
        return False
    with redis_sync(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s) as client:
        try:
            info: Any = client.info("cluster")
        except redis.exceptions.ResponseError:  # INFO refused to this user: nothing we can shard on
            return False
    return bool(int(info.get("cluster_enabled", 0) or 0))


def is_cluster(url: str) -> bool:
    """`probe_cluster`, cached per URL once a node answered; False while none does (a process that starts before
    its Redis asks again)."""
    if url not in _CLUSTER_URLS:
        try:
            _CLUSTER_URLS[url] = probe_cluster(url, SOCKET_TIMEOUT_S)
        except (RedisError, OSError):
            return False
    return _CLUSTER_URLS[url]


def refuse_cluster(url: str, what: str) -> None:
    """Raise `InvalidRequestError` if `url` is a Redis Cluster's: for what needs one Redis (RQ's batch jobs)."""
    if is_cluster(url):
        raise InvalidRequestError(
            f"{what} need one Redis, not a Redis Cluster (RQ does not run on a cluster, and {redacted(url)} is a "
            "cluster node): run the batch queue on a separate Redis"
        )


def tag_slot(tag: str) -> int:
    """The hash slot (0..16383) of every key whose hash tag is `tag`."""
    return int(key_slot(tag.encode()))


def shard_url(url: str, shard: str) -> str:
    """The URL of the primary serving shard `shard`'s slot in the cluster `url` names (its credentials, database and
    options kept); `url` itself if it is not a cluster's. Raises `RuntimeError` if no primary serves the slot (that
    part of the cluster is down or unassigned), `redis.ConnectionError` if the node cannot be reached."""
    if not is_cluster(url):
        return url
    slot = tag_slot(shard)
    with redis_sync(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S) as client:
        ranges = client.execute_command("CLUSTER", "SLOTS")
    parsed = urlparse(url)
    for start, end, primary, *_ in ranges:
        if int(start) <= slot <= int(end):
            host = primary[0].decode() if isinstance(primary[0], bytes) else primary[0]
            host = host if host and host != "?" else (parsed.hostname or "127.0.0.1")
            return _with_address(url, host, int(primary[1]))
    raise RuntimeError(
        f"no primary of the Redis Cluster at {redacted(url)} serves slot {slot} (shard {shard}): that part of the "
        "cluster is down or its slots are unassigned (`redis-cli --cluster check`)"
    )


def redis_router(url: str, **kwargs: Any) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """A client for the keys outside every shard: `redis.asyncio.cluster.RedisCluster` for a cluster URL (it
    follows the slot map), else the same client as `connect.redis_async`."""
    if not is_cluster(url):
        return redis_async(url, **kwargs)
    from redis.asyncio.cluster import RedisCluster

    router = RedisCluster.from_url(url, **_timeouts(url, kwargs))
    _reconnecting_nodes(router)
    return router


def _reconnecting_nodes(router: Any) -> None:
    """Give `router` (a `redis.asyncio.cluster.RedisCluster`) connections that reconnect before writing on a transport
    the loop closed (`connections.urls.reconnecting`), as `redis_async` gives every other asyncio client: under uvloop
    (serve's loop) a node connection whose socket was reset while idle raised `RuntimeError` on its next command.
    redis-py's cluster client takes no connection class of its own choosing, so it is set on its connection arguments
    (the nodes it finds later are made from them: the same dict) and on the startup nodes it already made (the only
    ones before its first command: it discovers the rest then)."""
    kwargs = router.connection_kwargs
    kwargs["connection_class"] = reconnecting(kwargs["connection_class"])
    for node in router.nodes_manager.startup_nodes.values():
        node.connection_class = reconnecting(node.connection_class)


def redis_router_sync(url: str, **kwargs: Any) -> redis.Redis | redis.RedisCluster:
    """`redis_router` for blocking code."""
    if not is_cluster(url):
        return redis_sync(url, **kwargs)
    return redis.RedisCluster.from_url(url, **_timeouts(url, kwargs))


def _with_address(url: str, host: str, port: int) -> str:
    parsed = urlparse(url)
    credentials, _, _ = parsed.netloc.rpartition("@")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return urlunparse(parsed._replace(netloc=f"{credentials}@{address}" if credentials else address))


async def close_router(router: Any) -> None:
    """Close a `redis_router` client. redis-py's `RedisCluster.aclose` skips its node connections when a connection
    error left it waiting to re-initialize (a primary died), so they are closed here too."""
    await router.aclose()
    manager = getattr(router, "nodes_manager", None)
    if manager is not None:
        for nodes in ("nodes_cache", "startup_nodes"):
            with contextlib.suppress(RedisError, OSError):
                await manager.aclose(nodes)
