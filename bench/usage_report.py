"""What `GET /usage` (each team's chip-hours and tokens in a window) costs with many jobs stored.

`--jobs` jobs (default 100,000) of 20 tenants, in three shapes, each run for up to a few hours at some time
in the last 60 days (one in 20 preempted once, and back after a wait), inserted straight into the database
with their status events (the moves the report reads) and 10 metrics events each; then the report
through the app in-process (TestClient: the route, its query and the JSON), as an admin (every tenant,
the last 30 days: about half the jobs) and as one tenant. Median wall time of `--rounds` calls. Then
migrations 0008 and 0009 as on a database from before them, timed: the report must be the same after,
and each job's `held_seconds` what the API had written. Last, each job's own chip-hours (its `usage`),
summed by tenant, against the report over all time. Then the retention (TPUTUNE_JOB_RETENTION_DAYS=30:
api.deletion, as the dispatcher's hourly pass runs it) deletes the jobs that ended more than 30 days ago,
timed with its longest transaction; the reports must be the same after (what a deleted job used is kept
apart: usage_spans), and are timed again. Last line: one JSON object.

    .venv/bin/python bench/usage_report.py                          # SQLite and PostgreSQL, 100,000 jobs
    .venv/bin/python bench/usage_report.py --databases sqlite --jobs 10000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastapi.testclient import TestClient  # noqa: E402
from sqlalchemy import insert, select  # noqa: E402

from api import deletion  # noqa: E402
from api.jobs import new_job_id  # noqa: E402
from api.main import create_app  # noqa: E402
from api.migrate import downgrade, upgrade  # noqa: E402
from api.models import Job, JobEvent, utcnow  # noqa: E402
from api.settings import Settings  # noqa: E402
from bench.databases import Databases  # noqa: E402

ADMIN = "bench-admin-key-0123456789"
TENANTS = 20
SHAPES = [{"processes": 1}, {"processes": 2}, {"processes": 4}]
BATCH = 5_000


def seed(settings: Settings, jobs: int) -> float:
    """Insert `jobs` finished jobs; seconds it took."""
    from api.db import make_engine

    engine = make_engine(settings.resolved_database_url, 2)
    rng = random.Random(0)
    now = utcnow()
    started = time.monotonic()
    for first in range(0, jobs, BATCH):
        rows = []
        for i in range(first, min(jobs, first + BATCH)):
            begun = now - timedelta(seconds=rng.uniform(4 * 3600, 60 * 86_400))  # (each over by now)
            shape = SHAPES[i % len(SHAPES)]
            rows.append(
                {
                    "id": new_job_id(),
                    "tenant": f"team{i % TENANTS:02d}",
                    "name": f"bench-{i}",
                    "status": "succeeded",
                    "model": "tiny",
                    "method": "full",
                    "spec": {"name": f"bench-{i}", "model": "tiny", "resources": shape},
                    "executor": "local",
                    "created_at": begun,
                    "updated_at": begun,
                    "started_at": begun,
                    "launched_at": begun - LAUNCH_BEFORE_RUN,
                    "finished_at": begun + timedelta(seconds=rng.uniform(60, 4 * 3600)),
                    "output_uri": "/tmp/out",
                    "step": 100,
                    "trained_tokens": 1_000_000,
                    "restarts": 0,
                    "preemptions": int(rng.random() < 0.05),
                }
            )
            row = rows[-1]  # admitted when launched, or (preempted) when Kueue let it run again
            if row["finished_at"] - row["started_at"] < timedelta(minutes=30):
                row["preemptions"] = 0  # (too short to be preempted and back after 12 minutes)
            row["admitted_at"] = readmitted(row) if row["preemptions"] else row["launched_at"]
            held_before = (preempted_at(row) - row["launched_at"]).total_seconds()  # (preempted: until then)
            row["held_seconds"] = held_before if row["preemptions"] else 0.0
        with engine.begin() as connection:
            table = Job.__table__  # type: ignore[attr-defined]
            statement = insert(table).returning(table.c.seq, sort_by_parameter_order=True)
            seqs = connection.execute(statement, rows).scalars().all()
            events = [event for seq, row in zip(seqs, rows, strict=True) for event in history(seq, row)]
            connection.execute(insert(JobEvent.__table__), events)  # type: ignore[attr-defined]
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.exec_driver_sql("VACUUM ANALYZE jobs")
            connection.exec_driver_sql("VACUUM ANALYZE job_events")
    engine.dispose()
    return time.monotonic() - started


LAUNCH_BEFORE_RUN = timedelta(seconds=59)  # its launch, a second after its move to starting


def preempted_at(job: dict[str, Any]) -> Any:
    """When a job preempted once was: in the middle of its run."""
    return job["started_at"] + (job["finished_at"] - job["started_at"]) / 2


def readmitted(job: dict[str, Any]) -> Any:
    """When a job preempted in the middle of its run was let run again (10 minutes after)."""
    return preempted_at(job) + timedelta(minutes=10)


def history(seq: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished job's events as the API would have written them: its moves (status events), one in 20
    preempted once in the middle of its run, and 10 metrics reports."""
    began, ended = job["started_at"], job["finished_at"]
    moves = [("queued", began - timedelta(minutes=2)), ("starting", began - timedelta(minutes=1))]
    moves.append(("running", began))
    if job["preemptions"]:
        middle = preempted_at(job)
        moves += [("queued", middle), ("starting", readmitted(job))]
        moves.append(("running", middle + timedelta(minutes=12)))
    moves.append(("succeeded", ended))
    events = [
        {"job_seq": seq, "created_at": at, "type": "status", "level": "info", "message": f"→ {status}",
         "step": None, "data": {"status": status, "from": before}, "dedupe_key": None}
        for (before, _), (status, at) in zip([("queued", None), *moves], moves, strict=False)
    ]  # fmt: skip
    launch = {"job_seq": seq, "created_at": job["launched_at"], "type": "launch", "level": "info"}
    events.append(launch | {"message": "Workers started.", "step": None, "data": None, "dedupe_key": None})
    for step in range(10, 110, 10):
        at = began + (ended - began) * step / 100
        events.append(
            {"job_seq": seq, "created_at": at, "type": "metrics", "level": "info", "message": "",
             "step": step, "data": {"loss": 2.0}, "dedupe_key": f"metrics:{step}:"}
        )  # fmt: skip
    return sorted(events, key=lambda event: event["created_at"])  # (ids in the order they were written)


