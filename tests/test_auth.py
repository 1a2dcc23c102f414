"""API keys, tenancy and rate limits (auth is on when TPUTUNE_ADMIN_KEY is set)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text, update
from sqlalchemy.exc import OperationalError
from sqlmodel import Session, col, select

from api.auth import COOKIE_NAME, NO_ADMIN_KEY, Authenticator, SharedBuckets
from api.deps import _Caller
from api.main import create_app
from api.models import ApiKey, as_utc
from api.routes import audit, health, jobs, keys, tenants, webhooks
from api.settings import Settings

ADMIN = "admin-secret-0123456789"


@pytest.fixture
def auth_client(make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    app = create_app(make_settings(dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0))
    with TestClient(app) as test_client:
        yield test_client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_id_of(client: TestClient, key: str) -> str:
    listed = client.get("/admin/keys", headers=bearer(ADMIN)).json()["data"]
    return str(next(row["id"] for row in listed if key.startswith(row["prefix"] + "_")))


def make_key(client: TestClient, tenant: str) -> str:
    response = client.post(
        "/admin/keys", json={"tenant": tenant, "name": f"{tenant} key"}, headers=bearer(ADMIN)
    )
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["key"].startswith(body["prefix"] + "_") and body["prefix"].startswith("tpt_")
    return body["key"]


def job(dataset: Path) -> dict:
    return {"name": "t", "model": "tiny", "dataset_uri": str(dataset)}


def test_job_routes_need_a_key(auth_client: TestClient, dataset: Path) -> None:
    for method, path in [
        ("get", "/jobs"),
        ("post", "/jobs"),
        ("get", "/jobs/ft-x"),
        ("post", "/jobs/ft-x/cancel"),
        ("get", "/jobs/ft-x/events"),
        ("get", "/jobs/ft-x/metrics"),
        ("get", "/jobs/ft-x/logs"),
    ]:
        response = auth_client.request(method, path, json=job(dataset) if method == "post" else None)
        assert response.status_code == 401, path
        if method == "post":  # (an invalid body too: the key is checked first)
            assert auth_client.post(path, json={"name": 1}).status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert auth_client.get("/jobs", headers=bearer("tpt_wrong_key")).status_code == 401
    for path in ("/healthz", "/readyz", "/docs", "/openapi.json"):
        assert auth_client.get(path).status_code == 200, path


def test_openapi_declares_who_may_call_each_route(auth_client: TestClient) -> None:
    spec = auth_client.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["ApiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "A tputune API key (`tputune keys create`).",
    }
    declared = {
        (method, path): [name for requirement in op.get("security", []) for name in requirement]
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
    }
    assert declared[("post", "/jobs/{job_id}/progress")] == ["JobToken"]
    for (method, path), schemes in declared.items():
        if path.startswith(("/jobs", "/admin")) and not path.endswith("/progress"):
            assert schemes == ["ApiKey"], (method, path)
        elif path.startswith(("/healthz", "/readyz", "/metrics", "/auth")):
            assert schemes == [], (method, path)


def test_bearer_scheme_is_case_insensitive_and_a_cookie_stands_in(auth_client: TestClient) -> None:
    key = make_key(auth_client, "alpha")
    assert auth_client.get("/jobs", headers={"Authorization": f"bearer  {key}"}).status_code == 200
    assert auth_client.get("/jobs", headers={"Authorization": f"Basic {key}"}).status_code == 401
    auth_client.cookies.set(COOKIE_NAME, key)
    try:
        assert auth_client.get("/jobs", headers={"Authorization": "Basic eDp5"}).status_code == 200
    finally:
        auth_client.cookies.clear()


def test_tenants_are_isolated(auth_client: TestClient, dataset: Path) -> None:
    alpha, beta = make_key(auth_client, "alpha"), make_key(auth_client, "beta")
    created = auth_client.post("/jobs", json=job(dataset), headers=bearer(alpha))
    assert created.status_code == 201
    job_id = created.json()["id"]
    assert auth_client.get(f"/jobs/{job_id}", headers=bearer(alpha)).status_code == 200
    # Another tenant's job does not exist for beta: 404, not 403.
    for method, path in [
        ("get", f"/jobs/{job_id}"),
        ("post", f"/jobs/{job_id}/cancel"),
        ("post", f"/jobs/{job_id}/pause"),
        ("post", f"/jobs/{job_id}/resume"),
        ("get", f"/jobs/{job_id}/events"),
        ("get", f"/jobs/{job_id}/logs"),
    ]:
        response = auth_client.request(method, path, headers=bearer(beta))
        assert response.status_code == 404 and response.json()["error"]["code"] == "job_not_found"
    assert auth_client.get(f"/jobs/{job_id}", headers=bearer(alpha)).json()["status"] == "queued"
    # Nor can beta start from its weights: the same answer as for a job that exists nowhere.
    stolen = auth_client.post("/jobs", json={**job(dataset), "from_job": job_id}, headers=bearer(beta))
    assert stolen.status_code == 422 and stolen.json()["error"]["code"] == "from_job_not_found"
    assert auth_client.get("/jobs", headers=bearer(beta)).json()["data"] == []
    assert [j["id"] for j in auth_client.get("/jobs", headers=bearer(alpha)).json()["data"]] == [job_id]
    # Nor is it a cursor for beta's list: the same answer as for an id that exists nowhere.
    for after in (job_id, "ft-nowhere"):
        listed = auth_client.get("/jobs", params={"after": after}, headers=bearer(beta))
        assert listed.status_code == 400 and listed.json()["error"]["code"] == "invalid_cursor"
        assert after in listed.json()["error"]["message"]
    assert auth_client.get("/jobs", params={"after": job_id}, headers=bearer(alpha)).json()["data"] == []
    # Idempotency keys are per tenant too.
    a = auth_client.post("/jobs", json=job(dataset), headers={**bearer(alpha), "Idempotency-Key": "same"})
    b = auth_client.post("/jobs", json=job(dataset), headers={**bearer(beta), "Idempotency-Key": "same"})
    assert a.status_code == b.status_code == 201 and a.json()["id"] != b.json()["id"]
    # The queue is every team's: beta's job waits behind alpha's two (their number, not which they are).
    assert auth_client.get(f"/jobs/{b.json()['id']}", headers=bearer(beta)).json()["queue_position"] == 3


def test_the_admin_key_sees_and_acts_on_every_tenants_jobs(auth_client: TestClient, dataset: Path) -> None:
    """A platform team's view of the shared quota: the admin key lists, reads, follows and cancels the
    jobs of every tenant (each job says whose it is); a tenant's key still sees only its own."""
    alpha, beta = make_key(auth_client, "alpha"), make_key(auth_client, "beta")
    ids = {}
    for name, key in (("alpha", alpha), ("beta", beta), ("default", ADMIN), ("alpha2", alpha)):
        created = auth_client.post("/jobs", json=job(dataset) | {"name": name}, headers=bearer(key))
        assert created.status_code == 201, created.text
        ids[name] = created.json()["id"]
        assert created.json()["tenant"] == {"alpha2": "alpha"}.get(name, name)
    admin = bearer(ADMIN)

    def listed(headers: dict[str, str], **params: str | int) -> list[tuple[str, str]]:
        page = auth_client.get("/jobs", params=params, headers=headers)
        assert page.status_code == 200, page.text
        return [(j["name"], j["tenant"]) for j in page.json()["data"]]

    everyone = [("alpha2", "alpha"), ("default", "default"), ("beta", "beta"), ("alpha", "alpha")]
    assert listed(admin) == everyone
    assert listed(admin, tenant="alpha") == [("alpha2", "alpha"), ("alpha", "alpha")]
    assert listed(admin, tenant="nobody") == []
    assert listed(admin, status="queued", limit=2) == everyone[:2]
    # Paged across tenants; a cursor of another tenant's job is no cursor for a tenant's page.
    pages, after = [], None
    while True:
        page = auth_client.get(
            "/jobs", params={"limit": 1, **({"after": after} if after else {})}, headers=admin
        )
        pages += [j["name"] for j in page.json()["data"]]
        if not page.json()["has_more"]:
            break
        after = page.json()["next_after"]
    assert pages == [name for name, _ in everyone]
    stray = auth_client.get("/jobs", params={"tenant": "alpha", "after": ids["beta"]}, headers=admin)
    assert stray.status_code == 400 and stray.json()["error"]["code"] == "invalid_cursor"
    # A tenant's key: its own jobs, `tenant` naming its own or nothing; another tenant's is an admin's.
    assert listed(bearer(alpha)) == [("alpha2", "alpha"), ("alpha", "alpha")]
    assert listed(bearer(alpha), tenant="alpha") == [("alpha2", "alpha"), ("alpha", "alpha")]
    refused = auth_client.get("/jobs", params={"tenant": "beta"}, headers=bearer(alpha))
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "admin_only" and refused.json()["error"]["param"] == "tenant"
    assert auth_client.get(f"/jobs/{ids['beta']}", headers=bearer(alpha)).status_code == 404
    assert auth_client.get(f"/jobs/{ids['default']}", headers=bearer(alpha)).status_code == 404

    # Every job route, for the admin, on another tenant's job.
    beta_job = ids["beta"]
    assert auth_client.get(f"/jobs/{beta_job}", headers=admin).json()["tenant"] == "beta"
    for path in ("events", "metrics", "checkpoints"):
        response = auth_client.get(f"/jobs/{beta_job}/{path}", headers=admin)
        assert response.status_code == 200, (path, response.text)
    cancelled = auth_client.post(f"/jobs/{beta_job}/cancel", headers=admin)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    # The tenant sees who stopped its job.
    seen = auth_client.get(f"/jobs/{beta_job}", headers=bearer(beta)).json()
    assert (seen["status"], seen["status_message"]) == (
        "cancelled",
        "Cancelled by the admin before it started.",
    )
    own = auth_client.post(f"/jobs/{ids['alpha2']}/cancel", headers=bearer(alpha)).json()
    assert own["status_message"] == f"Cancelled by key {key_id_of(auth_client, alpha)} before it started."
    with auth_client.stream(
        "GET", f"/jobs/{beta_job}/events", params={"follow": "true"}, headers=admin
    ) as followed:
        assert followed.status_code == 200
        text = "".join(followed.iter_text())
    assert "Cancelled by the admin before it started." in text and text.endswith("event: end\ndata: {}\n\n")


