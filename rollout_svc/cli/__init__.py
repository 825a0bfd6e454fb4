"""The `rollout-svc` command (entry point `rollout_svc.cli:main`): one module per group of subcommands."""

import os
import stat
import sys

# Help piped into grep or a log is as wide as its longest option: rich otherwise renders it 80 columns wide off a
# terminal and cuts option names (`--tensor-parallel-…`). Read by typer when it is imported, below.
if not sys.stdout.isatty() and "TERMINAL_WIDTH" not in os.environ and "COLUMNS" not in os.environ:
    os.environ["TERMINAL_WIDTH"] = "160"

from rollout_svc.cli.main import app

__all__ = ["app", "main"]


def main() -> None:
    """Run the command. A reader that stops reading early (`| head`, `| grep -q`) ends it quietly with exit 0, as it
    has what it wanted, not exit 1, which `set -o pipefail` reads as a failure (seen when `rollout-svc up --help |
    grep -q` matched before the help was all written). Rich answers the broken pipe with exit 1 after pointing
    stdout at /dev/null, typer and click with exit 1 after wrapping stdout in their `PacifyFlushWrapper`: that is how
    it is told apart from a real exit 1."""
    piped = _is_pipe()
    try:
        try:
            app()
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail again
        sys.exit(0)
    except SystemExit as exc:
        pacified = type(sys.stdout).__name__.lstrip("_") == "PacifyFlushWrapper"
        if exc.code == 1 and piped and (pacified or not _is_pipe()):
            sys.exit(0)
        raise


def _is_pipe() -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (OSError, ValueError):
        return False
