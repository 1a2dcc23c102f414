"""The service's settings: one object, read from `TPUTUNE_*` environment variables (and `.env`)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from worker.config import check_prefix, for_tenant

AUTO_WORKERS_MAX = 4  # TPUTUNE_WORKERS=0: a worker per core, up to this many
# A Kubernetes object's name (a DNS-1123 subdomain), as a worker's service account must be.
SERVICE_ACCOUNT = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
KEY_DAYS_MAX = 36_500  # the longest lifetime an API key may be given, in days (a hundred years)


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
    tenant_data_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Where each team's jobs may read and write (comma-separated): gs://bucket/path or local "
        "directory prefixes, `{tenant}` standing for the job's team (gs://ml-data/teams/{tenant}); an admin "
        "may give a team its own (PATCH /admin/tenants/{name}). Empty: anywhere (local paths within the "
        "data roots).",
    )
    shared_read_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["gs://gemma-data"],
        description="Where every team's jobs may also read, not write, where a team's data prefixes hold: "
        "the official Gemma checkpoints and tokenizer (comma-separated).",
    )
    allow_tiny_model: bool = Field(default=False, description="Accept the `tiny` test model.")
    worker_command: str = Field(
        default=f"{shlex.quote(sys.executable)} -m worker",
        description="Command the local executor runs; `--config <job.json>` is appended.",
    )
    max_local_processes: int = Field(default=8, ge=1, le=64)
    cancel_grace_seconds: float = Field(default=15.0, ge=0)
    local_max_restarts: int = Field(
        default=3, ge=0, description="Local restarts of a run after a preemption exit."
    )
    stall_minutes: float = Field(
        default=30.0,
        ge=0,
        description="A running job whose workers reported nothing for this long (they report every step) "
        "has stalled, a host lost in a collective or a read that never returns: its run is stopped and the "
        "job queued again, to go on from its last checkpoint; 0: never.",
    )
    stall_max_restarts: int = Field(
        default=2,
        ge=0,
        description="Runs of a job stopped as stalled that are started again; one more stall fails it "
        "(worker_stalled).",
    )
    dispatch_interval_seconds: float = Field(default=1.0, gt=0)
    dispatcher_enabled: bool = True
    dispatcher_process: bool = Field(
        default=True,
        description="Run the dispatcher in a process of its own, on another core (false: a thread of the "
        "API's process).",
    )
    dispatcher_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="The dispatcher process's niceness: on a busy machine the API's requests go first.",
    )
    dispatcher_busy_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="As a thread (TPUTUNE_DISPATCHER_PROCESS=false): its share of the interpreter while "
        "requests arrive (1: no limit).",
    )
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    gcs_endpoint: str | None = Field(default=None, description="Cloud Storage endpoint (emulator) override.")
    gcs_project: str | None = None
    storage_timeout_seconds: float = Field(default=10.0, gt=0, description="Bound on one dataset check.")
    log_level: str = "info"
    log_format: Literal["text", "json"] = Field(default="text", description="`json`: one object per line.")
    access_log: bool = Field(default=True, description="A log line per request (logger tputune.access).")
    metrics_enabled: bool = Field(default=True, description="Serve Prometheus metrics at /metrics.")

    admin_key: SecretStr | None = Field(
        default=None,
        description="Bootstrap admin key; when set, every job route needs an API key (Bearer).",
    )
    require_api_keys: bool = Field(
        default=False,
        description="Every job route needs an API key also without TPUTUNE_ADMIN_KEY: the bootstrap key "
        "retired, admin API keys manage the keys.",
    )
    allow_unauthenticated: bool = Field(
        default=False, description="Serve without keys on a non-loopback address (not recommended)."
    )
    key_max_days: int | None = Field(
        default=None,
        ge=1,
        le=KEY_DAYS_MAX,
        description="Every API key expires within this many days of its creation: a key created without "
        "`expires_in_days` gets this; unset: keys may live until revoked.",
    )
    rate_limit_per_second: float = Field(default=50.0, ge=0, description="Per API key; 0 turns it off.")
    rate_limit_burst: int = Field(default=200, ge=1)
    database_pool_size: int = Field(
        default=40, ge=1, le=1000, description="Database connections kept open (PostgreSQL: the most)."
    )
    keep_alive_seconds: int = Field(
        default=75,
        ge=1,
        description="How long an idle client connection stays open (behind a load balancer: longer than "
        "its own idle timeout, or it sees resets; Google Cloud's is 600 s).",
    )
    workers: int = Field(
        default=1,
        ge=0,
        le=64,
        description="API processes sharing the port (`tputune serve`); 0: one per CPU core this process "
        f"may use, at most {AUTO_WORKERS_MAX}. The dispatcher runs in a process of its own besides.",
    )
    worker_threads: int = Field(
        default=8, ge=1, le=256, description="Threads that run the API's blocking route code."
    )
    max_log_followers: int = Field(
        default=32,
        ge=0,
        le=4096,
        description="Job logs followed at once (`GET /jobs/{id}/logs?follow=true`, kubernetes executor), per "
        "API process; each holds a thread of its own and a connection to the Kubernetes API. More get 429.",
    )
    max_event_followers: int = Field(
        default=1000,
        ge=0,
        le=100_000,
        description="Job event streams followed at once (`GET /jobs/{id}/events?follow=true`, the "
        "dashboard's job page), per API process; each holds a socket, and reads when its job changes. "
        "More get 429.",
    )
    max_streams_per_key: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Streams (followed events and logs) one API key holds at once, in all of the server's "
        "processes (`--workers`); more get 429. Not for the admin key.",
    )
    usage_sync_seconds: float = Field(
        default=1.0,
        ge=0,
        le=10,  # (a replica's heartbeat goes with a pass: api.usage.STALE_SECONDS is 30)
        description="How often the server shares each API key's use of its rate limit and streams with the "
        "other replicas on the database, and learns of keys revoked there (api.usage); 0: each replica "
        "counts its own.",
    )
    stream_recheck_seconds: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="How often followed streams' keys are checked again: a stream of a key revoked "
        "meanwhile ends (at once in the server that revoked it, all its `--workers` processes).",
    )
    tenant_max_active_jobs: int | None = Field(
        default=None, ge=1, description="Jobs of one tenant running at once; more wait queued."
    )
    tenant_max_active_chips: int | None = Field(
        default=None,
        ge=1,
        description="TPU chips one tenant's running jobs may hold at once (local executor: processes); "
        "more wait queued, and a job bigger than this is refused.",
    )
    tenant_max_queued_jobs: int | None = Field(
        default=None,
        ge=1,
        description="Jobs one tenant may have queued (waiting to start) at once; POST /jobs over it is "
        "refused with 429 (too_many_queued_jobs), so that a runaway script cannot fill the queue.",
    )
    tenant_max_chip_hours_per_month: int | None = Field(
        default=None,
        ge=1,
        description="Chip-hours (local executor: process-hours) one tenant's jobs may hold in a calendar "
        "month (UTC), as GET /usage counts them; once they have, its queued jobs wait until the next month "
        "or a higher budget (running ones go on, unless TPUTUNE_TENANT_BUDGET_PAUSES_RUNNING).",
    )
    tenant_budget_pauses_running: bool = Field(
        default=False,
        description="Once a tenant's jobs have held its monthly chip-hours, also stop its running jobs: "
        "each saves a checkpoint, lets its chips go and waits in the queue, and goes on from the "
        "checkpoint in the next month or once an admin raises the budget. Off: they run to their end.",
    )

    # --- webhooks (api.webhooks) ---
    webhooks_enabled: bool = Field(
        default=True, description="Send webhooks (with the dispatcher, on the leader); false: none are sent."
    )
    webhook_allow_http: bool = Field(default=False, description="Endpoints may be http:// (tests, a LAN).")
    webhook_allow_private: bool = Field(
        default=False,
        description="Endpoints may be private or local addresses (else only public ones: the server posts "
        "from inside the cluster).",
    )
    webhook_timeout_seconds: float = Field(
        default=10.0, gt=0, le=60, description="Bound on one post, from the address lookup to the answer."
    )
    webhook_ca_bundle: Path | None = Field(
        default=None,
        description="CA certificates (PEM) to trust for https endpoints instead of the public ones "
        "(endpoints behind a company's own CA).",
    )
    webhook_proxy: SecretStr | None = Field(
        default=None,
        description="http(s)://[user:password@]host:port of the egress proxy webhooks go through (no other "
        "proxy setting, HTTPS_PROXY included, applies to them).",
    )
    webhook_retry_seconds: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [5.0, 30.0, 120.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0],
        description="Waits before each retry of a failed delivery (comma-separated seconds); after the "
        "last, it has failed.",
    )
    webhook_disable_after_hours: float = Field(
        default=120,
        ge=0,
        description="An endpoint whose every attempt failed for this long is disabled until its team enables "
        "it again (PATCH /webhooks/{id}); 0: never.",
    )
    webhook_max_per_tenant: int = Field(
        default=10, ge=1, le=1000, description="Endpoints one tenant may have."
    )
    idempotency_key_hours: float = Field(
        default=24,
        gt=0,
        description="An Idempotency-Key is remembered this long at least (deleted within the hour after): "
        "the same key later makes a new job.",
    )
    audit_retention_days: float | None = Field(
        default=None, gt=0, description="Audit events older than this are deleted (unset: kept)."
    )
    job_retention_days: float | None = Field(
        default=None,
        gt=0,
        description="Jobs that ended (succeeded, failed, cancelled) longer ago than this are deleted with "
        "their events and logs, as DELETE /jobs/{id} does (unset: kept). Their outputs stay; what they used "
        "stays counted in GET /usage.",
    )
    webhook_retention_days: float = Field(
        default=30, gt=0, description="Deliveries done are kept this long (GET /webhooks/{id}/deliveries)."
    )

    # --- the kubernetes executor (TPU JobSets on GKE) ---
    k8s_namespace: str = Field(default="tputune", description="Namespace of the JobSets, Secrets and Lease.")
    k8s_api_server: str | None = Field(
        default=None,
        description="API server URL used without credentials (kubectl proxy, tests); "
        "default: in-cluster config, else the kubeconfig.",
    )
    k8s_kubeconfig: Path | None = Field(default=None, description="Kubeconfig file; default ~/.kube/config.")
    k8s_gke_cluster: str | None = Field(
        default=None,
        pattern=r"^projects/[^/]+/locations/[^/]+/clusters/[^/]+$",
        description="projects/<project>/locations/<location>/clusters/<cluster>: the GCS FUSE driver's "
        "identity provider for host-network TPU pods.",
    )
    k8s_worker_image: str | None = Field(default=None, description="The worker image (Dockerfile.worker).")
    k8s_image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    k8s_worker_service_account: str = Field(
        default="tputune-worker",
        description="Kubernetes service account of the workers (Workload Identity); `{tenant}` stands for "
        "the job's team (tputune-worker-{tenant}: each team's jobs reach only the buckets its own Google "
        "service account may).",
    )
    k8s_worker_cpu: str = Field(default="8", description="CPU request of each worker pod.")
    k8s_worker_memory: str = Field(default="32Gi", description="Memory request of each worker pod.")
    k8s_worker_run_as_user: int | None = Field(
        default=None, ge=1, description="Run workers as this non-root UID where the TPU nodes allow it."
    )
    k8s_termination_grace_seconds: int = Field(
        default=120, ge=0, description="Time a worker gets to save a checkpoint after SIGTERM."
    )
    k8s_max_restarts: int = Field(
        default=3, ge=0, description="JobSet restarts for worker failures; preemptions do not count."
    )
    k8s_ttl_seconds_after_finished: int | None = Field(
        default=86400, ge=0, description="Finished JobSets are deleted after this long (unset: kept)."
    )
    k8s_saved_log_lines: int = Field(
        default=500,
        ge=0,
        le=10_000,
        description="The last lines of a run's worker log kept in the database as the run ends (its pods' "
        "logs go with its JobSet: paused, cancelled, resumed or past its TTL); 0: none.",
    )
    k8s_kueue_queue: str | None = Field(default=None, description="Kueue LocalQueue for the JobSets.")
    k8s_kueue_priority_class: str | None = Field(default=None, description="Kueue WorkloadPriorityClass.")
    k8s_gcs_fuse_mount_options: str = Field(
        default="implicit-dirs", description="mountOptions of the read-only GCS FUSE dataset volumes."
    )
    k8s_gcs_fuse_sidecar_limits: dict[Literal["cpu", "memory", "ephemeral-storage"], str] = Field(
        default_factory=dict,
        description='GCS FUSE sidecar limits as JSON, e.g. {"memory": "0"} (0: unlimited).',
    )
    k8s_output_base_uri: str | None = Field(
        default=None,
        pattern=r"^gs://[^/]+",
        description="gs://bucket/prefix: a job without output_uri writes under <prefix>/<job id>; `{tenant}` "
        "stands for the job's team (gs://outputs/tputune/{tenant}: a place each team's service account may "
        "write).",
    )
    k8s_tpu_machine_types: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Machine types of the cluster's TPU node pools (comma-separated), where a topology "
        "runs on more than one (v6e 2x4: ct6e-standard-8t or -4t).",
    )
    k8s_leader_election: bool = Field(default=True, description="Dispatch only while holding the Lease.")
    k8s_lease_name: str = "tputune-dispatcher"
    k8s_lease_seconds: float = Field(
        default=15.0, gt=0, description="A leader that stops renewing is replaced."
    )
    k8s_request_timeout_seconds: float = Field(default=10.0, gt=0)
    k8s_resync_seconds: float = Field(default=300.0, gt=0, description="Full relist of JobSets and pods.")

    @field_validator("k8s_output_base_uri")
    @classmethod
    def _output_bucket(cls, value: str | None) -> str | None:
        """A bucket name the pods can mount: the overlay's placeholder (OUTPUT_BUCKET) left in failed every
        job at run time, after the wait for TPUs."""
        if value is not None:
            check_prefix(value)  # (`{tenant}` may stand for the team: a bucket or a directory of each)
        return value

    @field_validator(
        "allowed_data_roots",
        "k8s_tpu_machine_types",
        "webhook_retry_seconds",
        "tenant_data_prefixes",
        "shared_read_prefixes",
        mode="before",
    )
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part for part in (p.strip() for p in value.split(",")) if part]
        return value

    @field_validator("tenant_data_prefixes", "shared_read_prefixes")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        return [check_prefix(prefix) for prefix in value]

    @field_validator("k8s_worker_service_account")
    @classmethod
    def _service_account(cls, value: str) -> str:
        if not SERVICE_ACCOUNT.fullmatch(for_tenant(value, "team")):
            raise ValueError(
                "a Kubernetes service account name: lowercase letters, digits, '-' and '.', starting and "
                "ending with a letter or digit, `{tenant}` standing for the job's team"
            )
        return value

    @field_validator("webhook_proxy")
    @classmethod
    def _proxy(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            parts = urlsplit(value.get_secret_value())
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("an http:// or https:// proxy URL with a host, e.g. http://proxy.corp:3128")
        return value

    @field_validator("webhook_retry_seconds")
    @classmethod
    def _retry_waits(cls, value: list[float]) -> list[float]:
        if any(wait < 0 for wait in value) or len(value) > 50:
            raise ValueError("at most 50 waits, each 0 seconds or more")
        return value

    @property
    def auth_enabled(self) -> bool:
        return self.admin_key is not None or self.require_api_keys

    def check_exposure(self) -> None:
        """Refuse to serve a network address with no authentication unless told to."""
        loopback = self.host in ("127.0.0.1", "localhost", "::1")
        if not loopback and not self.auth_enabled and not self.allow_unauthenticated:
            raise SystemExit(
                f"tputune: refusing to serve {self.host} without authentication; set TPUTUNE_ADMIN_KEY, "
                "or TPUTUNE_REQUIRE_API_KEYS=true once admin API keys exist (or "
                "TPUTUNE_ALLOW_UNAUTHENTICATED=true to accept the risk)."
            )

    @property
    def resolved_workers(self) -> int:
        if self.workers:
            return self.workers
        if self.dispatcher_enabled and not self.dispatcher_process:
            return 1  # a dispatcher thread per worker would be one dispatcher too many
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, min(AUTO_WORKERS_MAX, cores))

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

    @cached_property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    @cached_property
    def jobs_root(self) -> Path:
        """`jobs_dir` as the checks of users' paths compare it (api.validation)."""
        return self.jobs_dir.expanduser().resolve()

    def ensure_dirs(self) -> None:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
