"""A named step in Redis: what lets a step survive its trainer (`RolloutClient.generate(..., step_id=)`,
`RolloutClient.attach_step`).

A named step's requests carry a `reply_to` of their own: the results streams of the producer `step-<step_id>`, which
a new process can read (a named producer's results are read from their start and never deleted by the reader). Its
record (`Keys.step`, a hash) holds the requests in order and, per position, the request id it is awaited under now
(the request's own, or its latest retry's or regeneration's, written once Redis took that attempt): a client that
attaches awaits exactly those, so nothing is generated twice. Once every answer came to a client the step is marked
collected (field `collected`), and kept: a process that died after the call returned but before it used the results
(trained on them, checkpointed) collects them again, until the trainer says it is done with them (`finish`,
`RolloutClient.finish_step`) or the TTL passes. The record has a TTL (`ClientSettings.step_ttl_s`), renewed while a
client runs the step; the index `Keys.steps` holds each uncollected step's expiry, and a client that starts or
attaches to a step first clears the uncollected steps that expired unattached (their results streams too), counting
them in `Keys.steps_expired`. Messages are msgpack envelopes (`protocol.encode`), never pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgpack
from redis.asyncio import Redis, RedisCluster

from rollout_svc.client.call_runner import CallRunner
from rollout_svc.client.connection import NO_TARGET, Connection, RequestBuilder, Target
from rollout_svc.config import Settings
from rollout_svc.errors import InvalidRequestError
from rollout_svc.fleet import Fleet
from rollout_svc.keys import Keys
from rollout_svc.protocol import RolloutRequest, decode, encode

log = logging.getLogger("rollout_svc.client")
REQUESTS_FIELD = "requests"
COLLECTED_FIELD = "collected"  # set once every answer came to a client


def step_producer(step_id: str) -> str:
    """The producer id whose results streams a named step's requests answer to."""
    return f"step-{step_id}"


class StepRecord:
    """One named step's record (`Keys.step`) on the Redis holding the keys outside every shard (`redis`). `ttl_s`:
    how long it lives unless renewed (s)."""

    def __init__(self, redis: Redis | RedisCluster, fleet: Fleet, keys: Keys, step_id: str, ttl_s: float) -> None:
        if not step_id or any(c in step_id for c in "{}*?[] "):
            raise InvalidRequestError(f"step_id {step_id!r}: give a non-empty name without spaces, braces or globs")
        self.redis, self.fleet, self.keys, self.step_id, self.ttl_s = redis, fleet, keys, step_id, ttl_s
        self.key = keys.step(step_id)
        self._writes: set[asyncio.Task[None]] = set()

    async def create(self, requests: Sequence[RolloutRequest]) -> None:
        """Record a new step of `requests` (in order, each awaited under its own id). Raises `InvalidRequestError`
        if a step of this id lives (attach to it, or name this one otherwise), and the Redis error."""
        await sweep_expired(self.redis, self.fleet, self.keys)
        packed = msgpack.packb([encode(request) for request in requests])
        if not await self.redis.hsetnx(self.key, REQUESTS_FIELD, packed):
            raise InvalidRequestError(
                f"step {self.step_id!r} exists already: attach to it (attach_step), finish it (finish_step) once its "
                "results are used, or give this step another id"
            )
        attempts = {f"a:{i}": request.request_id for i, request in enumerate(requests)}
        async with self.redis.pipeline(transaction=False) as pipe:
            if attempts:
                pipe.hset(self.key, mapping=attempts)  # type: ignore[arg-type]
            self._renew(pipe)
            await pipe.execute()

    async def load(self) -> tuple[list[RolloutRequest], list[str]]:
        """The step's requests, in order, and the request id each position is awaited under. Raises
        `InvalidRequestError` if no such step lives (finished with `finish_step`, expired, or never started)."""
        await sweep_expired(self.redis, self.fleet, self.keys)
        raw: dict[bytes, bytes] = await self.redis.hgetall(self.key)  # type: ignore[misc,assignment]
        fields = {k.decode(): v for k, v in raw.items()}
        packed = fields.get(REQUESTS_FIELD)
        if packed is None:
            raise InvalidRequestError(
                f"no step {self.step_id!r}: it was finished (finish_step), it expired (step_ttl_s, {self.ttl_s:g} s "
                "after its last client), or it never started"
            )
        requests: list[RolloutRequest] = [decode(envelope) for envelope in msgpack.unpackb(packed)]
        attempts = [fields.get(f"a:{i}") or r.request_id.encode() for i, r in enumerate(requests)]
        await self.renew()
        return requests, [a.decode() for a in attempts]

    def moved(self, index: int, request_id: str) -> None:
        """Position `index` is awaited under `request_id` from now on (a retry or a regeneration Redis took): written
        in the background, in order."""
        task = asyncio.get_running_loop().create_task(self._write(index, request_id))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, index: int, request_id: str) -> None:
        try:
            await self.redis.hset(self.key, f"a:{index}", request_id)
        except Exception as exc:  # Redis away: an attached client awaits the attempt before, and retries it
            log.warning("step %s: could not record attempt %s (%s)", self.step_id, request_id, exc)

    async def renew(self) -> None:
        """Keep the step (its record and its results streams) for `ttl_s` more."""
        async with self.redis.pipeline(transaction=False) as pipe:
            self._renew(pipe)
            await pipe.execute()
        await self.fleet.each(lambda link: link.redis.expire(link.keys.results(step_producer(self.step_id)), self._ttl))

    @property
    def _ttl(self) -> int:
        return max(1, int(self.ttl_s))

    def _renew(self, pipe: object) -> None:
        pipe.expire(self.key, self._ttl)  # type: ignore[attr-defined]
        pipe.zadd(self.keys.steps, {self.step_id: time.time() + self.ttl_s})  # type: ignore[attr-defined]

    async def keep(self) -> None:
        """Renew the step every third of its TTL, until cancelled (while a client runs it)."""
        while True:
            await asyncio.sleep(max(1.0, self.ttl_s / 3))
            with contextlib.suppress(Exception):
                await self.renew()

    async def collected(self) -> None:
        """Every answer came to this client: mark the step collected (out of the index of steps that may expire
        unattached) and keep it `ttl_s` more, for a process that dies before it used them."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, COLLECTED_FIELD, 1)
            pipe.expire(self.key, self._ttl)
            pipe.zrem(self.keys.steps, self.step_id)
            await pipe.execute()
        await self.fleet.each(lambda link: link.redis.expire(link.keys.results(step_producer(self.step_id)), self._ttl))

    async def finish(self) -> bool:
        """The trainer is done with the step's results: delete its record and results streams. False if there was
        no such step."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.key)
            pipe.zrem(self.keys.steps, self.step_id)
            deleted, _ = await pipe.execute()
        await self.fleet.each(lambda link: link.redis.delete(link.keys.results(step_producer(self.step_id))))
        return bool(deleted)


