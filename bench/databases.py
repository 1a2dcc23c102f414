"""Throwaway databases for the benchmarks that measure one call on each: a SQLite file in a temp dir, or a
database on one PostgreSQL server (tests.support.postgres), started on first use and stopped by `close`."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


class Databases:
    def __init__(self) -> None:
        self.postgres: Any = None

    def new(self, kind: str, prefix: str = "tputune-bench-") -> tuple[str, Path]:
        """A new empty database of `kind` (sqlite or postgres): its URL, and a temp dir for the rest."""
        workdir = Path(tempfile.mkdtemp(prefix=prefix))
        if kind == "sqlite":
            return f"sqlite:///{workdir / 'tputune.db'}", workdir
        if self.postgres is None:
            from tests.support.postgres import PostgresServer

            self.postgres = PostgresServer().start()
        return self.postgres.create_database(), workdir

    def close(self) -> None:
        if self.postgres is not None:
            self.postgres.close()
            self.postgres = None
