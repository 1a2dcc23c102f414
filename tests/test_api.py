"""The job API's behaviour, on SQLite and on PostgreSQL (the `database_url` fixture runs both)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.conftest import LiveApi


def job_body(dataset: Path, **overrides: object) -> dict:
    body: dict = {"name": "stories", "model": "gemma3-270m-pt", "dataset_uri": str(dataset)}
    body.update(overrides)
    return body


def test_create_and_get(client: TestClient, dataset: Path) -> None:
    response = client.post(
        "/jobs",
        json=job_body(dataset, method={"type": "lora"}, hyperparameters={"batch_size": 4, "max_steps": 10}),
    )
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["id"].startswith("ft-")
    assert job["status"] == "queued"
    assert job["method"] == "lora"
    assert job["spec"]["method"]["lora_rank"] == 8
    assert job["spec"]["method"]["objective"] == "sft" and job["spec"]["method"]["dpo_beta"] is None
    assert job["spec"]["hyperparameters"]["max_steps"] == 10
    dpo = client.post("/jobs", json=job_body(dataset, method={"type": "lora", "objective": "dpo"}))
    assert dpo.status_code == 201 and dpo.json()["spec"]["method"]["dpo_beta"] == 0.1  # (the default)
    assert job["progress"] == {
        "step": 0,
        "total_steps": None,
        "epoch": None,
        "fraction": None,
        "eta_seconds": None,
    }
    assert job["created_at"].endswith(("Z", "+00:00"))
    assert job["queue_position"] is None  # (GET /jobs/{id} works it out)
    fetched = client.get(f"/jobs/{job['id']}").json()
    assert fetched == {**job, "queue_position": 1}


def test_a_dpo_job_without_a_learning_rate_gets_a_lower_one(client: TestClient, dataset: Path) -> None:
    """At SFT's learning rate DPO and SimPO make every reply far less likely (bench/dpo.py): a dpo job that
    gives none gets a lower one, by method type, written into its spec; one it gives is kept."""

    def learning_rate(method: dict, **hyperparameters: float) -> float:
        response = client.post(
            "/jobs", json=job_body(dataset, method=method, hyperparameters=hyperparameters)
        )
        assert response.status_code == 201, response.text
        return response.json()["spec"]["hyperparameters"]["learning_rate"]

    assert learning_rate({"type": "lora"}) == learning_rate({"type": "full"}) == 1e-4
    assert learning_rate({"type": "lora", "objective": "dpo"}) == 2e-5
    assert learning_rate({"type": "full", "objective": "dpo"}) == 1e-6
    assert learning_rate({"type": "lora", "objective": "dpo", "simpo_gamma": 1}) == 2e-5
    assert learning_rate({"type": "full", "objective": "dpo"}, learning_rate=1e-4) == 1e-4
    docs = client.get("/openapi.json").json()["components"]["schemas"]["Hyperparameters"]
    assert "2e-5 for LoRA, 1e-6 for a full fine-tune" in docs["properties"]["learning_rate"]["description"]


def test_a_stopped_app_leaves_no_connection_open(make_settings, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    """At shutdown the app closes its database connections itself: left to the garbage collector, a
    PostgreSQL one was finalized after its server had stopped (a traceback at exit), and a server a
    rolling update stops held connections until then."""
    from sqlalchemy import create_engine, text

    from api.main import create_app

    settings = make_settings(dispatcher_enabled=False)
    app = create_app(settings)
    with TestClient(app) as client:
        job = client.post("/jobs", json=job_body(dataset)).json()
        assert client.get(f"/jobs/{job['id']}").status_code == 200
        assert app.state.engine.pool.checkedin() > 0
    assert app.state.engine.pool.checkedin() == 0
    if settings.resolved_database_url.startswith("postgresql"):
        others = text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid()"
        )
        probe = create_engine(settings.resolved_database_url)
        try:
            with probe.connect() as connection:
                assert connection.execute(others).scalar() == 0
        finally:
            probe.dispose()


def test_unknown_job_is_404(client: TestClient) -> None:
    for method, path in [
        ("get", "/jobs/ft-nope"),
        ("post", "/jobs/ft-nope/cancel"),
        ("post", "/jobs/ft-nope/pause"),
        ("post", "/jobs/ft-nope/resume"),
        ("get", "/jobs/ft-nope/events"),
    ]:
        response = client.request(method, path)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "job_not_found"


@pytest.mark.parametrize(
    ("overrides", "status", "code", "param"),
    [
        ({"model": "gemma3-2b-pt"}, 422, "unknown_model", "model"),
        ({"dataset_uri": "http://example.com/x.txt"}, 422, "unsupported_uri_scheme", "dataset_uri"),
        ({"dataset_uri": "s3://bucket/x.txt"}, 422, "unsupported_uri_scheme", "dataset_uri"),
        ({"dataset_uri": "/etc/passwd.txt"}, 422, "path_not_allowed", "dataset_uri"),
        ({"dataset_uri": "{root}/../x.txt"}, 422, "path_traversal", "dataset_uri"),
        ({"dataset_uri": "relative/x.txt"}, 422, "invalid_uri", "dataset_uri"),
        ({"dataset_uri": "{root}/x.csv"}, 422, "unsupported_dataset_format", "dataset_uri"),
        ({"dataset_uri": "gs://bucket-only"}, 422, "invalid_uri", "dataset_uri"),
        # The pods mount each bucket at /gcs/<bucket>: a bad name, or '..', failed there (or escaped).
        ({"dataset_uri": "gs://My Bucket/x.txt"}, 422, "invalid_uri", "dataset_uri"),
        ({"dataset_uri": "gs://ab/x.txt"}, 422, "invalid_uri", "dataset_uri"),
        ({"dataset_uri": "gs://../etc/x.txt"}, 422, "invalid_uri", "dataset_uri"),
        ({"dataset_uri": "gs://data/../other/x.txt"}, 422, "path_traversal", "dataset_uri"),
        ({"output_uri": "gs://data/./out"}, 422, "path_traversal", "output_uri"),
        ({"method": {"type": "full", "lora_rank": 4}}, 422, "invalid_request", "method"),
        ({"method": {"dpo_beta": 0.2}}, 422, "conflicting_fields", "method"),  # (an sft job's)
        ({"method": {"rpo_alpha": 1}}, 422, "conflicting_fields", "method"),
        ({"method": {"simpo_gamma": 0}}, 422, "conflicting_fields", "method"),
        ({"method": {"dpo_normalize_logratios_by_length": True}}, 422, "conflicting_fields", "method"),
        ({"method": {"objective": "dpo", "simpo_gamma": -1}}, 422, "invalid_request", "method.simpo_gamma"),
        ({"method": {"objective": "dpo", "dpo_beta": 0}}, 422, "invalid_request", "method.dpo_beta"),
        ({"method": {"objective": "orpo"}}, 422, "invalid_request", "method.objective"),
        (
            {"method": {"objective": "dpo"}, "hyperparameters": {"train_on_inputs": True}},
            422,
            "conflicting_fields",
            None,
        ),
        ({"hyperparameters": {"learning_rate": -1}}, 422, "invalid_request", "hyperparameters.learning_rate"),
        (
            {"hyperparameters": {"warmup_steps": 10, "warmup_ratio": 0.1}},
            422,
            "conflicting_fields",
            "hyperparameters",
        ),
        (
            {"hyperparameters": {"lr_scheduler": "constant", "min_lr_ratio": 0.0}},
            422,
            "conflicting_fields",
            "hyperparameters",
        ),
        (
            {"hyperparameters": {"lr_scheduler": "step"}},
            422,
            "invalid_request",
            "hyperparameters.lr_scheduler",
        ),
        ({"hyperparameters": {"warmup_ratio": 1}}, 422, "invalid_request", "hyperparameters.warmup_ratio"),
        (
            {"hyperparameters": {"eval_every_steps": 10, "n_evals": 4}},
            422,
            "conflicting_fields",
            "hyperparameters",
        ),
        (
            {"hyperparameters": {"checkpoint_every_steps": 10, "n_checkpoints": 4}},
            422,
            "conflicting_fields",
            "hyperparameters",
        ),
        ({"hyperparameters": {"n_evals": 0}}, 422, "invalid_request", "hyperparameters.n_evals"),
        (
            {"hyperparameters": {"early_stopping_patience": 3, "n_evals": 10}},  # (no validation data)
            422,
            "early_stopping_needs_evals",
            None,
        ),
        (
            {"validation_split": 0.1, "hyperparameters": {"early_stopping_patience": 3}},  # (no evals)
            422,
            "early_stopping_needs_evals",
            None,
        ),
        (
            {"hyperparameters": {"export_best": True, "n_evals": 10}},  # (no validation data)
            422,
            "export_best_needs_evals",
            None,
        ),
        (
            {"validation_split": 0.1, "hyperparameters": {"export_best": True}},
            422,
            "export_best_needs_evals",
            None,
        ),
        (
            {"hyperparameters": {"batch_size": 3}, "resources": {"processes": 2}},
            422,
            "batch_size_not_divisible",
            None,
        ),
        (
            {"resources": {"accelerator": "v6e", "topology": "2x4"}},
            422,
            "resources_not_supported",
            "resources",
        ),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, 422, "invalid_request", "metadata"),
        ({"stall_minutes": 0}, 422, "invalid_request", "stall_minutes"),
        ({"stall_minutes": 1441}, 422, "invalid_request", "stall_minutes"),
        ({"surprise": 1}, 422, "invalid_request", "surprise"),
        # PostgreSQL's text cannot hold NUL (it was a 500 there, and the paths a 500 on both databases).
        ({"name": "a\x00b"}, 422, "nul_character", "name"),
        ({"metadata": {"team\x00": "x"}}, 422, "nul_character", "metadata"),
        ({"metadata": {"team": "x\x00"}}, 422, "nul_character", "metadata"),
        ({"dataset_uri": "{root}/tr\x00ain.txt"}, 422, "nul_character", "dataset_uri"),
        ({"output_uri": "{root}/out\x00"}, 422, "nul_character", "output_uri"),
        ({"sample_prompts": ["Once\x00"]}, 422, "nul_character", "sample_prompts.0"),
        (
            {"resources": {"accelerator": "v6e", "topology": "2x\x004"}},
            422,
            "nul_character",
            "resources.topology",
        ),
    ],
)
def test_bad_input_gets_a_clear_4xx(
    client: TestClient, dataset: Path, overrides: dict, status: int, code: str, param: str | None
) -> None:
    body = job_body(dataset)
    for key, value in overrides.items():
        body[key] = value.replace("{root}", str(dataset.parent)) if isinstance(value, str) else value
    response = client.post("/jobs", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["message"] and error["message"][0].isalpha()
    if param is not None:
        assert error["param"] == param
    assert client.get("/jobs").json()["data"] == []


@pytest.mark.parametrize(
    ("path", "where"),
    [
        ("/jobs/ft-%00", "path"),
        ("/jobs/ft-%00/events", "path"),
        ("/jobs?after=ft-%00", "query"),
        ("/jobs?metadata[team]=a%00", "query"),
        ("/jobs/ft-x/events?type=%00", "query"),
        ("/admin/keys/%00", "path"),
    ],
)
def test_a_nul_character_in_the_path_or_query_is_422(client: TestClient, path: str, where: str) -> None:
    """A job id, cursor or filter with NUL was a 500 on PostgreSQL (its text cannot hold it)."""
    response = client.request("DELETE" if path.startswith("/admin") else "GET", path)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == {
        "code": "nul_character",
        "message": f"The request's {where} contains the NUL character (%00); remove it.",
        "param": where,
    }
    assert client.get("/jobs?metadata[team]=%2500").status_code == 200  # (an escaped '%00' is text)


def test_numbers_past_what_the_database_holds_are_422(client: TestClient, dataset: Path) -> None:
    """An event id past BIGINT, a step past INTEGER: a 500 on both databases (SQLite's OverflowError,
    PostgreSQL's out of range). And each filter one more to plan (200 metadata filters took PostgreSQL 11 s,
    3,400 timed out), so they are bounded."""
    job_id = client.post("/jobs", json=job_body(dataset)).json()["id"]
    for path, param in [
        (f"/jobs/{job_id}/events?after={2**63}", "query.after"),
        (f"/jobs/{job_id}/metrics?min_step={2**31}", "query.min_step"),
        (f"/jobs/{job_id}/metrics?max_step={10**20}", "query.max_step"),
        (f"/jobs/{job_id}/events?" + "&".join(f"type=t{i}" for i in range(17)), "query.type"),
        ("/jobs?" + "&".join(["status=queued"] * 17), "query.status"),
    ]:
        response = client.get(path)
        assert response.status_code == 422, (path, response.text)
        assert response.json()["error"]["param"] == param
    assert client.get(f"/jobs/{job_id}/events?after={2**63 - 1}").json()["data"] == []
    # 1e999 is infinity: PostgreSQL's JSON cannot hold it (a 500), SQLite's stored it.
    body = json.dumps(job_body(dataset)).replace("}", ', "hyperparameters": {"max_grad_norm": 1e999}}')
    infinite = client.post("/jobs", content=body, headers={"content-type": "application/json"})
    assert infinite.status_code == 422, infinite.text
    assert infinite.json()["error"]["param"] == "hyperparameters.max_grad_norm"
    assert client.get(f"/jobs/{job_id}/metrics?min_step={2**31 - 1}").status_code == 200
    filters = "&".join(f"metadata[k{i}]=v" for i in range(17))
    refused = client.get(f"/jobs?{filters}")
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "too_many_filters"
    assert refused.json()["error"]["param"] == "metadata"
    tagged = job_body(dataset, metadata={f"k{i}": "v" for i in range(16)})
    tagged_id = client.post("/jobs", json=tagged).json()["id"]
    sixteen = "&".join(f"metadata[k{i}]=v" for i in range(16))
    assert [job["id"] for job in client.get(f"/jobs?{sixteen}").json()["data"]] == [tagged_id]


def test_bucket_names_as_cloud_storage_takes_them(client: TestClient, dataset: Path) -> None:
    for bucket in ("abc", "my-data_1", "data.example.com", "a" * 63, ".".join(["b" * 63] * 3)):
        body = job_body(dataset, dataset_uri=f"gs://{bucket}/train.txt")
        assert client.post("/jobs", json=body).status_code == 201, bucket
    for bucket in ("a" * 64, "-data", "data-", "Data", "da..ta", "da ta"):
        body = job_body(dataset, dataset_uri=f"gs://{bucket}/train.txt")
        response = client.post("/jobs", json=body)
        assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_uri", bucket


def test_missing_fields_are_all_named(client: TestClient) -> None:
    response = client.post("/jobs", json={})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert {d["param"] for d in error["details"]} == {"name", "model", "dataset_uri"}


def test_not_json_is_422(client: TestClient) -> None:
    response = client.post("/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_request"


def test_tiny_model_needs_the_setting(make_settings, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    from api.main import create_app

    with TestClient(create_app(make_settings(dispatcher_enabled=False, allow_tiny_model=False))) as c:
        response = c.post("/jobs", json=job_body(dataset, model="tiny"))
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "unknown_model"


def test_oversize_body_is_413(client: TestClient, dataset: Path) -> None:
    body = job_body(dataset, name="x" * 100)
    body["metadata"] = {"blob": "y" * 400}
    huge = b'{"name": "' + b"x" * 2_000_000 + b'"}'
    response = client.post("/jobs", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: the limit must hold on the streamed body too
        yield b'{"name": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    response = client.post("/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_idempotency_key(client: TestClient, dataset: Path) -> None:
    body = job_body(dataset)
    first = client.post("/jobs", json=body, headers={"Idempotency-Key": "k1"})
    again = client.post("/jobs", json=body, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 201
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    other = client.post("/jobs", json={**body, "name": "other"}, headers={"Idempotency-Key": "k1"})
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    fresh = client.post("/jobs", json=body, headers={"Idempotency-Key": "k2"})
    assert fresh.status_code == 201 and fresh.json()["id"] != first.json()["id"]
    assert len(client.get("/jobs").json()["data"]) == 2


def test_list_pagination_and_filters(client: TestClient, dataset: Path) -> None:
    ids = []
    for i in range(7):
        metadata = {"team": "a" if i % 2 else "b", "i": str(i)}
        ids.append(client.post("/jobs", json=job_body(dataset, name=f"j{i}", metadata=metadata)).json()["id"])
    client.post(f"/jobs/{ids[0]}/cancel")
    seen, after = [], None
    while True:
        page = client.get("/jobs", params={"limit": 3, **({"after": after} if after else {})}).json()
        seen += [job["id"] for job in page["data"]]
        if not page["has_more"]:
            assert page["next_after"] is None
            break
        after = page["next_after"]
    assert seen == list(reversed(ids))
    team_a = client.get("/jobs", params={"metadata[team]": "a"}).json()["data"]
    assert [job["id"] for job in team_a] == [ids[5], ids[3], ids[1]]
    both = client.get("/jobs", params={"metadata[team]": "a", "metadata[i]": "3"}).json()["data"]
    assert [job["id"] for job in both] == [ids[3]]
    cancelled = client.get("/jobs", params={"status": "cancelled"}).json()["data"]
    assert [job["id"] for job in cancelled] == [ids[0]]
    queued = client.get("/jobs", params=[("status", "queued"), ("status", "cancelled")]).json()["data"]
    assert len(queued) == 7
    assert client.get("/jobs", params={"status": "bogus"}).status_code == 422
    assert client.get("/jobs", params={"after": "ft-unknown"}).json()["error"]["code"] == "invalid_cursor"
    assert client.get("/jobs", params={"limit": 1000}).status_code == 422


def test_cancel_queued_and_finished(client: TestClient, dataset: Path) -> None:
    job = client.post("/jobs", json=job_body(dataset)).json()
    cancelled = client.post(f"/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None
    again = client.post(f"/jobs/{job['id']}/cancel")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "job_finished"
    events = client.get(f"/jobs/{job['id']}/events").json()["data"]
    assert [e["data"]["status"] for e in events if e["type"] == "status"] == ["queued", "cancelled"]


def statuses(client: TestClient, job_id: str) -> list[str]:
    events = client.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    return [e["data"]["status"] for e in events if e["type"] == "status" and "status" in (e["data"] or {})]


def test_pause_and_resume_a_queued_job(client: TestClient, dataset: Path) -> None:
    job = client.post("/jobs", json=job_body(dataset)).json()
    paused = client.post(f"/jobs/{job['id']}/pause")
    assert paused.status_code == 200, paused.text
    assert paused.json()["status"] == "paused" and paused.json()["pauses"] == 1
    assert "resume it" in paused.json()["status_message"]
    assert paused.json()["finished_at"] is None  # (not an end)
    assert client.get(f"/jobs/{job['id']}").json() == paused.json()
    # Pausing it again changes nothing; a paused job is listed as such.
    again = client.post(f"/jobs/{job['id']}/pause")
    assert again.status_code == 200 and again.json() == paused.json()
    listed = client.get("/jobs", params={"status": "paused"}).json()["data"]
    assert [j["id"] for j in listed] == [job["id"]]
    assert client.get("/jobs", params={"status": "queued"}).json()["data"] == []

    resumed = client.post(f"/jobs/{job['id']}/resume")
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["status"] == "queued" and resumed.json()["pauses"] == 1
    assert "continues from its last checkpoint" in resumed.json()["status_message"]
    # Resuming a queued job changes nothing.
    assert client.post(f"/jobs/{job['id']}/resume").json() == resumed.json()
    assert statuses(client, job["id"]) == ["queued", "paused", "queued"]

    # A paused job is cancelled at once; a finished one is neither paused nor resumed.
    client.post(f"/jobs/{job['id']}/pause")
    cancelled = client.post(f"/jobs/{job['id']}/cancel")
    assert cancelled.json()["status"] == "cancelled" and "while paused" in cancelled.json()["status_message"]
    for action, code in [("pause", "job_not_pausable"), ("resume", "job_not_paused")]:
        refused = client.post(f"/jobs/{job['id']}/{action}")
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == code
        assert (
            "already cancelled" in refused.json()["error"]["message"]
            or "is cancelled" in (refused.json()["error"]["message"])
        )
    assert statuses(client, job["id"]) == ["queued", "paused", "queued", "paused", "cancelled"]
    assert client.get(f"/jobs/{job['id']}").json()["pauses"] == 2


def test_pause_a_started_job_waits_for_its_workers(client: TestClient, dataset: Path) -> None:
    """A launched job goes to `pausing`: its worker learns it from the answer to its next report, and the
    job is not resumed before its workers have stopped."""
    from tests.test_progress import metrics, post, started_job

    job_id, token = started_job(client, dataset)
    pausing = client.post(f"/jobs/{job_id}/pause")
    assert pausing.status_code == 200 and pausing.json()["status"] == "pausing", pausing.text
    assert pausing.json()["pauses"] == 0
    answer = post(client, job_id, token, [metrics(1, 2.0)])
    assert answer.status_code == 200 and answer.json()["job_status"] == "pausing"
    assert client.get(f"/jobs/{job_id}").json()["status"] == "pausing"  # (a report does not make it run)
    early = client.post(f"/jobs/{job_id}/resume")
    assert early.status_code == 409 and early.json()["error"]["code"] == "job_not_paused"
    assert "still pausing" in early.json()["error"]["message"]
    # A cancel does not wait for the pause.
    assert client.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelling"
    refused = client.post(f"/jobs/{job_id}/pause")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "job_not_pausable"
    assert "being cancelled" in refused.json()["error"]["message"]


def test_resume_keeps_to_the_teams_limit_on_queued_jobs(
    make_settings: Callable[..., Any], dataset: Path
) -> None:
    from api.main import create_app

    settings = make_settings(dispatcher_enabled=False, tenant_max_queued_jobs=1)
    with TestClient(create_app(settings)) as client:
        first = client.post("/jobs", json=job_body(dataset)).json()["id"]
        assert client.post(f"/jobs/{first}/pause").json()["status"] == "paused"
        second = client.post("/jobs", json=job_body(dataset))
        assert second.status_code == 201  # (a paused job takes no room in the queue)
        full = client.post(f"/jobs/{first}/resume")
        assert full.status_code == 429, full.text
        assert full.json()["error"]["code"] == "too_many_queued_jobs"
        assert "resume this job once" in full.json()["error"]["message"]
        assert full.headers["Retry-After"]
        assert client.get(f"/jobs/{first}").json()["status"] == "paused"
        client.post(f"/jobs/{second.json()['id']}/cancel")
        assert client.post(f"/jobs/{first}/resume").json()["status"] == "queued"


def test_resume_a_failed_job(client: TestClient, dataset: Path) -> None:
    """A failed job its owner resumes is queued again, to go on from its last checkpoint: its error and end
    cleared, `retries` counted, what its failed run held kept (not the time it lay failed). Succeeded or
    cancelled, a job is not resumed."""
    from datetime import timedelta

    from sqlmodel import Session, select

    from api.jobs import transition
    from api.models import Job
    from api.states import JobStatus
    from tests.test_progress import metrics, new_run, post, started_job

    job_id, token = started_job(client, dataset)
    _set(client, job_id, launched_at=datetime.now(UTC), admitted_at=datetime.now(UTC) - timedelta(seconds=60))
    checkpoint = {"kind": "checkpoint", "step": 2, "uri": str(dataset.parent / "ckpt-2")}
    error = {"kind": "error", "step": 3, "code": "loss_not_finite", "message": "The loss became NaN."}
    reports = [metrics(1, 2.0), metrics(2, 1.5), checkpoint, error]
    assert post(client, job_id, token, reports).status_code == 200
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        assert transition(session, job, JobStatus.failed, error["message"])  # (as the dispatcher does)
    failed = client.get(f"/jobs/{job_id}").json()
    assert (
        failed["status"] == "failed"
        and failed["finished_at"]
        and failed["error"]["code"] == "loss_not_finite"
    )
    assert failed["usage"]["held_seconds"] == pytest.approx(60, abs=1)
    time.sleep(0.5)  # (it lies failed: that holds nothing)

    resumed = client.post(f"/jobs/{job_id}/resume")
    assert resumed.status_code == 200, resumed.text
    job = resumed.json()
    assert (job["status"], job["error"], job["finished_at"], job["retries"]) == ("queued", None, None, 1)
    assert job["status_message"] == (
        "Resumed after it failed (loss_not_finite); queued, it goes on from its last checkpoint."
    )
    assert job["checkpoint_uri"] == checkpoint["uri"] and job["progress"]["step"] == 2
    assert job["usage"]["held_seconds"] == failed["usage"]["held_seconds"]
    assert client.post(f"/jobs/{job_id}/resume").json() == job  # (no change)
    assert statuses(client, job_id) == ["queued", "starting", "running", "failed", "queued"]
    assert client.get("/jobs", params={"status": "failed"}).json()["data"] == []
    # Its new run fails as the first did: its error is the job's again (not taken for the first's).
    token = new_run(client, job_id)
    assert post(client, job_id, token, [metrics(3, 1.2), error]).json()["accepted"] == 2  # (the error too)
    assert client.get(f"/jobs/{job_id}").json()["error"] == {
        "code": error["code"],
        "message": error["message"],
    }

    # Succeeded or cancelled: it is not resumed.
    done = client.post("/jobs", json=job_body(dataset)).json()["id"]
    _finish(client, done)
    gone = client.post("/jobs", json=job_body(dataset)).json()["id"]
    assert client.post(f"/jobs/{gone}/cancel").json()["status"] == "cancelled"
    for other, status in ((done, "succeeded"), (gone, "cancelled")):
        refused = client.post(f"/jobs/{other}/resume")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "job_not_paused"
        assert refused.json()["error"]["message"] == (
            f"Job {other} is {status}; only a paused or failed job can be resumed."
        )


def _finish(client: TestClient, job_id: str, status: str = "succeeded") -> None:
    _set(client, job_id, status=status)


def _set(client: TestClient, job_id: str, **values: Any) -> None:
    from sqlalchemy import update
    from sqlmodel import Session, col

    from api.models import Job

    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        session.execute(update(Job).where(col(Job.id) == job_id).values(**values))
        session.commit()


def test_a_queued_job_shows_its_place_in_the_queue(client: TestClient, dataset: Path) -> None:
    ids = [client.post("/jobs", json=job_body(dataset)).json()["id"] for _ in range(4)]

    def places() -> list[int | None]:
        return [client.get(f"/jobs/{job_id}").json()["queue_position"] for job_id in ids]

    assert places() == [1, 2, 3, 4]
    assert {job["queue_position"] for job in client.get("/jobs").json()["data"]} == {None}  # (GET only)
    # The first starts: the others move up. A paused job leaves the queue; resumed, it has its old place.
    _set(client, ids[0], status="starting", launched_at=datetime.now(UTC))
    assert client.post(f"/jobs/{ids[2]}/pause").json()["status"] == "paused"
    assert places() == [None, 1, None, 2]
    assert client.post(f"/jobs/{ids[2]}/resume").json()["queue_position"] is None  # (GET only)
    assert places() == [None, 1, 2, 3]
    # Jobs of another team held back by its own limits start after ours: not counted ahead of them.
    # (Its own team's are: `ids[2]` waits behind `ids[1]`, held or not.)
    _set(client, ids[1], tenant="other", status_message="Waiting: 1 job of your team is running (limit 1).")
    assert places() == [None, 1, 1, 2]
    _set(client, ids[1], tenant="default")
    assert places() == [None, 1, 2, 3]
    # A job held by the platform after its launch (Kueue) waits in its queue, not ours; each executor's
    # jobs have a queue of their own (one left from a server run with the other is not ahead).
    _set(client, ids[1], launched_at=datetime.now(UTC))
    _set(client, ids[2], executor="kubernetes")
    assert places() == [None, None, 1, 1]
    _set(client, ids[3], status="running")
    assert places() == [None, None, 1, None]


def test_a_long_queue_places_its_jobs_from_one_read_a_second(client: TestClient, dataset: Path) -> None:
    """Past QueuePlaces.LONG jobs queued, a place is not counted for each GET (O(jobs ahead): 10 ms with
    20,000) but looked up in one read of the queue, made at most every SECONDS: the same places, other
    teams' held-back jobs left out as the count leaves them; a job queued since the read is last."""
    places = client.app.state.queue_places  # type: ignore[attr-defined]
    places.LONG = 4
    reads: list[str] = []
    read_queue = places.reader.queued_order

    async def counted(executor: str) -> Any:
        reads.append(executor)
        return await read_queue(executor)

    places.reader.queued_order = counted
    ids = [client.post("/jobs", json=job_body(dataset)).json()["id"] for _ in range(6)]

    def placed() -> list[int | None]:
        return [client.get(f"/jobs/{job_id}").json()["queue_position"] for job_id in ids]

    assert placed() == [1, 2, 3, 4, 5, 6]  # (counted; the fifth is past LONG: the sixth from a read)
    assert reads == ["local"]
    places.SECONDS = places.STALE_SECONDS = 0  # (a read for every GET, waited for)
    _set(client, ids[0], status="starting", launched_at=datetime.now(UTC))
    _set(client, ids[1], tenant="other", status_message="Waiting: 1 job of your team is running (limit 1).")
    assert placed() == [None, 1, 1, 2, 3, 4] and len(reads) == 1 + 5
    places.SECONDS = places.STALE_SECONDS = 60  # a read is used for a minute: a job queued since is last
    ids.append(client.post("/jobs", json=job_body(dataset)).json()["id"])
    assert placed()[-1] == 5 and len(reads) == 6
    for job_id in ids[1:6]:
        assert client.post(f"/jobs/{job_id}/cancel").status_code == 200
    assert placed()[-1] == 5 and len(reads) == 6  # (the read of a minute ago)
    # A read due but the last one not stale: the GET does not wait for it, the next one has its places.
    places.SECONDS = 0
    assert placed()[-1] == 5
    deadline = time.monotonic() + 10
    while len(reads) < 7 or places._reading is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert placed()[-1] == 1 and len(reads) == 7  # one job left: counted one by one again
    assert placed()[-1] == 1 and len(reads) == 7


