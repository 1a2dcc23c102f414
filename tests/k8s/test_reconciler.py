"""The dispatcher and the kubernetes executor, end to end: the real API (uvicorn, SQLite, the official
Kubernetes client) against the fake API server, with the test playing the JobSet controller and the worker."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
from sqlmodel import Session, col, select

from api import jobset as render
from api.db import make_engine
from api.models import Job, as_utc
from tests.conftest import LiveApi
from tests.k8s.cluster import NAMESPACE, Cluster
from tests.k8s.fake_apiserver import FakeKubernetes

FINAL = ("succeeded", "failed", "cancelled")


def submit(api: LiveApi, dataset_uri: str, **spec: Any) -> str:
    body = {
        "name": "stories",
        "model": "tiny",
        "dataset_uri": dataset_uri,
        "resources": {"accelerator": "v6e", "topology": "2x4"},
        "hyperparameters": {"batch_size": 8},
        **spec,
    }
    with api.client() as http:
        response = http.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def events(api: LiveApi, job_id: str, type_: str | None = None) -> list[dict[str, Any]]:
    with api.client() as http:
        params: dict[str, Any] = {"limit": 1000}
        if type_:
            params["type"] = type_
        return list(http.get(f"/jobs/{job_id}/events", params=params).json()["data"])


def statuses(api: LiveApi, job_id: str) -> list[str]:
    return [e["data"]["status"] for e in events(api, job_id, "status") if "status" in (e["data"] or {})]


def admitted_at(api: LiveApi, *job_ids: str) -> dict[str, datetime | None]:
    """When each job last took its chips (`Job.admitted_at`, which the API does not show)."""
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with Session(engine) as session:
            rows = session.exec(select(Job.id, Job.admitted_at).where(col(Job.id).in_(job_ids))).all()
    finally:
        engine.dispose()
    return {job_id: as_utc(at) for job_id, at in rows}


def running(api: LiveApi, cluster: Cluster, job_id: str) -> dict[str, Any]:
    """Pods up and the worker's first report in: the job is running."""
    api.wait_for(
        job_id, lambda j: j["status"] == "starting" and j["status_message"].startswith("Workers started")
    )
    cluster.start_pods(job_id)
    report = cluster.report(api.url, job_id, {"kind": "status", "phase": "training", "message": "Training."})
    assert report.status_code == 200, report.text
    return api.wait_for(job_id, lambda j: j["status"] == "running")