def timed(client: TestClient, rounds: int, **params: str) -> tuple[float, dict[str, Any]]:
    times, body = [], {}
    for _ in range(rounds):
        began = time.perf_counter()
        response = client.get("/usage", params=params, headers={"Authorization": f"Bearer {ADMIN}"})
        times.append(time.perf_counter() - began)
        assert response.status_code == 200, response.text
        body = response.json()
    return statistics.median(times) * 1000, body


def measure(url: str, jobs: int, rounds: int, workdir: Path) -> dict[str, Any]:
    settings = Settings(
        data_dir=workdir / "state",
        database_url=url,
        dispatcher_enabled=False,
        admin_key=ADMIN,
        metrics_enabled=False,
    )
    upgrade(settings.resolved_database_url)
    seeded = seed(settings, jobs)
    with TestClient(create_app(settings)) as client:
        every_ms, every = timed(client, rounds)
        one_ms, _ = timed(client, rounds, tenant="team03")
    counted = sum(row["jobs"] for row in every["data"])
    url = settings.resolved_database_url
    written = held(url)
    # Migrations 0008 and 0009 on these jobs, as on a database upgraded to this version: admitted_at and
    # held_seconds read back from their events. The report must not change, nor any job's held_seconds.
    downgrade(url, "0007")
    migrated_s = {}
    for revision in ("0008", "0009"):
        began = time.monotonic()
        upgrade(url, revision)
        migrated_s[revision] = time.monotonic() - began
    upgrade(url)  # (and the later ones, to this version's head)
    with TestClient(create_app(settings)) as client:
        _, again = timed(client, 1, since=every["since"], until=every["until"])
        # Each job's own chip-hours against the report over all time (from before the first job).
        _, ever = timed(client, 1, since=(utcnow() - timedelta(days=90)).isoformat())
    if again["data"] != every["data"]:
        raise SystemExit(f"the report changed after migrations 0008-9: {every['data']} -> {again['data']}")
    backfilled = held(url)
    worst = max(abs(backfilled[seq] - seconds) for seq, seconds in written.items())
    if backfilled.keys() != written.keys() or worst > 0.002:  # (SQLite's date functions count ms)
        raise SystemExit(f"migration 0009's held_seconds differ from the API's by up to {worst} s")
    reported = sum(row["chip_hours"] for row in ever["data"])
    own = sum(job_chip_hours(url).values())
    if abs(reported - own) > 1e-5 * own + 0.01:  # (each figure rounded as the API shows it)
        raise SystemExit(f"over all time the report counts {reported} chip-hours, the jobs' own {own}")
    retention = retain(settings, client_reports=(every, ever), rounds=rounds)
    return {
        "jobs": jobs,
        "seed_s": round(seeded, 1),
        "jobs_in_30_days": counted,
        "every_tenant_ms": round(every_ms, 1),
        "one_tenant_ms": round(one_ms, 1),
        "migration_0008_s": round(migrated_s["0008"], 1),
        "migration_0009_s": round(migrated_s["0009"], 1),
        "reported_chip_hours": round(reported, 1),
        "jobs_own_chip_hours": round(own, 1),
        **retention,
    }


