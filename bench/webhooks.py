"""What webhooks cost the leader, and how fast they go out (api.webhooks.WebhookSender, one pass at a time).

Per database: `--jobs` queued jobs of a team with an endpoint (a local HTTP server that answers 200), and
`--reports` worker reports (metrics events) written just now, as a busy server has: on PostgreSQL the
sender reads the events of the last CURSOR_GRACE_SECONDS again on every pass. Then
- a quiet pass (nothing new: what every second costs the leader), the median of 20;
- `--jobs` jobs fail at once (api.jobs.fail_queued: a status event each): the time until the endpoint has
  every delivery, deliveries per second, and the passes it took (run as the sender's thread runs them);
- again, with a second endpoint of the team's that never answers (each post to it waits out the
  timeout, 10 s): the time until the first has every delivery;
- in a database of its own, `--endpoints` endpoints with a backlog each (3 deliveries due): what a pass
  reads to choose the deliveries to send (`WebhookSender._due`, a full page: each endpoint's oldest),
  the median of 15.
The endpoint is Python's http.server in a process of its own, on the same 2 cores.
Last line: one JSON object.

    .venv/bin/python bench/webhooks.py                          # SQLite and PostgreSQL
    .venv/bin/python bench/webhooks.py --databases sqlite --jobs 500 --reports 10000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import sys
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import insert, text  # noqa: E402
from sqlmodel import Session  # noqa: E402

from api.db import make_engine  # noqa: E402
from api.jobs import fail_queued, prepare_job, write_jobs  # noqa: E402
from api.migrate import upgrade  # noqa: E402
from api.models import JobEvent, Webhook, WebhookDelivery, utcnow  # noqa: E402
from api.schemas import JobCreate  # noqa: E402
from api.settings import Settings  # noqa: E402
from api.webhooks import DEFAULT_EVENTS, SEND_PAGE, WebhookSender, new_secret  # noqa: E402
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
    hook = {
        "id": "wh_bench",
        "tenant": "bench",
        "url": endpoint.url,
        "events": list(DEFAULT_EVENTS),
        "secret": new_secret(),
        "created_at": utcnow(),
    }
    spec = JobCreate.model_validate({"name": "b", "model": "tiny", "dataset_uri": str(dataset)})
    with engine.begin() as connection:
        connection.execute(insert(Webhook.__table__), hook)  # type: ignore[attr-defined]
        write_jobs(connection, [prepare_job(spec, settings, "bench") for _ in range(2 * jobs)])
        seqs = list(connection.execute(text("SELECT seq FROM jobs ORDER BY seq")).scalars())
        now = utcnow()
        rows = [
            {
                "job_seq": seqs[i % len(seqs)],
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
    sender.tick()  # (the cursor read)
    quiet = []
    for _ in range(20):
        started = time.perf_counter()
        sender.tick()
        quiet.append(time.perf_counter() - started)
    figures: dict[str, Any] = {"quiet_pass_ms": round(statistics.median(quiet) * 1000, 2)}
    figures.update(burst(engine, sender, endpoint, seqs[:jobs], settings))
    # Again, with a second endpoint of the team's that never answers (each post waits out the timeout).
    hanging = socket.create_server(("127.0.0.1", 0), backlog=128)  # (connections made, never accepted)
    with engine.begin() as connection:
        connection.execute(
            insert(Webhook.__table__),  # type: ignore[attr-defined]
            {**hook, "id": "wh_hanging", "url": f"http://127.0.0.1:{hanging.getsockname()[1]}/hook"},
        )
    beside = burst(engine, sender, endpoint, seqs[jobs:], settings)
    figures.update({f"{key}_beside_hanging": value for key, value in beside.items()})
    sender.close()
    hanging.close()
    endpoint.close()
    engine.dispose()
    return figures


def burst(
    engine: Any, sender: WebhookSender, endpoint: Endpoint, seqs: list[int], settings: Settings
) -> dict[str, Any]:
    """The jobs `seqs` fail at once; the sender's passes run as its thread runs them (`step`) until the
    endpoint has every one."""
    before = endpoint.count
    with engine.begin() as connection:
        failed = fail_queued(connection, [(seq, "bench", "The bench ended it.") for seq in seqs])
    assert len(failed) == len(seqs)
    started = time.perf_counter()
    passes = 0
    while endpoint.count - before < len(seqs):
        sender.step()
        passes += 1
        if time.perf_counter() - started > 600:
            raise RuntimeError(f"only {endpoint.count - before} of {len(seqs)} delivered in 10 minutes")
    took = time.perf_counter() - started
    sender.settle(timeout=30)  # (what the endpoints answered, recorded)
    with engine.connect() as connection:
        delivered = connection.execute(
            text("SELECT count(*) FROM webhook_deliveries WHERE status = 'delivered' AND webhook_id = :id"),
            {"id": "wh_bench"},
        ).scalar_one()
    return {
        "burst_seconds": round(took, 2),
        "deliveries_per_second": round(len(seqs) / took),
        "passes": passes,
        "delivered": delivered - before,
    }


def backlog_read(url: str, workdir: Path, endpoints: int, each: int = 3) -> float:
    """Milliseconds a pass takes to choose what to send where `endpoints` endpoints have `each` deliveries
    due (more than a page: each endpoint's oldest are read), the median of 15. Nothing is posted."""
    upgrade(url)
    engine = make_engine(url, 4)
    due_at = utcnow() - timedelta(seconds=5)
    hooks = [
        {
            "id": f"wh_{i:06d}",
            "tenant": "bench",
            "url": "http://127.0.0.1:9/hook",
            "events": ["job.failed"],
            "secret": new_secret(),
            "created_at": due_at,
        }
        for i in range(endpoints)
    ]
    deliveries = [
        {
            "webhook_id": hook["id"],
            "event_id": n,
            "type": "job.failed",
            "job_id": f"ft-{n}",
            "body": "{}",
            "status": "pending",
            "attempts": 0,
            "created_at": due_at,
            "next_attempt_at": due_at,
        }
        for n, hook in enumerate(hook for hook in hooks for _ in range(each))
    ]
    with engine.begin() as connection:
        connection.execute(insert(Webhook.__table__), hooks)  # type: ignore[attr-defined]
        for start in range(0, len(deliveries), 5_000):
            connection.execute(insert(WebhookDelivery.__table__), deliveries[start : start + 5_000])  # type: ignore[attr-defined]
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("ANALYZE"))
    sender = WebhookSender(engine, Settings(data_dir=workdir / "state", database_url=url))
    took = []
    for _ in range(15):
        with Session(engine) as session:
            started = time.perf_counter()
            due = sender._due(session, SEND_PAGE)
            took.append(time.perf_counter() - started)
            session.rollback()  # (nothing put off stays so)
        assert len(due) == min(SEND_PAGE, endpoints * each), len(due)
    sender.close()
    engine.dispose()
    return round(statistics.median(took) * 1000, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--databases", default="sqlite,postgres", help="comma-separated (sqlite,postgres)")
    p.add_argument("--jobs", type=int, default=2_000, help="jobs that end at once (2,000)")
    p.add_argument("--reports", type=int, default=60_000, help="reports written in the last minute (60,000)")
    p.add_argument("--endpoints", type=int, default=1_000, help="endpoints with a backlog each (1,000)")
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
                f"({row['deliveries_per_second']:,}/s, {row['passes']} passes); beside an endpoint that "
                f"never answers: {row['burst_seconds_beside_hanging']:.2f} s "
                f"({row['deliveries_per_second_beside_hanging']:,}/s, {row['passes_beside_hanging']} passes)",
                flush=True,
            )
            url, workdir = databases.new(database, "tputune-webhooks-")
            row["backlog_read_ms"] = backlog_read(url, workdir, args.endpoints)
            row["endpoints"] = args.endpoints
            print(
                f"{database:8} {args.endpoints:,} endpoints with a backlog each: a pass chooses what to send "
                f"in {row['backlog_read_ms']:.1f} ms",
                flush=True,
            )
            figures.append(row)
    finally:
        databases.close()
    print(json.dumps({"webhooks": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
