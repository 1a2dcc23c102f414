"""The dispatcher and the local executor with a test-double worker that speaks the progress contract."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from api.dispatcher import Dispatcher
from api.models import Job
from api.runner import process_start_time
from api.settings import Settings

FINAL = ("succeeded", "failed", "cancelled")


def submit(api, dataset: Path, fake: str = "succeed", **extra: str) -> str:  # type: ignore[no-untyped-def]
    body = {
        "name": f"fake-{fake}",
        "model": "tiny",
        "dataset_uri": str(dataset),
        "metadata": {"fake": fake, **extra},
    }
    with api.client() as http:
        response = http.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def events(api, job_id: str) -> list[dict]:  # type: ignore[no-untyped-def]
    with api.client() as http:
        return http.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]


def log_text(api, job_id: str) -> str:  # type: ignore[no-untyped-def]
    with api.client() as http:
        return "\n".join(http.get(f"/jobs/{job_id}/logs", params={"tail": 1000}).json()["lines"])


def timed_moves(history: list[dict]) -> list[tuple[str, datetime]]:
    """The job's statuses, in order, with when it moved to each."""
    return [
        (e["data"]["status"], datetime.fromisoformat(e["created_at"]))
        for e in history
        if e["type"] == "status" and "status" in (e["data"] or {})
    ]


