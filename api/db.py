"""Database engine and sessions (SQLite by default, PostgreSQL in production)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DisconnectionError
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
    engine = create_engine(
        url,
        pool_size=pool_size,  # as many as before at most (was 20 + 20 overflow), but kept open
        max_overflow=0,
        pool_timeout=5,
        connect_args={"connect_timeout": 3},
    )
    _ping_when_idle(engine)
    return engine


# A pooled connection idle for longer than this is pinged before use. `pool_pre_ping` pinged on every
# checkout: a round trip per request, a third of a GET's. A connection in use more recently that the server
# dropped (a restart) fails its statement instead; SQLAlchemy then discards every connection of the pool
# opened before the failure, so one request per connection in flight gets a 503, no more.
IDLE_PING_SECONDS = 10.0


def _ping_when_idle(engine: Engine) -> None:
    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info["tputune_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get("tputune_idle_since")
        if since is None or time.monotonic() - since < IDLE_PING_SECONDS:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            # The pool discards the connection and checks out another (a new one), up to three times.
            raise DisconnectionError(
                f"a pooled connection idle for {IDLE_PING_SECONDS:.0f} s is gone"
            ) from exc


@contextmanager
def read_connection(engine: Engine) -> Iterator[Connection]:
    """A connection for reads that need no transaction (one statement, or a few whose results need not
    agree). On PostgreSQL in autocommit: no BEGIN and no ROLLBACK, two round trips fewer. SQLite's driver
    begins no transaction for a SELECT anyway (and switching its isolation level costs a statement)."""
    with engine.connect() as connection:
        if engine.dialect.name == "postgresql":
            connection.execution_options(isolation_level="AUTOCOMMIT")
        yield connection


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    with Session(engine, expire_on_commit=False) as session:
        yield session


def ping(engine: Engine) -> None:
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))
