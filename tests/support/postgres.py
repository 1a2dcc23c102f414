"""A throwaway PostgreSQL server for tests.

:class:`PostgresServer` runs ``initdb`` into a fresh temporary directory, starts ``postgres`` on
127.0.0.1 and a free port (fsync and friends off, so it is fast), and creates a database for the
tests.  It can be stopped and started again on the same port with its data kept (``restart()``),
which lets tests check how the service behaves while the database goes away under load.

``initdb`` and ``postgres`` refuse to run as root.  When the tests run as root, every server
binary is run as the ``postgres`` system user through ``runuser -u postgres --``, inside a
directory made with :func:`tempfile.mkdtemp` under ``/tmp`` and chowned to that user.

The binaries are looked up in this order: ``$TPUTUNE_PG_BINDIR``, ``pg_config --bindir``,
``/usr/lib/postgresql/<version>/bin`` (newest first), then ``PATH``.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Self

import psycopg
from psycopg import sql

__all__ = [
    "PostgresNotAvailable",
    "PostgresServer",
    "find_pg_bindir",
    "free_port",
]

BINDIR_ENV = "TPUTUNE_PG_BINDIR"
REQUIRED_BINARIES = ("initdb", "pg_ctl", "postgres")
DEFAULT_DATABASE = "tputune_test"
SERVER_USER = "postgres"
HOST = "127.0.0.1"

_SERVER_OPTIONS = "-F -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
_DB_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class PostgresNotAvailable(RuntimeError):
    """The PostgreSQL server binaries could not be found."""


def _has_binaries(path: Path) -> bool:
    return all(os.access(path / name, os.X_OK) for name in REQUIRED_BINARIES)


def _candidate_bindirs() -> list[tuple[str, Path]]:
    candidates: list[tuple[str, Path]] = []
    env = os.environ.get(BINDIR_ENV)
    if env:
        candidates.append((f"${BINDIR_ENV}", Path(env)))
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out:
                candidates.append(("pg_config --bindir", Path(out)))

    def version_key(path: str) -> tuple[int, str]:
        version = Path(path).parent.name
        return (int(version) if version.isdigit() else -1, version)

    for path in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version_key, reverse=True):
        candidates.append(("/usr/lib/postgresql", Path(path)))
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(("PATH", Path(initdb).resolve().parent))
    return candidates


def find_pg_bindir() -> Path:
    """Return the directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    If ``$TPUTUNE_PG_BINDIR`` is set it must hold them; otherwise the usual places are searched.
    Raises :class:`PostgresNotAvailable` (with the places searched) when none has them.
    """
    env = os.environ.get(BINDIR_ENV)
    if env:
        if _has_binaries(Path(env)):
            return Path(env)
        raise PostgresNotAvailable(f"${BINDIR_ENV}={env} does not contain {', '.join(REQUIRED_BINARIES)}")
    searched: list[str] = []
    for source, path in _candidate_bindirs():
        if _has_binaries(path):
            return path
        searched.append(f"{source}: {path}")
    searched.append("PATH")
    raise PostgresNotAvailable("searched " + "; ".join(dict.fromkeys(searched)))


def free_port(host: str = HOST) -> int:
    """Return a TCP port on ``host`` that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


