"""Reads for `GET /jobs/{id}`, the route clients poll, without a trip through the thread pool.

A sync read handed to a worker thread cost more than the read itself: measured at 64 clients on 2 cores,
GET /jobs/{id} took 1.1 ms of CPU per request against 0.5 ms for /healthz, most of the difference in
thread hand-offs and the GIL passing back and forth. So the read runs on the event loop:

- SQLite: inline, with sqlite3 itself. A primary-key lookup in a local file takes tens of microseconds,
  and in WAL mode a reader does not wait for writers.
- PostgreSQL: psycopg's async connections, a few of its own in autocommit, and the reads asked for
  while they are busy answered together by one statement (see `PostgresReader`).

Measured with bench/api_load.py (64 clients, 2 cores): GET /jobs/{id} went from ~860 req/s to 4,609 on
SQLite and 4,305 on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections import namedtuple
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from api import pg_async
from api.errors import DatabaseUnavailable
from api.jobs import (
    EVENT_COLUMNS,
    JOB_COLUMNS,
    EventHead,
    EventPoll,
    JobListing,
    JobRow,
    event_heads_statement,
    queue_position_statement,
    queued_order_statement,
)


class JobReader(Protocol):
    """Reads of jobs and events on the event loop. `tenant`: the caller's; None for the admin keys, whose
    reads see every tenant's jobs (api.auth.Principal.scope)."""

    async def read_job(self, tenant: str | None, job_id: str) -> Any | None:
        """The job as a row with `api.jobs.JOB_COLUMNS` as attributes, or None."""

    async def list_jobs(self, tenant: str | None, listing: JobListing) -> tuple[list[Any], bool]:
        """A page of the tenant's jobs (rows as `read_job` gives them, newest first) and whether more
        follow; ApiError invalid_cursor for an `after` that is not one of the tenant's jobs."""

    async def poll_events(self, tenant: str | None, poll: EventPoll) -> tuple[str | None, list[Any]]:
        """The job's status (None: no such job of the tenant's) and its new events, rows with
        `api.jobs.EVENT_COLUMNS` as attributes (times as datetimes, `data` parsed)."""

    async def event_heads(self, job_ids: list[str]) -> dict[str, Any]:
        """Of each of these jobs that exists: an `api.jobs.EventHead` (tenant, status, newest event id)."""

    async def queue_position(self, job_id: str) -> int:
        """The job's place in the queue (`api.jobs.queue_position_statement`; 0: not waiting in it)."""

    async def queued_order(self, executor: str) -> list[Any]:
        """The jobs waiting in `executor`'s queue, in order (`api.jobs.queued_order_statement`)."""

    async def close(self) -> None: ...


log = logging.getLogger(__name__)

_COLUMNS = ", ".join(JOB_COLUMNS)
_EVENT_COLUMNS = ", ".join(EVENT_COLUMNS)
EventRow = namedtuple("EventRow", EVENT_COLUMNS)  # type: ignore[misc]
_TIMES = [i for i, name in enumerate(JOB_COLUMNS) if name.endswith("_at")]


def _sqlite_row(values: tuple[Any, ...]) -> Any:
    """A JobRow from sqlite3's values: times parsed (SQLAlchemy stores them as ISO text, UTC); the spec
    stays JSON text until `job_spec` needs it (once per job and process)."""
    row = list(values)
    for i in _TIMES:
        if row[i] is not None:
            row[i] = datetime.fromisoformat(row[i])
    return JobRow._make(row)


def _sqlite_list(execute: Any, tenant: str | None, listing: JobListing) -> tuple[list[Any], bool]:
    """`listing` run with `execute(sql, params) -> rows` on a SQLite connection."""
    try:
        rows = execute(*listing.statement(tenant, _COLUMNS, "?"))
        found = bool(rows) or listing.after is None or bool(execute(*listing.cursor_statement(tenant, "?")))
    except sqlite3.OperationalError as exc:
        raise DatabaseUnavailable(str(exc)) from exc
    return listing.page([_sqlite_row(values) for values in rows], found)


def _sqlite_poll(execute: Any, tenant: str | None, poll: EventPoll) -> tuple[str | None, list[Any]]:
    """`poll` run with `execute(sql, params) -> rows` on a SQLite connection."""
    try:
        job = execute(*poll.job_statement(tenant, "?"))
        if not job:
            return None, []
        seq, status = job[0]
        rows = execute(*poll.events_statement(seq, _EVENT_COLUMNS, "?"))
    except sqlite3.OperationalError as exc:
        raise DatabaseUnavailable(str(exc)) from exc
    events = [
        EventRow._make(
            (id, datetime.fromisoformat(created), kind, level, message, step, data and json.loads(data))
        )
        for id, created, kind, level, message, step, data in rows
    ]
    return status, events


