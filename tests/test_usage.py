"""api.usage: replicas of the server share each API key's use of its limits through the database.

Two servers' state side by side, each as `tputune serve --workers N` keeps it (the mapped buckets and
streams table of a data dir of its own), over one real database of each kind; the passes are run by hand,
with the clock given where the test moves it. (Real replicas: test_replicas.py.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from api.auth import LocalBuckets, Principal, SharedBuckets, hash_key
from api.db import make_engine
from api.errors import ApiError
from api.migrate import upgrade
from api.models import ApiKey, utcnow
from api.settings import Settings
from api.streams import EVENTS, SharedKeyStreams, Streams
from api.usage import FORGET_SECONDS, IDLE_SECONDS, STALE_SECONDS, UsageStats, UsageSync
from tests.support.postgres import PostgresServer

RATE = 0.001  # (a token in 1,000 s: none comes back during a test)
BURST = 10
T0 = time.time() + 3600  # (a clock the tests move: later than the replicas started)


@dataclass
class Replica:
    buckets: SharedBuckets
    streams: SharedKeyStreams
    sync: UsageSync

    def spend(self, key: str, most: int = 1000) -> int:
        """Take tokens of `key` until refused (or `most`); how many were taken."""
        taken = 0
        while taken < most and self.buckets.take(key, RATE, BURST) is None:
            taken += 1
        return taken


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url, 2)
    yield engine
    engine.dispose()


@pytest.fixture
def replicas(tmp_path: Path, engine: Engine) -> list[Replica]:
    made = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        buckets = SharedBuckets(folder / "buckets", reset=True)
        streams = SharedKeyStreams(folder / "streams", rows=4096, reset=True)
        made.append(Replica(buckets, streams, UsageSync(engine, buckets, streams, RATE, BURST, replica=name)))
    return made


def sync(*replicas: Replica, now: float | None = None) -> None:
    for replica in replicas:
        replica.sync.sync(now)


def test_what_one_replica_spends_is_taken_from_the_others_buckets(replicas: list[Replica]) -> None:
    a, b = replicas
    sync(a, b)  # (they see each other)
    assert a.spend("key_x", most=6) == 6
    sync(a, b)
    assert b.spend("key_x") == 4  # not 10: the key's burst is spent in all
    sync(b, a)
    assert a.spend("key_x") == 0
    assert b.spend("key_y", most=3) == 3  # another key, its own limit
    sync(b, a)
    assert a.spend("key_y") == 7
    # Passes with nothing new charge nothing again.
    assert a.spend("key_w", most=2) == 2
    sync(a, b, a, b, a, b)
    assert b.spend("key_w") == 8
    assert b.buckets.take("key_y", RATE, BURST) is not None


def test_spending_before_a_replica_started_is_not_charged(
    tmp_path: Path, engine: Engine, replicas: list[Replica]
) -> None:
    """A replica that starts takes the others' rows as they are: what they spent before is past (their
    own buckets still hold it). What they spend after it started is charged, seen at once or later."""
    a, b = replicas
    sync(a)
    assert a.spend("key_x", most=8) == 8
    sync(a)
    assert b.spend("key_x", most=5) == 5  # (b has made no pass yet: a sees it for the first time next)
    sync(b, a)
    assert a.spend("key_x") == 0  # 8 of its own and b's 5: in debt
    assert b.spend("key_x") == 0
    buckets = SharedBuckets(tmp_path / "c-buckets", reset=True)
    c = UsageSync(
        engine, buckets, SharedKeyStreams(tmp_path / "c-streams", rows=4096, reset=True), RATE, BURST
    )
    c.sync()
    assert buckets.take("key_x", RATE, BURST) is None  # a's and b's spending is older than c


def test_each_key_s_streams_count_in_every_replica(replicas: list[Replica]) -> None:
    a, b = replicas
    assert a.streams.take("key_x", 3) == (0, True)
    assert a.streams.take("key_x", 3) == (1, True)
    sync(a, b)
    assert b.streams.take("key_x", 3) == (2, True)
    assert b.streams.take("key_x", 3) == (3, False)  # a's two and its own
    assert b.streams.local_counts() == {b.streams.local_counts().popitem()[0]: 1}  # (not a's)
    a.streams.give("key_x")
    sync(a, b)
    assert b.streams.take("key_x", 3) == (2, True)
    sync(b, a)
    assert a.streams.take("key_x", 3) == (3, False)  # its one and b's two
    b.streams.give("key_x")
    b.streams.give("key_x")
    sync(b, a)
    assert a.streams.take("key_x", 3) == (1, True)


def test_a_replica_that_stops_is_not_counted(replicas: list[Replica], engine: Engine) -> None:
    a, b = replicas
    a.streams.take("key_x", 2)
    a.streams.take("key_x", 2)
    sync(a, b)
    assert b.streams.take("key_x", 2) == (2, False)
    a.sync.stop()  # (deletes its rows)
    sync(b)
    assert b.streams.take("key_x", 2) == (0, True)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT DISTINCT replica FROM key_usage")).scalars().all() == ["b"]


def test_a_replica_that_died_stops_counting_then_its_rows_go(replicas: list[Replica], engine: Engine) -> None:
    """A replica killed (no pass deletes its rows): its streams count until its heartbeat is stale, and
    its rows are deleted later. Ages are on the database's clock (here, a's heartbeat is made older)."""
    a, b = replicas
    a.streams.take("key_x", 2)
    a.streams.take("key_x", 2)
    sync(a, b)
    assert b.streams.take("key_x", 2) == (2, False)
    with engine.connect() as connection:
        heartbeat = "SELECT seen_at FROM key_usage WHERE replica = 'a' AND key_digest = 0"
        assert abs(connection.execute(text(heartbeat)).scalar_one() - time.time()) < 5  # (Unix time)

    def age_a(seconds: float) -> None:
        with engine.begin() as connection:
            aged = "UPDATE key_usage SET seen_at = seen_at - :seconds WHERE replica = 'a'"
            connection.execute(text(aged), {"seconds": seconds})

    age_a(STALE_SECONDS - 2)
    sync(b)
    assert b.streams.take("key_x", 2) == (2, False)
    age_a(2)
    sync(b)
    assert b.streams.take("key_x", 2) == (0, True)

    def replicas_stored() -> set[str]:
        with engine.connect() as connection:
            return set(connection.execute(text("SELECT replica FROM key_usage")).scalars())

    assert replicas_stored() == {"a", "b"}
    age_a(FORGET_SECONDS - STALE_SECONDS)
    sync(b)
    assert replicas_stored() == {"b"}


def test_a_replica_whose_clock_is_off_is_counted(replicas: list[Replica]) -> None:
    """Heartbeats are aged on the database's clock: one taken on a's own, a minute behind, read as dead."""
    a, b = replicas
    a.streams.take("key_x", 2)
    a.streams.take("key_x", 2)
    sync(a, now=time.time() - 60)
    sync(b)
    assert b.streams.take("key_x", 2) == (2, False)


def test_an_idle_row_is_deleted_and_made_again_without_charging_twice(
    replicas: list[Replica], engine: Engine
) -> None:
    a, b = replicas
    sync(a, b, now=T0)
    assert a.spend("key_x", most=4) == 4
    assert b.spend("key_x", most=1) == 1
    sync(a, b, now=T0 + 1)
    later = T0 + 1 + IDLE_SECONDS
    sync(a, b, now=later)  # (their rows of key_x, idle, are deleted: a saw b's 1 first)

    def rows() -> int:
        with engine.connect() as connection:
            return int(
                connection.execute(text("SELECT count(*) FROM key_usage WHERE key_digest != 0")).scalar_one()
            )

    assert rows() == 0
    assert a.spend("key_x", most=2) == 2  # (its bucket still knows its 4, and b's 1)
    sync(a, b, now=later + 1)
    assert rows() == 1
    assert b.spend("key_x") == 3  # 10 less a's 4 + 2 and its own 1: the old 4 are not charged again


def test_spending_while_the_database_fails_is_shared_when_it_is_back(
    replicas: list[Replica], engine: Engine
) -> None:
    a, b = replicas
    sync(a, b)
    assert a.spend("key_x", most=5) == 5
    with engine.begin() as connection:
        connection.execute(text("ALTER TABLE key_usage RENAME TO key_usage_away"))
    try:
        with pytest.raises(Exception, match="key_usage"):
            a.sync.sync()
    finally:
        with engine.begin() as connection:
            connection.execute(text("ALTER TABLE key_usage_away RENAME TO key_usage"))
    sync(a, b)
    assert b.spend("key_x") == 5


def test_a_key_revoked_elsewhere_has_this_replica_look(replicas: list[Replica], engine: Engine) -> None:
    """Its processes forget their key cache and recheck their streams' keys (Streams.watch) when the count
    of revoked keys moves, whichever replica revoked it."""
    a, b = replicas
    with Session(engine) as session:
        session.add(ApiKey(id="key_1", tenant="t", name="n", prefix="tpt_1", key_hash=hash_key("k")))
        session.commit()
    sync(a, b)
    seen = b.streams.revocations()
    sync(b)
    assert b.streams.revocations() == seen
    with Session(engine) as session:
        row = session.get(ApiKey, "key_1")
        assert row is not None
        row.revoked_at = utcnow()
        session.add(row)
        session.commit()
    sync(b)
    assert b.streams.revocations() == seen + 1
    sync(b)
    assert b.streams.revocations() == seen + 1
    # A key that expires (as a rotated one does) counts as one revoked, when it expires.
    with Session(engine) as session:
        session.add(
            ApiKey(
                id="key_2",
                tenant="t",
                name="n",
                prefix="tpt_2",
                key_hash=hash_key("k2"),
                expires_at=utcnow() + timedelta(seconds=0.5),
            )
        )
        session.commit()
    sync(b)
    assert b.streams.revocations() == seen + 1
    time.sleep(0.6)
    sync(b)
    assert b.streams.revocations() == seen + 2


def test_the_last_pass_and_the_replicas_seen_are_figures_for_metrics(
    tmp_path: Path, engine: Engine, replicas: list[Replica]
) -> None:
    a, b = replicas
    stats = UsageStats(tmp_path / "usage.stats")
    UsageStats(tmp_path / "usage.stats").record(123.0, 5)  # (the last server's: cleared)
    c = UsageSync(
        engine, None, SharedKeyStreams(tmp_path / "c", rows=4096, reset=True), RATE, BURST, stats=stats
    )

    def figures() -> dict[str, float]:
        return {family.name: family.samples[0].value for family in stats.collect()}

    assert figures() == {"tputune_usage_last_pass_timestamp_seconds": 0.0, "tputune_replicas": 0.0}
    sync(a, b)
    before = time.time()
    c.sync()
    seen = figures()
    assert seen["tputune_replicas"] == 3
    assert before <= seen["tputune_usage_last_pass_timestamp_seconds"] <= time.time()
    a.sync.stop()
    c.sync()
    assert figures()["tputune_replicas"] == 2


def test_a_one_process_server_shares_alike(tmp_path: Path, engine: Engine, replicas: list[Replica]) -> None:
    """`tputune serve` with one process keeps its buckets and streams in memory (LocalBuckets, Streams)."""
    a = replicas[0]
    buckets = LocalBuckets()
    streams = Streams(Settings(data_dir=tmp_path, max_streams_per_key=3))
    one = UsageSync(engine, buckets, streams, RATE, BURST, replica="one")
    principal = Principal(tenant="t", key_id="key_x")
    sync(a)
    one.sync()
    assert a.spend("key_x", most=4) == 4
    assert [buckets.take("key_x", RATE, BURST) for _ in range(2)] == [None, None]
    held = [streams.admit(EVENTS, principal), streams.admit(EVENTS, principal)]
    assert a.streams.take("key_x", 3) == (0, True)
    sync(a)
    one.sync()
    a.sync.sync()
    assert sum(buckets.take("key_x", RATE, BURST) is None for _ in range(10)) == 4  # 10 - 4 - 2
    assert a.spend("key_x") == 4  # 10 - 4 - 2 (one's last four are not in a pass yet)
    one.sync()
    a.sync.sync()
    assert a.spend("key_x") == 0 and buckets.take("key_x", RATE, BURST) is not None  # both in debt now
    with pytest.raises(ApiError) as refused:
        streams.admit(EVENTS, principal)  # two here, one in a
    assert refused.value.status == 429 and refused.value.code == "too_many_streams"
    assert a.streams.take("key_x", 3) == (3, False)
    streams.release(held.pop())
    one.sync()
    a.sync.sync()
    assert a.streams.take("key_x", 3) == (2, True)
    seen = streams.revocations()
    with Session(engine) as session:
        session.add(
            ApiKey(id="key_1", tenant="t", name="n", prefix="p", key_hash=hash_key("k"), revoked_at=utcnow())
        )
        session.commit()
    one.sync()
    assert streams.revocations() == seen + 1


@pytest.mark.postgres
def test_what_a_replica_spends_while_postgresql_is_down_is_shared_when_it_is_back(
    own_postgres: PostgresServer, tmp_path: Path
) -> None:
    """The database restarted: the passes fail fast meanwhile, and the first one after takes it all
    (the spending is counted, not sampled); nothing restarts the replicas."""
    url = own_postgres.create_database("usage")
    upgrade(url)
    engine = make_engine(url, 2)
    try:
        made = []
        for name in ("a", "b"):
            buckets = SharedBuckets(tmp_path / f"{name}.buckets", reset=True)
            streams = SharedKeyStreams(tmp_path / f"{name}.streams", rows=4096, reset=True)
            made.append(
                Replica(buckets, streams, UsageSync(engine, buckets, streams, RATE, BURST, replica=name))
            )
        a, b = made
        sync(a, b)
        assert a.spend("key_x", most=3) == 3
        own_postgres.stop("fast")
        assert a.spend("key_x", most=4) == 4
        started = time.monotonic()
        with pytest.raises(OperationalError):
            a.sync.sync()  # (what it would have written is written by the next pass)
        assert time.monotonic() - started < 10  # (connect_timeout: fails fast, does not hang)
        own_postgres.start()
        deadline = time.monotonic() + 30
        while True:  # (a pooled connection from before the restart may fail once)
            try:
                sync(a)
                break
            except OperationalError:
                assert time.monotonic() < deadline
        sync(b)
        assert b.spend("key_x") == 3  # 10 less a's 3 + 4
    finally:
        engine.dispose()