def test_keys_are_hashed_listed_and_revocable(auth_client: TestClient, dataset: Path) -> None:
    key = make_key(auth_client, "alpha")
    listed = auth_client.get("/admin/keys", headers=bearer(ADMIN)).json()["data"]
    assert len(listed) == 1 and "key" not in listed[0]
    with auth_client.app.state.engine.connect() as connection:  # type: ignore[attr-defined]
        stored = " ".join(str(v) for row in connection.execute(text("SELECT * FROM api_keys")) for v in row)
    secret = key.split("_", 2)[2]  # after "tpt_<id>_"; the secret itself may hold "_"
    assert key not in stored and secret not in stored
    assert auth_client.get("/admin/keys", headers=bearer(key)).json()["error"]["code"] == "admin_only"
    assert auth_client.get("/jobs", headers=bearer(key)).status_code == 200
    revoked = auth_client.delete(f"/admin/keys/{listed[0]['id']}", headers=bearer(ADMIN))
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert auth_client.get("/jobs", headers=bearer(key)).status_code == 401
    assert auth_client.delete("/admin/keys/key_nope", headers=bearer(ADMIN)).status_code == 404
    # A name PostgreSQL's text cannot hold (NUL) is refused on both databases; it was a 500 there.
    nul = auth_client.post("/admin/keys", json={"tenant": "alpha", "name": "ci\x00"}, headers=bearer(ADMIN))
    assert nul.status_code == 422 and nul.json()["error"]["code"] == "nul_character", nul.text
    assert nul.json()["error"]["param"] == "name"


