"""The `tputune` CLI against a running API (the fake worker at the process boundary)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session, select

from api.cli import (
    data_line,
    exported_note,
    gguf_line,
    hf_line,
    interruptions_line,
    main,
    parser,
    progress_line,
    queue_place,
    rewards_line,
    usage_line,
)
from api.client import Client
from api.jobs import transition
from api.models import Job, utcnow
from api.settings import Settings
from api.states import JobStatus
from worker.config import GGUF_TYPES

ROOT = Path(__file__).resolve().parent.parent


def run(api, capsys, *argv: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    code = main(["--api-url", api.url, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_submit_follow_status_events_checkpoints(live_api, dataset: Path, capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: cli\nmodel: tiny\ndataset_uri: {dataset}\nmetadata:\n  fake: succeed\n  steps: '8'\n"
    )
    code, out, _ = run(
        api,
        capsys,
        "submit",
        str(spec),
        "--max-steps",
        "8",
        "--set",
        "hyperparameters.seed=7",
        "--follow",
        "--interval",
        "0.2",
    )
    assert code == 0, out
    job_id = out.split()[1]
    assert "100.0% step 8/8" in out and out.strip().endswith(f"{job_id} succeeded")
    job = api.client().get(f"/jobs/{job_id}").json()
    assert job["spec"]["hyperparameters"] == {**job["spec"]["hyperparameters"], "seed": 7, "max_steps": 8}
    code, out, _ = run(api, capsys, "status", job_id)
    assert code == 0 and "succeeded" in out and "loss 0.3750" in out
    assert f"  {usage_line(job)}\n" in out and "held 1 process for " in out
    code, out, _ = run(api, capsys, "status", job_id, "--json")
    assert json.loads(out)["id"] == job_id
    code, out, _ = run(api, capsys, "list")
    assert job_id in out and "100%" in out
    code, out, _ = run(api, capsys, "events", job_id, "--follow")
    assert code == 0 and "queued → starting" in out and "succeeded" in out
    code, out, _ = run(api, capsys, "checkpoints", job_id)
    assert "step       8" in out and "final.json" in out
    code, out, _ = run(api, capsys, "logs", job_id)
    assert "fake worker" in out
    code, _, err = run(api, capsys, "logs", job_id, "--previous")  # (a local log file keeps every run's)
    assert code == 3 and "drop previous. (previous_not_supported)" in err
    # Another from its weights; the API's sentence when it cannot.
    code, out, _ = run(
        api,
        capsys,
        "submit",
        str(spec),
        "--from-job",
        job_id,
        "--method",
        "lora",
        "--export-hf",
        "--export-gguf",
        "q8_0",
    )
    more = api.client().get(f"/jobs/{out.split()[1]}").json()
    assert code == 0 and more["spec"]["from_job"] == job_id
    assert more["spec"]["method"] == {
        "type": "lora",
        "objective": "sft",
        "dpo_beta": None,
        "rpo_alpha": None,
        "dpo_normalize_logratios_by_length": False,
        "simpo_gamma": None,
        "lora_rank": 8,
        "export_merged": False,
        "export_hf": True,
        "export_gguf": "q8_0",
    }
    assert more["spec"]["base_checkpoint_uri"] == f"{job['output_uri']}/final/params"
    # Preference fine-tuning; `status` names it beside the method.
    code, out, _ = run(api, capsys, "submit", str(spec), "--objective", "dpo", "--dpo-beta", "0.3")
    dpo = api.client().get(f"/jobs/{out.split()[1]}").json()
    assert (
        code == 0 and dpo["spec"]["method"]["objective"] == "dpo" and dpo["spec"]["method"]["dpo_beta"] == 0.3
    )
    code, out, _ = run(api, capsys, "status", dpo["id"])
    assert code == 0 and f"{dpo['id']}  {dpo['name']}  {dpo['model']} (full, dpo)  " in out
    code, out, _ = run(
        api, capsys, "submit", str(spec), "--objective", "dpo", "--set", "method.simpo_gamma=1"
    )
    simpo = api.client().get(f"/jobs/{out.split()[1]}").json()
    assert code == 0 and simpo["spec"]["method"]["simpo_gamma"] == 1
    code, out, _ = run(api, capsys, "status", simpo["id"])
    assert code == 0 and f"{simpo['model']} (full, simpo)  " in out
    # A GGUF type the spec does not take: the API's sentence names those it does (the CLI does not check).
    code, _, err = run(api, capsys, "submit", str(spec), "--export-gguf", "q4_k_m")
    assert code == 3 and all(f"'{kind}'" in err for kind in GGUF_TYPES), err
    assert all(kind in _submit_help() for kind in GGUF_TYPES)
    code, _, err = run(api, capsys, "submit", str(spec), "--from-job", "ft-nowhere")
    assert code == 3 and "there is no job ft-nowhere of your team. (from_job_not_found)" in err
    code, _, err = run(api, capsys, "submit", str(spec), "--from-job", job_id, "--from-step", "3")
    assert code == 3 and f"job {job_id} saved no checkpoint at step 3" in err
    assert "(from_job_checkpoint_not_found)" in err


def test_watch_exit_codes_and_cancel(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    code, out, _ = run(
        api,
        capsys,
        "submit",
        "--name",
        "f",
        "--model",
        "tiny",
        "--dataset",
        str(dataset),
        "--set",
        "metadata.fake=fail",
    )
    failed_id = out.split()[1]
    code, out, _ = run(api, capsys, "watch", failed_id, "--interval", "0.2")
    assert code == 1 and "The loss became NaN at step 0. (loss_not_finite)" in out

    code, out, _ = run(
        api,
        capsys,
        "submit",
        "--name",
        "s",
        "--model",
        "tiny",
        "--dataset",
        str(dataset),
        "--set",
        "metadata.fake=slow",
    )
    slow_id = out.split()[1]
    api.wait_for(slow_id, lambda j: j["status"] == "running")
    threading.Timer(0.5, lambda: main(["--api-url", api.url, "cancel", slow_id])).start()
    started = time.monotonic()
    code, out, _ = run(api, capsys, "watch", slow_id, "--interval", "0.2")
    assert code == 2 and out.strip().endswith(f"{slow_id} cancelled")
    assert time.monotonic() - started < 20


def test_watch_waits_out_a_pause(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A paused job has not ended: `watch` says it is paused, and goes on once it is resumed."""
    api = live_api()
    code, out, _ = run(api, capsys, "submit", "--name", "a", "--model", "tiny", "--dataset", str(dataset),
                       "--set", "metadata.fake=succeed", "--set", 'metadata.steps="20"',
                       "--set", 'metadata.interval="0.05"')  # fmt: skip
    job_id = out.split()[1]
    assert run(api, capsys, "pause", job_id)[0] == 0
    with api.client() as http:
        deadline = time.monotonic() + 20
        while http.get(f"/jobs/{job_id}").json()["status"] != "paused":
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def resume() -> None:
        with api.client() as http:
            http.post(f"/jobs/{job_id}/resume")

    later = threading.Timer(1.0, resume)
    later.start()
    try:
        code, out, _ = run(api, capsys, "watch", job_id, "--interval", "0.2")
    finally:
        later.join()
    lines = out.splitlines()
    assert code == 0 and lines[-1] == f"{job_id} succeeded"
    assert lines[0].startswith("paused: Paused"), lines
    assert any(line.startswith("[") and line.endswith("succeeded") for line in lines)


