"""What GET /jobs/{id} of a queued job costs for its place in the queue (api.reader.QueuePlaces), with a
long queue: `--jobs` queued (20,000), the place of the last one.

- counted: `JobReader.queue_position`, one count of the jobs ahead (what every GET did; on SQLite, on the
  event loop), the median of 20;
- looked up: past QueuePlaces.LONG jobs queued, one read of the whole queue (`queued_order`; on SQLite off
  the event loop), made at most once a second (its time: the median of 5; a GET waits for it only when
  the last one is 10 s old), and a lookup per GET (the median of 1,000).
Last line: one JSON object.

    .venv/bin/python bench/queue_places.py                     # SQLite and PostgreSQL
    .venv/bin/python bench/queue_places.py --databases sqlite --jobs 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import text  # noqa: E402

from api.db import make_engine  # noqa: E402
from api.jobs import prepare_job, write_jobs  # noqa: E402
from api.migrate import upgrade  # noqa: E402
from api.reader import QueuePlaces, make_reader  # noqa: E402
from api.schemas import JobCreate  # noqa: E402
from api.settings import Settings  # noqa: E402
from bench.databases import Databases  # noqa: E402


async def timed(call: Any, times: int) -> float:
    """The median time of `times` awaits of `call()`, in ms."""
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        await call()
        spent.append(time.perf_counter() - started)
    return statistics.median(spent) * 1000


def measure(url: str, workdir: Path, jobs: int) -> dict[str, Any]:
    upgrade(url)
    engine = make_engine(url)
    dataset = workdir / "train.txt"
    dataset.write_text("Once upon a time.\n")
    settings = Settings(data_dir=workdir, database_url=url, allow_tiny_model=True)
    spec = JobCreate.model_validate({"name": "q", "model": "tiny", "dataset_uri": str(dataset)})
    with engine.begin() as connection:
        for start in range(0, jobs, 5_000):
            count = min(5_000, jobs - start)
            write_jobs(connection, [prepare_job(spec, settings, "bench") for _ in range(count)])
        last = connection.execute(text("SELECT id FROM jobs ORDER BY seq DESC LIMIT 1")).scalar_one()
    if engine.dialect.name == "postgresql":  # (as a server's autovacuum would have, long before)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("ANALYZE"))

    async def run() -> dict[str, Any]:
        reader = make_reader(engine)
        try:
            counted = await timed(lambda: reader.queue_position(last), 20)
            places = QueuePlaces(reader, "local")
            assert await places.position(last, "bench", "local") == jobs  # (counted: now past LONG)
            places.SECONDS = places.STALE_SECONDS = 0  # (a read each time, waited for)
            read = await timed(lambda: places.position(last, "bench", "local"), 5)
            places.SECONDS = places.STALE_SECONDS = 3600
            looked_up = await timed(lambda: places.position(last, "bench", "local"), 1_000)
            assert await places.position(last, "bench", "local") == jobs
        finally:
            await reader.close()
        return {"counted_ms": round(counted, 3), "read_ms": round(read, 2), "lookup_ms": round(looked_up, 4)}

    try:
        return asyncio.run(run())
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--databases", default="sqlite,postgres", help="comma-separated (sqlite,postgres)")
    p.add_argument("--jobs", type=int, default=20_000, help="jobs queued (20,000)")
    args = p.parse_args(argv)
    figures: list[dict[str, Any]] = []
    databases = Databases()
    try:
        for database in args.databases.split(","):
            url, workdir = databases.new(database, "tputune-queue-")
            row = {"database": database, "jobs": args.jobs, **measure(url, workdir, args.jobs)}
            print(
                f"{database:8} {args.jobs:,} queued, the last one's place: counted "
                f"{row['counted_ms']:.2f} ms a GET; looked up {row['lookup_ms'] * 1000:.1f} us a GET, from "
                f"a read of the queue ({row['read_ms']:.1f} ms, in the background, once a second at most)",
                flush=True,
            )
            figures.append(row)
    finally:
        databases.close()
    print(json.dumps({"queue_places": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
