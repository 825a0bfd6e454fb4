"""Settings of every rollout-svc process (env vars `ROLLOUT_*`), by concern, and the engine settings of a worker."""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollout_svc.keys import DEFAULT_SHARD, Keys

MiB = 1024 * 1024
# vLLM's defaults on the CPU (workers.vllm_args.CPU_DEFAULTS: why each), the context also the echo and sim engines'
DEFAULT_MAX_MODEL_LEN = 2048
CPU_KV_CACHE_BYTES = 512 * MiB
CPU_MAX_NUM_SEQS = 64
VLLM_ARGS_ENV = "ROLLOUT_VLLM_ARGS"  # EngineSettings.vllm_args of every command that starts workers


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollout-svc"


GC_YOUNG_THRESHOLD = 50_000  # allocations between young collections (Python's default: 700)
MAX_LEASE_S = 7 * 86400.0  # the longest pause lease (a week): longer, hold the pause without one
_GC_TUNED: list[bool] = []


def tune_gc(young_threshold: int = GC_YOUNG_THRESHOLD) -> None:
    """Once per process: collect, freeze what is alive (imports, start-up state: never scanned again) and collect the
    young generation every `young_threshold` allocations (0: leave the collector alone). With thousands of requests
    in flight, the collector's passes over every live object otherwise take most of a producer's or a worker's CPU
    (measured: 11k against 20k requests/s for one producer at 5,000 in flight; BENCHMARKS.md, the hop section)."""
    if young_threshold <= 0 or _GC_TUNED:
        return
    _GC_TUNED.append(True)
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(young_threshold, gc.get_threshold()[0]), *gc.get_threshold()[1:])


