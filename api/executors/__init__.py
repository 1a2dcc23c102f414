"""The seam between the control plane and what runs jobs. Nothing above it knows processes or JobSets."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from api.models import Job
from api.settings import Settings


@dataclass(frozen=True)
class Observation:
    """What an executor sees of a launched job.

    state: `running` (still going), `exited` (ended with `exit_code`), `gone` (no trace of it: died without
    an exit status, or never launched), `pending` (launched but waiting for resources; `reason` says why).
    `held` (with `pending`): the platform holds the whole run back for quota (Kueue), so the job shows as
    queued. `restarts` counts the restarts the platform made itself (JobSets), `restart_reason` says why
    the latest one happened.
    """

    state: Literal["pending", "running", "exited", "gone"]
    exit_code: int | None = None
    reason: str | None = None
    restarts: int = 0
    restart_reason: str | None = None
    held: bool = False
    details: dict[str, Any] = field(default_factory=dict)


class Executor(Protocol):
    name: str
    # True where a run's log outlives it (a file); False where it goes with the run (a pod's): the
    # dispatcher then saves the end of it as the run ends.
    logs_outlive_runs: bool

    def find(self, job: Job) -> dict[str, Any] | None:
        """The launch handle of a run of this job that already exists (adopt it), or None."""

    def launch(self, job: Job, token: str) -> dict[str, Any]:
        """Start the job's workers with its token; idempotent per job id. Returns the launch handle."""

    def observe(self, job: Job) -> Observation:
        """Look at a launched job (its `launch` handle is set)."""

    def cancel(self, job: Job) -> bool:
        """Ask the run to stop (first call: graceful; later calls past the grace period: forceful).
        Returns True once nothing of it runs any more."""

    def restart(self, job: Job, token: str) -> dict[str, Any]:
        """Start the run again after a preemption exit (it resumes from its last checkpoint). Only asked of
        executors that report EXIT_PREEMPTED; the kubernetes one never does (JobSets restart themselves)."""

    def logs(self, job: Job, tail: int) -> tuple[list[str], bool]:
        """The last `tail` lines of the job's log and whether older lines were left out."""

    def forget(self, job: Job) -> None:
        """Remove what is left of the runs of an ended job that was deleted (api.deletion): its records and
        logs (a JobSet kept for its pods' logs); never its outputs. Idempotent; may raise (the platform
        away): the caller logs it, and what is left stays (a JobSet until its TTL)."""


class ExecutorUnavailable(RuntimeError):
    """The platform did not answer (after retries); the dispatcher tries again on its next pass."""


class LaunchRefused(OSError):
    """The platform refused to start the run for good (e.g. an invalid object); the job fails with this."""


@runtime_checkable
class FollowsLogs(Protocol):
    def follow_logs(self, job: Job, tail: int) -> LogStream:
        """The last `tail` lines, then new ones as they come, until the log ends; LookupError if there is
        no log to follow yet."""
        ...


class LogStream(Protocol):
    """A followed log. Reading it blocks until a line comes (iterate on a thread of its own)."""

    def __iter__(self) -> Iterator[str]: ...

    def interrupt(self) -> None:
        """End the stream, from any thread: a read blocked in it returns."""


@runtime_checkable
class Discards(Protocol):
    def discard(self, job: Job) -> None:
        """Remove what a launch that never finished left behind (the job was cancelled or its launch
        refused before a run existed). Idempotent."""
        ...


@runtime_checkable
class KeepsCrashLogs(Protocol):
    def crash_log(self, job: Job, since_attempt: int) -> tuple[str, list[str]] | None:
        """The end of the log of the job's worker that crashed last (pod, lines), read as it crashed, where
        the platform's restart deletes it; once, and only if it crashed in restart attempt `since_attempt`
        or later (one read too late for its own restart is not told of the next)."""
        ...


@runtime_checkable
class Closeable(Protocol):
    def close(self) -> None:
        """Stop background work (watches) and release connections."""
        ...


def make_executor(settings: Settings) -> Executor:
    if settings.executor == "kubernetes":
        from api.executors.kubernetes import KubernetesExecutor

        return KubernetesExecutor(settings)
    from api.executors.local import LocalExecutor

    return LocalExecutor(settings)
