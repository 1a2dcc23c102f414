"""Fixtures for the worker tests: a generated story corpus and a tiny SentencePiece tokenizer.

* ``story_corpus`` (session): a TinyStories-format .txt with 400 generated stories.
* ``tiny_tokenizer_path`` (session): a ~1000-piece SentencePiece model trained here in well under a second,
  with Gemma's special ids (pad 0, eos 1, bos 2, unk 3), byte fallback and the chat markers as single pieces.
* ``tiny_tokenizer`` (session): that model loaded as a :class:`worker.tokenizer.Tokenizer`.
* ``plain_tokenizer`` (session): a smaller SentencePiece model without the chat markers.
* ``tiny`` (module): the tiny model (full, float32) and its initial params at seed 0, as a run starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm

from worker.stories import generate_stories, write_txt
from worker.tokenizer import Tokenizer, train_bpe_model

STORY_CORPUS_SIZE = 400
TINY_VOCAB_SIZE = 1000


@pytest.fixture(scope="session")
def story_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_txt(
        tmp_path_factory.mktemp("stories") / "stories.txt", generate_stories(STORY_CORPUS_SIZE, 0)
    )


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("tokenizer") / "tiny"
    # A different seed from the corpus, so the tests also meet words the tokenizer was not trained on.
    return train_bpe_model(generate_stories(STORY_CORPUS_SIZE, 1), prefix, TINY_VOCAB_SIZE)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_path: Path) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_path)


@pytest.fixture(scope="session")
def plain_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    prefix = tmp_path_factory.mktemp("tokenizer") / "plain"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(generate_stories(50, 0)),
        model_prefix=str(prefix),
        vocab_size=400,
        byte_fallback=True,
        minloglevel=2,
    )
    return Tokenizer.load(prefix.with_suffix(".model"))


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer: Tokenizer) -> tuple[Any, dict]:
    import jax.numpy as jnp  # (here: gemma's import takes seconds, and not every module needs it)

    from worker import model as gemma
    from worker import train

    model = gemma.build_model(
        "tiny", tiny_tokenizer.vocab_size, lora_rank=None, param_dtype=jnp.float32, compute_dtype=jnp.float32
    )
    mesh = train.make_mesh(1)
    params, _ = model.init_params(0, (train.tree_shardings(mesh, model.abstract_params()[0]), {}))
    return model, params
