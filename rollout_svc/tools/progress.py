"""Progress of a long command: a rich bar on a terminal, plain flushed lines every few seconds anywhere else."""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    """Counts done out of `total` (None: unknown, or a phase with no count), shown while a `with` block runs.

    On a terminal (`stream.isatty()`) it is a rich progress bar. Anywhere else (CI logs, pipes, files) it prints
    flushed lines: one on entering, one per `interval_s` seconds while the block runs (from a daemon thread, so
    a phase that never calls `advance` still says it is alive), and one on leaving, that says done:

        requests: started, 500 to do
        requests: 120/500 (24%), 13.2/s, 9 s
        requests: done, 500/500 (100%), 13.1/s, 38 s

    A phase with no count prints `section: still running, 12 s`. `interval_s=0` prints at every update instead.
    Example (advance and update are thread-safe):

        with Progress(len(prompts), "requests") as progress:
            for prompt in prompts:
                run(prompt)
                progress.advance()
    """

    def __init__(
        self, total: int | None, description: str, *, interval_s: float = 5.0, stream: IO[str] | None = None
    ) -> None:
        self.total, self.description, self.interval_s = total, description, interval_s
        self.stream = stream if stream is not None else sys.stdout
        self.completed = 0
        self._lock = threading.Lock()
        self._started_s = self._printed_s = time.monotonic()
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Progress:
        self._started_s = time.monotonic()
        if self.stream.isatty():
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self._bar = RichProgress(*columns, console=Console(file=self.stream))
            self._task = self._bar.add_task(self.description, total=self.total)
            self._bar.start()
            return self
        with self._lock:
            self._print("started" + (f", {self.total} to do" if self.total is not None else ""))
        if self.interval_s > 0:
            self._ticker = threading.Thread(target=self._tick, name=f"progress: {self.description}", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._bar is not None:
            self._bar.stop()
            return
        with self._lock:
            outcome = "done" if exc[0] is None else f"stopped ({exc[0].__name__})"
            counts = self._counts()
            if counts:
                self._print(f"{outcome}, {counts}, {self._rate()}, {self._elapsed_s():.0f} s")
            else:
                self._print(f"{outcome} in {self._elapsed_s():.0f} s")

    def advance(self, n: int = 1) -> None:
        """Count `n` more done."""
        with self._lock:
            self._set(self.completed + n, self.total)

    def update(self, completed: int, total: int | None = None) -> None:
        """Set the count done (and the total, if given)."""
        with self._lock:
            self._set(completed, total if total is not None else self.total)

    # --- internals (called with the lock held) ---------------------------------------------------------------

    def _set(self, completed: int, total: int | None) -> None:
        self.completed, self.total = completed, total
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=completed, total=total)
        elif time.monotonic() - self._printed_s >= self.interval_s:
            self._print(self._status())

    def _tick(self) -> None:
        """The daemon thread of a plain stream: a status line whenever `interval_s` passed with none printed."""
        while True:
            with self._lock:
                due_in_s = self._printed_s + self.interval_s - time.monotonic()
                if due_in_s <= 0:
                    self._print(self._status())
                    due_in_s = self.interval_s
            if self._stop.wait(due_in_s):
                return

    def _status(self) -> str:
        counts = self._counts()
        if not counts:
            return f"still running, {self._elapsed_s():.0f} s"
        return f"{counts}, {self._rate()}, {self._elapsed_s():.0f} s"

    def _counts(self) -> str:
        if self.total is not None:
            percent = 100 * self.completed / self.total if self.total else 100.0
            return f"{self.completed}/{self.total} ({percent:.0f}%)"
        return f"{self.completed} done" if self.completed else ""

    def _rate(self) -> str:
        elapsed_s = self._elapsed_s()
        return f"{self.completed / elapsed_s:.1f}/s" if elapsed_s > 0 else "-/s"

    def _elapsed_s(self) -> float:
        return time.monotonic() - self._started_s

    def _print(self, text: str) -> None:
        self.stream.write(f"{self.description}: {text}\n")
        self.stream.flush()
        self._printed_s = time.monotonic()
