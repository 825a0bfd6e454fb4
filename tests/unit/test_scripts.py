"""One name per thing: the Lua scripts name fields, states, phases and replies only through `rollout_svc.keys`.

What a quoted literal in a script may be (every other quoted word fails the tests here):
- Redis syntax: a command or keyword (an upper-case word: `HGET`, `PX`, `MAXLEN`), a range end (`-`, `+`, `-inf`),
  `*` (a new entry id), `~` (approximate MAXLEN), a number or the empty string (ARGV flags and defaults), or a Lua
  string pattern (it holds a `%`);
- in the source: a placeholder (`'${HeartbeatField.STATE}'`) that `keys.lua` fills in at import;
- once rendered: a value of `keys.LUA_NAMES`. That includes the scripts' own reply tags (`ScriptReply`), the
  enqueue kinds (`EnqueueKind`) and the nudges they publish (`Nudge`): Python reads or writes those too.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import get_args

import pytest

from rollout_svc import keys
from rollout_svc.control.plane import FleetState
from rollout_svc.keys import LUA_NAMES, HeartbeatField, StateField, WorkerLabel, lua
from rollout_svc.protocol import WorkerStatus

ROOT = Path(__file__).resolve().parents[2]
# A Lua comment, or a quoted string (its text in group 1 or 2).
LUA_TOKEN = re.compile(r"--[^\n]*|'((?:[^'\\\n]|\\.)*)'|\"((?:[^\"\\\n]|\\.)*)\"")
REDIS_SYNTAX = re.compile(r"[A-Z]+|[-+]|[-+]inf|\*|~|\d*")
PLACEHOLDER = re.compile(r"\$\{[A-Za-z_.]+\}")
RUNS_REDIS = re.compile(r"redis\.p?call\b")
RENDERERS = ("lua", "with_levels")  # what renders a template: `keys.lua`, and `dataplane.levels.with_levels` by it


def _literals(script: str) -> list[str]:
    """The quoted strings of a Lua script, comments left out."""
    return [
        m.group(1) if m.group(1) is not None else m.group(2) for m in LUA_TOKEN.finditer(script) if m.group(0)[0] != "-"
    ]


def _syntax(literal: str) -> bool:
    return bool(REDIS_SYNTAX.fullmatch(literal)) or "%" in literal


def _sources() -> list[Path]:
    return sorted([*(ROOT / "rollout_svc").rglob("*.py"), *(ROOT / "workers").rglob("*.py")])


def _templates(path: Path) -> tuple[list[str], list[str]]:
    """A module's Lua templates (the string constants in the arguments of `lua(...)` calls), and the string constants
    outside them that run Redis commands (a script that `lua` never sees; docstrings left out)."""
    tree = ast.parse(path.read_text())
    inside: set[int] = set()
    templates = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in RENDERERS:
            for arg in node.args:
                for const in ast.walk(arg):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        inside.add(id(const))
                        templates.append(const.value)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    loose = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant)
        and isinstance(n.value, str)
        and RUNS_REDIS.search(n.value)
        and id(n) not in inside | docstrings
    ]
    return templates, loose


def _script_modules() -> list[str]:
    return [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in _sources() if _templates(p)[0]]


def _rendered_scripts() -> dict[str, str]:
    """Every Lua script the package holds, rendered: the module-level strings that run Redis commands in each
    module that renders templates."""
    scripts = {}
    for module_name in _script_modules():
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if isinstance(value, str) and RUNS_REDIS.search(value):
                scripts[f"{module_name}.{name}"] = value
    return scripts


def test_every_script_is_rendered_by_lua_and_spells_no_name_itself():
    """In the source, a script's quoted literals are Redis syntax or placeholders; every script goes through `lua`."""
    spelled, loose = [], []
    for path in _sources():
        templates, unrendered = _templates(path)
        where = path.relative_to(ROOT)
        loose += [f"{where}: {text.strip().splitlines()[0]}" for text in unrendered]
        for template in templates:
            spelled += [
                f"{where}: '{lit}'" for lit in _literals(template) if not (_syntax(lit) or PLACEHOLDER.fullmatch(lit))
            ]
    assert loose == [], "a Lua script not rendered by keys.lua"
    assert spelled == [], "a name spelled in Lua: use a keys.py constant as a placeholder"


def test_every_rendered_script_names_only_what_keys_defines():
    """Rendered, a script's quoted literals are Redis syntax or values of `keys.LUA_NAMES`."""
    scripts = _rendered_scripts()
    assert {"rollout_svc.dataplane.scripts", "rollout_svc.control.scripts", "rollout_svc.batch.scripts"} <= {
        name.rpartition(".")[0] for name in scripts
    }
    assert len(scripts) >= 15
    defined = set(keys.LUA_NAMES.values())
    undefined = {
        f"{name}: '{lit}'"
        for name, script in scripts.items()
        for lit in _literals(script)
        if not (_syntax(lit) or lit in defined)
    }
    assert undefined == set()


def test_a_misspelled_field_is_caught():
    """What the two tests above catch: a field name spelled in a template, and a placeholder keys.py lacks."""
    template = "return redis.call('HGET', KEYS[1], 'applied_epoc')"
    assert [lit for lit in _literals(template) if not (_syntax(lit) or PLACEHOLDER.fullmatch(lit))] == ["applied_epoc"]
    assert [lit for lit in _literals(lua(template)) if not (_syntax(lit) or lit in keys.LUA_NAMES.values())] == [
        "applied_epoc"
    ]
    with pytest.raises(KeyError, match=r"HeartbeatField\.APPLIED_EPOC"):
        lua("return redis.call('HGET', KEYS[1], '${HeartbeatField.APPLIED_EPOC}')")
    assert lua("redis.call('HGET', KEYS[1], '${HeartbeatField.APPLIED_EPOCH}') '%d+$$'") == (
        "redis.call('HGET', KEYS[1], 'applied_epoch') '%d+$'"
    )


def test_heartbeat_fields_are_worker_status_fields():
    """The heartbeat hash is `WorkerStatus.to_hash()`: each field the scripts name must be one it writes."""
    written = set(WorkerStatus(worker_id="w").to_hash())
    named = {v for a, v in vars(HeartbeatField).items() if a.isupper()}
    assert named and named <= written
    assert written == set(WorkerStatus.model_fields)


def test_scripts_name_every_worker_label():
    named = {v for a, v in LUA_NAMES.items() if a.startswith("WorkerLabel.")}
    assert named == set(get_args(WorkerLabel)) == set(get_args(WorkerStatus.model_fields["state"].annotation))


def test_the_state_hash_holds_the_state_fields():
    state = FleetState(epoch=3, holders={"trainer": "keep"}, sleep_level=1, awake_tags=frozenset({"weights"}))
    fields = state.to_hash()
    plain = {v for a, v in vars(StateField).items() if a.isupper() and not a.endswith("_PREFIX")}
    assert set(fields) == plain | {StateField.holder("trainer"), StateField.awake("weights")}
    assert fields[StateField.EPOCH] == "3" and fields["pause:trainer"] == "keep"
    assert FleetState.from_hash({k.encode(): v.encode() for k, v in fields.items()}) == state
