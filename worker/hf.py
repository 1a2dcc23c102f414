"""Gemma 3 weights in the Hugging Face layout: fine-tuned weights exported as `Gemma3ForCausalLM` in
safetensors, with its config and tokenizer, for `transformers`, vLLM and the tools that read that layout
(and convert it: llama.cpp); and such a model (or a multimodal `Gemma3ForConditionalGeneration`'s text
model) read as base weights.

What `gm.nn.Gemma3_*` and `transformers`' Gemma 3 store differently, and is changed here:
- each projection is one `(out_features, in_features)` matrix: gemma's `q_einsum` `(heads, embed, head_dim)`
  is `q_proj` `(heads * head_dim, embed)`, its `kv_einsum` holds `k_proj` and `v_proj`, `attn_vec_einsum`
  `(heads, head_dim, embed)` is `o_proj` `(embed, heads * head_dim)`; the MLP's `gating_einsum` holds
  `gate_proj` (index 0, the one through the GELU) and `up_proj`, `linear` is `down_proj` transposed;
- RMSNorm scales are the same numbers (both compute `x * (1 + scale)`), and rotary embeddings rotate the
  same halves of each head, so no permutation is needed; the output layer is tied to the embedding;
- the text model only: the 4B and larger ones are exported as the text model `Gemma3ForCausalLM`.

Each tensor is gathered to the first JAX process (across hosts, one tensor at a time) and written by it, in
shards of at most `max_shard_bytes`, with `model.safetensors.index.json` when there is more than one. Read,
each tensor is taken from its file by its offsets, one at a time.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from etils import epath
from gemma import gm

from worker.tokenizer import Tokenizer

Params = dict[str, Any]

# transformers' own default shard size ("5GB"); a shard never splits a tensor.
MAX_SHARD_BYTES = 5 * 10**9
# Gemma 3's context lengths (its model cards): 32K tokens for 270M and 1B, 128K for the larger ones.
_MAX_POSITIONS = {"270m": 32_768, "1b": 32_768}
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_NUMPY_DTYPES = {code: np.dtype(name) for name, code in _SAFETENSORS_DTYPES.items()}
# Where a checkpoint keeps the text model's layers: Gemma3ForCausalLM's, and Gemma3ForConditionalGeneration's
# as transformers 5 and 4 save it (its vision tower and projector are not read).
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")

# Gemma's turn format, as the trainer lays out chat data (`worker/data.py`): a system message opens the
# first user turn; `assistant` is Gemma's `model`.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content']"
    " + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def hf_config(
    config: gm.nn.config.TransformerConfig, model_name: str, dtype: Any, *, eos_ids: list[int]
) -> dict[str, Any]:
    """`config.json` of a `Gemma3ForCausalLM` equal to the gemma network of `config`."""
    # transformers scales queries by `query_pre_attn_scalar ** -0.5` (an int); gemma by the config's choice.
    norm = gm.nn.config.QueryPreAttentionNormalisation
    match config.query_pre_attn_norm:
        case norm.BY_ONE_OVER_SQRT_HEAD_DIM:
            scalar = config.head_dim
        case norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS:
            scalar = config.embed_dim // config.num_heads
        case other:  # (no Gemma 3 size)
            raise ValueError(f"transformers' Gemma 3 cannot scale queries as {other}")
    layer_types = [
        "sliding_attention" if kind == gm.nn.AttentionType.LOCAL_SLIDING else "full_attention"
        for kind in config.attention_types
    ]
    rope_scaling = (
        None
        if config.global_scale_factor == 1.0
        else {"rope_type": "linear", "factor": float(config.global_scale_factor)}
    )
    torch_dtype = np.dtype(dtype).name
    if torch_dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"weights in {torch_dtype} have no Hugging Face export here")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": config.num_embed,
        "hidden_size": config.embed_dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": max_positions(model_name),
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": scalar,
        "sliding_window": config.sliding_window_size,
        "layer_types": layer_types,
        # transformers 4.x names the rotary bases so; 5.x reads them into `rope_parameters`.
        "rope_theta": float(config.global_base_frequency),
        "rope_local_base_freq": float(config.local_base_frequency),
        "rope_scaling": rope_scaling,
        "final_logit_softcapping": config.final_logit_softcap,
        "attn_logit_softcapping": config.attn_logits_soft_cap,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0],
        "bos_token_id": 2,
        "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
        "use_cache": True,
    }


def max_positions(model_name: str) -> int:
    """The context length of `model_name`'s size (the `tiny` test model's: 270M's)."""
    size = model_name.split("-")[1] if model_name.startswith("gemma3-") else "270m"
    return _MAX_POSITIONS.get(size, 131_072)