def test_submit_run_succeed(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    jobset = cluster.wait_jobset(job_id)
    assert jobset["metadata"]["labels"][render.LABEL_JOB_ID] == job_id
    job = running(api, cluster, job_id)
    assert job["output_uri"] == f"gs://outputs/tputune/{job_id}"
    owner = render.owner_reference(jobset)
    for plural, name in (
        ("secrets", render.secret_name(job_id)),
        ("configmaps", render.config_map_name(job_id)),
    ):
        obj = fake_k8s.get(plural, name, NAMESPACE)
        assert obj is not None and obj["metadata"]["ownerReferences"] == [owner]
    cluster.complete(job_id)
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "succeeded", job
    assert statuses(api, job_id) == ["queued", "starting", "running", "succeeded"]
    assert fake_k8s.count("create", "jobsets") == 1


def test_failure_carries_the_reason_and_the_log(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api()
    crashed, bad_input, reported = (submit(api, dataset_uri) for _ in range(3))
    for job_id in (crashed, bad_input, reported):
        running(api, cluster, job_id)
    process_zero = next(p for p in cluster.pods(crashed) if p["metadata"]["name"].endswith("-0-0-a0"))
    fake_k8s.append_log(process_zero["metadata"]["name"], NAMESPACE, "loading", "Traceback: boom")
    cluster.fail(crashed, exit_code=1, reason="FailedJobs", message="jobset failed due to job failure")
    job = api.wait_for(crashed, lambda j: j["status"] in FINAL)
    assert job["status"] == "failed" and job["error"]["code"] == "worker_failed"
    message = job["error"]["message"]
    assert "The JobSet failed (FailedJobs: jobset failed due to job failure)" in message
    assert f"the worker in pod {process_zero['metadata']['name']} exited with status 1" in message
    assert message.endswith("Last log lines: loading | Traceback: boom")

    cluster.fail(bad_input, exit_code=65, reason="FailedByFailurePolicy")
    job = api.wait_for(bad_input, lambda j: j["status"] in FINAL)
    assert job["error"]["code"] == "invalid_input"

    error = {
        "kind": "error",
        "step": 3,
        "code": "loss_not_finite",
        "message": "The loss became NaN at step 3.",
    }
    assert cluster.report(api.url, reported, error).status_code == 200
    cluster.complete(reported)  # a worker that reported an error and exited 0 still failed
    job = api.wait_for(reported, lambda j: j["status"] in FINAL)
    assert job["status"] == "failed" and job["error"]["code"] == "loss_not_finite"


def test_cancel_deletes_the_jobset(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    fake_k8s.hold_foreground = True  # the pods take their time to stop
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelling"
    deadline = time.monotonic() + 10
    while not fake_k8s.deletions:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert fake_k8s.deletions[0] == ("jobsets", render.jobset_name(job_id), "Foreground")
    time.sleep(0.5)
    assert api.wait_for(job_id, lambda j: True)["status"] == "cancelling"  # not before the pods are gone
    assert cluster.pods(job_id) == []  # dependents go first
    fake_k8s.finish_deletions()
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "cancelled"
    assert cluster.jobset(job_id) is None
    assert (
        fake_k8s.get("secrets", render.secret_name(job_id), NAMESPACE) is None
    )  # collected with their owner
    assert fake_k8s.get("configmaps", render.config_map_name(job_id), NAMESPACE) is None
    assert [d for d in fake_k8s.deletions if d[0] == "jobsets"] == [d for d in fake_k8s.deletions[:1]]


def test_restarts_are_counted_with_their_cause(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, dataset_uri: str
) -> None:
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    cluster.restart(job_id, exit_code=75, disruption="Node is being drained for maintenance")
    job = api.wait_for(job_id, lambda j: j["restarts"] == 1)
    assert job["status"] == "running"
    cluster.restart(job_id, exit_code=75)
    job = api.wait_for(job_id, lambda j: j["restarts"] == 2)
    restarts = events(api, job_id, "restart")
    assert [e["data"]["restarts"] for e in restarts] == [1, 2]
    assert "stopped by the cluster (Node is being drained for maintenance)" in restarts[0]["message"]
    assert "saved a checkpoint (exit status 75)" in restarts[1]["message"]
    cluster.complete(job_id)
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "succeeded" and job["restarts"] == 2


def test_a_crashed_workers_log_goes_in_its_restart_event(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    """A JobSet restarts by making all its pods anew, and the old ones' logs go with them: the end of a
    crashed worker's log, read as it crashed, goes in the restart's event. A preemption's has none."""
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    crashed = next(p for p in cluster.pods(job_id) if p["metadata"]["name"].endswith("-0-0-a0"))
    name = crashed["metadata"]["name"]
    lines = [f"step {n}" for n in range(1, 30)] + ["Traceback (most recent call last):", "KeyError: 'x'"]
    fake_k8s.append_log(name, NAMESPACE, *lines)
    reads = fake_k8s.count("get", "pods/log")
    cluster.fail_pod(job_id, exit_code=1)
    # The JobSet's restart, once the API read the crashed pod's log: a restart that deletes the pod first is
    # a race this best effort loses (the log is gone), not what this test is about.
    deadline = time.monotonic() + 30  # (10 s ran out once, on a machine busy with other tests)
    while fake_k8s.count("get", "pods/log") == reads:
        assert time.monotonic() < deadline, "the crashed pod's log was not read"
        time.sleep(0.02)
    time.sleep(0.5)
    cluster.recreate(job_id)
    job = api.wait_for(job_id, lambda j: j["restarts"] == 1)
    assert "Last log lines" not in job["status_message"]  # (the event has them)
    [restart] = events(api, job_id, "restart")
    assert restart["data"] == {"restarts": 1, "pod": name, "log_tail": lines[-20:]}
    assert restart["message"].endswith(
        f"Last log lines of pod {name}: step 27 | step 28 | step 29 | Traceback (most recent call last): | "
        "KeyError: 'x'"
    )
    cluster.restart(job_id, exit_code=75)  # (stopped, a checkpoint saved: not a crash)
    api.wait_for(job_id, lambda j: j["restarts"] == 2)
    assert events(api, job_id, "restart")[1]["data"] == {"restarts": 2}


def test_a_stuck_pod_says_why(k8s_api: Callable[..., LiveApi], cluster: Cluster, dataset_uri: str) -> None:
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    api.wait_for(
        job_id, lambda j: j["status"] == "starting" and j["status_message"].startswith("Workers started")
    )
    unschedulable = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient google.com/tpu.",
            }
        ],
    }
    pods = cluster.start_pods(job_id, unschedulable)
    job = api.wait_for(job_id, lambda j: "cannot be scheduled" in j["status_message"])
    assert job["status_message"] == (
        f"Pod {pods[0]['metadata']['name']} cannot be scheduled: 0/3 nodes are available: 3 Insufficient "
        "google.com/tpu. A node pool with v6e 2x4 TPUs must exist and have room (or be able to scale up)."
    )
    pulling = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [
            {
                "name": "worker",
                "image": "us-docker.pkg.dev/example/tputune/worker:0.1.0",
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}},
            }
        ],
    }
    cluster.set_pods(job_id, pulling)
    job = api.wait_for(job_id, lambda j: "ImagePullBackOff" in j["status_message"])
    assert "cannot pull the image us-docker.pkg.dev/example/tputune/worker:0.1.0" in job["status_message"]
    warnings = [e["message"] for e in events(api, job_id, "warning")]
    assert len(warnings) == 2 and "cannot be scheduled" in warnings[0] and "ImagePullBackOff" in warnings[1]
    cluster.set_pods(job_id, {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]})
    job = api.wait_for(
        job_id, lambda j: j["status_message"] == "Workers started; waiting for the first report."
    )
    assert job["status"] == "starting"


