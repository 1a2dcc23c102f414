"""Fixtures for the kubernetes executor: a fake API server (checked against the RBAC Role after every test),
the cluster around it played by the test, a dataset in the GCS emulator, and the real API pointed at them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.migrate import upgrade
from tests.conftest import LiveApi
from tests.k8s.cluster import NAMESPACE, Cluster
from tests.k8s.fake_apiserver import FakeKubernetes

ROLE = Path(__file__).parents[2] / "manifests" / "base" / "rbac.yaml"

K8S_SETTINGS: dict[str, Any] = {
    "executor": "kubernetes",
    "k8s_namespace": NAMESPACE,
    "k8s_worker_image": "us-docker.pkg.dev/example/tputune/worker:0.1.0",
    "k8s_gke_cluster": "projects/example/locations/us-east5/clusters/tpu",
    "k8s_output_base_uri": "gs://outputs/tputune",
}


def role_grants() -> set[tuple[str, str, str]]:
    """(api group, resource, verb) for every grant of the API's Role."""
    role = next(doc for doc in yaml.safe_load_all(ROLE.read_text()) if doc["kind"] == "Role")
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: these tests are about the cluster, and the API tests cover both databases."""
    url = f"sqlite:///{tmp_path / 'tputune.db'}"
    upgrade(url)
    return url


@pytest.fixture
def fake_k8s() -> Iterator[FakeKubernetes]:
    fake = FakeKubernetes().start()
    yield fake
    fake.close()
    beyond = fake.used() - role_grants()
    assert not beyond, f"calls the Role in manifests/base/rbac.yaml does not grant: {sorted(beyond)}"


@pytest.fixture
def cluster(fake_k8s: FakeKubernetes) -> Cluster:
    return Cluster(fake_k8s)


@pytest.fixture
def dataset_uri(gcs: Any) -> str:
    gcs.make_bucket("data").blob("stories/train.jsonl").upload_from_string('{"text": "Once upon a time."}\n')
    return "gs://data/stories/train.jsonl"


@pytest.fixture
def k8s_settings(fake_k8s: FakeKubernetes, gcs: Any) -> dict[str, Any]:
    return {
        **K8S_SETTINGS,
        "k8s_api_server": fake_k8s.url,
        "gcs_endpoint": gcs.endpoint,
        "gcs_project": "test",
        "k8s_lease_seconds": 1.0,
    }


@pytest.fixture
def k8s_api(k8s_settings: dict[str, Any], live_api: Callable[..., LiveApi]) -> Callable[..., LiveApi]:
    """Start the real API (dispatcher, leader election, kubernetes executor) against the fake cluster; the
    APIs stop before the fake does."""

    def start(**overrides: Any) -> LiveApi:
        return live_api(**{**k8s_settings, **overrides})

    return start
