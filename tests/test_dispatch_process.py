"""The dispatcher in a process of its own (api/dispatch_process.py), under a real `tputune serve`.

What is checked: the server starts the dispatcher process and wakes it across the pipe (the pass interval
here is a minute, so a job that starts at once was woken); /metrics shows the figures of that process;
a dispatcher process that dies is replaced; one that finds another dispatcher on its data dir waits for it;
and it does not outlive a server killed with SIGKILL.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from api.dispatch_process import LOCK_FILE
from tests.conftest import FAKE_WORKER, free_port
from tests.support.serve import alive, children, command_line, serve, wait_up

pytestmark = pytest.mark.slow


def _dispatchers(server: int) -> list[int]:
    return [pid for pid in children(server) if "api.dispatch_process" in command_line(pid)]


def _wait_for(check: Callable[[], object], what: str, timeout: float = 30) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Server:
    def __init__(self, tmp_path: Path, dataset: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = tmp_path / "state"
        self.dataset = dataset
        self.log = tmp_path / "api.log"
        self.env = {
            "TPUTUNE_DATA_DIR": str(self.data_dir),
            "TPUTUNE_PORT": str(self.port),
            "TPUTUNE_ALLOWED_DATA_ROOTS": str(dataset.parent),
            "TPUTUNE_ALLOW_TINY_MODEL": "true",
            # A pass a minute unless woken: a job that starts in seconds was woken through the pipe.
            "TPUTUNE_DISPATCH_INTERVAL_SECONDS": "60",
            "TPUTUNE_WORKER_COMMAND": f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE_WORKER))}",
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = serve(self.env, self.log)
        wait_up(self.url, self.proc, timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)

    def dispatcher(self) -> int:
        assert self.proc is not None
        found = _wait_for(lambda: _dispatchers(self.proc.pid), "the dispatcher process")  # type: ignore[union-attr]
        assert isinstance(found, list) and len(found) == 1, found
        return int(found[0])

    def submit(self, fake: str = "succeed") -> str:
        body = {"name": fake, "model": "tiny", "dataset_uri": str(self.dataset), "metadata": {"fake": fake}}
        response = httpx.post(f"{self.url}/jobs", json=body, timeout=10)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def job(self, job_id: str) -> dict[str, object]:
        return dict(httpx.get(f"{self.url}/jobs/{job_id}", timeout=10).json())

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")

    def passed(self) -> bool:
        """The dispatcher process has made its first pass (the one it makes on starting)."""
        return self.metric("tputune_dispatcher_last_pass_timestamp_seconds") > 0

    def dispatched(self, job_id: str, timeout: float) -> None:
        _wait_for(lambda: self.job(job_id)["status"] != "queued", f"{job_id} to be dispatched", timeout)


@pytest.fixture
def server(tmp_path: Path, dataset: Path) -> Iterator[Server]:
    running = Server(tmp_path, dataset)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def test_the_dispatcher_runs_in_its_own_process_and_is_woken_by_a_submission(server: Server) -> None:
    dispatcher = server.dispatcher()
    assert dispatcher != server.proc.pid  # type: ignore[union-attr]
    _wait_for(server.passed, "the first pass")
    # TPUTUNE_DISPATCHER_NICE (10) more than the server's (set on starting): busy, requests go first.
    server_nice = os.getpriority(os.PRIO_PROCESS, server.proc.pid)  # type: ignore[union-attr]
    assert os.getpriority(os.PRIO_PROCESS, dispatcher) == min(19, server_nice + 10)
    before = server.metric("tputune_launches_total")
    server.submit()
    # Launched far sooner than the next pass a minute away; counted there, served here.
    _wait_for(lambda: server.metric("tputune_launches_total") == before + 1, "the launch", timeout=15)


def test_a_dispatcher_process_that_dies_is_replaced(server: Server) -> None:
    first = server.dispatcher()
    _wait_for(server.passed, "the first pass")
    os.kill(first, signal.SIGKILL)
    _wait_for(lambda: not alive(first), "the killed dispatcher to be reaped")
    second = server.dispatcher()
    assert second != first
    server.dispatched(server.submit(), timeout=30)  # the new one starts with a pass
    assert "the dispatcher process exited" in server.log.read_text()


def test_it_waits_for_another_dispatcher_on_the_same_data_dir(tmp_path: Path, dataset: Path) -> None:
    running = Server(tmp_path, dataset)
    running.data_dir.mkdir(parents=True)
    held = os.open(running.data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # as an older dispatcher still ending its step would
    try:
        running.start()
        job_id = running.submit()
        time.sleep(3)
        assert running.job(job_id)["status"] == "queued"  # nobody dispatched it
        assert "another dispatcher runs" in running.log.read_text()
        os.close(held)  # the older one is gone
        held = -1
        running.dispatched(job_id, timeout=15)  # it takes over with a pass of its own
    finally:
        if held >= 0:
            os.close(held)
        running.stop()


def test_it_does_not_outlive_a_killed_server(server: Server) -> None:
    dispatcher = server.dispatcher()
    server.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
    server.proc.wait()  # type: ignore[union-attr]
    # Its stdin closed with the server: it ends the step it is in and exits (reaped by init, or by us).
    _wait_for(lambda: not alive(dispatcher), "the dispatcher process to exit", timeout=15)


def test_a_server_stopped_normally_stops_its_dispatcher_first(server: Server) -> None:
    dispatcher = server.dispatcher()
    server.stop()  # uvicorn ends with the signal it got (-15) after a graceful shutdown
    assert not alive(dispatcher)  # stopped and reaped by the server, not orphaned
