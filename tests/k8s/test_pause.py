"""Pausing and resuming a job on Kubernetes, end to end (as test_reconciler.py): the real API against the
fake API server, with the test playing the JobSet controller, Kueue and the worker. A pause deletes the
job's JobSet and lets its chips go; a resume launches a new JobSet of the same name."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
import pytest

from api import jobset as render
from tests.conftest import LiveApi
from tests.k8s.cluster import NAMESPACE, Cluster
from tests.k8s.fake_apiserver import FakeKubernetes
from tests.k8s.test_reconciler import FINAL, admitted_at, assert_cleaned_up, events, running, statuses, submit


def job(api: LiveApi, job_id: str) -> dict[str, Any]:
    return api.wait_for(job_id, lambda j: True)


def post(api: LiveApi, job_id: str, action: str) -> httpx.Response:
    with api.client() as http:
        return http.post(f"/jobs/{job_id}/{action}")


def wait_deleted(fake_k8s: FakeKubernetes, job_id: str) -> None:
    """Until the API asked for the job's JobSet to be deleted."""
    deadline = time.monotonic() + 10
    while ("jobsets", render.jobset_name(job_id), "Foreground") not in fake_k8s.deletions:
        assert time.monotonic() < deadline, fake_k8s.deletions
        time.sleep(0.02)


def held_seconds(api: LiveApi, job_id: str) -> float:
    """What the job held by its events: from each launch (or Kueue's admission of a run it held) until it
    let its chips go (held for quota, paused, ended)."""
    spans, took, launched = [], None, False
    for event in events(api, job_id):
        at, data = datetime.fromisoformat(event["created_at"]), event["data"] or {}
        status = data.get("status") if event["type"] == "status" else None
        if event["type"] == "launch":
            launched, took = True, at
        elif launched and status == "starting" and data.get("from") == "queued":
            took = at  # (admitted by Kueue; a resumed job's claim is followed by its launch, which counts)
        elif status in ("queued", "paused", *FINAL) and took is not None:
            spans.append((at - took).total_seconds())
            took = None
        if status == "paused":
            launched = False  # (its run is gone: the next one is launched anew)
    return sum(spans)


