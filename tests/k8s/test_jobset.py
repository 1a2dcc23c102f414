"""JobSet rendering, a pure function of the job and the settings: golden files, and the Job template
checked against Kubernetes' own schema (kubernetes-validate)."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from api import jobset as render
from api.models import Job
from api.settings import Settings
from tests.k8s.conftest import K8S_SETTINGS
from worker.config import EXIT_BAD_INPUT, JobSpec
from worker.data import ENV_GCS_FUSE_ROOT

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("TPUTUNE_UPDATE_GOLDEN") == "1"
KUBERNETES = "1.32.0"

BASE_SETTINGS: dict[str, Any] = {
    **K8S_SETTINGS,
    "public_url": "http://tputune-api.tputune.svc.cluster.local:8000",
}

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "v5e-2x4": (
        {
            "name": "stories-full",
            "model": "gemma3-1b-pt",
            "dataset_uri": "gs://data/tinystories/train.txt",
            "resources": {"accelerator": "v5e", "topology": "2x4"},
            "hyperparameters": {"batch_size": 32},
        },
        {},
    ),
    "v6e-4x4-2-slices": (
        {
            "name": "chat-4b",
            "model": "gemma3-4b-it",
            "dataset_uri": "gs://data/chat/train.jsonl",
            "validation_uri": "gs://eval-data/chat/valid.jsonl",
            "output_uri": "gs://outputs/chat-4b",
            "resources": {"accelerator": "v6e", "topology": "4x4", "slices": 2},
            "hyperparameters": {"batch_size": 64},
        },
        {
            "k8s_kueue_queue": "tpu-queue",
            "k8s_kueue_priority_class": "batch-high",
            "k8s_gcs_fuse_sidecar_limits": {"memory": "0", "cpu": "0"},
            "k8s_max_restarts": 5,
        },
    ),
    "v5p-2x2x2": (
        {
            "name": "full-12b",
            "model": "gemma3-12b-pt",
            "dataset_uri": "gs://data/corpus/train.parquet",
            "resources": {"accelerator": "v5p", "topology": "2x2x2"},
            "hyperparameters": {"batch_size": 8},
        },
        {"k8s_worker_cpu": "100", "k8s_worker_memory": "300Gi"},
    ),
    "v6e-1x1-lora": (
        {
            "name": "stories-lora",
            "model": "gemma3-270m-pt",
            "method": {"type": "lora", "lora_rank": 8},
            "dataset_uri": "gs://data/tinystories/train.txt",
            "validation_split": 0.01,
            "resources": {"accelerator": "v6e", "topology": "1x1"},
            "hyperparameters": {"batch_size": 16},
        },
        {
            "k8s_worker_run_as_user": 1000,
            "k8s_ttl_seconds_after_finished": None,
            "k8s_image_pull_policy": "Always",
        },
    ),
}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the worker config) as literal blocks, so a golden diff reads line by line."""


_Dumper.add_representer(
    str,
    lambda dumper, value: dumper.represent_scalar(
        "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None
    ),
)


def make_job(spec: dict[str, Any], job_id: str = "ft-golden0000001") -> Job:
    parsed = JobSpec.model_validate(spec)
    return Job(
        id=job_id,
        tenant="default",
        name=parsed.name,
        status="queued",
        model=parsed.model,
        method=parsed.method.type,
        spec=parsed.model_dump(mode="json"),
        executor="kubernetes",
        output_uri=parsed.output_uri or f"gs://outputs/tputune/{job_id}",
    )


def make_settings(**overrides: Any) -> Settings:
    return Settings(_env_file=None, **{**BASE_SETTINGS, **overrides})  # type: ignore[call-arg]


