"""`rollout-svc dead-letters list|replay` against a real redis-server, with dead letters made by real workers."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import subprocess
import sys

import pytest
import redis
from redis.asyncio import Redis

from rollout_svc.config import Settings
from rollout_svc.dataplane.dead_letters import DeadLetters
from rollout_svc.dataplane.producer_streams import ProducerStreams
from rollout_svc.dataplane.recovery_streams import RecoveryStreams
from rollout_svc.dataplane.streams import Enqueue, StreamConnection
from rollout_svc.dataplane.worker_streams import TakeOptions, WorkerStreams
from rollout_svc.keys import DELIVERIES_FIELD, EPOCH_FIELD, PAYLOAD_FIELD, SESSION_FIELD
from rollout_svc.protocol import ErrorResult, RolloutRequest, Trajectory, encode
from tests.support import ROOT, Results, wait_until

# Each test runs the CLI as a user does, a process per call (~1 s here alone, 2.5 s a test): beside the vLLM modules
# of `make test` on 2 cores, CI twice saw one test pass 30 s. The calls keep their own 60 s limit.
pytestmark = pytest.mark.timeout(240)  # a minute-long freeze of this machine fits

UNDECODABLE = b"\xc1 not msgpack"


def cli(settings: Settings, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`rollout-svc dead-letters ARGS` on the test's Redis and key prefix; `env`: more ROLLOUT_* settings."""
    env = {**os.environ, "ROLLOUT_KEY_PREFIX": settings.key_prefix, "COLUMNS": "300", **env}
    command = [sys.executable, "-m", "rollout_svc", "dead-letters", *args, "--redis-url", settings.redis_url]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=150)


def poison(replies: Results, session_id: str | None = "s-1") -> RolloutRequest:
    return RolloutRequest(
        request_id="poison", prompt_token_ids=[5, 6, 7], reply_to=replies.stream, session_id=session_id
    )


def make_dead_letters(settings: Settings, rds: redis.Redis, replies: Results) -> tuple[str, str]:
    """With a worker running: an undecodable entry, then a request already delivered max_deliveries times (as the
    reaper requeues it), each dead-lettered by the worker. Returns (the undecodable one's id, the request's)."""
    keys = settings.keys
    rds.xadd(keys.requests, {PAYLOAD_FIELD: UNDECODABLE})
    wait_until(lambda: rds.xlen(keys.dead) == 1, 10, "the undecodable entry to be dead-lettered")
    # Its heartbeat says serving (not starting): placement pins the request's session to it.
    wait_until(lambda: rds.hget(keys.worker("echo-0"), "state") == b"serving", 10, "echo-0 to heartbeat serving")

    async def requeue() -> None:
        client = Redis.from_url(settings.redis_url)
        try:
            recovery = RecoveryStreams(StreamConnection(client, keys, settings.session_ttl_s))
            item = Enqueue(encode(poison(replies)), "s-1", deliveries=settings.worker.max_deliveries)
            await recovery.requeue([item], [])
        finally:
            await client.aclose()

    asyncio.run(requeue())
    wait_until(lambda: rds.xlen(keys.dead) == 2, 10, "the request over max_deliveries to be dead-lettered")
    [(newest, _), (oldest, _)] = rds.xrevrange(keys.dead)
    return oldest.decode(), newest.decode()


