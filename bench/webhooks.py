"""What webhooks cost the leader, and how fast they go out (api.webhooks.WebhookSender, one pass at a time).

Per database: `--jobs` queued jobs of a team with an endpoint (a local HTTP server that answers 200), and
`--reports` worker reports (metrics events) written just now, as a busy server has: on PostgreSQL the
sender reads the events of the last CURSOR_GRACE_SECONDS again on every pass. Then
- a quiet pass (nothing new: what every second costs the leader), the median of 20;
- every job fails at once (api.jobs.fail_queued: a status event each): the time until every delivery has
  been delivered, deliveries per second, and the passes it took.
The endpoint is Python's http.server in a process of its own, on the same 2 cores.
Last line: one JSON object.

    .venv/bin/python bench/webhooks.py                          # SQLite and PostgreSQL
    .venv/bin/python bench/webhooks.py --databases sqlite --jobs 500 --reports 10000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import insert, text  # noqa: E402

from api.db import make_engine  # noqa: E402
from api.jobs import fail_queued, prepare_job, write_jobs  # noqa: E402
from api.migrate import upgrade  # noqa: E402
from api.models import JobEvent, Webhook, utcnow  # noqa: E402
from api.schemas import JobCreate  # noqa: E402
from api.settings import Settings  # noqa: E402
from api.webhooks import DEFAULT_EVENTS, WebhookSender, new_secret  # noqa: E402
from bench.databases import Databases  # noqa: E402


class Endpoint:
    """A process of its own that answers every POST with 200 and counts them (in the sender's process its
    threads would take the interpreter's lock from the sender's)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.posted = context.Value("l", 0)
        ready = context.Queue()
        self.process = context.Process(target=_serve, args=(self.posted, ready), daemon=True)
        self.process.start()
        self.url = f"http://127.0.0.1:{ready.get(timeout=30)}/hook"

    @property
    def count(self) -> int:
        return int(self.posted.value)

    def close(self) -> None:
        self.process.terminate()
        self.process.join(timeout=10)


def _serve(posted: Any, ready: Any) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()
            with posted.get_lock():
                posted.value += 1

        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # (the default 5 drops connections opened together: a retry 1 s later)

    server = Server(("127.0.0.1", 0), Handler)
    ready.put(server.server_address[1])
    server.serve_forever()


def measure(url: str, workdir: Path, jobs: int, reports: int) -> dict[str, Any]:
    upgrade(url)
    engine = make_engine(url, 4)
    dataset = workdir / "train.txt"
    dataset.write_text("Once upon a time.\n")
    settings = Settings(
        data_dir=workdir / "state",
        database_url=url,
        allowed_data_roots=[workdir],
        allow_tiny_model=True,
        webhook_allow_http=True,
        webhook_allow_private=True,
    )
    endpoint = Endpoint()
    spec = JobCreate.model_validate({"name": "b", "model": "tiny", "dataset_uri": str(dataset)})
    with engine.begin() as connection:
        connection.execute(
            insert(Webhook.__table__),  # type: ignore[attr-defined]
            {
                "id": "wh_bench",
                "tenant": "bench",
                "url": endpoint.url,
                "events": list(DEFAULT_EVENTS),
                "secret": new_secret(),
                "created_at": utcnow(),
            },
        )
        write_jobs(connection, [prepare_job(spec, settings, "bench") for _ in range(jobs)])
        seqs = list(connection.execute(text("SELECT seq FROM jobs ORDER BY seq")).scalars())
        now = utcnow()
        rows = [
            {
                "job_seq": seqs[i % jobs],
                "created_at": now,
                "type": "metrics",
                "message": "",
                "step": i,
                "data": {},
            }
            for i in range(reports)
        ]
        for start in range(0, len(rows), 5_000):
            connection.execute(insert(JobEvent.__table__), rows[start : start + 5_000])  # type: ignore[attr-defined]
    if engine.dialect.name == "postgresql":  # (as a server's autovacuum would have, long before)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("ANALYZE"))
    sender = WebhookSender(engine, settings)
    sender.tick()  # (the cursor read, the pools made)
    quiet = []
    for _ in range(20):
        started = time.perf_counter()
        sender.tick()
        quiet.append(time.perf_counter() - started)
    with engine.begin() as connection:
        failed = fail_queued(connection, [(seq, "bench", "The bench ended it.") for seq in seqs])
    assert len(failed) == jobs
    started = time.perf_counter()
    passes = 0
    while endpoint.count < jobs:
        sender.tick()
        passes += 1
        if time.perf_counter() - started > 600:
            raise RuntimeError(f"only {endpoint.count} of {jobs} delivered in 10 minutes")
    took = time.perf_counter() - started
    sender.tick()  # (the last results recorded)
    with engine.connect() as connection:
        delivered = connection.execute(
            text("SELECT count(*) FROM webhook_deliveries WHERE status = 'delivered'")
        ).scalar_one()
    sender.close()
    endpoint.close()
    engine.dispose()
    return {
        "quiet_pass_ms": round(statistics.median(quiet) * 1000, 2),
        "burst_seconds": round(took, 2),
        "deliveries_per_second": round(jobs / took),
        "passes": passes,
        "delivered": delivered,
        "posted": endpoint.count,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--databases", default="sqlite,postgres", help="comma-separated (sqlite,postgres)")
    p.add_argument("--jobs", type=int, default=2_000, help="jobs that end at once (2,000)")
    p.add_argument("--reports", type=int, default=60_000, help="reports written in the last minute (60,000)")
    args = p.parse_args(argv)
    figures: list[dict[str, Any]] = []
    databases = Databases()
    try:
        for database in args.databases.split(","):
            url, workdir = databases.new(database, "tputune-webhooks-")
            row = {"database": database, "jobs": args.jobs, "reports": args.reports}
            row.update(measure(url, workdir, args.jobs, args.reports))
            print(
                f"{database:8} quiet pass {row['quiet_pass_ms']:7.2f} ms ({args.reports:,} reports in the "
                f"last minute); {args.jobs:,} jobs ending at once: delivered in {row['burst_seconds']:.2f} s "
                f"({row['deliveries_per_second']:,}/s, {row['passes']} passes)",
                flush=True,
            )
            figures.append(row)
    finally:
        databases.close()
    print(json.dumps({"webhooks": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
