"""A request's life in a producer: the record of each attempt awaited (`Attempt`), and the pure rules that decide
what follows a trajectory: a token-exact retry (`retry_of`), the caller's answer (`final_fields`), a regeneration of a
stale one (`regeneration_of`).

An attempt is one request id the connection awaits for one position of a call; the connection holds one map,
request id -> `Attempt`, and each attempt goes through:

1. awaited: put in the map by `submit` (or `attach`, which sends nothing and knows no shard);
2. being sent: `sending` counts its enqueues Redis has not answered yet (the submitter is on them);
3. placed: Redis answered; `placed` is its entry (what a cancel sweeps);
4. then one of: answered (its result routed; out of the map); retried or regenerated (out of the map, a new attempt
   under a new id, for the same position, in); cancelled (`cancelling`: it stays, its results dropped, until the
   submitter has sent the cancel with its shard and placement, then out); failed with `shard_unavailable` (its shard's
   Redis away past `redis_outage_s`; out); lost by a Redis that restarted (enqueued again under its id, to the shard
   chosen for it then: back to 2). A result may beat Redis' answer to the enqueue: an attempt out of the map may
   still count down `sending`.

A request carries its shard: `reply_to` is this producer's results stream in the shard it is enqueued to, set with
its deadline when the request is built (`Connection.reply_to`), so the hot path copies nothing; a retry keeps the
deadline and gets the `reply_to` of the shard chosen for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_svc.client.calls import Call
from rollout_svc.config import ClientSettings
from rollout_svc.dataplane.streams import Placed
from rollout_svc.protocol import ErrorResult, Request, RolloutRequest, Trajectory

RETRIED_CAUSES = ("pause", "shutdown", "stale", "migrate")  # the aborts the client hides by retrying
# The request id and `reply_to` of a request's next attempt: a fresh id, and the results stream of the shard chosen
# for it. Called only once the attempt is decided.
NewAttempt = Callable[[RolloutRequest], tuple[str, str]]


@dataclass(slots=True)
class Attempt:
    """One attempt awaited at position `index` of `call`, under `request.request_id` (the position's own request for
    the first attempt, a retry or a regeneration of it later). `shard`: where it was enqueued (None until then, and
    for an attached one). `placed`: its entry there, once Redis answered. `sending`: its enqueues not yet answered.
    `cancelling`: cancelled, the cancel not yet sent."""

    call: Call
    index: int
    request: Request
    shard: str | None = None
    placed: Placed | None = None
    sending: int = 0
    cancelling: bool = False


def _is_retried(result: Trajectory) -> bool:
    return result.finish_reason == "abort" and result.abort_cause in RETRIED_CAUSES


def retry_of(
    request: Request, result: Trajectory, limits: ClientSettings, now: float, new_attempt: NewAttempt
) -> RolloutRequest | None:
    """The token-exact retry of `request` (the caller's) whose latest attempt came back as `result`, or None if
    `result` is final.

    Retried: an abort by a pause, a worker's shutdown or a stale worker (`RETRIED_CAUSES`) of a rollout request that
    has its prompt's token ids, fewer than `limits.max_abort_retries` interruptions so far, tokens left to generate
    (`max_tokens` not reached) and its deadline (unix s) after `now`. The retry is the same request (session, group,
    streaming, tools, deadline) on the prompt ids it was served with, under the id and `reply_to` `new_attempt`
    gives, submitted at `now`, with a `Continuation` of every token so far (the worker reduces `max_tokens` and
    `min_tokens` by them and answers with the whole completion)."""
    if not _is_retried(result) or not isinstance(request, RolloutRequest) or not result.prompt_token_ids:
        return None
    if result.interruptions >= limits.max_abort_retries:
        return None
    if len(result.completion_token_ids) >= request.sampling_params.max_tokens:
        return None
    if request.deadline is not None and request.deadline <= now:
        return None
    request_id, reply_to = new_attempt(request)
    return request.continued(result, request.request_id, request_id=request_id, reply_to=reply_to, submitted_at=now)


def final_fields(request: Request, result: Trajectory) -> dict[str, Any]:
    """The fields the caller's trajectory changes, for an attempt's trajectory `retry_of` did not retry: none for a
    trajectory that was not cut by a retried abort; `finish_reason="length"` for one cut at its very last token
    (`max_tokens` reached: nothing was lost); otherwise (retries exhausted, deadline passed, no prompt ids) one more
    interruption, the abort kept."""
    if not _is_retried(result):
        return {}
    if isinstance(request, RolloutRequest) and len(result.completion_token_ids) >= request.sampling_params.max_tokens:
        return {"finish_reason": "length", "abort_cause": None}
    return {"interruptions": result.interruptions + 1}


def cut_fields(request: Request, result: Trajectory) -> dict[str, Any]:
    """The fields the caller's trajectory changes, for the answer of a position cut by its call's completion target:
    none if it finished first; for one the cut stopped (`finish_reason="abort"`, any cause: the cut's cancel, or a
    pause or shutdown that came first), `abort_cause="partial"` and one more interruption, or `finish_reason="length"`
    if it had reached `max_tokens` (nothing left to continue)."""
    if result.finish_reason != "abort":
        return {}
    if isinstance(request, RolloutRequest) and len(result.completion_token_ids) >= request.sampling_params.max_tokens:
        return {"finish_reason": "length", "abort_cause": None}
    return {"abort_cause": "partial", "interruptions": result.interruptions + 1}


def regeneration_of(
    request: Request,
    result: Trajectory,
    limits: ClientSettings,
    regenerations: int,
    now: float,
    new_attempt: NewAttempt,
) -> RolloutRequest | None:
    """`request` (the caller's) to generate again, from scratch, because `result` (its final trajectory, `staleness`
    and `adapter_staleness` set) is staler than `limits.max_staleness` (its weights or its adapter), or was cut by
    its worker as staler than its own bound (`abort_cause="staleness"`); None if the caller gets `result` as it is:
    fresh enough, no limit, policy `mark`, not a rollout request, `regenerations` (of this position so far) at
    `limits.max_abort_retries`, or its deadline (unix s) not after `now`. The regeneration is `request` under the id
    and `reply_to` `new_attempt` gives, without the continuation it may carry (those tokens are the stale ones)."""
    limit = limits.max_staleness
    stalest = max((s for s in (result.staleness, result.adapter_staleness) if s is not None), default=None)
    cut = result.abort_cause == "staleness"
    if not cut and (limit is None or stalest is None or stalest <= limit):
        return None
    if limits.stale_policy != "regenerate" or not isinstance(request, RolloutRequest):
        return None
    if regenerations >= limits.max_abort_retries:
        return None
    if request.deadline is not None and request.deadline <= now:
        return None
    request_id, reply_to = new_attempt(request)
    return request.model_copy(update={"request_id": request_id, "reply_to": reply_to, "continuation": None})


def error_trajectory(request: RolloutRequest, error: ErrorResult) -> Trajectory:
    """An error result as the trajectory a caller gets (`finish_reason=\"error\"`, the error's message and code)."""
    return Trajectory(
        request_id=request.request_id,
        session_id=request.session_id,
        group_id=request.group_id,
        prompt_token_ids=request.prompt_token_ids or [],
        finish_reason="error",
        worker_id=error.worker_id,
        error=error.message,
        error_code=error.code,
    )
