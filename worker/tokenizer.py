"""The Gemma 3 tokenizer: a SentencePiece model, loaded from a local path, a `gs://` URI or a model proto.

Gemma's special ids are fixed by the model: pad 0, eos 1, bos 2; the chat markers `<start_of_turn>` and
`<end_of_turn>` are single pieces of the vocabulary.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import sentencepiece as spm

OFFICIAL_TOKENIZER_URI = "gs://gemma-data/tokenizers/tokenizer_gemma3.model"
START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tputune" / "tokenizers"


class TokenizerError(Exception):
    """The tokenizer cannot be loaded, or lacks a piece the data needs."""


class Tokenizer:
    """A thin, typed wrapper over `sentencepiece.SentencePieceProcessor`."""

    def __init__(self, processor: spm.SentencePieceProcessor) -> None:
        self.processor = processor

    @classmethod
    def load(cls, uri_or_path: str | Path, cache_dir: str | Path | None = None) -> Tokenizer:
        """Load from a local path or a `gs://` URI (read on the FUSE mount, or downloaded once to a cache)."""
        path = _local_copy(str(uri_or_path), Path(cache_dir or DEFAULT_CACHE_DIR))
        if not path.is_file():
            raise TokenizerError(f"tokenizer model {uri_or_path} does not exist")
        try:
            return cls.from_model_proto(path.read_bytes())
        except TokenizerError as error:
            raise TokenizerError(f"{uri_or_path} is not a SentencePiece model: {error}") from error

    @classmethod
    def from_model_proto(cls, model_proto: bytes) -> Tokenizer:
        """Load from a serialized SentencePiece `ModelProto` (as the GGUF importer builds it)."""
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(model_proto)
        except RuntimeError as error:
            raise TokenizerError(str(error)) from error
        return cls(processor)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without bos/eos."""
        return list(self.processor.Encode(text, out_type=int))

    def encode_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        """Token ids of each text, encoded by SentencePiece's own thread pool (-1: all cores)."""
        return [list(ids) for ids in self.processor.Encode(texts, out_type=int, num_threads=num_threads)]

    def encode_batch_arrays(self, texts: list[str], num_threads: int = -1) -> list[np.ndarray]:
        """Like `encode_batch`, as int32 arrays: a few bytes a token instead of a Python int each."""
        return list(self.processor.Encode(texts, out_type="numpy", num_threads=num_threads))

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return str(self.processor.Decode([int(token) for token in ids]))

    def piece_to_id(self, piece: str) -> int | None:
        """The id of `piece`, or None when the vocabulary lacks it."""
        token = int(self.processor.PieceToId(piece))
        # SentencePiece answers unk_id for a piece it lacks.
        return token if self.processor.IdToPiece(token) == piece else None

    @property
    def vocab_size(self) -> int:
        return int(self.processor.GetPieceSize())

    @property
    def pad_id(self) -> int:
        return int(self.processor.pad_id())

    @property
    def bos_id(self) -> int:
        return int(self.processor.bos_id())

    @property
    def eos_id(self) -> int:
        return int(self.processor.eos_id())

    @property
    def start_of_turn_id(self) -> int:
        return self._marker_id(START_OF_TURN)

    @property
    def end_of_turn_id(self) -> int:
        return self._marker_id(END_OF_TURN)

    def _marker_id(self, piece: str) -> int:
        token = self.piece_to_id(piece)
        if token is None:
            raise TokenizerError(f"the tokenizer has no {piece} piece, so it cannot encode chat data")
        return token


def _local_copy(uri: str, cache_dir: Path) -> Path:
    """A local file with the contents of `uri`; a `gs://` object is downloaded at most once per cache."""
    if not uri.startswith("gs://"):
        return Path(uri)
    # Imported here: data.py imports this module, and owns the one way to reach GCS.
    from worker.data import fuse_path, gcs_blob

    mounted = fuse_path(uri)
    if mounted is not None:
        return mounted
    bucket, _, name = uri[len("gs://") :].partition("/")
    cached = cache_dir / bucket / name
    if cached.is_file():
        return cached
    blob = gcs_blob(uri)
    if blob is None:
        raise TokenizerError(f"tokenizer model {uri} does not exist")
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Download beside the target and rename, so processes sharing the cache never read half a file.
    handle, partial = tempfile.mkstemp(dir=cached.parent, prefix=f".{cached.name}.")
    os.close(handle)
    try:
        blob.download_to_filename(partial)
        os.replace(partial, cached)
    finally:
        Path(partial).unlink(missing_ok=True)
    return cached


def train_bpe_model(
    sentences: Iterable[str], prefix: Path, vocab_size: int, *, hard_vocab_limit: bool = True
) -> Path:
    """Train a small SentencePiece BPE model in Gemma's conventions (pad 0, eos 1, bos 2, unk 3, the turn
    markers as single pieces, byte fallback) for the tiny test model and the training benchmark; returns
    the `.model` path. `hard_vocab_limit=False` accepts a corpus with fewer pieces than `vocab_size`."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        user_defined_symbols=[START_OF_TURN, END_OF_TURN],
        # Like Gemma's: text round-trips exactly (newlines and runs of spaces included).
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        max_sentence_length=1 << 16,
        num_threads=1,
        hard_vocab_limit=hard_vocab_limit,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")
