"""The worker's side of the API: POST /jobs/{id}/progress (the contract in worker/protocol.py)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import JSON, update
from sqlmodel import Session, col, select

from api.jobs import new_job_token, transition
from api.models import Job
from api.states import JobStatus


def started_job(client: TestClient, dataset: Path) -> tuple[str, str]:
    """A job as the dispatcher leaves it after launch: starting, with a token."""
    job_id = client.post("/jobs", json={"name": "p", "model": "tiny", "dataset_uri": str(dataset)}).json()[
        "id"
    ]
    return job_id, new_run(client, job_id)


def new_run(client: TestClient, job_id: str) -> str:
    """The queued job's run launched, as the dispatcher does: starting, with a new token (returned)."""
    with Session(client.app.state.engine, expire_on_commit=False) as session:  # type: ignore[attr-defined]
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        assert transition(session, job, JobStatus.starting)
        token, job.token_hash = new_job_token()
        session.add(job)
        session.commit()
    return token


def post(client: TestClient, job_id: str, token: str | None, reports: list[dict]):  # type: ignore[no-untyped-def]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return client.post(f"/jobs/{job_id}/progress", json={"reports": reports}, headers=headers)


def metrics(step: int, loss: float, accuracy: float | None = None) -> dict:
    return {
        "kind": "metrics",
        "step": step,
        "total_steps": 10,
        "loss": loss,
        "tokens_per_second": 100.0,
        "trained_tokens": step * 64,
        "eta_seconds": 10.0 - step,
        "learning_rate": 1e-4,
        "epoch": step / 10,
        **({"accuracy": accuracy} if accuracy is not None else {}),
    }


def test_reports_update_the_job(client: TestClient, dataset: Path) -> None:
    job_id, token = started_job(client, dataset)
    response = post(
        client, job_id, token, [{"kind": "status", "message": "Compiling.", "phase": "compiling"}]
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"accepted": 1, "duplicates": 0, "job_status": "running"}
    post(
        client,
        job_id,
        token,
        [
            metrics(1, 3.0, accuracy=0.25),
            metrics(2, 2.5, accuracy=0.375),
            {"kind": "eval", "step": 2, "eval_loss": 2.7, "eval_accuracy": 0.3},
        ],
    )
    job = client.get(f"/jobs/{job_id}").json()
    assert job["status"] == "running" and job["started_at"]
    assert job["progress"] == {
        "step": 2,
        "total_steps": 10,
        "epoch": 0.2,
        "fraction": 0.2,
        "eta_seconds": 8.0,
    }
    assert job["metrics"] == {
        "loss": 2.5,
        "eval_loss": 2.7,
        "accuracy": 0.375,
        "eval_accuracy": 0.3,
        # (a dpo job's: none for this one's)
        **dict.fromkeys(("chosen_reward", "rejected_reward", "eval_chosen_reward", "eval_rejected_reward")),
        "learning_rate": 1e-4,
        "tokens_per_second": 100.0,
    }
    assert job["trained_tokens"] == 128
    # An older step arriving late (a retried batch) is stored but does not move the job back.
    post(client, job_id, token, [metrics(1, 9.9, accuracy=0.9)])
    post(client, job_id, token, [metrics(0, 9.9, accuracy=0.9)])
    job = client.get(f"/jobs/{job_id}").json()
    assert job["progress"]["step"] == 2 and job["metrics"]["accuracy"] == 0.375
    post(client, job_id, token, [{"kind": "checkpoint", "step": 2, "uri": "/x/ckpt/2", "loss": 2.5}])
    assert client.get(f"/jobs/{job_id}").json()["checkpoint_uri"] == "/x/ckpt/2"
    types = [e["type"] for e in client.get(f"/jobs/{job_id}/events").json()["data"]]
    assert types.count("metrics") == 3 and "checkpoint" in types and "eval" in types


