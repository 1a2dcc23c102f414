"""Database engine and sessions (SQLite by default, PostgreSQL in production)."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from sqlalchemy import event, text
from sqlalchemy.dialects import postgresql, sqlite
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
        connect_args = {"check_same_thread": False, "timeout": 30, "factory": SerializedWrites}
        engine = create_engine(url, connect_args=connect_args, **pool)

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


# --- SQLite: one writer at a time, waiting on a lock instead of SQLite's busy handler ---

# SQLite lets one connection write at a time. A writer that finds the database locked sleeps in SQLite's
# busy handler (1, 2, 5, 10 ... 100 ms between tries) and may find it locked again, by a thread that holds
# the lock while it waits for the GIL. With the dispatcher committing each job's moves while the job writer
# stored new ones, POST /jobs waited in those sleeps: its p99 was 222 ms at half the rate 2 cores serve
# (PostgreSQL: 26 ms). So writers queue on a lock that lets the next one go at once: the threads of one
# process on a threading.Lock, the processes (the API and its dispatcher process, a `tputune` command) on
# flock(2) of a file beside the database. Connections that do not use this class (sqlite3 itself) still
# meet the busy handler.
# Weak: a lock (and its file descriptor) goes with the last connection to its database.
_WRITE_LOCKS: weakref.WeakValueDictionary[str, _WriteLock] = weakref.WeakValueDictionary()
_WRITE_LOCKS_GUARD = threading.Lock()
_WRITE_WAIT_SECONDS = 30.0  # then go on to SQLite's own wait, as before (a thread writing on two connections)
_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "BEGIN")
WRITE_LOCK_SUFFIX = "-writer.lock"


class _WriteLock:
    """The write lock of one database file in this process: a threading.Lock, and for a file, flock(2) of
    `<file>-writer.lock` taken by the thread that holds the threading.Lock.

    A writer that finds another process writing waits in flock(2) itself, so the kernel hands the lock
    over the moment it is let go, to the writers in the order they came. flock(2) has no timeout, so that
    wait runs on a thread of its own (_FileWaits), and the writer gives up on it after `timeout` (SQLite's
    busy handler then takes over). Waiting instead in sleeps between tries (0.2, then 0.5 ms) was fair to
    no one: with two API processes storing jobs (`--workers 2`), one that let go and took the lock again
    for its next batch before the other woke kept it, and POST /jobs p99 was 78-91 ms where this gets
    63-71 (SQLite, 2 cores, pairs run in turn)."""

    def __init__(self, path: str | None) -> None:
        self._threads = threading.Lock()
        self._file: _FileWaits | None = None
        if path is not None:
            try:
                fd = os.open(path + WRITE_LOCK_SUFFIX, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                self._file = _FileWaits(fd)
            except OSError:  # a read-only directory: only the threads of this process queue
                self._file = None
        self._flocked = False

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        if not self._threads.acquire(timeout=timeout):
            return False
        if self._file is not None:
            self._flocked = self._file.lock(deadline)
        return True

    def try_acquire(self) -> bool:
        """The lock if no one holds it (nor waits in flock(2) for it), without waiting."""
        if not self._threads.acquire(blocking=False):
            return False
        if self._file is not None:
            if not self._file.try_lock():
                self._threads.release()
                return False
            self._flocked = True
        return True

    def release(self) -> None:
        if self._flocked:
            self._flocked = False
            assert self._file is not None
            fcntl.flock(self._file.fd, fcntl.LOCK_UN)
        self._threads.release()

    def __del__(self) -> None:
        if self._file is not None:
            self._file.close()


class _FileWaits:
    """flock(2) of one file, with a deadline: a thread waits in flock(2) for the writer that holds the
    process's threading.Lock (one at a time). Each wait is a turn: `granted` is the last turn the thread
    got the lock for, `abandoned` the last one a writer stopped waiting for."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._turns = threading.Condition()
        self._asked = self._granted = self._abandoned = 0
        self._waiting = False  # the thread is in flock(2)
        self._closed = False
        self._thread: threading.Thread | None = None

    def lock(self, deadline: float) -> bool:
        with self._turns:
            # While the thread still waits for an abandoned turn, a lock taken here would be its too (flock
            # belongs to the open file, not the thread), and it would let it go: so ask it, in turn.
            if not self._waiting:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    pass
            if self._thread is None:
                self._thread = threading.Thread(target=self._wait, name="tputune-sqlite-flock", daemon=True)
                self._thread.start()
            self._asked += 1
            turn = self._asked
            self._turns.notify_all()
            while self._granted != turn:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._abandoned = turn
                    return False
                self._turns.wait(left)
            return True

    def try_lock(self) -> bool:
        with self._turns:
            if self._waiting:  # the thread waits for an abandoned turn: the lock would be its too
                return False
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False

    def _wait(self) -> None:
        while True:
            with self._turns:
                while not self._closed and self._asked in (self._granted, self._abandoned):
                    self._turns.wait()
                if self._closed:
                    os.close(self.fd)
                    return
                turn = self._asked
                self._waiting = True
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # (without the GIL)
            with self._turns:
                self._waiting = False
                if self._abandoned == turn:
                    fcntl.flock(self.fd, fcntl.LOCK_UN)  # its writer went on without it
                self._granted = turn
                self._turns.notify_all()

    def close(self) -> None:
        with self._turns:
            self._closed = True
            if self._thread is None:
                os.close(self.fd)
            self._turns.notify_all()  # the thread closes it once out of flock(2)


