"""A job as Kubernetes objects: a JobSet on TPU slices, and the ConfigMap (worker config) and Secret (job
token) its pods mount. Pure functions of the job and the settings, golden-file tested (tests/k8s/golden).

Failures: a pod evicted for preemption or node maintenance (condition `DisruptionTarget`) fails its Job
through the Job's podFailurePolicy, and the JobSet restarts without spending `maxRestarts`; the worker's
"bad input" exit fails the JobSet at once; any other failure (the "preempted" exit included) restarts it
and counts. Restarted workers resume from their last checkpoint.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from api import tpu
from api.models import Job
from api.settings import Settings
from worker.config import (
    ENV_API_URL,
    ENV_GCS_FUSE_ROOT,
    ENV_JOB_ID,
    ENV_JOB_TOKEN,
    EXIT_BAD_INPUT,
    JobSpec,
    Resources,
    WorkerConfig,
    for_tenant,
)

GROUP = "jobset.x-k8s.io"
VERSION = "v1alpha2"
API_VERSION = f"{GROUP}/{VERSION}"
REPLICATED_JOB = "slice"
WORKER_CONTAINER = "worker"
CONFIG_DIR = "/etc/tputune"
CONFIG_FILE = "job.json"
FUSE_ROOT = "/gcs"
TOKEN_KEY = "token"
# worker/data.py reads it; named here because importing worker.data needs numpy, which the API image lacks.

LABEL_JOB_ID = "tputune.dev/job-id"
LABEL_TENANT = "tputune.dev/tenant"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "tputune"
# Set by JobSet on its pods: which slice (Job) and which host in it; (0, 0) is JAX process 0.
LABEL_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
LABEL_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
LABEL_RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY = "kueue.x-k8s.io/priority-class"
TPU_RESOURCE = "google.com/tpu"
GCS_FUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
DISRUPTION_TARGET = "DisruptionTarget"

_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


def jobset_name(job_id: str) -> str:
    # Job ids are `ft-` and 12 lowercase alphanumerics: a valid name, short enough for the pods' hostnames.
    return job_id


def config_map_name(job_id: str) -> str:
    return f"{job_id}-config"


def secret_name(job_id: str) -> str:
    return f"{job_id}-token"


def label_value(value: str) -> str:
    """`value` if Kubernetes accepts it as a label value, else a stable hash of it."""
    if _LABEL_VALUE.fullmatch(value):
        return value
    return "h-" + hashlib.sha256(value.encode()).hexdigest()[:40]


def service_account(settings: Settings, tenant: str) -> str:
    """The Kubernetes service account `tenant`'s workers run as: TPUTUNE_K8S_WORKER_SERVICE_ACCOUNT, its
    `{tenant}` put in (api.validation.check_service_account refuses a team whose name cannot be one)."""
    return for_tenant(settings.k8s_worker_service_account, tenant)


def labels(job: Job) -> dict[str, str]:
    return {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_JOB_ID: job.id,
        LABEL_TENANT: label_value(job.tenant),
    }


def _metadata(job: Job, settings: Settings, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": settings.k8s_namespace, "labels": labels(job)}


def tpu_request(spec: JobSpec, settings: Settings) -> tpu.TpuRequest:
    return resources_request(spec.resources, settings)


def resources_request(res: Resources, settings: Settings) -> tpu.TpuRequest:
    return tpu.resolve(res.accelerator, res.topology, res.slices, tuple(settings.k8s_tpu_machine_types))


def fuse_buckets(spec: JobSpec) -> list[str]:
    """The buckets mounted read-only through GCS FUSE: the dataset's and the validation file's."""
    uris = [spec.dataset_uri, spec.validation_uri]
    buckets = [uri.removeprefix("gs://").split("/", 1)[0] for uri in uris if uri and uri.startswith("gs://")]
    return list(dict.fromkeys(buckets))


def render_config_map(job: Job, settings: Settings) -> dict[str, Any]:
    config = WorkerConfig(job_id=job.id, spec=JobSpec.model_validate(job.spec), output_uri=job.output_uri)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, settings, config_map_name(job.id)),
        "data": {CONFIG_FILE: config.model_dump_json(indent=2)},
    }


def render_secret(job: Job, settings: Settings, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(job, settings, secret_name(job.id)),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


def owner_reference(jobset: dict[str, Any]) -> dict[str, Any]:
    """Makes an object owned by the created JobSet, so deleting the JobSet deletes it."""
    return {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "name": jobset["metadata"]["name"],
        "uid": jobset["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _env(job: Job, settings: Settings, mounts_fuse: bool) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": ENV_API_URL, "value": settings.resolved_public_url},
        {"name": ENV_JOB_ID, "value": job.id},
        {
            "name": ENV_JOB_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": secret_name(job.id), "key": TOKEN_KEY}},
        },
        # Fail at start on a pod that sees no TPU instead of training on its CPUs.
        {"name": "JAX_PLATFORMS", "value": "tpu"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if mounts_fuse:
        env.append({"name": ENV_GCS_FUSE_ROOT, "value": FUSE_ROOT})
    return env


def _fuse_volume(bucket: str, index: int, settings: Settings) -> dict[str, Any]:
    attributes = {"bucketName": bucket, "mountOptions": settings.k8s_gcs_fuse_mount_options}
    if settings.k8s_gke_cluster:
        # A host-network pod's KSA token reaches the driver only with these (driver 1.17.2+, GKE 1.29+).
        attributes["hostNetworkPodKSA"] = "true"
        attributes["identityProvider"] = f"https://container.googleapis.com/v1/{settings.k8s_gke_cluster}"
    return {
        "name": f"gcs-{index}",
        "csi": {"driver": GCS_FUSE_DRIVER, "readOnly": True, "volumeAttributes": attributes},
    }


def _pod_template(job: Job, settings: Settings, request: tpu.TpuRequest) -> dict[str, Any]:
    spec = JobSpec.model_validate(job.spec)
    buckets = fuse_buckets(spec)
    shape = request.shape
    annotations: dict[str, str] = {}
    if buckets:
        annotations["gke-gcsfuse/volumes"] = "true"
        for resource, limit in sorted(settings.k8s_gcs_fuse_sidecar_limits.items()):
            annotations[f"gke-gcsfuse/{resource}-limit"] = limit
    volumes: list[dict[str, Any]] = [
        {
            "name": "config",
            "configMap": {
                "name": config_map_name(job.id),
                "items": [{"key": CONFIG_FILE, "path": CONFIG_FILE}],
            },
        },
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    for index, bucket in enumerate(buckets):
        volumes.append(_fuse_volume(bucket, index, settings))
        mounts.append({"name": f"gcs-{index}", "mountPath": f"{FUSE_ROOT}/{bucket}", "readOnly": True})
    pod_security: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if settings.k8s_worker_run_as_user is not None:
        uid = settings.k8s_worker_run_as_user
        pod_security.update({"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid})
    container = {
        "name": WORKER_CONTAINER,
        "image": settings.k8s_worker_image,
        "imagePullPolicy": settings.k8s_image_pull_policy,
        "command": ["python", "-m", "worker", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "env": _env(job, settings, bool(buckets)),
        "resources": {
            "requests": {"cpu": settings.k8s_worker_cpu, "memory": settings.k8s_worker_memory},
            "limits": {TPU_RESOURCE: str(shape.chips_per_vm)},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }
    metadata: dict[str, Any] = {"labels": labels(job)}
    if annotations:
        metadata["annotations"] = annotations
    return {
        "metadata": metadata,
        "spec": {
            "serviceAccountName": service_account(settings, job.tenant),
            # Workers reach Cloud Storage through Workload Identity, never the Kubernetes API.
            "automountServiceAccountToken": False,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": settings.k8s_termination_grace_seconds,
            "hostNetwork": True,
            "dnsPolicy": "ClusterFirstWithHostNet",
            "nodeSelector": {
                "cloud.google.com/gke-tpu-accelerator": shape.gke_accelerator,
                "cloud.google.com/gke-tpu-topology": shape.topology,
            },
            "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
            "securityContext": pod_security,
            "containers": [container],
            "volumes": volumes,
        },
    }


def render_jobset(job: Job, settings: Settings) -> dict[str, Any]:
    spec = JobSpec.model_validate(job.spec)
    request = tpu_request(spec, settings)
    shape = request.shape
    metadata = _metadata(job, settings, jobset_name(job.id))
    if settings.k8s_kueue_queue:
        metadata["labels"][KUEUE_QUEUE] = settings.k8s_kueue_queue
    if settings.k8s_kueue_priority_class:
        metadata["labels"][KUEUE_PRIORITY] = settings.k8s_kueue_priority_class
    if shape.multi_host:
        # Each slice on a node pool of its own: a multi-host slice's hosts share one ICI domain.
        metadata["annotations"] = {EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"}
    jobset_spec: dict[str, Any] = {
        "failurePolicy": {
            "maxRestarts": settings.k8s_max_restarts,
            # No new worker may join a JAX job whose old workers are still shutting down.
            "restartStrategy": "BlockingRecreate",
            "rules": [
                {
                    "name": "badInput",
                    "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                    "onJobFailureMessagePatterns": [
                        f"failed with exit code {EXIT_BAD_INPUT} matching FailJob"
                    ],
                },
                {
                    "name": "disruption",
                    "action": "RestartJobSetAndIgnoreMaxRestarts",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                    "onJobFailureMessagePatterns": [f"has condition {DISRUPTION_TARGET} matching FailJob"],
                },
            ],
        },
        "replicatedJobs": [
            {
                "name": REPLICATED_JOB,
                "replicas": request.slices,
                "template": {
                    "spec": {
                        "parallelism": shape.vms,
                        "completions": shape.vms,
                        "completionMode": "Indexed",
                        "backoffLimit": 0,
                        "podFailurePolicy": {
                            "rules": [
                                {
                                    "action": "FailJob",
                                    "onPodConditions": [{"type": DISRUPTION_TARGET, "status": "True"}],
                                },
                                {
                                    "action": "FailJob",
                                    "onExitCodes": {
                                        "containerName": WORKER_CONTAINER,
                                        "operator": "In",
                                        "values": [EXIT_BAD_INPUT],
                                    },
                                },
                            ]
                        },
                        "template": _pod_template(job, settings, request),
                    }
                },
            }
        ],
    }
    if settings.k8s_ttl_seconds_after_finished is not None:
        jobset_spec["ttlSecondsAfterFinished"] = settings.k8s_ttl_seconds_after_finished
    return {"apiVersion": API_VERSION, "kind": "JobSet", "metadata": metadata, "spec": jobset_spec}
