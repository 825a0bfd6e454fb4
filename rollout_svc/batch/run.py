"""One run of a batch (the body of the RQ job `rollout_svc.batch.run_batch`): see `rollout_svc.batch`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import ValidationError
from redis.exceptions import RedisError

from rollout_svc.batch.store import TERMINAL, BatchLine, BatchStore, output_line, parse_lines, write_atomically
from rollout_svc.client.rollout_client import RolloutClient
from rollout_svc.config import Settings
from rollout_svc.errors import QueueFullError, RequestTimeoutError
from rollout_svc.fleet import Fleet
from rollout_svc.openai.errors import APIError, from_exception, invalid_body
from rollout_svc.openai.plans import Plan, chat_plan, completion_plan, raise_for
from rollout_svc.openai.schemas import ChatCompletionRequest, CompletionRequest
from rollout_svc.protocol import RolloutRequest, Trajectory

log = logging.getLogger("rollout_svc.batch")
CANCEL_POLL_S = 0.5
QUEUE_FULL_BACKOFF_S = 1.0


T = TypeVar("T")


class Coalesced(Generic[T]):
    """Calls of many tasks in one: `await coalesced(item)` returns once `flush(items)` ran with its item among those
    that came while the previous flush was on its way (one flush at a time, in order). A flush that raises raises in
    every caller of its round."""

    def __init__(self, flush: Callable[[list[T]], Awaitable[Any]]) -> None:
        self.flush = flush
        self.waiting: list[tuple[T, asyncio.Future[None]]] = []
        self.flusher: asyncio.Task[None] | None = None

    async def __call__(self, item: T) -> None:
        done = asyncio.get_running_loop().create_future()
        self.waiting.append((item, done))
        if self.flusher is None or self.flusher.done():
            self.flusher = asyncio.ensure_future(self._flush())
        await done

    async def drain(self) -> None:
        """Wait until every item handed in so far was flushed (or its flush failed)."""
        while self.flusher is not None and not self.flusher.done():
            await asyncio.wait([self.flusher])

    async def _flush(self) -> None:
        while self.waiting:
            round_, self.waiting = self.waiting, []
            try:
                await self.flush([item for item, _ in round_])
            except Exception as exc:
                for _, done in round_:
                    if not done.done():
                        done.set_exception(exc)
            else:
                for _, done in round_:
                    if not done.done():
                        done.set_result(None)


class BatchRun:
    """Runs (or resumes) one batch under its lease. `run()` returns the status it ended in, or why it did not run.

    A run that loses its lease (Redis says another run holds it, or it could not refresh it for a whole lease
    lifetime) exits the process at once: the other run owns the lines now, and a cancel on the way out would abort
    requests that run awaits.
    """

    def __init__(self, settings: Settings, batch_id: str) -> None:
        self.settings, self.batch_id = settings, batch_id
        self.store = BatchStore(settings)
        # Many lines finish (and start) at once: their marks and outputs go to Redis together, one round trip each.
        self._mark: Coalesced[str] = Coalesced(lambda ids: self.store.mark_submitted(self.batch_id, ids))
        self._record: Coalesced[tuple[str, dict[str, Any]]] = Coalesced(
            lambda outputs: self.store.record(self.batch_id, outputs)
        )
        self.token = uuid.uuid4().hex
        self.models: list[str] = []

    async def run(self) -> str:
        try:
            meta = await self.store.batch(self.batch_id)
            if meta is None:
                return f"no batch {self.batch_id}"
            if meta["status"] in TERMINAL:
                return meta["status"]
            if not await self.store.acquire_lease(self.batch_id, self.token):
                return "another run holds this batch"
            keeper = asyncio.create_task(self._keep_lease())
            try:
                return await self._run(meta)
            finally:
                keeper.cancel()
                await self.store.refresh_lease(self.batch_id, self.token, release=True)
        finally:
            await self.store.close()

    async def _keep_lease(self) -> None:
        ttl = self.settings.batch.batch_lease_ttl_s
        held_at = time.monotonic()
        while True:
            await asyncio.sleep(ttl / 4)
            try:
                if not await self.store.refresh_lease(self.batch_id, self.token):
                    log.error("batch %s: another run holds the lease; this run stops", self.batch_id)
                    os._exit(3)
                held_at = time.monotonic()
            except (RedisError, OSError) as exc:
                if time.monotonic() - held_at > ttl:
                    log.error(
                        "batch %s: could not refresh the lease for %g s (%s); this run stops", self.batch_id, ttl, exc
                    )
                    os._exit(3)

    async def _run(self, meta: dict[str, str]) -> str:
        if meta["status"] == "cancelling":
            return await self._finalize("cancelled")
        if meta["status"] == "validating":
            await self.store.mark(self.batch_id, status="in_progress", in_progress_at=int(time.time()))
        content = await self.store.file_content(meta["input_file_id"])
        if content is None:
            await self.store.mark(
                self.batch_id,
                status="failed",
                failed_at=int(time.time()),
                errors=json.dumps(
                    [{"code": "file_not_found", "message": f"input file {meta['input_file_id']} expired"}]
                ),
            )
            return "failed"
        lines = parse_lines(content, meta["endpoint"])
        done = await self.store.done_ids(self.batch_id)
        unfinished = [line for line in lines if line.custom_id not in done]
        earlier = await self.store.submitted_ids(self.batch_id)
        submitted = await self._in_redis([line for line in unfinished if line.custom_id in earlier])
        # Lines awaited from an earlier run go first, all at once (they are in flight already, and the reader reads
        # the stream again once per burst of them); the rest through `batch_concurrency` feeders.
        awaited = [line for line in unfinished if line.custom_id in submitted]
        todo = iter([line for line in unfinished if line.custom_id not in submitted])
        log.info(
            "batch %s: %d lines, %d done, %d awaited from an earlier run, %d of its lines sent again",
            self.batch_id,
            len(lines),
            len(done),
            len(submitted),
            len(earlier - done - submitted),
        )
        async with RolloutClient(self.settings, producer_id=f"batch-{self.batch_id}") as client:
            self.models = sorted({w.model for w in await client.workers() if w.model})
            if self.settings.api.served_model_name:
                self.models = [self.settings.api.served_model_name]

            async def one(line: BatchLine, attached: bool) -> None:
                output = await self._line(client, line, attached)
                await self._record((line.custom_id, output))

            async def feed() -> None:
                for line in todo:
                    await one(line, False)

            feeders = [asyncio.ensure_future(one(line, True)) for line in awaited]
            feeders += [asyncio.ensure_future(feed()) for _ in range(self.settings.batch.batch_concurrency)]
            all_fed = asyncio.ensure_future(asyncio.gather(*feeders))
            try:
                while not all_fed.done():
                    await asyncio.wait([all_fed], timeout=CANCEL_POLL_S)
                    status = (await self.store.batch(self.batch_id) or {}).get("status")
                    if status == "cancelling" and not all_fed.done():
                        all_fed.cancel()
                        await asyncio.gather(all_fed, return_exceptions=True)
                        return await self._finalize("cancelled")
                all_fed.result()  # a Redis error ends the run: RQ runs it again
            finally:
                for feeder in feeders:
                    feeder.cancel()
        return await self._finalize("completed")

    async def _line(self, client: RolloutClient, line: BatchLine, attached: bool) -> dict[str, Any]:
        """One line's output. Lines fail (with their HTTP status and error) on bad input or a failed generation;
        Redis errors propagate (the run is retried)."""
        try:
            plan = self._plan(line)
            ids = self._request_ids(line, plan)
            trajectories = await self._generate(client, line, plan, ids, attached)
            for t in trajectories:
                raise_for(t)
            return output_line(line.custom_id, 200, plan.reply.response(trajectories, plan.prompt_indices), None)
        except (RedisError, OSError):
            raise
        except Exception as exc:
            error = from_exception(exc)
            body = error.body()
            return output_line(line.custom_id, error.status, body, {"code": error.code, "message": error.message})

    def _plan(self, line: BatchLine) -> Plan:
        """The line's plan, as the HTTP API would make it. Raises `APIError` 400 (bad body) or 404 (model)."""
        if line.body.get("stream"):
            raise APIError(400, "stream is not supported in a batch", param="stream")
        model = line.body.get("model")
        if self.models and model is not None and model not in self.models:
            names = ", ".join(self.models)
            message = f"The model `{model}` does not exist; this fleet serves {names}"
            raise APIError(404, message, param="model", code="model_not_found")
        name = model if isinstance(model, str) else (self.models[0] if self.models else "")
        try:
            if line.url == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(line.body)
                return chat_plan(chat, name, chat.session_id, self.settings.api.api_default_max_tokens)
            completion = CompletionRequest.model_validate(line.body)
            return completion_plan(completion, name, completion.session_id)
        except ValidationError as exc:  # answered as the HTTP API answers a bad body
            raise invalid_body(exc.errors()) from exc

    async def _generate(
        self, client: RolloutClient, line: BatchLine, plan: Plan, ids: list[str], attached: bool
    ) -> list[Trajectory]:
        """Send the plan's requests (or, `attached`, await those an earlier run sent), waiting out a full queue."""

        while True:
            requests = await self._requests(client, plan, ids)
            if not attached:  # marked before it is sent: a resumed run checks that Redis has what is marked
                await self._mark(line.custom_id)
            try:
                return await client.run(requests, enqueued=attached)
            except QueueFullError:
                await asyncio.sleep(QUEUE_FULL_BACKOFF_S)
            except RequestTimeoutError:
                if not attached:
                    raise
                # What the earlier run sent never answered (lost with a Redis that forgot, or its result expired).
                log.warning("batch %s: %s got no result from an earlier run; sending it again", self.batch_id, ids)
                ids, attached = [f"{i}~{uuid.uuid4().hex[:6]}" for i in ids], False

    def _request_ids(self, line: BatchLine, plan: Plan) -> list[str]:
        """A line's request ids: `batch:{id}:{custom_id}`, and `:{j}` for the j-th of its plan's choices (n > 1, or
        several prompts). A line's plan is the same in every run, so a resumed run finds the same ids."""
        base = f"batch:{self.batch_id}:{line.custom_id}"
        return [base] if len(plan.prompts) == 1 else [f"{base}:{j}" for j in range(len(plan.prompts))]

    async def _in_redis(self, lines: list[BatchLine]) -> set[str]:
        """The custom_ids among `lines` (marked submitted by an earlier run) whose every request Redis still has: its
        result in the batch's results stream, or its entry in a requests stream (queued, or pending on a worker).
        The others never reached Redis (the run died in between) or were lost with it, and are sent again."""
        ids_of: dict[str, list[str]] = {}
        for line in lines:
            with contextlib.suppress(APIError):  # a line that plans to an error was never sent
                ids_of[line.custom_id] = self._request_ids(line, self._plan(line))
        if not ids_of:
            return set()
        wanted = {rid for rids in ids_of.values() for rid in rids}
        fleet = Fleet(self.settings)
        try:
            await fleet.refresh()
            held = await fleet.each(lambda link: link.streams.held(wanted, link.keys.results(f"batch-{self.batch_id}")))
        finally:
            await fleet.close()
        found = set().union(*held.values())
        return {cid for cid, rids in ids_of.items() if all(rid in found for rid in rids)}

    @staticmethod
    async def _requests(client: RolloutClient, plan: Plan, ids: list[str]) -> list[RolloutRequest]:
        sessions = [plan.session_id] * len(plan.prompts) if plan.session_id else None
        return await client.rollout_requests(
            plan.prompts,
            plan.params,
            sessions,
            request_ids=ids,
            group_ids=plan.group_ids,
            tools=plan.tools,
            parse_tool_calls=plan.parse_tool_calls,
            chat_template_kwargs=plan.chat_template_kwargs,
        )

    async def _finalize(self, status: str) -> str:
        """Write the output file (in input order) and end the batch in `status`; idempotent (a run that dies here
        is run again and finalizes again)."""
        await self._record.drain()  # outputs of lines cancelled on their way to Redis are in before it is read
        now = int(time.time())
        await self.store.mark(self.batch_id, finalizing_at=now)
        meta = await self.store.batch(self.batch_id) or {}
        content = await self.store.file_content(meta.get("input_file_id", "")) or b""
        outputs = await self.store.outputs(self.batch_id)
        order = [line.custom_id for line in parse_lines(content, meta.get("endpoint"))] if content else list(outputs)
        chunks = [outputs[c] + b"\n" for c in order if c in outputs]
        retention = self.settings.batch.batch_retention_s
        output_id = await self.store.create_file(
            b"".join(chunks), f"{self.batch_id}_output.jsonl", "batch_output", expire_s=retention
        )
        if meta.get("output_path"):
            try:
                write_atomically(Path(meta["output_path"]), iter(chunks))
            except OSError as exc:
                log.warning(
                    "batch %s: could not write %s (%s); `rollout-svc batch download %s` has it",
                    self.batch_id,
                    meta["output_path"],
                    exc,
                    self.batch_id,
                )
        keys = self.settings.keys
        pipe = self.store.redis.pipeline(transaction=True)
        pipe.hset(
            keys.batch(self.batch_id), mapping={"status": status, f"{status}_at": now, "output_file_id": output_id}
        )
        for key in (
            keys.batch(self.batch_id),
            keys.batch_output(self.batch_id),
            keys.file(meta.get("input_file_id", "")),
        ):
            pipe.expire(key, int(retention))
        pipe.delete(keys.batch_submitted(self.batch_id), keys.results(f"batch-{self.batch_id}"))
        await pipe.execute()
        log.info("batch %s %s: %d lines written (%s)", self.batch_id, status, len(chunks), output_id)
        return status