def _write_lock(database: Any) -> _WriteLock:
    name = os.fsdecode(database) if isinstance(database, str | bytes | os.PathLike) else ""
    if not name or name == ":memory:" or name.startswith("file:"):
        return _WriteLock(None)  # a database of this connection alone
    path = os.path.abspath(name)
    with _WRITE_LOCKS_GUARD:
        lock = _WRITE_LOCKS.get(path)
        if lock is None:
            lock = _WRITE_LOCKS[path] = _WriteLock(path)
        return lock


class SerializedWrites(sqlite3.Connection):
    """A sqlite3 connection that holds its database's write lock (above) from its first write statement
    (where sqlite3 begins a transaction) to its commit or rollback."""

    def __init__(self, database: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(database, *args, **kwargs)
        self._lock = _write_lock(database)
        self._holding = False

    def cursor(self, factory: Any = None) -> Any:
        return super().cursor(factory or _SerializedCursor)

    def acquire_for_write(self) -> None:
        if not self._holding:
            self._holding = self._lock.acquire(timeout=_WRITE_WAIT_SECONDS)

    def try_acquire_for_write(self) -> bool:
        """The write lock, if it is free now (no wait)."""
        if not self._holding:
            self._holding = self._lock.try_acquire()
        return self._holding

    def release_unless_writing(self) -> None:
        if self._holding and not self.in_transaction:
            self._holding = False
            self._lock.release()

    def commit(self) -> None:
        try:
            super().commit()
        finally:
            self.release_unless_writing()

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self.release_unless_writing()

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._holding:
                self._holding = False
                self._lock.release()


class _SerializedCursor(sqlite3.Cursor):
    connection: SerializedWrites

    def execute(self, sql: str, parameters: Any = (), /) -> Self:
        return self._run(super().execute, sql, parameters)

    def executemany(self, sql: str, parameters: Any, /) -> Self:
        return self._run(super().executemany, sql, parameters)

    def _run(self, run: Any, sql: str, parameters: Any) -> Self:
        connection = self.connection
        if not connection.in_transaction and sql.lstrip()[:7].upper().startswith(_WRITES):
            connection.acquire_for_write()
        try:
            run(sql, parameters)
            return self
        finally:
            connection.release_unless_writing()  # a statement outside a transaction, or one that failed


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
def autocommit_connection(engine: Engine) -> Iterator[Connection]:
    """A connection for work that needs no transaction: reads (one statement, or a few whose results need
    not agree) and single-statement writes. On PostgreSQL in autocommit: no BEGIN and no COMMIT/ROLLBACK,
    two round trips fewer. SQLite's driver begins no transaction for a SELECT anyway (and switching its
    isolation level costs a statement); a write there still begins one, which the caller commits."""
    with engine.connect() as connection:
        if engine.dialect.name == "postgresql":
            connection.execution_options(isolation_level="AUTOCOMMIT")
        yield connection


def upsert_insert(bind: Engine | Connection) -> Any:
    """The dialect's INSERT (`on_conflict_do_nothing`/`_do_update` on both): PostgreSQL's, or SQLite's."""
    return postgresql.insert if bind.dialect.name == "postgresql" else sqlite.insert


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    with Session(engine, expire_on_commit=False) as session:
        yield session


def ping(engine: Engine) -> None:
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))