def test_success(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    job_id = submit(api, dataset, steps="6")
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "succeeded", job
    assert job["progress"]["step"] == 6 and job["progress"]["total_steps"] == 6
    assert job["progress"]["fraction"] == 1.0
    assert job["metrics"]["loss"] == pytest.approx(0.5)
    assert job["started_at"] and job["finished_at"]
    assert job["checkpoint_uri"].endswith("final.json")
    assert Path(job["output_uri"], "final.json").exists()
    history = events(api, job_id)
    assert [e["step"] for e in history if e["type"] == "metrics"] == [1, 2, 3, 4, 5, 6]
    statuses = [
        e["data"]["status"] for e in history if e["type"] == "status" and "status" in (e["data"] or {})
    ]
    assert statuses == ["queued", "starting", "running", "succeeded"]
    # It held its one process from its launch until it ended.
    launched = next(e["created_at"] for e in history if e["type"] == "launch")
    ran = datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(launched)
    usage = job["usage"]
    assert usage["chips"] == 1 and usage["chip_unit"] == "processes"
    assert usage["held_seconds"] == pytest.approx(ran.total_seconds(), abs=0.05) and ran.total_seconds() > 0
    assert usage["chip_hours"] == pytest.approx(usage["held_seconds"] / 3600, abs=1e-4)
    assert job["status_message"] == "Training finished."
    # A run its worker ended early (early stopping) says so: its progress stops short.
    early = api.wait_for(submit(api, dataset, steps="3", total_steps="30"), lambda j: j["status"] in FINAL)
    assert early["status"] == "succeeded" and early["progress"]["fraction"] == 0.1
    assert early["status_message"] == "Training finished early, at step 3 of 30."
    with api.client() as http:
        logs = http.get(f"/jobs/{job_id}/logs").json()
    assert any("fake worker" in line for line in logs["lines"])


def test_worker_error_report_and_exit_code(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    failed = submit(api, dataset, "fail")
    bad = submit(api, dataset, "bad_input")
    crash = submit(api, dataset, "silent_crash")
    job = api.wait_for(failed, lambda j: j["status"] in FINAL)
    assert job["status"] == "failed"
    assert job["error"] == {"code": "loss_not_finite", "message": "The loss became NaN at step 0."}
    job = api.wait_for(bad, lambda j: j["status"] in FINAL)
    assert job["status"] == "failed" and job["error"]["code"] == "dataset_empty"
    job = api.wait_for(crash, lambda j: j["status"] in FINAL)
    assert job["status"] == "failed"
    assert job["error"]["code"] == "worker_failed"
    assert "status 3" in job["error"]["message"] and "about to crash" in job["error"]["message"]


def test_missing_dataset_fails_before_launch(live_api, data_root: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    job_id = submit(api, data_root / "nope.jsonl")
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "failed"
    assert job["error"]["code"] == "dataset_not_found"
    assert "nope.jsonl" in job["error"]["message"]
    seen = events(api, job_id)
    assert not any(e["type"] == "launch" for e in seen)
    # A local file is checked before the job is claimed: one move, no `starting` in between.
    moves = [(e["data"]["from"], e["data"]["status"]) for e in seen if "from" in (e.get("data") or {})]
    assert moves == [("queued", "failed")]


def _runner_pid(api, job_id: str) -> int:  # type: ignore[no-untyped-def]
    import json

    path = api.settings.jobs_dir / job_id / "runner.json"
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return int(json.loads(path.read_text())["pid"])


def _gone(pid: int) -> bool:
    return process_start_time(pid) is None


def test_a_run_that_stops_reporting_is_stopped_and_goes_on_from_its_checkpoint(  # type: ignore[no-untyped-def]
    live_api, dataset: Path
) -> None:
    """TPUTUNE_STALL_MINUTES: a running job whose workers report nothing for that long (alive, hung) has its
    run stopped as a pause stops it, and is queued again to go on from its checkpoint; one that stalls
    more than TPUTUNE_STALL_MAX_RESTARTS times fails (worker_stalled). A slower one that reports is left."""
    api = live_api(stall_minutes=0.03, stall_max_restarts=1)  # (1.8 s)
    once = submit(api, dataset, "stall_once", steps="8", resume="checkpoint")
    always = submit(api, dataset, "stall", steps="8")
    slow = submit(api, dataset, "succeed", steps="40", interval="0.1")  # (4 s: reports every 0.1 s)
    api.wait_for(once, lambda j: j["status"] == "running")
    pid = _runner_pid(api, once)
    done = api.wait_for(once, lambda j: j["status"] in FINAL, timeout=60)
    assert done["status"] == "succeeded", done
    assert _gone(pid) and done["pauses"] == 1 and done["progress"]["step"] == 8
    history = events(api, once)
    moves = [e for e in history if "status" in (e["data"] or {}) and "from" in e["data"]]
    assert [e["data"]["status"] for e in moves] == [
        "starting", "running", "pausing", "paused", "queued", "starting", "running", "succeeded"
    ]  # fmt: skip
    assert moves[2]["data"]["for"] == "stalled"
    assert re.fullmatch(
        r"running → pausing: Restarting: the workers reported nothing for [0-9] minutes \(a host lost in a "
        r"collective, a read that never returns\?\); they are stopped, and the job goes on from its last "
        r"checkpoint\.",
        moves[2]["message"],
    ), moves[2]["message"]
    assert moves[4]["message"] == (
        "paused → queued: Queued again after its workers stalled (restart 1 of 1); it goes on from its last "
        "checkpoint."
    )
    # It stalled at step 3, saved it on SIGTERM, and the next run went on from there.
    steps = [e["step"] for e in history if e["type"] == "metrics"]
    assert sorted(set(steps)) == list(range(1, 9)) and steps.count(3) == 1

    failed = api.wait_for(always, lambda j: j["status"] in FINAL, timeout=60)
    assert failed["status"] == "failed" and failed["error"]["code"] == "worker_stalled", failed
    assert failed["error"]["message"] == (
        "The workers stalled (reported nothing for TPUTUNE_STALL_MINUTES) 2 times; giving up "
        "(TPUTUNE_STALL_MAX_RESTARTS 1). Its checkpoints are kept."
    )
    assert [e["data"]["status"] for e in events(api, always) if "from" in (e["data"] or {})][-3:] == [
        "running",
        "pausing",
        "failed",
    ]
    finished = api.wait_for(slow, lambda j: j["status"] in FINAL, timeout=60)
    assert finished["status"] == "succeeded" and finished["pauses"] == 0
    assert api.gauge("tputune_stalls_total") == 3  # (once's, and always' two)
    # Resumed by its owner, the failed one has its restarts anew: its next stall restarts it.
    with api.client() as http:
        assert http.post(f"/jobs/{always}/resume").json()["status"] == "queued"
    again = "Queued again after its workers stalled (restart 1 of 1)"
    seen = api.wait_for(
        always, lambda j: (j["status_message"] or "").startswith(again) or j["status"] in FINAL
    )
    assert seen["status"] not in FINAL and seen["retries"] == 1, seen
    with api.client() as http:
        assert http.post(f"/jobs/{always}/cancel").status_code == 200


def test_a_dispatcher_that_dies_between_pausing_and_queueing_a_stopped_run_leaves_no_paused_job(  # type: ignore[no-untyped-def]
    live_api, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run the server stopped (stalled here; a budget alike) goes paused then queued in one transaction:
    a dispatcher that fails between the two moves (as it would dying there) leaves the job pausing, and
    its next pass queues it. Were the first move committed alone, the job would stay paused, waiting for
    an owner who never paused it."""
    from api import jobs

    transition, failed = jobs.transition, []

    def dies_before_queueing(session, job, target, *args, **kwargs):  # type: ignore[no-untyped-def]
        if target == jobs.JobStatus.queued and job.status == jobs.JobStatus.paused and not failed:
            failed.append(job.id)
            raise RuntimeError("the dispatcher died here")
        return transition(session, job, target, *args, **kwargs)

    monkeypatch.setattr(jobs, "transition", dies_before_queueing)
    api = live_api(stall_minutes=0.03, stall_max_restarts=1, dispatcher_process=False)
    job_id = submit(api, dataset, "stall_once", steps="6", resume="checkpoint")
    done = api.wait_for(job_id, lambda j: j["status"] in FINAL, timeout=60)
    assert failed == [job_id] and done["status"] == "succeeded", done
    moves = [e["data"]["status"] for e in events(api, job_id) if "from" in (e["data"] or {})]
    assert moves == ["starting", "running", "pausing", "paused", "queued", "starting", "running", "succeeded"]
    assert done["pauses"] == 1


def test_stalls_are_timed_from_the_dispatchers_watch_not_before() -> None:
    """A job's silence counts from its last report, or from the dispatcher's first pass if later (reports
    may have waited for it: it was stopped, not the leader, or the database was away), or from when its run
    last started anew; a gap between passes starts the watch again. Only running jobs stall; 0: none."""
    dispatcher = Dispatcher(None, None, Settings(stall_minutes=5, webhooks_enabled=False))  # type: ignore[arg-type]
    start = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    job = Job(id="ft-a", name="a", status="running", model="tiny", method="lora", spec={}, executor="local")
    job.output_uri, job.reported_at, job.updated_at = "/x", start - timedelta(hours=1), start
    assert dispatcher._silent_minutes(job, start) is None  # (no pass yet)
    for second in range(0, 400, 30):  # a pass each 30 s: watched from the first
        dispatcher._watch(start + timedelta(seconds=second))
    at = start + timedelta(seconds=390)
    assert dispatcher._silent_minutes(job, at) == pytest.approx(6.5)
    job.reported_at = at - timedelta(minutes=4)  # (a report since)
    assert dispatcher._silent_minutes(job, at) is None
    job.reported_at = start - timedelta(hours=1)
    job.status = "pausing"
    assert dispatcher._silent_minutes(job, at) is None
    job.status = "running"
    # Its run started anew (pending, restarted by the platform): timed from then, until it reports.
    dispatcher._run_started["ft-a"] = at - timedelta(minutes=3)
    assert dispatcher._silent_minutes(job, at) is None
    assert dispatcher._silent_minutes(job, at + timedelta(minutes=2)) == pytest.approx(5)
    job.reported_at = at - timedelta(minutes=2)
    assert dispatcher._silent_minutes(job, at) is None and "ft-a" not in dispatcher._run_started
    job.reported_at = start - timedelta(hours=1)
    # Away for 2 minutes: the watch starts again.
    dispatcher._watch(at + timedelta(minutes=2))
    assert dispatcher._silent_minutes(job, at + timedelta(minutes=6)) is None
    assert dispatcher._silent_minutes(job, at + timedelta(minutes=7)) == pytest.approx(5)
    # A job's own stall_minutes, first.
    job.spec = {"stall_minutes": 8}
    assert dispatcher._silent_minutes(job, at + timedelta(minutes=9)) is None
    assert dispatcher._silent_minutes(job, at + timedelta(minutes=10)) == pytest.approx(8)
    dispatcher.settings = Settings(stall_minutes=0, webhooks_enabled=False)
    assert dispatcher._silent_minutes(job, at + timedelta(minutes=10)) == pytest.approx(8)
    job.spec = {}
    assert dispatcher._silent_minutes(job, at + timedelta(hours=9)) is None


def test_cancel_running_job_stops_its_processes(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    job_id = submit(api, dataset, "slow")
    api.wait_for(job_id, lambda j: j["status"] == "running" and j["progress"]["step"] >= 2)
    pid = _runner_pid(api, job_id)
    with api.client() as http:
        response = http.post(f"/jobs/{job_id}/cancel")
    assert response.status_code == 200
    assert response.json()["status"] in ("cancelling", "cancelled")
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "cancelled"
    assert _gone(pid)
    # The worker got SIGTERM (not SIGKILL): it saved its state on the way out.
    assert (Path(job["output_uri"]) / "checkpoint.json").exists()


def test_pause_stops_the_workers_and_resume_goes_on_from_the_checkpoint(  # type: ignore[no-untyped-def]
    live_api, dataset: Path
) -> None:
    api = live_api()
    job_id = submit(api, dataset, "succeed", steps="30", interval="0.1", resume="checkpoint")
    api.wait_for(job_id, lambda j: j["status"] == "running" and j["progress"]["step"] >= 3)
    pid = _runner_pid(api, job_id)
    with api.client() as http:
        response = http.post(f"/jobs/{job_id}/pause")
    assert response.status_code == 200 and response.json()["status"] in ("pausing", "paused"), response.text
    paused = api.wait_for(job_id, lambda j: j["status"] == "paused")
    assert _gone(pid) and paused["pauses"] == 1 and paused["finished_at"] is None
    assert paused["status_message"].startswith("Paused: the workers stopped")
    # The worker got SIGTERM: it saved its step on the way out.
    saved = json.loads((Path(paused["output_uri"]) / "checkpoint.json").read_text())["step"]
    assert 3 <= saved <= paused["progress"]["step"] + 1
    # Paused, it holds nothing: its usage stands still.
    time.sleep(0.5)
    with api.client() as http:
        still = http.get(f"/jobs/{job_id}").json()
    assert still["status"] == "paused" and still["usage"] == paused["usage"]

    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/resume").json()["status"] == "queued"
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "succeeded", job
    # Launched anew (not a restart), and it went on from its checkpoint instead of from the start.
    assert job["restarts"] == 0 and job["pauses"] == 1
    history = events(api, job_id)
    assert [e["type"] for e in history].count("launch") == 2
    steps = [e["step"] for e in history if e["type"] == "metrics"]
    assert sorted(set(steps)) == list(range(1, 31))
    assert f"resumed from the checkpoint at step {saved}" in log_text(api, job_id)
    moves = timed_moves(history)
    assert [status for status, _ in moves] == [
        *("queued", "starting", "running", "pausing", "paused"),
        *("queued", "starting", "running", "succeeded"),
    ]
    # It held its process from each launch until it let it go: paused, then at its end.
    launches = [datetime.fromisoformat(e["created_at"]) for e in history if e["type"] == "launch"]
    held = (moves[4][1] - launches[0]) + (moves[8][1] - launches[1])
    assert job["usage"]["held_seconds"] == pytest.approx(held.total_seconds(), abs=0.05)


def test_a_failed_job_resumed_goes_on_from_the_checkpoint_its_failed_run_saved(  # type: ignore[no-untyped-def]
    live_api, dataset: Path
) -> None:
    """A run that dies (its checkpoint saved at step 3) fails the job; its owner resumes it: the run's
    leftovers are removed (else its launch would adopt the run that ended, and fail again), a new one goes
    on from step 3 and succeeds. What it held counts both runs, not the time it lay failed, in its usage
    and in GET /usage alike."""
    api = live_api()
    job_id = submit(api, dataset, "crash_once", steps="6", resume="checkpoint")
    failed = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert failed["status"] == "failed" and failed["error"]["code"] == "worker_failed", failed
    assert "crashing at step 3" in failed["error"]["message"]
    assert failed["checkpoint_uri"].endswith("checkpoint.json")
    time.sleep(2)  # (lying failed holds nothing)
    with api.client() as http:
        resumed = http.post(f"/jobs/{job_id}/resume").json()
    assert resumed["status"] == "queued" and resumed["retries"] == 1 and resumed["error"] is None
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "succeeded" and job["error"] is None, job
    assert (job["retries"], job["restarts"], job["pauses"], job["progress"]["step"]) == (1, 0, 0, 6)
    history = events(api, job_id)
    steps = [e["step"] for e in history if e["type"] == "metrics"]
    assert steps == [1, 2, 3, 4, 5, 6]  # (it went on from step 3)
    assert "resumed from the checkpoint at step 3" in log_text(api, job_id)
    moves = timed_moves(history)
    assert [status for status, _ in moves] == [
        *("queued", "starting", "running", "failed"),
        *("queued", "starting", "running", "succeeded"),
    ]
    # It held its process from each launch until the run ended (the job's own times: its events' come a
    # moment after them on a busy machine), not while it lay failed.
    launches = [datetime.fromisoformat(e["created_at"]) for e in history if e["type"] == "launch"]
    first = (datetime.fromisoformat(failed["finished_at"]) - launches[0]).total_seconds()
    assert failed["usage"]["held_seconds"] == pytest.approx(first, abs=0.05)
    held = first + (datetime.fromisoformat(job["finished_at"]) - launches[1]).total_seconds()
    assert job["usage"]["held_seconds"] == pytest.approx(held, abs=0.05)
    assert (moves[4][1] - moves[3][1]).total_seconds() >= 2  # (what it lay failed)
    with api.client() as http:
        report = http.get("/usage").json()["data"]
    assert report[0]["chip_hours"] == pytest.approx(held / 3600, abs=1e-4)  # (rounded to 4 places)


def test_a_resumed_job_has_local_restarts_of_its_own(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    """TPUTUNE_LOCAL_MAX_RESTARTS counts a run's restarts: a job that failed as they ran out, resumed, is
    restarted again after a preemption (as a new JobSet would be), not failed at its first."""
    api = live_api(local_max_restarts=1)
    job_id = submit(api, dataset, "preempt_n", preempts="3", steps="3")
    failed = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert failed["status"] == "failed" and failed["error"]["code"] == "too_many_restarts", failed
    assert failed["restarts"] == 1 and failed["error"]["message"].startswith(
        "The workers were preempted 2 times"
    )
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/resume").json()["status"] == "queued"
    done = api.wait_for(job_id, lambda j: j["status"] in FINAL and j["retries"] == 1)
    assert done["status"] == "succeeded" and done["restarts"] == 2, done  # (its third run preempted too)


def test_a_pause_outlives_an_api_restart_and_a_worker_that_will_not_stop(  # type: ignore[no-untyped-def]
    live_api, dataset: Path
) -> None:
    """The API (and its dispatcher) goes away while a job is pausing, its worker deaf to SIGTERM: the next
    one stops the run all the same (SIGKILL past the grace), and the job ends paused with nothing left."""
    api = live_api(cancel_grace_seconds=1.0)
    job_id = submit(api, dataset, "hang")
    api.wait_for(job_id, lambda j: j["status"] == "running")
    pid = _runner_pid(api, job_id)
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/pause").json()["status"] == "pausing"
    api.restart()
    assert not _gone(pid)  # (it ignored the SIGTERM)
    job = api.wait_for(job_id, lambda j: j["status"] != "pausing", timeout=20)
    assert job["status"] == "paused" and job["pauses"] == 1, job
    assert _gone(pid)
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelled"


def test_cancel_hanging_worker_kills_after_grace(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api(cancel_grace_seconds=1.0)
    job_id = submit(api, dataset, "hang")
    api.wait_for(job_id, lambda j: j["status"] == "running")
    pid = _runner_pid(api, job_id)
    started = time.monotonic()
    with api.client() as http:
        http.post(f"/jobs/{job_id}/cancel")
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL, timeout=20)
    assert job["status"] == "cancelled"
    assert time.monotonic() - started >= 1.0
    assert _gone(pid)


def test_api_restart_adopts_live_worker(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    job_id = submit(api, dataset, "succeed", steps="40", interval="0.05")
    api.wait_for(job_id, lambda j: j["status"] == "running")
    pid = _runner_pid(api, job_id)
    api.stop()
    time.sleep(0.5)
    assert not _gone(pid)  # the worker outlives the API
    api.start()
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "succeeded", job
    assert job["progress"]["step"] == 40
    assert len([e for e in events(api, job_id) if e["type"] == "launch"]) == 1


def test_api_restart_fails_job_whose_worker_died(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    job_id = submit(api, dataset, "slow")
    api.wait_for(job_id, lambda j: j["status"] == "running")
    pid = _runner_pid(api, job_id)
    api.stop()
    os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    api.start()
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "failed"
    assert job["error"]["code"] == "worker_lost"


def test_crash_between_launch_and_record_adopts(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    """A run that started but was never recorded (the API died in between) is adopted, not doubled."""
    from sqlmodel import Session, select

    from api.executors.local import LocalExecutor
    from api.jobs import create_job, new_job_token, transition
    from api.models import Job
    from api.states import JobStatus
    from worker.config import JobSpec

    api = live_api(dispatcher_enabled=False)
    settings = api.settings
    engine = api.server.config.app.state.engine  # type: ignore[union-attr]
    spec = JobSpec(
        name="x", model="tiny", dataset_uri=str(dataset), metadata={"fake": "succeed", "steps": "30"}
    )
    with Session(engine, expire_on_commit=False) as session:
        job, _ = create_job(session, spec, settings, "default")
        transition(session, job, JobStatus.starting)
        token, job.token_hash = new_job_token()
        session.add(job)
        session.commit()
        LocalExecutor(settings).launch(job, token)  # ...and the API "crashes" before recording it
    api.stop()
    api.settings = settings.model_copy(update={"dispatcher_enabled": True})
    api.start()
    job_view = api.wait_for(job.id, lambda j: j["status"] in FINAL)
    assert job_view["status"] == "succeeded", job_view
    launches = [e for e in events(api, job.id) if e["type"] == "launch"]
    assert len(launches) == 1 and "adopted" in launches[0]["message"]
    with Session(engine) as session:
        assert session.exec(select(Job).where(Job.id == job.id)).one().restarts == 0


def test_preempted_worker_restarts_and_resumes(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    job_id = submit(api, dataset, "preempt_once")
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "succeeded", job
    assert job["restarts"] == 1
    assert [e["type"] for e in events(api, job_id)].count("restart") == 1


def test_preemption_budget(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api(local_max_restarts=0)
    job_id = submit(api, dataset, "preempt_once")
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL)
    assert job["status"] == "failed" and job["error"]["code"] == "too_many_restarts"


def test_tenant_cap_keeps_extra_jobs_queued(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api(tenant_max_active_jobs=1)
    first = submit(api, dataset, "slow")
    second = submit(api, dataset, "succeed")
    api.wait_for(first, lambda j: j["status"] == "running")
    waiting = api.wait_for(second, lambda j: "limit 1" in (j["status_message"] or ""))
    assert waiting["status"] == "queued"
    with api.client() as http:
        http.post(f"/jobs/{first}/cancel")
    assert api.wait_for(second, lambda j: j["status"] in FINAL)["status"] == "succeeded"


def test_tenant_chip_cap_queues_what_does_not_fit_and_refuses_what_never_can(  # type: ignore[no-untyped-def]
    live_api, dataset: Path
) -> None:
    api = live_api(tenant_max_active_chips=2, max_local_processes=4)

    def post(fake: str, processes: int) -> httpx.Response:
        body = {
            "name": f"fake-{fake}",
            "model": "tiny",
            "dataset_uri": str(dataset),
            "resources": {"processes": processes},
            "hyperparameters": {"batch_size": 6},
            "metadata": {"fake": fake},
        }
        with api.client() as http:
            return http.post("/jobs", json=body)

    never = post("succeed", 3)
    assert never.status_code == 422 and never.json()["error"]["code"] == "over_tenant_chip_limit"
    assert "needs 3 local processes" in never.json()["error"]["message"]
    big, small = post("slow", 2).json()["id"], post("succeed", 1).json()["id"]
    api.wait_for(big, lambda j: j["status"] == "running")
    waiting = api.wait_for(small, lambda j: "this job needs 1" in (j["status_message"] or ""))
    assert waiting["status"] == "queued"
    assert (
        waiting["status_message"]
        == "Waiting: your team's running jobs hold 2 of its 2 processes; this job needs 1."
    )
    with api.client() as http:
        http.post(f"/jobs/{big}/cancel")
    assert api.wait_for(small, lambda j: j["status"] in FINAL)["status"] == "succeeded"
