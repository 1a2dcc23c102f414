"""The API's Role grants exactly the calls the code makes: every test checks "nothing beyond it" (conftest);
this one drives every executor and leader operation and checks "nothing short of it" too."""

from __future__ import annotations

import time
from typing import Any

from api.executors.kubernetes import KubeClient, KubernetesExecutor
from api.leader import LeaderElector
from api.settings import Settings
from tests.k8s.cluster import NAMESPACE, Cluster
from tests.k8s.conftest import role_grants
from tests.k8s.fake_apiserver import FakeKubernetes
from tests.k8s.test_jobset import CASES, make_job


def test_the_role_grants_exactly_what_the_code_uses(
    fake_k8s: FakeKubernetes, cluster: Cluster, k8s_settings: dict[str, Any]
) -> None:
    settings = Settings(_env_file=None, **k8s_settings)  # type: ignore[call-arg]
    executor = KubernetesExecutor(settings)
    job = make_job(CASES["v6e-1x1-lora"][0], job_id="ft-rbac00000001")
    try:
        executor.launch(job, "first-token")
        cluster.fake.remove("jobsets", job.id, NAMESPACE)  # a launch that stopped before its JobSet...
        executor.launch(job, "second-token")  # ...leaves a ConfigMap and a Secret to update
        assert cluster.token(job.id) == "second-token"
        cluster.start_pods(job.id)
        assert executor.observe(job).state == "running"
        deadline = time.monotonic() + 10
        while fake_k8s.count("watch", "pods") == 0 or fake_k8s.count("watch", "jobsets") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        pod = cluster.pods(job.id)[0]["metadata"]["name"]
        fake_k8s.append_log(pod, NAMESPACE, "hello")
        assert executor.logs(job, 10) == (["hello"], False)
        assert next(iter(executor.follow_logs(job, 10))) == "hello"
        while not executor.cancel(job):
            assert time.monotonic() < deadline
        executor.discard(job)  # what a launch cut short before its JobSet leaves: deleted
    finally:
        executor.close()
    leader = LeaderElector(KubeClient(settings), settings, identity="rbac")
    assert leader.try_acquire_or_renew() and leader.try_acquire_or_renew()  # create, then get + update
    assert fake_k8s.used() == role_grants()
