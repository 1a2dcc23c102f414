"""The dispatcher in a process of its own (api/dispatch_process.py), under a real `tputune serve`.

What is checked, for a server of one process and one of two workers (where the parent process starts
the dispatcher and serves nothing): the server starts the dispatcher process and the API wakes it through
the FIFO (the pass interval here is a minute, so a job that starts at once was woken); /metrics shows the
figures of that process; a dispatcher process that dies is replaced; one that finds another dispatcher on
its data dir waits for it; and it does not outlive a server killed with SIGKILL.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.dispatch_process import LOCK_FILE
from tests.support.serve import Server, alive, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(params=[1, 2], ids=["one-process", "two-workers"])
def server(request: pytest.FixtureRequest, tmp_path: Path, dataset: Path) -> Iterator[Server]:
    with Server(tmp_path, dataset, workers=request.param) as running:
        yield running


def test_the_dispatcher_runs_in_its_own_process_and_is_woken_by_a_submission(server: Server) -> None:
    dispatcher = server.dispatcher()
    assert dispatcher != server.proc.pid  # type: ignore[union-attr]
    wait_for(server.passed, "the first pass")
    # TPUTUNE_DISPATCHER_NICE (10) more than the server's (set on starting): busy, requests go first.
    server_nice = os.getpriority(os.PRIO_PROCESS, server.proc.pid)  # type: ignore[union-attr]
    assert os.getpriority(os.PRIO_PROCESS, dispatcher) == min(19, server_nice + 10)
    before = server.metric("tputune_launches_total")
    server.submit()
    # Launched far sooner than the next pass a minute away; counted there, served here.
    wait_for(lambda: server.metric("tputune_launches_total") == before + 1, "the launch", timeout=15)


def test_a_dispatcher_process_that_dies_is_replaced(server: Server) -> None:
    first = server.dispatcher()
    wait_for(server.passed, "the first pass")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: not alive(first), "the killed dispatcher to be reaped")
    second = server.dispatcher()
    assert second != first
    server.dispatched(server.submit(), timeout=30)  # the new one starts with a pass
    assert "the dispatcher process exited" in server.log.read_text()


@pytest.mark.parametrize("workers", [1, 2])
def test_it_waits_for_another_dispatcher_on_the_same_data_dir(
    tmp_path: Path, dataset: Path, workers: int
) -> None:
    running = Server(tmp_path, dataset, workers=workers)
    running.data_dir.mkdir(parents=True)
    held = os.open(running.data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # as an older dispatcher still ending its step would
    try:
        running.start()
        job_id = running.submit()
        # (its dispatcher process says so once started: seconds on a busy machine)
        wait_for(lambda: "another dispatcher runs" in running.log.read_text(), "the wait", timeout=30)
        time.sleep(2)
        assert running.job(job_id)["status"] == "queued"  # nobody dispatched it
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
    wait_for(lambda: not alive(dispatcher), "the dispatcher process to exit", timeout=15)


def test_a_server_stopped_normally_stops_its_dispatcher_first(server: Server) -> None:
    dispatcher = server.dispatcher()
    server.stop()  # uvicorn ends with the signal it got (-15) after a graceful shutdown
    assert not alive(dispatcher)  # stopped and reaped by the server, not orphaned
