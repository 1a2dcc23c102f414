"""Faults: the database goes away under load; the API process is killed while jobs are submitted."""

from __future__ import annotations

import json
import random
import shlex
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from api import db
from api.db import make_engine
from api.migrate import upgrade
from api.runner import process_start_time
from api.settings import Settings
from tests.conftest import LiveApi, free_port
from tests.support.postgres import PostgresServer
from tests.support.serve import serve, wait_up

pytestmark = pytest.mark.slow


def _api_on_own_database(own_postgres: PostgresServer, name: str, tmp_path: Path, dataset: Path) -> LiveApi:
    """The API started on a new, migrated database of `own_postgres` (which the test may stop and start)."""
    url = own_postgres.create_database(name)
    upgrade(url)
    settings = Settings(
        data_dir=tmp_path / "state",
        database_url=url,
        port=free_port(),
        dispatcher_enabled=False,
        allowed_data_roots=[dataset.parent],
        allow_tiny_model=True,
    )
    api = LiveApi(settings)
    api.start()
    return api


def test_database_restart_under_load(own_postgres: PostgresServer, tmp_path: Path, dataset: Path) -> None:
    api = _api_on_own_database(own_postgres, "faults", tmp_path, dataset)
    with api.client() as http:
        job_id = http.post("/jobs", json={"name": "a", "model": "tiny", "dataset_uri": str(dataset)}).json()[
            "id"
        ]
    results: list[tuple[float, int, float]] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=api.url, timeout=10) as http:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    # The reads on the event loop (a job, a page of jobs), one through the pool, the writes.
                    pick = random.random()
                    if pick < 0.3:
                        code = http.get(f"/jobs/{job_id}").status_code
                    elif pick < 0.45:
                        code = http.get("/jobs", params={"limit": 20}).status_code
                    elif pick < 0.55:
                        code = http.get(f"/jobs/{job_id}/events").status_code
                    else:
                        code = http.post(
                            "/jobs", json={"name": "b", "model": "tiny", "dataset_uri": str(dataset)}
                        ).status_code
                except httpx.HTTPError:
                    code = 0
                results.append((started, code, time.monotonic() - started))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    down_at = time.monotonic()
    own_postgres.stop()
    time.sleep(3.0)
    with api.client() as http:
        ready = http.get("/readyz")
    up_at = time.monotonic()
    own_postgres.start()
    time.sleep(5.0)
    stop.set()
    for thread in threads:
        thread.join()
    api.stop()

    assert ready.status_code == 503
    codes = Counter(code for _, code, _ in results)
    assert set(codes) <= {200, 201, 503}, codes  # never a 500, never a dropped connection
    outage = [(code, took) for t, code, took in results if down_at + 0.5 < t < up_at]
    assert outage and all(code == 503 for code, _ in outage)
    assert max(took for _, took in outage) < 6.0  # bounded by the connect and pool timeouts: no hang
    recovered = [code for t, code, _ in results if t > up_at + 3.0]
    assert recovered and all(code in (200, 201) for code in recovered)


def test_followed_events_wait_out_a_database_restart(
    own_postgres: PostgresServer, tmp_path: Path, dataset: Path
) -> None:
    """A client following a job's events (the dashboard) keeps its stream while the database is away, and
    gets the events stored once it is back."""
    api = _api_on_own_database(own_postgres, "follow", tmp_path, dataset)
    try:
        with api.client() as http:
            body = {"name": "a", "model": "tiny", "dataset_uri": str(dataset)}
            job_id = http.post("/jobs", json=body).json()["id"]
            with http.stream(
                "GET", f"/jobs/{job_id}/events", params={"follow": "true"}, timeout=30
            ) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("id: ")  # the job's first event
                own_postgres.stop("fast")
                time.sleep(2.0)  # the stream polls meanwhile, and finds no database
                own_postgres.start()
                deadline = time.monotonic() + 15
                while (cancel := http.post(f"/jobs/{job_id}/cancel")).status_code == 503:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
                assert cancel.status_code == 200, cancel.text
                received = []
                for line in lines:
                    received.append(line)
                    if line == "event: end":
                        break
        assert any(line.startswith("data: ") and '"cancelled"' in line for line in received), received
    finally:
        api.stop()


