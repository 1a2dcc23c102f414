"""Alembic is the only schema path: upgrade, downgrade and upgrade again, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, insert, inspect, text
from sqlmodel import Session, select

from api.db import make_engine
from api.jobs import prepare_job, write_jobs
from api.migrate import downgrade, upgrade
from api.models import Job, JobEvent, as_utc, utcnow
from api.schemas import JobCreate
from api.settings import Settings

TABLES = {
    "jobs",
    "job_events",
    "job_metadata",
    "idempotency_keys",
    "api_keys",
    "key_usage",
    "tenants",
    "webhooks",
    "webhook_deliveries",
    "webhook_cursor",
    "audit_events",
    "job_logs",
    "usage_spans",
}


def tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_roundtrip(database_url: str) -> None:
    # The fixture already upgraded to head.
    assert tables(database_url) == TABLES
    downgrade(database_url, "base")
    assert tables(database_url) == set()
    upgrade(database_url)
    assert tables(database_url) == TABLES
    engine = create_engine(database_url)
    indexes = {ix["name"] for ix in inspect(engine).get_indexes("jobs")}
    engine.dispose()
    assert {"ix_jobs_tenant_seq", "ix_jobs_tenant_status_seq"} <= indexes


def test_models_match_migrations(database_url: str) -> None:
    """The tables the code declares are exactly what the migrations built (no forgotten migration)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlmodel import SQLModel

    import api.models  # noqa: F401

    engine = create_engine(database_url)
    with engine.connect() as connection:
        diff = compare_metadata(MigrationContext.configure(connection), SQLModel.metadata)
    engine.dispose()
    assert diff == []


def test_replicas_starting_at_once_migrate_once(database_url: str) -> None:
    """Several API processes upgrade the same empty database together: one migrates, none fails."""
    downgrade(database_url, "base")
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def start_replica() -> None:
        barrier.wait()
        try:
            upgrade(database_url)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start_replica) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert tables(database_url) == TABLES
    engine = create_engine(database_url)
    with engine.connect() as connection:
        versions = connection.execute(text("SELECT version_num FROM alembic_version")).all()
    engine.dispose()
    assert len(versions) == 1


