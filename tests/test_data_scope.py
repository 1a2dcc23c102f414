"""Where each team's jobs may read and write (TPUTUNE_TENANT_DATA_PREFIXES, a tenant's own `data_prefixes`):
what the API refuses at submission, what the dispatcher fails when an admin narrowed them since, and each
team's own Kubernetes service account; on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlmodel import Session

from api import jobs as service
from api import jobset as render
from api import tenants
from api.dispatcher import Dispatcher
from api.executors import make_executor
from api.main import create_app
from api.models import Tenant
from api.settings import Settings
from tests.k8s.conftest import K8S_SETTINGS
from tests.k8s.test_jobset import make_job
from tests.test_auth import ADMIN, bearer, make_key
from tests.test_tenants import body, server

OFFICIAL_TOKENIZER = "gs://gemma-data/tokenizers/tokenizer_gemma3.model"


def files(data_root: Path, *names: str) -> dict[str, Path]:
    made = {}
    for name in names:
        path = data_root / name / "train.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("Once upon a time.\n")
        made[name] = path
    return made


def refused(answer: Any, param: str) -> str:
    """The message of a 422 path_not_allowed on `param`."""
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("path_not_allowed", param), error
    return str(error["message"])


def test_a_teams_jobs_read_and_write_only_under_its_prefixes(
    make_settings: Callable[..., Settings], data_root: Path
) -> None:
    prefixes = [f"{data_root}/{{tenant}}/", "gs://ml-data/teams/{tenant}"]
    data = files(data_root, "research", "vision", "research-old")
    (data_root / "research" / "link.txt").symlink_to(data["vision"])
    with server(make_settings, tenant_data_prefixes=",".join(prefixes)) as app_client:
        research, vision = bearer(make_key(app_client, "research")), bearer(make_key(app_client, "vision"))
        mine = app_client.get("/tenant", headers=research).json()
        assert mine["data_prefixes"] == [f"{data_root}/research", "gs://ml-data/teams/research"]
        assert mine["own_data_prefixes"] is None and mine["shared_read_prefixes"] == ["gs://gemma-data"]

        def post(headers: dict[str, str], **changes: Any) -> Any:
            return app_client.post("/jobs", json={**body(data["research"]), **changes}, headers=headers)

        assert post(research).status_code == 201  # (its output: the server's own job directory)
        assert post(vision, dataset_uri=str(data["vision"])).status_code == 201
        message = refused(post(vision), "dataset_uri")
        assert (
            f"outside where your team's jobs may read ({data_root}/vision, gs://ml-data/teams/vision, "
            in message
        )
        # A prefix is a directory: research-old is not under research.
        refused(post(research, dataset_uri=str(data["research-old"])), "dataset_uri")
        # A symlink out is out, wherever it lies.
        refused(post(research, dataset_uri=str(data_root / "research" / "link.txt")), "dataset_uri")
        refused(post(research, validation_uri=str(data["vision"])), "validation_uri")
        refused(post(research, output_uri=str(data_root / "vision" / "out")), "output_uri")
        assert post(research, output_uri=str(data_root / "research" / "out")).status_code == 201

        in_bucket = {"dataset_uri": "gs://ml-data/teams/research/stories.jsonl"}
        assert post(research, **in_bucket).status_code == 201
        refused(post(research, dataset_uri="gs://ml-data/teams/vision/stories.jsonl"), "dataset_uri")
        refused(post(research, dataset_uri="gs://ml-data/teams/researcher/stories.jsonl"), "dataset_uri")
        refused(post(research, dataset_uri="gs://other-data/teams/research/stories.jsonl"), "dataset_uri")
        # The official weights and tokenizer are every team's to read, not to write.
        assert post(research, **in_bucket, tokenizer_uri=OFFICIAL_TOKENIZER).status_code == 201
        assert f"may write ({data_root}/research, gs://ml-data/teams/research);" in refused(
            post(research, **in_bucket, output_uri="gs://gemma-data/research-out"), "output_uri"
        )
        refused(post(research, base_checkpoint_uri="gs://ml-data/teams/vision/ckpt"), "base_checkpoint_uri")


def test_an_admin_gives_a_team_its_own_prefixes(
    make_settings: Callable[..., Settings], data_root: Path
) -> None:
    data = files(data_root, "research", "vision", "shared")
    with server(make_settings, tenant_data_prefixes=f"{data_root}/{{tenant}}") as app_client:
        settings = app_client.app.state.settings  # type: ignore[attr-defined]
        research, admin = bearer(make_key(app_client, "research")), bearer(ADMIN)

        def post(dataset: Path) -> Any:
            return app_client.post("/jobs", json=body(dataset), headers=research)

        own = [f"{data_root}//shared/", f"{data_root}/{{tenant}}/", f"{data_root}/shared"]
        answer = app_client.patch("/admin/tenants/research", json={"data_prefixes": own}, headers=admin)
        assert answer.status_code == 200, answer.text
        kept = [f"{data_root}/shared", f"{data_root}/{{tenant}}"]  # (as a path, once each)
        assert answer.json()["own_data_prefixes"] == kept
        assert answer.json()["data_prefixes"] == [f"{data_root}/shared", f"{data_root}/research"]
        assert answer.json()["limits"]["max_active_chips"] == 8  # (the limits stay as they were)
        assert post(data["shared"]).status_code == 201 and post(data["research"]).status_code == 201
        refused(post(data["vision"]), "dataset_uri")
        # Stored as such: another process (a replica) reads it so.
        with Session(app_client.app.state.engine) as session:  # type: ignore[attr-defined]
            row = session.get(Tenant, "research")
        assert tenants.Limits.of(row, settings, "research").data_prefixes == (
            f"{data_root}/shared",
            f"{data_root}/research",
        )
        # `any`: anywhere, whatever the server's; null: the server's again.
        anywhere = app_client.patch("/admin/tenants/research", json={"data_prefixes": "any"}, headers=admin)
        assert anywhere.json()["data_prefixes"] is None and anywhere.json()["own_data_prefixes"] == "any"
        assert post(data["vision"]).status_code == 201
        back = app_client.patch("/admin/tenants/research", json={"data_prefixes": None}, headers=admin)
        assert back.json()["data_prefixes"] == [f"{data_root}/research"]
        refused(post(data["shared"]), "dataset_uri")

        for wrong, code in [
            ([], "invalid_prefixes"),
            ("anywhere", "invalid_prefixes"),
            ([{"path": "/data"}], "invalid_prefixes"),
            (["/data"] * 33, "invalid_prefixes"),
            (["data/research"], "invalid_prefix"),
            (["/data/{team}"], "invalid_prefix"),
            (["gs://b/research"], "invalid_uri"),  # (not a bucket name)
            (["/data/../research"], "path_traversal"),
            (["gs://ml-data/teams/../research"], "path_traversal"),
        ]:
            answer = app_client.patch("/admin/tenants/research", json={"data_prefixes": wrong}, headers=admin)
            assert answer.status_code == 422, (wrong, answer.text)
            assert answer.json()["error"]["code"] == code, (wrong, answer.json())
        assert app_client.get("/tenant", headers=research).json()["data_prefixes"] == [
            f"{data_root}/research"
        ]
        denied = app_client.patch("/admin/tenants/research", json={"data_prefixes": "any"}, headers=research)
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_only"


def test_a_queued_job_outside_its_teams_narrowed_prefixes_fails(
    make_settings: Callable[..., Settings], data_root: Path
) -> None:
    """An admin narrows a team's prefixes: its queued jobs with data elsewhere fail as they would now be
    refused (before its limits are looked at, and before their files are: one removed since is not said
    missing); the others wait their turn."""
    data = files(data_root, "research", "shared", "gone")
    with server(make_settings) as app_client:
        settings = app_client.app.state.settings  # type: ignore[attr-defined]
        engine = app_client.app.state.engine  # type: ignore[attr-defined]
        research, admin = bearer(make_key(app_client, "research")), bearer(ADMIN)
        ids = {
            name: app_client.post("/jobs", json=body(path), headers=research).json()["id"]
            for name, path in data.items()
        }
        data["gone"].unlink()
        narrowed = {"data_prefixes": [str(data_root / "research")], "max_active_jobs": 0}
        assert app_client.patch("/admin/tenants/research", json=narrowed, headers=admin).status_code == 200
        assert Dispatcher(engine, make_executor(settings), settings).tick() is False
        with Session(engine) as session:
            gone = service.get_job(session, "research", ids["gone"])
            assert (gone.status, gone.error_code) == ("failed", "path_not_allowed")
            shared = service.get_job(session, "research", ids["shared"])
            assert (shared.status, shared.error_code) == ("failed", "path_not_allowed")
            assert f"dataset_uri: {data['shared']} is outside where your team's jobs may read" in (
                shared.error_message or ""
            )
            kept = service.get_job(session, "research", ids["research"])
            assert kept.status == "queued" and (kept.status_message or "").startswith("Waiting: ")


def k8s_server(make_settings: Callable[..., Settings], **changed: Any) -> TestClient:
    settings = make_settings(
        **{
            **K8S_SETTINGS,
            "k8s_api_server": "http://127.0.0.1:9",
            "dispatcher_enabled": False,
            "admin_key": ADMIN,
            "rate_limit_per_second": 0,
            **changed,
        }
    )
    return TestClient(create_app(settings))


def test_each_teams_workers_run_as_its_own_service_account(make_settings: Callable[..., Settings]) -> None:
    """`{tenant}` in TPUTUNE_K8S_WORKER_SERVICE_ACCOUNT: each team's pods run as its own Kubernetes service
    account (Workload Identity: its own Google service account, its own buckets). A team whose name cannot
    be one is refused, not launched to fail."""
    spec = {
        "name": "sa",
        "model": "gemma3-270m-pt",
        "dataset_uri": "gs://data/train.jsonl",
        "resources": {"accelerator": "v6e", "topology": "2x4"},
        "hyperparameters": {"batch_size": 8},
    }
    settings = make_settings(**K8S_SETTINGS, k8s_worker_service_account="tputune-worker-{tenant}")
    job = make_job(spec)
    job.tenant = "research"
    pod = render.render_jobset(job, settings)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "tputune-worker-research"
    assert pod["spec"]["automountServiceAccountToken"] is False
    for wrong in ("tputune_worker", "Tputune-{tenant}", "{tenant}-"):
        with pytest.raises(ValidationError, match="a Kubernetes service account name"):
            make_settings(k8s_worker_service_account=wrong)

    per_team = {
        "k8s_worker_service_account": "tputune-worker-{tenant}",
        "k8s_output_base_uri": "gs://outputs/tputune/{tenant}/",
    }
    with k8s_server(make_settings, **per_team) as app_client:
        team = bearer(make_key(app_client, "research"))
        created = app_client.post("/jobs", json=spec, headers=team)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        assert created.json()["output_uri"] == f"gs://outputs/tputune/research/{job_id}"
        # Every team's outputs are the jobs' own: read only as from_job (checked to be the team's).
        for other in (
            f"gs://outputs/tputune/research/{job_id}/train.jsonl",
            "gs://outputs/tputune/v/a.jsonl",
        ):
            answer = app_client.post("/jobs", json={**spec, "dataset_uri": other}, headers=team)
            message = refused(answer, "dataset_uri")
            assert message.startswith(f"dataset_uri: {other} is inside the server's job")
        odd = bearer(make_key(app_client, "ml_team"))
        answer = app_client.post("/jobs", json=spec, headers=odd)
        assert answer.status_code == 422 and answer.json()["error"]["code"] == "tenant_name_not_allowed"
        assert "'tputune-worker-ml_team'" in answer.json()["error"]["message"]
    with k8s_server(make_settings) as app_client:  # one service account for all: any team's name will do
        odd = bearer(make_key(app_client, "ml_team"))
        assert app_client.post("/jobs", json=spec, headers=odd).status_code == 201
