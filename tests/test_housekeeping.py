"""What is kept for a while only (api.housekeeping): idempotency keys and audit events past their time,
deleted by the dispatcher at its first pass and then once an hour; on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from api import housekeeping
from api.dispatcher import Dispatcher
from api.executors.local import LocalExecutor
from api.housekeeping import prune
from api.main import create_app
from api.models import AuditEvent, IdempotencyKey, utcnow
from api.settings import Settings
from tests.test_audit import audit
from tests.test_auth import make_key
from tests.test_tenants import server


def post(client: TestClient, dataset: Path, key: str) -> httpx.Response:
    body = {"name": "keyed", "model": "tiny", "dataset_uri": str(dataset)}
    return client.post("/jobs", json=body, headers={"Idempotency-Key": key})


def keys(engine: Engine) -> list[str]:
    with Session(engine) as session:
        return sorted(session.exec(select(IdempotencyKey.key)).all())


def age_keys(engine: Engine, *names: str, days: float = 2) -> None:
    with Session(engine) as session:
        session.execute(
            update(IdempotencyKey)
            .where(col(IdempotencyKey.key).in_(names))
            .values(created_at=utcnow() - timedelta(days=days))
        )
        session.commit()


def test_an_idempotency_key_is_remembered_for_its_hours_then_makes_a_new_job(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    settings = make_settings(dispatcher_enabled=False)
    with TestClient(create_app(settings)) as client:
        engine = client.app.state.engine  # type: ignore[attr-defined]
        first = post(client, dataset, "stories-001")
        assert first.status_code == 201, first.text
        assert prune(engine, settings, utcnow() + timedelta(hours=23)) == {
            "idempotency_keys": 0,
            "audit_events": 0,
            "jobs": 0,
        }
        again = post(client, dataset, "stories-001")
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        assert prune(engine, settings, utcnow() + timedelta(hours=25))["idempotency_keys"] == 1
        later = post(client, dataset, "stories-001")  # a day later: a new job
        assert later.status_code == 201 and later.json()["id"] != first.json()["id"]
        assert keys(engine) == ["stories-001"]
        shorter = make_settings(dispatcher_enabled=False, idempotency_key_hours=0.5)
        assert prune(engine, shorter, utcnow() + timedelta(minutes=20))["idempotency_keys"] == 0
        assert prune(engine, shorter, utcnow() + timedelta(minutes=40))["idempotency_keys"] == 1


def test_audit_events_are_kept_unless_a_retention_is_set_then_go_in_batches(
    make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    with server(make_settings) as client:
        engine = client.app.state.engine  # type: ignore[attr-defined]
        for team in ("t0", "t1", "t2", "t3", "t4"):
            make_key(client, team)
        events = audit(client)
        assert [e["tenant"] for e in events] == ["t4", "t3", "t2", "t1", "t0"]
        with Session(engine) as session:  # the three oldest, made 100 days ago
            oldest = [e["id"] for e in events[2:]]
            session.execute(
                update(AuditEvent)
                .where(col(AuditEvent.id).in_(oldest))
                .values(at=utcnow() - timedelta(days=100))
            )
            session.commit()
        assert prune(engine, make_settings())["audit_events"] == 0  # (no retention set: kept)
        assert len(audit(client)) == 5
        assert prune(engine, make_settings(audit_retention_days=120))["audit_events"] == 0
        monkeypatch.setattr(housekeeping, "BATCH", 2)
        assert prune(engine, make_settings(audit_retention_days=90))["audit_events"] == 3
        assert [e["tenant"] for e in audit(client)] == ["t4", "t3"]


def test_the_dispatcher_deletes_them_at_its_first_pass_then_hourly(
    make_settings: Callable[..., Settings], dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(dispatcher_enabled=False, webhooks_enabled=False)
    monkeypatch.setattr(housekeeping, "EVERY_SECONDS", 1.0)
    with TestClient(create_app(settings)) as client:
        engine = client.app.state.engine  # type: ignore[attr-defined]
        for name in ("a", "b"):
            job = post(client, dataset, name).json()
            assert (
                client.post(f"/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
            )  # (none to launch)
        age_keys(engine, "a")
        dispatcher = Dispatcher(engine, LocalExecutor(settings), settings)
        dispatcher.tick()
        assert keys(engine) == ["b"]  # at its first pass
        age_keys(engine, "b")
        dispatcher.tick()
        assert keys(engine) == ["b"]  # not again within the hour (here: a second)
        time.sleep(1.1)
        dispatcher.tick()
        assert keys(engine) == []
