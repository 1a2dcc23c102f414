"""Schemathesis against /openapi.json, on SQLite and on PostgreSQL: zero 5xx, responses match their
declared schemas, and routes that declare a key refuse requests without one. Bounded examples per
operation, so it runs in CI. And on every parameter and body field, the values it rarely draws: numbers
past the columns, infinity, NaN, the NUL character."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from pydantic import BaseModel
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import update
from sqlmodel import Session, col

from api.auth import new_api_key
from api.jobs import new_job_token
from api.main import create_app
from api.migrate import upgrade
from api.models import ApiKey, Job
from api.routes.keys import KeyCreate
from api.routes.tenants import TenantLimitsUpdate
from api.schemas import JobCreate
from api.settings import Settings
from worker.protocol import Report

ADMIN = "fuzz-admin-key-0123456789"
_KEY_ID, _PREFIX, API_KEY, _HASH = new_api_key()
_root = Path(tempfile.mkdtemp(prefix="tputune-fuzz-"))
atexit.register(shutil.rmtree, _root, ignore_errors=True)
(_root / "train.txt").write_text("Once upon a time.\n<|endoftext|>\nThe end.\n")


def make_app(database_url: str) -> Any:
    settings = Settings(
        data_dir=_root / "state",
        database_url=database_url,
        allowed_data_roots=[_root],
        dispatcher_enabled=False,
        admin_key=ADMIN,
        rate_limit_per_second=0,
        allow_tiny_model=True,
    )
    upgrade(settings.resolved_database_url)
    made = create_app(settings)
    with Session(made.state.engine) as session:
        session.add(ApiKey(id=_KEY_ID, tenant="fuzz", name="fuzz", prefix=_PREFIX, key_hash=_HASH))
        session.commit()
    return made


class Target:
    """The app the cases go to: SQLite's, or PostgreSQL's while the `database` fixture says so."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


sqlite_app = make_app(f"sqlite:///{_root / 'fuzz.db'}")
target = Target(sqlite_app)
schema = schemathesis.openapi.from_asgi("/openapi.json", target)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each case on both databases: PostgreSQL refuses some of what SQLite stores (NUL characters)."""
    if request.param == "sqlite":
        yield "sqlite"
        return
    server = request.getfixturevalue("postgres_server")
    url = server.create_database()
    target.app = make_app(url)
    try:
        yield "postgres"
    finally:
        target.app.state.engine.dispose()
        target.app = sqlite_app
        server.drop_database(url.rsplit("/", 1)[1], force=True)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    ignored_auth,
]


@schema.auth()
class KeyAuth:
    def get(self, case, context):  # type: ignore[no-untyped-def]
        return ADMIN if case.path.startswith("/admin") else API_KEY

    def set(self, case, data, context):  # type: ignore[no-untyped-def]
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


# Examples per operation and database: 25 in CI; more for a longer hunt (TPUTUNE_FUZZ_EXAMPLES=500).
EXAMPLES = int(os.environ.get("TPUTUNE_FUZZ_EXAMPLES", "25"))


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms(case, database: str) -> None:  # type: ignore[no-untyped-def]
    if case.path.endswith("/events") and case.query:
        case.query.pop("follow", None)  # (a followed stream lasts until its job ends: the paged route only)
    case.call_and_validate(checks=CHECKS)


# What the fuzzing above rarely draws, tried on every field: numbers past what the databases' columns and
# JSON hold (PostgreSQL's INTEGER and BIGINT; infinity and NaN, which its JSON refuses) and the NUL
# character (which its text refuses). Each was a 500 somewhere; new fields and parameters are covered as
# they are added.
HUGE_INTS = ("2147483648", "9223372036854775808", "100000000000000000000", "-9223372036854775809")
BAD_FLOATS = ("Infinity", "-Infinity", "NaN", "1e999")
JSON = {"content-type": "application/json"}


def _kind(annotation: Any) -> str | None:
    """'int', 'float', 'str' or 'model' (a nested model's class name) for a field's annotation."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, UnionType) or get_origin(annotation) is Annotated:
        return next((kind for a in args if (kind := _kind(a))), None)
    if annotation is bool:
        return None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "model"
    return {int: "int", float: "float", str: "str"}.get(annotation)


def _edge_values(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], str]]:
    """(the field's path, a JSON value to put there) for every int, float and str field, nested models too."""
    for name, field in model.model_fields.items():
        kind = _kind(field.annotation)
        if kind == "model":
            nested = next(
                a
                for a in (field.annotation, *get_args(field.annotation))
                if isinstance(a, type) and issubclass(a, BaseModel)
            )
            yield from _edge_values(nested, (*prefix, name))
        elif kind == "int":
            yield from (((*prefix, name), value) for value in HUGE_INTS)
        elif kind == "float":
            yield from (((*prefix, name), value) for value in BAD_FLOATS)
        elif kind == "str":
            yield (*prefix, name), '"a\\u0000b"'


