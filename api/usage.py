"""What each replica of the server has used of every API key's limits, shared through the database, so that
a key's limits hold across replicas (the manifests run two), not only across one server's processes.

Every `usage_sync_seconds` (on a thread of `tputune serve`: api.server), each server
- writes, for every key it served since the last pass, the rate-limit tokens it spent and the streams it
  follows now: its rows of `key_usage` (api.models.KeyUsage), and a heartbeat every HEARTBEAT_SECONDS;
- reads the other replicas' rows, takes what they spent since its last pass from its own buckets
  (`Buckets.charge`), and counts their streams to each key's share (`Streams.set_remote`);
- counts the revoked keys (and those past their expiry: rotated, or expired), and when the count moves,
  has its processes forget their key cache and recheck their streams' keys (`Streams.revoked`): a key
  revoked in another replica is refused here within about a pass, not after the key cache's 5 s, and its
  streams end then, not at the streams' recheck.

So a key's rate is its limit in all (not one limit per replica), within what the replicas spend in one
pass before they see each other's spending; and its streams' share is exact within a pass. A replica that
stops deletes its rows; one killed stops counting when its heartbeat is STALE_SECONDS old (on the
database's clock, not the replicas' own), and its rows are deleted after FORGET_SECONDS. The database
away: nothing is shared meanwhile, each replica counts its own, and a later pass catches up (the spending
is counted, not sampled).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Float, Table, delete, extract, func, select
from sqlalchemy.engine import Engine

from api.auth import Buckets, usable_key
from api.db import upsert_insert
from api.mapped import MappedFile
from api.models import ApiKey, KeyUsage
from api.settings import Settings

log = logging.getLogger("api.usage")
USAGE = cast(Table, KeyUsage.__table__).c  # type: ignore[attr-defined]
KEYS = cast(Table, ApiKey.__table__)  # type: ignore[attr-defined]

HEARTBEAT = 0  # the key_digest of a replica's heartbeat row
HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 30.0  # a replica whose heartbeat is older is not counted (it died without deleting its rows)
FORGET_SECONDS = 600.0  # ... and its rows are deleted
IDLE_SECONDS = 300.0  # a row of ours unchanged this long, with no streams, is deleted (a bucket refills well
# within it at any rate limit that matters)


USAGE_STATS_FILE = "usage.stats"
_STATS = struct.Struct("dd")  # the last pass that worked (Unix time), the replicas it saw (itself included)
LAST_PASS = (
    "tputune_usage_last_pass_timestamp_seconds",
    "When this server last shared its API keys' use of their limits with the other replicas "
    "(lag = now - this; TPUTUNE_USAGE_SYNC_SECONDS apart while it works)",
)
REPLICAS = ("tputune_replicas", "Replicas of the server sharing API keys' limits, this one included")


class UsageStats(Collector):
    """The last pass's figures, in a file of the data dir: the pass writes them (in the server's supervisor
    with `--workers N`), every process's /metrics reads them."""

    def __init__(self, path: Path) -> None:
        self._file = MappedFile(path, _STATS.size)

    def record(self, last_pass: float, replicas: int) -> None:
        with self._file.locked() as table:
            _STATS.pack_into(table, 0, last_pass, replicas)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        last_pass, replicas = _STATS.unpack_from(self._file.map)
        yield GaugeMetricFamily(*LAST_PASS, value=last_pass)
        yield GaugeMetricFamily(*REPLICAS, value=replicas)


# The database's clock as Unix time: the heartbeats' ages are measured on it, not on each replica's.
_UNIX_NOW_POSTGRESQL = extract("epoch", func.now()).cast(Float)
_UNIX_NOW_SQLITE = (func.julianday("now") - 2440587.5) * 86400.0


class StreamCounts(Protocol):
    def local_counts(self) -> dict[int, int]: ...
    def set_remote(self, counts: dict[int, int]) -> None: ...
    def revoked(self) -> None: ...


def signed(key_digest: int) -> int:
    """A 64-bit digest as the signed BIGINT the database holds."""
    return key_digest - (1 << 64) if key_digest >= 1 << 63 else key_digest


