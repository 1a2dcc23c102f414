"""The job writer (api.writer): concurrent creates share a transaction, each request gets its own answer."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from api import dispatcher as dispatcher_module
from api import jobs as service
from api.db import WRITE_LOCK_SUFFIX, make_engine
from api.dispatcher import Dispatcher
from api.errors import ApiError, DatabaseUnavailable
from api.executors import make_executor
from api.jobs import NewJob, Outcome, read_job_row
from api.migrate import upgrade
from api.schemas import JobCreate, JobPublic
from api.settings import Settings
from api.tenants import Limits
from api.writer import JobWriter, PostgresWriter, SqliteWriter, make_writer
from tests.support.postgres import PostgresServer


def _spec(dataset: Path, name: str, **extra: Any) -> JobCreate:
    return JobCreate.model_validate(
        {"name": name, "model": "gemma3-270m-pt", "dataset_uri": str(dataset), **extra}
    )


def _count(engine: sa.Engine, sql: str, **params: Any) -> int:
    with engine.connect() as connection:
        return int(connection.execute(sa.text(sql), params).scalar_one())


def test_concurrent_creates_share_transactions_and_get_their_own_answers(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    settings = make_settings(dispatcher_enabled=False)
    engine = make_engine(settings.resolved_database_url)
    # A key stored before: a request that repeats it gets that job back.
    # (its session closed: a connection it kept checked out was closed by the garbage collector, at times
    # after the database was dropped: "Exception during reset" in CI's output)
    with Session(engine, expire_on_commit=False) as session:
        earlier, _ = service.create_job(
            session, _spec(dataset, "earlier"), settings, "alpha", idempotency_key="old"
        )
    commits: list[int] = []
    # On PostgreSQL a PostgresWriter: the jobs without a key from the event loop, the others on a JobWriter.
    writer = make_writer(engine, on_commit=lambda: commits.append(1))

    def new(name: str, tenant: str = "alpha", key: str | None = None, **extra: Any) -> NewJob:
        return service.prepare_job(_spec(dataset, name, **extra), settings, tenant, key)

    team = 'nlp "ü" \\ 😀'  # stored as given, whatever the database takes the batch's rows apart with
    plain = [new(f"job-{i}", metadata={"run": str(i), "team": team}) for i in range(40)]
    twice_a, twice_b = new("same", key="k1"), new("same", key="k1")  # the same key and body twice
    clash = new("different", key="k1")  # the same key, another body: 409
    repeat = new("earlier", key="old")  # the same key and body as a job stored before: that job
    other_tenant = new("same", tenant="beta", key="k1")  # keys are per tenant
    batch = [*plain, twice_a, twice_b, clash, repeat, other_tenant]

    async def create_all() -> list[Outcome | BaseException]:
        try:
            return await asyncio.gather(*(writer.create(n) for n in batch), return_exceptions=True)
        finally:
            await writer.aclose()

    try:
        results = asyncio.run(create_all())
    finally:
        engine.dispose()

    outcomes = dict(zip([id(n) for n in batch], results, strict=True))
    assert len(commits) < len(plain)  # batched: fewer commits than jobs
    for n in plain:
        outcome = outcomes[id(n)]
        assert isinstance(outcome, Outcome) and outcome.created and outcome.job.id == n.id
        stored = read_job_row(engine, "alpha", n.id)
        assert stored is not None
        # The response made from the new row is what a later read shows.
        assert JobPublic.of(outcome.job, n.spec).model_dump() == JobPublic.of(stored).model_dump()
        assert json.loads(n.created_json()) == json.loads(JobPublic.of(stored).model_dump_json())
        assert _count(engine, "SELECT count(*) FROM jobs WHERE id = :id", id=n.id) == 1
    first, second = outcomes[id(twice_a)], outcomes[id(twice_b)]
    assert isinstance(first, Outcome) and isinstance(second, Outcome)
    assert first.created and not second.created and second.job.id == first.job.id
    assert isinstance(outcomes[id(clash)], ApiError) and outcomes[id(clash)].code == "idempotency_key_reused"  # type: ignore[union-attr]
    again = outcomes[id(repeat)]
    assert isinstance(again, Outcome) and not again.created and again.job.id == earlier.id
    beta = outcomes[id(other_tenant)]
    assert isinstance(beta, Outcome) and beta.created and beta.job.id != first.job.id

    created = len(plain) + 2  # + the first "same" of alpha and beta's
    assert _count(engine, "SELECT count(*) FROM jobs") == created + 1  # + the earlier job
    # Each new job: its metadata rows and one "created" event, tied to its own seq.
    assert _count(engine, "SELECT count(*) FROM job_metadata") == 2 * len(plain)
    mismatched = """SELECT count(*) FROM job_metadata m JOIN jobs j ON j.seq = m.job_seq
                    WHERE m.key = 'run' AND j.name != 'job-' || m.value"""
    assert _count(engine, mismatched) == 0
    assert _count(engine, "SELECT count(*) FROM job_metadata WHERE key = 'team' AND value = :v", v=team) == 40
    events = "SELECT count(*) FROM job_events WHERE type = 'status' AND message = 'Job created and queued.'"
    assert _count(engine, events) == created + 1
    assert _count(engine, "SELECT count(*) FROM idempotency_keys") == 3  # old, alpha's k1, beta's k1
    engine.dispose()


def test_a_batch_keeps_each_tenants_limit_on_queued_jobs(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """One batch of several tenants' jobs: those over their tenant's limit on queued jobs are refused
    (the last of the tenant's, once its queue is full), the others stored, in one go."""
    settings = make_settings(dispatcher_enabled=False)
    engine = make_engine(settings.resolved_database_url)
    with Session(engine) as session:
        for i in range(2):
            service.create_job(session, _spec(dataset, f"before-{i}"), settings, "alpha", f"old-{i}")

    def new(name: str, tenant: str, max_queued: int | None, key: str | None = None) -> NewJob:
        limits = Limits(None, None, max_queued)
        return service.prepare_job(_spec(dataset, name), settings, tenant, key, limits)

    alpha = [new(f"a{i}", "alpha", 4) for i in range(4)]  # room for 2
    repeat = new("before-0", "alpha", 4, "old-0")  # a retry of a stored job: that job, full queue or not
    beta = new("b", "beta", 0)
    gamma = [new(f"g{i}", "gamma", 10) for i in range(3)]
    delta = [new(f"d{i}", "delta", None) for i in range(2)]
    batch = [alpha[0], gamma[0], beta, alpha[1], repeat, alpha[2], *delta, gamma[1], alpha[3], gamma[2]]
    try:
        outcomes = dict(zip([id(n) for n in batch], JobWriter(engine)._write(batch), strict=True))
    finally:
        engine.dispose()

    def created(n: NewJob) -> bool:
        outcome = outcomes[id(n)]
        return isinstance(outcome, Outcome) and outcome.created and outcome.job.id == n.id

    def refused(n: NewJob) -> str:
        outcome = outcomes[id(n)]
        assert isinstance(outcome, ApiError) and outcome.status == 429, outcome
        assert outcome.code == "too_many_queued_jobs" and outcome.headers == {"Retry-After": "30"}
        return outcome.message

    assert [created(n) for n in (*alpha[:2], *gamma, *delta)] == [True] * 7
    assert {refused(n) for n in alpha[2:]} == {
        "Your team (alpha) has 4 jobs queued and may have 4: submit this one once some have started, or "
        "cancel some."
    }
    assert refused(beta).startswith("Your team (beta) may not queue jobs now")
    again = outcomes[id(repeat)]
    assert isinstance(again, Outcome) and not again.created and again.job.name == "before-0"
    queued = "SELECT count(*) FROM jobs WHERE tenant = :t AND status = 'queued'"
    assert [_count(engine, queued, t=t) for t in ("alpha", "beta", "gamma", "delta")] == [4, 0, 3, 2]
    # Nothing of the refused jobs was left behind.
    for n in (*alpha[2:], beta):
        assert _count(engine, "SELECT count(*) FROM jobs WHERE id = :id", id=n.id) == 0
    assert _count(engine, "SELECT count(*) FROM job_events") == 4 + 3 + 2
    engine.dispose()


@pytest.mark.parametrize("microsecond", [0, 1, 60290, 999999])
def test_a_new_jobs_json_is_what_the_model_makes(
    make_settings: Callable[..., Settings], dataset: Path, microsecond: int
) -> None:
    """POST /jobs answers with NewJob.created_json, made without JobPublic: the same JSON, to the character
    for its times (pydantic leaves out zero microseconds), for any spec."""
    settings = make_settings(dispatcher_enabled=False)
    spec = _spec(
        dataset,
        'say "hi" \\ ü 😀',
        metadata={"k": "</script>\n\t\u0001"},
        method={"type": "full"},
        hyperparameters={"learning_rate": 1e-5, "max_steps": 7, "weight_decay": 0.25},
        output_uri=str(dataset.parent / "out"),
    )
    new = service.prepare_job(spec, settings, "alpha")
    new.row["created_at"] = datetime(2026, 12, 4, 8, 1, 2, microsecond, tzinfo=UTC)
    row = service.JobRow._make([new.row.get(name) for name in service.JOB_COLUMNS])
    expected = JobPublic.of(row, new.spec).model_dump_json()
    assert json.loads(new.created_json()) == json.loads(expected)
    assert f'"created_at":"{json.loads(expected)["created_at"]}"' in new.created_json()


def test_a_request_that_goes_away_does_not_cancel_its_write(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """The client left (its request's task is cancelled) while the job waited for the writer: the job is
    stored all the same, and the writer goes on answering the others."""
    settings = make_settings(dispatcher_enabled=False)
    engine = make_engine(settings.resolved_database_url)
    writer = make_writer(engine)
    news = [service.prepare_job(_spec(dataset, f"j{i}"), settings, "alpha") for i in range(6)]

    async def run() -> list[Outcome | BaseException]:
        try:
            gone = [asyncio.create_task(writer.create(n)) for n in news[:3]]
            await asyncio.sleep(0)  # they are waiting for the writer
            for task in gone:
                task.cancel()
            stayed = asyncio.gather(*(writer.create(n) for n in news[3:]), return_exceptions=True)
            results = await asyncio.wait_for(stayed, timeout=30)
            assert all(task.cancelled() for task in gone)
            return results
        finally:
            await writer.aclose()

    try:
        results = asyncio.run(run())
        assert all(isinstance(r, Outcome) and r.created for r in results)
        for n in news:
            assert read_job_row(engine, "alpha", n.id) is not None
    finally:
        engine.dispose()


@pytest.mark.parametrize("kind", ["JobWriter", "SqliteWriter"])
def test_a_database_that_is_away_fails_each_request_and_the_writer_goes_on(tmp_path: Path, kind: str) -> None:
    settings = Settings(data_dir=tmp_path / "state", allow_tiny_model=True)
    settings.ensure_dirs()
    dataset = settings.data_dir / "train.txt"
    # A database file the writer cannot open: every write fails, none hangs.
    engine = make_engine(f"sqlite:///{tmp_path / 'missing-dir' / 'x' / 'tputune.db'}")
    (tmp_path / "missing-dir" / "x").rmdir()
    (tmp_path / "missing-dir" / "x").write_text("a file where the database's directory should be")
    writer = JobWriter(engine) if kind == "JobWriter" else SqliteWriter(engine)
    error = OperationalError if kind == "JobWriter" else DatabaseUnavailable  # both answered with a 503

    async def create(count: int) -> list[Any]:
        news = [service.prepare_job(_spec(dataset, f"j{i}"), settings, "alpha") for i in range(count)]
        return await asyncio.wait_for(
            asyncio.gather(*(writer.create(n) for n in news), return_exceptions=True), timeout=30
        )

    try:
        for count in (5, 1):
            results = asyncio.run(create(count))
            assert all(isinstance(r, error) for r in results), results
    finally:
        asyncio.run(writer.aclose())


def _sqlite_writer_setup(tmp_path: Path) -> tuple[Settings, sa.Engine]:
    url = f"sqlite:///{tmp_path / 'tputune.db'}"
    upgrade(url)
    settings = Settings(data_dir=tmp_path / "state", allow_tiny_model=True, database_url=url)
    settings.ensure_dirs()
    return settings, make_engine(url)


def test_sqlite_writer_waits_on_the_loop_for_a_lock_held_briefly(tmp_path: Path) -> None:
    """Another writer of this process holds the lock for 5 ms: the jobs wait on the loop and are written
    there once it is let go (not handed to the thread)."""
    settings, engine = _sqlite_writer_setup(tmp_path)
    writer = SqliteWriter(engine)
    news = [
        service.prepare_job(_spec(settings.data_dir / "t.txt", f"j{i}"), settings, "alpha") for i in range(5)
    ]
    holder = engine.raw_connection().dbapi_connection
    assert holder is not None

    async def scenario() -> list[Outcome]:
        assert holder.try_acquire_for_write()
        try:
            loop = asyncio.get_running_loop()
            loop.call_later(0.005, holder.release_unless_writing)
            return await asyncio.gather(*(writer.create(n) for n in news))
        finally:
            await writer.aclose()

    try:
        outcomes = asyncio.run(scenario())
        assert [o.job.id for o in outcomes] == [n.id for n in news] and all(o.created for o in outcomes)
        assert writer.handed_over == 0 and writer.keyed._thread is None  # the thread never started
        assert _count(engine, "SELECT count(*) FROM jobs") == 5
    finally:
        holder.close()
        engine.dispose()


def test_sqlite_writer_hands_the_jobs_over_when_another_process_holds_the_lock(tmp_path: Path) -> None:
    """Another process (the dispatcher's) holds the lock for 0.5 s: after `wait_seconds` the batch goes to
    the JobWriter's thread, which waits in flock(2) and writes it when the lock is let go."""
    import subprocess
    import sys

    settings, engine = _sqlite_writer_setup(tmp_path)
    writer = SqliteWriter(engine)
    lock_file = str(tmp_path / "tputune.db") + WRITE_LOCK_SUFFIX
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({lock_file!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(0.5)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    news = [
        service.prepare_job(_spec(settings.data_dir / "t.txt", f"j{i}"), settings, "alpha") for i in range(3)
    ]

    async def scenario() -> list[Outcome]:
        try:
            return await asyncio.wait_for(asyncio.gather(*(writer.create(n) for n in news)), timeout=30)
        finally:
            await writer.aclose()

    try:
        started = time.monotonic()
        outcomes = asyncio.run(scenario())
        assert time.monotonic() - started >= 0.3  # it waited for the other process
        assert all(o.created for o in outcomes) and writer.handed_over == 1
        assert _count(engine, "SELECT count(*) FROM jobs") == 3
        assert _count(engine, "SELECT count(*) FROM job_events") == 3
    finally:
        holder.wait(timeout=10)
        engine.dispose()


def test_sqlite_writer_checkpoints_on_a_thread_not_on_the_loop(tmp_path: Path) -> None:
    settings, engine = _sqlite_writer_setup(tmp_path)
    writer = SqliteWriter(engine, checkpoint_seconds=0.0)

    async def scenario() -> None:
        try:
            for round_ in range(3):
                news = [
                    service.prepare_job(
                        _spec(settings.data_dir / "t.txt", f"j{round_}-{i}"), settings, "alpha"
                    )
                    for i in range(20)
                ]
                await asyncio.gather(*(writer.create(n) for n in news))
                await asyncio.sleep(0.05)
            assert writer._connection is not None
            # The loop's connection makes no checkpoints of its own.
            assert writer._connection.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
        finally:
            await writer.aclose()

    try:
        asyncio.run(scenario())
        assert writer.checkpoints.made >= 1
        last = writer.checkpoints.last
        assert last is not None and last[0] == 0 and last[1] == last[2] > 0  # every WAL frame copied back
        assert _count(engine, "SELECT count(*) FROM jobs") == 60
    finally:
        engine.dispose()


def _backend_pid(writer: PostgresWriter) -> int:
    ((connection, _),) = writer._connections._idle
    return int(connection.info.backend_pid)


@pytest.mark.postgres
def test_postgres_writer_replaces_a_dropped_connection_and_never_stores_a_job_twice(
    postgres_db_url: str, tmp_path: Path
) -> None:
    """A pooled connection the server dropped fails its statement, which is tried once more on a new one;
    if the first try had committed, the second finds the jobs stored and answers them as created."""
    import psycopg

    upgrade(postgres_db_url)
    settings = Settings(data_dir=tmp_path / "state", allow_tiny_model=True, database_url=postgres_db_url)
    settings.ensure_dirs()
    engine = make_engine(postgres_db_url)
    writer = PostgresWriter(engine)
    names = ["first", "second", "committed", "taken", "after"]
    news = {
        name: service.prepare_job(_spec(settings.data_dir / "t.txt", name), settings, "alpha")
        for name in names
    }

    def store(new: NewJob) -> None:
        with engine.begin() as connection:
            service.write_jobs(connection, [new])

    def drop(pid: int) -> None:
        with engine.connect() as connection:
            assert connection.exec_driver_sql(f"SELECT pg_terminate_backend({pid})").scalar()

    async def scenario() -> None:
        try:
            assert (await writer.create(news["first"])).created
            dropped = _backend_pid(writer)
            drop(dropped)
            second = await writer.create(news["second"])  # on a new connection, unseen by the caller
            assert second.created and second.job.id == news["second"].id
            assert _backend_pid(writer) != dropped
            # As if the first try had committed and then lost its connection before the answer came.
            store(news["committed"])
            drop(_backend_pid(writer))
            committed = await writer.create(news["committed"])
            assert committed.created and committed.job.id == news["committed"].id
            # On a connection that did not drop, a taken id is an error, not an answer.
            store(news["taken"])
            with pytest.raises(psycopg.errors.UniqueViolation):
                await writer.create(news["taken"])
            assert (await writer.create(news["after"])).created  # and the writer goes on
        finally:
            await writer.aclose()

    try:
        asyncio.run(scenario())
        for name, new in news.items():
            assert _count(engine, "SELECT count(*) FROM jobs WHERE id = :id", id=new.id) == 1, name
        events = "SELECT count(*) FROM job_events WHERE message = 'Job created and queued.'"
        assert _count(engine, events) == len(names)
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_writer_fails_fast_while_the_database_is_away(
    own_postgres: PostgresServer, tmp_path: Path
) -> None:
    url = own_postgres.create_database("writer")
    upgrade(url)
    settings = Settings(data_dir=tmp_path / "state", allow_tiny_model=True, database_url=url)
    settings.ensure_dirs()
    engine = make_engine(url)
    writer = PostgresWriter(engine)

    def new(name: str) -> NewJob:
        return service.prepare_job(_spec(settings.data_dir / "t.txt", name), settings, "alpha")

    async def scenario() -> None:
        try:
            assert (await writer.create(new("before"))).created
            own_postgres.stop("fast")
            for round_ in range(3):  # the pooled connection is gone, then no new one can be opened
                started = time.monotonic()
                together = await asyncio.gather(
                    *(writer.create(new(f"away-{round_}-{i}")) for i in range(5)), return_exceptions=True
                )
                assert all(isinstance(error, DatabaseUnavailable) for error in together), together
                assert time.monotonic() - started < 4.0
            own_postgres.start()
            assert (await writer.create(new("after"))).created  # back without a restart of the writer
        finally:
            await writer.aclose()

    try:
        asyncio.run(scenario())
        assert _count(engine, "SELECT count(*) FROM jobs") == 2
    finally:
        engine.dispose()


def test_dispatcher_passes_page_through_more_jobs_than_one_pass_takes(
    make_settings: Callable[..., Settings], dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass takes PAGE queued jobs; the next passes go on from there (at once), so jobs behind a page
    of held ones get their turn, then the next pass starts over from the oldest."""
    monkeypatch.setattr(dispatcher_module, "PAGE", 5)
    settings = make_settings()
    engine = make_engine(settings.resolved_database_url)
    with Session(engine) as session:
        ids = [
            service.create_job(session, _spec(dataset, f"j{i}"), settings, "alpha")[0].id for i in range(12)
        ]

    seen: list[str] = []

    class Recording(Dispatcher):
        def _claim(self, session: Any, job: Any) -> None:  # every job is held: it stays queued
            seen.append(job.id)

    dispatcher = Recording(engine, make_executor(settings), settings)
    try:
        assert [dispatcher.tick() for _ in range(3)] == [True, True, False]
        assert seen == ids
        seen.clear()
        assert dispatcher.tick() is True and seen == ids[:5]  # a new round starts at the oldest
    finally:
        engine.dispose()


def test_jobs_with_unusable_data_fail_in_groups_each_with_its_own_reason(
    make_settings: Callable[..., Settings], data_root: Path
) -> None:
    """A pass fails the jobs whose data is unusable FAIL_GROUP at a time, a commit per group (not per
    job), each with its own code, message and event; good jobs in between are not held up."""
    settings = make_settings(dispatcher_enabled=False)
    engine = make_engine(settings.resolved_database_url)
    empty = data_root / "empty.txt"
    empty.write_text("")
    specs = [_spec(data_root / f"missing-{i}.txt", f"m{i}") for i in range(dispatcher_module.FAIL_GROUP + 8)]
    specs.insert(5, _spec(empty, "empty"))
    with Session(engine) as session:
        ids = [service.create_job(session, spec, settings, "alpha")[0].id for spec in specs]
    commits: list[int] = []
    sa.event.listen(engine, "commit", lambda _connection: commits.append(1))
    assert Dispatcher(engine, make_executor(settings), settings).tick() is False
    assert len(commits) == 2  # 41 jobs: a group of 32, then the rest at the end of the page
    with Session(engine) as session:
        for job_id, spec in zip(ids, specs, strict=True):
            job = service.get_job(session, "alpha", job_id)
            code = "dataset_empty" if spec.name == "empty" else "dataset_not_found"
            assert (job.status, job.error_code) == ("failed", code)
            assert job.error_message == job.status_message and spec.dataset_uri in job.status_message
            assert job.finished_at is not None
            events = [(e.type, e.level, e.message, e.data) for e in service.list_events(session, job)[0]]
            assert events[-1] == (
                "status",
                "error",
                f"queued → failed: {job.status_message}",
                {"status": "failed", "from": "queued"},
            )
            assert len(events) == 2  # created, failed
    engine.dispose()


def test_a_job_whose_validation_file_is_unusable_fails_with_its_own_code(
    make_settings: Callable[..., Settings], dataset: Path, data_root: Path
) -> None:
    """The dispatcher checks the validation file too (from the light page: the URIs out of the spec's
    JSON in SQL), and names the file that is wrong."""
    settings = make_settings(dispatcher_enabled=False)
    engine = make_engine(settings.resolved_database_url)
    missing = data_root / "missing-validation.txt"
    specs = [
        _spec(dataset, "bad-validation", validation_uri=str(missing)),
        _spec(data_root / "missing.txt", "both", validation_uri=str(dataset)),
    ]
    with Session(engine) as session:
        ids = [service.create_job(session, spec, settings, "alpha")[0].id for spec in specs]
    assert Dispatcher(engine, make_executor(settings), settings).tick() is False
    with Session(engine) as session:
        jobs = [service.get_job(session, "alpha", job_id) for job_id in ids]
    assert [(job.status, job.error_code) for job in jobs] == [
        ("failed", "validation_not_found"),
        ("failed", "dataset_not_found"),
    ]
    assert jobs[0].error_message is not None and str(missing) in jobs[0].error_message
    engine.dispose()


def test_failing_queued_jobs_leaves_out_one_that_moved_on(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    settings = make_settings(dispatcher_enabled=False)
    engine = make_engine(settings.resolved_database_url)
    with Session(engine) as session:
        ids = [
            service.create_job(session, _spec(dataset, f"j{i}"), settings, "alpha")[0].id for i in range(3)
        ]
    with Session(engine, expire_on_commit=False) as session:
        jobs = [service.get_job(session, "alpha", job_id) for job_id in ids]
        with Session(engine) as other:  # cancelled after the dispatcher read it
            service.request_cancel(other, "alpha", jobs[1].id)
        failures = [(job.seq, f"code_{i}", f"why {i}") for i, job in enumerate(jobs)]
        failed = service.fail_queued(session.connection(), failures)
        session.commit()
    assert failed == [jobs[0].seq, jobs[2].seq]
    with Session(engine) as session:
        stored = [service.get_job(session, "alpha", job_id) for job_id in ids]
        assert [(j.status, j.error_code, j.error_message) for j in stored] == [
            ("failed", "code_0", "why 0"),
            ("cancelled", None, None),
            ("failed", "code_2", "why 2"),
        ]
        events = [e.message for e in service.list_events(session, stored[1])[0]]
        assert not any("failed" in message for message in events)
        assert [e.message for e in service.list_events(session, stored[2])[0]][-1] == "queued → failed: why 2"
        assert stored[0].finished_at is not None and stored[0].finished_at == stored[0].updated_at
    engine.dispose()


@pytest.mark.parametrize("busy", [True, False])
def test_dispatcher_yields_to_requests_in_proportion_to_its_cpu(
    make_settings: Callable[..., Settings], dataset: Path, busy: bool
) -> None:
    """While requests arrive, after each job's step the dispatcher waits (1 - share) / share times the CPU
    time the step used (capped), so it takes at most `dispatcher_busy_share` of the interpreter."""
    import time

    settings = make_settings(dispatcher_busy_share=0.25)
    engine = make_engine(settings.resolved_database_url)
    with Session(engine) as session:
        for i in range(3):
            service.create_job(session, _spec(dataset, f"j{i}"), settings, "alpha")
    used: list[float] = []
    waits: list[float] = []

    class Burning(Dispatcher):
        def _claim(self, session: Any, job: Any) -> None:
            start = time.thread_time()
            while time.thread_time() - start < (0.01 if len(used) < 2 else 0.2):  # the last: over the cap
                pass
            used.append(time.thread_time() - start)

    class Recording:
        def wait(self, seconds: float) -> bool:
            waits.append(seconds)
            return False

    dispatcher = Burning(engine, make_executor(settings), settings, api_busy=lambda: busy)
    dispatcher._stop = Recording()  # type: ignore[assignment]
    try:
        dispatcher.tick()
    finally:
        engine.dispose()
    assert len(used) == 3
    if not busy:
        assert waits == []
        return
    assert len(waits) == 4  # the page's data checks (a stat(2) each), then each job's step
    assert waits[0] < 0.01
    waits = waits[1:]
    for step_cpu, wait in zip(used[:2], waits[:2], strict=True):
        assert 3 * step_cpu <= wait <= 3 * step_cpu + 0.01  # the step's CPU and the bookkeeping around it
    assert waits[2] == dispatcher_module.MAX_YIELD_SECONDS


def test_the_api_counts_as_busy_right_after_a_request(make_settings: Callable[..., Settings]) -> None:
    import time

    from fastapi.testclient import TestClient

    from api.main import create_app
    from api.observability import RequestLoad

    app = create_app(make_settings(dispatcher_process=False))  # a thread shares the API's interpreter
    with TestClient(app) as client:
        load = app.state.dispatcher.api_busy.__self__
        assert isinstance(load, RequestLoad)
        before = time.monotonic()
        client.get("/healthz")
        assert before <= load.last_request <= time.monotonic()
    load.last_request = time.monotonic()
    assert load.busy() is True
    load.last_request = time.monotonic() - 2 * RequestLoad.WINDOW_SECONDS
    assert load.busy() is False