def test_a_dpo_jobs_rewards_are_in_its_history_events_metrics_and_checkpoints(
    client: TestClient, dataset: Path
) -> None:
    """A dpo job's worker reports each step's mean rewards of the chosen and rejected replies (and each
    eval's): the metrics history has them per step, next to the loss, and the events say them; the job's
    metrics have the latest (the highest step's), its checkpoints theirs."""
    job_id, token = started_job(client, dataset)
    rewards = {"chosen_reward": 0.125, "rejected_reward": -0.5}
    eval_report = {"kind": "eval", "step": 2, "eval_loss": 0.6, "eval_accuracy": 0.75}
    response = post(
        client,
        job_id,
        token,
        [
            metrics(1, 0.69, accuracy=0.0),
            {**metrics(2, 0.55, accuracy=0.5), **rewards},
            {**eval_report, "eval_chosen_reward": 0.25, "eval_rejected_reward": -0.75},
        ],
    )
    assert response.status_code == 200, response.text
    points = client.get(f"/jobs/{job_id}/metrics").json()["data"]
    assert [(p["step"], p["chosen_reward"], p["rejected_reward"]) for p in points] == [
        (1, None, None),
        (2, 0.125, -0.5),
    ]
    assert (points[1]["eval_chosen_reward"], points[1]["eval_rejected_reward"]) == (0.25, -0.75)
    assert points[1]["loss"] == 0.55 and points[1]["eval_loss"] == 0.6
    messages = [e["message"] for e in client.get(f"/jobs/{job_id}/events").json()["data"]]
    assert "step 2/10: loss 0.5500, accuracy 50.0%, rewards chosen +0.125, rejected -0.500" in messages
    assert "step 2: eval loss 0.6000, accuracy 75.0%, rewards chosen +0.250, rejected -0.750" in messages
    assert "step 1/10: loss 0.6900, accuracy 0.0%" in messages
    job = client.get(f"/jobs/{job_id}").json()["metrics"]
    assert (job["chosen_reward"], job["rejected_reward"]) == (0.125, -0.5)
    assert (job["eval_chosen_reward"], job["eval_rejected_reward"]) == (0.25, -0.75)
    # A late report of an earlier step leaves the latest; the next step's and eval's replace them.
    post(client, job_id, token, [{**metrics(1, 0.69), "chosen_reward": 9.0, "rejected_reward": 9.0}])
    assert client.get(f"/jobs/{job_id}").json()["metrics"]["chosen_reward"] == 0.125
    later = {"chosen_reward": 0.5, "rejected_reward": -1.25}
    post(client, job_id, token, [{**metrics(3, 0.4), **later}, {**eval_report, "step": 3, "eval_loss": 0.5}])
    job = client.get(f"/jobs/{job_id}").json()["metrics"]
    assert (job["chosen_reward"], job["rejected_reward"]) == (0.5, -1.25)
    assert (job["eval_chosen_reward"], job["eval_rejected_reward"]) == (None, None)  # (that eval had none)
    checkpoint = {"kind": "checkpoint", "step": 3, "uri": "/x/ckpt/3", "loss": 0.4, **later}
    post(client, job_id, token, [{**checkpoint, "eval_chosen_reward": 0.375, "eval_rejected_reward": -1.0}])
    (saved,) = client.get(f"/jobs/{job_id}/checkpoints").json()["data"]
    assert saved["metrics"] == {
        **{"loss": 0.4, "eval_loss": None, "accuracy": None, "eval_accuracy": None},
        **{"chosen_reward": 0.5, "rejected_reward": -1.25},
        **{"eval_chosen_reward": 0.375, "eval_rejected_reward": -1.0},
    }


