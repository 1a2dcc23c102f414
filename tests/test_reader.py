"""GET /jobs/{id} reads on the event loop (api.reader): the same answer as the other routes, and the
PostgreSQL reader's own pool survives a dropped connection and a database that is away."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.pool import NullPool
from sqlmodel import Session, col, select, update

from api import schemas
from api.errors import ApiError, DatabaseUnavailable
from api.jobs import EventPoll, JobListing
from api.migrate import upgrade
from api.models import Job, utcnow
from api.reader import InlineReader, PostgresReader, SqliteReader, make_reader
from api.routes import jobs as job_routes
from api.schemas import EventPublic, JobPage, JobPublic
from tests.support.postgres import PostgresServer
from tests.test_progress import metrics, post, started_job


def test_get_and_list_answer_as_the_models_write_them(client: TestClient, dataset: Path) -> None:
    """GET /jobs/{id} and GET /jobs read with the driver on the event loop and write each job's JSON
    themselves (api.reader, routes/jobs.py's _rendered and _page_json): byte for byte, what JobPublic and
    JobPage write for the ORM's Job objects. A running job with progress, metrics, a checkpoint and times,
    queued and cancelled ones with metadata; pages through a cursor, filtered pages (on SQLite read on a
    worker thread), an empty last page."""
    reader = client.app.state.job_reader  # type: ignore[attr-defined]
    engine = client.app.state.engine  # type: ignore[attr-defined]
    assert isinstance(reader, PostgresReader if engine.dialect.name == "postgresql" else SqliteReader)
    job_id, token = started_job(client, dataset)
    post(client, job_id, token, [metrics(3, 2.5), {"kind": "eval", "step": 3, "eval_loss": 2.7}])
    post(client, job_id, token, [{"kind": "checkpoint", "step": 3, "uri": "/x/ckpt/3", "loss": 2.5}])
    client.post(f"/jobs/{job_id}/cancel")  # cancel_requested: still running, until the worker stops
    others = []
    for i in range(4):
        body = {
            "name": f"j{i}",
            "model": "tiny",
            "dataset_uri": str(dataset),
            "metadata": {"team": "ab"[i % 2]},
        }
        others.append(client.post("/jobs", json=body).json()["id"])
    client.post(f"/jobs/{others[1]}/cancel")
    newest_first = [*reversed(others), job_id]

    def public(ids: list[str]) -> list[JobPublic]:
        with Session(engine) as session:
            jobs = {job.id: job for job in session.exec(select(Job).where(col(Job.id).in_(ids)))}
            return [JobPublic.of(jobs[i]) for i in ids]

    def expected(ids: list[str], has_more: bool) -> str:
        page = JobPage(data=public(ids), has_more=has_more, next_after=ids[-1] if has_more else None)
        return page.model_dump_json()

    fetched = client.get(f"/jobs/{job_id}")
    assert fetched.status_code == 200
    assert fetched.text == public([job_id])[0].model_dump_json()
    assert fetched.json()["started_at"].endswith(("Z", "+00:00"))
    assert fetched.json()["checkpoint_uri"] == "/x/ckpt/3"
    pages = [
        ({"limit": 2}, newest_first[:2], True),
        ({"limit": 2, "after": newest_first[1]}, newest_first[2:4], True),
        ({"limit": 2, "after": newest_first[3]}, newest_first[4:], False),
        ({"after": newest_first[-1]}, [], False),  # a cursor at the end: an empty page, not an error
        ({"metadata[team]": "a"}, [others[2], others[0]], False),
        ({"status": "cancelled"}, [others[1]], False),
        ({"status": ["queued", "cancelled"], "limit": 3}, newest_first[:3], True),
        ({"status": "queued", "metadata[team]": "b"}, [others[3]], False),
    ]
    for params, ids, has_more in pages:
        listed = client.get("/jobs", params=params)
        assert listed.status_code == 200, (params, listed.text)
        assert listed.text == (
            expected(ids, has_more)
            if ids
            else '{"object":"list","data":[],"has_more":false,"next_after":null}'
        ), params
    for params in ({"after": "ft-nope"}, {"after": "ft-nope", "status": "queued"}):
        answer = client.get("/jobs", params=params)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_cursor", params
    assert client.get("/jobs/ft-nope").json()["error"]["code"] == "job_not_found"
    if engine.dialect.name == "sqlite":  # the reader for SQLite in memory, through the engine: the same rows
        inline = InlineReader(engine)
        for params, _, _ in pages:
            status = params.get("status", [])
            listing = JobListing(
                status=[status] if isinstance(status, str) else status,
                metadata={"team": params["metadata[team]"]} if "metadata[team]" in params else None,
                after=params.get("after"),
                limit=params.get("limit", 20),
            )
            assert asyncio.run(inline.list_jobs("default", listing)) == asyncio.run(
                reader.list_jobs("default", listing)
            ), params
        with pytest.raises(ApiError, match="ft-nope"):
            asyncio.run(inline.list_jobs("default", JobListing(after="ft-nope")))
        assert asyncio.run(inline.read_job("default", job_id)) == asyncio.run(
            reader.read_job("default", job_id)
        )


def test_a_job_holding_its_chips_reads_as_the_model_writes_it_at_each_moment(
    client: TestClient, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that holds its chips has a `usage` that grows with the clock: GET /jobs/{id} keeps the JSON
    around it and writes its figures anew, byte for byte as JobPublic would then, for held times from
    nothing to decades, with time held before a preemption, and one process or several."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    body = {"name": "p", "model": "tiny", "dataset_uri": str(dataset), "resources": {"processes": 2}}
    ids = [started_job(client, dataset)[0], client.post("/jobs", json=body).json()["id"]]
    now = utcnow()
    clock = [now]
    monkeypatch.setattr(schemas, "utcnow", lambda: clock[0])
    monkeypatch.setattr(job_routes, "USAGE_MAX_AGE", 0.0)  # (written anew on every read)
    for job_id in ids:
        for before in (0.0, 12.3456789):
            with Session(engine) as session:  # (launched an hour ago; held `before` before a preemption)
                session.execute(
                    update(Job)
                    .where(col(Job.id) == job_id)
                    .values(status="running", admitted_at=now - timedelta(hours=1), held_seconds=before)
                )
                session.commit()
                job = session.exec(select(Job).where(Job.id == job_id)).one()
            for later in (0, 0.0001, 0.0004, 1.5, 59.999, 86_400 * 40, 86_400 * 365 * 30):
                clock[0] = now + timedelta(seconds=later)
                fetched = client.get(f"/jobs/{job_id}")
                assert fetched.text == JobPublic.of(job).model_dump_json(), (job_id, before, later)
                listed = client.get("/jobs", params={"limit": 2}).text
                assert JobPublic.of(job).model_dump_json() in listed, (job_id, before, later)
            # Read again within USAGE_MAX_AGE, it is shown as it was (at most that old); then anew.
            monkeypatch.setattr(job_routes, "USAGE_MAX_AGE", 60.0)
            clock[0] += timedelta(hours=1)
            assert client.get(f"/jobs/{job_id}").text == fetched.text
            monkeypatch.setattr(job_routes, "USAGE_MAX_AGE", 0.0)
            assert client.get(f"/jobs/{job_id}").text == JobPublic.of(job).model_dump_json() != fetched.text
            clock[0] -= timedelta(hours=1)
            usage = fetched.json()["usage"]
            chips = 2 if job_id == ids[1] else 1
            held = before + 3600 + 86_400 * 365 * 30
            assert usage == {
                "chips": chips,
                "chip_unit": "processes",
                "held_seconds": round(held, 3),
                "chip_hours": round(chips * held / 3600, 4),
            }


def test_followed_events_read_as_the_pages_show_them(client: TestClient, dataset: Path) -> None:
    """A followed job's events are read on the event loop (api.reader.poll_events; on SQLite with a type
    filter on a worker thread): the same events, in the same JSON, as the paged route reads through the
    ORM, after any cursor and of any types; another tenant's job, or none, is no job."""
    reader = client.app.state.job_reader  # type: ignore[attr-defined]
    engine = client.app.state.engine  # type: ignore[attr-defined]
    job_id, token = started_job(client, dataset)
    post(
        client,
        job_id,
        token,
        [metrics(1, 2.9), metrics(2, 2.7), {"kind": "eval", "step": 2, "eval_loss": 2.8}],
    )
    post(client, job_id, token, [{"kind": "checkpoint", "step": 2, "uri": "/x/ckpt/2", "loss": 2.7}])
    client.post(f"/jobs/{job_id}/cancel")
    paged = client.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    assert len(paged) >= 6 and {"status", "metrics", "eval", "checkpoint"} <= {e["type"] for e in paged}
    readers = [reader] + ([InlineReader(engine)] if engine.dialect.name == "sqlite" else [])
    for each in readers:
        for after, types in [(0, []), (paged[2]["id"], []), (0, ["metrics", "checkpoint"]), (0, ["sample"])]:
            status, rows = asyncio.run(each.poll_events("default", EventPoll(job_id, after, types)))
            assert status == "cancelling"  # (until its worker stops)
            expected = [e for e in paged if e["id"] > after and (not types or e["type"] in types)]
            assert [json.loads(EventPublic.of(row).model_dump_json()) for row in rows] == expected
        assert asyncio.run(each.poll_events("other", EventPoll(job_id))) == (None, [])
        assert asyncio.run(each.poll_events("default", EventPoll("ft-nope"))) == (None, [])


