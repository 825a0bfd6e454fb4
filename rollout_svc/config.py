"""Settings shared by every rollout-svc process (env vars `ROLLOUT_*`), and the engine settings of a worker."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollout_svc.keys import DEFAULT_SHARD, Keys

MiB = 1024 * 1024


def default_cache_dir() -> Path:
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollout-svc"


GC_YOUNG_THRESHOLD = 50_000  # allocations between young collections (Python's default: 700)
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


class Settings(BaseSettings):
    """Every knob, with its unit in its name. Env var: `ROLLOUT_<FIELD>` (for example `ROLLOUT_REDIS_URL`)."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "rollout"
    shard: str = Field(
        DEFAULT_SHARD,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="workers: the shard (worker group) this worker joins; its keys share one Redis Cluster hash tag",
    )
    cache_dir: Path = Field(default_factory=default_cache_dir)
    redis_data_dir: Path | None = Field(
        None, description="up's private Redis: where its append-only file lives (default: <cache_dir>/redis/<port>)"
    )

    request_timeout_s: float = Field(600.0, gt=0, description="client: default per-request timeout")
    max_queued_requests: int = Field(100_000, ge=1, description="admission limit per requests stream")
    session_ttl_s: float = Field(3600.0, gt=0, description="a session's pin expires this long after its last turn")
    results_ttl_s: float = Field(3600.0, gt=0, description="a results stream nobody reads expires after this")
    max_abort_retries: int = Field(16, ge=0, description="client: token-exact retries of one request cut by aborts")
    max_staleness: int | None = Field(
        None, ge=0, description="client: drop trajectories staler than this many weight versions (None: keep all)"
    )
    stale_policy: Literal["regenerate", "mark"] = Field(
        "regenerate", description="client: a too-stale trajectory is generated again, or returned with its staleness"
    )

    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="a worker silent this long is dead")
    control_timeout_s: float = Field(60.0, gt=0, description="how long a control command waits for every ack")
    max_deliveries: int = Field(3, ge=1, description="deliveries before an entry becomes a dead letter")
    read_block_ms: int = Field(100, ge=1, description="XREADGROUP / XREAD block time")
    gc_young_threshold: int = Field(
        GC_YOUNG_THRESHOLD,
        ge=0,
        description="clients: at the first connection, freeze what is alive and collect the young generation after "
        "this many allocations (Python's default: 700); 0 leaves the process's garbage collector alone",
    )
    redis_outage_s: float = Field(
        30.0, ge=0, description="client: how long an enqueue keeps retrying a Redis that is away before it raises"
    )

    checkpoint_root: Path | None = Field(
        None, description="workers: the only directory whose checkpoints they load (env ROLLOUT_CHECKPOINT_ROOT)"
    )
    weight_bucket_bytes: int = Field(256 * MiB, ge=1, description="weight sync: bytes per broadcast bucket")
    weight_sync_timeout_s: float = Field(
        120.0, gt=0, description="weight sync: each barrier's and each collective's timeout"
    )
    advertise_addr: str = Field(
        "", description="weight sync: the address peers reach this process at ('': the one that routes to Redis)"
    )
    dead_letter_maxlen: int = Field(10_000, ge=1, description="approximate cap of the dead-letter stream")
    api_keys: list[str] = Field(
        default_factory=list, description="API: data-plane keys, a JSON list (env ROLLOUT_API_KEYS='[\"k1\"]')"
    )
    admin_token: str | None = Field(None, description="API: the bearer token of /admin/* (none: admin routes off)")
    served_model_name: str = Field("", description="API: the model name served ('': the workers' model folder name)")
    api_default_max_tokens: int = Field(1024, ge=1, description="API: max_tokens of a chat request that sets none")
    stream_interval_s: float = Field(
        0.05, ge=0, description="workers: a streaming request's chunk is sent at most this often (unless full)"
    )
    stream_chunk_tokens: int = Field(16, ge=1, description="workers: a streaming chunk is sent once it holds this many")
    batch_concurrency: int = Field(256, ge=1, description="batch jobs: lines of one batch in flight at once")
    batch_lease_ttl_s: float = Field(
        10.0, gt=0, description="batch jobs: a run silent this long is dead and its batch is run again"
    )
    batch_retention_s: float = Field(
        7 * 86400.0, gt=0, description="batch jobs: files, batches and outputs expire this long after they finish"
    )
    batch_max_file_bytes: int = Field(200 * MiB, ge=1, description="batch jobs: the largest input file accepted")

    @property
    def keys(self) -> Keys:
        return Keys(self.key_prefix, self.shard)