_HEADS_CHUNK = 500  # (job ids per SQLite statement: under its limit on bound parameters)


def _sqlite_heads(execute: Any, job_ids: list[str]) -> dict[str, Any]:
    """`event_heads` run with `execute(sql, params) -> rows` on a SQLite connection."""
    heads = {}
    try:
        for start in range(0, len(job_ids), _HEADS_CHUNK):
            for job_id, *head in execute(
                *event_heads_statement(job_ids[start : start + _HEADS_CHUNK], "?", False)
            ):
                heads[job_id] = EventHead._make(head)
    except sqlite3.OperationalError as exc:
        raise DatabaseUnavailable(str(exc)) from exc
    return heads


def _sqlite_order(execute: Any, executor: str) -> list[Any]:
    """`queued_order` run with `execute(sql, params) -> rows` on a SQLite connection."""
    try:
        return list(execute(*queued_order_statement(executor, "?")))
    except sqlite3.OperationalError as exc:
        raise DatabaseUnavailable(str(exc)) from exc


def _sqlite_position(execute: Any, job_id: str) -> int:
    """`queue_position` run with `execute(sql, params) -> rows` on a SQLite connection."""
    try:
        [(position,)] = execute(*queue_position_statement(job_id, "?"))
    except sqlite3.OperationalError as exc:
        raise DatabaseUnavailable(str(exc)) from exc
    return int(position)


class InlineReader:
    """SQLite in memory: the reads through the engine (its one connection), on the event loop; the rows as
    SqliteReader gives them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def read_job(self, tenant: str | None, job_id: str) -> Any | None:
        with self.engine.connect() as connection:
            values = connection.exec_driver_sql(*SqliteReader.statement(tenant, job_id)).first()
        return None if values is None else _sqlite_row(tuple(values))

    async def list_jobs(self, tenant: str | None, listing: JobListing) -> tuple[list[Any], bool]:
        return self._run(_sqlite_list, tenant, listing)

    async def poll_events(self, tenant: str | None, poll: EventPoll) -> tuple[str | None, list[Any]]:
        return self._run(_sqlite_poll, tenant, poll)

    async def event_heads(self, job_ids: list[str]) -> dict[str, Any]:
        return self._run(_sqlite_heads, job_ids)

    async def queue_position(self, job_id: str) -> int:
        return self._run(_sqlite_position, job_id)

    async def queued_order(self, executor: str) -> list[Any]:
        return self._run(_sqlite_order, executor)

    def _run(self, run: Any, *args: Any) -> Any:
        """`run(execute, *args)` on one of the engine's connections."""
        with self.engine.connect() as connection:
            return run(lambda sql, params: connection.exec_driver_sql(sql, tuple(params)).all(), *args)

    async def close(self) -> None:
        pass


