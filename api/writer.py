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
acknowledged before its commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from api.db import autocommit_connection
from api.errors import ApiError
from api.jobs import NewJob, Outcome, write_jobs, write_one

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
        try:
            with self._connection(batch) as connection:
                return list(write_jobs(connection, batch))
        except IntegrityError:
            # Another writer (an API replica) stored one of these Idempotency-Keys after write_jobs looked:
            # write each job on its own, so only the requests that lost the race see the winner's job.
            return [self._write_one(new) for new in batch]
        except Exception as exc:  # the database is away (OperationalError: a 503), or a bug (a 500)
            return [exc] * len(batch)

    @contextlib.contextmanager
    def _connection(self, batch: list[NewJob]) -> Iterator[Connection]:
        """A transaction; on PostgreSQL, for jobs without Idempotency-Keys, autocommit: write_jobs then
        runs one statement, atomic on its own, and BEGIN and COMMIT would be two more round trips."""
        if self.engine.dialect.name == "postgresql" and all(new.idempotency_key is None for new in batch):
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


def make_writer(engine: Engine, on_commit: Callable[[], None] | None = None) -> JobWriter | InlineWriter:
    database = engine.url.database or ":memory:"
    if engine.dialect.name == "sqlite" and (database == ":memory:" or "mode=memory" in database):
        return InlineWriter(engine, on_commit)
    return JobWriter(engine, on_commit)