class EngineSettings(BaseModel):
    """The engine one worker runs: the one model shared by `python -m workers`, `workers.direct` and `up`.

    `max_num_seqs` is the engine's batch size and the worker's capacity (default: vLLM's on a GPU, read from the
    engine once it started; 64 for vLLM on the CPU, 1024 for echo). `max_model_len`, `max_num_seqs` and
    `kv_cache_memory_bytes` left None are the platform's: vLLM's own defaults on GPUs, as `vllm serve` runs them;
    on the CPU `workers.vllm_args.CPU_DEFAULTS` (vLLM's default KV cache, a share of memory, fails on small hosts).
    `dtype="float32"` is what greedy token-equality checks need (bf16 and batching change the numerics).
    `enable_sleep_mode` (vLLM sleep mode, GPU only) defaults to on where the platform supports it. `vllm_args` and
    `vllm_config`: vLLM's own flags (`workers.vllm_flags`).
    `echo_token_delay_s`: the echo engine's seconds per generated token (it stands in for a long generation).
    `sim_*`: the simulated GPU engine's profile, time scale, step token budget and output lengths (workers/sim;
    docs/simulator.md); with a fitted profile (a JSON path) its KV cache is `kv_cache_memory_bytes`.
    `echo_preload_weight_transfer`: the echo engine imports torch before the worker registers, as the vLLM one does,
    so its first weight sync does not stall the heartbeat. `weight_transfer_backend` gives vLLM's engine its native
    weight transfer (vLLM 0.32's `weight_transfer_config`), which SkyRL's trainer drives through `serve`.
    """

    model_config = ConfigDict(extra="forbid")

    engine: Literal["vllm", "echo", "sim"] = Field(
        "vllm", description="echo: deterministic, for queue tests only; sim: a simulated GPU, for scheduling studies"
    )
    model: str | None = Field(None, description="Hugging Face model folder (default: the prepared SmolLM2)")
    dtype: str = Field(
        "auto",
        description="vLLM dtype: auto, bfloat16, float16, float32 (auto on CPU: bfloat16 only where the CPU has "
        "avx512_bf16 or amx_bf16, else float32)",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="context length in tokens (default: the model's on GPUs; 2048 on the CPU and the echo and sim "
        "engines)",
    )
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        description="engine batch size = worker capacity (default: vLLM's on GPUs, by the device; 64 on the CPU)",
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=MiB,
        description="KV cache size in bytes (default: vLLM's on GPUs, a share of the device's memory; 512 MiB on the "
        "CPU)",
    )
    seed: int = Field(0, description="engine seed")
    enable_sleep_mode: bool | None = Field(None, description="vLLM sleep mode (default: where supported)")
    echo_token_delay_s: float = Field(0.0, ge=0, description="echo engine: seconds per generated token")
    echo_load_delay_s: float = Field(0.0, ge=0, description="echo engine: seconds a weight load takes")
    echo_preload_weight_transfer: bool = Field(
        False,
        description="echo engine: import torch and the weight transfer at start, as vLLM does, not at the first "
        "sync (a cold import of torch holds the GIL, and the heartbeat, for seconds)",
    )
    sim_gpu: str = Field(
        "h100", description="sim engine: the simulated GPU (h100, h200) or the path of a fitted profile's JSON"
    )
    sim_model: Literal["qwen2.5-7b", "qwen2.5-32b", "smollm2-135m", "llama3-8b"] = Field(
        "qwen2.5-7b", description="sim engine: the simulated model"
    )
    sim_time_scale: float = Field(1.0, gt=0, description="sim engine: simulated seconds per second of wall clock")
    sim_engines: int = Field(
        1, ge=1, le=64, description="sim engine: simulated GPUs this process runs, each a worker (ID, ID.1, ...)"
    )
    sim_max_num_batched_tokens: int = Field(
        8192, ge=1, description="sim engine: the token budget of one step (vLLM 0.32's default on H100 and H200)"
    )
    sim_length_median: int = Field(
        0, ge=0, description="sim engine: median output length before end of sequence (0: run to max_tokens)"
    )
    sim_length_p99: int = Field(0, ge=0, description="sim engine: 99th percentile output length (with the median)")
    tool_call_parser: str = Field(
        "hermes", description="vLLM tool-call parser for tool_choice=auto ('' for none): hermes, llama3_json, ..."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM: GPUs one model replica's layers are split over (tensor parallel ranks)"
    )
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM: pipeline stages of one model replica")
    data_parallel_size: int = Field(
        1, ge=1, description="vLLM: model replicas in this worker's engine, each tensor x pipeline parallel"
    )
    enable_lora: bool = Field(False, description="vLLM: serve LoRA adapters (`rollout-svc adapter load`)")
    max_loras: int = Field(
        4, ge=1, description="vLLM: LoRA adapters (versions count apiece) in one batch; more wait for a slot"
    )
    max_lora_rank: int = Field(16, ge=1, description="vLLM: the largest LoRA rank an adapter may have")
    vllm_args: str = Field(
        "",
        description="vLLM's own engine flags, as `vllm serve` takes them, in one string (env ROLLOUT_VLLM_ARGS; "
        "on a command line also everything after --), e.g. '--gpu-memory-utilization 0.85 --quantization fp8'",
    )
    vllm_config: str = Field("", description="a YAML file of vLLM engine flags, the file `vllm serve --config` takes")
    weight_transfer_backend: Literal["none", "nccl"] = Field(
        "none",
        description="vLLM's native weight transfer, for a trainer-led broadcast (SkyRL's /init_weight_transfer_engine"
        "): nccl, on CUDA (none: WeightSender and checkpoints need none)",
    )

    @model_validator(mode="after")
    def _sim_lengths(self) -> EngineSettings:
        if (self.sim_length_median or self.sim_length_p99) and not 0 < self.sim_length_median < self.sim_length_p99:
            raise ValueError(
                "sim_length_median and sim_length_p99 go together, median below p99 (for example 1000 and 16000), "
                f"or neither: got {self.sim_length_median} and {self.sim_length_p99}"
            )
        return self

    @model_validator(mode="after")
    def _parallel_only_on_vllm(self) -> EngineSettings:
        if self.engine != "vllm" and self.gpus > 1:
            raise ValueError(
                f"tensor, pipeline and data parallel sizes are vLLM's: the {self.engine} engine runs one rank "
                "(leave them at 1; the sim engine's --sim-engines runs several simulated GPUs)"
            )
        return self

    @property
    def context_len(self) -> int:
        """`max_model_len`, or the echo and sim engines' (and the CPU's) default where it is None."""
        return self.max_model_len or DEFAULT_MAX_MODEL_LEN

    @property
    def capacity(self) -> int:
        """Sequences the worker runs at once: `max_num_seqs` per data-parallel replica (vLLM schedules each). A vLLM
        engine on a GPU reports what vLLM chose once it started (`VLLMEngine.capacity`)."""
        per_replica = self.max_num_seqs or (CPU_MAX_NUM_SEQS if self.engine == "vllm" else 1024)  # sim: vLLM's on H100
        return per_replica * self.data_parallel_size

    @property
    def gpus(self) -> int:
        """Devices (ranks) one worker's engine spans: tensor x pipeline x data parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    def vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `workers.vllm_args.vllm_engine_args` (all but `model`); `vllm_flags`: vLLM's own
        flags, verbatim (`vllm_config`'s file as `vllm serve --config` reads it, then `vllm_args`)."""
        kwargs: dict[str, Any] = {"dtype": self.dtype, "seed": self.seed}
        for name in ("max_model_len", "kv_cache_memory_bytes", "max_num_seqs"):  # None: the platform's default
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) > 1:
                kwargs[name] = getattr(self, name)
        if self.enable_sleep_mode is not None:
            kwargs["enable_sleep_mode"] = self.enable_sleep_mode
        if self.enable_lora:
            kwargs |= {"enable_lora": True, "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank}
        if self.weight_transfer_backend != "none":
            kwargs["weight_transfer_config"] = {"backend": self.weight_transfer_backend}
        if self.vllm_args or self.vllm_config:
            kwargs["vllm_flags"] = (["--config", self.vllm_config] if self.vllm_config else []) + shlex.split(
                self.vllm_args
            )
        return kwargs

    def to_args(self) -> list[str]:
        """Command-line options of `python -m workers` that reproduce these settings (defaults left out)."""
        args: list[str] = []
        for name, value in self.model_dump(exclude_defaults=True).items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            elif name == "vllm_args":  # one word, which argparse would read as an option if it began with one
                args.append(f"{flag}={value}")
            else:
                args += [flag, str(value)]
        return args

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, engine: bool = True) -> None:
        """Add one option per field (`--max-num-seqs`, ...) to an argparse parser; `from_args` reads them back."""
        for name, info in cls.model_fields.items():
            if (name == "engine" or name.startswith(("echo_", "sim_"))) and not engine:
                continue
            flag, help_text = "--" + name.replace("_", "-"), info.description
            if name == "engine":
                parser.add_argument(flag, choices=["vllm", "echo", "sim"], default="vllm", help=help_text)
            elif name == "sim_model":
                parser.add_argument(flag, choices=list(get_args(info.annotation)), default=info.default, help=help_text)
            elif name == "enable_sleep_mode" or isinstance(info.default, bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=info.default, help=help_text)
            else:
                types = {info.annotation, *get_args(info.annotation)}  # int | None: int
                kind = int if int in types else float if float in types else str
                default = os.environ.get(VLLM_ARGS_ENV, "") if name == "vllm_args" else info.default
                parser.add_argument(flag, type=kind, default=default, help=help_text)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> EngineSettings:
        """The settings `add_arguments`' options gave; only those given are set (`model_fields_set`)."""
        given = {k: v for k, v in vars(namespace).items() if k in cls.model_fields and v != cls.model_fields[k].default}
        return cls.model_validate(given)


