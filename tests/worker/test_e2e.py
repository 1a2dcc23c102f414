"""End to end: the API's local executor runs the real worker (tiny Gemma 3 on CPU) through the job's
life, and the job's loss history and checkpoints land where the API says."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FINAL = ("succeeded", "failed", "cancelled")
WORKER = f"{shlex.quote(sys.executable)} -m worker --compute-dtype float32 --sample-tokens 4"


def submit(api, corpus: Path, tokenizer: Path, steps: int, epochs: int = 1, **extra: object) -> str:  # type: ignore[no-untyped-def]
    body = {
        "name": "e2e",
        "model": "tiny",
        "tokenizer_uri": str(tokenizer),
        "dataset_uri": str(corpus),
        "validation_split": 0.05,
        "hyperparameters": {
            "max_steps": steps,
            "epochs": epochs,
            "batch_size": 8,
            "max_seq_len": 64,
            "learning_rate": 3e-3,
            "warmup_steps": 2,
            "eval_every_steps": steps // 2,
            "checkpoint_every_steps": steps // 2,
        },
        "sample_prompts": ["Once upon a time"],
        **extra,
    }
    with api.client() as http:
        response = http.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: the API's database behaviour is covered on both kinds elsewhere."""
    from api.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'tputune.db'}"
    upgrade(url)
    return url


@pytest.fixture
def worker_api(live_api, story_corpus: Path, tiny_tokenizer_path: Path):  # type: ignore[no-untyped-def]
    def start(**overrides: object):  # type: ignore[no-untyped-def]
        roots = [story_corpus.parent, tiny_tokenizer_path.parent]
        return live_api(worker_command=WORKER, allowed_data_roots=roots, cancel_grace_seconds=60, **overrides)

    return start


