"""Progress off a terminal: plain flushed lines with counts, at most one per interval, a final line saying done."""

from __future__ import annotations

import io
import re
import threading

import pytest

from rollout_svc.tools.progress import Progress


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_every_update_prints_a_line_with_counts_at_interval_zero():
    stream = io.StringIO()
    with Progress(4, "requests", interval_s=0, stream=stream) as progress:
        progress.advance()
        progress.advance(2)
        progress.update(4)
    out = lines(stream)
    assert out[0] == "requests: started, 4 to do"
    assert [re.sub(r", [\d.]+/s, \d+ s$", "", line) for line in out[1:4]] == [
        "requests: 1/4 (25%)",
        "requests: 3/4 (75%)",
        "requests: 4/4 (100%)",
    ]
    assert re.fullmatch(r"requests: done, 4/4 \(100%\), [\d.]+/s, \d+ s", out[-1])
    assert len(out) == 5


def test_updates_within_the_interval_print_nothing_until_the_end():
    stream = io.StringIO()
    with Progress(500, "requests", interval_s=60, stream=stream) as progress:
        for _ in range(500):
            progress.advance()
    assert [line.split(",")[0] for line in lines(stream)] == ["requests: started", "requests: done"]
    assert "500/500 (100%)" in lines(stream)[-1]


def test_update_can_set_the_total_later():
    stream = io.StringIO()
    with Progress(None, "batch", interval_s=0, stream=stream) as progress:
        progress.update(3)
        progress.update(3, total=12)
    assert lines(stream)[0] == "batch: started"
    assert lines(stream)[1].startswith("batch: 3 done, ")
    assert lines(stream)[2].startswith("batch: 3/12 (25%), ")


def test_a_phase_with_no_count_says_it_is_still_running():
    printed = threading.Event()

    class Watched(io.StringIO):
        def flush(self) -> None:
            if "still running" in self.getvalue():
                printed.set()

    stream = Watched()
    with Progress(None, "bench (a) queue overhead", interval_s=0.01, stream=stream):
        assert printed.wait(5), "no periodic line from a phase that never advances"
    out = lines(stream)
    assert re.fullmatch(r"bench \(a\) queue overhead: still running, \d+ s", out[1])
    assert re.fullmatch(r"bench \(a\) queue overhead: done in \d+ s", out[-1])


def test_the_final_line_says_what_stopped_it():
    stream = io.StringIO()
    with pytest.raises(KeyboardInterrupt), Progress(10, "demo", interval_s=60, stream=stream) as progress:
        progress.advance(3)
        raise KeyboardInterrupt
    assert lines(stream)[-1].startswith("demo: stopped (KeyboardInterrupt), 3/10 (30%), ")


def test_a_terminal_gets_a_rich_bar_not_lines():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    with Progress(2, "requests", interval_s=0, stream=stream) as progress:
        progress.advance(2)
    assert "requests: " not in stream.getvalue()
    assert "2/2" in stream.getvalue()
