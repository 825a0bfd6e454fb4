"""Project-level guarantees: the import boundary, the CLI contract, no pickle (compose: test_compose.py)."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

from tests.support import ROOT, fresh_python


def test_import_rollout_svc_pulls_in_neither_vllm_nor_torch():
    code = (
        "import sys, rollout_svc, rollout_svc.cli, rollout_svc.api, rollout_svc.batch, rollout_svc.integrations.skyrl; "
        "rollout_svc.WeightSender, rollout_svc.SyncReport; print(sorted({'vllm', 'torch'} & set(sys.modules)))"
    )
    assert fresh_python(code).strip() == "[]"


def test_workers_and_the_weight_sender_import_torch_only_to_transfer_tensors():
    code = (
        "import sys, workers.worker, workers.echo, rollout_svc.weightsync.plane; before = 'torch' in sys.modules; "
        "from rollout_svc import WeightSender; import rollout_svc.weightsync.transfer; "
        "print(before, WeightSender.__module__, 'torch' in sys.modules)"
    )
    assert fresh_python(code).split() == ["False", "rollout_svc.client.weight_sender", "True"]


def test_no_pickle_in_service_code():
    pattern = re.compile(r"\bpickle\.(loads?|Unpickler)|cloudpickle")
    sources = [p for d in ("rollout_svc", "workers") for p in (ROOT / d).rglob("*.py")]
    offenders = [p for p in sources if pattern.search(p.read_text())]
    assert offenders == []


def test_every_cli_command_answers_help():
    """The entry point answers in a fresh interpreter, and `worker` there too (it execs `python -m workers`); every
    other command's help is read in this one (typer's own test runner: the same app, without 13 interpreter starts).
    """
    from typer.testing import CliRunner

    from rollout_svc.cli.main import app

    for args, said in (([], "serve"), (["worker"], "--redis-url")):
        out = subprocess.run(
            [sys.executable, "-m", "rollout_svc", *args, "--help"], capture_output=True, text=True, cwd=ROOT
        )
        assert out.returncode == 0 and said in out.stdout, (args, out.stderr)
    commands = ("up", "serve", "status", "top", "demo", "bench", "model")
    commands += ("pause", "resume", "abort", "sleep", "wake-up", "reset-prefix-cache")
    runner = CliRunner()
    for command in commands:
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
        assert result.exit_code == 0, (command, result.output, result.exception)
        assert "--redis-url" in result.output or command == "model", (command, result.output)


# The package map (docs/architecture.md): each part of the package, and the parts it may import. A part is a folder
# of rollout_svc, a module at its top, or `workers`.
TOP = {"config.py", "keys.py", "errors.py", "protocol.py", "orders.py", "wire.py", "model.py", "tracing.py"}
PLANES = {"dataplane", "control", "weightsync"}
MAY_IMPORT: dict[str, set[str]] = {
    **{module: TOP for module in TOP},
    "connections": TOP,
    "dataplane": TOP,
    "control": TOP | {"connections", "dataplane"},
    "weightsync": TOP | {"dataplane"},
    "fleet.py": TOP | {"connections"} | PLANES,
    "client": TOP | {"connections", "fleet.py"} | PLANES,
    "openai": TOP | {"client"},
    "integrations": TOP | {"fleet.py", "client", "openai"},
    "batch": TOP | {"connections", "fleet.py", "client", "openai"},
    "api": TOP | {"connections", "client", "openai", "integrations", "batch"},
    "deploy": TOP | {"connections"},
    "__init__.py": TOP | {"client"},
    "launch.py": set(),  # the Ray worker group's old path: it loads deploy.ray by name, on first use
    "workers": TOP | {"connections"} | PLANES,
}
EVERYTHING = set(MAY_IMPORT) | {"tools", "cli", "workers"}
MAY_IMPORT |= {"tools": EVERYTHING - {"cli"}, "cli": EVERYTHING, "__main__.py": {"cli"}}


def _part(module: str) -> str:
    names = module.split(".")
    if names[0] == "workers":
        return "workers"
    if len(names) == 1:
        return "__init__.py"
    return names[1] if (ROOT / "rollout_svc" / names[1]).is_dir() else f"{names[1]}.py"


def _sources() -> list[Path]:
    return sorted([*(ROOT / "rollout_svc").rglob("*.py"), *(ROOT / "workers").rglob("*.py")])


def test_imports_follow_the_package_map():
    """No part imports one the package map does not allow it (in particular, no circle between parts, and the
    runtime never imports tools, deploy or the CLI), at module level or inside a function."""
    wrong = []
    for path in _sources():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        part = _part(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] not in ("rollout_svc", "workers") or target == "rollout_svc":
                    continue
                other = _part(target)
                if other != part and other not in MAY_IMPORT[part]:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target} ({part} -> {other})")
    assert wrong == []


def _code_lines(path: Path) -> set[int]:
    """The numbers of the lines holding code: not blank, not comments, not docstrings."""
    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skipped = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines.update(r for r in range(token.start[0], token.end[0] + 1) if r not in docstrings)
    return lines


# Rooms by role (STYLE.md): a runtime module over this many lines of code, or a class over that many, is split by
# role, never compressed to fit. The runtime is what a worker, `serve` or a trainer imports: not tools/, deploy/ or
# cli/ (operations code), nor `python -m rollout_svc`'s entry.
MODULE_LINES = 400
CLASS_LINES = 300


def _runtime() -> list[Path]:
    return [
        p
        for p in _sources()
        if not {"tools", "deploy", "cli"} & set(p.relative_to(ROOT).parts[1:-1]) and p.stem != "__main__"
    ]


def test_no_runtime_module_holds_over_400_lines_of_code():
    big = {str(p.relative_to(ROOT)): n for p in _runtime() if (n := len(_code_lines(p))) > MODULE_LINES}
    assert big == {}


def test_no_runtime_class_holds_over_300_lines_of_code():
    big = {}
    for path in _runtime():
        code = _code_lines(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = sum(1 for r in code if node.lineno <= r <= (node.end_lineno or node.lineno))
                if lines > CLASS_LINES:
                    big[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert big == {}


def test_no_runtime_code_raises_not_implemented_error():
    """Composition over mixins: no `raise NotImplementedError` stub holding a mixin up (the engines' optional
    capabilities, in workers/engine*.py, may still refuse a call that way)."""
    stubs = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _runtime()
        if not path.name.startswith("engine")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Raise) and node.exc is not None and "NotImplementedError" in ast.unparse(node.exc)
    ]
    assert stubs == []