class _Concern(BaseSettings):
    """The settings of one concern. Env var: `ROLLOUT_<FIELD>`, as for every setting."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_", extra="forbid")


class ClientSettings(_Concern):
    """A producer's (`RolloutClient`, the API, batch jobs) and a control command's issuer's."""

    request_timeout_s: float = Field(600.0, gt=0, description="default per-call timeout (the caller's budget)")
    max_queued_requests: int = Field(100_000, ge=1, description="admission limit per requests stream")
    max_abort_retries: int = Field(16, ge=0, description="token-exact retries of one request cut by aborts")
    max_staleness: int | None = Field(
        None, ge=0, description="drop trajectories staler than this many weight versions (None: keep all)"
    )
    stale_policy: Literal["regenerate", "mark"] = Field(
        "regenerate", description="a too-stale trajectory is generated again, or returned with its staleness"
    )
    step_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="a named step (`generate(..., step_id=)`) whose client died is kept this long for a new client to "
        "attach to (`attach_step`), renewed while one is attached; then it goes, counted, its results uncollected",
    )
    control_timeout_s: float = Field(60.0, gt=0, description="how long a control command waits for every ack")
    pause_lease_s: float = Field(
        20.0,
        ge=0,
        le=MAX_LEASE_S,
        description="a RolloutClient's or WeightSender's pause lapses this long after its process last renewed it "
        "(it died or hung), and the fleet resumes; 0: pauses are held until resumed",
    )
    redis_outage_s: float = Field(
        30.0, ge=0, description="how long an enqueue or a control command keeps retrying a Redis that is away"
    )
    gc_young_threshold: int = Field(
        GC_YOUNG_THRESHOLD,
        ge=0,
        description="at the first connection, freeze what is alive and collect the young generation after this many "
        "allocations (Python's default: 700); 0 leaves the process's garbage collector alone",
    )


