"""The job state machine: the one place that says which status may follow which."""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    queued = "queued"
    starting = "starting"
    running = "running"
    cancelling = "cancelling"
    pausing = "pausing"
    paused = "paused"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


FINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})
# The statuses in which a job's workers may run: it holds its chips, and counts against its team's limits.
ACTIVE = frozenset({JobStatus.starting, JobStatus.running, JobStatus.cancelling, JobStatus.pausing})

TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    # queued → cancelling or pausing: a launched job the platform holds back (Kueue) has a JobSet to
    # delete. queued → paused: one never launched has nothing to stop.
    JobStatus.queued: frozenset(
        {
            JobStatus.starting,
            JobStatus.cancelled,
            JobStatus.cancelling,
            JobStatus.failed,
            JobStatus.pausing,
            JobStatus.paused,
        }
    ),
    # A worker can finish before its first report moves the job to running. → queued: the platform
    # suspended the run to wait for quota (Kueue, before admission or preempting a running workload).
    JobStatus.starting: frozenset(
        {
            JobStatus.queued,
            JobStatus.running,
            JobStatus.succeeded,
            JobStatus.failed,
            JobStatus.cancelling,
            JobStatus.cancelled,
            JobStatus.pausing,
        }
    ),
    JobStatus.running: frozenset(
        {JobStatus.queued, JobStatus.succeeded, JobStatus.failed, JobStatus.cancelling, JobStatus.pausing}
    ),
    # A run can end on its own before the cancel reaches it: record what really happened.
    JobStatus.cancelling: frozenset({JobStatus.cancelled, JobStatus.succeeded, JobStatus.failed}),
    # Pausing: the workers save a checkpoint and stop (or the run ends on its own first); a cancel then
    # stops them without waiting for the pause.
    JobStatus.pausing: frozenset(
        {JobStatus.paused, JobStatus.succeeded, JobStatus.failed, JobStatus.cancelling}
    ),
    # Paused: nothing runs; resumed, it waits its turn in the queue and continues from its checkpoint.
    JobStatus.paused: frozenset({JobStatus.queued, JobStatus.cancelled}),
    JobStatus.succeeded: frozenset(),
    # Failed is final unless its owner resumes it (POST /jobs/{id}/resume): it waits its turn in the queue
    # and its new run goes on from the last checkpoint the failed one saved.
    JobStatus.failed: frozenset({JobStatus.queued}),
    JobStatus.cancelled: frozenset(),
}


class InvalidTransition(Exception):
    def __init__(self, current: str, target: str) -> None:
        super().__init__(f"a job cannot go from '{current}' to '{target}'")
        self.current = current
        self.target = target


def can_transition(current: str, target: str) -> bool:
    return JobStatus(target) in TRANSITIONS[JobStatus(current)]


def check_transition(current: str, target: str) -> None:
    if not can_transition(current, target):
        raise InvalidTransition(current, target)


def is_final(status: str) -> bool:
    return JobStatus(status) in FINAL