def test_a_result_of_the_lowest_eval_gives_the_job_that_step_and_its_figures(
    client: TestClient, dataset: Path
) -> None:
    """export_best: the result names the step whose weights were exported (its eval the lowest) and carries
    that step's figures, which the job's metrics become, a figure the step lacks too (the base weights,
    step 0, have no train loss); a result of the last step only adds to what the job has."""
    job_id, token = started_job(client, dataset)
    evals = [
        {"kind": "eval", "step": s, "eval_loss": loss, "eval_accuracy": 0.3}
        for s, loss in ((2, 1.5), (4, 1.9))
    ]
    post(client, job_id, token, [metrics(s, 3.0 - s * 0.1, accuracy=0.2) for s in range(1, 5)] + evals)
    assert client.get(f"/jobs/{job_id}").json()["exported_step"] is None
    post(client, job_id, token, [{**metrics(4, 2.6), "chosen_reward": 0.5, "rejected_reward": -0.5}])
    result = {"kind": "result", "step": 4, "exported_step": 2, "output_uri": "/o/final", "eval_loss": 1.5}
    post(client, job_id, token, [{**result, "loss": 2.8, "accuracy": 0.2, "eval_accuracy": 0.3}])
    job = client.get(f"/jobs/{job_id}").json()
    assert job["exported_step"] == 2 and job["progress"]["step"] == 4
    assert (job["metrics"]["loss"], job["metrics"]["eval_loss"]) == (2.8, 1.5)
    # (step 4's rewards are not the exported weights': the result gave none of step 2's)
    assert job["metrics"]["chosen_reward"] is None and job["metrics"]["rejected_reward"] is None
    (event,) = [e for e in client.get(f"/jobs/{job_id}/events").json()["data"] if e["type"] == "result"]
    assert event["message"] == (
        "Training finished. Exported the weights of step 2 (the lowest eval loss, 1.5000). Output: /o/final"
    )

    base_job, base_token = started_job(client, dataset)  # (the baseline's eval the lowest)
    post(client, base_job, base_token, [metrics(1, 3.0), {"kind": "result", "step": 1, "exported_step": 0}])
    job = client.get(f"/jobs/{base_job}").json()
    assert job["exported_step"] == 0 and job["metrics"]["loss"] is None

    last_job, last_token = started_job(client, dataset)
    post(client, last_job, last_token, [metrics(1, 3.0), {"kind": "result", "step": 1, "exported_step": 1}])
    job = client.get(f"/jobs/{last_job}").json()
    assert job["exported_step"] == 1 and job["metrics"]["loss"] == 3.0
    (event,) = [e for e in client.get(f"/jobs/{last_job}/events").json()["data"] if e["type"] == "result"]
    assert event["message"] == "Training finished."


def test_a_run_resumed_from_its_checkpoint_replaces_what_an_earlier_run_reported_past_it(
    client: TestClient, dataset: Path
) -> None:
    """A run that crashed at step 8 after a checkpoint at 5: the next run trains 6.. again. Its resume
    report drops the first run's metrics and evals of steps 6-8 (kept, they hid the new run's: each step is
    stored once) and takes the job's progress back to 5; a retried batch does not drop the new run's."""
    job_id, token = started_job(client, dataset)
    first = [metrics(s, 4.0 - s * 0.1, accuracy=0.1) for s in range(1, 9)]
    evals = [{"kind": "eval", "step": s, "eval_loss": 9.0 - s, "eval_accuracy": s / 10} for s in (4, 8)]
    post(client, job_id, token, [*first, *evals, {"kind": "checkpoint", "step": 5, "uri": "/o/5"}])
    assert client.get(f"/jobs/{job_id}").json()["progress"]["step"] == 8
    resumed = {"kind": "status", "step": 5, "key": "loading-b-1", "message": "resumed", "resumed_from": 5}
    again = [resumed, metrics(6, 1.5, accuracy=0.6)]
    assert post(client, job_id, token, again).json() == {
        "accepted": 2,
        "duplicates": 0,
        "job_status": "running",
    }
    job = client.get(f"/jobs/{job_id}").json()
    assert job["progress"]["step"] == 6 and job["metrics"]["loss"] == 1.5
    # (the eval of step 4, the latest left)
    assert (job["metrics"]["eval_loss"], job["metrics"]["eval_accuracy"]) == (5.0, 0.4)
    points = client.get(f"/jobs/{job_id}/metrics").json()["data"]
    assert [(p["step"], p["loss"]) for p in points][4:] == [(5, 3.5), (6, 1.5)]
    # A retried batch (its answer lost) is a duplicate; the next one goes on.
    assert post(client, job_id, token, again).json()["duplicates"] == 2
    post(client, job_id, token, [metrics(7, 1.4), {"kind": "eval", "step": 8, "eval_loss": 1.2}])
    assert post(client, job_id, token, again).json()["duplicates"] == 2
    points = client.get(f"/jobs/{job_id}/metrics").json()["data"]
    # (its eval of step 8 stored: the first run's had taken its place)
    assert [(p["step"], p["loss"], p["eval_loss"]) for p in points][5:] == [
        (6, 1.5, None),
        (7, 1.4, None),
        (8, None, 1.2),
    ]
    job = client.get(f"/jobs/{job_id}").json()
    assert job["progress"]["step"] == 7 and job["metrics"]["eval_loss"] == 1.2
    # A resume where the run had got to (a preemption's checkpoint, saved as it stopped) drops nothing.
    post(client, job_id, token, [{**resumed, "key": "loading-c-1", "step": 8, "resumed_from": 8}])
    assert len(client.get(f"/jobs/{job_id}/metrics").json()["data"]) == 8


