"""What a JobSet and its pods say about a run (`observation_of`), case by case."""

from __future__ import annotations

from typing import Any

from api.executors import Observation
from api.executors.kubernetes import observation_of, pod_failure, stuck_reason
from worker.config import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_PREEMPTED


def jobset(
    status: dict[str, Any] | None = None, suspend: bool = False, deleting: bool = False
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "ft-x"}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": metadata, "spec": {"suspend": suspend}, "status": status or {}}


def condition(kind: str, reason: str = "", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": "True", "reason": reason, "message": message}


def pod(name: str, status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": status}


def failed(name: str, exit_code: int, disruption: str | None = None) -> dict[str, Any]:
    conditions = [{"type": "DisruptionTarget", "status": "True", "message": disruption}] if disruption else []
    return pod(
        name,
        {
            "phase": "Failed",
            "conditions": conditions,
            "containerStatuses": [{"name": "worker", "state": {"terminated": {"exitCode": exit_code}}}],
        },
    )


def waiting(name: str, reason: str, message: str = "", container: str = "worker") -> dict[str, Any]:
    status = {
        "name": container,
        "image": "img:1",
        "state": {"waiting": {"reason": reason, "message": message}},
    }
    key = "initContainerStatuses" if container != "worker" else "containerStatuses"
    return pod(name, {"phase": "Pending", key: [status]})


def observe(
    js: dict[str, Any],
    pods: list[dict[str, Any]] | None = None,
    last: str | None = None,
    queue: str | None = None,
) -> Observation:
    return observation_of(js, pods or [], last, "v6e 4x4", queue)


def test_completed_and_running() -> None:
    assert observe(jobset({"conditions": [condition("Completed")]})).state == "exited"
    assert observe(jobset({"conditions": [condition("Completed")]})).exit_code == 0
    seen = observe(jobset({"restarts": 2}), last="pod p was stopped by the cluster (maintenance)")
    assert (seen.state, seen.restarts, seen.restart_reason) == (
        "running",
        2,
        "pod p was stopped by the cluster (maintenance)",
    )
    assert observe(jobset(), last="an old failure").restart_reason is None  # no restart: nothing to explain


def test_failed_takes_the_worker_s_exit_code_and_says_why() -> None:
    failure = condition("Failed", "FailedByFailurePolicy", "rule badInput matched")
    seen = observe(jobset({"conditions": [failure]}), [failed("p-0", EXIT_BAD_INPUT), failed("p-1", 143)])
    assert (seen.state, seen.exit_code) == ("exited", EXIT_BAD_INPUT)
    assert seen.reason == (
        "The JobSet failed (FailedByFailurePolicy: rule badInput matched); the worker in pod p-0 rejected "
        "the job's input (exit status 65) (and 1 more pods failed)."
    )


def test_a_preempted_worker_out_of_restarts_is_a_failure_not_a_restart() -> None:
    failure = condition(
        "Failed", "ReachedMaxRestarts", "jobset failed due to reaching max number of restarts"
    )
    seen = observe(jobset({"conditions": [failure], "restarts": 3}), [failed("p-0", EXIT_PREEMPTED)])
    assert seen.exit_code == EXIT_FAILED
    assert "stopped and saved a checkpoint (exit status 75)" in (seen.reason or "")
    assert observe(jobset({"conditions": [failure]}), []).exit_code == EXIT_FAILED  # pods already gone


def test_waiting_states() -> None:
    assert observe(jobset(deleting=True)).reason == "The JobSet is being deleted."
    held = jobset({"conditions": [condition("Suspended")]}, suspend=True)
    assert (
        observe(held, queue="q").reason
        == "Waiting for quota: Kueue has not admitted the job yet (LocalQueue q)."
    )
    assert observe(held).reason == "The JobSet is suspended; it starts when it is resumed."
    assert observe(held).held and not observe(jobset(deleting=True)).held  # held: the job shows queued


def test_stuck_pods() -> None:
    crash = waiting("p-1", "CrashLoopBackOff", "back-off 5m0s restarting failed container")
    assert stuck_reason([crash], "v6e 4x4") == (
        "Pod p-1: its worker container keeps crashing (CrashLoopBackOff): back-off 5m0s restarting failed "
        "container. See the job's logs."
    )
    secret = waiting("p-0", "CreateContainerConfigError", 'secret "ft-x-token" not found')
    assert stuck_reason([secret], "v6e 4x4") == (
        "Pod p-0 cannot start its worker container (CreateContainerConfigError): "
        'secret "ft-x-token" not found.'
    )
    sidecar = waiting("p-2", "ErrImagePull", container="gke-gcsfuse-sidecar")
    assert stuck_reason([sidecar], "v6e 4x4") == (
        "Pod p-2 cannot pull the image img:1 of its gke-gcsfuse-sidecar container (ErrImagePull)."
    )
    gone = {**secret, "metadata": {"name": "p-0", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert stuck_reason([gone], "v6e 4x4") is None  # a pod on its way out is not the problem
    assert observe(jobset(), [crash]).state == "pending"


def test_pod_failures() -> None:
    assert pod_failure(pod("p", {"phase": "Running"})) is None
    assert pod_failure(failed("p", 1)) == "the worker in pod p exited with status 1"
    assert pod_failure(failed("p", 75, disruption="Preempted by a higher priority pod")) == (
        "pod p was stopped by the cluster (Preempted by a higher priority pod)"
    )
    assert pod_failure(pod("p", {"phase": "Failed", "reason": "Evicted"})) == "pod p failed (Evicted)"
