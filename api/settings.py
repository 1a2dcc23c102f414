"""The service's settings: one object, read from `TPUTUNE_*` environment variables (and `.env`)."""

from __future__ import annotations

import shlex
import sys
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "tputune"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TPUTUNE_", env_file=".env", extra="ignore")

    data_dir: Path = Field(default_factory=_default_data_dir, description="SQLite file, job dirs, logs.")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default a SQLite file under data_dir."
    )
    executor: Literal["local", "kubernetes"] = "local"
    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str | None = Field(
        default=None, description="URL workers use to reach the API; default http://host:port."
    )
    allowed_data_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Local dirs jobs may read from and write to (comma-separated); data_dir always is.",
    )
    allow_tiny_model: bool = Field(default=False, description="Accept the `tiny` test model.")
    worker_command: str = Field(
        default=f"{shlex.quote(sys.executable)} -m worker",
        description="Command the local executor runs; `--config <job.json>` is appended.",
    )
    max_local_processes: int = Field(default=8, ge=1, le=64)
    cancel_grace_seconds: float = Field(default=15.0, ge=0)
    local_max_restarts: int = Field(default=3, ge=0, description="Local restarts after a preemption exit.")
    dispatch_interval_seconds: float = Field(default=1.0, gt=0)
    dispatcher_enabled: bool = True
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    gcs_endpoint: str | None = Field(default=None, description="Cloud Storage endpoint (emulator) override.")
    gcs_project: str | None = None
    storage_timeout_seconds: float = Field(default=10.0, gt=0, description="Bound on one dataset check.")
    log_level: str = "info"

    @field_validator("allowed_data_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            return [part for part in (p.strip() for p in value.split(",")) if part]
        return value

    @cached_property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'tputune.db'}"

    @cached_property
    def resolved_public_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return (self.public_url or f"http://{host}:{self.port}").rstrip("/")

    @cached_property
    def data_roots(self) -> list[Path]:
        roots = [self.data_dir, *self.allowed_data_roots]
        return [Path(root).expanduser().resolve() for root in roots]

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    def ensure_dirs(self) -> None:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
