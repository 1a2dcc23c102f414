"""Deleting jobs that ended (DELETE /jobs/{id}, `tputune delete`, TPUTUNE_JOB_RETENTION_DAYS): what goes
with a job, what stays (its outputs, what it used: test_tenants.test_deleted_jobs_stay_counted_in_usage; its
webhooks: test_webhooks.test_a_job_deleted_as_it_ends_is_still_posted_once), and who may; on SQLite and
PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, text, update
from sqlmodel import Session, col, select

from api import deletion, housekeeping
from api import jobs as service
from api.cli import main
from api.errors import ApiError
from api.models import IdempotencyKey, Job, JobEvent, JobLog, JobMetadata, UsageSpan, utcnow
from api.settings import Settings
from api.states import JobStatus
from api.tenants import spent
from tests.test_auth import ADMIN, bearer, make_key
from tests.test_tenants import body, server
from tests.test_webhooks import move
from worker.protocol import ProgressBatch


@pytest.fixture
def app_client(make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    with server(make_settings) as test_client:
        yield test_client


def submit(client: TestClient, key: dict[str, str], dataset: Path, **headers: str) -> str:
    response = client.post("/jobs", json=body(dataset), headers={**key, **headers})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def rows_of(client: TestClient, seq: int) -> dict[str, int]:
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        return {
            table.__tablename__: session.exec(  # type: ignore[attr-defined]
                select(func.count()).select_from(table).where(col(table.job_seq) == seq)  # type: ignore[attr-defined]
            ).one()
            for table in (JobEvent, JobMetadata, JobLog)
        }


def error(response: Any) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def test_an_ended_job_goes_with_its_events_metadata_logs_and_idempotency_key(
    app_client: TestClient, dataset: Path
) -> None:
    client = app_client
    key = make_key(client, "research")
    research = bearer(key)
    job_id = submit(client, research, dataset, **{"Idempotency-Key": "nightly-1"})
    move(client, job_id, JobStatus.starting, JobStatus.running)
    progress = {"reports": [{"kind": "metrics", "step": 1, "loss": 2.5}]}
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        service.ingest_progress(session, job, ProgressBatch.model_validate(progress))
        session.add(JobLog(job_seq=job.seq, run=0, text="step 1\n"))
        session.commit()
        seq = job.seq
    assert seq is not None and all(rows_of(client, seq).values())
    move(client, job_id, JobStatus.succeeded)
    other = submit(client, research, dataset)

    deleted = client.delete(f"/jobs/{job_id}", headers=research)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {
        "id": job_id,
        "object": "job",
        "deleted": True,
        "output_uri": client.get(f"/jobs/{other}", headers=research)
        .json()["output_uri"]
        .replace(other, job_id),
    }
    for path in ("", "/events", "/metrics", "/checkpoints", "/logs"):
        assert error(client.get(f"/jobs/{job_id}{path}", headers=research)) == (404, "job_not_found"), path
    assert error(client.delete(f"/jobs/{job_id}", headers=research)) == (404, "job_not_found")
    assert [job["id"] for job in client.get("/jobs", headers=research).json()["data"]] == [other]
    assert rows_of(client, seq) == {"job_events": 0, "job_metadata": 0, "job_logs": 0}
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        assert session.exec(select(IdempotencyKey)).all() == []
    # The same key and body again: a new job (the key named the deleted one), not a 404 for the old.
    again = client.post("/jobs", json=body(dataset), headers={**research, "Idempotency-Key": "nightly-1"})
    assert again.status_code == 201 and again.json()["id"] not in (job_id, other)
    # Who deleted what, in the audit log.
    [audited] = client.get("/audit", params={"action": "job.deleted"}, headers=bearer(ADMIN)).json()["data"]
    assert (audited["tenant"], audited["target"], audited["details"]["status"]) == (
        "research",
        job_id,
        "succeeded",
    )
    assert (
        audited["actor"]["tenant"] == "research" and audited["actor"]["key_id"] == "key_" + key.split("_")[1]
    )
    assert audited["details"]["name"] == "fake-succeed" and audited["details"]["finished_at"]


def test_only_an_ended_job_of_the_callers_team_is_deleted(app_client: TestClient, dataset: Path) -> None:
    client = app_client
    research, vision = bearer(make_key(client, "research")), bearer(make_key(client, "vision"))
    reader = client.post(
        "/admin/keys", json={"tenant": "research", "name": "ro", "read_only": True}, headers=bearer(ADMIN)
    ).json()["key"]
    queued, running, paused, failed = (submit(client, research, dataset) for _ in range(4))
    move(client, running, JobStatus.starting, JobStatus.running)
    assert client.post(f"/jobs/{paused}/pause", headers=research).json()["status"] == "paused"
    move(client, failed, JobStatus.starting, JobStatus.failed)
    for job_id, status in [(queued, "queued"), (running, "running"), (paused, "paused")]:
        refused = client.delete(f"/jobs/{job_id}", headers=research)
        assert error(refused) == (409, "job_not_ended")
        message = refused.json()["error"]["message"]
        assert f"is {status}" in message and f"POST /jobs/{job_id}/cancel" in message
    # Another team's: as if there were none; a read-only key, no key, a wrong one: refused.
    assert error(client.delete(f"/jobs/{failed}", headers=vision)) == (404, "job_not_found")
    assert error(client.delete(f"/jobs/{failed}", headers=bearer(reader))) == (403, "read_only_key")
    assert client.delete(f"/jobs/{failed}").status_code == 401
    assert client.delete(f"/jobs/{failed}", headers=bearer("tpt_abcdefghij_nope")).status_code == 401
    assert error(client.delete("/jobs/ft-nosuchjob", headers=research)) == (404, "job_not_found")
    statuses = {job["id"]: job["status"] for job in client.get("/jobs", headers=research).json()["data"]}
    assert statuses == {queued: "queued", running: "running", paused: "paused", failed: "failed"}
    # Cancelled, the paused one goes; the admin deletes any team's.
    client.post(f"/jobs/{paused}/cancel", headers=research)
    assert client.delete(f"/jobs/{paused}", headers=research).status_code == 200
    assert client.delete(f"/jobs/{failed}", headers=bearer(ADMIN)).status_code == 200
    assert {job["id"] for job in client.get("/jobs", headers=research).json()["data"]} == {queued, running}


def test_a_resume_meanwhile_wins_over_the_delete(app_client: TestClient, dataset: Path) -> None:
    """A failed job resumed while its delete reads it: the delete claims the job's row first, so it
    waits for the resume's transaction and then finds the job queued (409), not deleted under it."""
    client = app_client
    research = bearer(make_key(client, "research"))
    job_id = submit(client, research, dataset)
    move(client, job_id, JobStatus.starting, JobStatus.failed)
    engine = client.app.state.engine  # type: ignore[attr-defined]
    answers: list[Any] = []
    with Session(engine) as resume:
        # The resume's write, not committed yet (PostgreSQL: the row is locked; SQLite: the write lock held).
        resume.execute(update(Job).where(col(Job.id) == job_id).values(status="queued", finished_at=None))
        deleting = threading.Thread(
            target=lambda: answers.append(client.delete(f"/jobs/{job_id}", headers=research))
        )
        deleting.start()
        time.sleep(1.0)
        assert not answers  # (waiting for the resume)
        resume.commit()
    deleting.join(30)
    [answer] = answers
    assert error(answer) == (409, "job_not_ended") and "is queued" in answer.json()["error"]["message"]
    assert client.get(f"/jobs/{job_id}", headers=research).json()["status"] == "queued"
    with Session(engine) as session:
        assert session.exec(select(UsageSpan)).all() == []  # (nothing kept of a job not deleted)


