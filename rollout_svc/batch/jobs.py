"""Batch jobs on RQ: enqueue a batch's run, run it (the job `rollout_svc.batch.run_batch`), the batch worker, and
the check that enqueues again a batch whose run died (see `rollout_svc.batch`)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import redis

from rollout_svc.batch.store import RUNNING, BatchStore
from rollout_svc.config import Settings
from rollout_svc.connections.topology import refuse_cluster
from rollout_svc.connections.urls import redis_sync, warn_if_evicting_sync

log = logging.getLogger("rollout_svc.batch")


def _queue(settings: Settings, connection: redis.Redis) -> Any:
    from rq import Queue
    from rq.serializers import JSONSerializer

    return Queue(settings.keys.batch_queue, connection=connection, serializer=JSONSerializer)


def enqueue_job(settings: Settings, batch_id: str, attempt: int = 0) -> str:
    """Enqueue a run of a batch on RQ (JSON arguments; retried up to 3 times if it raises). Returns the job id."""
    from rq import Retry

    refuse_cluster(settings.redis_url, "batch jobs")
    connection = redis_sync(settings.redis_url)
    try:
        job = _queue(settings, connection).enqueue(
            "rollout_svc.batch.run_batch",
            batch_id,
            job_id=f"{batch_id}-{attempt}",
            retry=Retry(max=3, interval=[2, 10, 30]),
            job_timeout=-1,  # a batch runs as long as it needs; the lease, not RQ's timeout, tells a dead run
            result_ttl=int(settings.batch.batch_retention_s),
            failure_ttl=int(settings.batch.batch_retention_s),
            description=f"rollout-svc batch {batch_id}",
        )
    finally:
        connection.close()
    return str(job.id)


async def submit_batch(
    store: BatchStore,
    input_file_id: str,
    endpoint: str,
    *,
    output_path: str | None = None,
    metadata: dict[str, str] | None = None,
) -> str:
    """Record a batch of an uploaded file's lines (`BatchStore.create_batch`) and enqueue its run on RQ. Returns the
    batch id. Raises `InvalidRequestError` (no such file, a bad line; nothing is recorded then)."""
    batch_id = await store.create_batch(input_file_id, endpoint, output_path=output_path, metadata=metadata)
    await asyncio.to_thread(enqueue_job, store.settings, batch_id)
    return batch_id


def batch_workers(settings: Settings) -> int:
    """How many RQ workers (`rollout-svc batch-worker`) listen on this deployment's batch queue."""
    from rq import Worker

    connection = redis_sync(settings.redis_url)
    try:
        return int(Worker.count(connection=connection, queue=_queue(settings, connection)))
    finally:
        connection.close()


def run_batch(batch_id: str) -> str:
    """The RQ job: run (or resume) one batch with this process's settings (env `ROLLOUT_*`). Returns how it ended."""
    from rollout_svc.batch.run import BatchRun

    return asyncio.run(BatchRun(Settings(), batch_id).run())


def requeue_abandoned(settings: Settings, connection: redis.Redis) -> list[str]:
    """The abandoned-job check: enqueue a new run of every running batch whose lease expired (its run died), at most
    once per three lease lifetimes. Returns the batch ids requeued."""
    keys, now = settings.keys, time.time()
    rds: Any = connection  # bytes replies
    requeued = []
    ids = [raw.decode() for raw in rds.zrange(keys.batches, 0, -1)]
    pipe = rds.pipeline(transaction=False)  # every batch's state and lease in one round trip, not two per batch
    for batch_id in ids:
        pipe.hmget(keys.batch(batch_id), ["status", "requeued_at", "attempts"])
        pipe.exists(keys.batch_lease(batch_id))
    replies = pipe.execute()
    for batch_id, (status, requeued_at, attempts), leased in zip(ids, replies[::2], replies[1::2], strict=True):
        if status is None or status.decode() not in RUNNING or leased:
            continue
        if requeued_at is not None and now - float(requeued_at) < 3 * settings.batch.batch_lease_ttl_s:
            continue
        attempt = int(attempts or 0) + 1
        rds.hset(keys.batch(batch_id), mapping={"requeued_at": now, "attempts": attempt})
        enqueue_job(settings, batch_id, attempt)
        log.warning("batch %s was %s with no live run: enqueued run %d", batch_id, status.decode(), attempt)
        requeued.append(batch_id)
    return requeued


def run_batch_worker(settings: Settings, burst: bool = False, check_interval_s: float = 1.0) -> None:
    """`rollout-svc batch-worker`: an RQ worker on the batch queue (RQ's `JSONSerializer`), with the abandoned-job
    check in a thread. Its jobs read their settings from this process's environment."""
    from rq import Worker
    from rq.serializers import JSONSerializer

    from rollout_svc.config import settings_env

    refuse_cluster(settings.redis_url, "batch workers")
    os.environ.update(settings_env(settings))  # the work horse (a fork) builds its Settings from these
    connection = redis_sync(settings.redis_url)
    warn_if_evicting_sync(connection, "batch worker")
    stop = threading.Event()

    def check() -> None:
        while not stop.wait(check_interval_s):
            try:
                requeue_abandoned(settings, connection)
            except redis.RedisError as exc:
                log.warning("abandoned-batch check failed (%s); retrying", exc)

    checker = threading.Thread(target=check, name="abandoned-batches", daemon=True)
    checker.start()
    try:
        queue = _queue(settings, connection)
        worker = Worker([queue], connection=connection, serializer=JSONSerializer, maintenance_interval=60)
        worker.work(burst=burst, with_scheduler=True, logging_level="INFO")
    finally:
        stop.set()
        checker.join()
        connection.close()