def test_reports_are_idempotent(client: TestClient, dataset: Path) -> None:
    job_id, token = started_job(client, dataset)
    batch = [
        metrics(1, 3.0),
        metrics(2, 2.0),
        {"kind": "sample", "step": 0, "key": "0", "phase": "before", "prompt": "Once", "text": "upon"},
    ]
    assert post(client, job_id, token, batch).json()["accepted"] == 3
    again = post(client, job_id, token, batch).json()
    assert again["accepted"] == 0 and again["duplicates"] == 3
    doubled = post(client, job_id, token, [metrics(3, 1.0), metrics(3, 1.0)]).json()
    assert doubled["accepted"] == 1 and doubled["duplicates"] == 1
    other_key = {"kind": "sample", "step": 0, "key": "1", "phase": "before", "prompt": "Two", "text": "x"}
    assert post(client, job_id, token, [other_key]).json()["accepted"] == 1
    events = client.get(f"/jobs/{job_id}/events", params={"type": "metrics"}).json()["data"]
    assert [e["step"] for e in events] == [1, 2, 3]
    assert len(client.get(f"/jobs/{job_id}/events", params={"type": "sample"}).json()["data"]) == 2


def test_token_is_checked(client: TestClient, dataset: Path) -> None:
    job_id, token = started_job(client, dataset)
    _, other_token = started_job(client, dataset)
    for job, tok in [(job_id, None), (job_id, "wrong"), (job_id, other_token), ("ft-unknown", token)]:
        response = post(client, job, tok, [metrics(1, 1.0)])
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_job_token"
        # The token is checked before the body is parsed: a caller without it learns nothing of the body.
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        for content, kind in [(b'{"reports": [', "application/json"), (b"reports", "text/plain")]:
            refused = client.post(
                f"/jobs/{job}/progress", content=content, headers={**headers, "content-type": kind}
            )
            assert (refused.status_code, refused.json()["error"]["code"]) == (401, "invalid_job_token")
    assert client.get(f"/jobs/{job_id}").json()["progress"]["step"] == 0
    for content, kind in [(b'{"reports": [', "application/json"), (b"reports", "text/plain")]:
        headers = {"Authorization": f"Bearer {token}", "content-type": kind}
        refused = client.post(f"/jobs/{job_id}/progress", content=content, headers=headers)
        assert (refused.status_code, refused.json()["error"]["code"]) == (422, "invalid_request"), content


def test_bad_reports_are_422(client: TestClient, dataset: Path) -> None:
    job_id, token = started_job(client, dataset)
    for reports in (
        [],
        [{"kind": "nope", "step": 1}],
        [{"kind": "metrics", "step": -1}],
        [{"kind": "eval", "step": 1, "eval_loss": "NaN"}],
        [{"kind": "metrics", "step": 1, "accuracy": 1.5}],
        [{"kind": "eval", "step": 1, "eval_loss": 1.0, "eval_accuracy": -0.1}],
    ):
        response = post(client, job_id, token, reports)
        assert response.status_code == 422, reports
        assert response.json()["error"]["code"] == "invalid_request"
    # Many bad reports: the message names the first five and counts the rest; the details list each.
    many = post(client, job_id, token, [{"kind": "metrics", "step": n, "accuracy": 2.0} for n in range(1000)])
    error = many.json()["error"]
    assert many.status_code == 422 and len(error["details"]) == 1000
    assert error["message"].count("accuracy: Input should be less than or equal to 1") == 5
    assert error["message"].startswith("reports.0.metrics.accuracy: ")
    assert error["message"].endswith("; and 995 more, each in error.details")
    # A NaN loss (Python's json writes it) is stored as missing; the job stays readable.
    nan_loss = client.post(
        f"/jobs/{job_id}/progress",
        content=b'{"reports": [{"kind": "metrics", "step": 1, "loss": NaN}]}',
        headers={"Authorization": f"Bearer {token}", "content-type": "application/json"},
    )
    assert nan_loss.status_code == 200, nan_loss.text
    job = client.get(f"/jobs/{job_id}").json()
    assert job["progress"]["step"] == 1 and job["metrics"]["loss"] is None


