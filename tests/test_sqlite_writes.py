"""SQLite writes queue on a lock (api.db.SerializedWrites), not in SQLite's busy handler: the threads of
one process on a threading.Lock, processes (the API and its dispatcher process) on flock(2).

Each connection here has SQLite's busy timeout set to 0: a writer that met the database locked would fail
at once with "database is locked" if the lock did not make it wait for the other writer's commit.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from api.db import WRITE_LOCK_SUFFIX, _WriteLock, make_engine


def _engine(path: Path) -> Engine:
    engine = make_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def _no_busy_wait(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("PRAGMA busy_timeout=0")

    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE t (k INTEGER PRIMARY KEY, who TEXT)")
    return engine


def _insert_in_thread(engine: Engine, key: int, who: str) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with engine.begin() as connection:
                connection.exec_driver_sql("INSERT INTO t VALUES (?, ?)", (key, who))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def test_a_writer_waits_for_the_open_write_transaction_then_commits(tmp_path: Path) -> None:
    engine = _engine(tmp_path / "db.sqlite")
    with engine.connect() as holder:
        holder.exec_driver_sql("INSERT INTO t VALUES (1, 'first')")  # holds the write lock, uncommitted
        thread, errors = _insert_in_thread(engine, 2, "second")
        thread.join(timeout=0.5)
        assert thread.is_alive(), f"the second writer did not wait: {errors}"
        holder.commit()
        thread.join(timeout=10)
    assert not thread.is_alive() and errors == []
    with engine.connect() as connection:
        rows = connection.exec_driver_sql("SELECT k, who FROM t ORDER BY k").all()
    assert [tuple(row) for row in rows] == [(1, "first"), (2, "second")]


def test_reads_do_not_wait_for_a_writer(tmp_path: Path) -> None:
    engine = _engine(tmp_path / "db.sqlite")
    with engine.connect() as holder, engine.connect() as reader:
        holder.exec_driver_sql("INSERT INTO t VALUES (1, 'open')")
        started = time.monotonic()
        assert reader.exec_driver_sql("SELECT count(*) FROM t").scalar() == 0  # WAL: the last commit
        assert time.monotonic() - started < 1
        holder.rollback()


@pytest.mark.parametrize("end", ["rollback", "failed statement", "close"])
def test_the_lock_is_let_go_however_the_transaction_ends(tmp_path: Path, end: str) -> None:
    engine = _engine(tmp_path / "db.sqlite")
    with engine.begin() as connection:
        connection.exec_driver_sql("INSERT INTO t VALUES (1, 'x')")
    holder = engine.connect()
    if end == "failed statement":
        with pytest.raises(IntegrityError):
            holder.exec_driver_sql("INSERT INTO t VALUES (1, 'duplicate')")
        holder.rollback()
    else:
        holder.exec_driver_sql("INSERT INTO t VALUES (2, 'x')")
        if end == "rollback":
            holder.rollback()
        else:
            holder.invalidate()  # closes the DBAPI connection itself, mid-transaction
    thread, errors = _insert_in_thread(engine, 3, "next")
    thread.join(timeout=10)
    holder.close()
    assert not thread.is_alive() and errors == []


def test_many_threads_writing_at_once_all_commit(tmp_path: Path) -> None:
    engine = _engine(tmp_path / "db.sqlite")
    threads = [_insert_in_thread(engine, key, f"t{key}") for key in range(32)]
    for thread, _ in threads:
        thread.join(timeout=30)
    assert [errors for _, errors in threads if errors] == []
    with engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT count(*) FROM t").scalar() == 32


def test_separate_database_files_do_not_share_a_lock(tmp_path: Path) -> None:
    first, second = _engine(tmp_path / "a.sqlite"), _engine(tmp_path / "b.sqlite")
    with first.connect() as holder:
        holder.exec_driver_sql("INSERT INTO t VALUES (1, 'a')")
        thread, errors = _insert_in_thread(second, 1, "b")
        thread.join(timeout=10)
        assert not thread.is_alive() and errors == []
        holder.rollback()


# Another process (as the dispatcher process is to the API's) opens a write transaction and holds it open.
HOLDER = """
import sys
from sqlalchemy import event
from api.db import WRITE_LOCK_SUFFIX, _WriteLock, make_engine
engine = make_engine(sys.argv[1])
@event.listens_for(engine, "connect")
def _no_busy_wait(dbapi_connection, _record):
    dbapi_connection.execute("PRAGMA busy_timeout=0")
with engine.connect() as connection:
    connection.exec_driver_sql("INSERT INTO t VALUES (1, 'other process')")
    print("holding", flush=True)
    sys.stdin.readline()
    connection.commit()
"""


def test_a_writer_waits_for_another_process_s_write_transaction(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    engine = _engine(path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, f"sqlite:///{path}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == b"holding\n"
        thread, errors = _insert_in_thread(engine, 2, "this process")
        thread.join(timeout=0.5)
        assert thread.is_alive(), f"the writer did not wait: {errors}"
        holder.stdin.write(b"commit\n")
        holder.stdin.flush()
        assert holder.wait(timeout=30) == 0
        thread.join(timeout=10)
    finally:
        holder.kill()
    assert not thread.is_alive() and errors == []
    with engine.connect() as connection:
        rows = connection.exec_driver_sql("SELECT k, who FROM t ORDER BY k").all()
    assert [tuple(row) for row in rows] == [(1, "other process"), (2, "this process")]


def test_a_writer_that_gives_up_waiting_for_the_file_lock_leaves_it_free(tmp_path: Path) -> None:
    """flock(2) has no timeout: a thread waits in it, and a writer past its deadline goes on without the lock
    (to SQLite's busy handler). When the lock comes free later that thread must let it go again, and the
    next writer must get it."""
    path = str(tmp_path / "db.sqlite")
    other = os.open(path + WRITE_LOCK_SUFFIX, os.O_RDWR | os.O_CREAT)  # another open file: another process
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        lock = _WriteLock(path)
        started = time.monotonic()
        assert lock.acquire(timeout=0.3)
        assert 0.3 <= time.monotonic() - started < 5
        assert not lock._flocked  # went on without it
        lock.release()
        fcntl.flock(other, fcntl.LOCK_UN)  # the waiting thread gets it now, for a writer that left
        time.sleep(0.2)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ... and let it go: free
        fcntl.flock(other, fcntl.LOCK_UN)
        assert lock.acquire(timeout=5) and lock._flocked
        with pytest.raises(BlockingIOError):  # held for this writer
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.release()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(other)


def test_a_writer_waiting_for_another_process_gets_the_lock_when_it_is_let_go(tmp_path: Path) -> None:
    path = str(tmp_path / "db.sqlite")
    other = os.open(path + WRITE_LOCK_SUFFIX, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        lock = _WriteLock(path)
        got: list[bool] = []
        waiter = threading.Thread(target=lambda: got.append(lock.acquire(timeout=30) and lock._flocked))
        waiter.start()
        waiter.join(timeout=0.3)
        assert waiter.is_alive()  # waits
        fcntl.flock(other, fcntl.LOCK_UN)
        waiter.join(timeout=5)
        assert got == [True]
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.release()
    finally:
        os.close(other)
