"""Stores the jobs `POST /jobs` creates: the requests waiting at one moment share one transaction.

A job is three to four inserts and a commit. Run per request on the route threads, 64 clients on 2 cores
got ~260 jobs/s with a p99 near a second: on SQLite the threads queued for its single write lock (its
busy handler sleeps up to 100 ms between tries), on PostgreSQL each request paid its round trips and
commit, and everywhere the thread hand-offs and SQLAlchemy's unit of work cost more than the inserts.

So the route checks the spec and builds the row on the event loop and hands it to `JobWriter`: one thread
that takes every job waiting, writes them in one transaction (`api.jobs.write_jobs`: on SQLite a
statement per table, the rows as one JSON parameter; on PostgreSQL one statement, in autocommit unless
Idempotency-Keys need reading first), commits once, and answers each request. Under load a batch holds the
jobs that arrived while the previous one was written; an idle server writes a lone job at once. Nothing is
acknowledged before its commit. The jobs of tenants with a limit on queued jobs are counted in it too
(`api.jobs.write_jobs`).

The jobs without an Idempotency-Key (most) skip the thread. On a SQLite file `SqliteWriter` writes those
asked for in one turn of the event loop on the loop itself, when the write lock is free (the thread takes
over a batch that found it busy for 20 ms); POST /jobs at 64 clients, 15 s, 3 alternated rounds:
1,752/2,581/2,387 -> 3,058/2,749/2,807 req/s, p99 62.2/48.8/54.9 -> 37.7/43.5/41.4 ms. On PostgreSQL
`PostgresWriter` sends the same single statement from the event loop on a psycopg async connection, as
api.reader does for GET. POST /jobs
at 64 clients, 15 s, 3 alternated rounds (bench/api_ab.py --database postgres): 2,458/2,273/2,172 ->
3,092/3,149/2,906 req/s, p99 72.9/65.0/65.8 -> 41.2/52.9/41.2 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from api import pg_async
from api.db import SerializedWrites, autocommit_connection
from api.errors import ApiError, DatabaseUnavailable
from api.jobs import (
    PG_INSERT_NEW_JOBS,
    NewJob,
    Outcome,
    QueueFull,
    pg_new_jobs_parameters,
    sqlite_new_jobs_statements,
    write_jobs,
    write_one,
)
from api.pg_async import AsyncConnections, conninfo

log = logging.getLogger(__name__)

_Waiter = tuple[NewJob, asyncio.Future[Outcome], asyncio.AbstractEventLoop]


class JobWriter:
    """Writes jobs in batches of up to `max_batch` on a thread of its own (started on first use);
    `on_commit` runs after each commit that stored a job (the dispatcher's wake-up)."""

    def __init__(
        self, engine: Engine, on_commit: Callable[[], None] | None = None, max_batch: int = 256
    ) -> None:
        self.engine = engine
        self.on_commit = on_commit
        self.max_batch = max_batch
        self._waiting: deque[_Waiter] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False

    async def create(self, new: NewJob) -> Outcome:
        """Store `new`; its outcome once committed. Raises ApiError (a reused Idempotency-Key) or the
        database's error (OperationalError: the API answers 503)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        with self._lock:
            self._waiting.append((new, future, loop))
            if self._thread is None:
                self._start()
            self._ready.notify()
        # A client that goes away cancels only this wait, not the write: the job is stored all the same,
        # as it would be had it gone away a moment later (a retry with its Idempotency-Key finds it), and
        # `_answer` skips the cancelled future. (asyncio.shield said the same at the cost of one more turn
        # of the event loop before the request went on; under load a turn is 1-3 ms.)
        return await future

    def submit(self, waiters: list[tuple[NewJob, asyncio.Future[Outcome]]]) -> None:
        """Write these jobs and answer their futures (on the running loop), as create does."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._waiting.extend((new, future, loop) for new, future in waiters)
            if self._thread is None:
                self._start()
            self._ready.notify()

    def close(self) -> None:
        """Write what is waiting, then stop the thread (a later create starts another: an app's lifespan
        may run more than once, in tests)."""
        with self._lock:
            self._closed = True
            self._ready.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=30)
        with self._lock:
            self._closed = False
            self._thread = None
            if self._waiting:  # asked for while the thread stopped
                self._start()

    async def aclose(self) -> None:
        self.close()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tputune-job-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._closed:
                    self._ready.wait()
                if not self._waiting:
                    return
                batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
            outcomes = self._write([new for new, _, _ in batch])
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Outcome], object]]] = {}
            for (_, future, loop), outcome in zip(batch, outcomes, strict=True):
                by_loop.setdefault(loop, []).append((future, outcome))
            for loop, answers in by_loop.items():
                # A closed loop raises RuntimeError: no one waits for these answers any more.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_answer, answers)
            if self.on_commit is not None and any(isinstance(o, Outcome) and o.created for o in outcomes):
                self.on_commit()

    def _write(self, batch: list[NewJob]) -> list[Outcome | BaseException]:
        refused: dict[int, BaseException] = {}  # over their tenants' limits on queued jobs, by index
        for _ in range(3):
            todo = [i for i in range(len(batch)) if i not in refused]
            try:
                with self._connection([batch[i] for i in todo]) as connection:
                    written = dict(zip(todo, write_jobs(connection, [batch[i] for i in todo]), strict=True))
                return [written[i] if i in written else refused[i] for i in range(len(batch))]
            except QueueFull as full:
                # Rolled back: again without the jobs that did not fit. The tenants' other writers (replicas)
                # may have changed their queues meanwhile: the next try counts again.
                refused.update((todo[j], error) for j, error in full.refusals().items())
            except IntegrityError:
                # Another writer (an API replica) stored one of these Idempotency-Keys after write_jobs
                # looked: write each job on its own, so only the requests that lost the race see the
                # winner's job.
                break
            except Exception as exc:  # the database is away (OperationalError: a 503), or a bug (a 500)
                return [refused.get(i, exc) for i in range(len(batch))]
        return [refused[i] if i in refused else self._write_one(new) for i, new in enumerate(batch)]

    @contextlib.contextmanager
    def _connection(self, batch: list[NewJob]) -> Iterator[Connection]:
        """A transaction; on PostgreSQL, for jobs without Idempotency-Keys or limits on queued jobs,
        autocommit: write_jobs then runs one statement, atomic on its own, and BEGIN and COMMIT would be
        two more round trips."""
        if self.engine.dialect.name == "postgresql" and not any(new.needs_transaction for new in batch):
            with autocommit_connection(self.engine) as connection:
                yield connection
        else:
            with self.engine.begin() as connection:
                yield connection

    def _write_one(self, new: NewJob) -> Outcome | BaseException:
        try:
            return write_one(self.engine, new)
        except IntegrityError:
            log.exception("could not store job %s", new.id)
            return _FAILED
        except Exception as exc:
            return exc