@pytest.mark.postgres
@pytest.mark.parametrize("idle_ping", [True, False])
def test_pooled_connection_dropped_while_idle_is_pinged_and_replaced(
    postgres_db_url: str, monkeypatch: pytest.MonkeyPatch, idle_ping: bool
) -> None:
    """Checkouts are not pinged (a round trip per request); a connection idle past IDLE_PING_SECONDS is,
    and one the server dropped meanwhile is replaced without the request seeing it."""
    engine = make_engine(postgres_db_url, pool_size=1)
    killer = sa.create_engine(postgres_db_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            first = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with killer.connect() as connection:
            assert connection.exec_driver_sql(f"SELECT pg_terminate_backend({first})").scalar()
        monkeypatch.setattr(db, "IDLE_PING_SECONDS", 0.0 if idle_ping else 3600.0)
        if idle_ping:
            with engine.connect() as connection:
                second = connection.exec_driver_sql("SELECT pg_backend_pid()").scalar()
            assert second != first
        else:  # used recently, so not pinged: the statement fails, and the pool drops the connection
            with pytest.raises(sa.exc.OperationalError), engine.connect() as connection:
                connection.exec_driver_sql("SELECT pg_backend_pid()")
            with engine.connect() as connection:
                assert connection.exec_driver_sql("SELECT pg_backend_pid()").scalar() != first
    finally:
        engine.dispose()
        killer.dispose()


CRASH_WORKER = "import os, sys, time; open('launches.log', 'a').write(f'{os.getpid()}\\n'); time.sleep(0.05)"


@pytest.mark.timeout(600)  # ~2 min on a quiet 2-core machine; 200 runs and 4 API starts take longer loaded
def test_sigkill_during_submissions_loses_and_doubles_nothing(tmp_path: Path, dataset: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    jobs_dir = tmp_path / "state" / "jobs"
    env = {
        "TPUTUNE_DATA_DIR": str(tmp_path / "state"),
        "TPUTUNE_PORT": str(port),
        "TPUTUNE_ALLOWED_DATA_ROOTS": str(dataset.parent),
        "TPUTUNE_ALLOW_TINY_MODEL": "true",
        "TPUTUNE_DISPATCH_INTERVAL_SECONDS": "0.05",
        "TPUTUNE_WORKER_COMMAND": f"{shlex.quote(sys.executable)} -c {shlex.quote(CRASH_WORKER)}",
        "TPUTUNE_LOG_LEVEL": "warning",
    }
    log = tmp_path / "api.log"
    proc = serve(env, log)
    wait_up(url, proc)
    accepted: dict[str, str] = {}
    lock = threading.Lock()

    def submit(index: int) -> None:
        key = f"job-{index}"
        body = {"name": key, "model": "tiny", "dataset_uri": str(dataset)}
        # A client that retries with its Idempotency-Key until it gets an answer.
        while True:
            try:
                response = httpx.post(f"{url}/jobs", json=body, headers={"Idempotency-Key": key}, timeout=5)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if response.status_code in (200, 201):
                with lock:
                    assert accepted.setdefault(key, response.json()["id"]) == response.json()["id"]
                return
            time.sleep(0.2)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(200)]
    for thread in threads:
        thread.start()
    rng = random.Random(7)
    for _ in range(3):
        time.sleep(rng.uniform(0.3, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = serve(env, log)
        wait_up(url, proc)
    for thread in threads:
        thread.join(timeout=120)
    try:
        deadline = time.monotonic() + 120
        while True:
            page = httpx.get(
                f"{url}/jobs", params={"limit": 100, "status": ["queued", "starting", "running"]}
            ).json()
            if not page["data"]:
                break
            assert time.monotonic() < deadline, f"{len(page['data'])} jobs still active"
            time.sleep(0.5)
        ids: list[str] = []
        after = None
        while True:
            page = httpx.get(
                f"{url}/jobs", params={"limit": 100, **({"after": after} if after else {})}
            ).json()
            ids += [job["id"] for job in page["data"] if job["status"] == "succeeded"]
            if not page["has_more"]:
                break
            after = page["next_after"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert len(accepted) == 200
    assert sorted(ids) == sorted(accepted.values())  # every accepted job exists once, and succeeded
    launches = {job_id: (jobs_dir / job_id / "launches.log").read_text().split() for job_id in ids}
    doubled = {job_id: pids for job_id, pids in launches.items() if len(pids) != 1}
    assert not doubled  # launched exactly once
    for runner_file in jobs_dir.glob("*/runner.json"):
        assert process_start_time(json.loads(runner_file.read_text())["pid"]) is None  # nothing orphaned
