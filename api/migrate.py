"""Alembic, configured in code: the migrations in migrations/ are the only way the schema changes."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, make_url, text

from api.db import make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Alembic's ini interpolation treats % specially (URL-encoded passwords contain it).
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


# The PostgreSQL advisory lock every process takes to migrate ("tptu").
MIGRATION_LOCK_KEY = 0x74707475


def upgrade(database_url: str, revision: str = "head") -> None:
    """Migrate to `revision`. Several API replicas may start at once: each migrates under one lock, so the
    first does the work and the others wait, then find nothing left to do."""
    config = alembic_config(database_url)
    with _migration_lock(database_url) as connection:
        if connection is not None:
            config.attributes["connection"] = connection
        command.upgrade(config, revision)


@contextmanager
def _migration_lock(database_url: str) -> Iterator[Connection | None]:
    url = make_url(database_url)
    if url.get_backend_name() == "postgresql":
        engine = make_engine(database_url)
        try:
            with engine.connect() as connection:
                # A session lock: it outlives the transactions Alembic commits on this connection.
                connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
                connection.commit()
                try:
                    yield connection
                finally:
                    connection.rollback()  # a failed migration leaves its transaction open
                    connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
                    connection.commit()
        finally:
            engine.dispose()
    elif url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        lock_path = Path(url.database).with_name(Path(url.database).name + ".migrate-lock")
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with lock_path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield None
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    else:
        yield None


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


def revision(database_url: str, message: str) -> None:
    command.revision(alembic_config(database_url), message=message, autogenerate=True)
