"""The dispatcher's dataset check: the real google-cloud-storage client against the GCS emulator."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.datasets import DatasetUnavailable, StorageUnreachable, check_dataset
from api.jobs import _base_tokenizer
from api.settings import Settings


@pytest.fixture
def gcs_settings(gcs, tmp_path: Path) -> Settings:  # type: ignore[no-untyped-def]
    return Settings(data_dir=tmp_path, gcs_endpoint=gcs.endpoint, gcs_project="test")


def test_gcs_object_found(gcs, gcs_settings: Settings) -> None:  # type: ignore[no-untyped-def]
    gcs.make_bucket("data").blob("stories/train.txt").upload_from_string("Once upon a time.")
    check_dataset("gs://data/stories/train.txt", gcs_settings)


@pytest.mark.parametrize(
    ("uri", "code"),
    [
        ("gs://data/stories/missing.txt", "dataset_not_found"),
        ("gs://no-such-bucket/train.txt", "dataset_not_found"),
        ("gs://data/stories/empty.txt", "dataset_empty"),
    ],
)
def test_gcs_problems(gcs, gcs_settings: Settings, uri: str, code: str) -> None:  # type: ignore[no-untyped-def]
    bucket = gcs.make_bucket("data")
    bucket.blob("stories/empty.txt").upload_from_string("")
    with pytest.raises(DatasetUnavailable) as info:
        check_dataset(uri, gcs_settings)
    assert info.value.code == code
    assert uri.split("/")[-1] in info.value.message or "bucket" in info.value.message


def test_gcs_unreachable_is_retryable(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = Settings(
        data_dir=tmp_path,
        gcs_endpoint=f"http://127.0.0.1:{port}",
        gcs_project="test",
        storage_timeout_seconds=1,
    )
    with pytest.raises(StorageUnreachable):
        check_dataset("gs://data/train.txt", settings)


def test_local_files(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    good = tmp_path / "train.jsonl"
    good.write_text('{"text": "hi"}\n')
    check_dataset(str(good), settings)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for path, code in [
        (tmp_path / "missing.txt", "dataset_not_found"),
        (empty, "dataset_empty"),
        (tmp_path, "dataset_not_found"),
    ]:
        with pytest.raises(DatasetUnavailable) as info:
            check_dataset(str(path), settings)
        assert info.value.code == code


def test_dispatcher_fails_job_whose_gcs_dataset_is_missing(live_api, gcs) -> None:  # type: ignore[no-untyped-def]
    gcs.make_bucket("data").blob("train.txt").upload_from_string("Once upon a time.")
    api = live_api(gcs_endpoint=gcs.endpoint, gcs_project="test")
    with api.client() as http:
        ok = http.post(
            "/jobs",
            json={
                "name": "a",
                "model": "tiny",
                "dataset_uri": "gs://data/train.txt",
                "metadata": {"fake": "succeed"},
            },
        ).json()["id"]
        missing = http.post(
            "/jobs", json={"name": "b", "model": "tiny", "dataset_uri": "gs://data/nope.txt"}
        ).json()
    job = api.wait_for(missing["id"], lambda j: j["status"] in ("failed", "succeeded"))
    assert job["status"] == "failed" and job["error"]["code"] == "dataset_not_found"
    assert api.wait_for(ok, lambda j: j["status"] in ("failed", "succeeded"))["status"] == "succeeded"


def test_a_hugging_face_base_tokenizer_on_gcs(gcs, gcs_settings: Settings, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """from_job of a job whose base was a Hugging Face directory on gs:// (no tokenizer_uri): its
    tokenizer.model, looked up with the API's storage client; none where the directory lacks one or
    storage does not answer."""
    from worker.config import JobSpec

    bucket = gcs.make_bucket("models")
    bucket.blob("hf/config.json").upload_from_string("{}")
    spec = JobSpec.model_validate(
        {
            "name": "x",
            "model": "tiny",
            "dataset_uri": "gs://data/t.txt",
            "base_checkpoint_uri": "gs://models/hf/",
        }
    )
    assert _base_tokenizer(spec, gcs_settings) is None
    bucket.blob("hf/tokenizer.model").upload_from_string("sentencepiece")
    assert _base_tokenizer(spec, gcs_settings) == "gs://models/hf/tokenizer.model"
    named = spec.model_copy(update={"tokenizer_uri": "gs://models/other.model"})
    assert _base_tokenizer(named, gcs_settings) is None  # (its own tokenizer was named)
    away = Settings(data_dir=tmp_path, gcs_endpoint="http://127.0.0.1:9", storage_timeout_seconds=1)
    assert _base_tokenizer(spec, away) is None
