"""The busiest routes are served ahead of FastAPI's router (api.direct_routes). They must answer exactly
as FastAPI's routes do, and leave every other request to FastAPI."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import Depends, FastAPI, Request, Response
from fastapi.testclient import TestClient

from api.direct_routes import DirectRoute, serve_directly
from api.main import create_app
from api.routes import health, jobs
from api.settings import Settings
from tests.test_api import job_body

ADMIN_KEY = "admin-key-for-direct-routes"


@pytest.fixture
def clients(make_settings: Callable[..., Settings]) -> Iterator[tuple[TestClient, TestClient]]:
    """The app as served, and the same app (same settings and database) with its direct routes taken out,
    so that FastAPI serves everything."""
    settings = make_settings(dispatcher_enabled=False, admin_key=ADMIN_KEY)
    direct = create_app(settings)
    plain = create_app(settings)
    plain.router.routes[:] = [route for route in plain.router.routes if not isinstance(route, DirectRoute)]
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with TestClient(direct, headers=auth) as one, TestClient(plain, headers=auth) as other:
        yield one, other


def test_the_busiest_routes_are_served_directly(clients: tuple[TestClient, TestClient]) -> None:
    app: Any = clients[0].app
    served = {route.route.endpoint for route in app.router.routes if isinstance(route, DirectRoute)}
    assert served == {jobs.create_job, jobs.get_job, health.healthz}
    assert all(isinstance(route, DirectRoute) for route in app.router.routes[:3])  # ahead of the others


def _answer(response: Any) -> tuple[int, str | None, str | None, Any]:
    """What a client sees of a response, but for what differs between any two requests."""
    try:
        body = response.json()
    except ValueError:
        body = response.text
    if isinstance(body, dict) and "id" in body and body.get("object") == "fine_tuning.job":
        body = {k: v for k, v in body.items() if k not in ("id", "created_at", "output_uri")}
    return response.status_code, response.headers.get("content-type"), response.headers.get("allow"), body


def test_direct_routes_answer_as_fastapi_does(clients: tuple[TestClient, TestClient], dataset: Path) -> None:
    direct, plain = clients
    job_id = direct.post("/jobs", json=job_body(dataset)).json()["id"]
    cases: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/healthz", {}),
        ("HEAD", "/healthz", {}),
        ("GET", f"/jobs/{job_id}", {}),
        ("GET", "/jobs/ft-nope", {}),
        ("GET", f"/jobs/{job_id}", {"headers": {"Authorization": "Bearer wrong"}}),
        ("HEAD", f"/jobs/{job_id}", {}),
        ("DELETE", f"/jobs/{job_id}", {}),
        ("POST", "/jobs", {"json": job_body(dataset)}),
        ("POST", "/jobs", {"json": job_body(dataset, model="gemma3-nope")}),
        ("POST", "/jobs", {"json": job_body(dataset, dataset_uri="/etc/passwd")}),
        ("POST", "/jobs", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}),
        ("POST", "/jobs", {"content": b"name=x", "headers": {"Content-Type": "text/plain"}}),
        ("POST", "/jobs", {"json": job_body(dataset), "headers": {"Idempotency-Key": "k" * 256}}),
        ("POST", "/jobs", {"json": job_body(dataset), "headers": {"Authorization": ""}}),
        ("PUT", "/jobs", {}),
        ("GET", "/jobs?limit=1", {}),  # FastAPI's: the list shares the path with POST /jobs
        ("GET", f"/jobs/{job_id}/events", {}),
    ]
    for method, path, options in cases:
        got, expected = (_answer(c.request(method, path, **options)) for c in (direct, plain))
        if path.startswith("/jobs?"):  # the second list also shows the job the first POST made
            got, expected = got[:3], expected[:3]
        assert got == expected, (method, path, options)
    statuses = [direct.request(method, path, **options).status_code for method, path, options in cases[:4]]
    assert statuses == [200, 405, 200, 404]  # (not all alike: the comparison above compared something)


def test_the_direct_lane_serves_them_past_the_router(
    clients: tuple[TestClient, TestClient], dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DirectLane answers the direct routes before the router; the router still gets every other request
    (the list, on the path POST /jobs shares; HEAD, a method the direct route does not take)."""
    direct, _ = clients
    app: Any = direct.app
    routed: list[str] = []
    router_stack = app.router.middleware_stack

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        routed.append(f"{scope['method']} {scope['path']}")
        await router_stack(scope, receive, send)

    monkeypatch.setattr(app.router, "middleware_stack", counting)
    job_id = direct.post("/jobs", json=job_body(dataset)).json()["id"]
    assert direct.get(f"/jobs/{job_id}").status_code == 200
    assert direct.get("/healthz").status_code == 200
    assert direct.post("/jobs", json=job_body(dataset, model="gemma3-nope")).status_code == 422  # handled
    assert routed == []
    assert direct.get("/jobs?limit=1").status_code == 200
    assert direct.head("/healthz").status_code == 405
    assert routed == ["GET /jobs", "HEAD /healthz"]


def test_direct_routes_are_labelled_by_template(
    clients: tuple[TestClient, TestClient], dataset: Path
) -> None:
    direct, _ = clients
    job_id = direct.post("/jobs", json=job_body(dataset)).json()["id"]
    direct.get(f"/jobs/{job_id}")
    direct.get("/healthz")
    body = direct.get("/metrics").text
    for method, route, status in (
        ("POST", "/jobs", 201),
        ("GET", "/jobs/{job_id}", 200),
        ("GET", "/healthz", 200),
    ):
        labels = f'method="{method}",route="{route}",status="{status}"'
        assert f"tputune_http_requests_total{{{labels}}} 1.0" in body
    assert job_id not in body


def test_a_polled_job_shows_its_changes(client: TestClient, dataset: Path, monkeypatch: Any) -> None:
    """GET /jobs/{id} keeps the JSON it last made for each job: a job that changed is shown as it is now,
    and no more jobs are kept than the limit."""
    monkeypatch.setattr(jobs, "_RENDERED", {})
    monkeypatch.setattr(jobs, "_RENDERED_MAX", 2)
    ids = [client.post("/jobs", json=job_body(dataset, name=f"j{i}")).json()["id"] for i in range(3)]
    assert client.get(f"/jobs/{ids[0]}").json()["status"] == "queued"
    client.post(f"/jobs/{ids[0]}/cancel")
    assert client.get(f"/jobs/{ids[0]}").json()["status"] == "cancelled"
    for job_id in ids:
        assert client.get(f"/jobs/{job_id}").json()["id"] == job_id
    assert list(jobs._RENDERED) == ids[1:]  # the least recently read went first
    assert client.get(f"/jobs/{ids[0]}").json()["status"] == "cancelled"


def test_serve_directly_takes_only_endpoints_that_need_no_fastapi() -> None:
    app = FastAPI()

    @app.get("/sync")
    def sync(request: Request) -> Response:
        return Response()

    @app.get("/query")
    async def query(request: Request, limit: int = 10) -> Response:
        return Response()

    @app.get("/dependency", dependencies=[Depends(lambda: None)])
    async def dependency(request: Request) -> Response:
        return Response()

    async def nowhere(request: Request) -> Response:
        return Response()

    for endpoint in (sync, query, dependency):
        with pytest.raises(TypeError):
            serve_directly(app, endpoint)
    with pytest.raises(ValueError, match="nowhere"):
        serve_directly(app, nowhere)