async def sweep_expired(redis: Redis | RedisCluster, fleet: Fleet, keys: Keys) -> int:
    """Clear the named steps whose record expired unattached: their results streams go, each is counted in
    `Keys.steps_expired` and logged. Returns how many."""
    due = await redis.zrangebyscore(keys.steps, "-inf", time.time())
    swept = 0
    for raw in due:
        step_id = raw.decode() if isinstance(raw, bytes) else str(raw)
        if await redis.exists(keys.step(step_id)):
            continue  # renewed by a client that died before the index was (or it is being attached to now)
        if not await redis.zrem(keys.steps, step_id):
            continue  # another client swept it
        results = step_producer(step_id)
        await fleet.each(lambda link: link.redis.delete(link.keys.results(results)))  # noqa: B023 (awaited here)
        await redis.incrby(keys.steps_expired, 1)
        log.warning("step %s expired unattached: its uncollected results are gone", step_id)
        swept += 1
    return swept


async def finish_step(connection: Connection, settings: Settings, step_id: str) -> bool:
    """Delete the named step `step_id` (its record and results); False if there was none."""
    record = StepRecord(connection.redis, connection.fleet, settings.keys, step_id, settings.client.step_ttl_s)
    return await record.finish()


async def expired_steps(redis: Redis | RedisCluster, keys: Keys) -> int:
    """How many named steps expired unattached so far."""
    return int(await redis.get(keys.steps_expired) or 0)


async def run_step(
    settings: Settings,
    runner: CallRunner,
    step_id: str,
    requests: Sequence[RolloutRequest] | None,
    *,
    timeout_s: float | None,
    raise_on_error: bool,
    target: Target = NO_TARGET,
) -> list[Any]:
    """Run the named step `step_id` on a connection of its own (producer `step-<step_id>`) and return its answers in
    order, as `CallRunner.run`: start it with `requests` (addressed to the step's results streams, recorded, then
    sent), or, `requests` None, attach to it (await what its record names, reading its results from their start).
    Once every answer came the step is marked collected, and kept until `finish_step` or its TTL. Raises
    `InvalidRequestError` (a step of that id lives already; none lives to attach to), and what `CallRunner.run`
    raises."""
    connection = Connection(settings, producer_id=step_producer(step_id))
    await connection.start()
    try:
        record = StepRecord(connection.redis, connection.fleet, settings.keys, step_id, settings.client.step_ttl_s)
        attempt_ids: list[str] | None = None
        if requests is None:
            requests, attempt_ids = await record.load()
        else:
            requests = [r.model_copy(update={"reply_to": connection.reply_to(r.session_id)}) for r in requests]
            await record.create(requests)
        connection.on_attempt = record.moved
        keeper = asyncio.create_task(record.keep())
        try:
            build = RequestBuilder(connection, timeout_s)
            attached = attempt_ids is not None
            results = await runner.run(build, requests, raise_on_error, target, attached, attempt_ids)
        finally:
            keeper.cancel()
        await record.collected()
        return results
    finally:
        await connection.close()