def test_worker_token_cannot_read_or_cancel(auth_client: TestClient, dataset: Path) -> None:
    from tests.test_progress import post, started_job

    key = make_key(auth_client, "default")
    auth_client.headers.update(bearer(key))
    job_id, token = started_job(auth_client, dataset)
    auth_client.headers.pop("Authorization")
    for method, path in [
        ("get", f"/jobs/{job_id}"),
        ("post", f"/jobs/{job_id}/cancel"),
        ("post", f"/jobs/{job_id}/pause"),
        ("post", f"/jobs/{job_id}/resume"),
        ("get", "/jobs"),
    ]:
        assert auth_client.request(method, path, headers=bearer(token)).status_code == 401
    assert post(auth_client, job_id, token, [{"kind": "metrics", "step": 1, "loss": 1.0}]).status_code == 200
    # Without a token, the body is not looked at: 401, not a 422 about it.
    for headers in ({}, {"Authorization": "Basic eDp5"}):
        refused = auth_client.post(f"/jobs/{job_id}/progress", json={"reports": "x"}, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_job_token"
    # ...and an API key is no worker token.
    assert post(auth_client, job_id, key, [{"kind": "metrics", "step": 2, "loss": 1.0}]).status_code == 401


def test_browser_session_cookie(auth_client: TestClient) -> None:
    key = make_key(auth_client, "alpha")
    signed_out = {
        "auth_required": True,
        "signed_in": False,
        "tenant": None,
        "admin": False,
        "read_only": False,
    }
    assert auth_client.get("/auth/session").json() == signed_out
    assert auth_client.post("/auth/session", json={"key": "nope"}).status_code == 401
    response = auth_client.post("/auth/session", json={"key": key})
    assert response.status_code == 204
    assert auth_client.get("/auth/session").json() == {
        "auth_required": True,
        "signed_in": True,
        "tenant": "alpha",
        "admin": False,
        "read_only": False,
    }
    assert "httponly" in response.headers["set-cookie"].lower()
    assert "samesite=strict" in response.headers["set-cookie"].lower()
    assert auth_client.get("/jobs").status_code == 200
    response = auth_client.delete("/auth/session")
    assert response.status_code == 204 and 'tputune_key=""' in response.headers["set-cookie"]
    auth_client.cookies.clear()
    assert auth_client.get("/jobs").status_code == 401
    auth_client.cookies.set("tputune_key", ADMIN)
    assert auth_client.get("/auth/session").json()["admin"] is True
    auth_client.cookies.set("tputune_key", key)  # a revoked key's cookie is no session
    auth_client.delete(f"/admin/keys/{key_id_of(auth_client, key)}", headers=bearer(ADMIN))
    assert auth_client.get("/auth/session").json() == signed_out


def test_rate_limit(make_settings: Callable[..., Settings]) -> None:
    app = create_app(
        make_settings(dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=1, rate_limit_burst=5)
    )
    with TestClient(app) as client:
        key = make_key(client, "alpha")
        codes = [client.get("/jobs", headers=bearer(key)).status_code for _ in range(8)]
        assert codes[:5] == [200] * 5 and codes[-1] == 429
        limited = client.get("/jobs", headers=bearer(key))
        assert limited.json()["error"]["code"] == "rate_limited"
        assert int(limited.headers["retry-after"]) >= 1
        other = make_key(client, "beta")
        assert client.get("/jobs", headers=bearer(other)).status_code == 200


def test_each_request_spends_one_token_of_its_keys_rate(make_settings: Callable[..., Settings]) -> None:
    """A route that asked for the caller twice (its tenant, and who it is) spent two of the key's tokens:
    PATCH /webhooks/{id} did. No route asks twice: a burst of three is three requests."""
    settings = make_settings(
        dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0.001, rate_limit_burst=3
    )
    app = create_app(settings)

    def callers(dependant: Any) -> int:
        return isinstance(dependant.call, _Caller) + sum(callers(sub) for sub in dependant.dependencies)

    routers = (audit.router, health.router, jobs.router, keys.router, tenants.router, webhooks.router)
    routes = [route for router in routers for route in router.routes if isinstance(route, APIRoute)]
    assert {route.path: callers(route.dependant) for route in routes if callers(route.dependant) > 1} == {}
    assert sum(callers(route.dependant) == 1 for route in routes) >= 25  # (the walk finds them)
    with TestClient(app) as client:
        key = bearer(make_key(client, "alpha"))
        hook = client.post("/webhooks", json={"url": "https://ci.example.com/h"}, headers=key)
        assert hook.status_code == 201, hook.text
        path = f"/webhooks/{hook.json()['id']}"
        assert client.patch(path, json={"description": "ci"}, headers=key).status_code == 200
        assert client.get(path, headers=key).status_code == 200
        assert client.get(path, headers=key).status_code == 429


def test_a_read_only_key_reads_and_changes_nothing(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """A member's read-only key reads its team's jobs and nothing else; an admin's (an auditor's) reads
    every team's, keys included; neither creates, changes or cancels anything, whatever the route. The
    job's worker token is not a key: unaffected."""
    with TestClient(
        create_app(make_settings(dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0))
    ) as client:
        admin = bearer(ADMIN)
        writer = bearer(make_key(client, "alpha"))
        job_id = client.post("/jobs", json=job(dataset), headers=writer).json()["id"]
        other = client.post("/jobs", json=job(dataset), headers=bearer(make_key(client, "beta"))).json()["id"]

        def create(**kind: bool) -> dict[str, Any]:
            body = {"tenant": "alpha", "name": "grafana", **kind}
            made = client.post("/admin/keys", json=body, headers=admin)
            assert made.status_code == 201, made.text
            return dict(made.json())

        reader = create(read_only=True)
        assert (reader["read_only"], reader["admin"], reader["role"]) == (True, False, "reader")
        auditor = create(read_only=True, admin=True)
        assert auditor["role"] == "auditor"
        roles = {key["id"]: key["role"] for key in client.get("/admin/keys", headers=admin).json()["data"]}
        assert sorted(roles.values()) == ["auditor", "member", "member", "reader"]
        ops = client.post("/admin/keys", json={"tenant": "ops", "name": "o", "admin": True}, headers=admin)
        assert ops.json()["role"] == "admin"
        for made, sees_other in ((reader, False), (auditor, True)):
            key = bearer(made["key"])
            assert client.get(f"/jobs/{job_id}", headers=key).status_code == 200
            assert client.get(f"/jobs/{job_id}/events", headers=key).status_code == 200
            assert (client.get(f"/jobs/{other}", headers=key).status_code == 200) == sees_other
            for path in ("/jobs", "/tenant", "/usage", "/audit", "/webhooks"):
                assert client.get(path, headers=key).status_code == 200, path
            assert (client.get("/admin/keys", headers=key).status_code == 200) == sees_other
            for method, path, body in (
                ("POST", "/jobs", job(dataset)),
                ("POST", f"/jobs/{job_id}/cancel", None),
                ("POST", f"/jobs/{job_id}/pause", None),
                ("POST", "/webhooks", {"url": "https://ci.example.com/h"}),
                ("POST", "/admin/keys", {"tenant": "alpha", "name": "more"}),
                ("PATCH", "/admin/tenants/alpha", {"max_active_jobs": 1}),
                ("DELETE", f"/admin/keys/{made['id']}", None),
            ):
                refused = client.request(method, path, json=body, headers=key)
                assert refused.status_code == 403, (method, path, refused.text)
                error = refused.json()["error"]
                assert error["code"] == "read_only_key" and "read-only" in error["message"], error
        assert client.get(f"/jobs/{job_id}", headers=writer).json()["status"] == "queued"  # (not cancelled)
        assert [k["name"] for k in client.get("/admin/keys", headers=admin).json()["data"]].count(
            "grafana"
        ) == 2

        # Rotated, it stays read-only; the dashboard's session says so.
        rotated = client.post(f"/admin/keys/{reader['id']}/rotate", headers=admin).json()
        assert rotated["read_only"] is True
        assert client.post("/jobs", json=job(dataset), headers=bearer(rotated["key"])).status_code == 403
        client.post("/auth/session", json={"key": rotated["key"]})
        state = client.get("/auth/session").json()
        assert (state["signed_in"], state["tenant"], state["read_only"]) == (True, "alpha", True)


def test_refuses_open_network_address_without_auth(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"refusing to serve 0\.0\.0\.0"):
        Settings(data_dir=tmp_path, host="0.0.0.0").check_exposure()
    Settings(data_dir=tmp_path, host="0.0.0.0", admin_key="k").check_exposure()
    Settings(data_dir=tmp_path, host="0.0.0.0", require_api_keys=True).check_exposure()
    Settings(data_dir=tmp_path, host="127.0.0.1").check_exposure()


def test_shared_buckets_are_one_bucket_per_key_across_mappings(tmp_path: Path) -> None:
    """What `tputune serve --workers N` relies on: each process maps the file, and they spend one bucket."""
    path = tmp_path / "buckets"
    first, second = SharedBuckets(path, reset=True), SharedBuckets(path)
    taken = [(first if i % 2 else second).take("key_a", rate=0.001, burst=4) for i in range(6)]
    assert taken[:4] == [None] * 4 and all(retry is not None and retry >= 1 for retry in taken[4:])
    assert second.take("key_b", rate=0.001, burst=4) is None  # another key, another bucket
    assert SharedBuckets(path, reset=True).take("key_a", rate=0.001, burst=4) is None  # a new server


def test_shared_buckets_forget_the_least_recently_seen_key_when_full(tmp_path: Path) -> None:
    buckets = SharedBuckets(tmp_path / "buckets", reset=True, slots=4)
    for key in ("a", "b", "c", "d"):
        assert buckets.take(key, rate=0.001, burst=1) is None
    assert buckets.take("a", rate=0.001, burst=1) is not None  # still there: spent
    assert buckets.take("e", rate=0.001, burst=1) is None  # took the slot of "b", seen least recently
    assert buckets.take("b", rate=0.001, burst=1) is None  # forgotten: a full bucket again (in c's slot)
    assert buckets.take("a", rate=0.001, burst=1) is not None  # seen lately: kept
    assert buckets.take("c", rate=0.001, burst=1) is None  # forgotten for b


def set_key_times(client: TestClient, key_id: str, **times: datetime | None) -> None:
    """Move a key's stored times (as if its creation had asked for them, or time had passed)."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    with engine.begin() as connection:
        connection.execute(update(ApiKey).where(col(ApiKey.id) == key_id).values(**times))
    client.app.state.auth.forget()  # type: ignore[attr-defined]


def stored_key(client: TestClient, key_id: str) -> ApiKey:
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        row = session.get(ApiKey, key_id)
        assert row is not None
        return row


def test_keys_expire(auth_client: TestClient) -> None:
    before = datetime.now(UTC)
    created = auth_client.post(
        "/admin/keys", json={"tenant": "alpha", "name": "ci", "expires_in_days": 30}, headers=bearer(ADMIN)
    ).json()
    expires = datetime.fromisoformat(created["expires_at"])
    assert before + timedelta(days=30) <= expires <= datetime.now(UTC) + timedelta(days=30)
    key, key_id = created["key"], created["id"]
    listed = auth_client.get("/admin/keys", headers=bearer(ADMIN)).json()["data"]
    assert listed[0]["expires_at"] == created["expires_at"]
    forever = make_key(auth_client, "alpha")
    assert auth_client.get("/admin/keys", headers=bearer(ADMIN)).json()["data"][1]["expires_at"] is None
    for days in (0, -1, 36_501, "soon"):
        bad = auth_client.post(
            "/admin/keys", json={"tenant": "a", "name": "n", "expires_in_days": days}, headers=bearer(ADMIN)
        )
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "expires_in_days", bad.text

    # Every answer to a key that expires says when (clients warn before it comes), direct routes too.
    said = expires.strftime("%Y-%m-%d %H:%M:%S UTC")
    refused = auth_client.post("/jobs", json={"name": "t", "model": "tiny", "dataset_uri": "/nowhere"},
                               headers=bearer(key))  # fmt: skip
    assert refused.status_code == 422 and refused.headers["x-tputune-key-expires"] == said  # (any answer)
    for path in ("/jobs", "/jobs/ft-nope", "/jobs/ft-nope/events"):
        assert auth_client.get(path, headers=bearer(key)).headers["x-tputune-key-expires"] == said, path
    assert "x-tputune-key-expires" not in auth_client.get("/jobs", headers=bearer(forever)).headers
    assert "x-tputune-key-expires" not in auth_client.get("/jobs", headers=bearer(ADMIN)).headers

    # A key that expires while its lookup is cached (5 s) is refused at once, with a message that says so.
    set_key_times(auth_client, key_id, expires_at=datetime.now(UTC) + timedelta(seconds=1))
    assert auth_client.get("/jobs", headers=bearer(key)).status_code == 200
    time.sleep(1.1)
    refused = auth_client.get("/jobs", headers=bearer(key))
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["code"] == "api_key_expired"
    assert "expired at" in refused.json()["error"]["message"]
    assert "new one" in refused.json()["error"]["message"]
    auth_client.app.state.auth.forget()  # type: ignore[attr-defined]
    # ...and when looked up again; the dashboard's session too.
    assert auth_client.get("/jobs", headers=bearer(key)).json()["error"]["code"] == "api_key_expired"
    assert auth_client.post("/auth/session", json={"key": key}).status_code == 401
    assert auth_client.get("/jobs", headers=bearer(forever)).status_code == 200
    # Followed streams are rechecked with valid_key_ids: an expired key's end (api.streams.Streams.watch).
    forever_id = key_id_of(auth_client, forever)
    auth = auth_client.app.state.auth  # type: ignore[attr-defined]
    assert auth.valid_key_ids({key_id, forever_id}) == {forever_id}
    # A revoked key is unknown, expired or not.
    auth_client.delete(f"/admin/keys/{key_id}", headers=bearer(ADMIN))
    assert auth_client.get("/jobs", headers=bearer(key)).json()["error"]["code"] == "invalid_api_key"


def test_server_caps_a_keys_lifetime(make_settings: Callable[..., Settings]) -> None:
    app = create_app(
        make_settings(dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0, key_max_days=7)
    )
    with TestClient(app) as client:

        def create(**extra: int) -> httpx.Response:
            body = {"tenant": "a", "name": "n", **extra}
            return client.post("/admin/keys", json=body, headers=bearer(ADMIN))

        before = datetime.now(UTC)
        default = datetime.fromisoformat(create().json()["expires_at"])
        assert before + timedelta(days=7) <= default <= datetime.now(UTC) + timedelta(days=7)
        shorter = datetime.fromisoformat(create(expires_in_days=3).json()["expires_at"])
        assert before + timedelta(days=3) <= shorter <= datetime.now(UTC) + timedelta(days=3)
        longer = create(expires_in_days=8)
        assert longer.status_code == 422, longer.text
        error = longer.json()["error"]
        assert error["code"] == "key_lifetime_too_long" and error["param"] == "expires_in_days"
        assert "at most 7" in error["message"]
        assert len(client.get("/admin/keys", headers=bearer(ADMIN)).json()["data"]) == 2


def test_keys_record_when_they_were_last_used(make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0))
    auth = app.state.auth
    auth.use_flush_seconds = 0.2
    with TestClient(app) as client:
        key, idle = make_key(client, "alpha"), make_key(client, "alpha")
        key_id, idle_id = key_id_of(client, key), key_id_of(client, idle)
        time.sleep(0.5)
        assert stored_key(client, key_id).last_used_at is None  # (the admin's calls are no key's)
        before = datetime.now(UTC)
        assert client.get("/jobs", headers=bearer(key)).status_code == 200
        assert client.get("/jobs", headers=bearer(key)).status_code == 200  # (cached)
        deadline = time.monotonic() + 5
        while stored_key(client, key_id).last_used_at is None and time.monotonic() < deadline:
            time.sleep(0.05)  # written by the process's own task, every use_flush_seconds
        time.sleep(0.5)  # (a flush between the two calls wrote the first: the next writes the second)
        used = as_utc(stored_key(client, key_id).last_used_at)
        assert used is not None and before <= used <= datetime.now(UTC)
        assert stored_key(client, idle_id).last_used_at is None
        # Refused calls are no use: a revoked key's last use stays.
        client.delete(f"/admin/keys/{key_id}", headers=bearer(ADMIN))
        assert client.get("/jobs", headers=bearer(key)).status_code == 401
        time.sleep(0.5)
        assert as_utc(stored_key(client, key_id).last_used_at) == used

        # Another process that saw the key earlier never moves its last use back.
        other = Authenticator(app.state.engine, app.state.settings)
        other.authenticate(idle)
        auth.use_flush_seconds = 3600  # (the next tick of the task still waits 0.2 s)
        time.sleep(0.3)
        client.get("/jobs", headers=bearer(idle))
        auth.flush_uses()
        later = as_utc(stored_key(client, idle_id).last_used_at)
        assert other.flush_uses() == 1
        assert as_utc(stored_key(client, idle_id).last_used_at) == later
        # A write that fails (the database away) is made by the next one.
        client.get("/jobs", headers=bearer(idle))
        engine, auth.engine = auth.engine, create_engine("sqlite:////nonexistent/dir/tputune.db")
        with pytest.raises(OperationalError):
            auth.flush_uses()
        auth.engine = engine
        assert auth.flush_uses() == 1
        assert as_utc(stored_key(client, idle_id).last_used_at) > later  # type: ignore[operator]
        # The list shows them, with this process's latest uses written first.
        client.get("/jobs", headers=bearer(idle))
        listed = {row["id"]: row for row in client.get("/admin/keys", headers=bearer(ADMIN)).json()["data"]}
        assert datetime.fromisoformat(listed[idle_id]["last_used_at"]) > later
        assert datetime.fromisoformat(listed[key_id]["last_used_at"]) == used
        # Uses not yet written when the server stops are written then.
        auth.use_flush_seconds = 3600
        last_seen = datetime.fromisoformat(listed[idle_id]["last_used_at"])
        client.get("/jobs", headers=bearer(idle))
    assert as_utc(stored_key(client, idle_id).last_used_at) > last_seen  # type: ignore[operator]


def test_keys_rotate(auth_client: TestClient) -> None:
    admin = bearer(ADMIN)
    created = auth_client.post(
        "/admin/keys", json={"tenant": "alpha", "name": "ci", "expires_in_days": 30}, headers=admin
    ).json()
    old_key, old_id = created["key"], created["id"]
    assert auth_client.get("/jobs", headers=bearer(old_key)).status_code == 200

    # With a grace: both keys work until it ends, then only the new one.
    before = datetime.now(UTC)
    rotated = auth_client.post(f"/admin/keys/{old_id}/rotate", json={"grace_seconds": 1}, headers=admin)
    assert rotated.status_code == 201, rotated.text
    new = rotated.json()
    assert (new["tenant"], new["name"]) == ("alpha", "ci") and new["id"] != old_id
    assert new["key"].startswith(new["prefix"] + "_") and new["key"] != old_key
    expires = datetime.fromisoformat(new["expires_at"])  # the old key's lifetime, 30 days
    assert before + timedelta(days=30) <= expires <= datetime.now(UTC) + timedelta(days=30)
    old_stops = datetime.fromisoformat(new["replaces"]["expires_at"])
    assert new["replaces"]["id"] == old_id
    assert before + timedelta(seconds=1) <= old_stops <= datetime.now(UTC) + timedelta(seconds=1)
    assert auth_client.get("/jobs", headers=bearer(old_key)).status_code == 200
    assert auth_client.get("/jobs", headers=bearer(new["key"])).status_code == 200
    time.sleep(max(0.0, (old_stops - datetime.now(UTC)).total_seconds()) + 0.05)
    assert auth_client.get("/jobs", headers=bearer(old_key)).json()["error"]["code"] == "api_key_expired"
    assert auth_client.get("/jobs", headers=bearer(new["key"])).status_code == 200

    # Without one (the default), the old key stops at once, though this process had it cached.
    newer = auth_client.post(f"/admin/keys/{new['id']}/rotate", headers=admin).json()
    assert auth_client.get("/jobs", headers=bearer(new["key"])).json()["error"]["code"] == "api_key_expired"
    assert auth_client.get("/jobs", headers=bearer(newer["key"])).status_code == 200
    # An old key that expires sooner than the grace keeps its expiry; a lifetime may be asked for.
    grace = auth_client.post(
        f"/admin/keys/{old_id}/rotate", json={"grace_seconds": 3600, "expires_in_days": 2}, headers=admin
    ).json()
    assert grace["replaces"]["expires_at"] == new["replaces"]["expires_at"]
    assert datetime.fromisoformat(grace["expires_at"]) <= datetime.now(UTC) + timedelta(days=2)
    listed = auth_client.get("/admin/keys", headers=admin).json()["data"]
    assert [(k["tenant"], k["name"]) for k in listed] == [("alpha", "ci")] * 4

    # What cannot be rotated, and who may not.
    auth_client.delete(f"/admin/keys/{newer['id']}", headers=admin)
    revoked = auth_client.post(f"/admin/keys/{newer['id']}/rotate", headers=admin)
    assert revoked.status_code == 409 and revoked.json()["error"]["code"] == "key_revoked"
    assert auth_client.post("/admin/keys/key_nope/rotate", headers=admin).status_code == 404
    refused = auth_client.post(f"/admin/keys/{grace['id']}/rotate", headers=bearer(grace["key"]))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
    for body in ({"grace_seconds": -1}, {"grace_seconds": 30 * 86_400 + 1}, {"expires_in_days": 0}):
        bad = auth_client.post(f"/admin/keys/{grace['id']}/rotate", json=body, headers=admin)
        assert bad.status_code == 422, bad.text


def test_a_rotated_key_keeps_within_the_servers_lifetime(make_settings: Callable[..., Settings]) -> None:
    app = create_app(
        make_settings(dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0, key_max_days=7)
    )
    with TestClient(app) as client:
        # A key made before the server capped lifetimes (it never expires) gets the most, not forever.
        with Session(app.state.engine) as session:
            client.post("/admin/keys", json={"tenant": "a", "name": "old"}, headers=bearer(ADMIN))
            row = session.exec(select(ApiKey)).one()
        set_key_times(client, row.id, expires_at=None)
        before = datetime.now(UTC)
        rotated = client.post(f"/admin/keys/{row.id}/rotate", headers=bearer(ADMIN)).json()
        expires = datetime.fromisoformat(rotated["expires_at"])
        assert before + timedelta(days=7) <= expires <= datetime.now(UTC) + timedelta(days=7)
        longer = client.post(
            f"/admin/keys/{rotated['id']}/rotate", json={"expires_in_days": 8}, headers=bearer(ADMIN)
        )
        assert longer.status_code == 422 and longer.json()["error"]["code"] == "key_lifetime_too_long"


def test_admin_keys(auth_client: TestClient, dataset: Path) -> None:
    """Each platform engineer gets an admin key of their own (revocable, named in the access log), and the
    bootstrap TPUTUNE_ADMIN_KEY can stay in a vault."""
    created = auth_client.post(
        "/admin/keys", json={"tenant": "platform", "name": "alice", "admin": True}, headers=bearer(ADMIN)
    )
    assert created.status_code == 201 and created.json()["admin"] is True, created.text
    alice, alice_id = created.json()["key"], created.json()["id"]
    # It manages keys...
    member = auth_client.post(
        "/admin/keys", json={"tenant": "research", "name": "bob"}, headers=bearer(alice)
    )
    assert member.status_code == 201 and member.json()["admin"] is False
    bob = member.json()["key"]
    listed = auth_client.get("/admin/keys", headers=bearer(alice)).json()["data"]
    assert [(k["name"], k["admin"]) for k in listed] == [("alice", True), ("bob", False)]
    research = auth_client.get("/admin/keys", params={"tenant": "research"}, headers=bearer(alice)).json()
    assert [k["name"] for k in research["data"]] == ["bob"]
    # ...and sees and acts on every tenant's jobs; its own are its tenant's.
    bobs = auth_client.post("/jobs", json=job(dataset), headers=bearer(bob)).json()["id"]
    own = auth_client.post("/jobs", json=job(dataset), headers=bearer(alice)).json()
    assert own["tenant"] == "platform"
    assert [j["id"] for j in auth_client.get("/jobs", headers=bearer(alice)).json()["data"]] == [
        own["id"],
        bobs,
    ]
    cancelled = auth_client.post(f"/jobs/{bobs}/cancel", headers=bearer(alice)).json()
    assert cancelled["status_message"] == f"Cancelled by key {alice_id} before it started."
    assert auth_client.get("/auth/session", cookies={COOKIE_NAME: alice}).json()["admin"] is True
    # A member key is no admin: it may not make one either.
    for path, body in [("/admin/keys", {"tenant": "research", "name": "x", "admin": True})]:
        refused = auth_client.post(path, json=body, headers=bearer(bob))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
    assert auth_client.get(f"/jobs/{own['id']}", headers=bearer(bob)).status_code == 404
    # Rotated, the new key is an admin key too; revoked, it is nothing.
    rotated = auth_client.post(f"/admin/keys/{alice_id}/rotate", headers=bearer(ADMIN)).json()
    assert rotated["admin"] is True
    assert auth_client.get("/admin/keys", headers=bearer(rotated["key"])).status_code == 200
    assert auth_client.get("/admin/keys", headers=bearer(alice)).status_code == 401
    auth_client.delete(f"/admin/keys/{rotated['id']}", headers=bearer(ADMIN))
    assert auth_client.get("/admin/keys", headers=bearer(rotated["key"])).status_code == 401


def test_the_bootstrap_key_retired_admin_keys_manage_the_keys(
    make_settings: Callable[..., Settings], dataset: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """TPUTUNE_REQUIRE_API_KEYS without TPUTUNE_ADMIN_KEY: keys are needed as before, admin API keys manage
    them, and the last admin key that works is not revoked (nobody could manage keys). Started with no
    admin key, the server says so in its log."""
    with_bootstrap = make_settings(dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0)
    with TestClient(create_app(with_bootstrap)) as client:
        # With the bootstrap key set, the last admin key that works may go: the bootstrap key manages keys.
        only = client.post(
            "/admin/keys", json={"tenant": "platform", "name": "only", "admin": True}, headers=bearer(ADMIN)
        ).json()
        assert client.delete(f"/admin/keys/{only['id']}", headers=bearer(only["key"])).status_code == 200
        created = client.post(
            "/admin/keys", json={"tenant": "platform", "name": "alice", "admin": True}, headers=bearer(ADMIN)
        )
        alice, alice_id = created.json()["key"], created.json()["id"]
        spare = client.post(
            "/admin/keys", json={"tenant": "platform", "name": "spare", "admin": True}, headers=bearer(ADMIN)
        ).json()
    retired = with_bootstrap.model_copy(update={"admin_key": None, "require_api_keys": True})
    with caplog.at_level(logging.ERROR, logger="api.main"), TestClient(create_app(retired)) as client:
        assert not [r for r in caplog.records if "no admin API key works" in r.getMessage()]
        assert client.get("/jobs").status_code == 401
        assert client.get("/jobs", headers=bearer(ADMIN)).status_code == 401  # (no bootstrap key now)
        assert client.get("/auth/session").json()["auth_required"] is True
        member = client.post("/admin/keys", json={"tenant": "research", "name": "bob"}, headers=bearer(alice))
        assert member.status_code == 201, member.text
        bob = member.json()["key"]
        assert client.post("/jobs", json=job(dataset), headers=bearer(bob)).json()["tenant"] == "research"
        assert client.get("/admin/keys", headers=bearer(bob)).status_code == 403
        # The last admin key that works stays (an auditor's does not count: it manages nothing); another
        # one made, either may go.
        assert client.delete(f"/admin/keys/{spare['id']}", headers=bearer(alice)).status_code == 200
        auditor = {"tenant": "platform", "name": "auditor", "admin": True, "read_only": True}
        assert client.post("/admin/keys", json=auditor, headers=bearer(alice)).status_code == 201
        last = client.delete(f"/admin/keys/{alice_id}", headers=bearer(alice))
        assert last.status_code == 409 and last.json()["error"]["code"] == "last_admin_key", last.text
        assert "Create another admin key first" in last.json()["error"]["message"]
        assert client.get("/admin/keys", headers=bearer(alice)).status_code == 200
        carol = client.post(
            "/admin/keys", json={"tenant": "platform", "name": "carol", "admin": True}, headers=bearer(alice)
        ).json()
        assert client.delete(f"/admin/keys/{alice_id}", headers=bearer(carol["key"])).status_code == 200
        assert client.get("/admin/keys", headers=bearer(alice)).status_code == 401
        # A member key is no admin key: revoking it is never refused.
        assert (
            client.delete(f"/admin/keys/{member.json()['id']}", headers=bearer(carol["key"])).status_code
            == 200
        )
        # An expired admin key does not count as one that works.
        engine = client.app.state.engine  # type: ignore[attr-defined]
        with Session(engine) as session:
            session.execute(
                update(ApiKey)
                .where(col(ApiKey.id) == carol["id"])
                .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
            )
            session.commit()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="api.main"), TestClient(create_app(retired)):
        pass
    assert [r.getMessage() for r in caplog.records if r.name == "api.main"] == [NO_ADMIN_KEY]
