"""The GGUF export (`worker/gguf_export.py`): what transformers loads from the file (its GGUF reader) computes
what the gemma network computes, with the same tokenizer and chat template; llama.cpp's own reader
(`gguf.GGUFReader`) reads each type back within its precision; and every official size is built as llama.cpp
assumes Gemma 3 is. (The real 270M's file against the one llama.cpp's converter wrote:
`tests/worker/test_gguf_import.py`.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemma import gm
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from tests.worker.conftest import TINY_VOCAB_SIZE
from tests.worker.helpers import run_hf
from tests.worker.test_hf_export import CHAT, _random_params
from worker import model as gemma
from worker.config import GGUF_TYPES
from worker.data import encode_documents
from worker.gguf_export import OUTTYPES, export_gguf, gguf_metadata
from worker.gguf_import import gguf_tensor_name
from worker.hf import hf_tensors
from worker.tokenizer import Tokenizer


def _llama_cpp_tiny(**sizes: Any) -> Any:
    """A tiny Gemma 3 laid out as llama.cpp and transformers' GGUF reader take any Gemma 3 to be: every
    sixth layer global, and 256-wide heads (transformers' default query scale: GGUF does not store it)."""
    return dataclasses.replace(gemma.tiny_config(TINY_VOCAB_SIZE, layers=6, **sizes), head_dim=256)


def test_transformers_computes_from_the_gguf_what_gemma_computes(
    tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    config = _llama_cpp_tiny()
    params = _random_params(config, 0)
    out = tmp_path / "model-f32.gguf"
    export_gguf(params, str(out), config=config, model_name="tiny", tokenizer=tiny_tokenizer, outtype="f32")

    # 70 tokens: past the sliding window (32) of the first five layers.
    tokens = np.random.default_rng(0).integers(4, TINY_VOCAB_SIZE, size=(2, 70), dtype=np.int32)
    expected = np.asarray(
        gm.nn.Transformer(config=config, dtype=jnp.float32).apply({"params": params}, tokens).logits
    )
    text = "Once upon a time, a little fox found a shiny red ball.\n\nThe  end."
    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    result, logits = run_hf(
        tmp_path,
        tmp_path / "side",
        tokens=tokens,
        texts=[text],
        chats=[messages],
        config=True,
        gguf_file=out.name,
    )
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)
    assert result["texts"] == [[tiny_tokenizer.bos_id, *tiny_tokenizer.encode(text)]]
    (trained,) = encode_documents([CHAT], tiny_tokenizer)
    assert result["chats"] == [trained.tokens.tolist()[:-1]]  # (the document's closing eos: not a chat's)
    read = result["config"]
    assert read["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (read["sliding_window"], read["vocab_size"]) == (32, TINY_VOCAB_SIZE)


@pytest.mark.parametrize("outtype", GGUF_TYPES)
def test_each_type_reads_back_within_its_precision(
    tmp_path: Path, tiny_tokenizer: Tokenizer, outtype: str
) -> None:
    """Read by llama.cpp's own reader: norms in float32 as 1 + scale; every matrix in the type asked for,
    except (q8_0) those whose rows are not whole 32-value blocks: 80-wide here, written f16 as llama.cpp's
    converter writes them; each value within what its type holds."""
    config = _llama_cpp_tiny(embed_dim=80)
    params = _random_params(config, 3)
    out = tmp_path / f"model-{outtype}.gguf"
    export_gguf(
        params,
        str(out),
        config=config,
        model_name="tiny",
        tokenizer=tiny_tokenizer,
        outtype=outtype,
        name="ft-1",
    )
    reader = GGUFReader(out)
    fields = {name: field.contents() for name, field in reader.fields.items() if name.startswith("general.")}
    assert fields["general.name"] == "ft-1"
    assert fields["general.file_type"] == OUTTYPES[outtype][1]
    qtype = OUTTYPES[outtype][0]
    # transformers' weights by llama.cpp's names
    expected = {
        gguf_tensor_name(name.removeprefix("model.")): (name, w) for name, w in hf_tensors(params, config)
    }
    assert len(reader.tensors) == len(expected) == 2 + 13 * 6
    kinds = set()
    for tensor in reader.tensors:
        hf_name, weight = expected[tensor.name]
        want = np.asarray(weight, np.float32)
        got = dequantize(tensor.data, tensor.tensor_type).reshape(want.shape)
        if hf_name.endswith("norm.weight"):
            assert tensor.tensor_type == GGMLQuantizationType.F32
            np.testing.assert_array_equal(got, want + 1)
            continue
        kinds.add(tensor.tensor_type)
        tolerance = {
            GGMLQuantizationType.F32: 0.0,
            GGMLQuantizationType.F16: 2**-10,
            GGMLQuantizationType.BF16: 2**-8,
            GGMLQuantizationType.Q8_0: 1 / 127,
        }[tensor.tensor_type]
        # (relative to each value for the floats; to the largest of its 32-value block for q8_0)
        scale = np.abs(want)
        if tensor.tensor_type == GGMLQuantizationType.Q8_0:
            scale = np.repeat(scale.reshape(-1, 32).max(axis=1), 32).reshape(want.shape)
        assert np.all(np.abs(got - want) <= tolerance * scale + 1e-7), (tensor.name, tensor.tensor_type)
    if qtype == GGMLQuantizationType.Q8_0:
        assert kinds == {GGMLQuantizationType.Q8_0, GGMLQuantizationType.F16}
    else:
        assert kinds == {qtype}


@pytest.mark.parametrize("size", ["270M", "1B", "4B", "12B", "27B"])
def test_official_sizes_are_built_as_llama_cpp_assumes(size: str, tiny_tokenizer: Tokenizer) -> None:
    """llama.cpp reads neither the layer pattern, the local rotary base nor the query scale of a Gemma 3
    from its file: it takes every sixth layer as global, 10,000 as the base, and scales queries by the head
    size (27B: by width / heads). Each official size is built so; the file says the rest."""
    config = getattr(gm.nn, f"Gemma3_{size}").config
    assert list(config.attention_types) == [
        gm.nn.AttentionType.GLOBAL if (layer + 1) % 6 == 0 else gm.nn.AttentionType.LOCAL_SLIDING
        for layer in range(config.num_layers)
    ]
    assert config.local_base_frequency == 10_000
    norm = gm.nn.config.QueryPreAttentionNormalisation
    assert config.query_pre_attn_norm == (
        norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS if size == "27B" else norm.BY_ONE_OVER_SQRT_HEAD_DIM
    )
    assert config.final_logit_softcap is None and config.attn_logits_soft_cap is None

    metadata = {
        key: value
        for key, _, value in gguf_metadata(
            config, f"gemma3-{size.lower()}-it", tiny_tokenizer, file_type=OUTTYPES["bf16"][1], name="x"
        )
    }
    assert metadata["gemma3.block_count"] == config.num_layers
    # (an instruction-tuned model's turn ends at <end_of_turn>; a pretrained one's file names no such token)
    assert metadata["tokenizer.ggml.eot_token_id"] == tiny_tokenizer.end_of_turn_id
    pretrained = gguf_metadata(config, "gemma3-1b-pt", tiny_tokenizer, file_type=OUTTYPES["f16"][1], name="x")
    assert "tokenizer.ggml.eot_token_id" not in {key for key, _, _ in pretrained}
    assert metadata["gemma3.attention.key_length"] == config.head_dim
    assert metadata["gemma3.attention.sliding_window"] == config.sliding_window_size
    assert metadata["gemma3.context_length"] == (32_768 if size in ("270M", "1B") else 131_072)
    # The larger sizes scale their global layers' rotations by 8 (linearly); 270M and 1B do not.
    scaled = size not in ("270M", "1B")
    assert metadata.get("gemma3.rope.scaling.factor") == (8.0 if scaled else None)
    assert metadata.get("gemma3.rope.scaling.type") == ("linear" if scaled else None)


def test_the_embedding_has_a_row_per_token(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    """A model that embeds more rows than its tokenizer has pieces (a job allows it): the file has a row
    per token, as llama.cpp wants and its converter writes, the first rows of the embedding."""
    config = gemma.tiny_config(tiny_tokenizer.vocab_size + 24)
    params = _random_params(config, 7)
    out = tmp_path / "model-f32.gguf"
    export_gguf(params, str(out), config=config, model_name="tiny", tokenizer=tiny_tokenizer, outtype="f32")
    reader = GGUFReader(out)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == tiny_tokenizer.vocab_size
    np.testing.assert_array_equal(
        np.asarray(embedding.data),
        np.asarray(params["embedder"]["input_embedding"])[: tiny_tokenizer.vocab_size],
    )


def test_types_are_the_specs() -> None:
    assert tuple(OUTTYPES) == GGUF_TYPES


def test_exported_weights_are_those_given(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    """bf16 weights exported as bf16 are the same bits: no float32 round trip changes them."""
    config = gemma.tiny_config(TINY_VOCAB_SIZE)
    params = jax.tree.map(lambda leaf: leaf.astype(jnp.bfloat16), _random_params(config, 5))
    out = tmp_path / "model-bf16.gguf"
    export_gguf(params, str(out), config=config, model_name="tiny", tokenizer=tiny_tokenizer, outtype="bf16")
    embedding = next(t for t in GGUFReader(out).tensors if t.name == "token_embd.weight")
    np.testing.assert_array_equal(
        np.asarray(embedding.data).view(jnp.bfloat16).reshape(TINY_VOCAB_SIZE, -1),
        np.asarray(params["embedder"]["input_embedding"]),
    )
