"""The rest of a cluster, played by tests on the fake API server: the JobSet and Job controllers, the
scheduler, the kubelet, Kueue, and the worker's reports to the API."""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx

from api import jobset as render
from tests.k8s.fake_apiserver import FakeKubernetes, now

NAMESPACE = "tputune"


def _running_status() -> dict[str, Any]:
    return {
        "phase": "Running",
        "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
        "containerStatuses": [
            {"name": render.WORKER_CONTAINER, "ready": True, "state": {"running": {"startedAt": now()}}}
        ],
    }


def _terminated(exit_code: int) -> dict[str, Any]:
    return {
        "name": render.WORKER_CONTAINER,
        "ready": False,
        "state": {"terminated": {"exitCode": exit_code, "reason": "Error" if exit_code else "Completed"}},
    }


class Cluster:
    def __init__(self, fake: FakeKubernetes, namespace: str = NAMESPACE) -> None:
        self.fake = fake
        self.namespace = namespace

    # --- reading ---

    def jobset(self, job_id: str) -> dict[str, Any] | None:
        return self.fake.get("jobsets", render.jobset_name(job_id), self.namespace)

    def wait_jobset(self, job_id: str, timeout: float = 60) -> dict[str, Any]:
        # (60 s, as LiveApi.wait_for: a first launch waits for the dispatcher process's start, which took
        # longer than the 15 s this waited before, once, in CI on a busy machine.)
        deadline = time.monotonic() + timeout
        while (found := self.jobset(job_id)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"no JobSet for {job_id}")
            time.sleep(0.02)
        return found

    def pods(self, job_id: str) -> list[dict[str, Any]]:
        return self.fake.select("pods", self.namespace, f"{render.LABEL_JOB_ID}={job_id}")

    def token(self, job_id: str) -> str:
        secret = self.fake.get("secrets", render.secret_name(job_id), self.namespace)
        assert secret is not None
        return base64.b64decode(secret["data"][render.TOKEN_KEY]).decode()

    # --- the JobSet controller, scheduler and kubelet ---

    def start_pods(self, job_id: str, status: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Create the pods of the JobSet's current attempt (one per VM of every slice) with `status`."""
        jobset = self.wait_jobset(job_id)
        replicated = jobset["spec"]["replicatedJobs"][0]
        template = replicated["template"]["spec"]["template"]
        attempt = str((jobset.get("status") or {}).get("restarts") or 0)
        owner = render.owner_reference(jobset)
        pods = []
        for slice_index in range(replicated["replicas"]):
            for host in range(replicated["template"]["spec"]["parallelism"]):
                name = f"{jobset['metadata']['name']}-{replicated['name']}-{slice_index}-{host}-a{attempt}"
                labels = {
                    **template["metadata"]["labels"],
                    render.LABEL_JOB_INDEX: str(slice_index),
                    render.LABEL_COMPLETION_INDEX: str(host),
                    render.LABEL_RESTART_ATTEMPT: attempt,
                }
                pod = {
                    "metadata": {
                        "name": name,
                        "namespace": self.namespace,
                        "labels": labels,
                        "ownerReferences": [owner],
                    },
                    "spec": template["spec"],
                    "status": status or _running_status(),
                }
                pods.append(self.fake.put("pods", pod))
        return pods

    def set_pods(self, job_id: str, status: dict[str, Any]) -> None:
        for pod in self.pods(job_id):
            self.fake.mutate(
                "pods", pod["metadata"]["name"], self.namespace, lambda p: p.update(status=status)
            )

    def _jobset_status(self, job_id: str, **changes: Any) -> None:
        def change(obj: dict[str, Any]) -> None:
            obj["status"] = {**(obj.get("status") or {}), **changes}

        self.fake.mutate("jobsets", render.jobset_name(job_id), self.namespace, change)

    def _condition(self, kind: str, reason: str, message: str) -> dict[str, Any]:
        return {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": now(),
        }

    def complete(self, job_id: str) -> None:
        self.set_pods(job_id, {"phase": "Succeeded", "containerStatuses": [_terminated(0)]})
        self._jobset_status(
            job_id,
            conditions=[self._condition("Completed", "AllJobsCompleted", "jobset completed successfully")],
            terminalState="Completed",
        )

    def fail_pod(self, job_id: str, exit_code: int, disruption: str | None = None) -> str:
        """Process 0's pod fails with the worker's `exit_code` (evicted with `disruption`, if given)."""
        pod = next(
            p for p in self.pods(job_id) if p["metadata"]["labels"][render.LABEL_COMPLETION_INDEX] == "0"
        )
        conditions = []
        if disruption:
            conditions.append(
                {
                    "type": render.DISRUPTION_TARGET,
                    "status": "True",
                    "reason": "TerminationByKubelet",
                    "message": disruption,
                }
            )
        status = {"phase": "Failed", "conditions": conditions, "containerStatuses": [_terminated(exit_code)]}
        self.fake.mutate("pods", pod["metadata"]["name"], self.namespace, lambda p: p.update(status=status))
        return str(pod["metadata"]["name"])

    def restart(self, job_id: str, exit_code: int = 75, disruption: str | None = None) -> None:
        """A pod fails; the JobSet recreates every pod (BlockingRecreate) and counts a restart."""
        self.fail_pod(job_id, exit_code, disruption)
        time.sleep(0.5)  # the Job controller, then the JobSet controller, react to it: never at once
        self.recreate(job_id)

    def recreate(self, job_id: str) -> None:
        """The JobSet's restart after a pod failed: every pod made anew, a restart counted."""
        for pod in self.pods(job_id):
            self.fake.remove("pods", pod["metadata"]["name"], self.namespace)
        restarts = ((self.jobset(job_id) or {}).get("status") or {}).get("restarts") or 0
        self._jobset_status(job_id, restarts=restarts + 1)
        self.start_pods(job_id)

    def fail(self, job_id: str, exit_code: int, reason: str = "FailedJobs", message: str = "") -> None:
        self.fail_pod(job_id, exit_code)
        self._jobset_status(
            job_id,
            conditions=[self._condition("Failed", reason, message or "jobset failed due to a failed job")],
            terminalState="Failed",
        )

    def suspend(self, job_id: str) -> None:
        """Kueue holds the JobSet: suspended until quota allows."""

        def hold(obj: dict[str, Any]) -> None:
            obj["spec"]["suspend"] = True
            obj["status"] = {
                "conditions": [self._condition("Suspended", "SuspendedByKueue", "jobset is suspended")]
            }

        self.fake.mutate("jobsets", render.jobset_name(job_id), self.namespace, hold)

    def admit(self, job_id: str) -> None:
        def release(obj: dict[str, Any]) -> None:
            obj["spec"]["suspend"] = False
            obj["status"] = {"conditions": []}

        self.fake.mutate("jobsets", render.jobset_name(job_id), self.namespace, release)

    # --- the worker ---

    def report(self, api_url: str, job_id: str, *reports: dict[str, Any]) -> httpx.Response:
        """Post worker reports with the job token the pods get from their Secret."""
        headers = {"Authorization": f"Bearer {self.token(job_id)}"}
        return httpx.post(
            f"{api_url}/jobs/{job_id}/progress", json={"reports": list(reports)}, headers=headers
        )
