"""The command behind a pipe: a reader that stops early (`| head`, `| grep -q`) is no failure; a real one still is."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import ROOT

COMMAND = [sys.executable, "-m", "rollout_svc"]


def test_a_reader_that_stops_early_leaves_exit_0_and_no_traceback():
    proc = subprocess.Popen([*COMMAND, "up", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)  # the help is ~20 KB: the rest is written after the reader has gone
    proc.stdout.close()
    with proc.stderr:
        assert proc.wait(timeout=60) == 0
        assert b"Traceback" not in proc.stderr.read()


def test_a_reader_gone_before_the_first_write_leaves_exit_0():
    """The help's first write fails (EPIPE inside the command: typer's handler, not only the exit's flush)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [*COMMAND, "up", "--help"], stdout=write_end, stderr=subprocess.PIPE, cwd=ROOT, timeout=60
        )
    finally:
        os.close(write_end)
    assert done.returncode == 0 and b"Traceback" not in done.stderr


def test_a_failing_command_keeps_its_exit_code_behind_a_pipe():
    unreachable = ["adapter", "list", "--redis-url", "redis://127.0.0.1:1/0"]
    done = subprocess.run([*COMMAND, *unreachable], capture_output=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and b"cannot reach Redis" in done.stderr


def test_typers_answer_to_a_broken_pipe_becomes_exit_0_and_a_real_exit_1_stays(monkeypatch):
    """typer answers EPIPE by wrapping stdout in its PacifyFlushWrapper and exiting 1 (what a loaded machine hit in
    the acceptance script: `up --help | grep -q` read the match and left before the help's last write)."""
    import pytest
    from typer._click.utils import PacifyFlushWrapper

    import rollout_svc.cli as cli

    def typer_on_epipe() -> None:
        sys.stdout = PacifyFlushWrapper(sys.stdout)
        sys.exit(1)

    def failing() -> None:
        sys.exit(1)

    monkeypatch.setattr(cli, "_is_pipe", lambda: True)
    stdout = sys.stdout
    for app, code in ((typer_on_epipe, 0), (failing, 1)):
        monkeypatch.setattr(cli, "app", app)
        monkeypatch.setattr(sys, "stdout", stdout)  # as it was, and restored after the test
        with pytest.raises(SystemExit) as exited:
            cli.main()
        assert exited.value.code == code