_FAILED = ApiError(409, "job_conflict", "The job could not be stored (a conflicting row exists); retry.")


def _answer(answers: list[tuple[asyncio.Future[Outcome], object]]) -> None:
    for future, outcome in answers:
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)  # type: ignore[arg-type]


class InlineWriter:
    """SQLite in memory (each thread would see its own database): a job at a time, on the event loop."""

    def __init__(self, engine: Engine, on_commit: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_commit = on_commit

    async def create(self, new: NewJob) -> Outcome:
        outcome = write_one(self.engine, new)
        if isinstance(outcome, ApiError):
            raise outcome
        if outcome.created and self.on_commit is not None:
            self.on_commit()
        return outcome

    def close(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class SqliteWriter:
    """SQLite file: the jobs without an Idempotency-Key written on the event loop, all those asked for in
    one turn of the loop in one transaction (`api.jobs.sqlite_new_jobs_statements`), when the database's
    write lock (`api.db.SerializedWrites`) is free. When it is not (the dispatcher is committing), the
    batch waits on the loop, a try every `retry_seconds`, for up to `wait_seconds`; then it goes to a
    `JobWriter`, whose thread waits for the lock. The jobs with a key go there too (they read the keys
    first, in the transaction), and those of a tenant with a limit on queued jobs (counted in it).

    On the loop there is no thread to wake and no answer to hand back: with the writer on a thread, POST
    /jobs at 64 clients spent ~3 ms on each of those hops, more than the write, and the thread took its
    share of the GIL. The write itself is a few statements, in memory until a checkpoint (WAL,
    synchronous=NORMAL: no fsync at commit). Checkpoints, which do sync, are not made on the loop: this
    connection's automatic ones are off, and a thread of its own runs a PASSIVE checkpoint (it does not
    block writers) at most every `checkpoint_seconds` while jobs are written. (Other connections, the
    dispatcher's, still make theirs.)
    """

    def __init__(
        self,
        engine: Engine,
        on_commit: Callable[[], None] | None = None,
        max_batch: int = 256,
        *,
        retry_seconds: float = 0.001,
        wait_seconds: float = 0.02,
        checkpoint_seconds: float = 1.0,
    ) -> None:
        self.keyed = JobWriter(engine, on_commit, max_batch)
        self.on_commit = on_commit
        self.path = str(engine.url.database)
        self.retry_seconds = retry_seconds
        self.wait_seconds = wait_seconds
        self.checkpoints = _Checkpoints(self.path, checkpoint_seconds)
        self.handed_over = 0  # batches written by the JobWriter, the lock having stayed busy
        self._connection: SerializedWrites | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: list[tuple[NewJob, asyncio.Future[Outcome]]] = []
        self._waiting_since = 0.0  # when the first of `_waiting` asked
        self._flush: asyncio.Handle | None = None

    async def create(self, new: NewJob) -> Outcome:
        if new.needs_transaction:
            return await self.keyed.create(new)
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (a test's second client) starts afresh
            self._loop, self._waiting, self._flush = loop, [], None
        future: asyncio.Future[Outcome] = loop.create_future()
        if not self._waiting:
            self._waiting_since = loop.time()
        self._waiting.append((new, future))
        if self._flush is None:  # after this turn of the loop: the jobs of its other requests come along
            self._flush = loop.call_soon(self._write)
        # A client that goes away cancels only this wait: the job is written all the same.
        return await future

    def _write(self) -> None:
        self._flush = None
        batch, self._waiting = self._waiting, []
        if not batch:
            return
        try:
            written = self._write_here([new for new, _ in batch])
        except Exception as exc:
            _answer([(future, exc) for _, future in batch])
            return
        if not written:
            loop = asyncio.get_running_loop()
            if loop.time() - self._waiting_since < self.wait_seconds:
                self._waiting = batch + self._waiting
                self._flush = loop.call_later(self.retry_seconds, self._write)
            else:
                self.handed_over += 1
                self.keyed.submit(batch)
            return
        _answer([(future, new.created()) for new, future in batch])
        self.checkpoints.ask()
        if self.on_commit is not None:
            self.on_commit()

    def _write_here(self, news: list[NewJob]) -> bool:
        """Write `news` if the lock is free now: True if written, False if another writer holds it."""
        try:
            connection = self._connection
            if connection is None:
                # timeout=0: a lock held by a connection that does not take SerializedWrites' lock (none of
                # tputune's) is a busy answer at once, not a wait on the loop.
                connection = sqlite3.connect(
                    self.path, factory=SerializedWrites, check_same_thread=False, timeout=0
                )
                connection.execute("PRAGMA foreign_keys=ON")
                connection.execute("PRAGMA wal_autocheckpoint=0")
                self._connection = connection
            if not connection.try_acquire_for_write():
                return False
            try:
                connection.execute("BEGIN")
                for statement, parameters in sqlite_new_jobs_statements(news):
                    connection.execute(statement, parameters)
                connection.commit()
            except BaseException:
                connection.rollback()
                raise
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                return False
            raise DatabaseUnavailable(str(exc)) from exc  # (a 503, as for the JobWriter's)
        return True

    async def aclose(self) -> None:
        """Write what is waiting (on the JobWriter), then close."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self._waiting:
            self.keyed.submit(self._waiting)
            self._waiting = []
        self.keyed.close()
        self.checkpoints.close()
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class _Checkpoints:
    """PASSIVE checkpoints of one SQLite file on a thread of their own, at most one per `seconds`."""

    def __init__(self, path: str, seconds: float) -> None:
        self.path = path
        self.seconds = seconds
        self.made = 0
        self.last: tuple[int, int, int] | None = None  # SQLite's answer: (busy, WAL frames, checkpointed)
        self._asked = threading.Event()
        self._closed = False
        self._last = time.monotonic()
        self._thread: threading.Thread | None = None

    def ask(self) -> None:
        if self._asked.is_set() or time.monotonic() - self._last < self.seconds:
            return
        self._last = time.monotonic()
        if self._thread is None:
            self._closed = False
            self._thread = threading.Thread(target=self._run, name="tputune-sqlite-checkpoint", daemon=True)
            self._thread.start()
        self._asked.set()

    def _run(self) -> None:
        with contextlib.closing(sqlite3.connect(self.path, timeout=0, check_same_thread=False)) as connection:
            while True:
                self._asked.wait()
                self._asked.clear()
                if self._closed:
                    return
                try:
                    self.last = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    self.made += 1
                except sqlite3.Error:
                    log.warning("a WAL checkpoint of %s failed", self.path, exc_info=True)

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._closed = True
            self._asked.set()
            thread.join(timeout=30)


class PostgresWriter:
    """PostgreSQL: the jobs without an Idempotency-Key written from the event loop, on a psycopg async
    connection of its own; those with one go to a `JobWriter` (they need a transaction that reads the keys
    first, and a retry that finds a key taken), and so do those of a tenant with a limit on queued jobs
    (a transaction that counts them after the insert).

    The jobs asked for while a statement runs are written together by the next one, as `JobWriter` does
    (one statement, `api.jobs.PG_INSERT_NEW_JOBS`, in autocommit: atomic on its own). On the event loop
    there is no thread to wake and no answer to hand back across threads: with the writer on a thread,
    POST /jobs at 64 clients spent ~5 ms on each of those two hops on a busy loop, more than the write.

    A pooled connection the server dropped (a restart) fails its statement: it is tried once more on a new
    connection. That is safe: the statement is atomic and the jobs' ids unique, so if the first try did
    commit, the second fails on the ids (UniqueViolation), finds every job of the batch stored, and answers
    them as created. While the
    database is away the writes fail within the connect timeout (DatabaseUnavailable, a 503).
    """

    def __init__(
        self,
        engine: Engine,
        on_commit: Callable[[], None] | None = None,
        max_batch: int = 256,
        *,
        connect_timeout: float = 3.0,
        statement_timeout: float = 10.0,
    ) -> None:
        self.keyed = JobWriter(engine, on_commit, max_batch)
        self.on_commit = on_commit
        self.max_batch = max_batch
        self.statement_timeout = statement_timeout
        self._connections = AsyncConnections(conninfo(engine), connect_timeout=connect_timeout)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: list[tuple[NewJob, asyncio.Future[Outcome]]] = []
        self._running = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def create(self, new: NewJob) -> Outcome:
        if new.needs_transaction:
            return await self.keyed.create(new)
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to one loop; a new one (a test's) starts afresh
            self._connections.discard_all()
            self._loop, self._waiting, self._running, self._tasks = loop, [], False, set()
        future: asyncio.Future[Outcome] = loop.create_future()
        self._waiting.append((new, future))
        if not self._running:
            self._start(loop)
        # A client that goes away cancels only this wait: the batch's task writes the job all the same.
        return await future

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
        self._running = True
        task = loop.create_task(self._write(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, batch: list[tuple[NewJob, asyncio.Future[Outcome]]]) -> None:
        try:
            await self._insert([new for new, _ in batch])
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else DatabaseUnavailable("stopped")
            _answer([(future, error) for _, future in batch])
            if not isinstance(exc, Exception):
                raise
        else:
            _answer([(future, new.created()) for new, future in batch])
            if self.on_commit is not None:
                self.on_commit()
        finally:
            self._running = False
            if self._waiting and self._loop is asyncio.get_running_loop():
                self._start(self._loop)

    async def _insert(self, batch: list[NewJob]) -> None:
        import psycopg

        parameters = pg_new_jobs_parameters(batch)
        for attempt in (1, 2):
            connection, pooled = await self._connections.checkout()
            try:
                async with asyncio.timeout(self.statement_timeout):
                    await connection.execute(PG_INSERT_NEW_JOBS, parameters)
            except psycopg.errors.UniqueViolation:
                self._connections.checkin(connection)
                if attempt == 2 and await self._all_stored(connection, batch):
                    return  # the first try committed before its connection went
                raise
            except psycopg.OperationalError as exc:
                await pg_async.close(connection)
                if pooled and attempt == 1:
                    continue
                raise DatabaseUnavailable(str(exc)) from exc
            except TimeoutError as exc:
                await pg_async.close(connection)
                raise DatabaseUnavailable("the database did not answer in time") from exc
            except BaseException:
                await pg_async.close(connection)
                raise
            self._connections.checkin(connection)
            return

    async def _all_stored(self, connection: Any, batch: list[NewJob]) -> bool:
        async with asyncio.timeout(self.statement_timeout):
            cursor = await connection.execute(_COUNT_JOBS, ([new.id for new in batch],))
            row = await cursor.fetchone()
        return row is not None and row[0] == len(batch)

    async def aclose(self) -> None:
        """Finish the writes under way, then close the connections and the keyed writer."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=30)
        await self._connections.close()
        self.keyed.close()


_COUNT_JOBS = "SELECT count(*) FROM jobs WHERE id = ANY(%s)"


def make_writer(
    engine: Engine, on_commit: Callable[[], None] | None = None
) -> JobWriter | InlineWriter | SqliteWriter | PostgresWriter:
    if engine.dialect.name == "postgresql":
        return PostgresWriter(engine, on_commit)
    database = engine.url.database or ":memory:"
    if engine.dialect.name == "sqlite" and (database == ":memory:" or "mode=memory" in database):
        return InlineWriter(engine, on_commit)
    if engine.dialect.name == "sqlite":
        return SqliteWriter(engine, on_commit)
    return JobWriter(engine, on_commit)