class WorkerSettings(_Concern):
    """A worker process's (its heartbeat, deliveries, dead letters, streaming)."""

    heartbeat_interval_s: float = Field(1.0, gt=0, description="how often a worker renews its heartbeat")
    max_deliveries: int = Field(3, ge=1, description="deliveries before an entry becomes a dead letter")
    dead_letter_maxlen: int = Field(10_000, ge=1, description="approximate cap of the dead-letter stream")
    stream_interval_s: float = Field(
        0.05, ge=0, description="a streaming request's chunk is sent at most this often (unless full)"
    )
    stream_chunk_tokens: int = Field(16, ge=1, description="a streaming chunk is sent once it holds this many tokens")
    placement: Literal["cost", "fifo"] = Field(
        "cost",
        description="cost: a take is the worker's fair share of the queued work in tokens; fifo: whatever fits its "
        "free slots, first come first served (what placement was before, kept for the step-time bench)",
    )
    read_ahead: int = Field(
        2,
        ge=1,
        description="entries a worker that found nothing takes from each stream with its blocking read, before a take "
        "weighs its share of the rest: 2 keeps a batch of 2 x W requests over W idle workers even; more costs Redis "
        "and the workers less per request (fewer, larger takes: BENCHMARKS.md (p)) and spreads only batches of "
        "read_ahead x W or more evenly (a smaller one goes to the first workers woken, read_ahead each)",
    )
    move_stragglers: bool = Field(
        False,
        description="move a generation that shares its engine with others to a worker that holds no work (cut here, "
        "continued token-exact there; workers/moves.py); with placement by cost only",
    )
    move_after_s: float = Field(5.0, gt=0, description="a generation is moved only after this long in its engine")
    move_check_s: float = Field(1.0, gt=0, description="how often a worker looks for stragglers to move")


class ApiSettings(_Concern):
    """The HTTP API's (`rollout-svc serve`)."""

    api_keys: list[str] = Field(
        default_factory=list, description="data-plane keys, a JSON list (env ROLLOUT_API_KEYS='[\"k1\"]')"
    )
    admin_token: str | None = Field(None, description="the bearer token of /admin/* (none: admin routes off)")
    served_model_name: str = Field("", description="the model name served ('': the workers' model folder name)")
    api_default_max_tokens: int = Field(1024, ge=1, description="max_tokens of a chat request that sets none")
    api_pause_lease_s: float = Field(
        600.0,
        ge=0,
        le=MAX_LEASE_S,
        description="an HTTP /pause's lease: it lapses this long after its holder's last call (0: held until resumed)",
    )
    response_ttl_s: float = Field(
        86400.0,
        gt=0,
        description="how long a stored response of /v1/responses (and its conversation) is kept in Redis, seconds",
    )
    open_control: bool = Field(
        False,
        description="serve the control routes of SkyRL's server protocol (/pause, /sleep, ...) without the admin "
        "token, as SkyRL's client sends none (`serve` allows it on a loopback address only)",
    )


class BatchSettings(_Concern):
    """Batch jobs' (`rollout-svc batch`, `batch-worker`, OpenAI's Batch API)."""

    batch_concurrency: int = Field(256, ge=1, description="lines of one batch in flight at once")
    batch_lease_ttl_s: float = Field(10.0, gt=0, description="a run silent this long is dead and its batch run again")
    batch_retention_s: float = Field(
        7 * 86400.0, gt=0, description="files, batches and outputs expire this long after they finish"
    )
    batch_max_file_bytes: int = Field(200 * MiB, ge=1, description="the largest input file accepted")


class WeightSyncSettings(_Concern):
    """Weight sync's, at both ends (the trainer's `WeightSender` and the workers)."""

    checkpoint_root: Path | None = Field(None, description="workers: the only directory whose checkpoints they load")
    weight_bucket_bytes: int = Field(256 * MiB, ge=1, description="bytes per broadcast bucket")
    weight_sync_timeout_s: float = Field(120.0, gt=0, description="each barrier's and each collective's timeout")
    advertise_addr: str = Field(
        "", description="the address peers reach this process at ('': the one that routes to Redis)"
    )


_CONCERNS: dict[str, type[_Concern]] = {
    "client": ClientSettings,
    "worker": WorkerSettings,
    "api": ApiSettings,
    "batch": BatchSettings,
    "weight_sync": WeightSyncSettings,
}
# Each concern's field, by its name (the env var's, less `ROLLOUT_`): a field name is unique across concerns.
_CONCERN_OF: dict[str, str] = {field: name for name, cls in _CONCERNS.items() for field in cls.model_fields}