def test_jobs_that_ended_before_the_retention_go_in_batches(
    app_client: TestClient, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = app_client
    research = bearer(make_key(client, "research"))
    engine = client.app.state.engine  # type: ignore[attr-defined]
    now = utcnow()
    old = [submit(client, research, dataset) for _ in range(5)]
    recent, running, paused = (submit(client, research, dataset) for _ in range(3))
    for job_id, ended in [*((job_id, JobStatus.succeeded) for job_id in old[:3]), (old[3], JobStatus.failed)]:
        move(client, job_id, JobStatus.starting, JobStatus.running, ended)
    client.post(f"/jobs/{old[4]}/cancel", headers=research)
    move(client, recent, JobStatus.starting, JobStatus.running, JobStatus.succeeded)
    move(client, running, JobStatus.starting, JobStatus.running)
    client.post(f"/jobs/{paused}/pause", headers=research)
    with Session(engine) as session:
        # Ran from 11 days ago until 10 (the old ones), 2 days ago until 1 (the recent one); the cancelled
        # one never ran, and ended 12 days ago; the others were made 20 days ago.
        for ids, began, ended in [(old[:4], 11, 10), ([recent], 2, 1)]:
            session.execute(
                update(Job)
                .where(col(Job.id).in_(ids))
                .values(admitted_at=now - timedelta(days=began), finished_at=now - timedelta(days=ended))
            )
        session.execute(update(Job).where(col(Job.id) == old[4]).values(finished_at=now - timedelta(days=12)))
        for job_id in (running, paused):
            session.execute(
                update(Job).where(col(Job.id) == job_id).values(created_at=now - timedelta(days=20))
            )
        session.commit()
    since = now - timedelta(days=30)
    with Session(engine) as session:
        before = spent(session, client.app.state.settings, since, now)["research"]  # type: ignore[attr-defined]
    settings: Settings = client.app.state.settings  # type: ignore[attr-defined]
    assert housekeeping.prune(engine, settings, now)["jobs"] == 0  # (no retention set: kept)
    monkeypatch.setattr(deletion, "BATCH", 2)
    statements: list[str] = []
    with monkeypatch.context() as patched:
        patched.setattr(deletion, "_delete", counting(deletion._delete, statements))
        pruned = housekeeping.prune(engine, settings.model_copy(update={"job_retention_days": 7}), now)
    assert pruned["jobs"] == 5 and len(statements) == 3  # (2, 2 and 1)
    left = {job["id"] for job in client.get("/jobs", headers=research).json()["data"]}
    assert left == {recent, running, paused}
    with Session(engine) as session:
        after = spent(session, settings, since, now)["research"]
        # (the cancelled one never ran: four deleted jobs ran, one day each; kept as they were counted)
        assert len({span.job_id for span in session.exec(select(UsageSpan)).all()}) == 4
    assert (after.jobs, after.trained_tokens) == (before.jobs, before.trained_tokens) == (5, 0)
    assert after.chip_seconds == pytest.approx(before.chip_seconds) == pytest.approx(5 * 86_400)


def counting(delete: Callable[..., Any], calls: list[str]) -> Callable[..., Any]:
    def wrapped(session: Session, seqs: Any) -> Any:
        calls.append(str(seqs))
        return delete(session, seqs)

    return wrapped


def test_a_local_jobs_records_go_and_its_outputs_stay(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The local executor's job directory: the job's config, its runner's records and its workers' logs
    go; the model it wrote (the default output_uri is in that directory) stays. `tputune delete`."""
    api = live_api()
    outside = dataset.parent / "elsewhere"
    with api.client() as http:
        ids = []
        for output in (None, str(outside)):
            spec = {**body(dataset), "metadata": {"fake": "succeed", "steps": "2"}}
            spec |= {"output_uri": output} if output else {}
            ids.append(http.post("/jobs", json=spec).json()["id"])
        deadline = time.monotonic() + 60
        while {http.get(f"/jobs/{job_id}").json()["status"] for job_id in ids} != {"succeeded"}:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        jobs_dir = api.settings.jobs_dir
        inside = jobs_dir / ids[0]
        (inside / "output").mkdir(exist_ok=True)
        (inside / "output" / "model.safetensors").write_text("weights")
        assert {"config.json", "worker.log", "runner.json", "exit.json"} <= {p.name for p in inside.iterdir()}
        assert http.get(f"/jobs/{ids[0]}/logs").json()["lines"]
        assert main(["--api-url", api.url, "list", "--status", "succeeded", "-q"]) == 0
        assert capsys.readouterr().out.split() == ids[::-1]  # (newest first)
        code = main(["--api-url", api.url, "delete", ids[0], ids[1], "ft-nosuchjob"])
        out, err = capsys.readouterr()
        assert code == 3
        assert out.splitlines() == [
            f"{ids[0]} deleted (its outputs stay at {inside / 'output'})",
            f"{ids[1]} deleted (its outputs stay at {outside})",
        ]
        assert "error: ft-nosuchjob: No job with id 'ft-nosuchjob'" in err
        assert [p.name for p in inside.iterdir()] == ["output"]
        assert (inside / "output" / "model.safetensors").read_text() == "weights"
        assert not (jobs_dir / ids[1]).exists()
        assert http.get(f"/jobs/{ids[0]}/logs").status_code == 404


def test_a_jobs_rows_go_by_the_foreign_keys(app_client: TestClient) -> None:
    """Every table that holds a job's rows deletes them with it (ON DELETE CASCADE), on both databases:
    a table added later without it would keep rows of deleted jobs, or refuse the delete."""
    engine = app_client.app.state.engine  # type: ignore[attr-defined]
    tables = ("job_events", "job_metadata", "job_logs")
    with Session(engine) as session:
        referring = {
            table.name
            for table in Job.metadata.sorted_tables
            for fk in table.foreign_keys
            if fk.column.table.name == "jobs"
        }
        assert referring == set(tables)
        if engine.dialect.name == "postgresql":
            rules = session.exec(  # type: ignore[call-overload]
                text(
                    "SELECT tc.table_name, rc.delete_rule FROM information_schema.referential_constraints rc "
                    "JOIN information_schema.table_constraints tc ON tc.constraint_name = rc.constraint_name"
                )
            ).all()
        else:
            rules = [
                (table, row[6])
                for table in tables
                for row in session.exec(text(f"PRAGMA foreign_key_list({table})")).all()  # type: ignore[call-overload]
            ]
        assert {table: rule for table, rule in rules if table in tables} == dict.fromkeys(tables, "CASCADE")


def test_a_report_for_a_job_deleted_after_its_token_was_checked_is_a_401(
    app_client: TestClient, dataset: Path
) -> None:
    """A worker's late report (a retry) as its ended job is deleted: the job's rows refused by their
    foreign key are the job token's 401, as for a job that is not there, not a 500."""
    client = app_client
    research = bearer(make_key(client, "research"))
    job_id = submit(client, research, dataset)
    move(client, job_id, JobStatus.starting, JobStatus.running, JobStatus.succeeded)
    engine = client.app.state.engine  # type: ignore[attr-defined]
    late = ProgressBatch.model_validate({"reports": [{"kind": "metrics", "step": 9, "loss": 1.0}]})
    with Session(engine) as session:
        job = session.exec(select(Job).where(Job.id == job_id)).one()  # (as the route's token check read it)
        assert client.delete(f"/jobs/{job_id}", headers=research).status_code == 200
        with pytest.raises(ApiError) as refused:
            service.ingest_progress(session, job, late)
    assert (refused.value.status, refused.value.code) == (401, "invalid_job_token")