def test_event_heads_are_each_jobs_tenant_status_and_newest_event(
    client: TestClient, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the process's EventWatch asks each tick for all followed jobs at once: the newest event id
    of each (and its tenant and status), as the paged route sees them; jobs that do not exist are left
    out. On SQLite in chunks of ids (two here), one statement on PostgreSQL."""
    monkeypatch.setattr("api.reader._HEADS_CHUNK", 2)
    reader = client.app.state.job_reader  # type: ignore[attr-defined]
    engine = client.app.state.engine  # type: ignore[attr-defined]
    running, token = started_job(client, dataset)
    post(client, running, token, [metrics(1, 2.9), metrics(2, 2.7)])
    queued = client.post("/jobs", json={"name": "q", "model": "tiny", "dataset_uri": str(dataset)}).json()[
        "id"
    ]
    cancelled = client.post("/jobs", json={"name": "c", "model": "tiny", "dataset_uri": str(dataset)}).json()
    client.post(f"/jobs/{cancelled['id']}/cancel")
    ids = [running, queued, cancelled["id"]]

    def newest(job_id: str) -> int:
        return max(
            e["id"] for e in client.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
        )

    expected = {
        job_id: ("default", client.get(f"/jobs/{job_id}").json()["status"], newest(job_id)) for job_id in ids
    }
    assert [status for _, status, _ in expected.values()] == ["running", "queued", "cancelled"]
    readers = [reader] + ([InlineReader(engine)] if engine.dialect.name == "sqlite" else [])
    for each in readers:
        heads = asyncio.run(each.event_heads([*ids, "ft-nope", "ft-nope2"]))
        assert {job_id: tuple(head) for job_id, head in heads.items()} == expected
        assert heads[running].last_event == expected[running][2]
        assert asyncio.run(each.event_heads([])) == {}


def test_sqlite_in_memory_reads_through_the_engine() -> None:
    engine = sa.create_engine("sqlite://")
    assert isinstance(make_reader(engine), InlineReader)


async def _read(reader: PostgresReader, job_id: str) -> object:
    return await reader.read_job("default", job_id)


def _insert_jobs(url: str, jobs: list[tuple[str, str]]) -> None:
    engine = sa.create_engine(url, poolclass=NullPool)
    with engine.begin() as connection:
        for job_id, tenant in jobs:
            connection.execute(
                sa.text(
                    "INSERT INTO jobs (id, tenant, name, status, model, method, spec, executor, created_at,"
                    " updated_at, step, trained_tokens, restarts, output_uri) VALUES (:id, :tenant, 'n',"
                    " 'queued', 'tiny', 'lora', '{}', 'local', now(), now(), 0, 0, 0, '/out')"
                ),
                {"id": job_id, "tenant": tenant},
            )


@pytest.mark.postgres
def test_postgres_reads_asked_together_share_a_statement(postgres_db_url: str) -> None:
    """With its one connection busy, the reads asked meanwhile are answered by the next statement: each
    gets its own job, another tenant's job is not found, and a request that goes away takes no other
    request's answer with it."""
    upgrade(postgres_db_url)
    jobs = [(f"ft-{i}", "a" if i % 2 else "b") for i in range(12)]
    _insert_jobs(postgres_db_url, jobs)
    reader = PostgresReader.for_engine(sa.create_engine(postgres_db_url, poolclass=NullPool), size=1)
    batches: list[int] = []
    read_many = reader._read

    async def counted(job_ids: list[str]) -> list[object]:
        batches.append(len(job_ids))
        return await read_many(job_ids)

    reader._read = counted  # type: ignore[method-assign]

    async def scenario() -> None:
        asks = [(tenant, job_id) for job_id, tenant in jobs] + [("a", "ft-0"), ("b", "ft-1"), ("a", "ft-x")]
        tasks = [asyncio.create_task(reader.read_job(tenant, job_id)) for tenant, job_id in asks]
        gone = asyncio.create_task(reader.read_job("a", "ft-3"))
        await asyncio.sleep(0)
        gone.cancel()
        rows = await asyncio.gather(*tasks)
        for (tenant, job_id), row in zip(asks[:12], rows[:12], strict=True):
            assert row is not None and (row.id, row.tenant) == (job_id, tenant)
        assert rows[12:] == [None, None, None]  # other tenants' jobs, and no such job
        assert (await reader.read_job("a", "ft-3")).id == "ft-3"
        await reader.close()

    asyncio.run(scenario())
    assert batches[0] == 1 and sum(batches[:2]) == 16 and len(batches) == 3, batches


@pytest.mark.postgres
def test_postgres_reader_replaces_a_connection_the_server_dropped(postgres_db_url: str) -> None:
    upgrade(postgres_db_url)
    engine = sa.create_engine(postgres_db_url, poolclass=NullPool)
    reader = PostgresReader.for_engine(engine, size=1)

    async def scenario() -> None:
        assert await _read(reader, "ft-none") is None
        ((connection, _),) = reader._connections._idle
        first = connection.info.backend_pid
        with engine.connect() as killer:
            assert killer.exec_driver_sql(f"SELECT pg_terminate_backend({first})").scalar()
        assert await _read(reader, "ft-none") is None  # retried on a new connection, unseen by the caller
        ((connection, _),) = reader._connections._idle
        assert connection.info.backend_pid != first
        await reader.close()

    asyncio.run(scenario())


@pytest.mark.postgres
def test_postgres_reader_fails_fast_while_the_database_is_away(
    own_postgres: PostgresServer,
) -> None:
    url = own_postgres.create_database("reader")
    upgrade(url)
    reader = PostgresReader.for_engine(sa.create_engine(url, poolclass=NullPool), size=2)

    async def scenario() -> None:
        assert await _read(reader, "ft-none") is None
        own_postgres.stop("fast")  # (immediate would lose the migration: the test server skips fsync)
        for _ in range(3):  # the pooled connection is gone, then no new one can be opened
            started = time.monotonic()
            together = await asyncio.gather(
                *(_read(reader, "ft-none") for _ in range(5)), return_exceptions=True
            )
            assert all(isinstance(error, DatabaseUnavailable) for error in together), together
            assert time.monotonic() - started < 4.0
        own_postgres.start()
        assert await _read(reader, "ft-none") is None  # back without a restart of the reader
        await reader.close()

    asyncio.run(scenario())


@pytest.mark.postgres
@pytest.mark.parametrize("size", [1, 2])
def test_a_slow_statement_holds_up_other_reads_only_briefly(postgres_db_url: str, size: int) -> None:
    """One statement at a time as a rule; reads that have waited `slow_seconds` behind a slow one get a
    statement of their own, up to `size` in flight."""
    upgrade(postgres_db_url)
    _insert_jobs(postgres_db_url, [(f"ft-{i}", "a") for i in range(3)])
    reader = PostgresReader.for_engine(sa.create_engine(postgres_db_url, poolclass=NullPool), size=size)
    reader.slow_seconds = 0.05
    batches: list[list[str]] = []
    read_many = reader._read

    async def first_one_slow(job_ids: list[str]) -> list[object]:
        batches.append(job_ids)
        if len(batches) == 1:
            await asyncio.sleep(1.0)
        return await read_many(job_ids)

    reader._read = first_one_slow  # type: ignore[method-assign]

    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        slow = asyncio.create_task(reader.read_job("a", "ft-0"))
        await asyncio.sleep(0.01)
        others = [asyncio.create_task(reader.read_job("a", job_id)) for job_id in ("ft-1", "ft-2")]
        await asyncio.sleep(0.02)
        assert len(batches) == 1  # not yet: they have waited less than slow_seconds
        done = []
        for task in others:
            row = await task
            assert row is not None
            done.append(loop.time() - started)
        assert (await slow).id == "ft-0"
        await reader.close()
        return done

    done = asyncio.run(scenario())
    assert batches == [["ft-0"], ["ft-1", "ft-2"]]  # the two waiting reads shared the second statement
    if size == 2:
        assert max(done) < 0.5  # well before the slow statement's second
    else:
        assert min(done) >= 1.0  # one connection: they waited for it
