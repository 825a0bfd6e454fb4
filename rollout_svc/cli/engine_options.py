"""Every `EngineSettings` field as a command-line option of a command that starts workers (`up`, `demo`)."""

from __future__ import annotations

import functools
import inspect
import shlex
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any, Literal, get_args, get_origin

import pydantic
import typer

from rollout_svc.config import VLLM_ARGS_ENV, EngineSettings

PANEL = "Engine (each worker's; the options of python -m workers)"


def _option(name: str, info: Any) -> inspect.Parameter:
    """The keyword parameter typer reads as option `--{name}` (`--no-{name}` too for a bool), from one field."""
    annotation: Any = info.annotation
    default = info.default
    if get_origin(annotation) is Literal:  # typer offers the choices of an Enum
        choices = StrEnum(name, {choice: choice for choice in get_args(annotation)})  # type: ignore[misc]
        annotation, default = choices, choices(default)
    envvar = VLLM_ARGS_ENV if name == "vllm_args" else None
    option = typer.Option(help=f"{info.description}.", rich_help_panel=PANEL, envvar=envvar)
    parameter = Annotated[annotation, option]
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=parameter)


def engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command`, taking every `EngineSettings` field as an option (`--engine`, `--model`, `--dtype`,
    `--max-num-seqs`, ...: the options of `python -m workers`), which it receives as one `engine: EngineSettings`.
    A bad value exits with typer's usage error, naming the option."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "engine"]
    fields = [_option(name, info) for name, info in EngineSettings.model_fields.items()]

    @functools.wraps(command)
    def run(**kwargs: Any) -> Any:
        values = {name: kwargs.pop(name) for name in EngineSettings.model_fields}
        values = {name: v.value if isinstance(v, StrEnum) else v for name, v in values.items()}
        # only what was given, so a value also given as a vLLM flag is told apart from a default (workers.vllm_flags)
        values = {name: v for name, v in values.items() if v != EngineSettings.model_fields[name].default}
        try:
            engine = EngineSettings.model_validate(values)
        except pydantic.ValidationError as exc:
            error = exc.errors()[0]
            raise typer.BadParameter(error["msg"], param_hint=f"--{str(error['loc'][0]).replace('_', '-')}") from None
        return command(**kwargs, engine=engine)

    parameters = own + fields
    run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": signature.return_annotation}
    return run


def with_vllm_flags(engine: EngineSettings, flags: list[str] | None, command: str) -> EngineSettings:
    """`engine` with `flags` (a command line's words after `--`) added to its vLLM flags, all of them checked by
    the installed vLLM's parser and those our fields stand for folded in (`workers.vllm_flags.resolve`). A flag vLLM
    does not take, or a field and a flag that disagree, exits with status 2 and vLLM's message, as `vllm serve`
    would, before `command` starts anything."""
    if flags:
        joined = " ".join(part for part in (engine.vllm_args, shlex.join(flags)) if part)
        engine = EngineSettings.model_validate(engine.model_dump(exclude_unset=True) | {"vllm_args": joined})
    if not (engine.vllm_args or engine.vllm_config):
        return engine
    from workers.vllm_flags import VLLMFlagError, resolve

    try:
        return resolve(engine)
    except VLLMFlagError as exc:
        typer.echo(f"rollout-svc {command}: vLLM: {exc}", err=True)
    except ValueError as exc:
        typer.echo(f"rollout-svc {command}: {exc}", err=True)
    raise typer.Exit(2)