def rendered(case: str) -> list[dict[str, Any]]:
    spec, overrides = CASES[case]
    job, settings = make_job(spec), make_settings(**overrides)
    return [
        render.render_config_map(job, settings),
        render.render_secret(job, settings, "the-job-token"),
        render.render_jobset(job, settings),
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case: str) -> None:
    objects = rendered(case)
    path = GOLDEN / f"{case}.yaml"
    text = yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=110)
    if UPDATE:
        path.write_text(text)
    expected = path.read_text()
    if list(yaml.safe_load_all(expected)) != objects:
        diff = "".join(
            difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "now")
        )
        pytest.fail(f"the render of {case} changed (TPUTUNE_UPDATE_GOLDEN=1 rewrites it):\n{diff}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_renders_valid_kubernetes_objects(case: str) -> None:
    config_map, secret, jobset = rendered(case)
    kubernetes_validate.validate(config_map, KUBERNETES, strict=True)
    kubernetes_validate.validate(secret, KUBERNETES, strict=True)
    for replicated in jobset["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, **replicated["template"]}
        kubernetes_validate.validate(job, KUBERNETES, strict=True)


def test_shape_and_failure_policy() -> None:
    _, secret, jobset = rendered("v6e-4x4-2-slices")
    spec = jobset["spec"]
    (slices,) = spec["replicatedJobs"]
    job = slices["template"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    assert (
        slices["replicas"] == 2 and job["parallelism"] == job["completions"] == 4 and job["backoffLimit"] == 0
    )
    assert container["resources"]["limits"] == {"google.com/tpu": "4"}
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    assert jobset["metadata"]["annotations"] == {render.EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"}
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    # the token only ever travels in the Secret
    env = {e["name"]: e for e in container["env"]}
    assert env["TPUTUNE_JOB_TOKEN"] == {
        "name": "TPUTUNE_JOB_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "token"}},
    }
    assert "the-job-token" not in yaml.safe_dump(jobset)
    assert env[ENV_GCS_FUSE_ROOT]["value"] == render.FUSE_ROOT
    rules = {r["name"]: r for r in spec["failurePolicy"]["rules"]}
    assert rules["badInput"]["action"] == "FailJobSet"
    assert rules["disruption"]["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    exit_rule, disruption_rule = job["podFailurePolicy"]["rules"][1], job["podFailurePolicy"]["rules"][0]
    assert exit_rule["onExitCodes"]["values"] == [EXIT_BAD_INPUT]
    assert disruption_rule["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    # the Job controller's failure messages, which the JobSet rules match
    failed_by_exit = (
        f"Container worker for pod tputune/p failed with exit code {EXIT_BAD_INPUT} "
        "matching FailJob rule at index 1"
    )
    failed_by_disruption = "Pod tputune/p has condition DisruptionTarget matching FailJob rule at index 0"
    assert re.search(rules["badInput"]["onJobFailureMessagePatterns"][0], failed_by_exit)
    assert not re.search(rules["badInput"]["onJobFailureMessagePatterns"][0], failed_by_disruption)
    assert re.search(rules["disruption"]["onJobFailureMessagePatterns"][0], failed_by_disruption)
    assert not re.search(rules["disruption"]["onJobFailureMessagePatterns"][0], failed_by_exit)
    # both buckets read through GCS FUSE, read-only, with the host-network identity attributes
    volumes = {v["name"]: v for v in pod["volumes"] if "csi" in v}
    assert [v["csi"]["volumeAttributes"]["bucketName"] for v in volumes.values()] == ["data", "eval-data"]
    for volume in volumes.values():
        assert volume["csi"]["readOnly"] is True
        assert volume["csi"]["volumeAttributes"]["hostNetworkPodKSA"] == "true"
        assert volume["csi"]["volumeAttributes"]["identityProvider"] == (
            "https://container.googleapis.com/v1/projects/example/locations/us-east5/clusters/tpu"
        )


def test_the_cluster_s_machine_types_pick_the_vm_shape() -> None:
    spec = CASES["v5e-2x4"][0] | {"resources": {"accelerator": "v6e", "topology": "2x4"}}
    one_vm = render.render_jobset(make_job(spec), make_settings())
    two_vms = render.render_jobset(make_job(spec), make_settings(k8s_tpu_machine_types=["ct6e-standard-4t"]))
    for jobset, vms, chips in ((one_vm, 1, "8"), (two_vms, 2, "4")):
        job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert job["parallelism"] == vms
        assert job["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == chips
    assert "annotations" not in one_vm["metadata"]  # one host: no exclusive placement needed
    assert render.EXCLUSIVE_TOPOLOGY in two_vms["metadata"]["annotations"]


def test_the_fuse_root_is_the_one_the_worker_reads() -> None:
    assert render.ENV_GCS_FUSE_ROOT == ENV_GCS_FUSE_ROOT


def test_tenants_become_valid_label_values() -> None:
    assert render.label_value("team-a") == "team-a"
    assert render.label_value("team-a\n").startswith("h-")
    odd = render.label_value("Team A/ü")
    assert odd.startswith("h-") and len(odd) <= 63 and odd == render.label_value("Team A/ü")