class PostgresServer:
    """A PostgreSQL server in a temporary directory, for tests.

    ``start()`` creates the cluster on first use and starts the server; ``stop()`` stops it but
    keeps the data, so ``start()`` brings the same databases back on the same port;
    ``restart()`` is both.  ``close()`` stops the server and deletes the directory.  The object
    is also a context manager (start on enter, close on exit).
    """

    def __init__(
        self,
        bindir: Path | str | None = None,
        *,
        database: str = DEFAULT_DATABASE,
        port: int | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        self.bindir = Path(bindir) if bindir is not None else find_pg_bindir()
        if not _has_binaries(self.bindir):
            raise PostgresNotAvailable(f"{self.bindir} does not contain {', '.join(REQUIRED_BINARIES)}")
        _check_db_name(database)
        self.database = database
        self.host = HOST
        self.port = port if port is not None else free_port()
        self.start_timeout = start_timeout
        self.as_root = os.geteuid() == 0
        self.base_dir: Path | None = None
        self._running = False
        self._atexit_registered = False

    # -- paths and URLs ---------------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        if self.base_dir is None:
            raise RuntimeError("the PostgreSQL cluster has not been created yet (call start())")
        return self.base_dir / "data"

    @property
    def socket_dir(self) -> Path:
        if self.base_dir is None:
            raise RuntimeError("the PostgreSQL cluster has not been created yet (call start())")
        return self.base_dir

    @property
    def log_file(self) -> Path:
        return self.socket_dir / "postgres.log"

    @property
    def running(self) -> bool:
        return self._running

    def url_for(self, database: str, driver: str = "postgresql+psycopg") -> str:
        """A SQLAlchemy URL for ``database`` on this server (``driver="postgresql"`` for libpq)."""
        return f"{driver}://{SERVER_USER}@{self.host}:{self.port}/{database}"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the default test database."""
        return self.url_for(self.database)

    @property
    def dsn(self) -> str:
        """libpq connection string of the default test database (for psycopg directly)."""
        return self.url_for(self.database, driver="postgresql")

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Self:
        """Create the cluster if needed, start the server, and create the default database."""
        if self._running:
            return self
        if self.base_dir is None:
            self._init_cluster()
        if _port_open(self.host, self.port):
            raise RuntimeError(f"cannot start PostgreSQL: port {self.port} on {self.host} is already in use")
        options = f"-h {self.host} -p {self.port} -k {self.socket_dir} {_SERVER_OPTIONS}"
        try:
            self._run_pg(
                "pg_ctl",
                "start",
                "-w",
                "-t",
                str(int(self.start_timeout)),
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_file),
                "-o",
                options,
                timeout=self.start_timeout + 30,
            )
        except RuntimeError as err:
            raise RuntimeError(f"{err}\n--- postgres log ---\n{self._log_tail()}") from err
        self._running = True
        if not self._atexit_registered:
            atexit.register(self.close)
            self._atexit_registered = True
        self._wait_ready()
        if not self.database_exists(self.database):
            self.create_database(self.database)
        return self

    def stop(self, mode: str = "immediate") -> None:
        """Stop the server (``mode``: smart, fast or immediate); the data stays for ``start()``."""
        if not self._running or self.base_dir is None:
            return
        try:
            self._run_pg("pg_ctl", "stop", "-w", "-m", mode, "-D", str(self.data_dir), timeout=120)
        finally:
            self._running = False

    def restart(self, mode: str = "fast") -> None:
        """Stop the server and start it again on the same port, keeping all databases.

        Connections open at the time are cut; with ``mode="immediate"`` the server also goes
        through crash recovery on the way back up.
        """
        self.stop(mode=mode)
        self.start()

    def close(self) -> None:
        """Stop the server (immediately) and delete its directory."""
        with contextlib.suppress(Exception):
            self.stop(mode="immediate")
        if self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self.base_dir = None
        if self._atexit_registered:
            atexit.unregister(self.close)
            self._atexit_registered = False

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- databases --------------------------------------------------------------------------

    def connect(self, database: str = "postgres", *, autocommit: bool = True) -> psycopg.Connection:
        """A plain psycopg connection to ``database`` as the superuser."""
        return psycopg.connect(
            host=self.host,
            port=self.port,
            user=SERVER_USER,
            dbname=database,
            autocommit=autocommit,
            connect_timeout=10,
        )

    def database_exists(self, name: str) -> bool:
        with self.connect() as conn:
            row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        return row is not None

    def create_database(self, name: str | None = None) -> str:
        """Create a database (a unique name if none is given) and return its SQLAlchemy URL."""
        name = name if name is not None else f"test_{uuid.uuid4().hex[:16]}"
        _check_db_name(name)
        with self.connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url_for(name)

    def drop_database(self, name: str, *, force: bool = True) -> None:
        """Drop a database if it exists, by default cutting any connections still open to it."""
        _check_db_name(name)
        query = "DROP DATABASE IF EXISTS {} WITH (FORCE)" if force else "DROP DATABASE IF EXISTS {}"
        with self.connect() as conn:
            conn.execute(sql.SQL(query).format(sql.Identifier(name)))

    # -- internals --------------------------------------------------------------------------

    def _init_cluster(self) -> None:
        base = Path(tempfile.mkdtemp(prefix="tputune-pg-", dir="/tmp" if self.as_root else None))
        try:
            if self.as_root:
                try:
                    user = pwd.getpwnam(SERVER_USER)
                except KeyError as err:
                    raise RuntimeError(
                        f"running as root, but there is no {SERVER_USER!r} system user to run "
                        "initdb/postgres as (they refuse to run as root)"
                    ) from err
                os.chown(base, user.pw_uid, user.pw_gid)
            os.chmod(base, 0o700)
            self.base_dir = base
            self._run_pg(
                "initdb",
                "-D",
                str(self.data_dir),
                "-A",
                "trust",
                "-U",
                SERVER_USER,
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
                timeout=180,
            )
        except BaseException:
            self.base_dir = None
            shutil.rmtree(base, ignore_errors=True)
            raise

    def _command(self, binary: str, *args: str) -> list[str]:
        cmd = [str(self.bindir / binary), *args]
        if self.as_root:
            cmd = ["runuser", "-u", SERVER_USER, "--", *cmd]
        return cmd

    def _run_pg(self, binary: str, *args: str, timeout: float) -> None:
        cmd = self._command(binary, *args)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.setdefault("LC_ALL", "C")
        try:
            proc = subprocess.run(
                cmd,
                cwd=self.base_dir or "/",
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"{binary} timed out after {timeout}s: {' '.join(cmd)}") from err
        if proc.returncode != 0:
            raise RuntimeError(
                f"{binary} failed with exit code {proc.returncode}: {' '.join(cmd)}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                with self.connect() as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def _log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, RuntimeError):
            return "(no log)"


def _check_db_name(name: str) -> None:
    if not _DB_NAME_RE.match(name):
        raise ValueError(f"invalid database name for tests: {name!r}")
