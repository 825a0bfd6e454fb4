"""What the real-engine test modules share, each started once per test session: the reference they compare against
(vLLM called directly, `workers.direct`, no queue) for every prompt set they use, and the fleets of vLLM workers they
run on, one per `FleetSpec` (what its workers run), shared by every module that asks for the same spec.

Starting a vLLM engine is most of what a real-engine test costs (three interpreters importing torch and vLLM: about
40 s alone on a 2-core host without avx512, minutes under make test's load), so these start once, not once per module.
A module asks for a fleet with its `vllm_fleet(spec)` mark and the `vllm_fleet` fixture; tests/conftest.py runs the
modules asking for one spec one after the other, and the fleet stops after the last of them, so each spec's engines
start once and no two fleets hold the cores (and ~3 GB each) at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollout_svc.config import EngineSettings, Settings
from rollout_svc.model import prepare_model
from rollout_svc.tools import dataset
from tests.support import ROOT, WorkerProcs, redis_server

MiB = 2**20
# float32 and the same settings on every side: bf16 and batching change the numerics, so greedy ids could differ.
# The engines compared with the reference run these (`VLLMEngine(**REFERENCE_SETTINGS)`, `python -m workers`
# with `REFERENCE_ARGS`).
REFERENCE_SETTINGS = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_bytes": 256 * MiB, "max_num_seqs": 8}
REFERENCE_ARGS = [
    arg for name, value in REFERENCE_SETTINGS.items() for arg in (f"--{name.replace('_', '-')}", str(value))
]
REFERENCE_MAX_TOKENS = 32  # greedy, one prompt at a time
REFERENCE_TIMEOUT_S = 600  # startup ~40 s alone on a slow host; make test's load has made it minutes
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three prime numbers.",
]
# Each set's conversations: one user turn each. "sharegpt": the first 2 of the bundled ShareGPT sample (600
# characters at most: ~8 s each to generate here).
PROMPT_SETS: dict[str, Callable[[], list[list[dict[str, str]]]]] = {
    "questions": lambda: [[{"role": "user", "content": q}] for q in QUESTIONS],
    "sharegpt": lambda: dataset.first_turns(2, max_chars=600),
}


def cpu_env() -> dict[str, str]:
    """An engine's environment: its threads bound to one core (the first this process may run on), as each fleet
    worker's are, unless `VLLM_CPU_OMP_THREADS_BIND` says otherwise. On two cores, each step waits at the barriers for
    a thread that the machine's other work preempted: beside one busy process, test_vllm_engine.py took 165 s on both
    cores and 119 s on one (alone: 117 and 122 s); make test keeps the other xdist worker busy beside it."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", str(cpus[0]))}


def perturb_weights(weights: dict[str, Any]) -> dict[str, Any]:
    """`weights` (name -> torch tensor) each moved by seeded noise of a tenth of its standard deviation: enough to
    change greedy outputs (what the weight-loading tests need to see), the same every call."""
    import torch  # here, not at import: the modules that only call the fleet do not import torch

    noise = torch.Generator().manual_seed(0)
    return {n: t + 0.1 * t.std() * torch.randn(t.shape, generator=noise) for n, t in weights.items()}


@dataclass(frozen=True)
class Reference:
    """Per prompt set: its conversations, their prompts (token ids under the model's chat template, as Hugging
    Face's `apply_chat_template` renders them), and vLLM's greedy outputs for them (`workers.direct`'s
    `{"completion_token_ids", "logprobs"}`, in order)."""

    conversations: dict[str, list[list[dict[str, str]]]]
    prompts: dict[str, list[list[int]]]
    outputs: dict[str, list[dict[str, Any]]]
    output_tokens: int  # over every set, as workers.direct counted them
    output_tokens_per_s: float


