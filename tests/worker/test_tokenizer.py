"""The SentencePiece tokenizer wrapper: special ids, batch encoding, loading from paths, protos and GCS."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.support.gcs import GcsEmulator
from worker import data
from worker.tokenizer import END_OF_TURN, START_OF_TURN, Tokenizer, TokenizerError

TEXTS = ["Once upon a time, there was a girl named Amy.", "Zyx\tqu\u00e9 \u2603!\n\n  two  spaces", ""]


def test_gemma_special_ids_and_single_piece_chat_markers(tiny_tokenizer: Tokenizer) -> None:
    assert (tiny_tokenizer.pad_id, tiny_tokenizer.eos_id, tiny_tokenizer.bos_id) == (0, 1, 2)
    assert tiny_tokenizer.vocab_size == 1000
    start, end = tiny_tokenizer.start_of_turn_id, tiny_tokenizer.end_of_turn_id
    ids = tiny_tokenizer.encode(f"{START_OF_TURN}user\nHi{END_OF_TURN}\n")
    assert ids[0] == start and ids.count(start) == 1 and ids.count(end) == 1
    assert tiny_tokenizer.piece_to_id("<unk>") == 3
    assert tiny_tokenizer.piece_to_id("<no such piece>") is None


def test_batch_encoding_matches_single_encoding_and_round_trips(tiny_tokenizer: Tokenizer) -> None:
    singles = [tiny_tokenizer.encode(text) for text in TEXTS]
    assert tiny_tokenizer.encode_batch(TEXTS, num_threads=2) == singles
    arrays = tiny_tokenizer.encode_batch_arrays(TEXTS, num_threads=2)
    assert all(array.dtype == np.int32 for array in arrays)
    assert [array.tolist() for array in arrays] == singles
    # Byte fallback and identity normalisation: unseen characters and whitespace survive exactly.
    assert [tiny_tokenizer.decode(ids) for ids in singles] == TEXTS
    assert tiny_tokenizer.decode(arrays[0]) == TEXTS[0]


def test_from_model_proto_equals_loading_the_file(
    tiny_tokenizer_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    rebuilt = Tokenizer.from_model_proto(tiny_tokenizer_path.read_bytes())
    assert rebuilt.encode_batch(TEXTS) == tiny_tokenizer.encode_batch(TEXTS)
    with pytest.raises(TokenizerError):
        Tokenizer.from_model_proto(b"not a model proto")


def test_load_reports_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.load(tmp_path / "missing.model")
    (tmp_path / "broken.model").write_text("nope")
    with pytest.raises(TokenizerError, match="is not a SentencePiece model"):
        Tokenizer.load(tmp_path / "broken.model")


def test_chat_markers_are_required_only_when_asked_for(plain_tokenizer: Tokenizer) -> None:
    assert plain_tokenizer.encode("Amy")
    with pytest.raises(TokenizerError, match=f"no {START_OF_TURN} piece"):
        _ = plain_tokenizer.start_of_turn_id
    with pytest.raises(TokenizerError, match=f"no {END_OF_TURN} piece"):
        _ = plain_tokenizer.end_of_turn_id


def test_gs_tokenizer_is_downloaded_once_into_the_cache(
    gcs: GcsEmulator, tmp_path: Path, tiny_tokenizer_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    blob = gcs.make_bucket("models").blob("tokenizers/tiny.model")
    blob.upload_from_filename(str(tiny_tokenizer_path))
    cache = tmp_path / "cache"
    loaded = Tokenizer.load("gs://models/tokenizers/tiny.model", cache_dir=cache)
    assert loaded.encode_batch(TEXTS) == tiny_tokenizer.encode_batch(TEXTS)
    assert [path.name for path in cache.rglob("*") if path.is_file()] == ["tiny.model"]
    assert (cache / "models" / "tokenizers" / "tiny.model").read_bytes() == tiny_tokenizer_path.read_bytes()
    blob.delete()
    assert Tokenizer.load("gs://models/tokenizers/tiny.model", cache_dir=cache).vocab_size == 1000
    with pytest.raises(TokenizerError, match=re.escape("gs://models/tokenizers/other.model does not exist")):
        Tokenizer.load("gs://models/tokenizers/other.model", cache_dir=cache)


def test_gs_tokenizer_is_read_from_the_fuse_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_tokenizer_path: Path
) -> None:
    mounted = tmp_path / "mnt" / "models" / "tiny.model"
    mounted.parent.mkdir(parents=True)
    mounted.write_bytes(tiny_tokenizer_path.read_bytes())
    monkeypatch.setenv(data.ENV_GCS_FUSE_ROOT, str(tmp_path / "mnt"))

    def no_client() -> None:
        raise AssertionError("a mounted file must not be fetched with the GCS client")

    monkeypatch.setattr(data, "gcs_client", no_client)
    cache = tmp_path / "cache"
    assert Tokenizer.load("gs://models/tiny.model", cache_dir=cache).vocab_size == 1000
    assert not cache.exists()