RETENTION_DAYS = 30


def retain(settings: Settings, client_reports: tuple[dict[str, Any], ...], rounds: int) -> dict[str, Any]:
    """Delete the jobs that ended more than RETENTION_DAYS ago as the retention does; the same reports
    after (fails otherwise), and their times."""
    from api.db import make_engine

    engine = make_engine(settings.resolved_database_url, 2)
    longest = 0.0
    delete = deletion._delete

    def timed_delete(session: Any, seqs: Any) -> Any:  # (a batch: its transaction, less its commit)
        nonlocal longest
        began = time.perf_counter()
        try:
            return delete(session, seqs)
        finally:
            longest = max(longest, time.perf_counter() - began)

    deletion._delete = timed_delete  # type: ignore[assignment]
    try:
        before = utcnow() - timedelta(days=RETENTION_DAYS)
        began = time.monotonic()
        deleted = deletion.delete_ended_before(engine, before, forget=lambda job: None)
        took = time.monotonic() - began
        # A pass that finds nothing to delete (the jobs left ended after `before`), as most hourly ones.
        began = time.perf_counter()
        again = deletion.delete_ended_before(engine, before, forget=lambda job: None)
        idle_ms = (time.perf_counter() - began) * 1000
        assert again == 0, again
    finally:
        deletion._delete = delete  # type: ignore[assignment]
    every, ever = client_reports
    with TestClient(create_app(settings)) as client:
        every_ms, every_after = timed(client, rounds, since=every["since"], until=every["until"])
        _, ever_after = timed(client, 1, since=ever["since"], until=ever["until"])
    vacuumed_ms = None
    if engine.dialect.name == "postgresql":  # (its dead rows gone, as autovacuum does a while after)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            for table in ("jobs", "job_events", "usage_spans"):
                connection.exec_driver_sql(f"VACUUM ANALYZE {table}")
        with TestClient(create_app(settings)) as client:
            vacuumed_ms, _ = timed(client, rounds, since=every["since"], until=every["until"])
    engine.dispose()
    for name, was, now in [("30 days", every, every_after), ("all time", ever, ever_after)]:
        for row, after in zip(was["data"], now["data"], strict=True):
            same = (row["tenant"], row["jobs"], row["trained_tokens"]) == (
                after["tenant"],
                after["jobs"],
                after["trained_tokens"],
            )
            if not same or abs(row["chip_hours"] - after["chip_hours"]) > 1e-3:
                raise SystemExit(f"the report over {name} changed with the retention: {row} -> {after}")
    return {
        "retention_deleted_jobs": deleted,
        "retention_s": round(took, 1),
        "retention_longest_batch_ms": round(longest * 1000, 1),
        "retention_idle_pass_ms": round(idle_ms, 1),
        "every_tenant_after_retention_ms": round(every_ms, 1),
        "every_tenant_after_vacuum_ms": round(vacuumed_ms, 1) if vacuumed_ms is not None else None,
    }


