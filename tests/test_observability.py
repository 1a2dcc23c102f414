"""/metrics in Prometheus format, request ids, JSON logs — and no secrets in any of them."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlmodel import Session, col, select

from api.jobs import transition
from api.main import create_app
from api.models import Job
from api.observability import JsonFormatter, request_id_var
from api.settings import Settings
from api.states import JobStatus
from api.tenants import month_start
from tests.test_progress import metrics, post, started_job


def test_metrics_exposition(client: TestClient, dataset: Path) -> None:
    job_id, token = started_job(client, dataset)
    post(client, job_id, token, [metrics(1, 2.0), metrics(2, 1.5)])
    client.post("/jobs", json={"name": "q", "model": "tiny", "dataset_uri": str(dataset)})
    client.get(f"/jobs/{job_id}")
    body = client.get("/metrics").text
    assert 'tputune_jobs{status="running"} 1.0' in body
    assert 'tputune_jobs{status="queued"} 1.0' in body
    assert "tputune_worker_reports_total 2.0" in body
    # Routes are labelled by template, so ids never multiply the series.
    assert 'route="/jobs/{job_id}"' in body and job_id not in body
    assert token not in body


def test_metrics_show_each_tenants_jobs_and_chips(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """The shared quota by team: each tenant's unfinished jobs by status, and the chips (local executor:
    processes) its active jobs hold, what its jobs held this month, and its limits beside them."""
    from tests.test_auth import ADMIN, bearer, make_key

    settings = make_settings(
        dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0, tenant_max_active_chips=32
    )
    app = create_app(settings)
    with TestClient(app) as client:
        keys = {tenant: make_key(client, tenant) for tenant in ("alpha", "beta", "gamma")}

        def submit(tenant: str, processes: int = 1) -> str:
            body = {
                "name": "m",
                "model": "tiny",
                "dataset_uri": str(dataset),
                "resources": {"processes": processes},
            }
            created = client.post("/jobs", json=body, headers=bearer(keys[tenant]))
            assert created.status_code == 201, created.text
            return str(created.json()["id"])

        def move(job_id: str, *path: JobStatus) -> None:
            with Session(app.state.engine) as session:
                job = session.exec(select(Job).where(Job.id == job_id)).one()
                for status in path:
                    assert transition(session, job, status)

        move(submit("alpha", processes=2), JobStatus.starting, JobStatus.running)
        move(submit("alpha", processes=4), JobStatus.starting)
        submit("alpha")
        submit("beta")
        ran = submit("beta", processes=8)
        move(ran, JobStatus.cancelled)  # (finished: holds nothing; it held 8 for the last 30 minutes)
        now = datetime.now(UTC)
        began = max(now - timedelta(minutes=30), month_start(now))
        with Session(app.state.engine) as session:
            session.execute(update(Job).where(col(Job.id) == ran).values(admitted_at=began, finished_at=now))
            session.commit()
        move(submit("gamma"), JobStatus.cancelled)
        # Limits: the server's hold for a tenant without its own; one with none shows none.
        own = {"max_active_jobs": 3, "max_active_chips": None}
        assert client.patch("/admin/tenants/beta", json=own, headers=bearer(ADMIN)).status_code == 200
        own = {"max_active_chips": 16, "max_queued_jobs": 0, "max_chip_hours_per_month": 500}
        assert client.patch("/admin/tenants/delta", json=own, headers=bearer(ADMIN)).status_code == 200
        body = client.get("/metrics").text
    lines = {line for line in body.splitlines() if line.startswith("tputune_tenant_")}
    month = [line for line in lines if line.startswith("tputune_tenant_chip_hours_this_month")]
    assert [line.split()[0] for line in month] == ['tputune_tenant_chip_hours_this_month{tenant="beta"}']
    assert float(month[0].split()[1]) == pytest.approx(8 * (now - began).total_seconds() / 3600, abs=1e-3)
    assert lines - set(month) == {
        'tputune_tenant_jobs{status="running",tenant="alpha"} 1.0',
        'tputune_tenant_jobs{status="starting",tenant="alpha"} 1.0',
        'tputune_tenant_jobs{status="queued",tenant="alpha"} 1.0',
        'tputune_tenant_jobs{status="queued",tenant="beta"} 1.0',
        'tputune_tenant_chips{tenant="alpha"} 6.0',
        'tputune_tenant_chips{tenant="beta"} 0.0',
        'tputune_tenant_max_active_jobs{tenant="beta"} 3.0',
        'tputune_tenant_max_active_chips{tenant="alpha"} 32.0',
        'tputune_tenant_max_active_chips{tenant="beta"} 32.0',
        'tputune_tenant_max_active_chips{tenant="delta"} 16.0',
        'tputune_tenant_max_queued_jobs{tenant="delta"} 0.0',
        'tputune_tenant_max_chip_hours_per_month{tenant="delta"} 500.0',
    }
    assert 'tputune_jobs{status="cancelled"} 2.0' in body


def test_the_readmes_alerting_rules_name_metrics_the_server_serves(client: TestClient) -> None:
    """The README's example rules parse, and each metric their expressions name is one /metrics serves."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = next(b for b in readme.split("```yaml\n")[1:] if b.startswith("groups:")).split("```")[0]
    rules = [rule for group in yaml.safe_load(block)["groups"] for rule in group["rules"]]
    assert len(rules) >= 4 and all(rule["alert"] and rule["annotations"]["summary"] for rule in rules)
    body = client.get("/metrics").text
    served = set(re.findall(r"^# TYPE (\w+) ", body, re.MULTILINE))
    served |= {f"{name}_total" for name in served}  # (a counter's samples)
    named = {name for rule in rules for name in re.findall(r"\btputune_\w+", rule["expr"])}
    assert named and named <= served, named - served


