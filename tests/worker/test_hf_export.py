"""The Hugging Face export (`worker/hf.py`): what transformers loads from it computes what the gemma
network computes, its tokenizer and chat template give the ids the trainer gives, and its config describes
each Gemma 3 size as the official configs do. transformers runs in a process of its own (`run_hf`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gemma import gm
from safetensors.numpy import load_file, save_file

from tests.worker.conftest import TINY_VOCAB_SIZE
from tests.worker.helpers import run_hf
from worker import model as gemma
from worker.data import Message, encode_documents
from worker.hf import (
    HfImportError,
    export_hf,
    export_hf_adapter,
    hf_config,
    hf_tokenizer,
    hub_model_id,
    is_hf_model,
    load_hf_params,
)
from worker.tokenizer import Tokenizer

CHAT = (
    Message("system", "Answer in one word."),
    Message("user", "What color is the sky?"),
    Message("model", "Blue."),
    Message("user", "And grass?"),
    Message("model", "Green."),
)


def _random_params(config: Any, seed: int) -> Any:
    """A tiny Gemma's params, every leaf random: norms and all, so that a scale in the wrong place shows."""
    network = gm.nn.Transformer(config=config, dtype=jnp.float32)
    params = network.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(
        tree,
        [leaf + 0.2 * jax.random.normal(key, leaf.shape) for leaf, key in zip(leaves, keys, strict=True)],
    )


def test_transformers_computes_what_gemma_computes(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    config = gemma.tiny_config(TINY_VOCAB_SIZE)
    params = _random_params(config, 0)
    out = tmp_path / "hf"
    export_hf(
        params, str(out), config=config, model_name="tiny", tokenizer=tiny_tokenizer, max_shard_bytes=300_000
    )

    # Shards of at most 300 kB (the embedding alone is 512 kB: a tensor is never split), and their index.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards == sorted(path.name for path in out.glob("model-*.safetensors"))
    assert len(index["weight_map"]) == 2 + 13 * 2  # (the embedding and final norm; 13 weights a layer)

    # 70 tokens: past the sliding window (32) of the first layer, so its mask and rotary base count too.
    tokens = np.random.default_rng(0).integers(4, TINY_VOCAB_SIZE, size=(2, 70), dtype=np.int32)
    expected = np.asarray(
        gm.nn.Transformer(config=config, dtype=jnp.float32).apply({"params": params}, tokens).logits
    )
    text = "Once upon a time, a little fox found a shiny red ball."
    result, logits = run_hf(out, tmp_path / "side", tokens=tokens, texts=[text], config=True)
    assert result["dtype"] == "torch.float32"
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)
    assert result["texts"] == [[tiny_tokenizer.bos_id, *tiny_tokenizer.encode(text)]]
    assert result["config"]["layer_types"] == ["sliding_attention", "full_attention"]


def test_a_lora_adapter_as_peft_computes_what_gemma_lora_computes(
    tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    """A LoRA adapter exported for PEFT, on the base exported for transformers, computes what the gemma
    LoRA network computes; every adapter weight random (a fresh one's `b` is zero, and would hide a
    mistake)."""
    lora_model = gemma.build_model(
        "tiny", TINY_VOCAB_SIZE, lora_rank=3, param_dtype=jnp.float32, compute_dtype=jnp.float32
    )
    config = lora_model.base.config
    base = _random_params(config, 2)
    adapter = jax.tree.map(
        lambda leaf: 0.3 * jax.random.normal(jax.random.key(leaf.size), leaf.shape),
        lora_model.init_lora(0, None),
    )
    export_hf(base, str(tmp_path / "base"), config=config, model_name="tiny", tokenizer=tiny_tokenizer)
    export_hf_adapter(adapter, str(tmp_path / "adapter"), config=config, base_model=None)
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["peft_type"]) == (3, 3, "LORA")

    tokens = np.random.default_rng(1).integers(4, TINY_VOCAB_SIZE, size=(2, 40), dtype=np.int32)
    segments, positions = np.ones_like(tokens), np.broadcast_to(np.arange(40, dtype=np.int32), tokens.shape)
    expected = gemma.forward(lora_model, adapter, base, tokens, segments, positions)
    _, logits = run_hf(tmp_path / "base", tmp_path / "side", tokens=tokens, adapter=tmp_path / "adapter")
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)
    # (and the adapter changed them: a mapping that dropped it would not pass)
    plain = gm.nn.Transformer(config=config, dtype=jnp.float32).apply({"params": base}, tokens).logits
    assert np.abs(np.asarray(plain) - np.asarray(expected)).max() > 0.1