def test_a_nul_character_in_a_report_is_stored_as_a_replacement_character(
    client: TestClient, dataset: Path
) -> None:
    """A sample decoded from a byte token, or a message quoting the data, may hold NUL, which PostgreSQL's
    text cannot: the batch was a 500, retried and lost. It is stored, with U+FFFD in place of NUL."""
    job_id, token = started_job(client, dataset)
    reports = [
        {
            "kind": "sample",
            "step": 0,
            "key": "0\x00",
            "phase": "before",
            "prompt": "Once\x00",
            "text": "a\x00b",
        },
        {"kind": "warning", "step": 1, "message": "line 3: \x00 in the text"},
        {"kind": "checkpoint", "step": 1, "uri": f"{dataset.parent}/ckpt\x00/1"},
    ]
    response = post(client, job_id, token, reports)
    assert response.status_code == 200, response.text
    assert response.json()["accepted"] == 3
    events = client.get(f"/jobs/{job_id}/events", params={"type": ["sample", "warning"]}).json()["data"]
    sample = next(event for event in events if event["type"] == "sample")
    assert sample["data"]["prompt"] == "Once\ufffd" and sample["data"]["text"] == "a\ufffdb"
    assert any(event["message"] == "line 3: \ufffd in the text" for event in events)
    checkpoints = client.get(f"/jobs/{job_id}/checkpoints").json()["data"]
    assert [c["uri"] for c in checkpoints] == [f"{dataset.parent}/ckpt\ufffd/1"]
    assert post(client, job_id, token, reports[:1]).json()["duplicates"] == 1  # (its key, replaced alike)


def test_numbers_past_what_the_database_holds_are_422(client: TestClient, dataset: Path) -> None:
    """A step past INTEGER or a count past BIGINT was a 500 on PostgreSQL (on SQLite too, past BIGINT),
    which the worker retried without end, holding back every report after it."""
    job_id, token = started_job(client, dataset)
    for report, param in [
        ({"kind": "metrics", "step": 2**31, "loss": 1.0}, "step"),
        ({"kind": "metrics", "step": 1, "total_steps": 2**31}, "total_steps"),
        ({"kind": "metrics", "step": 1, "trained_tokens": 2**63}, "trained_tokens"),
        ({"kind": "eval", "step": 1, "eval_loss": 1.0, "eval_tokens": 2**63}, "eval_tokens"),
        ({"kind": "result", "step": 1, "trained_tokens": 2**70}, "trained_tokens"),
    ]:
        response = post(client, job_id, token, [report])
        assert response.status_code == 422, (report, response.text)
        assert response.json()["error"]["param"].endswith(param), response.text
    # Infinity and NaN: PostgreSQL's JSON cannot hold them (a 500), and SQLite's were served to browsers
    # whose JSON.parse fails on them. A diverged loss or gradient norm is stored as missing, as before.
    for report, param in [
        ('{"kind": "metrics", "step": 1, "epoch": Infinity}', "epoch"),
        ('{"kind": "status", "step": 1, "message": "m", "time": NaN}', "time"),
        ('{"kind": "result", "step": 1, "train_seconds": Infinity}', "train_seconds"),
    ]:
        response = client.post(
            f"/jobs/{job_id}/progress",
            content=b'{"reports": [' + report.encode() + b"]}",
            headers={"Authorization": f"Bearer {token}", "content-type": "application/json"},
        )
        assert response.status_code == 422, (report, response.text)
        assert response.json()["error"]["param"].endswith(param), response.text
    diverged = client.post(
        f"/jobs/{job_id}/progress",
        content=b'{"reports": [{"kind": "metrics", "step": 2, "loss": Infinity, "grad_norm": -Infinity}]}',
        headers={"Authorization": f"Bearer {token}", "content-type": "application/json"},
    )
    assert diverged.status_code == 200, diverged.text
    point = client.get(f"/jobs/{job_id}/metrics").json()["data"][-1]
    assert point["step"] == 2 and point["loss"] is None and point["grad_norm"] is None
    biggest = {"kind": "metrics", "step": 2**31 - 1, "total_steps": 2**31 - 1, "trained_tokens": 2**63 - 1}
    assert post(client, job_id, token, [biggest]).status_code == 200
    job = client.get(f"/jobs/{job_id}").json()
    assert job["progress"]["step"] == 2**31 - 1 and job["trained_tokens"] == 2**63 - 1