def test_a_job_that_succeeded_says_where_its_weights_are(client: TestClient, dataset: Path) -> None:
    """`exports`: by its method, once it succeeded (null before, and for a job that ended otherwise)."""
    expected = {
        "full": {"params": "params"},
        "lora": {"adapter": "adapter"},
        "merged": {"params": "params", "adapter": "adapter"},
        "full_hf": {"params": "params", "hf": "hf"},
        "lora_hf": {"adapter": "adapter", "hf": "hf", "hf_adapter": "hf_adapter"},
        "lora_gguf": {"adapter": "adapter", "gguf": "model-q8_0.gguf"},
        "full_all": {"params": "params", "hf": "hf", "gguf": "model-bf16.gguf"},
    }
    methods = {
        "full": {"type": "full"},
        "lora": {"type": "lora"},
        "merged": {"type": "lora", "export_merged": True},
        "full_hf": {"type": "full", "export_hf": True},
        "lora_hf": {"type": "lora", "export_hf": True},
        "lora_gguf": {"type": "lora", "export_gguf": "q8_0"},
        "full_all": {"type": "full", "export_hf": True, "export_gguf": "bf16"},
    }
    for name, method in methods.items():
        job = client.post("/jobs", json=job_body(dataset, method=method)).json()
        assert job["exports"] is None
        _finish(client, job["id"], "failed")
        assert client.get(f"/jobs/{job['id']}").json()["exports"] is None
        _finish(client, job["id"])
        shown = client.get(f"/jobs/{job['id']}").json()["exports"]
        final = f"{job['output_uri']}/final"
        none = dict.fromkeys(("params", "adapter", "hf", "hf_adapter", "gguf"))
        paths = {key: f"{final}/{path}" for key, path in expected[name].items()}
        assert shown == {"uri": final, **none, **paths}, name
        listed = client.get("/jobs", params={"limit": 1}).json()["data"][0]
        assert listed["id"] == job["id"] and listed["exports"] == shown