def test_watch_says_why_a_job_waits_until_it_runs(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    api = live_api(tenant_max_active_jobs=1)
    code, out, _ = run(api, capsys, "submit", "--name", "a", "--model", "tiny", "--dataset", str(dataset),
                       "--set", "metadata.fake=slow")  # fmt: skip
    running = out.split()[1]
    code, out, _ = run(api, capsys, "submit", "--name", "b", "--model", "tiny", "--dataset", str(dataset),
                       "--set", "metadata.fake=succeed")  # fmt: skip
    waiting = out.split()[1]
    with api.client() as http:
        deadline = time.monotonic() + 20
        while "limit 1" not in (http.get(f"/jobs/{waiting}").json()["status_message"] or ""):
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def cancel_the_running_one() -> None:
        with api.client() as http:
            http.post(f"/jobs/{running}/cancel")

    cancel = threading.Timer(1.0, cancel_the_running_one)
    cancel.start()
    try:
        code, out, _ = run(api, capsys, "watch", waiting, "--interval", "0.2")
    finally:
        cancel.join()
    lines = out.splitlines()
    assert code == 0 and lines[-1] == f"{waiting} succeeded"
    assert lines[0] == "queued (1st in the queue): Waiting: 1 job of your team is running (limit 1)."
    assert any(line.startswith("[") and line.endswith("succeeded") for line in lines)


def test_api_errors_are_sentences(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    code, _out, err = run(
        api, capsys, "submit", "--name", "x", "--model", "gemma3-9b-pt", "--dataset", str(dataset)
    )
    assert code == 3
    assert err.startswith("error: model: unknown model 'gemma3-9b-pt'") and "(unknown_model)" in err
    assert "Traceback" not in err
    code, _, err = run(api, capsys, "status", "ft-missing")
    assert code == 3 and "No job with id 'ft-missing'" in err
    code, _, err = main(["--api-url", "http://127.0.0.1:9", "list"]), *capsys.readouterr()
    assert code == 3 and "Cannot reach the tputune API" in err


def _submit(api, capsys, dataset: Path, fake: str = "succeed") -> str:  # type: ignore[no-untyped-def]
    flags = ("--name", f"{fake}-job", "--model", "tiny", "--dataset", str(dataset))
    code, out, _ = run(api, capsys, "submit", *flags, "--set", f"metadata.fake={fake}")
    assert code == 0, out
    return out.split()[1]


def test_a_failed_job_says_how_it_goes_on(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`tputune status` of a failed job says how to resume it; `tputune resume` queues it again."""
    api = live_api()
    job_id = _submit(api, capsys, dataset, "crash_once")  # (its first run dies after a checkpoint)
    api.wait_for(job_id, lambda j: j["status"] == "failed")
    code, out, _ = run(api, capsys, "status", job_id)
    assert code == 0 and out.splitlines()[0].endswith("  failed"), out
    assert "(worker_failed)\n" in out
    assert f"\n  to go on from its last checkpoint: tputune resume {job_id}\n" in out
    assert run(api, capsys, "resume", job_id)[:2] == (0, f"{job_id} queued\n")
    api.wait_for(job_id, lambda j: j["status"] == "succeeded")
    code, out, _ = run(api, capsys, "status", job_id)
    assert "  1 retry (each resumed from the latest checkpoint)\n" in out and "tputune resume" not in out


def test_pause_and_resume_a_queued_job(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Nothing launched: paused at once, and queued again; asking twice changes nothing."""
    api = live_api(dispatcher_enabled=False)
    job_id = _submit(api, capsys, dataset)
    assert run(api, capsys, "pause", job_id) == (0, f"{job_id} paused\n", "")
    assert run(api, capsys, "pause", job_id) == (0, f"{job_id} paused\n", "")  # (already: unchanged)
    code, out, _ = run(api, capsys, "status", job_id)
    assert code == 0 and out.splitlines()[0].endswith("  paused")
    assert "  1 pause (each resumed from the latest checkpoint)\n" in out
    assert "Paused before it started; resume it to queue it again." in out
    code, out, _ = run(api, capsys, "list", "--status", "paused")
    assert code == 0 and [line.split()[:2] for line in out.splitlines()[1:]] == [[job_id, "paused"]]
    assert run(api, capsys, "resume", job_id) == (0, f"{job_id} queued\n", "")
    assert run(api, capsys, "resume", job_id) == (0, f"{job_id} queued\n", "")  # (already: unchanged)
    job = api.client().get(f"/jobs/{job_id}").json()
    assert (job["status"], job["pauses"]) == ("queued", 1)

    # Paused again, then cancelled: neither can be asked of it any more, and each says why.
    assert run(api, capsys, "pause", job_id)[1] == f"{job_id} paused\n"
    assert run(api, capsys, "cancel", job_id)[1] == f"{job_id} cancelled\n"
    code, out, err = run(api, capsys, "pause", job_id)
    assert (code, out) == (3, "")
    assert err == (
        f"error: Job {job_id} already cancelled; only queued, starting or running jobs can be paused. "
        "(job_not_pausable)\n"
    )
    code, out, err = run(api, capsys, "resume", job_id)
    assert (code, out) == (3, "")
    assert err == (
        f"error: Job {job_id} is cancelled; only a paused or failed job can be resumed. (job_not_paused)\n"
    )
    code, _, err = run(api, capsys, "pause", "ft-missing")
    assert code == 3 and "No job with id 'ft-missing'" in err


def test_a_pausing_job_cannot_be_resumed_yet(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A launched job is `pausing` until its workers stopped (here: never, the dispatcher is off)."""
    api = live_api(dispatcher_enabled=False)
    job_id = _submit(api, capsys, dataset)
    engine = api.server.config.app.state.engine
    with Session(engine) as session:  # (as the dispatcher leaves a job it launched)
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        transition(session, job, JobStatus.starting, launched_at=utcnow())
        session.commit()
    assert run(api, capsys, "pause", job_id) == (0, f"{job_id} pausing\n", "")
    code, out, err = run(api, capsys, "resume", job_id)
    assert (code, out) == (3, "")
    assert err == (
        f"error: Job {job_id} is still pausing; only a paused or failed job can be resumed; resume it once "
        "it is paused. (job_not_paused)\n"
    )
    assert run(api, capsys, "cancel", job_id) == (0, f"{job_id} cancelling\n", "")


def test_resume_over_the_queued_jobs_limit_is_refused(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    api = live_api(dispatcher_enabled=False, tenant_max_queued_jobs=1)
    paused = _submit(api, capsys, dataset)
    assert run(api, capsys, "pause", paused)[1] == f"{paused} paused\n"
    _submit(api, capsys, dataset)  # (the queue has room again: a paused job does not wait in it)
    code, out, err = run(api, capsys, "resume", paused)
    assert (code, out) == (3, "")
    assert "(too_many_queued_jobs)" in err and "has 1 jobs queued and may have 1: resume this job" in err
    assert api.client().get(f"/jobs/{paused}").json()["status"] == "paused"


def test_pause_stops_a_running_job_and_resume_runs_it_again(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    job_id = _submit(api, capsys, dataset, fake="slow")
    api.wait_for(job_id, lambda j: j["status"] == "running")
    assert run(api, capsys, "pause", job_id) == (0, f"{job_id} pausing\n", "")
    api.wait_for(job_id, lambda j: j["status"] == "paused")
    code, out, _ = run(api, capsys, "status", job_id)
    assert code == 0 and out.splitlines()[0].endswith("  paused") and "  1 pause (" in out
    assert run(api, capsys, "resume", job_id) == (0, f"{job_id} queued\n", "")
    job = api.wait_for(job_id, lambda j: j["status"] == "running")
    assert job["pauses"] == 1
    assert run(api, capsys, "cancel", job_id) == (0, f"{job_id} cancelling\n", "")
    code, out, _ = run(api, capsys, "watch", job_id, "--interval", "0.2")
    assert code == 2 and out.strip().endswith(f"{job_id} cancelled")


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (
            {
                "progress": {"fraction": None, "step": 0, "total_steps": None, "eta_seconds": None},
                "metrics": {"loss": None, "eval_loss": None, "tokens_per_second": None},
                "status": "queued",
            },
            "[........................]   0.0% step 0/? loss - eval - - tok/s eta - queued",
        ),
        (
            {
                "progress": {"fraction": 0.5, "step": 50, "total_steps": 100, "eta_seconds": 95},
                "metrics": {"loss": 2.5, "eval_loss": 2.75, "tokens_per_second": 15321.4},
                "status": "running",
            },
            "[############............]  50.0% step 50/100 loss 2.5000 eval 2.7500 "
            "15,321 tok/s eta 1m35s running",
        ),
        (
            {
                "progress": {"fraction": 0.5, "step": 50, "total_steps": 100, "eta_seconds": 95},
                "metrics": {
                    "loss": 2.5,
                    "eval_loss": 2.75,
                    "accuracy": 0.4125,
                    "eval_accuracy": 0.38,
                    "tokens_per_second": 15321.4,
                },
                "status": "running",
            },
            "[############............]  50.0% step 50/100 loss 2.5000 eval 2.7500 acc 41.2% "
            "eval-acc 38.0% 15,321 tok/s eta 1m35s running",
        ),
    ],
)
def test_progress_line(job: dict, expected: str) -> None:
    assert progress_line(job) == expected


@pytest.mark.parametrize(
    ("exported", "expected"),
    [
        (None, ""),  # (not succeeded)
        (40, ""),  # (its last step's weights)
        (24, " (the weights of step 24, of the lowest eval loss)"),
        (0, " (the weights of step 0, of the lowest eval loss)"),  # (the base model's)
    ],
)
def test_exported_note(exported: int | None, expected: str) -> None:
    assert exported_note({"exported_step": exported, "progress": {"step": 40}}) == expected


def _submit_help() -> str:
    """`tputune submit --help`."""
    subcommands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices["submit"].format_help()


def test_gguf_line() -> None:
    assert gguf_line({"exports": None}) is None  # (not succeeded)
    assert gguf_line({"exports": {"hf": "/o/final/hf", "gguf": None}}) is None
    exports = {"gguf": "/o/final/model-q8_0.gguf"}
    assert gguf_line({"exports": exports}) == "GGUF (llama.cpp, ollama): /o/final/model-q8_0.gguf"


def test_hf_line() -> None:
    assert hf_line({"exports": None}) is None  # (not succeeded)
    assert hf_line({"exports": {"uri": "/o/final", "params": "/o/final/params", "hf": None}}) is None
    full = {"hf": "/o/final/hf", "hf_adapter": None}
    assert hf_line({"exports": full}) == "Hugging Face model: /o/final/hf"
    assert hf_line({"exports": {"hf": "/o/final/hf", "hf_adapter": "/o/final/hf_adapter"}}) == (
        "Hugging Face model: /o/final/hf (adapter for PEFT: /o/final/hf_adapter)"
    )


@pytest.mark.parametrize(
    ("position", "place"),
    [
        *[(None, ""), (1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th"), (12, "12th")],
        *[(13, "13th"), (21, "21st"), (22, "22nd"), (101, "101st"), (111, "111th"), (1003, "1003rd")],
    ],
)
def test_queue_place(position: int | None, place: str) -> None:
    expected = f" ({place} in the queue)" if place else ""
    assert queue_place({"status": "queued", "queue_position": position}) == expected


@pytest.mark.parametrize(
    ("restarts", "preemptions", "pauses", "retries", "expected"),
    [
        (0, 0, 0, 0, None),
        (1, 0, 0, 0, "1 restart (each resumed from the latest checkpoint)"),
        (0, 3, 0, 0, "3 preemptions (each resumed from the latest checkpoint)"),
        (2, 1, 0, 0, "2 restarts, 1 preemption (each resumed from the latest checkpoint)"),
        (0, 0, 1, 0, "1 pause (each resumed from the latest checkpoint)"),
        (0, 0, 0, 1, "1 retry (each resumed from the latest checkpoint)"),
        (
            1,
            2,
            3,
            2,
            "1 restart, 2 preemptions, 3 pauses, 2 retries (each resumed from the latest checkpoint)",
        ),
    ],
)
def test_interruptions_line(
    restarts: int, preemptions: int, pauses: int, retries: int, expected: str | None
) -> None:
    job = {"restarts": restarts, "preemptions": preemptions, "pauses": pauses, "retries": retries}
    assert interruptions_line(job) == expected
    if not pauses and not retries:  # (a server from before `pauses` and `retries`)
        assert interruptions_line({"restarts": restarts, "preemptions": preemptions}) == expected


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (None, None),  # (a server from before `usage`)
        ({"chips": 8, "chip_unit": "TPU chips", "held_seconds": 0.0, "chip_hours": 0.0}, None),
        (
            {"chips": 8, "chip_unit": "TPU chips", "held_seconds": 3720.4, "chip_hours": 8.2676},
            "held 8 TPU chips for 1h02m: 8.268 chip-hours",
        ),
        (
            {"chips": 1, "chip_unit": "processes", "held_seconds": 2.5, "chip_hours": 0.0007},
            "held 1 process for 2s: 0.0007 chip-hours",
        ),
        (
            {"chips": 256, "chip_unit": "TPU chips", "held_seconds": 90_000, "chip_hours": 6400.0},
            "held 256 TPU chips for 25h00m: 6,400 chip-hours",
        ),
    ],
)
def test_usage_line(usage: dict[str, Any] | None, expected: str | None) -> None:
    assert usage_line({"usage": usage}) == expected


def test_keys_commands(live_api, capsys) -> None:  # type: ignore[no-untyped-def]
    api = live_api(admin_key="the-admin-key-123")
    code, out, _ = run(
        api, capsys, "--api-key", "the-admin-key-123", "keys", "create", "--tenant", "t1", "--name", "ci"
    )
    assert code == 0
    key_id, key = out.split()[1], out.splitlines()[-1]
    assert key.startswith("tpt_")
    code, out, _ = run(api, capsys, "--api-key", key, "list")
    assert code == 0
    code, out, _ = run(
        api, capsys, "--api-key", "the-admin-key-123", "keys", "create", "--tenant", "ops", "--name", "alice",
        "--admin",
    )  # fmt: skip
    assert code == 0 and out.startswith("created an admin key key_")
    code, out, _ = run(api, capsys, "--api-key", out.splitlines()[-1], "keys", "list")  # (an admin key's)
    assert code == 0 and "ROLE" in out.splitlines()[0]
    roles = {line.split()[-1]: line.split()[3] for line in out.splitlines()[1:]}
    assert roles == {"ci": "member", "alice": "admin"}
    assert key_id in out and "active" in out and key not in out
    assert "LAST USED" in out.splitlines()[0]
    used = next(line for line in out.splitlines() if key_id in line)
    assert time.strftime("%Y-%m-%d", time.gmtime()) in used and "never" not in used  # (its `list` above)
    code, out, _ = run(
        api, capsys, "--api-key", "the-admin-key-123", "keys", "create", "--tenant", "ops", "--name", "audit",
        "--admin", "--read-only",
    )  # fmt: skip
    assert code == 0 and out.startswith("created an auditor key key_")
    code, out, err = run(api, capsys, "--api-key", out.splitlines()[-1], "keys", "revoke", key_id)
    assert code == 3 and "(read_only_key)" in err
    code, out, _ = run(api, capsys, "--api-key", "the-admin-key-123", "keys", "list", "--tenant", "ops")
    assert [line.split()[-1] for line in out.splitlines()[1:]] == ["alice", "audit"]
    assert out.splitlines()[-1].split()[3] == "auditor"
    code, out, _ = run(
        api, capsys, "--api-key", "the-admin-key-123", "keys", "create", "--tenant", "t1", "--name", "month",
        "--expires-in-days", "30",
    )  # fmt: skip
    expiry = time.strftime("%Y-%m-%d", time.gmtime(time.time() + 30 * 86400))
    assert code == 0 and f"expires {expiry}" in out.splitlines()[0]
    code, out, _ = run(api, capsys, "--api-key", "the-admin-key-123", "keys", "list")
    line = next(line for line in out.splitlines() if "month" in line)
    assert f"expires {expiry}" in line and "never" in line
    month_id = line.split()[0]
    code, out, _ = run(api, capsys, "--api-key", "the-admin-key-123", "keys", "rotate", month_id)
    assert code == 0 and f"{month_id} stops working at" in out.splitlines()[0]
    assert f"expires {expiry}" in out.splitlines()[0]  # (the old key's lifetime)
    rotated = out.splitlines()[-1]
    assert rotated.startswith("tpt_")
    code, _, err = run(api, capsys, "--api-key", rotated, "list")
    assert code == 0 and "warning" not in err  # (30 days left)
    # A key that expires within a week: every command warns, once.
    code, out, _ = run(
        api, capsys, "--api-key", "the-admin-key-123", "keys", "create", "--tenant", "t1", "--name", "soon",
        "--expires-in-days", "3",
    )  # fmt: skip
    soon = out.splitlines()[-1]
    code, _, err = run(api, capsys, "--api-key", soon, "list")
    assert code == 0 and err.count("warning:") == 1, err
    assert "warning: this API key expires at " in err and "(in 2 days): ask your admin to rotate it" in err
    run(api, capsys, "--api-key", "the-admin-key-123", "keys", "revoke", key_id)
    code, _, err = run(api, capsys, "--api-key", key, "list")
    assert code == 3 and "(invalid_api_key)" in err

    # The audit log: newest first, who did it, what changed; a team's key sees its own team's.
    code, out, _ = run(api, capsys, "--api-key", "the-admin-key-123", "audit")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[2:5] == ["key.revoked", "t1", key_id]
    assert lines[0].endswith("by the admin (default)") and lines[1].strip().startswith(
        'name "ci"; prefix "tpt_'
    )
    actions = [line.split()[2] for line in lines if not line.startswith(" ")]
    assert actions == [
        "key.revoked",
        "key.created",
        "key.rotated",
        "key.created",
        "key.created",
        "key.created",
        "key.created",
    ]
    code, out, _ = run(api, capsys, "--api-key", "the-admin-key-123", "audit", "--action", "key.rotated")
    assert f"key.rotated            t1               {month_id}" in out and "new_key_id" in out
    code, out, _ = run(
        api, capsys, "--api-key", "the-admin-key-123", "audit", "--tenant", "ops", "--limit", "1"
    )
    assert [line.split()[3] for line in out.splitlines() if not line.startswith(" ")] == ["ops"]
    code, out, _ = run(api, capsys, "--api-key", soon, "audit")
    assert code == 0 and "ops" not in out and out.count("key.created") == 3
    code, _, err = run(api, capsys, "--api-key", soon, "audit", "--tenant", "ops")
    assert code != 0 and "(admin_only)" in err


def test_list_pages_and_the_admin_sees_every_tenant(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    api = live_api(admin_key="the-admin-key-123", dispatcher_enabled=False)
    admin = ("--api-key", "the-admin-key-123")
    ids = {}
    for tenant in ("t1", "t2"):
        code, out, _ = run(api, capsys, *admin, "keys", "create", "--tenant", tenant, "--name", "ci")
        key = out.splitlines()[-1]
        flags = ["--name", f"{tenant}-job", "--model", "tiny", "--dataset", str(dataset)]
        code, out, _ = run(api, capsys, "--api-key", key, "submit", *flags)
        assert code == 0, out
        ids[tenant] = out.split()[1]
    code, out, _ = run(api, capsys, *admin, "list")
    lines = out.splitlines()
    assert "TENANT" in lines[0]
    assert [line.split()[:2] for line in lines[1:]] == [[ids["t2"], "t2"], [ids["t1"], "t1"]]
    code, out, _ = run(api, capsys, *admin, "list", "--tenant", "t1")
    assert "TENANT" not in out and ids["t1"] in out and ids["t2"] not in out
    code, out, _ = run(api, capsys, *admin, "list", "--limit", "1")
    assert out.splitlines()[-1] == f"(more: --after {ids['t2']})"
    code, out, _ = run(api, capsys, *admin, "list", "--after", ids["t2"])
    assert ids["t1"] in out and ids["t2"] not in out and "(more" not in out


def test_invalid_settings_are_named_as_the_environment_names_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tputune serve` with the GKE overlay's placeholder left in (or any bad setting): exit 2 and a line
    per setting, where a pydantic traceback used to end in the field's Python name."""
    monkeypatch.setenv("TPUTUNE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TPUTUNE_K8S_OUTPUT_BASE_URI", "gs://OUTPUT_BUCKET/tputune")
    monkeypatch.setenv("TPUTUNE_PORT", "eighty")
    monkeypatch.setenv("TPUTUNE_WEBHOOK_PROXY", "proxy.corp:3128")  # (no scheme)
    assert main(["serve"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("tputune: TPUTUNE_PORT: ") and "integer" in lines[0]
    assert lines[1].startswith("tputune: TPUTUNE_WEBHOOK_PROXY: an http:// or https:// proxy URL")
    assert lines[2].startswith("tputune: TPUTUNE_K8S_OUTPUT_BASE_URI: 'OUTPUT_BUCKET' is not a Cloud")
    assert len(lines) == 3


def test_every_setting_is_in_the_readmes_table() -> None:
    """Each TPUTUNE_ setting a server reads is a row of the README's configuration table."""
    lines = (ROOT / "README.md").read_text().splitlines()
    rows = {
        name
        for line in lines
        if line.startswith("| `")
        for name in re.findall(r"`(\w+)`", line.split("|")[1])
    }
    missing = [f"TPUTUNE_{name.upper()}" for name in Settings.model_fields]
    assert [name for name in missing if name not in rows] == []


def test_tenants_commands(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    api = live_api(
        admin_key="the-admin-key-123",
        tenant_max_active_chips=8,
        tenant_budget_pauses_running=True,
        dispatcher_enabled=False,
    )
    admin = ("--api-key", "the-admin-key-123")
    code, out, _ = run(api, capsys, *admin, "keys", "create", "--tenant", "research", "--name", "ci")
    member = ("--api-key", out.splitlines()[-1])
    code, out, _ = run(api, capsys, *member, "tenants", "show")
    assert code == 0
    assert out.splitlines() == [
        "tenant research",
        "  jobs:  0 active, limit none; 0 queued, limit none",
        "  processes: 0 held, limit 8 (server)",
        "  chip-hours this month (UTC): 0.00, budget none",
        "  data:  anywhere",
    ]
    code, out, err = run(api, capsys, *member, "tenants", "set", "research", "--max-jobs", "9")
    assert code == 3 and "(admin_only)" in err
    limits = ("--max-jobs", "2", "--max-chips", "4", "--max-queued", "1", "--max-chip-hours", "100")
    code, out, _ = run(api, capsys, *admin, "tenants", "set", "research", *limits)
    assert code == 0 and out.splitlines()[1:4] == [
        "  jobs:  0 active, limit 2; 0 queued, limit 1",
        "  processes: 0 held, limit 4",
        "  chip-hours this month (UTC): 0.00, budget 100; running jobs pause at it",
    ]
    assert out.splitlines()[5].startswith(
        "  limits set by the admin at " + time.strftime("%Y-%m-%d", time.gmtime())
    )
    where = ("--data-prefix", "gs://ml-data/{tenant}/", "--data-prefix", str(dataset.parent))
    code, out, _ = run(api, capsys, *admin, "tenants", "set", "research", *where)
    assert code == 0 and out.splitlines()[4:6] == [
        f"  data:  gs://ml-data/research, {dataset.parent}",
        "         and may read gs://gemma-data",
    ]
    code, out, _ = run(api, capsys, *admin, "tenants", "set", "research", "--data-prefix", "any")
    assert code == 0 and out.splitlines()[4] == "  data:  anywhere"
    # Over the limit on queued jobs, `submit` says so.
    job = ("submit", "--name", "a", "--model", "tiny", "--dataset", str(dataset))
    assert run(api, capsys, *member, *job)[0] == 0
    code, _, err = run(api, capsys, *member, *job)
    assert code == 3 and "(too_many_queued_jobs)" in err and "has 1 jobs queued and may have 1" in err
    code, out, _ = run(api, capsys, *admin, "tenants", "set", "research", "--max-chips", "default")
    assert code == 0 and out.splitlines()[1:3] == [
        "  jobs:  0 active, limit 2; 1 queued, limit 1",
        "  processes: 0 held, limit 8 (server)",
    ]
    code, out, _ = run(api, capsys, *admin, "tenants", "set", "ops", "--max-jobs", "0")
    code, out, _ = run(api, capsys, *admin, "tenants", "set", "infra", "--max-chips", "unlimited")
    assert code == 0 and out.splitlines()[2] == "  processes: 0 held, limit unlimited"
    code, out, _ = run(api, capsys, *admin, "tenants", "list")
    assert code == 0 and out.splitlines()[0].split() == [
        "TENANT", "ACTIVE", "MAX", "JOBS", "CHIPS", "MAX", "CHIPS", "QUEUED", "MAX", "QUEUED", "CHIP-H",
        "MONTH", "BUDGET", "SET", "BY"
    ]  # fmt: skip
    rows = {line.split()[0]: line.split()[1:8] for line in out.splitlines()[1:]}
    assert rows == {
        "infra": ["0", "none", "0", "unlimited", "0", "none", "0.0"],
        "ops": ["0", "0", "0", "8", "(server)", "0", "none"],
        "research": ["0", "2", "0", "8", "(server)", "1", "1"],
    }
    research = next(line.split() for line in out.splitlines() if line.startswith("research"))
    assert research[8:10] == ["0.0", "100"]  # (chip-hours this month, of its budget)
    code, out, _ = run(api, capsys, *admin, "tenants", "show", "ops")
    assert code == 0 and out.splitlines()[1] == "  jobs:  0 active, limit 0; 0 queued, limit none"
    with pytest.raises(SystemExit):
        main(["tenants", "set", "ops", "--max-jobs", "lots"])
    assert "expected a number, 'default' or 'unlimited'" in capsys.readouterr().err
    code, _, err = run(api, capsys, *admin, "tenants", "set", "ops")
    assert code == 2 and "--max-queued or --max-chip-hours" in err and "--data-prefix" in err

    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 7 * 86400))
    code, out, _ = run(api, capsys, *member, "usage", "--since", since)
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith(f"from {since[:10]} {since[11:16]} to ")
    assert lines[0].endswith(" UTC (processes)")
    assert [line.split() for line in lines[1:]] == [
        ["TENANT", "JOBS", "CHIP-HOURS", "TOKENS"],
        ["research", "0", "0.00", "0"],
    ]
    code, _, err = run(api, capsys, *member, "usage", "--tenant", "ops")
    assert code == 3 and "(admin_only)" in err


def test_rewards_line() -> None:
    metrics = {"chosen_reward": 0.5, "rejected_reward": -0.25, "eval_chosen_reward": None}
    assert rewards_line({"metrics": metrics}) == "rewards: chosen +0.5000 rejected -0.2500 (margin +0.7500)"
    held_out = {"eval_chosen_reward": -0.125, "eval_rejected_reward": -0.5}
    assert rewards_line({"metrics": held_out}) == "held out: chosen -0.1250 rejected -0.5000 (margin +0.3750)"
    assert rewards_line({"metrics": {"loss": 1.0, "chosen_reward": 0.5, "rejected_reward": None}}) is None


def test_data_line() -> None:
    assert (
        data_line({"data_stats": None}) is None and data_line({}) is None
    )  # (not packed yet; an older server)
    figures = {"documents": 380, "tokens": 51_234, "rows": 790, "row_tokens": 64, "pad_fraction": 0.0018}
    figures.update(steps_per_epoch=98, validation_documents=20)
    assert data_line({"data_stats": figures}) == (
        "data: 380 documents, 51,234 tokens in 790 rows of 64 (0.2% padding), 98 steps an epoch; "
        "validation 20 documents"
    )
    assert data_line({"data_stats": {**figures, "validation_documents": None}}).endswith("98 steps an epoch")  # type: ignore[union-attr]
    # A dpo job's documents are preference pairs.
    dpo = {"data_stats": {**figures, "preference_pairs": True}}
    assert data_line(dpo) == (
        "data: 380 preference pairs, 51,234 tokens in 790 rows of 64 (0.2% padding), 98 steps an epoch; "
        "validation 20 preference pairs"
    )


def test_metrics_table_csv_and_pages(live_api, dataset: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`tputune metrics`: a line a step (loss, token accuracy, eval loss and accuracy, lr, tokens/s), a
    window of steps, every N-th step with each eval's and the last, or CSV with every column; the client
    pages through a long history."""
    from tests.test_dashboard import create, report, started, step

    api = live_api(dispatcher_enabled=False)
    job_id, token = started(api, dataset, "curve")
    report(api, job_id, token, [step(n, 4.0 - 0.25 * n, total=13) for n in range(1, 14)])
    evals = [(5, 3.1, 0.2), (10, 2.0, None)]
    report(
        api,
        job_id,
        token,
        [{"kind": "eval", "step": s, "eval_loss": loss, "eval_accuracy": acc} for s, loss, acc in evals],
    )
    code, out, _ = run(api, capsys, "metrics", job_id)
    lines = out.splitlines()
    assert code == 0 and lines[0] == "    STEP      LOSS     ACC  EVAL LOSS  EVAL ACC         LR     TOK/S"
    assert [line.split()[0] for line in lines[1:]] == [str(n) for n in range(1, 14)]
    assert lines[5].split() == ["5", "2.7500", "15.0%", "3.1000", "20.0%", "1.000e-04", "1,234"]
    assert lines[10].split() == ["10", "1.5000", "30.0%", "2.0000", "-", "1.000e-04", "1,234"]
    code, out, _ = run(api, capsys, "metrics", job_id, "--every", "4")
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["4", "5", "8", "10", "12", "13"]
    code, out, _ = run(api, capsys, "metrics", job_id, "--csv", "--min-step", "4", "--max-step", "6")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [row["step"] for row in rows] == ["4", "5", "6"]
    assert rows[1] == {
        **rows[1],
        "loss": "2.75",
        "accuracy": "0.15",
        "eval_loss": "3.1",
        "eval_accuracy": "0.2",
        "trained_tokens": "320",
        "grad_norm": "",
    }
    with api.client() as http:
        assert http.get(f"/jobs/{job_id}/metrics", params={"limit": 5}).json()["has_more"]
    with Client(api.url) as client:
        assert [p["step"] for p in client.metric_points(job_id, page=5)] == list(range(1, 14))
        assert [p["step"] for p in client.metric_points(job_id, min_step=11, page=2)] == [11, 12, 13]
    code, out, _ = run(api, capsys, "metrics", created := create(api, dataset, "none yet"))
    assert (code, out) == (0, "no metrics yet\n"), created
    # A dpo job's rewards: two more columns in the table, four in the CSV.
    job_id, token = started(api, dataset, "dpo curve")
    rewards = {"chosen_reward": 0.25, "rejected_reward": -0.125}
    eval_rewards = {"eval_chosen_reward": 0.5, "eval_rejected_reward": -1.5}
    report(api, job_id, token, [step(1, 0.69, total=2), {**step(2, 0.5, total=2), **rewards}])
    report(api, job_id, token, [{"kind": "eval", "step": 2, "eval_loss": 0.4, **eval_rewards}])
    code, out, _ = run(api, capsys, "metrics", job_id)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[-2:] == ["CHOSEN", "REJECTED"]
    assert lines[1].split()[-2:] == ["-", "-"] and lines[2].split()[-2:] == ["+0.2500", "-0.1250"]
    code, out, _ = run(api, capsys, "metrics", job_id, "--csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert rows[1] == {**rows[1], "chosen_reward": "0.25", "eval_rejected_reward": "-1.5"}
    assert rows[0]["chosen_reward"] == ""
    # `tputune status`: the latest rewards and margins; `tputune checkpoints`: each one's margins.
    code, out, _ = run(api, capsys, "status", job_id)
    assert (
        code == 0
        and (
            "\n  rewards: chosen +0.2500 rejected -0.1250 (margin +0.3750); "
            "held out: chosen +0.5000 rejected -1.5000 (margin +2.0000)\n"
        )
        in out
    )
    checkpoint = {"kind": "checkpoint", "step": 2, "uri": "/o/ckpt/2", "loss": 0.5, **rewards, **eval_rewards}
    report(api, job_id, token, [checkpoint, {"kind": "checkpoint", "step": 1, "uri": "/o/ckpt/1"}])
    code, out, _ = run(api, capsys, "checkpoints", job_id)
    assert out.splitlines() == [
        "step       1  loss -  eval -  /o/ckpt/1",
        "step       2  loss 0.5000  eval - margin +0.3750 eval-margin +2.0000  /o/ckpt/2",
    ]
    code, out, _ = run(api, capsys, "status", created)
    assert code == 0 and "rewards:" not in out  # (an sft job's: none)