class Settings(BaseSettings):
    """Every knob, with its unit in its name. Env var: `ROLLOUT_<FIELD>` (for example `ROLLOUT_REDIS_URL`).

    The deployment's own fields (Redis, key prefix, shard, and what producers and workers must agree on) are here;
    the rest are grouped by concern: `client`, `worker`, `api`, `batch`, `weight_sync` (each a `BaseSettings` of its
    own, read from the same `ROLLOUT_*` env vars), and `engine`, the engine a worker process runs (from
    `python -m workers`' options, not the environment). A field of a concern may be given flat, as before:
    `Settings(heartbeat_interval_s=0.2)` sets `settings.worker.heartbeat_interval_s`; `copy_with(**fields)` likewise.
    An unknown field raises `pydantic.ValidationError`.
    """

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_", extra="forbid")

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "rollout"
    shard: str = Field(
        DEFAULT_SHARD,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="workers: the shard (worker group) this worker joins; its keys share one Redis Cluster hash tag",
    )
    model_name: str = Field(
        "",
        pattern=r"^([A-Za-z0-9][A-Za-z0-9._\-]{0,127})?$",
        description="the served model name: what a worker serves and a client or `serve` addresses; each has keys, "
        "queues and control state of its own, so several models share one Redis ('': the fleet's default model)",
    )
    cache_dir: Path = Field(default_factory=default_cache_dir)
    redis_data_dir: Path | None = Field(
        None, description="up's private Redis: where its append-only file lives (default: <cache_dir>/redis/<port>)"
    )
    session_ttl_s: float = Field(3600.0, gt=0, description="a session's pin expires this long after its last turn")
    results_ttl_s: float = Field(3600.0, gt=0, description="a results stream nobody reads expires after this")
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="a worker silent this long is dead")
    read_block_ms: int = Field(100, ge=1, description="XREADGROUP / XREAD block time")

    client: ClientSettings = Field(default_factory=ClientSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    weight_sync: WeightSyncSettings = Field(default_factory=WeightSyncSettings)
    engine: EngineSettings = Field(default_factory=lambda: EngineSettings())

    def __init__(self, **fields: Any) -> None:
        """`fields`: any field by name, a concern's too (flat: `heartbeat_interval_s=0.2`); the rest from env."""
        super().__init__(**fields)

    @model_validator(mode="before")
    @classmethod
    def _by_concern(cls, data: Any) -> Any:
        """Move the flat fields of a concern (`max_staleness=1`) into it; read the concern's others from env."""
        if not isinstance(data, dict) or not _CONCERN_OF.keys() & data.keys():
            return data
        data, flat = dict(data), dict[str, dict[str, Any]]()
        for field in _CONCERN_OF.keys() & data.keys():
            flat.setdefault(_CONCERN_OF[field], {})[field] = data.pop(field)
        for name, fields in flat.items():
            given = data.get(name)
            base = given.model_dump() if isinstance(given, BaseModel) else dict(given or {})
            data[name] = _CONCERNS[name](**{**base, **fields})
        return data

    @property
    def keys(self) -> Keys:
        """This model's keys: under `key_prefix`, or `{key_prefix}:model:{model_name}` for a named model."""
        prefix = f"{self.key_prefix}:model:{self.model_name}" if self.model_name else self.key_prefix
        return Keys(prefix, self.shard)

    @property
    def models_key(self) -> str:
        """The set of named models whose workers registered (`{key_prefix}:models`; untagged, one per deployment)."""
        return f"{self.key_prefix}:models"

    def copy_with(self, **fields: Any) -> Settings:
        """These settings with `fields` replaced (deployment or concern fields, flat), validated. Raises
        `pydantic.ValidationError` for an unknown field or a bad value."""
        return type(self).model_validate({**self.model_dump(), **fields})

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Settings:
        """pydantic's copy; a concern's field in `update` (flat) goes to its concern, validated as by `copy_with`
        (never set beside it, silently unused)."""
        if update and _CONCERN_OF.keys() & update.keys():
            return self.copy_with(**update)
        return super().model_copy(update=update, deep=deep)

    def flat(self) -> dict[str, Any]:
        """Every field by its env name (less `ROLLOUT_`), concerns flattened; the engine is left out (it reaches a
        worker as `python -m workers` options)."""
        dumped = self.model_dump(mode="json", exclude={"engine"})
        return {
            **{k: v for k, v in dumped.items() if k not in _CONCERNS},
            **{k: v for name in _CONCERNS for k, v in dumped[name].items()},
        }


def settings_env(settings: Settings) -> dict[str, str]:
    """The env vars (`ROLLOUT_*`) that give a child process exactly these settings: every field that is set (an
    unset one, None, is left to its default), so what the caller configured in Python reaches the workers."""
    return {
        f"ROLLOUT_{name.upper()}": json.dumps(value) if isinstance(value, (list, dict)) else str(value)
        for name, value in settings.flat().items()
        if value is not None
    }
