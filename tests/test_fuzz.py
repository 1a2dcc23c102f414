"""Schemathesis against /openapi.json, on SQLite and on PostgreSQL: zero 5xx, responses match their
declared schemas, and routes that declare a key refuse requests without one. Bounded examples per
operation, so it runs in CI."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from sqlmodel import Session

from api.auth import new_api_key
from api.main import create_app
from api.migrate import upgrade
from api.models import ApiKey
from api.settings import Settings

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


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms(case, database: str) -> None:  # type: ignore[no-untyped-def]
    if case.path.endswith("/events") and case.query:
        case.query.pop("follow", None)  # (a followed stream lasts until its job ends: the paged route only)
    case.call_and_validate(checks=CHECKS)