class SqliteReader:
    """SQLite file: the read on the event loop, on a connection of its own (sqlite3 without SQLAlchemy's
    layers, a third of the route's time through them); rows as `_sqlite_row` makes them.

    An unfiltered page of `GET /jobs` is read on the event loop too: at most `limit` + 1 rows of an index.
    A filtered one (status, metadata) may read many more rows, so it runs on a worker thread, on a
    connection of its own, and does not hold up the loop."""

    STATEMENT = f"SELECT {_COLUMNS} FROM jobs WHERE id = ? AND tenant = ?"
    STATEMENT_ANY_TENANT = f"SELECT {_COLUMNS} FROM jobs WHERE id = ?"

    @classmethod
    def statement(cls, tenant: str | None, job_id: str) -> tuple[str, tuple[str, ...]]:
        """The job's row if it is one of `tenant`'s (None: any tenant's, for the admin key)."""
        return (cls.STATEMENT_ANY_TENANT, (job_id,)) if tenant is None else (cls.STATEMENT, (job_id, tenant))

    def __init__(self, path: str, busy_timeout: float = 2.0) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self._connection: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        # In WAL mode (the engine sets it) a reader does not wait for writers; a lock held for long (a
        # migration) answers 503 after busy_timeout rather than stalling the loop longer.
        return sqlite3.connect(
            self.path, timeout=self.busy_timeout, check_same_thread=False, isolation_level=None
        )

    async def read_job(self, tenant: str | None, job_id: str) -> Any | None:
        try:
            if self._connection is None:
                self._connection = self._connect()
            values = self._connection.execute(*self.statement(tenant, job_id)).fetchone()
        except sqlite3.OperationalError as exc:
            raise DatabaseUnavailable(str(exc)) from exc
        return None if values is None else _sqlite_row(values)

    async def list_jobs(self, tenant: str | None, listing: JobListing) -> tuple[list[Any], bool]:
        if listing.filtered:
            return await run_in_threadpool(self._on_own_connection, _sqlite_list, tenant, listing)
        return _sqlite_list(self._execute_inline, tenant, listing)

    async def poll_events(self, tenant: str | None, poll: EventPoll) -> tuple[str | None, list[Any]]:
        # Only some types: the events of the others after the cursor are read too (all of a long run's
        # metrics, say), so off the loop, as a filtered list is.
        if poll.types:
            return await run_in_threadpool(self._on_own_connection, _sqlite_poll, tenant, poll)
        return _sqlite_poll(self._execute_inline, tenant, poll)

    async def event_heads(self, job_ids: list[str]) -> dict[str, Any]:
        # On the loop: an index lookup per job (a millisecond for a thousand).
        return _sqlite_heads(self._execute_inline, job_ids)

    async def queue_position(self, job_id: str) -> int:
        # On the loop: a count on an index of the queued jobs ahead of it (0.13 ms for a thousand; past
        # QueuePlaces.LONG, it reads them all instead, off the loop, once a second at most).
        return _sqlite_position(self._execute_inline, job_id)

    async def queued_order(self, executor: str) -> list[Any]:
        return await run_in_threadpool(self._on_own_connection, _sqlite_order, executor)

    def _execute_inline(self, sql: str, params: list[Any]) -> list[Any]:
        """On the event loop, on the reader's connection (sqlite3.OperationalError if it cannot open)."""
        if self._connection is None:
            self._connection = self._connect()
        return self._connection.execute(sql, params).fetchall()

    def _on_own_connection(self, run: Any, *args: Any) -> Any:
        """`run(execute, *args)` on a connection of its own (on a worker thread)."""
        try:
            connection = self._connect()
        except sqlite3.OperationalError as exc:
            raise DatabaseUnavailable(str(exc)) from exc
        try:
            return run(lambda sql, params: connection.execute(sql, params).fetchall(), *args)
        finally:
            connection.close()

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class PostgresReader:
    """Reads on up to `size` psycopg async connections of its own, opened on first use.

    Reads asked for while a statement runs are answered together by the next one (`WHERE id = ANY(...)`):
    at 64 clients on 2 cores one statement answers several requests, where a statement per request cost
    more CPU than the rest of the route. An idle server still runs each read at once, on its own. One
    statement in flight at a time, as a rule: fewer statements make bigger batches, and the event loop is
    the limit (GET /jobs/{id} at 64 clients, 2 runs each, with 4 / 2 / 1 statements in flight: 5,234 /
    6,832, 8,015 / 7,886 and 9,069 / 8,361 req/s). A second one (up to `size`) starts for reads that have
    waited `slow_seconds` behind a statement that is taking long, so one slow statement does not hold up
    every read.

    Pages of `GET /jobs` and followers' looks for new events are a statement or two each, up to
    `list_size` in flight (more wait their turn), with a longer time limit (`list_timeout`): a filtered
    page may read many rows. Rows come as `read_job` gives
    them, with the spec as its JSON text (validated once per job and process, `job_spec`).

    A pooled connection the server dropped (a restart) fails its statement: it is tried once more on a
    new connection, so the requests do not see it. While the database is away a read fails within the
    connect timeout (`DatabaseUnavailable`, a 503) and does not hang: the statement has a time limit too.
    """

    COLUMNS = ", ".join("spec::text AS spec" if c == "spec" else c for c in JOB_COLUMNS)
    STATEMENT = f"SELECT {COLUMNS} FROM jobs WHERE id = ANY(%s)"

    def __init__(
        self,
        conninfo: str,
        size: int = 2,
        *,
        connect_timeout: float = 3.0,
        statement_timeout: float = 5.0,
        slow_seconds: float = 0.02,
        list_size: int = 4,
        list_timeout: float = 30.0,
    ) -> None:
        self.conninfo = conninfo
        self.size = size
        self.list_size = list_size
        self.list_timeout = list_timeout
        self.slow_seconds = slow_seconds
        self.connect_timeout = connect_timeout
        self.statement_timeout = statement_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        from psycopg.rows import namedtuple_row

        self._connections = pg_async.AsyncConnections(
            conninfo, connect_timeout=connect_timeout, row_factory=namedtuple_row
        )
        self._waiting: list[tuple[str | None, str, asyncio.Future[Any]]] = []  # (tenant, job id, answer)
        self._running = 0  # statements in flight
        self._waiting_since = 0.0  # when the first of `_waiting` asked
        self._slow_check: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._list_slots = asyncio.Semaphore(list_size)

    @classmethod
    def for_engine(cls, engine: Engine, size: int = 2) -> PostgresReader:
        return cls(pg_async.conninfo(engine), size)

    def _bind(self) -> asyncio.AbstractEventLoop:
        # Connections belong to one event loop; a new loop (a test's second client) starts afresh.
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._connections.discard_all()
            self._loop = loop
            self._waiting, self._running, self._tasks = [], 0, set()
            self._slow_check = None
            self._list_slots = asyncio.Semaphore(self.list_size)
        return loop

    async def read_job(self, tenant: str | None, job_id: str) -> Any | None:
        loop = self._bind()
        answer: asyncio.Future[Any] = loop.create_future()
        if not self._waiting:
            self._waiting_since = loop.time()
        self._waiting.append((tenant, job_id, answer))
        if self._running == 0:
            self._start(loop)
        elif self._running < self.size and self._slow_check is None:
            self._slow_check = loop.call_at(self._waiting_since + self.slow_seconds, self._check_slow, loop)
        return await answer

    def _check_slow(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reads still waiting: start another statement if they have waited `slow_seconds`, or look again
        when the ones waiting now will have."""
        self._slow_check = None
        if not self._waiting or self._running >= self.size or loop is not self._loop:
            return
        if loop.time() >= self._waiting_since + self.slow_seconds:
            self._start(loop)
        else:
            self._slow_check = loop.call_at(self._waiting_since + self.slow_seconds, self._check_slow, loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._waiting = self._waiting, []
        self._running += 1
        # A task of its own: a request that goes away (its client hung up) does not take the others'
        # answers with it.
        task = loop.create_task(self._answer(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, batch: list[tuple[str | None, str, asyncio.Future[Any]]]) -> None:
        try:
            rows = await self._read([job_id for _, job_id, _ in batch])
        except BaseException as exc:
            for _, _, answer in batch:
                if not answer.done():
                    answer.set_exception(
                        exc if isinstance(exc, Exception) else DatabaseUnavailable("stopped")
                    )
            if not isinstance(exc, Exception):
                raise
        else:
            found = {row.id: row for row in rows}
            for tenant, job_id, answer in batch:
                row = found.get(job_id)
                if not answer.done():
                    # Another tenant's job is not found, as everywhere (a 404, not a 403); None: the admin.
                    answer.set_result(row if row is not None and tenant in (None, row.tenant) else None)
        finally:
            self._running -= 1
            if self._waiting and self._loop is asyncio.get_running_loop():
                self._start(self._loop)

    async def list_jobs(self, tenant: str | None, listing: JobListing) -> tuple[list[Any], bool]:
        self._bind()
        async with self._list_slots:
            rows = await self._execute(*listing.statement(tenant, self.COLUMNS, "%s"), self.list_timeout)
            found = bool(rows) or listing.after is None
            if not found:
                found = bool(await self._execute(*listing.cursor_statement(tenant, "%s"), self.list_timeout))
        return listing.page(rows, found)

    async def poll_events(self, tenant: str | None, poll: EventPoll) -> tuple[str | None, list[Any]]:
        self._bind()
        async with self._list_slots:
            job = await self._execute(*poll.job_statement(tenant, "%s"), self.list_timeout)
            if not job:
                return None, []
            seq, status = job[0]
            events = await self._execute(*poll.events_statement(seq, _EVENT_COLUMNS, "%s"), self.list_timeout)
        return status, events

    async def event_heads(self, job_ids: list[str]) -> dict[str, Any]:
        self._bind()
        async with self._list_slots:
            rows = await self._execute(*event_heads_statement(job_ids, "%s", True), self.list_timeout)
        return {job_id: EventHead(tenant, status, last) for job_id, tenant, status, last in rows}

    async def queue_position(self, job_id: str) -> int:
        self._bind()
        async with self._list_slots:
            [(position,)] = await self._execute(
                *queue_position_statement(job_id, "%s"), self.statement_timeout
            )
        return int(position)

    async def queued_order(self, executor: str) -> list[Any]:
        self._bind()
        async with self._list_slots:
            return await self._execute(*queued_order_statement(executor, "%s"), self.list_timeout)

    async def _read(self, job_ids: list[str]) -> list[Any]:
        return await self._execute(self.STATEMENT, [job_ids], self.statement_timeout)

    async def _execute(self, statement: str, params: list[Any], timeout: float) -> list[Any]:
        import psycopg

        for attempt in (1, 2):
            connection, pooled = await self._connections.checkout()
            try:
                async with asyncio.timeout(timeout):
                    cursor = await connection.execute(statement, params)
                    rows = await cursor.fetchall()
            except psycopg.OperationalError as exc:
                await pg_async.close(connection)
                if pooled and attempt == 1:
                    continue  # dropped while pooled (idle or not): once more, on a new connection
                raise DatabaseUnavailable(str(exc)) from exc
            except TimeoutError as exc:
                await pg_async.close(connection)
                raise DatabaseUnavailable("the database did not answer in time") from exc
            except BaseException:
                await pg_async.close(connection)  # cancelled mid-statement: its state is unknown
                raise
            self._connections.checkin(connection)
            return rows
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._connections.close()


def make_reader(engine: Engine) -> JobReader:
    if engine.dialect.name == "postgresql":
        return PostgresReader.for_engine(engine)
    database = engine.url.database
    if database and database != ":memory:" and not database.startswith("file:"):
        return SqliteReader(database)
    return InlineReader(engine)


class QueuePlaces:
    """Places in the queue, for GET /jobs/{id} of a queued job. While the queue is short, each is counted
    (`JobReader.queue_position`, exact). A count reads the jobs ahead: 15 ms with 20,000 queued on SQLite
    (on the event loop), 10 on PostgreSQL. Past LONG jobs queued, the places of every queued job are worked
    out from one read of them all (`queued_order`, 28-53 ms; on SQLite the query off the event loop, then
    5 ms on it for 20,000 rows), made at most every SECONDS, and each GET looks its job's up. A GET does
    not wait for the read: it gets the places of the last one, unless they are STALE_SECONDS old (a job
    polled once a minute). A job queued since the read is behind every one in it."""

    LONG = 1_000  # jobs queued: counted one by one up to this many
    SECONDS = 1.0
    STALE_SECONDS = 10.0

    def __init__(self, reader: JobReader, executor: str) -> None:
        self.reader = reader
        self.executor = executor
        self._long = False
        self._places: dict[str, int] | None = None  # (None: none read)
        self._free = 0  # jobs in the read not held back by their team's limits: each is ahead of all after
        self._held: dict[str, int] = {}  # and the held ones, by tenant: ahead of their own team's only
        self._read_at = -float("inf")  # (the places' time)
        self._tried_at = -float("inf")  # (the last read's start, failed or not)
        self._reading: asyncio.Task[None] | None = None

    async def position(self, job_id: str, tenant: str, executor: str) -> int:
        """The place of queued job `job_id` (of `tenant`, run by `executor`); 0: not waiting in the queue."""
        if not self._long or executor != self.executor:
            place = await self.reader.queue_position(job_id)
            if place > self.LONG and executor == self.executor:
                self._long = True
            return place
        now = time.monotonic()
        if now - self._tried_at >= self.SECONDS and self._reading is None:
            self._tried_at = now
            self._reading = asyncio.create_task(self._read())
        if self._reading is not None and (self._places is None or now - self._read_at >= self.STALE_SECONDS):
            await asyncio.shield(self._reading)  # (one read for every request that waits for it)
        if self._places is None:  # (the read failed: the count says why, a 503 if the database is away)
            return await self.reader.queue_position(job_id)
        found = self._places.get(job_id)
        return found if found is not None else self._free + self._held.get(tenant, 0) + 1

    async def _read(self) -> None:
        try:
            rows = await self.reader.queued_order(self.executor)
        except Exception as error:  # (the places read before stay; the next try in SECONDS)
            log.warning("could not read the queue for the places of its jobs: %s", error)
            return
        finally:
            self._reading = None
        places: dict[str, int] = {}
        held: dict[str, int] = {}
        free = 0
        for job_id, tenant, is_held in rows:
            if is_held:
                held[tenant] = held.get(tenant, 0) + 1
            else:
                free += 1
            places[job_id] = free + held.get(tenant, 0)
        self._places, self._free, self._held = places, free, held
        self._read_at = time.monotonic()
        if len(rows) < self.LONG // 2:  # short again: counted one by one
            self._long, self._places = False, None