def test_kueue_holds_the_job_for_quota(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api(k8s_kueue_queue="tpu-queue", k8s_kueue_priority_class="batch-low")
    held, dropped = submit(api, dataset_uri), submit(api, dataset_uri)
    labels = cluster.wait_jobset(held)["metadata"]["labels"]
    assert labels[render.KUEUE_QUEUE] == "tpu-queue" and labels[render.KUEUE_PRIORITY] == "batch-low"
    waiting = "Waiting for quota: Kueue has not admitted the job yet (LocalQueue tpu-queue)."
    for job_id in (held, dropped):
        cluster.wait_jobset(job_id)
        cluster.suspend(job_id)
        # Held for quota, the job is queued again (with why), not "starting" for hours.
        job = api.wait_for(job_id, lambda j: j["status"] == "queued")
        assert job["status_message"] == waiting

    # Cancelling a held job deletes its JobSet: it exists even though the job is queued.
    with api.client() as http:
        assert http.post(f"/jobs/{dropped}/cancel").json()["status"] == "cancelling"
    assert api.wait_for(dropped, lambda j: j["status"] in FINAL)["status"] == "cancelled"
    assert cluster.jobset(dropped) is None
    assert statuses(api, dropped) == ["queued", "starting", "queued", "cancelling", "cancelled"]

    time.sleep(0.5)  # more passes of the dispatcher: a held job stays put, one warning only
    assert api.wait_for(held, lambda j: True)["status"] == "queued"
    assert [e["message"] for e in events(api, held, "warning")] == []
    # Held, it holds no chips: its usage stands still (the time from its launch until Kueue held it).
    first = api.wait_for(held, lambda j: True)["usage"]
    time.sleep(0.3)
    assert api.wait_for(held, lambda j: True)["usage"] == first
    assert first["chips"] == 8 and first["chip_unit"] == "TPU chips" and first["held_seconds"] < 5
    cluster.admit(held)
    running(api, cluster, held)
    # Running, it holds its chips: its usage grows with the clock (also where nothing else changed).
    before = api.wait_for(held, lambda j: True)["usage"]
    time.sleep(0.5)
    after = api.wait_for(held, lambda j: True)["usage"]
    assert after["held_seconds"] >= before["held_seconds"] + 0.3  # (each at most 0.1 s old)
    assert after["chip_hours"] > before["chip_hours"]

    # Kueue preempts the running workload for a higher-priority one: back to queued, then resumed.
    cluster.suspend(held)
    job = api.wait_for(held, lambda j: j["status"] == "queued")
    assert job["status_message"] == waiting and job["preemptions"] == 1
    cluster.admit(held)
    api.wait_for(held, lambda j: j["status"] == "starting")
    resumed = {"kind": "status", "phase": "training", "message": "Training."}  # stored already
    assert cluster.report(api.url, held, resumed).status_code == 200
    api.wait_for(held, lambda j: j["status"] == "running")
    cluster.complete(held)
    assert api.wait_for(held, lambda j: j["status"] in FINAL)["status"] == "succeeded"
    assert statuses(api, held) == [
        "queued",
        "starting",
        "queued",
        "starting",
        "running",
        "queued",
        "starting",
        "running",
        "succeeded",
    ]
    assert fake_k8s.count("create", "jobsets") == 2  # one each, never relaunched
    # Preempted once while running; held for quota before it ran is not a preemption (the usage report
    # reads a preempted job's time from its moves).
    assert api.wait_for(held, lambda j: True)["preemptions"] == 1
    assert api.wait_for(dropped, lambda j: True)["preemptions"] == 0
    # It took its chips when Kueue last admitted it (the usage report counts from then); the job held until
    # it was cancelled never took them.
    moves = [e for e in events(api, held, "status") if "status" in (e["data"] or {})]
    at = {e["data"]["status"]: datetime.fromisoformat(e["created_at"]) for e in moves}  # (each one's last)
    admitted = admitted_at(api, held, dropped)
    assert admitted[dropped] is None
    assert at["queued"] < admitted[held] <= at["starting"], (admitted, moves)

    # What each held: from each launch or admission until it let its chips go (held, preempted, ended).
    def held_seconds(job_id: str) -> float:
        spans, took, launched = [], None, False
        for event in events(api, job_id):
            at, data = datetime.fromisoformat(event["created_at"]), event["data"] or {}
            status = data.get("status") if event["type"] == "status" else None
            launched |= event["type"] == "launch"
            admission = launched and status == "starting" and data.get("from") == "queued"
            if event["type"] == "launch" or admission:
                took = at
            elif status in ("queued", *FINAL) and took is not None:
                spans.append((at - took).total_seconds())
                took = None
        return sum(spans)

    for job_id in (held, dropped):
        usage = api.wait_for(job_id, lambda j: True)["usage"]
        assert usage["held_seconds"] == pytest.approx(held_seconds(job_id), abs=0.1), job_id
        assert usage["chip_hours"] == pytest.approx(8 * usage["held_seconds"] / 3600, abs=1e-4)
    assert held_seconds(held) > 0.3  # (launch → held, admitted → preempted: 0.3 s running, admitted → end)


def test_an_api_restart_adopts_the_running_jobset(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    api.restart()
    cluster.restart(job_id)  # seen by the new process's watch
    api.wait_for(job_id, lambda j: j["restarts"] == 1)
    cluster.complete(job_id)
    assert api.wait_for(job_id, lambda j: j["status"] in FINAL)["status"] == "succeeded"
    assert fake_k8s.count("create", "jobsets") == 1


def test_a_launch_cut_short_is_adopted_not_repeated(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    """The API died after creating the JobSet and before recording it: the next one adopts it."""
    from sqlmodel import Session, select

    from api.db import make_engine
    from api.executors.kubernetes import KubernetesExecutor
    from api.jobs import new_job_token
    from api.models import Job

    first = k8s_api(dispatcher_enabled=False)
    job_id = submit(first, dataset_uri)
    first.stop()
    token, token_hash = new_job_token()
    engine = make_engine(first.settings.resolved_database_url)
    with Session(engine) as session:
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        job.token_hash = token_hash
        session.add(job)
        session.commit()
        executor = KubernetesExecutor(first.settings)
        executor.launch(job, token)
        executor.close()
    # the next API finds the JobSet, its Secret holding the token the database knows
    api = k8s_api()
    api.wait_for(
        job_id, lambda j: j["status"] == "starting" and j["status_message"].startswith("Workers started")
    )
    launches = events(api, job_id, "launch")
    assert [e["message"] for e in launches] == ["Found the job's workers already running; adopted them."]
    assert cluster.token(job_id) == token
    running(api, cluster, job_id)
    assert fake_k8s.count("create", "jobsets") == 1


def test_an_expired_watch_relists(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    deadline = time.monotonic() + 10
    while not (fake_k8s.count("watch", "jobsets") and fake_k8s.count("watch", "pods")):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    lists = fake_k8s.count("list", "jobsets")
    # An object the watches do not see moves the server on; then their resourceVersions are compacted away.
    fake_k8s.put("configmaps", {"metadata": {"name": "unrelated", "namespace": NAMESPACE}})
    fake_k8s.compact()
    fake_k8s.drop_watches()
    cluster.complete(job_id)  # seen only by relisting
    assert api.wait_for(job_id, lambda j: j["status"] in FINAL)["status"] == "succeeded"
    assert fake_k8s.expired >= 1
    # The job can finish through the pods watch first; a dropped jobsets watch relists after its back-off.
    deadline = time.monotonic() + 10
    while fake_k8s.count("list", "jobsets") <= lists and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake_k8s.count("list", "jobsets") > lists


def test_api_server_errors_and_outages_are_retried(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api(k8s_leader_election=False)  # one replica: it keeps dispatching while the server is away
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    fake_k8s.fail_next(3, code=503)  # within one call's retries
    second = submit(api, dataset_uri)
    cluster.wait_jobset(second)
    fake_k8s.stop()  # refused connections, for longer than the retries last
    third = submit(api, dataset_uri)
    job = api.wait_for(third, lambda j: j["status_message"].startswith("The Kubernetes API server did not"))
    assert job["status"] == "starting" and job["status_message"].endswith("Connection refused; retrying.")
    assert cluster.jobset(third) is None
    fake_k8s.start()
    running(api, cluster, third)
    cluster.complete(job_id)
    assert api.wait_for(job_id, lambda j: j["status"] in FINAL)["status"] == "succeeded"
    assert fake_k8s.count("create", "jobsets") >= 3
    assert len(fake_k8s.select("jobsets", NAMESPACE)) == 3


def test_a_refused_jobset_fails_the_job(
    k8s_api: Callable[..., LiveApi], fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    from tests.k8s.fake_apiserver import ApiError

    fake_k8s.refuse_create["jobsets"] = ApiError(
        422,
        "Invalid",
        'JobSet.jobset.x-k8s.io "x" is invalid: spec.replicatedJobs[0].replicas: Invalid value',
    )
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "failed" and job["error"]["code"] == "launch_failed"
    assert "the Kubernetes API refused the JobSet (422)" in job["error"]["message"]
    assert "spec.replicatedJobs[0].replicas: Invalid value" in job["error"]["message"]
    assert_cleaned_up(fake_k8s, job_id)  # no JobSet owns its Secret and ConfigMap: deleted


def assert_cleaned_up(fake_k8s: FakeKubernetes, job_id: str) -> None:
    deadline = time.monotonic() + 10
    for plural, name in (
        ("secrets", render.secret_name(job_id)),  # the worker token
        ("configmaps", render.config_map_name(job_id)),
    ):
        while fake_k8s.get(plural, name, NAMESPACE) is not None:
            assert time.monotonic() < deadline, f"the job's {plural} {name} was left behind"
            time.sleep(0.05)


def test_cancel_while_the_jobset_cannot_be_created_leaves_nothing(
    k8s_api: Callable[..., LiveApi], fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    from tests.k8s.fake_apiserver import ApiError

    fake_k8s.refuse_create["jobsets"] = ApiError(503, "ServiceUnavailable", "the JobSet webhook is down")
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    job = api.wait_for(job_id, lambda j: "did not answer" in (j["status_message"] or ""))
    assert job["status"] == "starting"
    assert fake_k8s.get("secrets", render.secret_name(job_id), NAMESPACE) is not None
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelling"
    assert api.wait_for(job_id, lambda j: j["status"] in FINAL)["status"] == "cancelled"
    assert_cleaned_up(fake_k8s, job_id)
    assert fake_k8s.count("create", "jobsets") >= 1 and fake_k8s.select("jobsets", NAMESPACE) == []


def test_a_teams_chip_limit_counts_tpu_chips(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    """A team's own chip limit on Kubernetes counts each job's TPU chips: what does not fit waits with no
    JobSet, what never could is refused, and the next job launches when a running one ends."""
    api = k8s_api()
    with api.client() as http:
        set_limit = http.patch("/admin/tenants/default", json={"max_active_chips": 8})
        assert set_limit.json()["limits"]["max_active_chips"] == 8
        big = {
            "name": "big",
            "model": "tiny",
            "dataset_uri": dataset_uri,
            "hyperparameters": {"batch_size": 16},
        }
        refused = http.post("/jobs", json={**big, "resources": {"accelerator": "v6e", "topology": "4x4"}})
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["code"] == "over_tenant_chip_limit"
        assert (
            "needs 16 TPU chips, more than your team may use at once (8)"
            in refused.json()["error"]["message"]
        )
    first = submit(api, dataset_uri)  # 2x4: 8 chips
    second = submit(api, dataset_uri, resources={"accelerator": "v6e", "topology": "2x2"})
    running(api, cluster, first)
    waiting = api.wait_for(second, lambda j: "TPU chips" in (j["status_message"] or ""))
    assert waiting["status"] == "queued"
    assert (
        waiting["status_message"]
        == "Waiting: your team's running jobs hold 8 of its 8 TPU chips; this job needs 4."
    )
    assert cluster.jobset(second) is None
    with api.client() as http:
        mine = http.get("/tenant").json()
    used = mine["usage"]
    assert mine["chip_unit"] == "TPU chips" and (used["active_jobs"], used["queued_jobs"]) == (1, 1)
    # (8 chips since its launch, seconds ago: this month's chip-hours, under 0.1)
    assert used["chips"] == 8 and 0 <= used["chip_hours_this_month"] < 0.1
    cluster.complete(first)
    assert api.wait_for(first, lambda j: j["status"] in FINAL)["status"] == "succeeded"
    cluster.wait_jobset(second)
    assert fake_k8s.count("create", "jobsets") == 2
