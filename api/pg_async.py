"""psycopg async connections of the event loop's own, for the statements the API runs without a thread:
the reads of `GET /jobs/{id}` (api.reader) and the inserts of `POST /jobs` (api.writer)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

from sqlalchemy.engine import Engine

from api import db
from api.errors import DatabaseUnavailable


def conninfo(engine: Engine) -> str:
    """The engine's database as a libpq connection string (its password included)."""
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


class AsyncConnections:
    """Connections in autocommit, opened when asked for and kept for the next statement. One idle for
    `db.IDLE_PING_SECONDS` is pinged before use, as the engine's pool does: a server restart or a NAT
    timeout may have dropped it. They belong to one event loop (`discard_all` when it changes)."""

    def __init__(self, conninfo: str, *, connect_timeout: float = 3.0, row_factory: Any = None) -> None:
        self.conninfo = conninfo
        self.connect_timeout = connect_timeout
        self.row_factory = row_factory
        self._idle: deque[tuple[Any, float]] = deque()  # (connection, idle since), most recent last

    async def checkout(self) -> tuple[Any, bool]:
        """A connection, and whether it was pooled (a new one failed to connect: DatabaseUnavailable)."""
        import psycopg

        while self._idle:
            connection, since = self._idle.pop()
            if connection.closed:
                continue
            if time.monotonic() - since >= db.IDLE_PING_SECONDS:
                try:
                    async with asyncio.timeout(self.connect_timeout):
                        await connection.execute("SELECT 1")
                except (psycopg.OperationalError, TimeoutError):
                    await close(connection)
                    continue
            return connection, True
        options: dict[str, Any] = {} if self.row_factory is None else {"row_factory": self.row_factory}
        try:
            connection = await psycopg.AsyncConnection.connect(
                self.conninfo, autocommit=True, connect_timeout=max(1, round(self.connect_timeout)), **options
            )
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(str(exc)) from exc
        return connection, False

    def checkin(self, connection: Any) -> None:
        self._idle.append((connection, time.monotonic()))

    def discard_all(self) -> None:
        """Drop the idle connections without awaiting (their loop may be gone)."""
        while self._idle:
            connection, _ = self._idle.pop()
            connection.pgconn.finish()

    async def close(self) -> None:
        while self._idle:
            connection, _ = self._idle.pop()
            await close(connection)


async def close(connection: Any) -> None:
    with contextlib.suppress(Exception):
        await connection.close()