def held(url: str) -> dict[int, float]:
    """Each job's held_seconds, by seq."""
    from api.db import make_engine

    engine = make_engine(url, 1)
    with engine.connect() as connection:
        rows = connection.execute(select(Job.__table__.c.seq, Job.__table__.c.held_seconds))  # type: ignore[attr-defined]
        found = {seq: float(seconds) for seq, seconds in rows}
    engine.dispose()
    return found


def job_chip_hours(url: str) -> dict[str, float]:
    """Each job's chip-hours as GET /jobs/{id} shows it (`usage`), summed by tenant."""
    from api import tpu
    from api.db import make_engine
    from api.jobs import JOB_COLUMNS, JobRow
    from api.schemas import held_seconds, usage_figures
    from worker.config import Resources

    engine = make_engine(url, 1)
    found: dict[str, float] = {}
    with engine.connect() as connection:
        table = Job.__table__  # type: ignore[attr-defined]
        for values in connection.execute(select(*(table.c[name] for name in JOB_COLUMNS))):
            # (as JobPublic.of makes `usage`: the bench's specs are not whole, for it to validate)
            job = JobRow._make(values)
            chips = tpu.chips_of(Resources.model_validate(job.spec["resources"]), job.executor)
            found[job.tenant] = found.get(job.tenant, 0.0) + usage_figures(chips, held_seconds(job))[1]
    engine.dispose()
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--databases", default="sqlite,postgres", help="comma-separated (sqlite,postgres)")
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    figures: list[dict[str, Any]] = []
    databases = Databases()
    try:
        for database in args.databases.split(","):
            url, workdir = databases.new(database, "tputune-usage-report-")
            row = {"database": database, **measure(url, args.jobs, args.rounds, workdir)}
            print(
                f"{database:8} {row['jobs']:,} jobs ({row['jobs_in_30_days']:,} ran in the last 30 days): "
                f"every tenant's report {row['every_tenant_ms']:.1f} ms, "
                f"one tenant's {row['one_tenant_ms']:.1f} ms; migrations 0008 (admitted_at from the "
                f"events) {row['migration_0008_s']:.1f} s and 0009 (held_seconds) "
                f"{row['migration_0009_s']:.1f} s, the same report and held_seconds after them; "
                f"chip-hours ever: report {row['reported_chip_hours']:,.1f}, jobs' own "
                f"{row['jobs_own_chip_hours']:,.1f}; retention ({RETENTION_DAYS} days) deleted "
                f"{row['retention_deleted_jobs']:,} jobs in {row['retention_s']:.1f} s (longest batch of "
                f"{deletion.BATCH} {row['retention_longest_batch_ms']:.0f} ms; a pass with nothing to "
                f"delete {row['retention_idle_pass_ms']:.1f} ms), the same reports after, "
                f"every tenant's {row['every_tenant_after_retention_ms']:.1f} ms"
                + (
                    f" ({row['every_tenant_after_vacuum_ms']:.1f} ms after VACUUM ANALYZE)"
                    if row["every_tenant_after_vacuum_ms"] is not None
                    else ""
                ),
                flush=True,
            )
            figures.append(row)
    finally:
        databases.close()
    print(json.dumps({"benchmark": "usage_report", "figures": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
