"""Shard rendezvous (rollout_svc/fleet.py `rendezvous`): deterministic, even, and minimal movement when shards change
(highest random weight hashing: Thaler and Ravishankar). No Redis."""

from __future__ import annotations

from collections import Counter

from rollout_svc.fleet import rendezvous
from tests.support import fresh_python

SHARDS = ["g0", "g1", "g2", "g3", "g4"]
SESSIONS = [f"session-{i}" for i in range(3000)]


def placement(shards: list[str]) -> dict[str, str]:
    return {session: rendezvous(session, shards) for session in SESSIONS}


def test_the_shard_of_a_session_does_not_depend_on_the_order_of_shards_or_on_the_process():
    placed = placement(SHARDS)
    assert placed == placement(list(reversed(SHARDS)))
    shards = ["g0", "g1", "g2"]
    code = f"from rollout_svc.fleet import rendezvous as r; print([r(f'session-{{i}}', {shards}) for i in range(50)])"
    here = [rendezvous(f"session-{i}", shards) for i in range(50)]
    assert fresh_python(code).strip() == str(here)  # no per-process salt


def test_sessions_spread_evenly_over_the_shards():
    counts = Counter(placement(SHARDS).values())
    expected = len(SESSIONS) / len(SHARDS)
    chi_square = sum((counts[shard] - expected) ** 2 / expected for shard in SHARDS)
    assert set(counts) == set(SHARDS)
    assert chi_square < 18.47, counts  # the 0.999 quantile of chi-square with 4 degrees of freedom
    assert min(counts.values()) > 0.8 * expected and max(counts.values()) < 1.2 * expected, counts


def test_only_the_sessions_of_a_shard_that_leaves_move_and_they_spread_over_the_rest():
    before = placement(SHARDS)
    after = placement([s for s in SHARDS if s != "g2"])
    moved = {session for session in SESSIONS if before[session] != after[session]}
    assert moved == {session for session, shard in before.items() if shard == "g2"}
    assert Counter(after[session] for session in moved).keys() == {"g0", "g1", "g3", "g4"}


def test_a_shard_that_joins_takes_sessions_from_every_shard_and_only_for_itself():
    before = placement(SHARDS)
    after = placement([*SHARDS, "g5"])
    moved = [session for session in SESSIONS if before[session] != after[session]]
    assert all(after[session] == "g5" for session in moved)
    assert 0.8 * len(SESSIONS) / 6 < len(moved) < 1.2 * len(SESSIONS) / 6
    assert {before[session] for session in moved} == set(SHARDS)


def test_one_shard_takes_every_session():
    assert set(placement(["only"]).values()) == {"only"}
