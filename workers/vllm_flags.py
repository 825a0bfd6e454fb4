"""vLLM's own engine flags, verbatim, as `vllm serve` takes them: parsed and validated by the installed vLLM's parser.

A user moving from `vllm serve` passes the flags they already use after `--` (`rollout-svc up ... --
--gpu-memory-utilization 0.85 --quantization fp8`, `python -m workers ... -- ...`), in `--vllm-args` or the
`ROLLOUT_VLLM_ARGS` environment variable (one string, split as a shell would), or in a YAML file (`--vllm-config`,
the file `vllm serve --config` takes). Every flag of the installed vLLM works: they are read by vLLM's own
`FlexibleArgumentParser` with `AsyncEngineArgs.add_cli_args`, then `AsyncEngineArgs.from_cli_args` (the path of
`vllm serve`, vllm/entrypoints/openai/cli_args.py), so a misspelled one fails with vLLM's own message.

Our engine fields that are vLLM's (`SHORTHANDS`: `--max-num-seqs`, `--dtype`, ...) are shorthands for vLLM's flags
of the same meaning: a value given as a vLLM flag is folded into the field (`resolve`), so the worker's capacity, its
GPUs and its context length read one value; given both ways with different values is an error naming both.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from rollout_svc.config import EngineSettings

# EngineSettings field -> the dest (AsyncEngineArgs field) of the vLLM flag it stands for
SHORTHANDS = {
    name: name
    for name in (
        "model",
        "dtype",
        "max_model_len",
        "max_num_seqs",
        "kv_cache_memory_bytes",
        "seed",
        "enable_sleep_mode",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "enable_lora",
        "max_loras",
        "max_lora_rank",
    )
}


class VLLMFlagError(ValueError):
    """A vLLM flag the installed vLLM does not take, or a value it refuses; the message is vLLM's (argparse's) own.
    Command lines exit with status 2 on it, as `vllm serve` does."""


def flag_list(vllm_args: str, vllm_config: str = "") -> list[str]:
    """The flags of `vllm_args` (one string, split as a shell would) after those of the YAML file `vllm_config`
    (vLLM's `load_config_file`: later flags win, as in `vllm serve --config FILE ...`). Raises `VLLMFlagError` for a
    string a shell could not split or a file vLLM cannot read."""
    try:
        flags = shlex.split(vllm_args)
    except ValueError as exc:
        raise VLLMFlagError(f"vLLM flags {vllm_args!r}: {exc}") from None
    if not vllm_config:
        return flags
    try:
        return parser().load_config_file(vllm_config) + flags
    except (OSError, ValueError) as exc:
        raise VLLMFlagError(f"--vllm-config {vllm_config}: {exc}") from None


def given_flags(flags: list[str]) -> dict[str, Any]:
    """The `AsyncEngineArgs` fields `flags` set explicitly, by name, with the values vLLM's parser gives them
    (`["-tp", "2", "--enforce-eager"]` -> `{"tensor_parallel_size": 2, "enforce_eager": True}`); every other field
    keeps its default where the caller merges these. The whole set is also built into `AsyncEngineArgs` (vLLM's own
    checks of the values). Raises `VLLMFlagError` with vLLM's message for a flag or value it does not take."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    if not flags:
        return {}
    engine_parser = parser()
    for action in engine_parser._actions:  # only what is given: argparse leaves a dest with a SUPPRESS default unset
        action.default = argparse.SUPPRESS
    given = vars(engine_parser.parse_args(flags))
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    if unknown := sorted(set(given) - fields):
        raise VLLMFlagError(f"not an engine flag (a `vllm serve` server option?): {', '.join(unknown)}")
    try:
        AsyncEngineArgs.from_cli_args(argparse.Namespace(**given))
    except (TypeError, ValueError) as exc:
        raise VLLMFlagError(str(exc)) from None
    return given


def resolve(engine: EngineSettings) -> EngineSettings:
    """`engine` with its vLLM flags checked (`given_flags`) and those that a shorthand field stands for folded into
        it: `-- --max-num-seqs 8` gives `max_num_seqs=8` (the worker's capacity), `-- -tp 2` `tensor_parallel_size=2`
        (its GPUs). The flags stay as given, those of `vllm_config` inlined before them (a worker on another host needs
    no file), so resolving again gives the same settings. Raises `VLLMFlagError` for a
        flag vLLM refuses, `ValueError` naming both for a field and a flag set to different values, or for vLLM flags
        given to an engine that is not vLLM."""
    flags = flag_list(engine.vllm_args, engine.vllm_config)
    if not flags:
        return engine
    if engine.engine != "vllm":
        raise ValueError(
            f"vLLM's flags ({shlex.join(flags)}) go to the vLLM engine, and these workers run the {engine.engine} "
            "engine: leave them out, or use --engine vllm"
        )
    given = given_flags(flags)
    folded: dict[str, Any] = {"vllm_args": shlex.join(flags), "vllm_config": ""}  # the file's flags, inlined
    for name, dest in SHORTHANDS.items():
        if dest not in given:
            continue
        mine = getattr(engine, name)
        if name in engine.model_fields_set and mine != given[dest]:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag} {mine} and vLLM's --{dest.replace('_', '-')} {given[dest]} say different things: give one"
            )
        folded[name] = given[dest]
    return type(engine).model_validate(engine.model_dump(exclude_unset=True) | folded)


def engine_args(settings: dict[str, Any], flags: list[str]) -> AsyncEngineArgs:
    """`AsyncEngineArgs` of the service's `settings` (field -> value), with the fields `flags` set explicitly
    (`given_flags`) in their place."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**(settings | given_flags(flags)))


def parser() -> Any:
    """vLLM's `FlexibleArgumentParser` with `AsyncEngineArgs`' flags, raising `VLLMFlagError` where argparse would
    print its message and exit."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise VLLMFlagError(message)

    def build() -> Any:
        usage = "... -- [vLLM engine flags, as `vllm serve` takes them]"
        return AsyncEngineArgs.add_cli_args(Parser(prog="vllm", usage=usage, add_help=False))

    try:
        return build()
    except RuntimeError as exc:  # a CUDA build of vLLM on a host without a GPU: a Ray head node, an install check
        if "infer device type" not in str(exc):
            raise
    import vllm.platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    # vLLM's parser builds its config defaults, which need a device type: read the flags as on vLLM's CUDA
    # platform (its module needs the driver, libcuda, to import: a Platform of the CUDA kind stands in), for this
    # parser only
    cuda = {"_enum": PlatformEnum.CUDA, "device_name": "cuda", "device_type": "cuda"}
    found, vllm.platforms._current_platform = vllm.platforms._current_platform, type("Cuda", (Platform,), cuda)()
    try:
        return build()
    finally:
        vllm.platforms._current_platform = found
