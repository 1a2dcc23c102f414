"""The TPU catalogue and what POST /jobs says about TPU shapes on a kubernetes server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api import tpu
from api.main import create_app
from tests.k8s.conftest import K8S_SETTINGS


def test_every_row_adds_up() -> None:
    for shape in tpu.CATALOGUE:
        assert shape.chips == tpu.topology_chips(shape.topology), shape
        assert shape.machine_type.endswith(f"-{shape.chips_per_vm}t"), shape
        assert shape.gke_accelerator == tpu.GKE_ACCELERATOR[shape.accelerator]
    assert len({(s.accelerator, s.topology, s.machine_type) for s in tpu.CATALOGUE}) == len(tpu.CATALOGUE)


@pytest.mark.parametrize(
    ("accelerator", "topology", "slices", "machine_types", "vms", "chips_per_vm", "processes", "devices"),
    [
        ("v5e", "1x1", 1, (), 1, 1, 1, 1),
        ("v5e", "2x4", 1, (), 1, 8, 1, 8),
        ("v6e", "2x4", 1, ("ct6e-standard-4t",), 2, 4, 2, 8),
        ("v6e", "2x4", 2, (), 2, 4, 4, 16),  # multislice takes the multi-host shape
        ("v6e", "4x4", 2, (), 4, 4, 8, 32),
        ("v5p", "2x2x2", 1, (), 2, 4, 2, 8),
        ("v5p", "4x4x4", 1, (), 16, 4, 16, 64),
    ],
)
def test_resolve(
    accelerator: str,
    topology: str,
    slices: int,
    machine_types: tuple[str, ...],
    vms: int,
    chips_per_vm: int,
    processes: int,
    devices: int,
) -> None:
    request = tpu.resolve(accelerator, topology, slices, machine_types)
    assert (request.shape.vms, request.shape.chips_per_vm) == (vms, chips_per_vm)
    assert (request.processes, request.devices) == (processes, devices)


@pytest.fixture
def k8s_client(make_settings: Any) -> Iterator[TestClient]:
    """A kubernetes server without its dispatcher: submissions are checked, nothing is launched."""
    settings = make_settings(**K8S_SETTINGS, k8s_api_server="http://127.0.0.1:9", dispatcher_enabled=False)
    with TestClient(create_app(settings)) as client:
        yield client


def post(client: TestClient, **changes: Any) -> Any:
    body = {
        "name": "shape",
        "model": "gemma3-270m-pt",
        "dataset_uri": "gs://data/train.jsonl",
        "resources": {"accelerator": "v6e", "topology": "2x4"},
        "hyperparameters": {"batch_size": 8},
        **changes,
    }
    return client.post("/jobs", json=body)


@pytest.mark.parametrize(
    ("changes", "code", "param", "says"),
    [
        (
            {"resources": {"accelerator": "v6e", "topology": "3x3"}},
            "unknown_topology",
            "resources.topology",
            "'3x3' is not offered for v6e; v6e offers 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16.",
        ),
        (
            {"resources": {"accelerator": "v5p", "topology": "2x4"}},
            "unknown_topology",
            "resources.topology",
            "v5p offers 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4",
        ),
        (
            {"resources": {"accelerator": "v5e"}},
            "topology_required",
            "resources.topology",
            "v5e offers 1x1, 2x2, 2x4, 4x4",
        ),
        ({"resources": {}}, "accelerator_required", "resources.accelerator", "one of v5e, v5p, v6e"),
        (
            {"resources": {"accelerator": "v6e", "topology": "2x2", "slices": 2}},
            "multislice_needs_multi_host",
            "resources.slices",
            "v6e 2x2 runs on one VM",
        ),
        (
            {"resources": {"accelerator": "v6e", "topology": "2x4", "processes": 2}},
            "resources_not_supported",
            "resources.processes",
            "leave out resources.processes",
        ),
        (
            {"hyperparameters": {"batch_size": 12}},
            "batch_size_not_divisible",
            "hyperparameters.batch_size",
            "must be a multiple of 8: the 8 TPU chips of 1 x v6e 2x4",
        ),
        (
            {"dataset_uri": "/srv/data/train.jsonl"},
            "local_path_not_supported",
            "dataset_uri",
            "TPU pods cannot see; use a gs://bucket/path URI",
        ),
        # The jobs' outputs (every team's): not a path a user may name, to read or to write over.
        (
            {"base_checkpoint_uri": "gs://outputs/tputune/ft-aaaaaaaaaaaa/final/params"},
            "path_not_allowed",
            "base_checkpoint_uri",
            "inside the server's job directories (gs://outputs/tputune)",
        ),
        (
            {"dataset_uri": "gs://outputs/tputune/ft-aaaaaaaaaaaa/train.jsonl"},
            "path_not_allowed",
            "dataset_uri",
            "to start from a job's weights use from_job",
        ),
        ({"output_uri": "gs://outputs/tputune"}, "path_not_allowed", "output_uri", "every team's runs"),
    ],
)
def test_invalid_shapes_are_rejected(
    k8s_client: TestClient, changes: dict[str, Any], code: str, param: str, says: str
) -> None:
    answer = post(k8s_client, **changes)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert says in error["message"]


def test_an_unknown_accelerator_lists_the_valid_ones(k8s_client: TestClient) -> None:
    answer = post(k8s_client, resources={"accelerator": "v4", "topology": "2x2x1"})
    assert answer.status_code == 422
    assert "'v5e', 'v5p' or 'v6e'" in answer.json()["error"]["message"]


def test_output_defaults_under_the_configured_base(k8s_client: TestClient) -> None:
    job = post(k8s_client).json()
    assert job["output_uri"] == f"gs://outputs/tputune/{job['id']}"


def test_without_a_base_the_output_uri_is_required(make_settings: Any) -> None:
    settings = make_settings(
        **{**K8S_SETTINGS, "k8s_output_base_uri": None},
        k8s_api_server="http://127.0.0.1:9",
        dispatcher_enabled=False,
    )
    with TestClient(create_app(settings)) as client:
        answer = post(client)
        assert answer.status_code == 422 and answer.json()["error"]["code"] == "output_uri_required"
        assert post(client, output_uri="gs://outputs/mine").status_code == 201


def test_a_job_starts_from_the_weights_in_another_jobs_output(k8s_client: TestClient) -> None:
    """Its output (under TPUTUNE_K8S_OUTPUT_BASE_URI) is the server's to name, through from_job."""
    from tests.test_api import _finish

    first = post(k8s_client).json()
    assert first["output_uri"] == f"gs://outputs/tputune/{first['id']}"
    _finish(k8s_client, first["id"])
    more = post(k8s_client, from_job=first["id"])
    assert more.status_code == 201, more.text
    assert more.json()["spec"]["base_checkpoint_uri"] == f"{first['output_uri']}/final/params"