def test_job_preemptions_are_counted_from_the_moves_stored_before(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """0007 counts each job's moves from running back to queued (Kueue preemptions) made before it; its
    downgrade drops the column only, not the jobs' events."""
    settings = make_settings()
    url = settings.resolved_database_url
    downgrade(url, "0006")
    engine = make_engine(url)
    spec = JobCreate.model_validate({"name": "j", "model": "tiny", "dataset_uri": str(dataset)})
    jobs = [prepare_job(spec, settings, "alpha") for _ in range(2)]
    moves = {
        jobs[0].id: ["starting", "running", "queued", "starting", "running", "queued", "starting"],
        jobs[1].id: ["starting", "queued", "starting", "running", "succeeded"],  # (held back before it ran)
    }
    with engine.begin() as connection:
        write_jobs(connection, jobs)  # (the writer's statements name their columns: no preemptions)
        for job_id, statuses in moves.items():
            seq = connection.execute(text("SELECT seq FROM jobs WHERE id = :id"), {"id": job_id}).scalar_one()
            previous = "queued"
            for status in statuses:
                data = {"status": status, "from": previous}
                row = {"job_seq": seq, "created_at": utcnow(), "type": "status", "message": "", "data": data}
                connection.execute(insert(JobEvent.__table__), row)  # type: ignore[attr-defined]
                previous = status
            phase = {"kind": "status", "phase": "training", "from": "running", "message": "queued"}
            row = {"job_seq": seq, "created_at": utcnow(), "type": "status", "message": "", "data": phase}
            connection.execute(insert(JobEvent.__table__), row)  # type: ignore[attr-defined]
    events = "SELECT count(*) FROM job_events"
    with engine.connect() as connection:
        stored = connection.execute(text(events)).scalar_one()
    engine.dispose()

    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as connection:
        counted = dict(connection.execute(text("SELECT id, preemptions FROM jobs")).all())  # type: ignore[arg-type]
    engine.dispose()
    assert counted == {jobs[0].id: 2, jobs[1].id: 0}

    downgrade(url, "0006")
    engine = make_engine(url)
    with engine.connect() as connection:
        columns = {column["name"] for column in inspect(connection).get_columns("jobs")}
        assert "preemptions" not in columns
        assert connection.execute(text(events)).scalar_one() == stored
        assert connection.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 2
    engine.dispose()
    upgrade(url)


def test_when_jobs_took_their_chips_is_read_from_the_events_stored_before(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """0008 sets each job's admitted_at from its events: its latest launch, or admission after Kueue held
    it; none for a job held or waiting queued since, or never launched. 0009 its held_seconds: the time
    from each launch or admission to the next move back to the queue."""
    settings = make_settings()
    url = settings.resolved_database_url
    downgrade(url, "0007")
    engine = make_engine(url)
    spec = JobCreate.model_validate({"name": "j", "model": "tiny", "dataset_uri": str(dataset)})
    names = ["ran", "held_then_admitted", "held_then_cancelled", "never_launched", "preempted_waiting"]
    jobs = {name: prepare_job(spec, settings, "alpha") for name in names}
    # Each job's events as the dispatcher wrote them: a move (its status), or "launch".
    histories = {
        "ran": ["starting", "launch", "running", "succeeded"],
        "held_then_admitted": ["starting", "launch", "queued", "starting", "running", "succeeded"],
        "held_then_cancelled": ["starting", "launch", "queued", "cancelling", "cancelled"],
        "never_launched": ["starting", "failed"],
        "preempted_waiting": ["starting", "launch", "running", "queued"],
    }
    start = utcnow() + timedelta(minutes=1)  # (after each job's first event, "queued", written now)
    expected: dict[str, datetime | None] = {}
    held_for: dict[str, float] = {}
    with engine.begin() as connection:
        write_jobs(connection, list(jobs.values()))
        for name, history in histories.items():
            job_id = jobs[name].id
            seq = connection.execute(text("SELECT seq FROM jobs WHERE id = :id"), {"id": job_id}).scalar_one()
            status, launched, admitted, held = "queued", None, None, 0.0
            for i, what in enumerate(history):
                at = start + timedelta(minutes=len(expected) * 10 + i)
                if what == "launch":
                    row = {"job_seq": seq, "created_at": at, "type": "launch", "message": "Workers started."}
                    launched = admitted = at
                else:
                    data = {"status": what, "from": status}
                    row = {"job_seq": seq, "created_at": at, "type": "status", "message": "", "data": data}
                    if status == "queued" and what == "starting" and launched is not None:
                        admitted = at
                    elif what == "queued":
                        held += (at - admitted).total_seconds() if admitted is not None else 0.0
                        admitted = None
                    status = what
                connection.execute(insert(JobEvent.__table__), row)  # type: ignore[attr-defined]
            connection.execute(
                text("UPDATE jobs SET status = :status, launched_at = :launched WHERE seq = :seq"),
                {"status": status, "launched": launched, "seq": seq},
            )
            expected[job_id], held_for[job_id] = admitted, held
    engine.dispose()
    assert [expected[jobs[name].id] is not None for name in names] == [True, True, False, False, False]
    assert [held_for[jobs[name].id] for name in names] == [0, 60, 60, 0, 120]

    upgrade(url)
    engine = make_engine(url)
    with Session(engine) as session:
        stored = list(session.exec(select(Job)))
    engine.dispose()
    assert {job.id: as_utc(job.admitted_at) for job in stored} == expected
    assert {job.id: job.held_seconds for job in stored} == pytest.approx(held_for, abs=0.01)
    downgrade(url, "0007")
    upgrade(url)


def test_jobs_stored_before_pauses_were_never_paused(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """0010 adds jobs.pauses: 0 for the jobs stored before (whatever else they went through). Its downgrade
    drops the column only: the jobs, their events and metadata stay (SQLite's DROP COLUMN, not a copy of
    the table whose drop would take them by ON DELETE CASCADE), and upgrading again gives them 0 again."""
    settings = make_settings()
    url = settings.resolved_database_url
    downgrade(url, "0009")
    engine = make_engine(url)
    spec = JobCreate.model_validate(
        {"name": "j", "model": "tiny", "dataset_uri": str(dataset), "metadata": {"team": "nlp"}}
    )
    jobs = [prepare_job(spec, settings, "alpha") for _ in range(3)]
    with engine.begin() as connection:
        write_jobs(connection, jobs)  # (the writer's statements name their columns: no pauses)
        seqs = [
            connection.execute(text("SELECT seq FROM jobs WHERE id = :id"), {"id": job.id}).scalar_one()
            for job in jobs
        ]
        previous = "queued"
        for status in ("starting", "running", "queued", "starting", "running", "succeeded"):
            data = {"status": status, "from": previous}
            row = {"job_seq": seqs[0], "created_at": utcnow(), "type": "status", "message": "", "data": data}
            connection.execute(insert(JobEvent.__table__), row)  # type: ignore[attr-defined]
            previous = status
        connection.execute(
            text(
                "UPDATE jobs SET status = 'succeeded', preemptions = 1, held_seconds = 42.5, restarts = 2 "
                "WHERE seq = :seq"
            ),
            {"seq": seqs[0]},
        )
        connection.execute(text("UPDATE jobs SET status = 'running' WHERE seq = :seq"), {"seq": seqs[1]})
    engine.dispose()

    def stored() -> dict[str, tuple[object, ...]]:
        engine = make_engine(url)
        try:
            with engine.connect() as connection:
                columns = "id, status, preemptions, held_seconds, restarts"
                rows = connection.execute(text(f"SELECT {columns} FROM jobs")).all()
        finally:
            engine.dispose()
        return {row[0]: tuple(row[1:]) for row in rows}

    def counts() -> tuple[int, int, int]:
        engine = make_engine(url)
        try:
            with engine.connect() as connection:
                return tuple(  # type: ignore[return-value]
                    connection.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
                    for table in ("jobs", "job_events", "job_metadata")
                )
        finally:
            engine.dispose()

    def pauses() -> dict[str, int]:
        engine = make_engine(url)
        try:
            with engine.connect() as connection:
                return dict(connection.execute(text("SELECT id, pauses FROM jobs")).all())  # type: ignore[arg-type]
        finally:
            engine.dispose()

    before, stored_counts = stored(), counts()
    assert stored_counts == (3, 3 + 6, 3)  # (each job's "queued" event and metadata, the first's moves)
    assert before[jobs[0].id] == ("succeeded", 1, 42.5, 2)

    upgrade(url)
    assert pauses() == {job.id: 0 for job in jobs}
    assert stored() == before and counts() == stored_counts
    engine = make_engine(url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE jobs SET pauses = 3 WHERE seq = :seq"), {"seq": seqs[2]})
        # A job written now names no pauses either: the column's default.
        later = prepare_job(spec, settings, "alpha")
        write_jobs(connection, [later])
    with Session(engine) as session:
        assert session.exec(select(Job).where(Job.id == later.id)).one().pauses == 0
    engine.dispose()
    assert pauses()[jobs[2].id] == 3

    downgrade(url, "0009")
    engine = make_engine(url)
    with engine.connect() as connection:
        columns = {column["name"] for column in inspect(connection).get_columns("jobs")}
    engine.dispose()
    assert "pauses" not in columns and {"preemptions", "held_seconds", "admitted_at"} <= columns
    assert stored() == {**before, later.id: ("queued", 0, 0.0, 0)}
    assert counts() == (4, 3 + 6 + 1, 3 + 1)

    upgrade(url)
    assert pauses() == {**{job.id: 0 for job in jobs}, later.id: 0}
    assert stored() == {**before, later.id: ("queued", 0, 0.0, 0)}
    assert counts() == (4, 10, 4)


def test_the_webhook_sender_starts_after_the_events_stored_before(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """0011 adds webhooks: the sender's cursor starts at the last job event stored (an endpoint hears of
    moves made after it was created: the events before need never be read), 0 with none."""
    settings = make_settings()
    url = settings.resolved_database_url
    downgrade(url, "0010")
    engine = make_engine(url)
    spec = JobCreate.model_validate({"name": "j", "model": "tiny", "dataset_uri": str(dataset)})
    with engine.begin() as connection:
        write_jobs(connection, [prepare_job(spec, settings, "alpha") for _ in range(3)])
        last = connection.execute(text("SELECT max(id) FROM job_events")).scalar_one()
    engine.dispose()
    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT id, event_id FROM webhook_cursor")).all() == [(1, last)]
    engine.dispose()
    assert last >= 3  # (each job's creation is an event)
    downgrade(url, "0010")
    engine = make_engine(url)
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM jobs"))
    engine.dispose()
    upgrade(url)
    engine = make_engine(url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT event_id FROM webhook_cursor")).scalar_one() == 0
    engine.dispose()


WEBHOOK_COLUMNS_0012 = (
    "failing_since",
    "disabled_at",
    "disabled_reason",
    "enabled_at",
    "old_secret",
    "old_secret_until",
)


def test_webhooks_stored_before_are_enabled_and_keep_their_deliveries(database_url: str) -> None:
    """0012 adds an endpoint's failure streak and disabling: those stored before are enabled, with no
    streak; going back to 0011 drops the columns and keeps every endpoint's deliveries (a batch copy of
    the table would drop them by their foreign key's cascade on SQLite)."""
    downgrade(database_url, "0011")
    engine = make_engine(database_url)
    now = utcnow()
    hook = {"id": "wh_1", "tenant": "t", "url": "https://example.com/", "events": '["job.failed"]'}
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO webhooks (id, tenant, url, events, secret, created_at) "
                "VALUES (:id, :tenant, :url, :events, 'whsec_x', :now)"
            ),
            {**hook, "now": now},
        )
        connection.execute(
            text(
                "INSERT INTO webhook_deliveries (webhook_id, type, body, status, attempts, created_at) "
                "VALUES ('wh_1', 'webhook.test', '{}', 'delivered', 1, :now)"
            ),
            {"now": now},
        )
    engine.dispose()

    def stored() -> tuple[list[Any], int]:
        engine = make_engine(database_url)
        with engine.connect() as connection:
            columns = {column["name"] for column in inspect(connection).get_columns("webhooks")}
            added = sorted(set(WEBHOOK_COLUMNS_0012) & columns)
            rows = connection.execute(text(f"SELECT id, {', '.join(['url', *added])} FROM webhooks")).all()
            count = connection.execute(text("SELECT count(*) FROM webhook_deliveries")).scalar_one()
        engine.dispose()
        return [tuple(row) for row in rows], count

    upgrade(database_url)
    assert stored() == ([("wh_1", "https://example.com/", *[None] * len(WEBHOOK_COLUMNS_0012))], 1)
    downgrade(database_url, "0011")
    assert stored() == ([("wh_1", "https://example.com/")], 1)
    upgrade(database_url)


def test_tenants_stored_before_keep_their_limits_and_have_the_servers_data_prefixes(
    database_url: str,
) -> None:
    """0013 adds a tenant's own data prefixes: those stored before have none (the server's hold); going
    back to 0012 drops them and keeps the limits."""
    downgrade(database_url, "0012")
    engine = make_engine(database_url)
    with engine.begin() as connection:
        connection.execute(
            text("INSERT INTO tenants (name, max_active_jobs, updated_at) VALUES ('research', 2, :now)"),
            {"now": utcnow()},
        )
    engine.dispose()

    def stored() -> list[Any]:
        engine = make_engine(database_url)
        with engine.connect() as connection:
            columns = {column["name"] for column in inspect(connection).get_columns("tenants")}
            added = ", data_prefixes" if "data_prefixes" in columns else ""
            rows = connection.execute(text(f"SELECT name, max_active_jobs{added} FROM tenants")).all()
        engine.dispose()
        return [tuple(row) for row in rows]

    upgrade(database_url)
    assert stored() == [("research", 2, None)]
    engine = make_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text("""UPDATE tenants SET data_prefixes = '["gs://ml-data/research"]'"""))
    engine.dispose()
    downgrade(database_url, "0012")
    assert stored() == [("research", 2)]
    upgrade(database_url)
    assert stored() == [("research", 2, None)]


def test_keys_stored_before_are_not_read_only(database_url: str) -> None:
    """0015 adds api_keys.read_only: the keys stored before read and write as before; going back to 0014
    keeps them."""
    downgrade(database_url, "0014")
    engine = make_engine(database_url)
    with engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO api_keys (id, tenant, name, prefix, key_hash, created_at, admin) "
                "VALUES ('key_a', 'research', 'ci', 'tpt_a', 'h', :now, false)"
            ),
            {"now": utcnow()},
        )
    engine.dispose()
    upgrade(database_url)
    engine = make_engine(database_url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT id, read_only FROM api_keys")).all() == [("key_a", False)]
    engine.dispose()
    downgrade(database_url, "0014")
    engine = make_engine(database_url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT id, tenant FROM api_keys")).all() == [("key_a", "research")]
    engine.dispose()
    upgrade(database_url)