def test_a_job_starts_from_the_weights_of_one_that_succeeded(client: TestClient, dataset: Path) -> None:
    tokenizer = dataset.parent / "tokenizer.model"
    first = client.post("/jobs", json=job_body(dataset, tokenizer_uri=str(tokenizer))).json()

    def submit(**overrides: object) -> Any:
        return client.post("/jobs", json=job_body(dataset, from_job=first["id"], **overrides))

    # Not before it succeeded.
    early = submit()
    assert early.status_code == 422, early.text
    assert early.json()["error"]["code"] == "from_job_not_succeeded"
    assert early.json()["error"]["param"] == "from_job" and "is queued" in early.json()["error"]["message"]
    _finish(client, first["id"], "failed")  # (a failed one: its owner is told how it goes on)
    assert submit().json()["error"]["message"] == (
        f"from_job: job {first['id']} is failed; only a job that succeeded has final weights. To go on from "
        f"its last checkpoint, resume it (POST /jobs/{first['id']}/resume)."
    )
    _finish(client, first["id"])
    made = submit()
    assert made.status_code == 201, made.text
    spec = made.json()["spec"]
    assert spec["from_job"] == first["id"]
    assert spec["base_checkpoint_uri"] == f"{first['output_uri']}/final/params"
    assert spec["tokenizer_uri"] == str(tokenizer)  # (its tokenizer, unless the job names one)
    assert client.get(f"/jobs/{made.json()['id']}").json()["spec"] == spec
    own = submit(tokenizer_uri=str(dataset.parent / "other.model")).json()["spec"]
    assert own["tokenizer_uri"] == str(dataset.parent / "other.model")
    # The spec as shown, posted again, is accepted (its weights named as the server named them).
    again = client.post("/jobs", json={k: v for k, v in spec.items() if v is not None})
    assert again.status_code == 201, again.text
    assert again.json()["spec"]["base_checkpoint_uri"] == spec["base_checkpoint_uri"]
    # A job's directory is not a path a user may name: its weights only through from_job (its team's).
    export = f"{first['output_uri']}/final/params"
    for field, path in [
        ("base_checkpoint_uri", export),
        ("dataset_uri", f"{first['output_uri']}/x.txt"),
        ("output_uri", first["output_uri"]),  # (it would write over that job's checkpoints)
    ]:
        named = client.post("/jobs", json=job_body(dataset, **{field: path}))
        assert named.status_code == 422, named.text
        assert named.json()["error"]["code"] == "path_not_allowed" and named.json()["error"]["param"] == field
        assert "inside the server's job directories" in named.json()["error"]["message"]

    # A LoRA job's adapter, not exported merged: on the base it trained on (the official one here).
    lora = client.post(
        "/jobs", json=job_body(dataset, method={"type": "lora"}, tokenizer_uri=str(tokenizer))
    ).json()
    _finish(client, lora["id"])
    on_lora = client.post("/jobs", json=job_body(dataset, from_job=lora["id"]))
    assert on_lora.status_code == 201, on_lora.text
    spec = on_lora.json()["spec"]
    assert (spec["base_checkpoint_uri"], spec["adapter_uri"]) == (None, f"{lora['output_uri']}/final/adapter")
    # A full fine-tune of a GGUF file's weights, without a tokenizer: its tokenizer was the file's, still.
    gguf = str(dataset.parent / "base.gguf")
    on_gguf = client.post("/jobs", json=job_body(dataset, base_checkpoint_uri=gguf)).json()
    _finish(client, on_gguf["id"])
    spec = client.post("/jobs", json=job_body(dataset, from_job=on_gguf["id"])).json()["spec"]
    assert (spec["base_checkpoint_uri"], spec["tokenizer_uri"]) == (
        f"{on_gguf['output_uri']}/final/params",
        gguf,
    )
    # A Hugging Face model directory's weights, without a tokenizer: its tokenizer.model was the job's.
    hf_dir = dataset.parent / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    on_hf = client.post("/jobs", json=job_body(dataset, base_checkpoint_uri=str(hf_dir))).json()
    _finish(client, on_hf["id"])
    spec = client.post("/jobs", json=job_body(dataset, from_job=on_hf["id"])).json()["spec"]
    assert spec["tokenizer_uri"] is None  # (that directory has none: the official one, then)
    (hf_dir / "tokenizer.model").write_bytes(b"sentencepiece")
    spec = client.post("/jobs", json=job_body(dataset, from_job=on_hf["id"])).json()["spec"]
    assert (spec["base_checkpoint_uri"], spec["tokenizer_uri"]) == (
        f"{on_hf['output_uri']}/final/params",
        str(hf_dir / "tokenizer.model"),
    )
    # One of its own started so: its adapter was trained on a base and an adapter, one too many.
    twice = client.post("/jobs", json=job_body(dataset, method={"type": "lora"}, from_job=lora["id"])).json()
    _finish(client, twice["id"])
    for overrides, code in [
        ({"from_job": "ft-nowhere"}, "from_job_not_found"),
        ({"from_job": twice["id"]}, "from_job_not_merged"),
        ({"model": "gemma3-1b-pt"}, "from_job_model_mismatch"),
        ({"base_checkpoint_uri": str(dataset.parent / "ckpt")}, "conflicting_fields"),
        ({"adapter_uri": str(dataset.parent / "adapter")}, "conflicting_fields"),
    ]:
        refused = client.post("/jobs", json=job_body(dataset, **{"from_job": first["id"], **overrides}))
        assert refused.status_code == 422, (overrides, refused.text)
        assert refused.json()["error"]["code"] == code and refused.json()["error"]["param"] == "from_job"


