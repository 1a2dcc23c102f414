"""Tests for the test-support fixtures: a real PostgreSQL server and the GCS emulator."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from google.api_core.exceptions import NotFound
from google.cloud import storage

from tests.support import postgres as pg
from tests.support.gcs import GcsEmulator
from tests.support.postgres import PostgresServer

REPO_ROOT = Path(__file__).resolve().parent.parent

# Passed from one test to the next (to check what a fixture did after its test).
_held: dict[str, object] = {}

# -- PostgreSQL -----------------------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_url_shape(postgres_url: str, postgres_server: PostgresServer) -> None:
    assert postgres_url == f"postgresql+psycopg://postgres@127.0.0.1:{postgres_server.port}/tputune_test"


@pytest.mark.postgres
def test_postgres_roundtrip_and_restart(postgres_server: PostgresServer, postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url, pool_pre_ping=True)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE IF EXISTS support_items"))
            conn.execute(sa.text("CREATE TABLE support_items (id serial PRIMARY KEY, name text NOT NULL)"))
            conn.execute(sa.text("INSERT INTO support_items (name) VALUES (:a), (:b)"), {"a": "x", "b": "y"})
        with engine.connect() as conn:
            names = conn.execute(sa.text("SELECT name FROM support_items ORDER BY id")).scalars().all()
        assert names == ["x", "y"]

        port = postgres_server.port
        postgres_server.restart()
        assert postgres_server.port == port
        assert postgres_server.url == postgres_url

        # The pool's old connections are dead; pre-ping replaces them, and the data survived.
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO support_items (name) VALUES ('z')"))
            names = conn.execute(sa.text("SELECT name FROM support_items ORDER BY id")).scalars().all()
        assert names == ["x", "y", "z"]
    finally:
        postgres_server.start()
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE IF EXISTS support_items"))
        engine.dispose()


@pytest.mark.postgres
def test_postgres_restart_under_load(postgres_server: PostgresServer, postgres_db_url: str) -> None:
    engine = sa.create_engine(postgres_db_url, pool_pre_ping=True, pool_size=4)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE hits (id serial PRIMARY KEY)"))
    stop = threading.Event()
    counts = {"ok": 0, "failed": 0}
    lock = threading.Lock()

    def hammer() -> None:
        while not stop.is_set():
            try:
                with engine.begin() as conn:
                    conn.execute(sa.text("INSERT INTO hits DEFAULT VALUES"))
                key = "ok"
            except sa.exc.DBAPIError:
                key = "failed"
                time.sleep(0.02)
            with lock:
                counts[key] += 1

    workers = [threading.Thread(target=hammer) for _ in range(3)]
    for worker in workers:
        worker.start()
    try:
        time.sleep(0.3)
        postgres_server.restart(mode="immediate")
        ok_after_restart = counts["ok"]
        deadline = time.monotonic() + 20
        while counts["ok"] <= ok_after_restart + 10 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
    assert counts["ok"] > ok_after_restart + 10, counts
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM hits")).scalar_one() > 0
    engine.dispose()


@pytest.mark.postgres
def test_postgres_db_url_is_fresh_and_dropped(
    postgres_server: PostgresServer, postgres_db_url: str, postgres_url: str
) -> None:
    name = postgres_db_url.rsplit("/", 1)[1]
    assert name != "tputune_test"
    assert postgres_db_url.startswith(f"postgresql+psycopg://postgres@127.0.0.1:{postgres_server.port}/")
    engine = sa.create_engine(postgres_db_url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT current_database()")).scalar_one() == name
        tables = conn.execute(
            sa.text("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'")
        ).scalar_one()
        assert tables == 0
    # Keep a connection open: the fixture must still drop the database (WITH (FORCE)).
    _held["conn"] = postgres_server.connect(name)
    _held["name"] = name
    assert postgres_server.database_exists(name)
    engine.dispose()


@pytest.mark.postgres
def test_postgres_db_url_was_dropped(postgres_server: PostgresServer) -> None:
    # Runs after the test above (file order); checks that its database is gone.
    if "name" not in _held:
        pytest.skip("needs test_postgres_db_url_is_fresh_and_dropped to run first")
    conn = _held.pop("conn")
    assert isinstance(conn, psycopg.Connection)
    conn.close()
    assert not postgres_server.database_exists(str(_held.pop("name")))


@pytest.mark.postgres
def test_postgres_create_and_drop_database(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("support_extra")
    try:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (v int)"))
            conn.execute(sa.text("INSERT INTO t VALUES (42)"))
            assert conn.execute(sa.text("SELECT v FROM t")).scalar_one() == 42
        open_conn = engine.connect()
        open_conn.execute(sa.text("SELECT 1"))
        postgres_server.drop_database("support_extra")
        assert not postgres_server.database_exists("support_extra")
        open_conn.invalidate()
        engine.dispose()
    finally:
        postgres_server.drop_database("support_extra")
    with pytest.raises(ValueError):
        postgres_server.create_database('bad"name')


def test_postgres_missing_binaries_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(pg.BINDIR_ENV, str(tmp_path))
    with pytest.raises(pg.PostgresNotAvailable, match=pg.BINDIR_ENV):
        pg.find_pg_bindir()


def _run_pytest(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in {"TPUTUNE_REQUIRE_POSTGRES", "PYTEST_ADDOPTS"}}
    environ.update(env, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q", str(tmp_path)],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_postgres_missing_binaries_skip_or_fail(tmp_path: Path) -> None:
    empty = tmp_path / "no-bin"
    empty.mkdir()
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text('pytest_plugins = ["tests.support.fixtures"]\n')
    (project / "test_needs_db.py").write_text("def test_needs_db(postgres_url):\n    pass\n")

    result = _run_pytest(project, TPUTUNE_PG_BINDIR=str(empty))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 skipped" in result.stdout
    assert "PostgreSQL server binaries not found" in result.stdout
    assert "install postgresql to run these tests" in result.stdout

    result = _run_pytest(project, TPUTUNE_PG_BINDIR=str(empty), TPUTUNE_REQUIRE_POSTGRES="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 error" in result.stdout
    assert "PostgreSQL server binaries not found" in result.stdout


# -- GCS emulator ---------------------------------------------------------------------------


def test_gcs_roundtrip(gcs: GcsEmulator) -> None:
    assert gcs.endpoint.startswith("http://127.0.0.1:")
    client = gcs.client()
    bucket = gcs.make_bucket("tputune-test")
    assert client.bucket("tputune-test").exists()

    blob = bucket.blob("runs/1/config.json")
    blob.upload_from_string(b'{"lr": 0.001}', content_type="application/json")
    bucket.blob("runs/1/ckpt/0.bin").upload_from_string(b"\x00" * 1000)
    bucket.blob("runs/2/config.json").upload_from_string("{}")

    assert bucket.blob("runs/1/config.json").exists()
    assert not bucket.blob("runs/1/nope").exists()

    fresh = bucket.blob("runs/1/ckpt/0.bin")
    assert fresh.size is None
    fresh.reload()
    assert fresh.size == 1000
    got = bucket.get_blob("runs/1/config.json")
    assert got is not None
    assert got.size == len(b'{"lr": 0.001}')
    assert got.content_type == "application/json"

    assert bucket.blob("runs/1/config.json").download_as_bytes() == b'{"lr": 0.001}'
    assert client.bucket("tputune-test").blob("runs/1/ckpt/0.bin").download_as_bytes() == b"\x00" * 1000

    names = sorted(b.name for b in client.list_blobs("tputune-test", prefix="runs/1/"))
    assert names == ["runs/1/ckpt/0.bin", "runs/1/config.json"]
    assert sorted(b.name for b in client.list_blobs("tputune-test")) == [
        "runs/1/ckpt/0.bin",
        "runs/1/config.json",
        "runs/2/config.json",
    ]
    iterator = client.list_blobs("tputune-test", prefix="runs/", delimiter="/")
    assert list(iterator) == []
    assert set(iterator.prefixes) == {"runs/1/", "runs/2/"}

    bucket.blob("runs/2/config.json").delete()
    assert not bucket.blob("runs/2/config.json").exists()


def test_gcs_missing_blob_not_found(gcs: GcsEmulator) -> None:
    bucket = gcs.make_bucket("tputune-test")
    missing = bucket.blob("does/not/exist")
    with pytest.raises(NotFound):
        missing.download_as_bytes()
    with pytest.raises(NotFound):
        missing.reload()
    assert bucket.get_blob("does/not/exist") is None
    with pytest.raises(NotFound):
        gcs.client().get_bucket("no-such-bucket")


def test_gcs_large_upload_and_file(gcs: GcsEmulator, tmp_path: Path) -> None:
    bucket = gcs.make_bucket("big")
    payload = os.urandom(9 * 1024 * 1024)  # above the client's 8 MiB multipart limit: resumable
    path = tmp_path / "payload.bin"
    path.write_bytes(payload)
    blob = bucket.blob("payload.bin")
    blob.upload_from_filename(str(path))
    blob.reload()
    assert blob.size == len(payload)
    out = tmp_path / "out.bin"
    bucket.blob("payload.bin").download_to_filename(str(out))
    assert out.read_bytes() == payload


def test_gcs_wiped_between_tests_first(gcs: GcsEmulator) -> None:
    gcs.make_bucket("leftover").blob("a").upload_from_string("a")


def test_gcs_wiped_between_tests_second(gcs: GcsEmulator) -> None:
    assert list(gcs.client().list_buckets()) == []


def test_gcs_env_for_bare_client(gcs: GcsEmulator) -> None:
    assert os.environ["STORAGE_EMULATOR_HOST"] == gcs.endpoint
    gcs.make_bucket("env-bucket")
    client = storage.Client()  # no credentials, no project: picked up from the environment
    client.bucket("env-bucket").blob("x").upload_from_string("hello")
    assert gcs.client().bucket("env-bucket").blob("x").download_as_bytes() == b"hello"


def test_gcs_wipe_keep_buckets(gcs: GcsEmulator) -> None:
    bucket = gcs.make_bucket("keep")
    bucket.blob("a").upload_from_string("a")
    gcs.wipe(keep_buckets=True)
    assert gcs.client().bucket("keep").exists()
    assert list(gcs.client().list_blobs("keep")) == []


def test_gcs_quirk_generation_preconditions_ignored(gcs: GcsEmulator) -> None:
    # Documents an emulator limitation (see tests/support/gcs.py): real GCS would raise
    # PreconditionFailed here.  If this starts failing, the emulator fixed it; update the docs.
    bucket = gcs.make_bucket("quirks")
    bucket.blob("k").upload_from_string("1")
    bucket.blob("k").upload_from_string("2", if_generation_match=0)
    assert bucket.blob("k").download_as_bytes() == b"2"
