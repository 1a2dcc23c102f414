"""Loss history, checkpoints, and events followed as Server-Sent Events (resumable)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from tests.test_progress import metrics, post, started_job


def test_metrics_and_checkpoints(client: TestClient, dataset: Path) -> None:
    job_id, token = started_job(client, dataset)
    post(client, job_id, token, [metrics(s, 4.0 - s * 0.1, accuracy=s / 20) for s in range(1, 11)])
    post(
        client,
        job_id,
        token,
        [
            {"kind": "eval", "step": 5, "eval_loss": 3.7, "eval_accuracy": 0.2},
            {"kind": "eval", "step": 10, "eval_loss": 3.3},
        ],
    )
    post(
        client,
        job_id,
        token,
        [
            {
                "kind": "checkpoint",
                "step": 5,
                "uri": "/o/ckpt/5",
                "loss": 3.5,
                "eval_loss": 3.7,
                "accuracy": 0.25,
                "eval_accuracy": 0.2,
            },
            {"kind": "checkpoint", "step": 10, "uri": "/o/ckpt/10", "loss": 3.0},
        ],
    )
    points = client.get(f"/jobs/{job_id}/metrics").json()["data"]
    assert [p["step"] for p in points] == list(range(1, 11))
    assert points[4]["loss"] == 3.5 and points[4]["eval_loss"] == 3.7 and points[3]["eval_loss"] is None
    assert (points[4]["accuracy"], points[4]["eval_accuracy"]) == (0.25, 0.2)
    assert (points[3]["eval_accuracy"], points[9]["eval_accuracy"]) == (None, None)
    assert points[9]["trained_tokens"] == 640
    window = client.get(f"/jobs/{job_id}/metrics", params={"min_step": 3, "max_step": 6}).json()
    assert [p["step"] for p in window["data"]] == [3, 4, 5, 6] and not window["has_more"]
    first = client.get(f"/jobs/{job_id}/metrics", params={"limit": 4}).json()
    assert [p["step"] for p in first["data"]] == [1, 2, 3, 4] and first["has_more"]
    ckpts = client.get(f"/jobs/{job_id}/checkpoints").json()["data"]
    assert [(c["step"], c["uri"]) for c in ckpts] == [(5, "/o/ckpt/5"), (10, "/o/ckpt/10")]
    rewards = dict.fromkeys(
        ("chosen_reward", "rejected_reward", "eval_chosen_reward", "eval_rejected_reward")
    )
    assert ckpts[0]["metrics"] == {
        **{"loss": 3.5, "eval_loss": 3.7, "accuracy": 0.25, "eval_accuracy": 0.2},
        **rewards,  # (a dpo job's: test_progress)
    }
    assert ckpts[1]["metrics"] == {
        "loss": 3.0,
        "eval_loss": None,
        "accuracy": None,
        "eval_accuracy": None,
        **rewards,
    }
    assert [c["kept"] for c in ckpts] == [None, None]  # (its worker did not say)
    # Which are kept, as the latest report that says so says (its last keep_checkpoints: 2 here).
    post(client, job_id, token, [{"kind": "checkpoint", "step": 15, "uri": "/o/ckpt/15", "kept": [10, 15]}])
    ckpts = client.get(f"/jobs/{job_id}/checkpoints").json()["data"]
    assert [(c["step"], c["kept"]) for c in ckpts] == [(5, False), (10, True), (15, True)]
    # Its events say it too.
    [eval_5] = client.get(f"/jobs/{job_id}/events", params={"type": "eval", "limit": 1}).json()["data"]
    assert eval_5["message"] == "step 5: eval loss 3.7000, accuracy 20.0%"


def read_sse(response: httpx.Response, until: str = "end", max_events: int = 1000) -> list[dict]:
    events, current = [], {}
    for line in response.iter_lines():
        if not line:
            if current:
                events.append(current)
                if current.get("event") == until or len(events) >= max_events:
                    return events
            current = {}
        elif not line.startswith(":"):
            field, _, value = line.partition(": ")
            current[field] = value
    return events


def test_follow_events_streams_and_resumes(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api()
    with api.client() as http:
        job_id = http.post(
            "/jobs",
            json={
                "name": "sse",
                "model": "tiny",
                "dataset_uri": str(dataset),
                "metadata": {"fake": "succeed", "steps": "20", "interval": "0.05"},
            },
        ).json()["id"]
        with http.stream("GET", f"/jobs/{job_id}/events", params={"follow": "true"}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            first = read_sse(response, max_events=4)
        last_id = first[-1]["id"]
        # Resume where we left off: nothing repeated, nothing missed, ends when the job does.
        with http.stream(
            "GET",
            f"/jobs/{job_id}/events",
            params={"follow": "true"},
            headers={"Last-Event-ID": last_id},
            timeout=60,
        ) as response:
            rest = read_sse(response)
        assert rest[-1]["event"] == "end"
        streamed = [int(e["id"]) for e in first + rest if "id" in e]
        paged = [e["id"] for e in http.get(f"/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]]
        assert streamed == paged
        kinds = [e["event"] for e in rest]
        assert kinds.count("metrics") >= 10 and "result" in kinds
        assert json.loads(rest[-2]["data"])["data"]["status"] == "succeeded"