def run_direct(
    model_dir: Path, prompts: list[list[int]], folder: Path, args: list[str], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """`python -m workers.direct --sequential --temperature 0` on `prompts` with engine `args` (and `--max-tokens`),
    its files in `folder`, in `env` (default: this environment with `cpu_env()`); its OUT.json dict. Fails the test
    with the tail of its output if it exits non-zero or runs past `REFERENCE_TIMEOUT_S`."""
    (folder / "prompts.json").write_text(json.dumps(prompts))
    command = [sys.executable, "-m", "workers.direct", "--model", str(model_dir), *args, "--sequential"]
    command += ["--prompts-file", str(folder / "prompts.json"), "--out", str(folder / "out.json"), "--temperature", "0"]
    try:
        run = subprocess.run(
            command,
            cwd=ROOT,
            env=env if env is not None else {**os.environ, **cpu_env()},
            timeout=REFERENCE_TIMEOUT_S,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    except subprocess.TimeoutExpired as exc:
        output = (exc.output or b"").decode(errors="replace")[-4000:]
        pytest.fail(f"workers.direct ran past {REFERENCE_TIMEOUT_S} s:\n{output}")
    assert run.returncode == 0, run.stdout.decode(errors="replace")[-4000:]
    result: dict[str, Any] = json.loads((folder / "out.json").read_text())
    return result


@pytest.fixture(scope="session")
def direct_reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """Every prompt set run once, greedily, one prompt at a time, on vLLM called directly with `REFERENCE_ARGS`."""
    from transformers import AutoTokenizer

    model_dir = prepare_model(Settings().cache_dir)  # Settings reads ROLLOUT_CACHE_DIR (the modules' model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = {name: make() for name, make in PROMPT_SETS.items()}
    prompts = {
        name: [
            # as VLLMEngine.chat_prompt: the template writes every special token, the encoding adds none
            tokenizer.encode(
                tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False
            )
            for c in convs
        ]
        for name, convs in conversations.items()
    }
    every = [p for name in PROMPT_SETS for p in prompts[name]]
    result = run_direct(
        model_dir,
        every,
        tmp_path_factory.mktemp("direct-reference"),
        [*REFERENCE_ARGS, "--max-tokens", str(REFERENCE_MAX_TOKENS)],
    )
    outputs, start = {}, 0
    for name in PROMPT_SETS:
        outputs[name] = result["outputs"][start : start + len(prompts[name])]
        start += len(prompts[name])
    return Reference(conversations, prompts, outputs, result["output_tokens"], result["output_tokens_per_s"])


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of a fleet: its id, the model name it serves ("": the model folder's, the default) and the CPU
    cores its engine binds (`VLLM_CPU_OMP_THREADS_BIND`; "": this environment's)."""

    worker_id: str
    model_name: str = ""
    cores: str = ""


@dataclass(frozen=True)
class FleetSpec:
    """What a fleet's workers run, the key modules share a fleet by: `engine`, `EngineSettings` fields as sorted
    (name, value) pairs (the model is the prepared SmolLM2), and `workers`. Build one with `fleet_spec`."""

    engine: tuple[tuple[str, Any], ...]
    workers: tuple[WorkerSpec, ...]


def fleet_spec(*workers: WorkerSpec, **engine: Any) -> FleetSpec:
    """A `FleetSpec` of `workers` (default: `vllm-0` and `vllm-1`, a core each) running `EngineSettings(**engine)`."""
    every = workers or (WorkerSpec("vllm-0", cores="0"), WorkerSpec("vllm-1", cores="1"))
    return FleetSpec(tuple(sorted(engine.items())), tuple(every))


# Two float32 workers, a core each: 64 sequences (the control module's 100 requests are all in flight), 256 MiB of KV
# cache each. The OpenAI API's, SkyRL's, the control plane's, the service's and weight sync's modules run on it.
TWO_FLOAT32 = fleet_spec(dtype="float32", max_num_seqs=64, kv_cache_memory_bytes=256 * MiB)


@dataclass
class Fleet:
    """A running fleet: `spec`'s workers on a redis-server of their own (the other tests flush theirs), with a
    checkpoint root for `/fetch_weights`, checkpoint syncs and adapters. A module that changes it puts it back
    (weights, pauses, sleep, adapters, a worker it stopped) before its last test ends, so the next module on the same
    spec finds it serving the model's own outputs."""

    spec: FleetSpec
    settings: Settings  # its Redis, key prefix, checkpoint root
    model_dir: Path
    logs: Path  # the workers' logs; a module's serve may log here too
    engine: EngineSettings  # what the workers run
    procs: WorkerProcs
    stack: ExitStack = field(default_factory=ExitStack, repr=False)  # its Redis and workers, stopped on close

    def start_worker(self, worker_id: str) -> None:
        """Start (or restart) `worker_id` as the spec says: its model name and cores; returns once started, not live."""
        [worker] = [w for w in self.spec.workers if w.worker_id == worker_id]
        env = {"ROLLOUT_MODEL_NAME": worker.model_name} if worker.model_name else {}
        if worker.cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = worker.cores
        self.procs.start(worker_id, *self.engine.to_args(), env=env)

    def wait_ready(self) -> None:
        """Until every worker is live and out of `starting`, each looked up under its model's keys."""
        for name in dict.fromkeys(w.model_name for w in self.spec.workers):
            model = WorkerProcs(self.settings.copy_with(model_name=name), self.logs)
            model.procs = self.procs.procs  # the same processes, seen under the model's keys
            ids = [w.worker_id for w in self.spec.workers if w.model_name == name]
            model.wait_live(*ids, timeout_s=600)
            model.wait_converged(*ids, timeout_s=120)


def start_fleet(spec: FleetSpec, folder: Path) -> Fleet:
    """`spec`'s fleet in `folder`, every worker live and out of `starting` (started at once: their engines load side by
    side); the caller closes its `stack`."""
    model_dir = prepare_model(Settings().cache_dir)
    (folder / "redis").mkdir()
    (folder / "checkpoints").mkdir()
    stack = ExitStack()
    url = stack.enter_context(redis_server(folder / "redis"))
    settings = Settings(
        redis_url=url,
        key_prefix="e2e-fleet",
        heartbeat_interval_s=0.5,
        # This shared machine freezes for about a minute at times (a monitor's 5 s-bounded ping took 68 s): every
        # heartbeat lapsed mid-sync at 60 s. The TTL outlasts such a freeze (and the idle wait between modules at
        # make test's lower priority, tests/conftest.py).
        heartbeat_ttl_s=180,
        checkpoint_root=folder / "checkpoints",
        control_timeout_s=180,
    )
    engine = EngineSettings(model=str(model_dir), **dict(spec.engine))
    procs = WorkerProcs(settings, folder)
    stack.callback(procs.stop_all)
    fleet = Fleet(spec, settings, model_dir, folder, engine, procs, stack)
    try:
        for worker in spec.workers:
            fleet.start_worker(worker.worker_id)
        fleet.wait_ready()
    except BaseException:
        stack.close()
        raise
    return fleet


class Fleets:
    """The session's fleets by spec: `acquire` starts one on the first ask and hands the same one to every module after;
    `release` stops it once every module of the session that asks for it (`users`, module node ids by spec) has."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, users: dict[FleetSpec, set[str]]) -> None:
        self.tmp_path_factory, self.users = tmp_path_factory, users
        self.running: dict[FleetSpec, Fleet] = {}

    def acquire(self, spec: FleetSpec) -> Fleet:
        if spec not in self.running:
            self.running[spec] = start_fleet(spec, self.tmp_path_factory.mktemp("vllm-fleet"))
        return self.running[spec]

    def release(self, spec: FleetSpec, module: str) -> None:
        left = self.users.setdefault(spec, set())
        left.discard(module)
        if not left and spec in self.running:
            self.running.pop(spec).stack.close()

    def close(self) -> None:
        while self.running:
            self.running.popitem()[1].stack.close()


def fleet_users(items: list[pytest.Item]) -> dict[FleetSpec, set[str]]:
    """The module node ids of `items` by the spec of their `vllm_fleet` mark."""
    users: dict[FleetSpec, set[str]] = {}
    for item in items:
        if (mark := item.get_closest_marker("vllm_fleet")) is not None:
            users.setdefault(mark.args[0], set()).add(item.nodeid.split("::")[0])
    return users


@pytest.fixture(scope="session")
def vllm_fleets(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleets]:
    fleets = Fleets(tmp_path_factory, fleet_users(request.session.items))
    yield fleets
    fleets.close()


@pytest.fixture(scope="module")
def vllm_fleet(request: pytest.FixtureRequest, vllm_fleets: Fleets) -> Iterator[Fleet]:
    """The fleet of the spec this module's `vllm_fleet(spec)` mark names, shared with the other modules naming it."""
    mark = request.node.get_closest_marker("vllm_fleet")
    assert mark is not None, f"{request.node.nodeid} uses the vllm_fleet fixture without a vllm_fleet(spec) mark"
    module = request.node.nodeid
    yield vllm_fleets.acquire(mark.args[0])
    vllm_fleets.release(mark.args[0], module)
