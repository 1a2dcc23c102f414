"""`tputune serve --workers N` (api/server.py): N API processes on one port, under a real server.

What is checked: /metrics sums the counts of every worker, whichever one a scrape reaches, and keeps the
counts of a worker that died (uvicorn replaces it); a key's rate limit, and its share of followed
streams, hold across the workers; the
workers and the dispatcher do not outlive a supervisor killed with SIGKILL, and a new server binds the
port at once; each worker listens on a socket of its own (SO_REUSEPORT, Linux), so connections opened at
once spread over the workers, and a second server cannot take the same port; a thread dispatcher is
refused with more than one worker. (The dispatcher's side of it, woken by any worker, is in
test_dispatch_process.py, which runs each test with one and two workers.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import create_engine
from sqlmodel import Session

from api.models import ApiKey, as_utc
from api.routes.jobs import KEY_REVOKED
from api.server import REUSE_PORT
from tests.conftest import kill_runs
from tests.support.serve import Server, alive, api_workers, dispatchers, wait_for

pytestmark = pytest.mark.slow

ADMIN = "admin-key-for-the-workers-test"


def workers(server: Server) -> list[int]:
    assert server.proc is not None
    return api_workers(server.proc.pid)


def metrics_dir(worker: int) -> Path:
    """A worker's PROMETHEUS_MULTIPROC_DIR."""
    environ = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
    return Path(
        next(v.split(b"=", 1)[1] for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")).decode()
    )


def served(server: Server, route: str, status: str | None = None) -> dict[int, float]:
    """Requests to `route` each worker answered (with `status`, if given), from its own file in
    PROMETHEUS_MULTIPROC_DIR."""
    pids = workers(server)
    assert pids, "no worker processes"
    folder = metrics_dir(pids[0])
    counts = {}
    for pid in pids:
        total = 0.0
        path = folder / f"counter_{pid}.db"
        metrics = MultiProcessCollector.merge([str(path)], accumulate=True) if path.exists() else []
        for metric in metrics:
            for sample in metric.samples:
                if sample.name == "tputune_http_requests_total" and sample.labels["route"] == route:
                    total += sample.value if status in (None, sample.labels["status"]) else 0
        counts[pid] = total
    return counts


def total(server: Server, route: str, status: str = "200") -> float:
    found = 0.0
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        labels = (f'route="{route}"', f'status="{status}"')
        if line.startswith("tputune_http_requests_total{") and all(label in line for label in labels):
            found += float(line.split()[-1])
    return found


def until_every_worker_served(server: Server, route: str, send: Callable[[], object], least: int = 1) -> int:
    """Send requests on new connections, 8 at a time, until every worker has answered `least` of them;
    how many were sent."""
    sent = 0
    with ThreadPoolExecutor(8) as pool:
        while min(served(server, route).values()) < least:
            assert sent < 4000, f"a worker answered none of {sent} requests: {served(server, route)}"
            list(pool.map(lambda _: send(), range(8)))
            sent += 8
    return sent


def make_key(server: Server) -> tuple[str, dict[str, str]]:
    """A new key of tenant alpha, made with the admin key: (its id, the headers that send it)."""
    created = httpx.post(
        f"{server.url}/admin/keys",
        json={"tenant": "alpha", "name": "ci"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert created.status_code == 201, created.text
    return created.json()["id"], {"Authorization": f"Bearer {created.json()['key']}"}


def slow_job(server: Server, dataset: Path, headers: dict[str, str] | None = None) -> str:
    """A job whose fake worker runs until killed (`kill_runs`: it outlives the server)."""
    body = {"name": "followed", "model": "tiny", "dataset_uri": str(dataset), "metadata": {"fake": "slow"}}
    return str(httpx.post(f"{server.url}/jobs", json=body, headers=headers, timeout=10).json()["id"])


def follow(
    stack: contextlib.ExitStack, server: Server, job_id: str, headers: dict[str, str] | None = None
) -> httpx.Response:
    """The job's events followed, on a new connection (closed with `stack`)."""
    url = f"{server.url}/jobs/{job_id}/events"
    followed = httpx.stream("GET", url, params={"follow": "true"}, headers=headers, timeout=30)
    return stack.enter_context(followed)


@pytest.fixture
def two_workers(tmp_path: Path, dataset: Path) -> Iterator[Server]:
    with Server(tmp_path, dataset, workers=2) as running:
        yield running


def test_metrics_sum_the_workers_counts_and_keep_a_dead_workers(two_workers: Server) -> None:
    server = two_workers
    assert len(workers(server)) == 2
    before = total(server, "/healthz")
    sent = until_every_worker_served(server, "/healthz", lambda: httpx.get(f"{server.url}/healthz"))
    # Every scrape, whichever worker answers it, counts the requests of both.
    for _ in range(4):
        assert total(server, "/healthz") - before == sent
    victim = workers(server)[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: victim not in workers(server) and len(workers(server)) == 2, "uvicorn to replace it")
    assert httpx.get(f"{server.url}/healthz").status_code == 200  # (the other worker holds the port)
    # The dead worker's counts stay (a counter never goes back), and no request is counted twice.
    assert total(server, "/healthz") - before == sent + 1


def test_a_keys_rate_limit_holds_across_the_workers(tmp_path: Path, dataset: Path) -> None:
    limited = Server(
        tmp_path,
        dataset,
        workers=2,
        TPUTUNE_ADMIN_KEY=ADMIN,
        TPUTUNE_RATE_LIMIT_PER_SECOND="0.5",
        TPUTUNE_RATE_LIMIT_BURST="10",
    )
    with limited as server:
        _, auth = make_key(server)
        codes: list[int] = []

        def send() -> None:
            response = httpx.get(f"{server.url}/jobs", headers=auth)
            codes.append(response.status_code)

        started = time.monotonic()
        # Each worker answers more than the burst: with a bucket per process 20 would pass, not 10.
        until_every_worker_served(server, "/jobs", send, least=12)
        elapsed = time.monotonic() - started
        assert set(codes) == {200, 429}
        assert 10 <= codes.count(200) <= 10 + int(elapsed * 0.5) + 1, (codes.count(200), elapsed)


def test_a_keys_share_of_followed_streams_holds_across_the_workers(tmp_path: Path, dataset: Path) -> None:
    """Each worker used to count a key's streams itself: with two, a key held twice its share."""
    shared = Server(tmp_path, dataset, workers=2, TPUTUNE_ADMIN_KEY=ADMIN, TPUTUNE_MAX_STREAMS_PER_KEY="3")
    with contextlib.ExitStack() as stack:
        # (after the server stops, or it starts the killed run again: a local run outlives its server)
        stack.callback(kill_runs, shared.data_dir / "jobs")
        server = stack.enter_context(shared)
        _, auth = make_key(server)
        job_id = slow_job(server, dataset, auth)
        route = "/jobs/{job_id}/events"
        admitted = []
        # Follow on new connections until both workers have refused one: a worker refuses only when the
        # key holds its share, wherever its streams are.
        for _ in range(400):
            if len(admitted) == 3 and min(served(server, route, "429").values()) >= 1:
                break
            response = follow(stack, server, job_id, auth)
            if response.status_code == 200:
                admitted.append(response)
                assert len(admitted) <= 3
                continue
            response.read()
            assert response.status_code == 429 and response.json()["error"]["code"] == "too_many_streams"
            assert "follows 3 streams" in response.json()["error"]["message"]
            response.close()
        else:
            raise AssertionError(f"not refused by both workers: {served(server, route, '429')}")
        # A stream let go gives its place back to the key, on whichever worker.
        admitted.pop().close()
        deadline = time.monotonic() + 10
        while True:
            again = follow(stack, server, job_id, auth)
            if again.status_code == 200:
                break
            assert again.status_code == 429 and time.monotonic() < deadline
            again.close()
            time.sleep(0.1)


def test_a_key_revoked_through_one_worker_is_refused_and_its_streams_end_in_all(
    tmp_path: Path, dataset: Path
) -> None:
    """The worker that revoked a key ended its streams at once; the other one only at its recheck
    (TPUTUNE_STREAM_RECHECK_SECONDS, 60 here), and went on accepting the key from its cache for 5 s."""
    env = {"TPUTUNE_ADMIN_KEY": ADMIN, "TPUTUNE_STREAM_RECHECK_SECONDS": "60"}
    revoking = Server(tmp_path, dataset, workers=2, **env)
    with contextlib.ExitStack() as stack:
        stack.callback(kill_runs, revoking.data_dir / "jobs")
        server = stack.enter_context(revoking)
        key_id, auth = make_key(server)
        job_id = slow_job(server, dataset, auth)
        # Both workers have the key in their cache, and hold streams of it.
        until_every_worker_served(server, "/jobs", lambda: httpx.get(f"{server.url}/jobs", headers=auth))
        ended: dict[int, float] = {}
        lines: list[Iterator[str]] = []
        pids = workers(server)
        for _ in range(40):
            held = sockets_on(server.port, "01")
            if all(held.get(pid, 0) >= 1 for pid in pids):
                break
            response = follow(stack, server, job_id, auth)
            assert response.status_code == 200
            lines.append(response.iter_lines())
            assert next(lines[-1]).startswith("id: ")
        else:
            raise AssertionError(f"the streams are not on both workers: {sockets_on(server.port, '01')}")

        def read(index: int) -> None:
            if any(line == "event: closed" for line in lines[index]):
                ended[index] = time.monotonic()

        readers = [threading.Thread(target=read, args=(index,), daemon=True) for index in range(len(lines))]
        for reader in readers:
            reader.start()
        revoked_at = time.monotonic()
        admin = {"Authorization": f"Bearer {ADMIN}"}
        revoked = httpx.delete(f"{server.url}/admin/keys/{key_id}", headers=admin)
        assert revoked.status_code == 200, revoked.text
        for reader in readers:
            reader.join(timeout=10)
        assert sorted(ended) == list(range(len(lines))), ended
        assert max(ended.values()) - revoked_at < 5
        time.sleep(1.0)  # (the other worker's watch looks twice a second)
        for _ in range(16):  # (new connections: both workers)
            assert httpx.get(f"{server.url}/jobs", headers=auth).status_code == 401


def test_every_worker_records_its_keys_last_use_when_the_server_stops(tmp_path: Path, dataset: Path) -> None:
    """Each worker writes its keys' last uses every 60 s (api.auth.USE_FLUSH_SECONDS) and when it stops:
    a server stopped before the first minute has still recorded them."""
    with Server(tmp_path, dataset, workers=2, TPUTUNE_ADMIN_KEY=ADMIN) as server:
        key_id, auth = make_key(server)
        other_id, _ = make_key(server)
        before = datetime.now(UTC)
        until_every_worker_served(server, "/jobs", lambda: httpx.get(f"{server.url}/jobs", headers=auth))
        after = datetime.now(UTC)
    engine = create_engine(f"sqlite:///{server.data_dir / 'tputune.db'}")
    with Session(engine) as session:
        used, unused = session.get(ApiKey, key_id), session.get(ApiKey, other_id)
    engine.dispose()
    assert used is not None and unused is not None and unused.last_used_at is None
    assert before <= as_utc(used.last_used_at) <= after  # type: ignore[operator]


def test_a_rotated_keys_streams_end_when_its_grace_does(tmp_path: Path, dataset: Path) -> None:
    """The usage pass counts expired keys with the revoked ones: the streams of a key rotated with a grace
    end, in every worker, about when the grace does, not at their recheck (60 s here)."""
    env = {"TPUTUNE_ADMIN_KEY": ADMIN, "TPUTUNE_STREAM_RECHECK_SECONDS": "60"}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(Server(tmp_path, dataset, workers=2, **env))
        stack.callback(kill_runs, server.data_dir / "jobs")
        key_id, auth = make_key(server)
        job_id = slow_job(server, dataset, auth)
        lines = []
        for _ in range(40):  # (streams on both workers)
            if all(sockets_on(server.port, "01").get(pid, 0) >= 1 for pid in workers(server)):
                break
            response = follow(stack, server, job_id, auth)
            lines.append(response.iter_lines())
            assert next(lines[-1]).startswith("id: ")
        ended: dict[int, float] = {}

        def read(index: int) -> None:
            if any(line == "data: " + json.dumps(KEY_REVOKED) for line in lines[index]):
                ended[index] = time.monotonic()

        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(lines))]
        for reader in readers:
            reader.start()
        admin = {"Authorization": f"Bearer {ADMIN}"}
        rotated = httpx.post(
            f"{server.url}/admin/keys/{key_id}/rotate", json={"grace_seconds": 2}, headers=admin
        )
        assert rotated.status_code == 201, rotated.text
        grace_ends = time.monotonic() + 2
        for reader in readers:
            reader.join(timeout=15)
        print("ended after the grace, s:", sorted(round(t - grace_ends, 2) for t in ended.values()))
        assert sorted(ended) == list(range(len(lines))), ended
        assert grace_ends - 0.5 <= min(ended.values()) and max(ended.values()) <= grace_ends + 4, [
            t - grace_ends for t in ended.values()
        ]


def test_workers_and_dispatcher_die_with_a_killed_supervisor(two_workers: Server) -> None:
    server = two_workers
    assert server.proc is not None
    doomed = [*workers(server), server.dispatcher()]
    left = metrics_dir(workers(server)[0])
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    wait_for(lambda: not any(alive(pid) for pid in doomed), "the workers and the dispatcher to exit", 15)
    assert left.is_dir()  # nobody removed it
    # Nothing holds the port: a new server (same port, same data dir) comes up at once.
    server.start()
    assert len(workers(server)) == 2 and len(dispatchers(server.proc.pid)) == 1
    assert not left.exists() and metrics_dir(workers(server)[0]) != left  # the dead server's are gone


def serve_two_workers(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`tputune serve --workers 2` with `env`, expected to give up at start."""
    command = [sys.executable, "-m", "api.cli", "serve", "--workers", "2"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


def sockets_on(port: int, state: str) -> dict[int, int]:
    """TCP sockets whose local port is `port`, in `state` ("0A" listening, "01" established), counted by
    the process holding them (/proc/net/tcp, then each process's file descriptors)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == state:
                inodes.add(fields[9])
    held: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue  # gone, or not ours to read
        count = sum(link.startswith("socket:[") and link[8:-1] in inodes for link in links)
        if count:
            held[int(entry.name)] = count
    return held


@pytest.mark.skipif(not REUSE_PORT, reason="SO_REUSEPORT balances connections on Linux only")
def test_each_worker_listens_on_its_own_socket_and_connections_spread(two_workers: Server) -> None:
    server = two_workers
    assert server.proc is not None
    pids = workers(server)
    # One listening socket per worker, none in the supervisor (it holds the port bound, not listening).
    # (The server answered once one worker was up; the other may still be starting.)
    wait_for(lambda: sockets_on(server.port, "0A") == {pid: 1 for pid in pids}, "both workers to listen")
    # 48 connections opened at once: on the one socket uvicorn shares, whichever worker woke first took
    # every connection waiting (seen: 64 of 64). The kernel hashes them over the workers' sockets.
    opened = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(48)]
    try:
        for sock in opened:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
        for sock in opened:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        held = sockets_on(server.port, "01")
        per_worker = [held.get(pid, 0) for pid in pids]
        assert sum(per_worker) == 48, held
        # Binomial(48, 1/2): fewer than 8 on one side has a chance of about 1 in 10^6.
        assert min(per_worker) >= 8, per_worker
    finally:
        for sock in opened:
            sock.close()


def test_a_second_server_cannot_take_the_port(two_workers: Server, tmp_path: Path) -> None:
    env = {**os.environ, **two_workers.env, "TPUTUNE_DATA_DIR": str(tmp_path / "other")}
    done = serve_two_workers(env)
    assert done.returncode != 0
    assert f"cannot serve on 127.0.0.1:{two_workers.port}" in done.stderr
    assert httpx.get(f"{two_workers.url}/healthz", timeout=10).status_code == 200
    assert len(workers(two_workers)) == 2


def test_more_than_one_worker_needs_the_dispatcher_process(tmp_path: Path) -> None:
    env = {**os.environ, "TPUTUNE_DATA_DIR": str(tmp_path), "TPUTUNE_DISPATCHER_PROCESS": "false"}
    done = serve_two_workers(env)
    assert done.returncode != 0
    assert "TPUTUNE_WORKERS > 1 needs the dispatcher in a process of its own" in done.stderr


@pytest.mark.parametrize("count", [1, 2])
def test_followed_streams_do_not_keep_the_server_from_stopping(
    tmp_path: Path, dataset: Path, count: int
) -> None:
    """SIGTERM: uvicorn waits for every open response to end, and a followed stream ends when its job does.
    One dashboard page left open kept the server from stopping until a SIGKILL skipped its shutdown. Now
    the streams end (plainly: their clients follow again, from their last event), and the server stops."""
    server = Server(tmp_path, dataset, workers=count)
    server.start()
    assert server.proc is not None
    job_id = slow_job(server, dataset)
    with contextlib.ExitStack() as stack:
        stack.callback(kill_runs, server.data_dir / "jobs")  # (a local run outlives its server, by design)
        lines = []
        for _ in range(4):  # (new connections: with two workers, likely on both)
            response = follow(stack, server, job_id)
            assert response.status_code == 200
            lines.append(response.iter_lines())
            assert next(lines[-1]).startswith("id: ")
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=20)
        assert time.monotonic() - started < 10
        for each in lines:
            assert all(not line.startswith("event: closed") for line in each)  # (read to its end, no error)
    assert "Application shutdown complete" in server.log.read_text()