def unsigned(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


def replica_name() -> str:
    """This server among the replicas: its host (the pod's name on Kubernetes), pid and a random part."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass
class _Row:
    """One of our rows: what it holds in the database, and what the buckets said last."""

    since: float
    spent: float = 0.0  # (what the row says: spent here since `since`)
    streams: int = 0
    local: float = 0.0  # the buckets' count when last read
    changed_at: float = 0.0
    deleted: bool = True  # (not in the database: deleted when idle, or not written yet)
    pending: bool = False  # (changed, and not yet committed: written again if the pass fails)


class UsageSync:
    """This server's side of the sharing (see the module). `sync` is one pass; `start` runs them on a
    thread until `stop`."""

    def __init__(
        self,
        engine: Engine,
        buckets: Buckets | None,
        streams: StreamCounts,
        rate: float,
        burst: float,
        interval: float = 1.0,
        replica: str | None = None,
        stats: UsageStats | None = None,
    ) -> None:
        self.engine = engine
        self.buckets = buckets if rate > 0 else None
        self.streams = streams
        self.rate, self.burst = rate, burst
        self.interval = interval
        self.replica = replica or replica_name()
        self._rows: dict[int, _Row] = {}
        self._heartbeat_at = -HEARTBEAT_SECONDS
        self.started = time.time()
        self._others: dict[tuple[str, int], tuple[float, float]] = {}  # (replica, digest): (since, spent)
        self._remote: dict[int, int] | None = None  # the other replicas' streams, as last handed on
        self._revoked: int | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        postgresql = engine.dialect.name == "postgresql"
        self._insert = upsert_insert(engine)
        self._clock = _UNIX_NOW_POSTGRESQL if postgresql else _UNIX_NOW_SQLITE
        self.stats = stats
        if stats is not None:
            stats.record(0.0, 0)  # (none yet: not the last server's)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tputune-usage-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the passes and delete this replica's rows (the others stop counting them at once)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            with self.engine.begin() as connection:
                connection.execute(delete(KeyUsage).where(USAGE.replica == self.replica))
        except Exception as error:  # (the database away: the others forget them after FORGET_SECONDS)
            log.warning("could not delete this replica's key usage: %s", error)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self.sync()
            except Exception as error:
                if not self._failing:
                    log.warning("could not share key usage with the other replicas: %s", error)
                self._failing = True
            else:
                if self._failing:
                    log.info("sharing key usage with the other replicas again")
                self._failing = False

    def sync(self, now: float | None = None) -> None:
        """One pass: write what changed here, read and apply what changed in the other replicas."""
        now = time.time() if now is None else now
        heartbeat_at = self._heartbeat_at
        changed = self._changes(now)
        try:
            rows, ages, idle, revoked = self._exchange(changed, now)
        except Exception:
            self._heartbeat_at = heartbeat_at  # (and the rows stay pending: written next time)
            raise
        for row in self._rows.values():
            row.pending = False
        for key_digest in idle:
            self._rows[key_digest].deleted = True
        live = {replica for replica, age in ages.items() if age < STALE_SECONDS}
        self._apply([row for row in rows if row[0] in live and row[1] != HEARTBEAT])
        if self.stats is not None:
            self.stats.record(time.time(), len(live) + 1)
        if self._revoked is not None and revoked != self._revoked:
            self.streams.revoked()
        self._revoked = revoked

    def _exchange(
        self, changed: list[dict[str, object]], now: float
    ) -> tuple[list[tuple[str, int, float, float, int]], dict[str, float], list[int], int]:
        """One transaction: the revoked and expired keys counted (a key rotated, or past its expiry: the
        same as a revoked one for the caches and streams); our changed rows written, and idle ones deleted;
        the other replicas' rows read, with how old their heartbeats are (those of replicas long dead
        deleted)."""
        with self.engine.begin() as connection:
            # (and the database's clock, for the heartbeats: the replicas' own may disagree)
            revoked, clock = connection.execute(
                select(func.count(), self._clock).select_from(KEYS).where(~usable_key(now))
            ).one()
            clock = float(clock)
            for row in changed:
                row["seen_at"] = clock
            if changed:
                statement = self._insert(KeyUsage)
                values = ("since", "spent", "streams", "seen_at")
                statement = statement.on_conflict_do_update(
                    index_elements=["replica", "key_digest"],
                    set_={name: statement.excluded[name] for name in values},
                )
                connection.execute(statement, changed)
            idle = [key_digest for key_digest, row in self._rows.items() if self._idle(row, now)]
            if idle:
                connection.execute(
                    delete(KeyUsage).where(
                        USAGE.replica == self.replica,
                        USAGE.key_digest.in_([signed(key_digest) for key_digest in idle]),
                    )
                )
            rows = connection.execute(
                select(
                    USAGE.replica, USAGE.key_digest, USAGE.since, USAGE.spent, USAGE.streams, USAGE.seen_at
                ).where(USAGE.replica != self.replica)
            ).all()
            heartbeats = {
                replica: seen_at for replica, key_digest, *_, seen_at in rows if key_digest == HEARTBEAT
            }
            ages = {replica: clock - seen_at for replica, seen_at in heartbeats.items()}
            forgotten = [replica for replica, age in ages.items() if age >= FORGET_SECONDS]
            if forgotten:
                connection.execute(delete(KeyUsage).where(USAGE.replica.in_(forgotten)))
        return [tuple(row[:5]) for row in rows], ages, idle, int(revoked)

    def _changes(self, now: float) -> list[dict[str, object]]:
        """Our rows to write: those whose spending or streams changed, and the heartbeat when due."""
        spent = self.buckets.spent() if self.buckets is not None else {}
        streams = self.streams.local_counts()
        changed = []
        for key_digest in spent.keys() | streams.keys() | self._rows.keys():
            row = self._rows.get(key_digest)
            if row is None:
                row = self._rows[key_digest] = _Row(since=now, changed_at=now)
            local = spent.get(key_digest, 0.0)
            # (less than last time: its bucket was forgotten, and counts again from 0)
            grown = local - row.local if local >= row.local else local
            row.local = local
            count = streams.get(key_digest, 0)
            if not grown and count == row.streams and not row.pending:
                continue
            if row.deleted:  # (made again: counts from now)
                row.since, row.spent, row.deleted = now, 0.0, False
            row.spent += grown
            row.streams = count
            row.changed_at = now
            row.pending = True
            changed.append(self._values(key_digest, row, now))
        if now - self._heartbeat_at >= HEARTBEAT_SECONDS:
            self._heartbeat_at = now
            heartbeat = _Row(since=now)
            changed.append(self._values(HEARTBEAT, heartbeat, now))
        return changed

    @staticmethod
    def _idle(row: _Row, now: float) -> bool:
        return not row.deleted and not row.streams and now - row.changed_at >= IDLE_SECONDS

    def _values(self, key_digest: int, row: _Row, now: float) -> dict[str, object]:
        return {
            "replica": self.replica,
            "key_digest": signed(key_digest),
            "since": row.since,
            "spent": row.spent,
            "streams": row.streams,
            "seen_at": now,
        }

    def _apply(self, rows: list[tuple[str, int, float, float, int]]) -> None:
        """Charge our buckets what the live replicas spent since the last pass; count their streams."""
        charges: dict[int, float] = {}
        streams: Counter[int] = Counter()
        others: dict[tuple[str, int], tuple[float, float]] = {}
        for replica, value, since, spent, count in rows:
            key_digest = unsigned(value)
            others[replica, key_digest] = (since, spent)
            if count:
                streams[key_digest] += count
            before = self._others.get((replica, key_digest))
            if before is not None and before[0] == since:
                charge = spent - before[1]
            else:  # a row not seen before: all it says is new if it was made since this server started;
                # what an older one says was spent before (this server's buckets started full)
                charge = spent if since >= self.started else 0.0
            if charge > 0:
                charges[key_digest] = charges.get(key_digest, 0.0) + charge
        self._others = others
        if charges and self.buckets is not None:
            self.buckets.charge(charges, self.rate, self.burst)
        if streams != self._remote:  # (set_remote walks the workers' whole table under their lock)
            self._remote = dict(streams)
            self.streams.set_remote(self._remote)


def start_usage_sync(
    settings: Settings, engine: Engine, buckets: Buckets, streams: StreamCounts
) -> UsageSync | None:
    """The server's sharing, started (None with TPUTUNE_USAGE_SYNC_SECONDS=0)."""
    if settings.usage_sync_seconds <= 0:
        return None
    sync = UsageSync(
        engine,
        buckets,
        streams,
        rate=settings.rate_limit_per_second,
        burst=float(settings.rate_limit_burst),
        interval=settings.usage_sync_seconds,
        stats=UsageStats(settings.data_dir / USAGE_STATS_FILE),
    )
    sync.start()
    return sync
