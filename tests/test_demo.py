"""The demo's pieces: its dataset, its model file, and a job spec the real API accepts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from api.demo import DEMO_STORIES, demo_spec, prepare
from api.main import create_app
from api.settings import Settings
from worker.data import read_documents
from worker.gguf_import import gguf_model_name


def test_prepare_makes_stories_and_finds_the_gguf(tmp_path: Path) -> None:
    dataset, gguf = prepare(tmp_path)
    documents = read_documents(str(dataset))
    assert len(documents) == DEMO_STORIES
    assert all(isinstance(d, str) and d.endswith((".", "!", '"')) for d in documents)
    assert gguf.suffix == ".gguf" and gguf_model_name(gguf) == "gemma3-270m"
    before = dataset.stat().st_mtime_ns
    assert prepare(tmp_path)[0].stat().st_mtime_ns == before  # generated once


def test_demo_job_is_accepted_by_the_api(make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    dataset = tmp_path / "demo" / "stories.txt"
    dataset.parent.mkdir()
    dataset.write_text("Once upon a time.\n<|endoftext|>\n")
    gguf = tmp_path / "models" / "gemma-3-270m.gguf"
    settings = make_settings(dispatcher_enabled=False, allowed_data_roots=[dataset.parent, gguf.parent])
    with TestClient(create_app(settings)) as client:
        response = client.post("/jobs", json=demo_spec(dataset, gguf, steps=30))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["spec"]["base_checkpoint_uri"] == str(gguf)
    assert job["spec"]["hyperparameters"]["max_steps"] == 30
