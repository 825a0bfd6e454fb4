"""Settings shared by every rollout-svc process, read once per entry point from env vars `ROLLOUT_*`."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollout_svc.keys import Keys


def default_cache_dir() -> Path:
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollout-svc"


class Settings(BaseSettings):
    """Every knob, with its unit in its name. Env var: `ROLLOUT_<FIELD>` (for example `ROLLOUT_REDIS_URL`)."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "rollout"
    cache_dir: Path = Field(default_factory=default_cache_dir)

    request_timeout_s: float = Field(600.0, gt=0, description="client: default per-request timeout")
    max_queued_requests: int = Field(100_000, ge=1, description="admission limit per requests stream")
    session_ttl_s: float = Field(3600.0, gt=0, description="a session's pin expires this long after its last turn")
    results_ttl_s: float = Field(3600.0, gt=0, description="a results stream nobody reads expires after this")

    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="a worker silent this long is dead")
    max_deliveries: int = Field(3, ge=1, description="deliveries before an entry becomes a dead letter")
    read_block_ms: int = Field(100, ge=1, description="XREADGROUP / XREAD block time")
    dead_letter_maxlen: int = Field(10_000, ge=1, description="approximate cap of the dead-letter stream")

    @property
    def keys(self) -> Keys:
        return Keys(self.key_prefix)