def test_a_job_starts_from_a_checkpoint_of_another(client: TestClient, dataset: Path) -> None:
    """from_step: the checkpoint the job reported at that step (of a job still running, too), while it is
    kept; a LoRA job's as an adapter on its base. Its sentence where there is none, or none any more."""
    from tests.test_progress import new_run, post

    tokenizer = str(dataset.parent / "tokenizer.model")
    full = client.post("/jobs", json=job_body(dataset, tokenizer_uri=tokenizer)).json()
    lora = client.post(
        "/jobs", json=job_body(dataset, tokenizer_uri=tokenizer, method={"type": "lora"})
    ).json()
    for job in (full, lora):
        kept = f"{job['output_uri']}/checkpoints/20"
        Path(kept).mkdir(parents=True)
        checkpoints = [
            {"kind": "checkpoint", "step": n, "uri": f"{job['output_uri']}/checkpoints/{n}"} for n in (10, 20)
        ]
        assert post(client, job["id"], new_run(client, job["id"]), checkpoints).status_code == 200

    def submit(source: dict, step: int | None, **overrides: object) -> Any:
        return client.post(
            "/jobs", json=job_body(dataset, from_job=source["id"], from_step=step, **overrides)
        )

    made = submit(full, 20)  # (it runs still)
    assert made.status_code == 201, made.text
    spec = made.json()["spec"]
    assert (spec["from_step"], spec["base_checkpoint_uri"]) == (20, f"{full['output_uri']}/checkpoints/20")
    assert spec["adapter_uri"] is None and spec["tokenizer_uri"] == tokenizer
    assert submit(full, 20, base_checkpoint_uri=spec["base_checkpoint_uri"]).status_code == 201  # (as shown)
    on_lora = submit(lora, 20).json()["spec"]
    assert (on_lora["base_checkpoint_uri"], on_lora["adapter_uri"]) == (
        None,
        f"{lora['output_uri']}/checkpoints/20",
    )
    # A running job has no final weights: said so, with the way to its checkpoints.
    assert submit(full, None).json()["error"]["message"] == (
        f"from_job: job {full['id']} is running; only a job that succeeded has final weights. To start from "
        f"one of its checkpoints, give from_step (GET /jobs/{full['id']}/checkpoints)."
    )
    for step, says in (
        (15, f"from_step: job {full['id']} saved no checkpoint at step 15; its checkpoints: GET "),
        (10, f"from_step: job {full['id']}'s checkpoint at step 10 is no longer kept (a job keeps its last "),
    ):
        refused = submit(full, step)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("from_job_checkpoint_not_found", "from_step")
        assert error["message"].startswith(says), error
    # Checkpoints on Cloud Storage: which are kept, as the job's worker last said (the one at 10 removed).
    remote = client.post("/jobs", json=job_body(dataset, tokenizer_uri=tokenizer)).json()
    saved = [
        {"kind": "checkpoint", "step": n, "uri": f"gs://out/r/checkpoints/{n}", "kept": [n]} for n in (10, 20)
    ]
    assert post(client, remote["id"], new_run(client, remote["id"]), saved).status_code == 200
    assert submit(remote, 20).json()["spec"]["base_checkpoint_uri"] == "gs://out/r/checkpoints/20"
    removed = submit(remote, 10).json()["error"]
    assert removed["code"] == "from_job_checkpoint_not_found" and "is no longer kept" in removed["message"]
    alone = client.post("/jobs", json=job_body(dataset, from_step=20))
    assert alone.status_code == 422 and alone.json()["error"]["code"] == "from_step_needs_from_job"