def test_metrics_can_be_turned_off(make_settings: Callable[..., Settings]) -> None:
    with TestClient(create_app(make_settings(dispatcher_enabled=False, metrics_enabled=False))) as client:
        assert client.get("/metrics").status_code == 404


def test_request_id(client: TestClient) -> None:
    given = client.get("/healthz", headers={"X-Request-ID": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    fresh = client.get("/healthz").headers["x-request-id"]
    assert len(fresh) == 16 and fresh != client.get("/healthz").headers["x-request-id"]


def test_json_logs_carry_ids_and_no_secrets(client: TestClient, dataset: Path) -> None:
    def run() -> None:
        nonlocal token
        job_id, token = started_job(client, dataset)
        post(client, job_id, token, [metrics(1, 2.0)])
        reset = request_id_var.set("req-42")
        logging.getLogger("api.test").info("hello")
        request_id_var.reset(reset)

    token = ""
    stream = io.StringIO()
    lines = _capture_json_logs(run, logging.DEBUG, stream)
    assert {"message": "hello", "request_id": "req-42", "level": "info"}.items() <= lines[-1].items()
    assert token not in stream.getvalue()


def _capture_json_logs(
    run: Callable[[], None], level: int = logging.INFO, stream: io.StringIO | None = None
) -> list[dict]:
    """What `run` logs, as JSON lines (the root logger at `level` meanwhile)."""
    stream = stream or io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(level)
    try:
        run()
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_access_log_a_line_per_request_with_its_request_id(client: TestClient) -> None:
    def run() -> None:
        client.get("/healthz", headers={"X-Request-ID": "acc-1"})
        client.get("/jobs/nope?secret-looking=query", headers={"X-Request-ID": "acc-2"})

    lines = [line for line in _capture_json_logs(run) if line["logger"] == "tputune.access"]
    seen = [(line["request_id"], line["http"]["status"]) for line in lines]
    assert seen == [("acc-1", 200), ("acc-2", 404)]
    assert lines[1]["http"]["method"] == "GET" and lines[1]["http"]["path"] == "/jobs/nope"
    assert "secret-looking" not in json.dumps(lines)  # the query string is left out
    assert lines[0]["http"]["ms"] >= 0 and "GET /healthz 200" in lines[0]["message"]


def test_access_log_names_the_callers_key_and_tenant_never_the_key(
    make_settings: Callable[..., Settings],
) -> None:
    """A platform team reads who made a request, and which key a 429 limited, from the access log."""
    settings = make_settings(
        dispatcher_enabled=False,
        admin_key="admin-key-observed",
        rate_limit_per_second=0.001,
        rate_limit_burst=3,
    )
    with TestClient(create_app(settings)) as client:
        admin = {"Authorization": "Bearer admin-key-observed"}
        created = client.post("/admin/keys", json={"tenant": "research", "name": "ci"}, headers=admin).json()
        key = {"Authorization": f"Bearer {created['key']}"}

        def run() -> None:
            client.get("/jobs/ft-nope", headers=key)  # (a route served directly: api.direct_routes)
            for _ in range(3):
                client.get("/jobs", headers=key)
            client.get("/jobs", headers={"Authorization": "Bearer tpt_unknown_key"})
            client.get("/healthz")

        stream = io.StringIO()
        lines = [
            line for line in _capture_json_logs(run, stream=stream) if line["logger"] == "tputune.access"
        ]
    seen = [(line["http"]["status"], line["http"].get("key"), line["http"].get("tenant")) for line in lines]
    key_id = created["id"]
    assert seen == [
        (404, key_id, "research"),
        (200, key_id, "research"),
        (200, key_id, "research"),
        (429, key_id, "research"),
        (401, None, None),
        (200, None, None),
    ]
    assert " GET /jobs 200 " in lines[1]["message"]
    assert lines[1]["message"].endswith(f" ms key={key_id} tenant=research")
    assert created["key"] not in stream.getvalue() and "tpt_unknown_key" not in stream.getvalue()


def test_access_log_lines_cannot_be_forged_through_the_path(client: TestClient) -> None:
    """A path's control characters (%0A, a new line in the text log) are written escaped, as sent."""
    lines = _capture_json_logs(lambda: client.get("/jobs/x%0A127.0.0.1:1 GET /admin 200%09%00"))
    access = [line for line in lines if line["logger"] == "tputune.access"]
    assert [line["http"]["path"] for line in access] == ["/jobs/x%0A127.0.0.1:1 GET /admin 200%09%00"]
    assert "\n" not in access[0]["message"] and access[0]["http"]["status"] == 422


def test_access_log_can_be_turned_off(make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(dispatcher_enabled=False, access_log=False))
    with TestClient(app) as client:
        lines = _capture_json_logs(lambda: client.get("/healthz"))
    assert [line for line in lines if line["logger"] == "tputune.access"] == []


def test_json_log_times_are_formatTimes_also_when_the_second_changes() -> None:
    """JsonFormatter makes a second's text once: records of the same second, the next one and an earlier
    one (another thread's) each get their own time."""
    formatter, plain = JsonFormatter(), logging.Formatter()
    for created in (1_700_000_000.1, 1_700_000_000.9, 1_700_000_001.0, 1_700_000_000.5, 1_800_000_123.4):
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
        record.created = created
        assert json.loads(formatter.format(record))["time"] == plain.formatTime(record, "%Y-%m-%dT%H:%M:%S")