def hf_tensors(params: Params, config: gm.nn.config.TransformerConfig) -> Iterator[tuple[str, Any]]:
    """(name, array) of each `Gemma3ForCausalLM` weight, in the order written; arrays stay as given (JAX
    arrays are converted one at a time by the caller)."""
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim

    def rows(weight: Any, count: int) -> Any:
        """(count, embed, head_dim) -> (count * head_dim, embed)."""
        return weight.transpose(0, 2, 1).reshape(count * head_dim, -1)

    yield "model.embed_tokens.weight", params["embedder"]["input_embedding"]
    for layer in range(config.num_layers):
        block, prefix = params[f"layer_{layer}"], f"model.layers.{layer}."
        attn, mlp = block["attn"], block["mlp"]
        yield prefix + "self_attn.q_proj.weight", rows(attn["q_einsum"]["w"], heads)
        kv = attn["kv_einsum"]["w"]
        yield prefix + "self_attn.k_proj.weight", rows(kv[0], kv_heads)
        yield prefix + "self_attn.v_proj.weight", rows(kv[1], kv_heads)
        yield prefix + "self_attn.o_proj.weight", attn["attn_vec_einsum"]["w"].reshape(heads * head_dim, -1).T
        yield prefix + "self_attn.q_norm.weight", attn["_query_norm"]["scale"]
        yield prefix + "self_attn.k_norm.weight", attn["_key_norm"]["scale"]
        gating = mlp["gating_einsum"]
        if not config.transpose_gating_einsum:  # (2, embed, hidden) -> (2, hidden, embed)
            gating = gating.transpose(0, 2, 1)
        yield prefix + "mlp.gate_proj.weight", gating[0]
        yield prefix + "mlp.up_proj.weight", gating[1]
        yield prefix + "mlp.down_proj.weight", mlp["linear"].T
        yield prefix + "input_layernorm.weight", block["pre_attention_norm"]["scale"]
        yield prefix + "post_attention_layernorm.weight", block["post_attention_norm"]["scale"]
        yield prefix + "pre_feedforward_layernorm.weight", block["pre_ffw_norm"]["scale"]
        yield prefix + "post_feedforward_layernorm.weight", block["post_ffw_norm"]["scale"]
    yield "model.norm.weight", params["final_norm"]["scale"]


def hf_adapter_tensors(lora: Params, config: gm.nn.config.TransformerConfig) -> Iterator[tuple[str, Any]]:
    """(name, array) of each weight of a gemma LoRA adapter (`gm.nn.LoRA`'s `a`, `b` of every einsum) as
    PEFT's LoRA on those projections: `lora_A` `(rank, in_features)`, `lora_B` `(out_features, rank)`, so
    that `lora_B @ lora_A` is the change of the `hf_tensors` weight (PEFT's scaling `lora_alpha / r` = 1).
    The gating einsum's one adapter is both `gate_proj`'s and `up_proj`'s `lora_A`."""
    if not config.transpose_gating_einsum:  # (every Gemma 3 size transposes it)
        raise ValueError("a LoRA adapter of an untransposed gating einsum has no PEFT layout here")

    def adapter(node: Params, key: str = "_LoRAEinsum_0") -> tuple[Any, Any]:
        return node[key]["lora"]["a"], node[key]["lora"]["b"]

    def pair(module: str, a: Any, b: Any) -> Iterator[tuple[str, Any]]:
        yield f"{module}.lora_A.weight", a
        yield f"{module}.lora_B.weight", b

    for layer in range(config.num_layers):
        block, prefix = lora[f"layer_{layer}"], f"base_model.model.model.layers.{layer}."
        attn, mlp = block["attn"], block["mlp"]
        a, b = adapter(attn["q_einsum"])  # a (embed, r), b (r, heads, head_dim)
        rank = a.shape[-1]
        yield from pair(prefix + "self_attn.q_proj", a.T, b.reshape(rank, -1).T)
        a, b = adapter(attn["kv_einsum"])  # b (r, 2, kv_heads, head_dim)
        yield from pair(prefix + "self_attn.k_proj", a.T, b[:, 0].reshape(rank, -1).T)
        yield from pair(prefix + "self_attn.v_proj", a.T, b[:, 1].reshape(rank, -1).T)
        a, b = adapter(attn["attn_vec_einsum"])  # a (heads, head_dim, r), b (r, embed)
        yield from pair(prefix + "self_attn.o_proj", a.reshape(-1, rank).T, b.T)
        a, b = adapter(mlp, "_LoRAEinsum_gating_einsum")  # a (embed, r), b (r, 2, hidden)
        yield from pair(prefix + "mlp.gate_proj", a.T, b[:, 0].T)
        yield from pair(prefix + "mlp.up_proj", a.T, b[:, 1].T)
        a, b = adapter(mlp, "_LoRAEinsum_linear")  # a (hidden, r), b (r, embed)
        yield from pair(prefix + "mlp.down_proj", a.T, b.T)


