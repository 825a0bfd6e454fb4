"""The step report: how one call (an RL step's generation) used the fleet: its makespan, each worker's busy time, the
idle fraction, and what was moved or cut (`RolloutClient.step_report`, the bench's section (j))."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from rollout_svc.protocol import Trajectory


@dataclass(frozen=True)
class StepReport:
    """One call's step. Times are seconds of this host's wall clock (a simulated fleet's are scaled back by the
    reader: `scaled`).

    - `makespan_s`: from the call's start to its last answer.
    - `busy_s`: worker id -> time during which some request of the call ran there: the union of the requests'
      [taken, answered] intervals (`submitted_at + queue_time_s`, then `+ generation_time_s`; a request continued
      on another worker counts where its last attempt ran, for all its time). Workers that served none: 0.
    - `idle_fraction`: 1 - sum(busy) / (workers x makespan), the share of the fleet's time in the step spent
      without work (the figure partial rollouts and migration cut).
    - `requests`, `finished` (ended by a stop or a length), `cut` (partial rollouts: `abort_cause="partial"`),
      `moves` (interruptions the requests were continued through: straggler moves, pauses, shutdowns; a cut's own
      not counted),
      `output_tokens` (all, cut ones included) and `cut_tokens` (the tokens the cut ones carry to a later call).
    - `regenerated` and `stale_tokens`: requests generated again as staler than their bound, and the tokens they had
      made, then discarded (the goal is 0: workers check the bound before they generate,
      `RolloutRequest.max_staleness`).
    """

    makespan_s: float
    busy_s: dict[str, float] = field(default_factory=dict)
    requests: int = 0
    finished: int = 0
    cut: int = 0
    moves: int = 0
    output_tokens: int = 0
    cut_tokens: int = 0
    regenerated: int = 0
    stale_tokens: int = 0

    @property
    def idle_fraction(self) -> float:
        if not self.busy_s or self.makespan_s <= 0:
            return 0.0
        return max(0.0, 1 - sum(self.busy_s.values()) / (len(self.busy_s) * self.makespan_s))

    def scaled(self, factor: float) -> StepReport:
        """The same report with every time multiplied by `factor` (a simulated fleet's time scale)."""
        busy = {w: s * factor for w, s in self.busy_s.items()}
        return StepReport(
            self.makespan_s * factor,
            busy,
            self.requests,
            self.finished,
            self.cut,
            self.moves,
            self.output_tokens,
            self.cut_tokens,
            self.regenerated,
            self.stale_tokens,
        )

    def summary(self) -> str:
        """One line for a log: makespan, idle fraction, busiest and least busy worker, cuts and moves."""
        busy = sorted(self.busy_s.values()) or [0.0]
        return (
            f"step: {self.requests} requests in {self.makespan_s:.2f} s on {len(self.busy_s)} workers "
            f"(busy {busy[-1]:.2f} s at most, {busy[0]:.2f} s at least; idle fraction {self.idle_fraction:.2f}); "
            f"{self.finished} finished, {self.cut} cut ({self.cut_tokens} tokens carried), {self.moves} moves, "
            f"{self.regenerated} regenerated as stale ({self.stale_tokens} tokens discarded)"
        )


def step_report(
    trajectories: Sequence[Trajectory],
    started_at: float,
    ended_at: float,
    workers: Iterable[str] = (),
    stale: tuple[int, int] = (0, 0),
) -> StepReport:
    """The report of a step whose calls started at `started_at` and ended at `ended_at` (unix s; every request
    submitted at `started_at` or later, its own `submitted_at` unknown here), over `workers` (the fleet: those that
    served none count as idle the whole step) and the workers the trajectories name. `stale`: (regenerations as
    stale, tokens they discarded), which the trajectories do not show."""
    spans = worker_spans(trajectories, started_at, workers)
    cut = [t for t in trajectories if t.abort_cause == "partial"]
    return StepReport(
        makespan_s=max(0.0, ended_at - started_at),
        busy_s={w: sum(end - begin for begin, end in union(intervals)) for w, intervals in spans.items()},
        requests=len(trajectories),
        finished=sum(t.finish_reason in ("stop", "length") for t in trajectories),
        cut=len(cut),
        moves=sum(t.interruptions for t in trajectories) - len(cut),
        output_tokens=sum(len(t.completion_token_ids) for t in trajectories),
        cut_tokens=sum(len(t.completion_token_ids) for t in cut),
        regenerated=stale[0],
        stale_tokens=stale[1],
    )


def worker_spans(
    trajectories: Sequence[Trajectory], started_at: float = 0.0, workers: Iterable[str] = ()
) -> dict[str, list[tuple[float, float]]]:
    """Per worker (each of `workers`, and each the trajectories name), the (begin, end) of each trajectory's
    generation on it: `started_at` plus its queue time, then its generation time (s; unix s for a call's start)."""
    spans: dict[str, list[tuple[float, float]]] = {w: [] for w in workers}
    for t in trajectories:
        start = started_at + t.queue_time_s
        spans.setdefault(t.worker_id or "?", []).append((start, start + t.generation_time_s))
    return spans


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [begin, end] intervals, as disjoint (begin, end) intervals in order."""
    merged: list[tuple[float, float]] = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged
