"""Schemathesis against /openapi.json: zero 5xx, responses match their declared schemas, and routes
that declare a key refuse requests without one. Bounded examples per operation, so it runs in CI."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

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
_root = Path(tempfile.mkdtemp(prefix="tputune-fuzz-"))
atexit.register(shutil.rmtree, _root, ignore_errors=True)
_settings = Settings(
    data_dir=_root / "state",
    database_url=f"sqlite:///{_root / 'fuzz.db'}",
    allowed_data_roots=[_root],
    dispatcher_enabled=False,
    admin_key=ADMIN,
    rate_limit_per_second=0,
    allow_tiny_model=True,
)
upgrade(_settings.resolved_database_url)
app = create_app(_settings)
_key_id, _prefix, API_KEY, _hash = new_api_key()
with Session(app.state.engine) as _session:
    _session.add(ApiKey(id=_key_id, tenant="fuzz", name="fuzz", prefix=_prefix, key_hash=_hash))
    _session.commit()
(_root / "train.txt").write_text("Once upon a time.\n<|endoftext|>\nThe end.\n")

schema = schemathesis.openapi.from_asgi("/openapi.json", app)

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
def test_api_conforms(case) -> None:  # type: ignore[no-untyped-def]
    if case.path.endswith("/events") and case.query:
        case.query.pop("follow", None)  # (a followed stream lasts until its job ends: the paged route only)
    case.call_and_validate(checks=CHECKS)
