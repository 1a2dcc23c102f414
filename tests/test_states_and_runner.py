from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from api.runner import EXIT_FILE, RUNNER_FILE, process_start_time, run
from api.states import FINAL, TRANSITIONS, InvalidTransition, JobStatus, can_transition, check_transition


def test_state_machine() -> None:
    assert can_transition("queued", "starting")
    assert can_transition("running", "cancelling")
    for final in FINAL:
        # Final, but a failed job its owner resumes: queued again, to go on from its last checkpoint.
        assert TRANSITIONS[final] == (frozenset({JobStatus.queued}) if final == "failed" else frozenset())
        for target in set(JobStatus) - TRANSITIONS[final]:
            with pytest.raises(InvalidTransition):
                check_transition(final, target)
    with pytest.raises(InvalidTransition, match="from 'queued' to 'running'"):
        check_transition("queued", "running")
    assert can_transition("running", "queued")  # Kueue preempted it: waiting for quota again
    assert not can_transition("running", "starting")
    assert not can_transition("cancelling", "queued")
    # Paused and resumed: a queued job never launched is paused at once, a launched one stops first.
    assert can_transition("queued", "paused") and can_transition("running", "pausing")
    assert can_transition("pausing", "paused") and can_transition("paused", "queued")
    assert can_transition("pausing", "succeeded")  # (it finished before the pause reached it)
    assert not can_transition("running", "paused") and not can_transition("paused", "running")
    assert not can_transition("cancelling", "pausing")


def test_invalid_transition_is_refused_not_applied(client, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    from sqlmodel import Session, select

    from api.jobs import transition
    from api.models import Job

    job_id = client.post("/jobs", json={"name": "x", "model": "tiny", "dataset_uri": str(dataset)}).json()[
        "id"
    ]
    with Session(client.app.state.engine) as session:
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        with pytest.raises(InvalidTransition):
            transition(session, job, JobStatus.succeeded)
    assert client.get(f"/jobs/{job_id}").json()["status"] == "queued"


def test_concurrent_transition_loses_cleanly(client, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    from sqlmodel import Session, select

    from api.jobs import transition
    from api.models import Job

    job_id = client.post("/jobs", json={"name": "x", "model": "tiny", "dataset_uri": str(dataset)}).json()[
        "id"
    ]
    engine = client.app.state.engine
    with Session(engine) as first, Session(engine) as second:
        a = first.exec(select(Job).where(Job.id == job_id)).one()
        b = second.exec(select(Job).where(Job.id == job_id)).one()
        assert transition(first, a, JobStatus.starting)
        # The second actor read "queued" too; its cancel must not overwrite "starting".
        assert not transition(second, b, JobStatus.cancelled)
        assert b.status == "starting"


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", body]


def test_runner_records_exit_and_sets_process_env(tmp_path: Path) -> None:
    code = run(
        tmp_path,
        2,
        _script(
            "import os, sys; print(os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'], "
            "os.environ['JAX_COORDINATOR_ADDRESS']); sys.exit(0)"
        ),
    )
    assert code == 0
    assert json.loads((tmp_path / EXIT_FILE).read_text())["exit_code"] == 0
    assert json.loads((tmp_path / RUNNER_FILE).read_text())["pid"] > 0
    first = (tmp_path / "worker.log").read_text().split()
    second = (tmp_path / "worker-1.log").read_text().split()
    assert first[:2] == ["0", "2"] and second[:2] == ["1", "2"] and first[2] == second[2]


def test_runner_stops_peers_of_a_failed_process(tmp_path: Path) -> None:
    started = time.monotonic()
    code = run(
        tmp_path,
        2,
        _script("import os, sys, time\nif os.environ['JAX_PROCESS_ID'] == '1': sys.exit(7)\ntime.sleep(60)"),
        peer_grace=0.5,
    )
    assert code == 7
    assert time.monotonic() - started < 10
    assert json.loads((tmp_path / EXIT_FILE).read_text())["exit_code"] == 7


def test_runner_told_to_stop_before_its_workers_started_starts_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM reaches the runner once (then SIGKILL past the grace): one that came between two workers'
    starts stops the rest from starting, and the run does not count as finished (status 0)."""
    import os
    import signal
    import subprocess

    import api.runner

    started: list[object] = []
    real_popen = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        child = real_popen(*args, **kwargs)  # type: ignore[call-overload]
        started.append(child)
        os.kill(os.getpid(), signal.SIGTERM)  # (the runner's handler takes it)
        return child

    monkeypatch.setattr(api.runner.subprocess, "Popen", popen)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = run(tmp_path, 2, _script("import sys; sys.exit(0)"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(started) == 1 and not (tmp_path / "worker-1.log").exists()
    assert code == 128 + signal.SIGTERM
    assert json.loads((tmp_path / EXIT_FILE).read_text())["exit_code"] == code


def test_process_start_time_tells_pids_apart() -> None:
    import os

    assert process_start_time(os.getpid()) is not None
    assert process_start_time(2**22 + 12345) is None


def test_a_moves_event_has_the_time_the_job_moved(client, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    """The status event's time is the job's own (its started_at, finished_at, what it held): the usage
    report reads a job's moves from its events, its `usage` from its columns. The event was stamped after
    the UPDATE's round trip, which under CI's load put a job's end 50 ms past its finished_at."""
    from sqlmodel import Session, select

    from api.jobs import transition
    from api.models import Job

    job_id = client.post("/jobs", json={"name": "x", "model": "tiny", "dataset_uri": str(dataset)}).json()[
        "id"
    ]
    with Session(client.app.state.engine) as session:
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        # (a check after the UPDATE, before the event: as a slow round trip would)
        for target in (JobStatus.starting, JobStatus.running, JobStatus.succeeded):
            assert transition(session, job, target, check=lambda: time.sleep(0.2))
    job = client.get(f"/jobs/{job_id}").json()
    moved = {
        e["data"]["status"]: e["created_at"]
        for e in client.get(f"/jobs/{job_id}/events", params={"type": "status"}).json()["data"]
    }
    assert (moved["running"], moved["succeeded"]) == (job["started_at"], job["finished_at"])