def test_pause_deletes_the_jobset_and_resume_launches_a_new_one(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    first = cluster.wait_jobset(job_id)
    running(api, cluster, job_id)
    first_token = cluster.token(job_id)

    fake_k8s.hold_foreground = True  # the workers take their time to save a checkpoint and stop
    answer = post(api, job_id, "pause")
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "pausing" and answer.json()["pauses"] == 0
    wait_deleted(fake_k8s, job_id)
    assert cluster.pods(job_id) == []  # (dependents go first)
    # Pausing, not paused, until the JobSet is gone; meanwhile it still holds its chips.
    before = job(api, job_id)["usage"]
    time.sleep(0.5)
    pausing = job(api, job_id)
    assert pausing["status"] == "pausing" and pausing["pauses"] == 0
    assert pausing["usage"]["held_seconds"] >= before["held_seconds"] + 0.3
    assert cluster.jobset(job_id) is not None

    fake_k8s.finish_deletions()
    paused = api.wait_for(job_id, lambda j: j["status"] != "pausing")
    assert paused["status"] == "paused" and paused["pauses"] == 1, paused
    assert cluster.jobset(job_id) is None
    assert_cleaned_up(fake_k8s, job_id)  # its Secret and ConfigMap, collected with the JobSet
    assert admitted_at(api, job_id)[job_id] is None
    # Paused, it holds nothing: its usage stands still, and nothing launches it again.
    time.sleep(0.5)
    still = job(api, job_id)
    assert still["status"] == "paused" and still["usage"] == paused["usage"]
    assert paused["usage"]["held_seconds"] == pytest.approx(held_seconds(api, job_id), abs=0.1)
    assert fake_k8s.count("create", "jobsets") == 1 and cluster.jobset(job_id) is None
    again = post(api, job_id, "pause")  # (a paused job: nothing changes)
    assert again.status_code == 200 and again.json()["status"] == "paused" and again.json()["pauses"] == 1
    with api.client() as http:
        tenant = http.get("/tenant").json()["usage"]
    assert tenant["active_jobs"] == 0 and tenant["chips"] == 0

    resumed = post(api, job_id, "resume")
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["status"] == "queued" and resumed.json()["pauses"] == 1
    second = cluster.wait_jobset(job_id)  # a new JobSet of the same name
    assert second["metadata"]["name"] == first["metadata"]["name"] == render.jobset_name(job_id)
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    running(api, cluster, job_id)
    # A new token for the new run: the old run's workers can no longer report.
    assert cluster.token(job_id) != first_token
    stale = httpx.post(
        f"{api.url}/jobs/{job_id}/progress",
        json={"reports": [{"kind": "status", "phase": "training", "message": "Training."}]},
        headers={"Authorization": f"Bearer {first_token}"},
    )
    assert stale.status_code == 401, stale.text
    # Running again, it holds its chips again: its usage grows from where the pause left it.
    before = job(api, job_id)["usage"]
    assert before["held_seconds"] >= paused["usage"]["held_seconds"]
    time.sleep(0.5)
    assert job(api, job_id)["usage"]["held_seconds"] >= before["held_seconds"] + 0.3

    cluster.complete(job_id)
    done = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert done["status"] == "succeeded" and done["pauses"] == 1 and done["preemptions"] == 0
    assert statuses(api, job_id) == [
        "queued",
        "starting",
        "running",
        "pausing",
        "paused",
        "queued",
        "starting",
        "running",
        "succeeded",
    ]
    assert fake_k8s.count("create", "jobsets") == 2
    # What it held: its two runs, not the time it was paused.
    assert done["usage"]["held_seconds"] == pytest.approx(held_seconds(api, job_id), abs=0.1)
    assert done["usage"]["chip_hours"] == pytest.approx(8 * done["usage"]["held_seconds"] / 3600, abs=1e-4)


def test_a_failed_job_resumed_runs_a_new_jobset_once_the_failed_one_is_deleted(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    """A failed JobSet is left for its pods' logs; resumed, the job waits queued until it is deleted (a
    new JobSet of the same name could not be made, and the old one would be adopted: failed again), then
    a new one runs and goes on from the checkpoint in GCS. What the job held: both runs."""
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    first = cluster.wait_jobset(job_id)
    running(api, cluster, job_id)
    checkpoint = {"kind": "checkpoint", "step": 2, "uri": "gs://tputune-test-out/ckpt/2"}
    assert cluster.report(api.url, job_id, checkpoint).status_code == 200
    cluster.fail(job_id, exit_code=1)
    failed = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert failed["status"] == "failed" and failed["error"]["code"] == "worker_failed", failed
    assert cluster.jobset(job_id) is not None  # (kept: its pods' logs tell why)

    fake_k8s.hold_foreground = True
    resumed = post(api, job_id, "resume")
    assert resumed.status_code == 200 and resumed.json()["status"] == "queued", resumed.text
    wait_deleted(fake_k8s, job_id)
    time.sleep(0.5)  # (passes go by: it waits for the old one to go)
    assert job(api, job_id)["status"] == "queued" and fake_k8s.count("create", "jobsets") == 1
    fake_k8s.finish_deletions()
    second = cluster.wait_jobset(job_id)
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    running(api, cluster, job_id)
    cluster.complete(job_id)
    done = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert done["status"] == "succeeded" and done["error"] is None and done["retries"] == 1, done
    assert done["checkpoint_uri"] == checkpoint["uri"]  # (its last, until the new run reports one)
    assert statuses(api, job_id)[2:] == ["running", "failed", "queued", "starting", "running", "succeeded"]
    assert fake_k8s.count("create", "jobsets") == 2
    assert done["usage"]["held_seconds"] == pytest.approx(held_seconds(api, job_id), abs=0.1)


def test_a_paused_job_is_cancelled_at_once(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    assert post(api, job_id, "pause").json()["status"] == "pausing"
    paused = api.wait_for(job_id, lambda j: j["status"] != "pausing")
    assert paused["status"] == "paused" and cluster.jobset(job_id) is None

    cancelled = post(api, job_id, "cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled"  # at once: nothing runs to stop
    time.sleep(0.5)  # more passes of the dispatcher: nothing is launched or deleted
    done = job(api, job_id)
    assert done["status"] == "cancelled" and done["pauses"] == 1
    assert done["usage"] == paused["usage"]
    assert cluster.jobset(job_id) is None and cluster.pods(job_id) == []
    assert fake_k8s.count("create", "jobsets") == 1
    assert [d for d in fake_k8s.deletions if d[0] == "jobsets"] == [
        ("jobsets", render.jobset_name(job_id), "Foreground")
    ]
    assert statuses(api, job_id) == ["queued", "starting", "running", "pausing", "paused", "cancelled"]
    # Neither resumed nor paused once it ended.
    for action, code in (("resume", "job_not_paused"), ("pause", "job_not_pausable")):
        refused = post(api, job_id, action)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == code, refused.text


def test_a_job_held_by_kueue_is_paused(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    """Queued but launched (its JobSet suspended by Kueue): the pause deletes the JobSet it has."""
    api = k8s_api(k8s_kueue_queue="tpu-queue", k8s_kueue_priority_class="batch-low")
    job_id = submit(api, dataset_uri)
    cluster.wait_jobset(job_id)
    cluster.suspend(job_id)
    held = api.wait_for(job_id, lambda j: j["status"] == "queued")
    assert held["status_message"].startswith("Waiting for quota")

    answer = post(api, job_id, "pause")
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "pausing"  # (it has a JobSet to delete)
    paused = api.wait_for(job_id, lambda j: j["status"] != "pausing")
    assert paused["status"] == "paused" and paused["pauses"] == 1, paused
    wait_deleted(fake_k8s, job_id)
    assert cluster.jobset(job_id) is None
    assert_cleaned_up(fake_k8s, job_id)
    assert statuses(api, job_id) == ["queued", "starting", "queued", "pausing", "paused"]
    # Held, it held no chips; paused, it holds none: its usage is what it held from its launch until Kueue
    # held it.
    assert paused["usage"]["held_seconds"] == pytest.approx(held["usage"]["held_seconds"], abs=1e-3)
    assert paused["usage"]["held_seconds"] == pytest.approx(held_seconds(api, job_id), abs=0.1)
    time.sleep(0.3)
    assert job(api, job_id)["usage"] == paused["usage"]
    assert fake_k8s.count("create", "jobsets") == 1

    assert post(api, job_id, "resume").json()["status"] == "queued"
    labels = cluster.wait_jobset(job_id)["metadata"]["labels"]
    assert labels[render.KUEUE_QUEUE] == "tpu-queue"
    running(api, cluster, job_id)
    cluster.complete(job_id)
    done = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert done["status"] == "succeeded" and done["pauses"] == 1
    assert fake_k8s.count("create", "jobsets") == 2
    assert done["usage"]["held_seconds"] == pytest.approx(held_seconds(api, job_id), abs=0.1)
    assert fake_k8s.get("secrets", render.secret_name(job_id), NAMESPACE) is not None  # (the new run's)


def test_a_run_held_by_kueue_of_a_team_past_its_budget_is_deleted_and_waits_in_the_queue(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    """Queued jobs wait for their team's monthly budget, also one whose JobSet Kueue holds (it would admit
    it): its JobSet is deleted, as a pause deletes it, and the job waits in the queue saying why; with a
    budget again it is launched anew. A running job goes on (no TPUTUNE_TENANT_BUDGET_PAUSES_RUNNING)."""
    api = k8s_api(k8s_kueue_queue="tpu-queue")
    held_id, running_id = submit(api, dataset_uri), submit(api, dataset_uri)
    running(api, cluster, running_id)
    cluster.wait_jobset(held_id)
    cluster.suspend(held_id)
    assert api.wait_for(held_id, lambda j: j["status"] == "queued")["status_message"].startswith(
        "Waiting for"
    )
    with api.client() as http:
        assert http.patch("/admin/tenants/default", json={"max_chip_hours_per_month": 0}).status_code == 200
    waiting = api.wait_for(held_id, lambda j: j["status"] == "queued" and j["pauses"] == 1)
    assert waiting["status_message"] == (
        "Waiting: your team may use no chip-hours now (budget 0); ask your admin to raise it."
    )
    wait_deleted(fake_k8s, held_id)
    assert cluster.jobset(held_id) is None
    assert statuses(api, held_id) == ["queued", "starting", "queued", "pausing", "paused", "queued"]
    pausing = [e for e in events(api, held_id, "status") if (e["data"] or {}).get("status") == "pausing"]
    assert pausing[0]["data"]["for"] == "budget"
    assert job(api, running_id)["status"] == "running"
    assert cluster.jobset(running_id) is not None
    time.sleep(0.3)
    assert fake_k8s.count("create", "jobsets") == 2  # (not launched again while it waits)

    with api.client() as http:
        assert (
            http.patch("/admin/tenants/default", json={"max_chip_hours_per_month": None}).status_code == 200
        )
    cluster.wait_jobset(held_id)
    running(api, cluster, held_id)
    assert fake_k8s.count("create", "jobsets") == 3
    for job_id in (held_id, running_id):
        cluster.complete(job_id)
        assert api.wait_for(job_id, lambda j: j["status"] in FINAL)["status"] == "succeeded"


def test_a_running_job_past_its_budget_is_stopped_and_its_owners_pause_then_keeps_it_paused(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    """TPUTUNE_TENANT_BUDGET_PAUSES_RUNNING on Kubernetes: a running job of a team past its budget has its
    JobSet deleted, as a pause does. Its owner pausing it meanwhile keeps it paused once its workers
    stopped, where it would have waited in the queue to go on."""
    api = k8s_api(tenant_budget_pauses_running=True)
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    fake_k8s.hold_foreground = True  # the workers take their time to save a checkpoint and stop
    with api.client() as http:
        assert http.patch("/admin/tenants/default", json={"max_chip_hours_per_month": 0}).status_code == 200
    pausing = api.wait_for(job_id, lambda j: j["status"] == "pausing")
    assert pausing["status_message"].startswith("Pausing: your team may use no chip-hours now (budget 0);")
    wait_deleted(fake_k8s, job_id)
    answer = post(api, job_id, "pause")
    assert answer.status_code == 200 and answer.json()["status"] == "pausing", answer.text
    post(api, job_id, "pause")  # (asked again: said once)
    fake_k8s.finish_deletions()
    paused = api.wait_for(job_id, lambda j: j["status"] != "pausing")
    assert paused["status"] == "paused" and paused["pauses"] == 1, paused
    assert paused["status_message"].startswith("Paused: the workers stopped")
    time.sleep(0.3)
    assert job(api, job_id)["status"] == "paused"
    assert statuses(api, job_id) == ["queued", "starting", "running", "pausing", "paused"]
    said = [(e["message"], e["data"]) for e in events(api, job_id, "status") if "for" in e["data"]]
    assert said == [
        (
            "running → pausing: Pausing: your team may use no chip-hours now (budget 0); the workers save a "
            "checkpoint and stop, and the job waits in the queue to go on from it.",
            {"status": "pausing", "from": "running", "for": "budget"},
        ),
        (
            "Pause requested; once its workers stop, the job stays paused until resumed.",
            {"for": "owner"},
        ),
    ]
    assert fake_k8s.count("create", "jobsets") == 1
    # Resumed: it waits for the budget, as any queued job of its team.
    assert post(api, job_id, "resume").json()["status"] == "queued"
    waiting = api.wait_for(job_id, lambda j: "budget 0" in (j["status_message"] or ""))
    assert waiting["status"] == "queued" and cluster.jobset(job_id) is None
    assert waiting["status_message"].startswith("Waiting: ")


def test_a_stalled_run_is_deleted_and_the_job_launched_anew(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    """TPUTUNE_STALL_MINUTES on Kubernetes: pods running but no report for that long: the JobSet is
    deleted (its pods get SIGTERM and save a checkpoint), and the job is launched anew, a new JobSet of the
    same name that goes on from the checkpoint in GCS. While it reports it is left alone, and a run the
    JobSet restarted is timed from its restart."""
    api = k8s_api(stall_minutes=0.1)  # (6 s)
    job_id = submit(api, dataset_uri)
    first = cluster.wait_jobset(job_id)
    running(api, cluster, job_id)
    for step in range(1, 9):  # reporting: not stalled, however long it runs
        time.sleep(1)
        metrics = {"kind": "metrics", "step": step, "loss": 2.0}
        assert cluster.report(api.url, job_id, metrics).status_code == 200
    last_report = time.monotonic()
    assert job(api, job_id)["status"] == "running" and fake_k8s.count("create", "jobsets") == 1
    time.sleep(2)
    cluster.restart(job_id)  # (a pod failed: the JobSet recreates them; the new run reports later)
    api.wait_for(job_id, lambda j: j["restarts"] == 1)
    time.sleep(max(0.0, last_report + 7 - time.monotonic()))  # (silent for 7 s, but restarted since)
    assert job(api, job_id)["status"] == "running"
    assert fake_k8s.count("create", "jobsets") == 1 and cluster.jobset(job_id) is not None
    # Its new run reports nothing either: stalled.
    wait_deleted(fake_k8s, job_id)
    queued = api.wait_for(job_id, lambda j: j["status"] not in ("running", "pausing", "paused"))
    assert queued["status_message"].startswith("Queued again after its workers stalled (restart 1 of 2)")
    second = cluster.wait_jobset(job_id)
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    running(api, cluster, job_id)
    cluster.complete(job_id)
    done = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert done["status"] == "succeeded" and done["pauses"] == 1
    assert statuses(api, job_id)[2:] == [
        "running",
        "pausing",
        "paused",
        "queued",
        "starting",
        "running",
        "succeeded",
    ]
    assert fake_k8s.count("create", "jobsets") == 2


def test_restarts_after_a_resume_are_counted(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, dataset_uri: str
) -> None:
    """The new JobSet counts its restarts from 0; the job's count goes on from what its first run had."""
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    cluster.restart(job_id, exit_code=75)
    assert api.wait_for(job_id, lambda j: j["restarts"] == 1)["status"] == "running"
    post(api, job_id, "pause")
    assert api.wait_for(job_id, lambda j: j["status"] != "pausing")["status"] == "paused"
    post(api, job_id, "resume")
    cluster.wait_jobset(job_id)
    running(api, cluster, job_id)
    cluster.restart(job_id, exit_code=75, disruption="Node is being drained for maintenance")
    job = api.wait_for(job_id, lambda j: j["restarts"] == 2, timeout=10)
    assert job["status"] == "running"
    restarts = events(api, job_id, "restart")
    assert [e["data"]["restarts"] for e in restarts] == [1, 2]
    assert "Node is being drained for maintenance" in restarts[1]["message"]