def hub_model_id(model_name: str) -> str | None:
    """The Hugging Face id of the official weights of `model_name` (`gemma3-1b-it`), where its text model is
    the whole `Gemma3ForCausalLM` an adapter applies to as exported: 270M and 1B (the larger ones are
    multimodal there, their layers under another name)."""
    parts = model_name.split("-")
    if len(parts) != 3 or parts[1] not in ("270m", "1b"):
        return None
    _, size, kind = parts
    if size == "270m":  # (its pretrained one has no suffix)
        return "google/gemma-3-270m-it" if kind == "it" else "google/gemma-3-270m"
    return f"google/gemma-3-1b-{kind}"


def peft_base(model_name: str, base_checkpoint_uri: str | None, adapter_uri: str | None) -> str | None:
    """A PEFT adapter's `base_model_name_or_path`: the Hub id of the official weights, where a job trained
    on them (no other base weights, no adapter folded in)."""
    return hub_model_id(model_name) if base_checkpoint_uri is None and adapter_uri is None else None


PEFT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def export_hf(
    params: Params,
    uri: str,
    *,
    config: gm.nn.config.TransformerConfig,
    model_name: str,
    tokenizer: Tokenizer,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write `params` (the plain Gemma tree, in the dtype to export) as a Hugging Face model under `uri`.

    Every JAX process must call it (the tensors are gathered collectively); the first one writes."""
    root = epath.Path(uri)
    dtype = _write_weights(root, "model", lambda tree: hf_tensors(tree, config), params, max_shard_bytes)
    if jax.process_index() != 0:
        return
    eos_ids = [tokenizer.eos_id]
    end_of_turn = tokenizer.piece_to_id("<end_of_turn>")
    if model_name.endswith("-it") and end_of_turn is not None:
        eos_ids.append(end_of_turn)
    _write_json(root / "config.json", hf_config(config, model_name, dtype, eos_ids=eos_ids))
    _write_json(
        root / "generation_config.json",
        {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos_ids, "pad_token_id": tokenizer.pad_id},
    )
    _write_tokenizer(root, tokenizer)


def export_hf_adapter(
    lora: Params, uri: str, *, config: gm.nn.config.TransformerConfig, base_model: str | None
) -> None:
    """Write a gemma LoRA adapter as a PEFT adapter (`adapter_model.safetensors`, `adapter_config.json`)
    under `uri`, for `peft.PeftModel` or vLLM's LoRA serving on the base model (`base_model`: its name or
    path, as `base_model_name_or_path`). Every JAX process must call it; the first one writes."""
    root = epath.Path(uri)
    _write_weights(root, "adapter_model", lambda tree: hf_adapter_tensors(tree, config), lora, None)
    if jax.process_index() != 0:
        return
    rank = int(lora["layer_0"]["attn"]["q_einsum"]["_LoRAEinsum_0"]["lora"]["a"].shape[-1])
    _write_json(
        root / "adapter_config.json",
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": rank,
            "lora_alpha": rank,  # (scaling 1: gemma adds A·B as it is)
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": PEFT_TARGET_MODULES,
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
        },
    )


def _write_weights(
    root: epath.Path,
    stem: str,
    tensors_of: Callable[[Params], Iterator[tuple[str, Any]]],
    tree: Params,
    max_shard_bytes: int | None,
) -> np.dtype:
    """Write the arrays `tensors_of(tree)` yields as `{stem}.safetensors`, or in shards of at most
    `max_shard_bytes` with `{stem}.safetensors.index.json`; returns their dtype. Each array is gathered to
    the first process, which writes it: one array's bytes on the host at a time."""
    writer = jax.process_index() == 0
    if writer:
        root.mkdir(parents=True, exist_ok=True)
    # Shapes and dtypes first: each shard's header is written before its data.
    named = abstract_tensors(tensors_of, tree)
    abstract = dict(named)
    names = [name for name, _ in named]
    shards = _plan_shards(named, max_shard_bytes)
    tensors = tensors_of(tree)
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards):
        file = (
            f"{stem}.safetensors"
            if len(shards) == 1
            else f"{stem}-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        handle = (root / file).open("wb") if writer else None
        try:
            if handle is not None:
                handle.write(_header([(name, abstract[name]) for name in shard]))
            for name in shard:
                got, array = next(tensors)
                assert got == name
                host = gathered(array)
                if handle is not None:
                    handle.write(np.ascontiguousarray(host).tobytes())
                weight_map[name] = file
        finally:
            if handle is not None:
                handle.close()
    if writer and len(shards) > 1:
        total = sum(_nbytes(abstract[name]) for name in names)
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(root / f"{stem}.safetensors.index.json", index_json)
    return np.dtype(abstract[names[0]].dtype)


def abstract_tensors(
    tensors_of: Callable[[Params], Iterator[tuple[str, Any]]], tree: Params
) -> list[tuple[str, jax.ShapeDtypeStruct]]:
    """(name, shape and dtype) of each array `tensors_of(tree)` yields, in order, computing none of them."""
    names: list[str] = []

    def arrays(tree: Params) -> list[Any]:
        named = list(tensors_of(tree))
        names[:] = [name for name, _ in named]
        return [array for _, array in named]

    shapes = jax.eval_shape(arrays, tree)  # (fills `names`)
    return list(zip(names, shapes, strict=True))


def _write_tokenizer(root: epath.Path, tokenizer: Tokenizer) -> None:
    """The SentencePiece model as `tokenizer.model`, and the settings transformers' `GemmaTokenizer` takes."""
    processor = tokenizer.processor
    (root / "tokenizer.model").write_bytes(processor.serialized_model_proto())
    piece = processor.IdToPiece
    special = {
        "bos_token": piece(tokenizer.bos_id),
        "eos_token": piece(tokenizer.eos_id),
        "pad_token": piece(tokenizer.pad_id),
        "unk_token": piece(processor.unk_id()),
    }
    _write_json(
        root / "tokenizer_config.json",
        {
            "tokenizer_class": "GemmaTokenizer",
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "spaces_between_special_tokens": False,
            "sp_model_kwargs": {},
            "chat_template": CHAT_TEMPLATE,
            **special,
        },
    )
    _write_json(root / "special_tokens_map.json", special)


def gathered(array: Any) -> np.ndarray:
    """The whole of `array` on this host (a collective where it spans processes)."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)


def _nbytes(leaf: Any) -> int:
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def _plan_shards(tensors: list[tuple[str, Any]], max_bytes: int | None) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, leaf in tensors:
        nbytes = _nbytes(leaf)
        if shards[-1] and max_bytes is not None and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _header(tensors: list[tuple[str, Any]]) -> bytes:
    """A safetensors header: its length (u64, little-endian), then JSON padded with spaces to 8 bytes."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, leaf in tensors:
        nbytes = _nbytes(leaf)
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES[np.dtype(leaf.dtype).name],
            "shape": list(leaf.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_json(path: epath.Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


class HfImportError(ValueError):
    """The directory is not a Hugging Face Gemma 3 checkpoint of the job's model."""


def is_hf_model(uri: str) -> bool:
    """Whether `uri` is a Hugging Face model directory (its `config.json`), not an orbax checkpoint."""
    return (epath.Path(uri) / "config.json").is_file()


def hf_tokenizer(uri: str) -> str | None:
    """The SentencePiece model of the Hugging Face model directory `uri` (`tokenizer.model`), if it is one."""
    try:
        if is_hf_model(uri) and (epath.Path(uri) / "tokenizer.model").is_file():
            return str(epath.Path(uri) / "tokenizer.model")
    except OSError:  # (the base's own errors are the weights' to report)
        return None
    return None


def load_hf_params(uri: str, config: gm.nn.config.TransformerConfig, dtype: Any) -> Params:
    """The gemma params (host arrays in `dtype`) of the Hugging Face Gemma 3 model under `uri`, whose
    `config.json` must describe the network of `config`. HfImportError says what does not fit."""
    root = epath.Path(uri)
    settings = json.loads((root / "config.json").read_text())
    text = settings.get("text_config") or settings  # (a multimodal checkpoint's text model)
    expected = {
        "num_hidden_layers": config.num_layers,
        "hidden_size": config.embed_dim,
        "intermediate_size": config.hidden_dim,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
    }
    for key, value in expected.items():
        if text.get(key) != value:
            raise HfImportError(f"{uri}/config.json has {key} {text.get(key)}, where this model has {value}")
    weights = _read_weights(root)
    prefix = next(
        (p for p in _TEXT_PREFIXES if f"{p}embed_tokens.weight" in weights),
        None,
    )
    if prefix is None:
        raise HfImportError(f"{uri} holds no Gemma 3 text model (no embed_tokens.weight)")

    def take(name: str) -> np.ndarray:
        if f"{prefix}{name}" not in weights:
            raise HfImportError(f"{uri} lacks the weight {prefix}{name}")
        return np.asarray(weights[f"{prefix}{name}"](), dtype=dtype)

    flat = gemma_params_from_hf_layout(
        take,
        layers=config.num_layers,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        transposed_gating=config.transpose_gating_einsum,
    )
    return nested(flat)


def gemma_params_from_hf_layout(
    take: Callable[[str], np.ndarray],
    *,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    transposed_gating: bool = True,
) -> dict[str, np.ndarray]:
    """Gemma's params, flat (`/`-joined paths), from weights in transformers' layout: `take(name)` gives the
    one named so (`embed_tokens.weight`, `layers.{i}.self_attn.q_proj.weight`, ...) as `(out_features,
    in_features)`, norm scales as gemma's. (llama.cpp's GGUF holds the same layout under its own names, its
    norms as 1 + scale: `worker.gguf_import` reads it through this too.)"""

    def heads_last(weight: np.ndarray, count: int) -> np.ndarray:
        """(count * head_dim, embed) -> (count, embed, head_dim), the layout of gemma's q/kv einsums."""
        return weight.reshape(count, head_dim, -1).transpose(0, 2, 1)

    flat = {"embedder/input_embedding": take("embed_tokens.weight"), "final_norm/scale": take("norm.weight")}
    for layer in range(layers):
        name, path = f"layers.{layer}.", f"layer_{layer}/"
        flat[path + "attn/q_einsum/w"] = heads_last(take(name + "self_attn.q_proj.weight"), heads)
        flat[path + "attn/kv_einsum/w"] = np.stack(
            [
                heads_last(take(name + "self_attn.k_proj.weight"), kv_heads),
                heads_last(take(name + "self_attn.v_proj.weight"), kv_heads),
            ]
        )
        o_proj = take(name + "self_attn.o_proj.weight")
        flat[path + "attn/attn_vec_einsum/w"] = o_proj.T.reshape(heads, head_dim, -1)
        # gemma applies the GELU to index 0 of the gating einsum.
        gating = np.stack([take(name + "mlp.gate_proj.weight"), take(name + "mlp.up_proj.weight")])
        flat[path + "mlp/gating_einsum"] = gating if transposed_gating else gating.transpose(0, 2, 1)
        flat[path + "mlp/linear"] = take(name + "mlp.down_proj.weight").T
        for hf_norm, module in _LAYER_NORMS.items():
            flat[f"{path}{module}/scale"] = take(f"{name}{hf_norm}.weight")
    return flat


# The norms of layer i: transformers' name -> gemma's module under `layer_i`.
_LAYER_NORMS = {
    "input_layernorm": "pre_attention_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "pre_ffw_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn/_query_norm",
    "self_attn.k_norm": "attn/_key_norm",
}


def nested(flat: dict[str, Any]) -> Params:
    """A params tree from its flat (`/`-joined) paths."""
    params: Params = {}
    for name, array in flat.items():
        *parents, leaf = name.split("/")
        node = params
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = array
    return params


def _read_weights(root: epath.Path) -> dict[str, Callable[[], np.ndarray]]:
    """Each weight of the model's safetensors files (one, or the shards its index names), by name: a
    function that reads it (from its file, by its offsets)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HfImportError(f"{root} has no model.safetensors (nor model.safetensors.index.json)")
    weights: dict[str, Callable[[], np.ndarray]] = {}
    for file in files:
        path = root / file
        with path.open("rb") as handle:
            size = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _NUMPY_DTYPES:
                raise HfImportError(f"{path}: {name} is {info['dtype']}; float32, bfloat16 or float16 read")
            weights[name] = _reader(path, 8 + size, info)
    return weights


def _reader(path: epath.Path, data_start: int, info: dict[str, Any]) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        begin, end = info["data_offsets"]
        with path.open("rb") as handle:
            handle.seek(data_start + begin)
            data = handle.read(end - begin)
        return np.frombuffer(data, _NUMPY_DTYPES[info["dtype"]]).reshape(info["shape"])

    return read
