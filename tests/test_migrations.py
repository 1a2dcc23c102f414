"""Alembic is the only schema path: upgrade, downgrade and upgrade again, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading

from sqlalchemy import create_engine, inspect, text

from api.migrate import downgrade, upgrade

TABLES = {"jobs", "job_events", "job_metadata", "idempotency_keys", "api_keys", "key_usage", "tenants"}


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
