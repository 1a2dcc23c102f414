"""The fake API server keeps the promises the executor tests rely on, checked with the official client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch import Watch

from tests.k8s.fake_apiserver import FakeKubernetes

GROUP, VERSION, NS = "jobset.x-k8s.io", "v1alpha2", "ns"


@pytest.fixture
def fake() -> Iterator[FakeKubernetes]:
    server = FakeKubernetes().start()
    yield server
    server.close()


@pytest.fixture
def api(fake: FakeKubernetes) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(client.ApiClient(client.Configuration(host=fake.url)))


def jobset(name: str, labels: dict[str, str] | None = None) -> dict[str, object]:
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"suspend": False},
        "status": {"x": 1},
    }


def test_create_conflict_status_and_resource_versions(api: client.CustomObjectsApi) -> None:
    created = api.create_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", jobset("a"))
    assert "status" not in created  # status is the controllers' to write
    with pytest.raises(ApiException) as exists:
        api.create_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", jobset("a"))
    assert exists.value.status == 409
    status = {"status": {"restarts": 2}}
    patched = api.patch_namespaced_custom_object_status(GROUP, VERSION, NS, "jobsets", "a", status)
    assert patched["status"] == {"restarts": 2}
    replaced = api.replace_namespaced_custom_object(
        GROUP, VERSION, NS, "jobsets", "a", {**patched, "spec": {"suspend": True}, "status": {}}
    )
    assert replaced["spec"] == {"suspend": True} and replaced["status"] == {"restarts": 2}
    with pytest.raises(ApiException) as stale:  # patched's resourceVersion is behind now
        api.replace_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", "a", patched)
    assert stale.value.status == 409
    with pytest.raises(ApiException) as missing:
        api.get_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", "b")
    assert missing.value.status == 404


def test_watch_from_a_version_and_410_after_compaction(
    fake: FakeKubernetes, api: client.CustomObjectsApi
) -> None:
    api.create_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", jobset("a", {"team": "x"}))
    listed = api.list_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", label_selector="team=x")
    version = listed["metadata"]["resourceVersion"]
    api.create_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", jobset("b", {"team": "x"}))
    api.create_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", jobset("c", {"team": "y"}))
    api.delete_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", "a")
    events = [
        (e["type"], e["raw_object"]["metadata"]["name"])
        for e in Watch(return_type=object).stream(
            api.list_namespaced_custom_object,
            GROUP,
            VERSION,
            NS,
            "jobsets",
            label_selector="team=x",
            resource_version=version,
            timeout_seconds=1,
        )
    ]
    assert events == [("ADDED", "b"), ("DELETED", "a")]
    fake.compact()
    with pytest.raises(ApiException) as gone:
        list(
            Watch(return_type=object).stream(
                api.list_namespaced_custom_object,
                GROUP,
                VERSION,
                NS,
                "jobsets",
                resource_version=version,
                timeout_seconds=1,
            )
        )
    assert gone.value.status == 410


def test_owned_objects_go_with_their_owner_unless_orphaned(fake: FakeKubernetes) -> None:
    owner = fake.put("jobsets", {"metadata": {"name": "o", "namespace": NS}})
    reference = {
        "uid": owner["metadata"]["uid"],
        "name": "o",
        "kind": "JobSet",
        "apiVersion": f"{GROUP}/{VERSION}",
    }
    for name in ("s1", "s2"):
        fake.put("secrets", {"metadata": {"name": name, "namespace": NS, "ownerReferences": [reference]}})
    core = client.CoreV1Api(client.ApiClient(client.Configuration(host=fake.url)))
    custom = client.CustomObjectsApi(core.api_client)
    custom.delete_namespaced_custom_object(
        GROUP, VERSION, NS, "jobsets", "o", propagation_policy="Foreground"
    )
    assert fake.get("jobsets", "o", NS) is None and fake.select("secrets", NS) == []
    owner = fake.put("jobsets", {"metadata": {"name": "o", "namespace": NS}})
    fake.put(
        "secrets",
        {
            "metadata": {
                "name": "s3",
                "namespace": NS,
                "ownerReferences": [{**reference, "uid": owner["metadata"]["uid"]}],
            }
        },
    )
    custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", "o", propagation_policy="Orphan")
    (kept,) = fake.select("secrets", NS)
    assert kept["metadata"]["ownerReferences"] == []


def test_faults(fake: FakeKubernetes, api: client.CustomObjectsApi) -> None:
    fake.fail_next(1, code=503)
    with pytest.raises(ApiException) as failed:
        api.list_namespaced_custom_object(GROUP, VERSION, NS, "jobsets")
    assert failed.value.status == 503
    api.list_namespaced_custom_object(GROUP, VERSION, NS, "jobsets")
    fake.stop()
    with pytest.raises(Exception, match="refused"):
        api.list_namespaced_custom_object(GROUP, VERSION, NS, "jobsets", _request_timeout=2)
    fake.start()
    api.list_namespaced_custom_object(GROUP, VERSION, NS, "jobsets")
    assert ("jobset.x-k8s.io", "jobsets", "list") in fake.used()
