"""GET /jobs/{id}/logs reads JAX process 0's pod log through the API server, and follows it."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient

from api import jobset as render
from api.cli import main
from tests.conftest import LiveApi
from tests.k8s.cluster import NAMESPACE, Cluster
from tests.k8s.fake_apiserver import FakeKubernetes
from tests.k8s.test_pause import post, wait_deleted
from tests.k8s.test_reconciler import FINAL, running, submit


def process_zero(cluster: Cluster, job_id: str, attempt: int = 0) -> str:
    """Its pod in the JobSet's restart `attempt`."""
    name = f"-slice-0-0-a{attempt}"
    return next(p["metadata"]["name"] for p in cluster.pods(job_id) if p["metadata"]["name"].endswith(name))


def test_tail_and_follow_the_process_zero_log(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api()
    job_id = submit(
        api,
        dataset_uri,
        resources={"accelerator": "v6e", "topology": "4x4"},
        hyperparameters={"batch_size": 16},
    )
    api.wait_for(job_id, lambda j: j["status_message"].startswith("Workers started"))
    with api.client() as http:
        answer = http.get(f"/jobs/{job_id}/logs", params={"follow": "true"})
        assert answer.status_code == 409 and answer.json()["error"]["code"] == "logs_not_ready"
    running(api, cluster, job_id)
    assert len(cluster.pods(job_id)) == 4  # one per TPU VM of the 4x4 slice
    pod = process_zero(cluster, job_id)
    for other in cluster.pods(job_id):
        fake_k8s.append_log(other["metadata"]["name"], NAMESPACE, "not process 0")
    fake_k8s.append_log(pod, NAMESPACE, "step 1", "step 2", "step 3")
    with api.client() as http:
        assert http.get(f"/jobs/{job_id}/logs", params={"tail": 2}).json() == {
            "job_id": job_id,
            "lines": ["step 2", "step 3"],
            "truncated": True,
            "saved_at": None,
            "run": None,  # (a live log, not a saved one)
        }
        assert http.get(f"/jobs/{job_id}/logs").json()["truncated"] is False

    received: list[str] = []

    def follow() -> None:
        with httpx.stream(
            "GET", f"{api.url}/jobs/{job_id}/logs", params={"follow": "true", "tail": 1}
        ) as stream:
            assert stream.headers["content-type"].startswith("text/plain")
            received.extend(stream.iter_lines())

    reader = threading.Thread(target=follow)
    reader.start()
    deadline = time.monotonic() + 10
    while received != ["step 3"]:
        assert time.monotonic() < deadline, received
        time.sleep(0.02)
    fake_k8s.append_log(pod, NAMESPACE, "step 4")
    while received[-1:] != ["step 4"]:
        assert time.monotonic() < deadline, received
        time.sleep(0.02)
    fake_k8s.remove("pods", pod, NAMESPACE)  # the pod goes: the stream ends
    reader.join(timeout=10)
    assert not reader.is_alive()
    assert received == ["step 3", "step 4"]


def test_local_logs_cannot_be_followed(client: TestClient, dataset: Path) -> None:
    job = client.post("/jobs", json={"name": "local", "model": "tiny", "dataset_uri": str(dataset)}).json()
    answer = client.get(f"/jobs/{job['id']}/logs", params={"follow": "true"})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "follow_not_supported"


def _followers_gauge(api: LiveApi) -> float:
    return api.gauge("tputune_log_followers")


def test_log_followers_hold_no_route_thread_and_are_let_go_at_once(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    """A followed log waits minutes between lines. Its reads run on threads of their own: with more
    followers than route threads, the worker's reports and the other routes are still answered. Past
    TPUTUNE_MAX_LOG_FOLLOWERS a follower is refused (429), and one whose client leaves is let go at once,
    not when its log's next line comes."""
    api = k8s_api(worker_threads=2, max_log_followers=3)
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    pod = process_zero(cluster, job_id)
    fake_k8s.append_log(pod, NAMESPACE, "step 1")
    with contextlib.ExitStack() as followers:
        reading = []  # (a line iterator let go closes its response: kept until the end)
        for _ in range(3):
            http = followers.enter_context(httpx.Client(base_url=api.url, timeout=10))
            stream = followers.enter_context(
                http.stream("GET", f"/jobs/{job_id}/logs", params={"follow": "true", "tail": 1})
            )
            assert stream.status_code == 200
            reading.append(stream.iter_lines())
            assert next(reading[-1]) == "step 1"  # then it waits for the next line
        assert _followers_gauge(api) == 3
        with api.client() as http:
            refused = http.get(f"/jobs/{job_id}/logs", params={"follow": "true"})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "too_many_log_followers"
            assert refused.headers["retry-after"] == "10"
            started = time.monotonic()
            for path in ("/events", "/metrics", "/checkpoints", "/logs"):
                assert http.get(f"/jobs/{job_id}{path}").status_code == 200, path
            report = {"kind": "metrics", "step": 1, "loss": 2.0}
            assert cluster.report(api.url, job_id, report).status_code == 200
            assert time.monotonic() - started < 5.0
    # The clients went away with no new line in their logs: their followers end now.
    deadline = time.monotonic() + 5
    while _followers_gauge(api) != 0:
        assert time.monotonic() < deadline, "followers still held after their clients left"
        time.sleep(0.05)
    with httpx.stream(
        "GET", f"{api.url}/jobs/{job_id}/logs", params={"follow": "true", "tail": 1}, timeout=10
    ) as stream:
        lines = stream.iter_lines()
        assert next(lines) == "step 1"
        fake_k8s.append_log(pod, NAMESPACE, "step 2")
        assert next(lines) == "step 2"


def test_a_revoked_keys_log_follower_ends_at_once(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    """A followed log waits minutes for its next line; the key that opened it, revoked meanwhile, ends it
    now (its blocked read is interrupted), not at that line."""
    admin = "admin-secret-0123456789"
    api = k8s_api(admin_key=admin)
    api.headers = {"Authorization": f"Bearer {admin}"}
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    fake_k8s.append_log(process_zero(cluster, job_id), NAMESPACE, "step 1")
    with api.client() as http:
        key = http.post("/admin/keys", json={"tenant": "default", "name": "logs"}).json()
    with httpx.stream(
        "GET",
        f"{api.url}/jobs/{job_id}/logs",
        params={"follow": "true", "tail": 1},
        headers={"Authorization": f"Bearer {key['key']}"},
        timeout=10,
    ) as stream:
        lines = stream.iter_lines()
        assert next(lines) == "step 1"
        assert _followers_gauge(api) == 1
        started = time.monotonic()
        with api.client() as http:
            assert http.delete(f"/admin/keys/{key['id']}").status_code == 200
        assert next(lines, None) is None
        assert time.monotonic() - started < 2.0
    assert _followers_gauge(api) == 0


def logs(api: LiveApi, job_id: str, **params: Any) -> dict[str, Any]:
    with api.client() as http:
        answer = http.get(f"/jobs/{job_id}/logs", params=params)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def cli(api: LiveApi, *argv: str, out: io.StringIO | None = None) -> Any:
    """`tputune ...` against the API: its exit code (with `out`, its output goes there), else (code,
    stdout, stderr). (Not capsys: the live API set up during a capsys test logs to its stream, closed
    after the test, and a later test's process lost its stderr.)"""
    stdout, stderr = out or io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["--api-url", api.url, *argv])
    return code if out is not None else (code, stdout.getvalue(), stderr.getvalue())


def when(saved: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(saved["saved_at"])


def test_a_runs_log_is_saved_as_it_ends_and_served_once_its_pods_are_gone(
    k8s_api: Callable[..., LiveApi],
    cluster: Cluster,
    fake_k8s: FakeKubernetes,
    dataset_uri: str,
) -> None:
    """A pod's log goes with the pod: the end of each run's (TPUTUNE_K8S_SAVED_LOG_LINES lines) is saved as
    it ends (failed, paused, succeeded) and served with `saved_at` once no pod has one; `previous=true`
    gives the failed run's while the resumed job runs again, `run=N` any run's (each pause, and each resume
    after a failure, starts the next)."""
    api = k8s_api(k8s_saved_log_lines=3)
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    fake_k8s.append_log(
        process_zero(cluster, job_id), NAMESPACE, "loading", "step 1", "step 2", "Traceback: boom"
    )
    assert logs(api, job_id, previous="true")["saved_at"] is None  # (running: nothing saved yet)
    with api.client() as http:
        unsaved = http.get(f"/jobs/{job_id}/logs", params={"run": 0})
    assert unsaved.status_code == 404 and unsaved.json()["error"] == {
        "code": "log_not_saved",
        "message": f"No log of run 0 of job {job_id} was saved; none has one yet (a run's log is saved as "
        "it ends).",
        "param": "run",
    }
    cluster.fail(job_id, exit_code=1)
    assert api.wait_for(job_id, lambda j: j["status"] in FINAL)["status"] == "failed"
    live = logs(api, job_id)  # the failed JobSet is kept: its pod's log is read
    assert live["lines"][-1] == "Traceback: boom" and live["saved_at"] is None
    failed_run = logs(api, job_id, previous="true")
    assert failed_run["lines"] == ["step 1", "step 2", "Traceback: boom"] and failed_run["truncated"] is True
    assert failed_run["saved_at"] is not None and failed_run["run"] == 0
    assert logs(api, job_id, run=0) == failed_run

    fake_k8s.hold_foreground = True  # resumed, it waits queued while the failed JobSet is deleted
    assert post(api, job_id, "resume").json()["status"] == "queued"
    wait_deleted(fake_k8s, job_id)
    assert cluster.pods(job_id) == []
    assert logs(api, job_id) == failed_run  # no pod: the saved log
    assert logs(api, job_id, tail=1) == {**failed_run, "lines": ["Traceback: boom"]}
    fake_k8s.finish_deletions()
    fake_k8s.hold_foreground = False
    running(api, cluster, job_id)
    fake_k8s.append_log(process_zero(cluster, job_id), NAMESPACE, "resumed at step 2", "step 3")
    live = logs(api, job_id)
    assert live["lines"] == ["resumed at step 2", "step 3"] and live["saved_at"] is None
    assert logs(api, job_id, previous="true") == failed_run

    assert post(api, job_id, "pause").json()["status"] == "pausing"
    assert api.wait_for(job_id, lambda j: j["status"] != "pausing")["status"] == "paused"
    assert cluster.jobset(job_id) is None
    paused_run = logs(api, job_id)
    assert paused_run["lines"] == ["resumed at step 2", "step 3"] and paused_run["truncated"] is False
    assert when(paused_run) > when(failed_run)
    assert logs(api, job_id, previous="true") == paused_run and paused_run["run"] == 1
    assert logs(api, job_id, run=0) == failed_run and logs(api, job_id, run=1) == paused_run

    assert post(api, job_id, "resume").json()["status"] == "queued"
    running(api, cluster, job_id)
    fake_k8s.append_log(process_zero(cluster, job_id), NAMESPACE, "done")
    cluster.complete(job_id)
    assert api.wait_for(job_id, lambda j: j["status"] in FINAL)["status"] == "succeeded"
    fake_k8s.remove("jobsets", render.jobset_name(job_id), NAMESPACE)  # its TTL after it finished
    for pod in cluster.pods(job_id):
        fake_k8s.remove("pods", pod["metadata"]["name"], NAMESPACE)
    last = logs(api, job_id)
    assert last["lines"] == ["done"] and when(last) > when(paused_run) and last["run"] == 2
    code, out, err = cli(api, "logs", job_id, "--previous")
    assert code == 0
    assert out == "done\n" and err.startswith("(saved as run 2 ended, ")
    # Every run's, kept: the first (failed) run's too, from the CLI.
    assert [logs(api, job_id, run=n)["lines"][-1] for n in range(3)] == ["Traceback: boom", "step 3", "done"]
    code, out, err = cli(api, "logs", job_id, "--run", "0", "--tail", "2")
    assert (code, out) == (0, "step 2\nTraceback: boom\n") and err.startswith("(saved as run 0 ended, ")
    code, _, err = cli(api, "logs", job_id, "--run", "3")
    assert code == 3 and f"No log of run 3 of job {job_id} was saved; runs 0, 1 and 2 have one (" in err
    with api.client() as http:
        refused = http.get(f"/jobs/{job_id}/logs", params={"previous": "true", "follow": "true"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "previous_not_supported"
        refused = http.get(f"/jobs/{job_id}/logs", params={"run": 1, "follow": "true"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "run_not_supported"
        assert http.get(f"/jobs/{job_id}/logs", params={"run": -1}).status_code == 422
        both = http.get(f"/jobs/{job_id}/logs", params={"run": 1, "previous": "true"})
        assert both.status_code == 400 and both.json()["error"]["code"] == "conflicting_params"


def test_local_logs_have_no_previous(client: TestClient, dataset: Path) -> None:
    """A local job's log file keeps every run's lines: nothing is saved apart."""
    job = client.post("/jobs", json={"name": "local", "model": "tiny", "dataset_uri": str(dataset)}).json()
    answer = client.get(f"/jobs/{job['id']}/logs", params={"previous": "true"})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "previous_not_supported"
    answer = client.get(f"/jobs/{job['id']}/logs", params={"run": 0})
    assert answer.status_code == 400 and answer.json()["error"] == {
        "code": "run_not_supported",
        "message": "This server runs jobs as local processes, whose log file keeps every run's lines; "
        "drop run.",
        "param": "run",
    }
    assert client.get(f"/jobs/{job['id']}/logs").json()["saved_at"] is None


def test_following_a_log_across_pods_prints_no_earlier_runs_lines(
    k8s_api: Callable[..., LiveApi],
    cluster: Cluster,
    fake_k8s: FakeKubernetes,
    dataset_uri: str,
) -> None:
    """`tputune logs -f` polls the log. Between pods (a JobSet's restart makes new ones, whose logs start
    empty) the API answers with the log saved as an earlier run ended: not printed again as new lines."""
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    fake_k8s.append_log(process_zero(cluster, job_id), NAMESPACE, "first run")
    assert post(api, job_id, "pause").json()["status"] == "pausing"
    assert api.wait_for(job_id, lambda j: j["status"] != "pausing")["status"] == "paused"
    assert post(api, job_id, "resume").json()["status"] == "queued"
    running(api, cluster, job_id)
    fake_k8s.append_log(process_zero(cluster, job_id), NAMESPACE, "second run, 1")
    codes: list[int] = []
    followed = io.StringIO()
    follower = threading.Thread(target=lambda: codes.append(cli(api, "logs", job_id, "-f", out=followed)))
    follower.start()
    time.sleep(1.5)
    cluster.restart(job_id, exit_code=75)  # (new pods, their logs empty: the saved one is answered)
    time.sleep(2.5)  # (two polls between pods)
    fake_k8s.append_log(process_zero(cluster, job_id, attempt=1), NAMESPACE, "second run, 2")
    cluster.complete(job_id)
    follower.join(timeout=30)
    assert codes == [0]
    assert followed.getvalue() == "second run, 1\nsecond run, 2\n"