def test_hub_ids_of_the_official_weights() -> None:
    assert hub_model_id("gemma3-270m-pt") == "google/gemma-3-270m"
    assert hub_model_id("gemma3-270m-it") == "google/gemma-3-270m-it"
    assert hub_model_id("gemma3-1b-pt") == "google/gemma-3-1b-pt"
    assert hub_model_id("gemma3-4b-it") is None and hub_model_id("tiny") is None


def test_a_hugging_face_model_is_read_back_as_it_was_exported(
    tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    """load_hf_params undoes export_hf exactly (shards too); a multimodal checkpoint's text model (its
    layers under `model.language_model.`, the config's under `text_config`) is read as well; what is
    missing is named."""
    config = gemma.tiny_config(TINY_VOCAB_SIZE)
    params = _random_params(config, 3)
    out = tmp_path / "hf"
    export_hf(
        params, str(out), config=config, model_name="tiny", tokenizer=tiny_tokenizer, max_shard_bytes=300_000
    )
    read = load_hf_params(str(out), config, jnp.float32)
    jax.tree.map(np.testing.assert_array_equal, read, jax.device_get(params))
    assert is_hf_model(str(out)) and hf_tokenizer(str(out)) == str(out / "tokenizer.model")

    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    weights = {}
    for shard in out.glob("model-*.safetensors"):
        weights |= load_file(shard)
    renamed = {name.replace("model.", "model.language_model.", 1): array for name, array in weights.items()}
    save_file(
        {**renamed, "model.vision_tower.patch.weight": np.zeros(4, np.float32)},
        multimodal / "model.safetensors",
    )
    settings = json.loads((out / "config.json").read_text())
    (multimodal / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": settings}))
    jax.tree.map(np.testing.assert_array_equal, load_hf_params(str(multimodal), config, jnp.float32), read)

    del renamed["model.language_model.layers.1.mlp.up_proj.weight"]
    save_file(renamed, multimodal / "model.safetensors")
    with pytest.raises(
        HfImportError, match=r"lacks the weight model\.language_model\.layers\.1\.mlp\.up_proj"
    ):
        load_hf_params(str(multimodal), config, jnp.float32)
    (multimodal / "model.safetensors").unlink()
    with pytest.raises(HfImportError, match=r"has no model\.safetensors"):
        load_hf_params(str(multimodal), config, jnp.float32)


def test_chat_template_lays_out_turns_as_the_trainer_does(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    config = gemma.tiny_config(TINY_VOCAB_SIZE)
    out = tmp_path / "hf"
    export_hf(_random_params(config, 1), str(out), config=config, model_name="tiny", tokenizer=tiny_tokenizer)
    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    assistant = [{**m, "role": "assistant"} if m["role"] == "model" else m for m in messages]
    result, _ = run_hf(out, tmp_path / "side", chats=[messages, assistant])
    (trained,) = encode_documents([CHAT], tiny_tokenizer)
    expected = trained.tokens.tolist()[:-1]  # (the document's closing eos: not part of a chat)
    assert result["chats"] == [expected, expected]


# The official Hugging Face configs of Gemma 3 (google/gemma-3-{1b,27b}-pt, config.json / text_config).
OFFICIAL = {
    "1b": {
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "max_position_embeddings": 32768,
        "vocab_size": 262144,
    },
    "27b": {
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "query_pre_attn_scalar": 168,
        "sliding_window": 1024,
        "max_position_embeddings": 131072,
    },
}


@pytest.mark.parametrize("size", ["1b", "27b"])
def test_config_of_each_size_reads_as_the_official_one(tmp_path: Path, size: str) -> None:
    network = getattr(gm.nn, f"Gemma3_{size.upper()}").config
    out = tmp_path / "hf"
    out.mkdir()
    config = hf_config(network, f"gemma3-{size}-it", jnp.bfloat16, eos_ids=[1, 106])
    (out / "config.json").write_text(json.dumps(config))
    read = run_hf(out, tmp_path / "side", config=True)[0]["config"]
    assert {key: read[key] for key in OFFICIAL[size]} == OFFICIAL[size]
    # Every sixth layer is global, as in gemma's pattern; the bases of their rotary embeddings differ.
    assert read["layer_types"] == [
        "full_attention" if (layer + 1) % 6 == 0 else "sliding_attention"
        for layer in range(network.num_layers)
    ]
    rope = read["rope_parameters"]
    assert rope["sliding_attention"]["rope_theta"] == 10_000
    assert rope["full_attention"]["rope_theta"] == 1_000_000
    if size == "1b":
        assert rope["full_attention"]["rope_type"] == "default"
    else:  # (4B and larger stretch the global layers' positions 8 times)
        assert (rope["full_attention"]["rope_type"], rope["full_attention"]["factor"]) == ("linear", 8.0)
    assert (read["eos_token_id"], read["dtype"]) == ([1, 106], "bfloat16")
