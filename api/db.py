"""Database engine and sessions (SQLite by default, PostgreSQL in production)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import Engine, make_url
from sqlmodel import Session, create_engine

# Sync routes run on AnyIO's worker threads (40 by default), each holding a connection while it works.
# Pooling fewer connections than that made requests wait on the pool while holding a thread, and
# connections past the pool size were opened and closed again for every request under load.
POOL_SIZE = 40


def make_engine(url: str, pool_size: int = POOL_SIZE) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        pool: dict[str, Any] = {}
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            # No cap (max_overflow=-1): a SQLite connection is only a file handle, and a request waiting
            # for one can hold the thread that a request holding one needs to finish (FastAPI serializes
            # a sync route's response on a worker thread before the session is closed): a deadlock.
            pool = {"pool_size": pool_size, "max_overflow": -1}
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **pool)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    # Fail fast when the database is away (requests answer 503) instead of hanging.
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool_size,  # as many as before at most (was 20 + 20 overflow), but kept open
        max_overflow=0,
        pool_timeout=5,
        connect_args={"connect_timeout": 3},
    )


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    with Session(engine, expire_on_commit=False) as session:
        yield session


def ping(engine: Engine) -> None:
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))
