"""Pytest fixtures for the external services the tests need: PostgreSQL and a GCS emulator.

Loaded as a plugin from the project's conftest (``pytest_plugins = ["tests.support.fixtures"]``).

PostgreSQL:

* ``postgres_server`` (session): the running :class:`~tests.support.postgres.PostgresServer`,
  for tests that restart it or need more databases.
* ``postgres_url`` (session): SQLAlchemy URL of the shared ``tputune_test`` database,
  ``postgresql+psycopg://postgres@127.0.0.1:PORT/tputune_test``.
* ``postgres_db_url`` (function): URL of a fresh, uniquely named database, dropped (``WITH
  (FORCE)``) after the test.
* ``own_postgres`` (function): a server of the test's own, which it may stop and start.

If the PostgreSQL server binaries are not installed these fixtures skip the test, unless
``TPUTUNE_REQUIRE_POSTGRES=1`` (set in CI), in which case they fail it.

GCS:

* ``gcs_emulator`` (session): the running :class:`~tests.support.gcs.GcsEmulator`.
* ``gcs`` (function): the same emulator, wiped before the test, with ``STORAGE_EMULATOR_HOST``
  and ``GOOGLE_CLOUD_PROJECT`` set for the test so a bare ``storage.Client()`` talks to it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import NoReturn

import pytest

from tests.support.gcs import GcsEmulator, no_proxy_env
from tests.support.postgres import PostgresNotAvailable, PostgresServer, find_pg_bindir

__all__ = [
    "gcs",
    "gcs_emulator",
    "own_postgres",
    "postgres_db_url",
    "postgres_server",
    "postgres_url",
]

REQUIRE_POSTGRES_ENV = "TPUTUNE_REQUIRE_POSTGRES"


def _postgres_required() -> bool:
    return os.environ.get(REQUIRE_POSTGRES_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _postgres_missing(reason: str) -> NoReturn:
    if _postgres_required():
        pytest.fail(f"{reason} ({REQUIRE_POSTGRES_ENV} is set)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server for the whole test session."""
    try:
        bindir = find_pg_bindir()
    except PostgresNotAvailable as err:
        _postgres_missing(
            f"PostgreSQL server binaries not found ({err}) \u2013 install postgresql to run these tests"
        )
    server = PostgresServer(bindir)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test alone, which it may stop and start (the fault tests)."""
    try:
        server = PostgresServer(find_pg_bindir())
    except PostgresNotAvailable as err:
        _postgres_missing(f"PostgreSQL server binaries not found ({err})")
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """SQLAlchemy URL of the session's ``tputune_test`` database."""
    return postgres_server.url


@pytest.fixture
def postgres_db_url(postgres_server: PostgresServer) -> Iterator[str]:
    """SQLAlchemy URL of a fresh database for this test only (dropped with FORCE afterwards)."""
    postgres_server.start()  # no-op when running; brings it back if an earlier test left it down
    url = postgres_server.create_database()
    name = url.rsplit("/", 1)[1]
    try:
        yield url
    finally:
        postgres_server.start()
        postgres_server.drop_database(name, force=True)


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[GcsEmulator]:
    """The in-memory GCS emulator for the whole test session."""
    emulator = GcsEmulator().start()
    saved = {key: os.environ.get(key) for key in ("NO_PROXY", "no_proxy")}
    os.environ.update(no_proxy_env(emulator.host))
    try:
        yield emulator
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        emulator.stop()


@pytest.fixture
def gcs(gcs_emulator: GcsEmulator, monkeypatch: pytest.MonkeyPatch) -> GcsEmulator:
    """The GCS emulator, emptied for this test, with the emulator env vars set."""
    gcs_emulator.wipe()
    for key, value in gcs_emulator.env().items():
        monkeypatch.setenv(key, value)
    return gcs_emulator