def test_cancelling_is_visible_to_the_worker(client: TestClient, dataset: Path) -> None:
    job_id, token = started_job(client, dataset)
    post(client, job_id, token, [metrics(1, 1.0)])
    assert client.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelling"
    assert post(client, job_id, token, [metrics(2, 1.0)]).json()["job_status"] == "cancelling"


def test_status_messages_at_one_step_each_count(client: TestClient, dataset: Path) -> None:
    job_id, token = started_job(client, dataset)
    post(
        client,
        job_id,
        token,
        [{"kind": "status", "key": "loading-1", "phase": "loading", "message": "Loading."}],
    )
    post(
        client,
        job_id,
        token,
        [{"kind": "status", "key": "compiling-2", "phase": "compiling", "message": "Compiling."}],
    )
    assert client.get(f"/jobs/{job_id}").json()["status_message"] == "Compiling."


DATA = {
    "kind": "data",
    "documents": 380,
    "tokens": 51_234,
    "target_tokens": 50_100,
    "rows": 790,
    "row_tokens": 64,
    "pad_fraction": 0.0018,
    "steps_per_epoch": 98,
    "total_steps": 12,
    "validation_documents": 20,
    "validation_tokens": 2_700,
}


def test_what_the_data_came_to_shows_on_the_job(client: TestClient, dataset: Path) -> None:
    job_id, token = started_job(client, dataset)
    assert client.get(f"/jobs/{job_id}").json()["data_stats"] is None
    assert post(client, job_id, token, [DATA]).json()["accepted"] == 1
    figures = {name: value for name, value in DATA.items() if name != "kind"} | {"preference_pairs": False}
    assert client.get(f"/jobs/{job_id}").json()["data_stats"] == figures
    assert client.get("/jobs").json()["data"][0]["data_stats"] == figures
    [event] = client.get(f"/jobs/{job_id}/events", params={"type": "data"}).json()["data"]
    assert event["message"] == (
        "Data: 380 documents, 51,234 tokens (50,100 with loss) packed into 790 rows of 64 tokens (0.2% "
        "padding); 98 steps an epoch, 12 in all; validation: 20 documents, 2,700 tokens."
    )
    # A run after a restart packs the same data and says so again: kept once.
    assert post(client, job_id, token, [DATA]).json()["duplicates"] == 1
    refused = post(client, job_id, token, [{**DATA, "pad_fraction": 1.5}])
    assert refused.status_code == 422, refused.text


def test_a_job_whose_data_figures_are_json_null_reads_as_none(client: TestClient, dataset: Path) -> None:
    """JSON's null in `data_stats` (a row copied with its None before the column wrote None as NULL, as
    bench/api_load.py's bulk insert did: its job list was a 500) reads as no figures."""
    job_id, _ = started_job(client, dataset)
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        session.execute(update(Job).where(col(Job.id) == job_id).values(data_stats=JSON.NULL))
        session.commit()
    assert client.get(f"/jobs/{job_id}").json()["data_stats"] is None
    listed = client.get("/jobs")
    assert listed.status_code == 200 and listed.json()["data"][0]["data_stats"] is None
