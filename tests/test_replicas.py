"""Two replicas of `tputune serve` on one PostgreSQL database, as the manifests run them: an API key's
limits hold across them (api.usage), and a key revoked through one is refused by the other within about a
pass, its streams there ended. One replica runs two workers and the other one: both ways of serving.

Before, each replica counted a key's rate and streams itself (a key had twice its limits), and learned of
a revocation only when its key cache expired (5 s) and its streams' recheck came round."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import kill_runs
from tests.support.serve import Server, wait_for
from tests.test_serve_workers import ADMIN, follow, make_key, slow_job

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

SYNC = "0.2"  # TPUTUNE_USAGE_SYNC_SECONDS


@contextlib.contextmanager
def two_replicas(
    tmp_path: Path, dataset: Path, database_url: str, **env: str
) -> Iterator[tuple[Server, Server]]:
    """Replica a (two workers, the dispatcher) and replica b (one worker, no dispatcher), each with a data
    dir of its own; their local runs are killed after both stop."""
    common = {
        "TPUTUNE_DATABASE_URL": database_url,
        "TPUTUNE_ADMIN_KEY": ADMIN,
        "TPUTUNE_USAGE_SYNC_SECONDS": SYNC,
    }
    made = []
    for name, workers, extra in (("a", 2, {}), ("b", 1, {"TPUTUNE_DISPATCHER_ENABLED": "false"})):
        folder = tmp_path / name
        folder.mkdir()
        made.append(Server(folder, dataset, workers, **common, **extra, **env))
    with contextlib.ExitStack() as stack:
        for server in made:
            stack.callback(kill_runs, server.data_dir / "jobs")
        for server in made:  # (one after the other: each migrates the database first)
            stack.enter_context(server)
        yield made[0], made[1]


def passes(*servers: Server) -> None:
    """Wait until each replica has seen what the others had done before the call: two passes of each."""
    for _ in range(2):
        since = time.time()
        for server in servers:
            deadline = time.monotonic() + 10
            while server.metric("tputune_usage_last_pass_timestamp_seconds") <= since:
                assert time.monotonic() < deadline, "no pass"
                time.sleep(0.05)


def test_a_keys_rate_limit_holds_across_replicas(tmp_path: Path, dataset: Path, postgres_db_url: str) -> None:
    rate, burst, seconds = 2.0, 2, 6.0
    env = {"TPUTUNE_RATE_LIMIT_PER_SECOND": str(rate), "TPUTUNE_RATE_LIMIT_BURST": str(burst)}
    with two_replicas(tmp_path, dataset, postgres_db_url, **env) as (a, b):
        _, auth = make_key(a)
        passes(a, b)
        assert a.metric("tputune_replicas") == b.metric("tputune_replicas") == 2
        passed = {a.url: 0, b.url: 0}
        refused = 0
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            for server in (a, b):
                response = httpx.get(f"{server.url}/jobs", headers=auth)
                if response.status_code == 200:
                    passed[server.url] += 1
                else:
                    assert response.status_code == 429, response.text
                    refused += 1
            time.sleep(0.02)
        elapsed = time.monotonic() - started
        # The key's rate in all: a bucket each would pass about twice this (2 * (burst + rate * elapsed)).
        most = burst + rate * elapsed + burst + 2
        print(f"passed {passed} in {elapsed:.1f} s at {rate}/s, burst {burst}; at most {most:.1f}")
        assert sum(passed.values()) <= most, (passed, elapsed)
        assert sum(passed.values()) >= rate * elapsed / 2 and min(passed.values()) >= 2, passed
        assert refused > sum(passed.values())  # (well past the rate: how far, the machine's load says)
        # Each says on /metrics that it shares with the other, and when it last did.
        for server in (a, b):
            assert server.metric("tputune_replicas") == 2
            assert time.time() - server.metric("tputune_usage_last_pass_timestamp_seconds") < 2


def test_a_keys_streams_count_in_both_replicas_and_revoking_it_acts_in_both(
    tmp_path: Path, dataset: Path, postgres_db_url: str
) -> None:
    env = {"TPUTUNE_MAX_STREAMS_PER_KEY": "2", "TPUTUNE_STREAM_RECHECK_SECONDS": "60"}
    with two_replicas(tmp_path, dataset, postgres_db_url, **env) as (a, b), contextlib.ExitStack() as stack:
        key_id, auth = make_key(a)
        job_id = slow_job(a, dataset, auth)
        followed = [follow(stack, a, job_id, auth), follow(stack, b, job_id, auth)]
        assert [response.status_code for response in followed] == [200, 200]
        passes(a, b)
        for server in (a, b):
            third = follow(stack, server, job_id, auth)
            assert third.status_code == 429  # (before reading: an admitted stream would not end)
            third.read()
            assert third.json()["error"]["code"] == "too_many_streams", third.text
            assert "follows 2 streams" in third.json()["error"]["message"]

        # b holds a stream and the key in its cache; the key is revoked through a.
        assert httpx.get(f"{b.url}/jobs", headers=auth).status_code == 200
        lines = followed[1].iter_lines()
        assert next(lines).startswith("id: ")
        ended: list[float] = []

        def read() -> None:
            if any(line == "event: closed" for line in lines):
                ended.append(time.monotonic())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        revoked_at = time.monotonic()
        revoked = httpx.delete(f"{a.url}/admin/keys/{key_id}", headers={"Authorization": f"Bearer {ADMIN}"})
        assert revoked.status_code == 200, revoked.text
        wait_for(
            lambda: httpx.get(f"{b.url}/jobs", headers=auth).status_code == 401, "b to refuse the key", 3
        )
        refused_after = time.monotonic() - revoked_at
        reader.join(timeout=5)
        assert ended, "b's stream did not end"
        stream_ended = ended[0] - revoked_at
        print(f"b refused the key {refused_after:.2f} s after, its stream ended {stream_ended:.2f} s after")
        assert stream_ended < 3
        assert refused_after < 3
