"""Redis URLs (`rollout_svc.connections.urls`) and batch input lines (`batch.store.parse_lines`), without a server."""

from __future__ import annotations

import json

import pytest

from rollout_svc.batch.store import parse_lines
from rollout_svc.connections.urls import eviction_warning, is_sentinel, parse_sentinel
from rollout_svc.errors import InvalidRequestError


def test_sentinel_urls_name_sentinels_service_db_and_credentials():
    spec = parse_sentinel("redis+sentinel://:s3cret@10.0.0.1,10.0.0.2:26380/mymaster/2?sentinel_password=sp")
    assert spec.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26380)]
    assert (spec.service_name, spec.db, spec.password, spec.sentinel_password, spec.ssl) == (
        "mymaster",
        2,
        "s3cret",
        "sp",
        False,
    )
    assert parse_sentinel("rediss+sentinel://u:p@h/m").primary_kwargs() == {
        "db": 0,
        "username": "u",
        "password": "p",
        "ssl": True,
    }
    assert is_sentinel("redis+sentinel://h/m") and not is_sentinel("rediss://h:6380/0")
    with pytest.raises(ValueError, match="service name"):
        parse_sentinel("redis+sentinel://h:26379")


def test_only_an_evicting_policy_is_warned_about():
    assert eviction_warning("noeviction", 0) is None and eviction_warning(None, 0) is None
    warning = eviction_warning("allkeys-lru", 1 << 30)
    assert warning and "allkeys-lru" in warning and "noeviction" in warning and "1073741824" in warning


def _line(custom_id, url="/v1/chat/completions", **extra):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"messages": []}, **extra})


def test_batch_lines_are_checked_before_a_batch_is_created():
    lines = parse_lines(f"{_line('a')}\n\n{_line('b')}\n".encode(), "/v1/chat/completions")
    assert [(line.index, line.custom_id) for line in lines] == [(0, "a"), (1, "b")]
    for content, message in [
        (f"{_line('a')}\n{_line('a')}", "line 2: custom_id 'a' is used twice"),
        ("not json", "line 1 is not JSON"),
        ("[1]", "line 1 is not a JSON object"),
        (_line("a", url="/v1/completions"), "this batch takes /v1/chat/completions"),
        (_line("a", method="GET"), "`method` must be POST"),
        (json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": []}), "`body` must be a JSON object"),
        ("", "no lines"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            parse_lines(content.encode(), "/v1/chat/completions")


def test_every_connection_has_socket_timeouts_and_tcp_keepalive():
    """A link cut without a reset must raise, not hang: timeouts and keepalive unless the caller sets its own."""
    import socket

    from rollout_svc.connections.urls import KEEPALIVE_OPTIONS, SOCKET_TIMEOUT_S, redis_async, redis_sync

    for client in (redis_async("redis://127.0.0.1:1/0"), redis_sync("redis://127.0.0.1:1/0")):
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == SOCKET_TIMEOUT_S and kwargs["socket_connect_timeout"] > 0
        assert kwargs["socket_keepalive"] is True
        assert kwargs["socket_keepalive_options"] == KEEPALIVE_OPTIONS
    assert KEEPALIVE_OPTIONS[socket.TCP_KEEPIDLE] < SOCKET_TIMEOUT_S  # an idle peer is probed well inside a timeout
    assert redis_sync("redis://h:1/0", socket_timeout=None).connection_pool.connection_kwargs["socket_timeout"] is None
    unix = redis_sync("unix:///tmp/redis.sock").connection_pool.connection_kwargs
    assert unix["socket_timeout"] == SOCKET_TIMEOUT_S and "socket_keepalive" not in unix