def test_list_shows_dead_letters_newest_first_and_undecodable_ones_as_such(settings, echo_workers, rds):
    echo_workers(1)
    replies = Results(rds, settings.keys.results("test-producer"))
    undecodable_id, poison_id = make_dead_letters(settings, rds, replies)

    listed = cli(settings, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    first, second = (json.loads(line) for line in listed.stdout.splitlines())
    assert first["entry_id"] == poison_id and second["entry_id"] == undecodable_id  # newest first
    assert first["request_id"] == "poison" and first["reply_to"] == replies.stream and first["session_id"] == "s-1"
    assert first["reason"] == "max_deliveries" and first["deliveries"] == settings.worker.max_deliveries + 1
    assert first["message"] == f"delivered {settings.worker.max_deliveries + 1} times without a result"
    assert first["worker_id"] == "echo-0" and first["type"] == "RolloutRequest" and first["replayable"] is True
    assert first["stream"] == settings.keys.pinned_requests("echo-0")  # its session was placed there
    assert second["request_id"] is None and second["reason"] == "undecodable" and second["replayable"] is False
    assert "not a rollout-svc message" in second["message"] and second["payload_bytes"] == len(UNDECODABLE)

    table = cli(settings, "list")
    assert table.returncode == 0, table.stderr
    assert "dead letters: 2 of 2, newest first" in table.stdout
    assert table.stdout.index(poison_id) < table.stdout.index(undecodable_id)
    assert "(undecodable)" in table.stdout and "max_deliveries" in table.stdout and "echo-0" in table.stdout

    newest = cli(settings, "list", "--json", "--count", "1")
    assert [json.loads(line)["entry_id"] for line in newest.stdout.splitlines()] == [poison_id]


def test_replay_requeues_a_dead_letter_that_a_worker_then_serves(settings, echo_workers, rds):
    echo_workers(1)
    keys = settings.keys
    replies = Results(rds, keys.results("test-producer"))
    undecodable_id, poison_id = make_dead_letters(settings, rds, replies)
    [told] = replies.read(1)  # dead-lettering told the producer
    assert isinstance(told, ErrorResult) and told.code == "max_deliveries"

    replayed = cli(settings, "replay", poison_id, undecodable_id, "1-1", "not-an-id")
    assert replayed.returncode == 1  # some named ids could not be replayed
    assert f"replayed {poison_id}: request poison -> {keys.pinned_requests('echo-0')}" in replayed.stdout
    assert f"not replayed {undecodable_id}: undecodable: not a rollout-svc message" in replayed.stderr
    assert "not replayed 1-1: no such dead letter" in replayed.stderr
    assert "not replayed not-an-id: not a stream entry id" in replayed.stderr
    assert "1 replayed, 3 not" in replayed.stdout

    # A fresh delivery count: served, not dead-lettered again (it had been delivered max_deliveries + 1 times).
    [result] = replies.read(1)
    assert isinstance(result, Trajectory) and result.request_id == "poison" and result.session_id == "s-1"
    assert result.completion_token_ids == [5, 6, 7] and result.worker_id == "echo-0"
    assert [entry_id.decode() for entry_id, _ in rds.xrange(keys.dead)] == [undecodable_id]  # only it is left
    wait_until(lambda: rds.xlen(keys.pinned_requests("echo-0")) == 0, 5, "the replayed request to be acked")


async def dead_letter_without_workers(settings: Settings, request: RolloutRequest) -> None:
    """The data plane dead-letters a request that a worker (gone, never a process here) had taken, as a reaper does."""
    client = Redis.from_url(settings.redis_url)
    try:
        connection = StreamConnection(client, settings.keys, settings.session_ttl_s)
        for stream in (settings.keys.requests, settings.keys.pinned_requests("w-gone")):
            await connection.ensure_group(stream)
        await ProducerStreams(connection).enqueue([Enqueue(encode(request))], 100)
        [taken] = (await WorkerStreams(connection).take(TakeOptions("w-gone", 60_000), 1)).entries
        assert await RecoveryStreams(connection).dead_letter(
            taken,
            "max_deliveries",
            "a test",
            "",
            maxlen=settings.worker.dead_letter_maxlen,
            results_ttl_s=settings.results_ttl_s,
        )
    finally:
        await client.aclose()


def test_replay_into_a_full_queue_is_refused_and_loses_nothing(settings, rds):
    keys = settings.keys
    replies = Results(rds, keys.results("test-producer"))
    request = poison(replies, session_id=None)
    asyncio.run(dead_letter_without_workers(settings, request))
    [(dead_id, fields)] = rds.xrange(keys.dead)
    assert fields[b"worker_id"] == b"" and fields[b"deliveries"] == b"1"
    rds.xadd(keys.requests, {PAYLOAD_FIELD: b"filler"})  # the queue holds one request
    rds.hset(keys.state, "epoch", 7)

    full = cli(settings, "replay", "--all", ROLLOUT_MAX_QUEUED_REQUESTS="1")
    assert full.returncode == 1
    assert f"{keys.requests} holds 1 queued requests (limit 1)" in full.stderr and "stays a dead letter" in full.stderr
    assert f"not replayed {dead_id.decode()}: the queue is full" in full.stderr
    assert rds.xlen(keys.requests) == 1 and rds.xlen(keys.dead) == 1

    kept = cli(settings, "replay", "--all", "--keep")
    assert kept.returncode == 0, kept.stderr
    assert "1 replayed, 0 not; kept in the dead-letter stream (--keep)" in kept.stdout
    assert rds.xlen(keys.dead) == 1
    [_, (_, requeued)] = rds.xrange(keys.requests)
    assert requeued[PAYLOAD_FIELD] == encode(request)  # the request as it was queued, as a new one:
    assert DELIVERIES_FIELD not in requeued and SESSION_FIELD not in requeued  # no delivery count
    assert requeued[EPOCH_FIELD] == b"7"  # the current control epoch

    moved = cli(settings, "replay", "--all")
    assert moved.returncode == 0, moved.stderr
    assert rds.xlen(keys.dead) == 0 and rds.xlen(keys.requests) == 3  # with --keep before it: a duplicate


async def test_a_crash_between_requeue_and_delete_leaves_a_duplicate_not_a_loss(settings, rds, monkeypatch):
    keys = settings.keys
    replies = Results(rds, keys.results("test-producer"))
    await dead_letter_without_workers(settings, poison(replies, session_id=None))
    rds.xadd(keys.dead, {b"payload": pickle.dumps({"never": "unpickled"}), b"reason": b"undecodable"})
    client = Redis.from_url(settings.redis_url)
    try:
        dead_letters = DeadLetters(client, settings)
        assert [letter.request_id for letter in await dead_letters.newest(10)] == [None, "poison"]

        async def crash(*_: object) -> int:
            raise redis.ConnectionError("the operator's laptop went to sleep")

        monkeypatch.setattr(client, "xdel", crash)
        with pytest.raises(redis.ConnectionError):
            await dead_letters.replay_all()
        assert rds.xlen(keys.requests) == 1 and rds.xlen(keys.dead) == 2  # requeued, and still a dead letter
        monkeypatch.undo()

        report = await dead_letters.replay_all()
        assert [done.letter.request_id for done in report.replayed] == ["poison"]
        [skipped] = report.skipped
        assert skipped.why.startswith("undecodable: not a rollout-svc message")
        assert rds.xlen(keys.requests) == 2 and rds.xlen(keys.dead) == 1  # a duplicate; the pickle stays, unread
    finally:
        await client.aclose()