def _with(body: dict[str, Any], path: tuple[str | int, ...], value: str) -> bytes:
    """`body` as JSON, with the raw JSON `value` at `path` (raw: json.dumps refuses infinity)."""
    marker = "@@edge@@"
    changed = json.loads(json.dumps(body))
    node = changed
    for name in path[:-1]:
        node = node[name] if isinstance(name, int) else node.setdefault(name, {})
    node[path[-1]] = marker
    return json.dumps(changed).replace(f'"{marker}"', value).encode()


def test_numbers_past_the_columns_and_nul_characters_are_refused_never_a_5xx(database: str) -> None:
    app = target.app
    client = TestClient(app, raise_server_exceptions=False)
    user = {"Authorization": f"Bearer {API_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    spec = {"name": "edge", "model": "tiny", "dataset_uri": str(_root / "train.txt")}
    spec |= {"hyperparameters": {"max_steps": 2}, "resources": {"processes": 1}}
    job_id = client.post("/jobs", json=spec, headers=user).json()["id"]
    token, token_hash = new_job_token()
    with Session(app.state.engine) as session:
        session.execute(update(Job).where(col(Job.id) == job_id).values(token_hash=token_hash))
        session.commit()
    worker = {"Authorization": f"Bearer {token}", "content-type": "application/json"}
    server_errors: list[str] = []
    tried = 0

    def send(method: str, url: str, **kwargs: Any) -> None:
        nonlocal tried
        tried += 1
        response = client.request(method, url, **kwargs)
        if response.status_code >= 500:
            sent = kwargs.get("content") or kwargs.get("params")
            server_errors.append(f"{method} {url} {sent!r}: {response.status_code}")

    for path, operations in app.openapi()["paths"].items():
        url = path.replace("{job_id}", job_id).replace("{key_id}", "key_edge").replace("{name}", "edge")
        for method, operation in operations.items():
            headers = admin if path.startswith("/admin") else user
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path":
                    send(method, path.replace("{" + parameter["name"] + "}", "a%00b"), headers=headers)
                if parameter["in"] != "query" or parameter["name"] == "follow":
                    continue
                schema_text = json.dumps(parameter["schema"])
                if '"integer"' in schema_text:
                    values: tuple[str, ...] = HUGE_INTS
                elif '"number"' in schema_text:
                    values = ("inf", "nan", "1e999")
                else:
                    values = ("a\x00b",)
                for value in values:
                    send(method, url, params={parameter["name"]: value}, headers=headers)
    for field, value in _edge_values(JobCreate):
        send(
            "POST",
            "/jobs",
            content=_with(spec, field, value),
            headers={**user, "content-type": "application/json"},
        )
    for report_class in get_args(get_args(Report)[0]):
        report = {"kind": report_class.model_fields["kind"].default, "step": 1}
        report |= {
            name: "x" if _kind(f.annotation) == "str" else 1
            for name, f in report_class.model_fields.items()
            if f.is_required() and name not in report
        }
        for field, value in _edge_values(report_class):
            if field == ("kind",):
                continue
            body = _with({"reports": [report]}, ("reports", 0, *field), value)
            send("POST", f"/jobs/{job_id}/progress", content=body, headers=worker)
    for field, value in _edge_values(KeyCreate):
        body = _with({"tenant": "edge", "name": "n"}, field, value)
        send("POST", "/admin/keys", content=body, headers={**admin, **JSON})
    for field, value in _edge_values(TenantLimitsUpdate):
        send("PATCH", "/admin/tenants/edge", content=_with({}, field, value), headers={**admin, **JSON})
    assert tried > 150, tried
    assert server_errors == [], "\n".join(server_errors)