def test_real_worker_job_succeeds_with_history_and_checkpoints(  # type: ignore[no-untyped-def]
    worker_api, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    api = worker_api()
    method = {"type": "full", "export_hf": True, "export_gguf": "q8_0"}
    job_id = submit(api, story_corpus, tiny_tokenizer_path, steps=12, method=method)
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL, timeout=280)
    assert job["status"] == "succeeded", job
    assert job["progress"]["step"] == 12 and job["progress"]["total_steps"] == 12
    assert job["exported_step"] == 12  # (the last step's weights: export_best is off)
    assert job["trained_tokens"] > 0 and job["metrics"]["eval_loss"] is not None
    data = job["data_stats"]  # (the 400 stories, 5% held out, and what they packed into)
    assert data["documents"] == 380 and data["validation_documents"] == 20 and data["total_steps"] == 12
    assert data["row_tokens"] == 64 and data["steps_per_epoch"] == data["rows"] // 8
    with api.client() as http:
        points = http.get(f"/jobs/{job_id}/metrics").json()["data"]
        checkpoints = http.get(f"/jobs/{job_id}/checkpoints").json()["data"]
        samples = http.get(f"/jobs/{job_id}/events", params={"type": "sample"}).json()["data"]
    trained = [p for p in points if p["loss"] is not None]
    assert [p["step"] for p in trained] == list(range(1, 13))
    assert trained[-1]["loss"] < trained[0]["loss"]
    evals = [(p["step"], p["eval_loss"]) for p in points if p["eval_loss"] is not None]
    assert [step for step, _ in evals] == [0, 6, 12] and evals[-1][1] < evals[0][1]  # baseline first
    # Token accuracy, trained and held out, from the worker to the job, its history and its checkpoints.
    assert (job["metrics"]["accuracy"], job["metrics"]["eval_accuracy"]) == (
        trained[-1]["accuracy"],
        points[-1]["eval_accuracy"],
    )
    assert 0 <= trained[0]["accuracy"] < trained[-1]["accuracy"] <= 1
    assert checkpoints[-1]["metrics"]["accuracy"] == trained[-1]["accuracy"]
    assert [c["step"] for c in checkpoints][-1] == 12
    for checkpoint in checkpoints:
        assert Path(checkpoint["uri"]).exists(), checkpoint
    assert {s["data"]["phase"] for s in samples} == {"before", "after"}
    assert (Path(job["output_uri"]) / "final").exists()
    # Where the job says its weights are, they are (and nothing where it says none).
    exports = job["exports"]
    assert Path(exports["params"]).is_dir() and (Path(exports["hf"]) / "model.safetensors").is_file()
    assert Path(exports["gguf"]).read_bytes()[:4] == b"GGUF"
    assert exports["adapter"] is None and exports["hf_adapter"] is None
    assert sorted(path.name for path in Path(exports["uri"]).iterdir()) == [
        "export.json",
        "hf",
        "model-q8_0.gguf",
        "params",
    ]

    # Another job starts from its weights (its tokenizer too): its loss starts where this one's ended.
    body = {"name": "more", "model": "tiny", "dataset_uri": str(story_corpus), "from_job": job_id}
    body["hyperparameters"] = {"max_steps": 3, "batch_size": 8, "max_seq_len": 64, "learning_rate": 1e-4}
    with api.client() as http:
        created = http.post("/jobs", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["tokenizer_uri"] == str(tiny_tokenizer_path)
    more = api.wait_for(created.json()["id"], lambda j: j["status"] in FINAL, timeout=280)
    assert more["status"] == "succeeded", more
    with api.client() as http:
        went_on = http.get(f"/jobs/{more['id']}/metrics").json()["data"]
    first_loss = next(p["loss"] for p in went_on if p["loss"] is not None)
    assert first_loss < trained[0]["loss"] - 0.5 * (trained[0]["loss"] - trained[-1]["loss"])
    # And one from its checkpoint at step 6 (its params, not its optimizer state): from half way down.
    body["from_step"] = 6
    with api.client() as http:
        created = http.post("/jobs", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["base_checkpoint_uri"] == checkpoints[0]["uri"]
    halfway = api.wait_for(created.json()["id"], lambda j: j["status"] in FINAL, timeout=280)
    assert halfway["status"] == "succeeded", halfway
    with api.client() as http:
        went_on = http.get(f"/jobs/{halfway['id']}/metrics").json()["data"]
    from_six = next(p["loss"] for p in went_on if p["loss"] is not None)
    assert (
        trained[5]["loss"] - 0.5
        < from_six
        < trained[0]["loss"] - 0.25 * (trained[0]["loss"] - trained[5]["loss"])
    )


def test_sft_then_dpo_from_its_weights(  # type: ignore[no-untyped-def]
    worker_api, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    """The usual recipe: a supervised job, then a dpo job on preference pairs from its weights. The dpo
    job's reference is the model it starts from (the first job's weights), so its first loss is ln 2 exactly;
    the job object says its data are preference pairs."""
    import math

    from tests.worker.helpers import write_preference_pairs

    api = worker_api()
    sft = submit(api, story_corpus, tiny_tokenizer_path, steps=4)
    first = api.wait_for(sft, lambda j: j["status"] in FINAL, timeout=280)
    assert first["status"] == "succeeded", first
    pairs = write_preference_pairs(story_corpus.parent / "e2e_pairs.jsonl", 200, 9)
    body = {"name": "prefs", "model": "tiny", "dataset_uri": str(pairs), "from_job": sft}
    body |= {"method": {"type": "full", "objective": "dpo"}, "validation_split": 0.1}
    body["hyperparameters"] = {"max_steps": 4, "batch_size": 8, "max_seq_len": 64, "learning_rate": 3e-3}
    body["hyperparameters"] |= {"eval_every_steps": 2}
    with api.client() as http:
        created = http.post("/jobs", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["base_checkpoint_uri"] == first["exports"]["params"]
    job = api.wait_for(created.json()["id"], lambda j: j["status"] in FINAL, timeout=280)
    assert job["status"] == "succeeded", job
    assert job["data_stats"]["preference_pairs"] and job["data_stats"]["documents"] == 180
    with api.client() as http:
        points = http.get(f"/jobs/{job['id']}/metrics").json()["data"]
        data = http.get(f"/jobs/{job['id']}/events", params={"type": "data"}).json()["data"]
    trained = [p for p in points if p["loss"] is not None]
    assert trained[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    evals = [(p["step"], p["eval_loss"]) for p in points if p["eval_loss"] is not None]
    assert [s for s, _ in evals] == [0, 2, 4] and evals[0][1] == pytest.approx(math.log(2), abs=1e-5)
    assert evals[-1][1] < evals[0][1]
    # Its metrics, once it succeeded: the rewards of the weights exported (its last step's, and eval's).
    rewards = ("chosen_reward", "rejected_reward", "eval_chosen_reward", "eval_rejected_reward")
    assert [job["metrics"][name] for name in rewards] == [points[-1][name] for name in rewards]
    assert job["metrics"]["eval_chosen_reward"] > job["metrics"]["eval_rejected_reward"]
    assert data[0]["message"].startswith("Data: 180 preference pairs, ")
    assert Path(job["exports"]["params"]).is_dir()


def test_training_survives_the_api_being_down(  # type: ignore[no-untyped-def]
    worker_api, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    api = worker_api()
    job_id = submit(api, story_corpus, tiny_tokenizer_path, steps=40)
    api.wait_for(job_id, lambda j: j["progress"]["step"] >= 2, timeout=240)
    api.stop()
    time.sleep(6)  # the worker trains on, keeping its reports
    api.start()
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL, timeout=240)
    assert job["status"] == "succeeded", job
    with api.client() as http:
        points = http.get(f"/jobs/{job_id}/metrics").json()["data"]
    assert [p["step"] for p in points if p["loss"] is not None] == list(range(1, 41))  # nothing lost


def test_cancel_stops_the_real_worker_with_a_checkpoint(  # type: ignore[no-untyped-def]
    worker_api, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    api = worker_api()
    job_id = submit(api, story_corpus, tiny_tokenizer_path, steps=400)
    api.wait_for(job_id, lambda j: j["progress"]["step"] >= 3, timeout=240)
    with api.client() as http:
        http.post(f"/jobs/{job_id}/cancel")
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL, timeout=120)
    assert job["status"] == "cancelled"
    assert list((Path(job["output_uri"]) / "checkpoints").iterdir())  # it saved its state on the way out


def test_pause_and_resume_the_real_worker_loses_no_step(  # type: ignore[no-untyped-def]
    worker_api, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    api = worker_api()
    job_id = submit(api, story_corpus, tiny_tokenizer_path, steps=300)
    api.wait_for(job_id, lambda j: j["progress"]["step"] >= 3, timeout=240)
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/pause").json()["status"] == "pausing"
    paused = api.wait_for(job_id, lambda j: j["status"] in ("paused", *FINAL), timeout=120)
    assert paused["status"] == "paused", paused
    saved = sorted(int(p.name) for p in (Path(paused["output_uri"]) / "checkpoints").iterdir())
    assert saved and saved[-1] >= 3  # it saved its state on the way out
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/resume").json()["status"] == "queued"
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL, timeout=240)
    assert job["status"] == "succeeded", job
    total = job["progress"]["total_steps"]  # (300, or fewer if the data runs out first)
    assert job["pauses"] == 1 and job["restarts"] == 0 and job["progress"]["step"] == total > saved[-1]
    with api.client() as http:
        points = http.get(f"/jobs/{job_id}/metrics").json()["data"]
        statuses = http.get(f"/jobs/{job_id}/events", params={"type": "status", "limit": 1000}).json()["data"]
    assert [p["step"] for p in points if p["loss"] is not None] == list(
        range(1, total + 1)
    )  # each step, once
    # The second run went on from the checkpoint the pause left, not from the start.
    assert f"resumed from the checkpoint at step {saved[-1]}" in [e["message"] for e in statuses]


def test_a_real_worker_killed_fails_the_job_and_resumed_it_goes_on_from_its_checkpoint(  # type: ignore[no-untyped-def]
    worker_api, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    """A host lost: the run's processes SIGKILLed, no time to save. The job fails; its owner resumes it,
    and the real worker goes on from the last checkpoint it committed, its loss history each step once."""
    import json
    import os
    import signal

    api = worker_api()
    # A checkpoint at step 150 of 300 (an epoch is 195 steps: with one, the run had reached its end, and
    # saved it, before the kill at step 160 landed, on an idle machine). The kill waits for that checkpoint's
    # commit too (its directory renamed into place): it is written behind training, and on a busy machine
    # took more than 10 steps.
    job_id = submit(api, story_corpus, tiny_tokenizer_path, steps=300, epochs=2)

    def past_a_checkpoint(job: dict) -> bool:
        committed = (Path(job["output_uri"]) / "checkpoints" / "150").is_dir()
        return (job["progress"]["step"] >= 160 and committed) or job["status"] in FINAL

    api.wait_for(job_id, past_a_checkpoint, timeout=240)
    runner = json.loads((api.settings.jobs_dir / job_id / "runner.json").read_text())["pid"]
    os.killpg(runner, signal.SIGKILL)
    failed = api.wait_for(job_id, lambda j: j["status"] in FINAL, timeout=60)
    assert failed["status"] == "failed" and failed["error"]["code"] == "worker_lost", failed
    saved = [int(p.name) for p in (Path(failed["output_uri"]) / "checkpoints").iterdir() if p.name.isdigit()]
    assert max(saved) >= 150
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/resume").json()["status"] == "queued"
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL, timeout=240)
    assert job["status"] == "succeeded" and job["retries"] == 1, job
    total = job["progress"]["total_steps"]
    assert job["progress"]["step"] == total > max(saved)
    with api.client() as http:
        points = http.get(f"/jobs/{job_id}/metrics").json()["data"]
        statuses = http.get(f"/jobs/{job_id}/events", params={"type": "status", "limit": 1000}).json()["data"]
        trained = http.get(f"/jobs/{job_id}/events", params={"type": "metrics", "limit": 1000}).json()["data"]
    assert [p["step"] for p in points if p["loss"] is not None] == list(range(1, total + 1))
    [resumed] = [e for e in statuses if e["message"] == f"resumed from the checkpoint at step {max(saved)}"]
    # The steps after the checkpoint that the killed run had trained are the resumed run's (trained again).
    assert all(e["id"] > resumed["id"] for e in trained if e["step"] > max(saved))
    assert [e["step"] for e in trained if e["id"] < resumed["id"]] == list(range(1, max(saved) + 1))


@pytest.mark.timeout(600)  # two processes each import gemma and compile: minutes on a busy 2-core machine
def test_two_local_processes(worker_api, story_corpus: Path, tiny_tokenizer_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = worker_api()
    job_id = submit(api, story_corpus, tiny_tokenizer_path, steps=6, resources={"processes": 2})
    job = api.wait_for(job_id, lambda j: j["status"] in FINAL, timeout=560)
    assert job["status"] == "succeeded", job
    assert (api.settings.jobs_dir / job_id / "worker-1.log").exists()
    assert job["progress"]["step"] == 6
