"""Deleting an ended job on Kubernetes (api.deletion): its JobSet, kept for its pods' logs (a failed one's
until it is resumed), goes with it, with its Secret and ConfigMap; as test_reconciler.py, the real API
against the fake API server."""

from __future__ import annotations

from collections.abc import Callable

from api import jobset as render
from tests.conftest import LiveApi
from tests.k8s.cluster import Cluster
from tests.k8s.fake_apiserver import FakeKubernetes
from tests.k8s.test_pause import wait_deleted
from tests.k8s.test_reconciler import FINAL, assert_cleaned_up, running, submit


def test_a_deleted_jobs_jobset_goes_with_it(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    api = k8s_api()
    job_id = submit(api, dataset_uri)
    running(api, cluster, job_id)
    cluster.fail(job_id, exit_code=1, reason="FailedJobs", message="jobset failed due to job failure")
    assert api.wait_for(job_id, lambda j: j["status"] in FINAL)["status"] == "failed"
    assert cluster.jobset(job_id) is not None  # (kept: its pods' logs, until it is resumed)
    with api.client() as http:
        deleted = http.delete(f"/jobs/{job_id}")
        assert deleted.status_code == 200, deleted.text
        assert http.get(f"/jobs/{job_id}/logs").status_code == 404
    wait_deleted(fake_k8s, job_id)
    assert_cleaned_up(fake_k8s, job_id)
    assert fake_k8s.get("jobsets", render.jobset_name(job_id), cluster.namespace) is None