def test_health(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ok"}


def test_openapi_has_examples(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    create = spec["paths"]["/jobs"]["post"]
    assert create["requestBody"]["content"]["application/json"]["examples"]
    progress = spec["paths"]["/jobs/{job_id}/progress"]["post"]
    assert progress["requestBody"]["content"]["application/json"]["examples"]
    assert client.get("/docs").status_code == 200


def test_openapi_declares_the_create_body_the_route_reads_itself(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    create = spec["paths"]["/jobs"]["post"]
    body = create["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/JobCreate"}
    schemas = spec["components"]["schemas"]
    assert {"name", "model", "dataset_uri"} <= set(schemas["JobCreate"]["required"])
    # Every schema JobCreate refers to is in the document.
    refs = _refs(schemas["JobCreate"])
    assert refs and all(ref.removeprefix("#/components/schemas/") in schemas for ref in refs)
    [key] = [p for p in create["parameters"] if p["in"] == "header"]
    assert key["name"] == "Idempotency-Key" and key["schema"]["maxLength"] == 255
    assert create["security"] == [{"ApiKey": []}]


def _refs(node: object) -> set[str]:
    if isinstance(node, dict):
        return {node["$ref"]} if "$ref" in node else set().union(*map(_refs, node.values()))
    if isinstance(node, list):
        return set().union(*map(_refs, node))
    return set()


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_422(client: TestClient, dataset: Path, content_type: str | None) -> None:
    import json

    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/jobs", content=json.dumps(job_body(dataset)).encode(), headers=headers)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == "body"
    assert "Content-Type: application/json" in error["message"]
    sent = client.post(
        "/jobs", json=job_body(dataset), headers={"content-type": "application/json; charset=utf-8"}
    )
    assert sent.status_code == 201


def test_empty_body_and_wrong_types_name_the_field(client: TestClient, dataset: Path) -> None:
    empty = client.post("/jobs", content=b"", headers={"content-type": "application/json"})
    assert empty.status_code == 422 and empty.json()["error"]["code"] == "invalid_request"
    wrong = client.post("/jobs", json=job_body(dataset, name=5))
    assert wrong.status_code == 422 and wrong.json()["error"]["param"] == "name"
    array = client.post("/jobs", json=[1, 2])
    assert array.status_code == 422 and array.json()["error"]["param"] == "body"


def test_an_overlong_idempotency_key_is_422(client: TestClient, dataset: Path) -> None:
    response = client.post("/jobs", json=job_body(dataset), headers={"Idempotency-Key": "k" * 256})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["param"] == "header.idempotency-key" and "255" in error["message"]
    assert (
        client.post("/jobs", json=job_body(dataset), headers={"Idempotency-Key": "k" * 255}).status_code
        == 201
    )


def test_followed_streams_do_not_hold_database_connections(
    live_api: Callable[..., LiveApi], dataset: Path
) -> None:
    """A client following a job's events (the dashboard does, for as long as a job page is open) or
    logs holds no pooled connection while it waits: with more followers than connections, other requests
    are still answered at once."""
    api = live_api(dispatcher_enabled=False, database_pool_size=2)
    with api.client() as http:
        body = {"name": "followed", "model": "tiny", "dataset_uri": str(dataset)}
        job_id = http.post("/jobs", json=body).json()["id"]  # stays queued: its stream never ends
    with contextlib.ExitStack() as streams:
        reading = []  # (a line iterator let go closes its response: kept until the end)
        for _ in range(4):
            http = streams.enter_context(api.client())
            response = streams.enter_context(
                http.stream("GET", f"/jobs/{job_id}/events", params={"follow": "true"}, timeout=30)
            )
            reading.append(response.iter_lines())
            assert next(reading[-1]).startswith("id: ")  # the stream has begun
        with api.client() as http:
            for path in ("/events", "/metrics", "/checkpoints", ""):
                started = time.monotonic()
                assert http.get(f"/jobs/{job_id}{path}", timeout=30).status_code == 200, path
                assert time.monotonic() - started < 2.0, path  # not after the pool's 5 s timeout


def test_more_requests_than_threads_and_connections_never_deadlock(
    live_api: Callable[..., LiveApi], dataset: Path
) -> None:
    """Finished requests give their connection back even when every route thread waits for one (the
    events route reads through a session on a route thread; the list, on the event loop, in between)."""
    api = live_api(dispatcher_enabled=False, worker_threads=2, database_pool_size=2)
    with api.client() as http:
        ids = []
        for i in range(60):
            body = {"name": f"j{i}", "model": "tiny", "dataset_uri": str(dataset)}
            created = http.post("/jobs", json=body)
            assert created.status_code == 201
            ids.append(created.json()["id"])

    def list_page(i: int) -> int:
        with api.client() as http:
            if i % 4 == 0:
                return http.get("/jobs", params={"limit": 50}).status_code
            return http.get(f"/jobs/{ids[i % 60]}/events", params={"limit": 50}).status_code

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=32) as pool:
        codes = list(pool.map(list_page, range(200)))
    assert codes == [200] * 200
    assert time.monotonic() - started < 60


def test_a_client_gone_before_its_body_arrived_is_a_499_not_a_server_error(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that disconnects while it sends its body (a killed CLI, a timeout): nobody to answer, and not
    an error of ours to log with a traceback or count as a 500."""

    async def call(path: str) -> list[dict[str, Any]]:
        arriving: list[dict[str, Any]] = [
            {"type": "http.request", "body": b'{"name": "', "more_body": True},
            {"type": "http.disconnect"},
        ]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return arriving.pop(0) if arriving else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer tok")]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [*headers, (b"content-length", b"1000"), (b"host", b"testserver")],
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
        }
        await client.app(scope, receive, send)  # type: ignore[arg-type]
        return sent

    # (read by the route itself: a direct route, and not; and by FastAPI)
    paths = ["/jobs", "/jobs/ft-gone/progress", "/admin/keys"]
    with caplog.at_level(logging.INFO):
        for path in paths:
            assert client.portal is not None
            sent = client.portal.call(call, path)
            assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499, (path, sent)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    metrics = client.get("/metrics").text
    for route in ("/jobs", "/jobs/{job_id}/progress", "/admin/keys"):
        assert f'tputune_http_requests_total{{method="POST",route="{route}",status="499"}} 1.0' in metrics
