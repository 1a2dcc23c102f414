"""manifests/: every object validates against Kubernetes' schema (kubernetes-validate), the kustomizations
hold together, and the settings and names agree with the code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError

from api.settings import Settings

MANIFESTS = Path(__file__).parents[2] / "manifests"
KUBERNETES = "1.32.0"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def objects(directory: str) -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    kustomization = documents(MANIFESTS / directory / "kustomization.yaml")[0]
    for name in kustomization.get("resources", []):
        if name.startswith(".."):
            found.update(objects(str(Path(directory, name).resolve().relative_to(MANIFESTS.resolve()))))
            continue
        for doc in documents(MANIFESTS / directory / name):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


BASE = objects("base")


@pytest.mark.parametrize(
    "path", sorted(MANIFESTS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(MANIFESTS))
)
def test_every_object_validates(path: Path) -> None:
    for doc in documents(path):
        if doc.get("kind") != "Kustomization":
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@pytest.mark.parametrize("directory", ["base", "overlays/gke"])
def test_kustomizations_name_every_file_and_only_existing_ones(directory: str) -> None:
    kustomization = documents(MANIFESTS / directory / "kustomization.yaml")[0]
    named = [n for n in kustomization.get("resources", []) if not n.startswith("..")]
    named += [patch["path"] for patch in kustomization.get("patches", [])]
    files = sorted(p.name for p in (MANIFESTS / directory).glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(named) == files


def test_the_overlay_patches_objects_of_the_base() -> None:
    kustomization = documents(MANIFESTS / "overlays/gke/kustomization.yaml")[0]
    for patch in kustomization["patches"]:
        for doc in documents(MANIFESTS / "overlays/gke" / patch["path"]):
            assert (doc["kind"], doc["metadata"]["name"]) in BASE, patch["path"]


def test_the_api_deployment_is_locked_down_and_probed() -> None:
    deployment = BASE[("Deployment", "tputune-api")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["serviceAccountName"] == "tputune-api"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"livenessProbe", "readinessProbe", "startupProbe"} <= set(container)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    secrets = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e
    }
    assert secrets == {
        "TPUTUNE_DATABASE_URL": "tputune-secrets",
        "TPUTUNE_ADMIN_KEY": "tputune-secrets",
        "TPUTUNE_WEBHOOK_PROXY": "tputune-secrets",  # (its URL may hold credentials)
    }
    binding = BASE[("RoleBinding", "tputune-api")]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    assert BASE[("ServiceAccount", "tputune-worker")]["automountServiceAccountToken"] is False


# The README's substitutions ("Deploying to GKE", step 7), as a deployment makes them.
FILLED_IN = {"PROJECT_ID": "my-project", "REGION": "us-east5", "LOCATION": "us-east5", "CLUSTER": "tpus"}
FILLED_IN["OUTPUT_BUCKET"] = f"{FILLED_IN['PROJECT_ID']}-outputs"


def as_settings(values: dict[str, str]) -> Settings:
    return Settings(
        _env_file=None, **{key.removeprefix("TPUTUNE_").lower(): value for key, value in values.items()}
    )  # type: ignore[call-arg]


def test_settings_are_real_settings_that_agree_with_the_objects() -> None:
    settings = dict(BASE[("ConfigMap", "tputune-settings")]["data"])
    for patch in documents(MANIFESTS / "overlays/gke/settings.yaml"):
        settings.update(patch["data"])
    fields = {f"TPUTUNE_{name.upper()}" for name in Settings.model_fields}
    assert set(settings) <= fields, set(settings) - fields
    # The overlay as shipped, its placeholders not filled in: the server refuses to start (every job
    # would have failed at run time, its output bucket not one).
    with pytest.raises(ValidationError, match="'OUTPUT_BUCKET' is not a Cloud Storage bucket name"):
        as_settings(settings)
    for placeholder, value in FILLED_IN.items():
        settings = {key: text.replace(placeholder, value) for key, text in settings.items()}
    as_settings(settings)
    assert settings["TPUTUNE_K8S_WORKER_SERVICE_ACCOUNT"] in {
        name for kind, name in BASE if kind == "ServiceAccount"
    }
    role = BASE[("Role", "tputune-api")]
    lease_rule = next(rule for rule in role["rules"] if rule.get("resourceNames"))
    assert lease_rule["resourceNames"] == [settings["TPUTUNE_K8S_LEASE_NAME"]]
    assert Settings.model_fields["k8s_lease_name"].default == settings["TPUTUNE_K8S_LEASE_NAME"]
    service = BASE[("Service", "tputune-api")]
    assert settings["TPUTUNE_PUBLIC_URL"] == (
        f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:"
        f"{service['spec']['ports'][0]['port']}"
    )


def test_workload_identity_annotates_both_service_accounts() -> None:
    for name in ("api-identity.yaml", "worker-identity.yaml"):
        (account,) = documents(MANIFESTS / "overlays/gke" / name)
        assert account["metadata"]["annotations"]["iam.gke.io/gcp-service-account"].endswith(
            "@PROJECT_ID.iam.gserviceaccount.com"
        )
