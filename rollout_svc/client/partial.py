"""Partial rollouts: a call's completion target (end the step once enough groups finished, or after a time), and the
continuation of what it cut in a later call.

What the published systems do with an RL step's long tail: APRIL ("Active Partial Rollouts in Reinforcement Learning
to Tame Long-tail Generation", arXiv 2509.18521) over-samples and aborts the tail once the batch is full; Kimi k1.5
(arXiv 2501.12599, its "partial rollouts") carries unfinished rollouts into the next iteration and continues them.
Both are a `completion_target` here: the call returns once that fraction of its groups finished, the rest cut
(`finish_reason="abort"`, `abort_cause="partial"`) with the tokens they had. Drop them (APRIL's over-sampling), or
pass them as prompts to a later `generate` (Kimi's partial rollouts): each continues token-exact from where it was
cut, on any worker, with its weight-version spans, so its staleness stays exact.
"""

from __future__ import annotations

import math
from typing import Any

from rollout_svc.errors import InvalidRequestError
from rollout_svc.protocol import Continuation, Trajectory


def check_target(completion_target: float | None, cut_after_s: float | None) -> None:
    """Raise `InvalidRequestError` unless `completion_target` is None or in (0, 1] and `cut_after_s` None or > 0."""
    if completion_target is not None and not 0 < completion_target <= 1:
        raise InvalidRequestError(
            f"completion_target must be a fraction of the groups in (0, 1], got {completion_target}"
        )
    if cut_after_s is not None and not (cut_after_s > 0 and math.isfinite(cut_after_s)):
        raise InvalidRequestError(f"cut_after_s must be a positive number of seconds, got {cut_after_s}")


def continued_fields(index: int, trajectory: Trajectory, request_id: str) -> dict[str, Any]:
    """The `RolloutRequest` fields that continue `trajectory` (cut by a completion target, or another abort) under
    the new `request_id`: its prompt ids, session, group, and a `Continuation` of its tokens, logprobs, text and
    weight-version spans (the worker generates after them, `max_tokens` reduced by them, and answers with the whole
    completion). Raises `InvalidRequestError` (naming prompt `index`) for one that cannot be continued: it
    finished, or it has no prompt ids (a text or chat request cut before it ran: send its prompt again)."""
    if trajectory.finish_reason != "abort":
        raise InvalidRequestError(
            f"prompt {index} is a trajectory that finished ({trajectory.finish_reason}); only one cut early "
            "(finish_reason 'abort', say abort_cause 'partial') can be continued"
        )
    if not trajectory.prompt_token_ids:
        raise InvalidRequestError(
            f"prompt {index} is a trajectory without prompt token ids (a text or chat request cut before it ran): "
            "send its prompt again instead"
        )
    return {
        "request_id": request_id,
        "prompt_token_ids": trajectory.prompt_token_ids,
        "session_id": trajectory.session_id,
        "group_id": trajectory.group_id,
        "continuation": Continuation.of(trajectory, request_id, interruptions_added=0),
    }