class EngineSettings(BaseModel):
    """The engine one worker runs: the one model shared by `python -m workers`, `workers.direct` and `up`.

    `max_num_seqs` is the engine's batch size and the worker's capacity (default 64 for vLLM, 1024 for echo).
    `dtype="float32"` is what greedy token-equality checks need (bf16 and batching change the numerics).
    `kv_cache_memory_bytes` is explicit because vLLM's default (a fraction of device memory) fails on small
    CPU hosts. `enable_sleep_mode` (vLLM sleep mode, GPU only) defaults to on where the platform supports it.
    `echo_token_delay_s`: the echo engine's seconds per generated token (it stands in for a long generation).
    """

    model_config = ConfigDict(extra="forbid")

    engine: Literal["vllm", "echo"] = Field("vllm", description="echo: deterministic, for queue tests only")
    model: str | None = Field(None, description="Hugging Face model folder (default: the prepared SmolLM2)")
    dtype: str = Field(
        "auto",
        description="vLLM dtype: auto, bfloat16, float16, float32 (auto on CPU: bfloat16 only where the CPU has "
        "avx512_bf16 or amx_bf16, else float32)",
    )
    max_model_len: int = Field(2048, ge=16, description="context length in tokens")
    max_num_seqs: int | None = Field(None, ge=1, description="engine batch size = worker capacity")
    kv_cache_memory_bytes: int = Field(512 * MiB, ge=MiB, description="KV cache size in bytes")
    seed: int = Field(0, description="engine seed")
    enable_sleep_mode: bool | None = Field(None, description="vLLM sleep mode (default: where supported)")
    echo_token_delay_s: float = Field(0.0, ge=0, description="echo engine: seconds per generated token")
    echo_load_delay_s: float = Field(0.0, ge=0, description="echo engine: seconds a weight load takes")
    tool_call_parser: str = Field(
        "hermes", description="vLLM tool-call parser for tool_choice=auto ('' for none): hermes, llama3_json, ..."
    )

    @property
    def capacity(self) -> int:
        return self.max_num_seqs or (64 if self.engine == "vllm" else 1024)

    def vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `workers.engine.vllm_engine_args` (all but `model`)."""
        kwargs: dict[str, Any] = {
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "max_num_seqs": self.capacity,
            "seed": self.seed,
        }
        if self.enable_sleep_mode is not None:
            kwargs["enable_sleep_mode"] = self.enable_sleep_mode
        return kwargs

    def to_args(self) -> list[str]:
        """Command-line options of `python -m workers` that reproduce these settings (defaults left out)."""
        args: list[str] = []
        for name, value in self.model_dump(exclude_defaults=True).items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            else:
                args += [flag, str(value)]
        return args

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, engine: bool = True) -> None:
        """Add one option per field (`--max-num-seqs`, ...) to an argparse parser; `from_args` reads them back."""
        for name, info in cls.model_fields.items():
            if name in ("engine", "echo_token_delay_s", "echo_load_delay_s") and not engine:
                continue
            flag, help_text = "--" + name.replace("_", "-"), info.description
            if name == "engine":
                parser.add_argument(flag, choices=["vllm", "echo"], default="vllm", help=help_text)
            elif name == "enable_sleep_mode":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                kind = {int: int, float: float}.get(type(info.default), str)
                if name == "max_num_seqs":
                    kind = int
                parser.add_argument(flag, type=kind, default=info.default, help=help_text)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> EngineSettings:
        return cls.model_validate({k: v for k, v in vars(namespace).items() if k in cls.model_fields})
