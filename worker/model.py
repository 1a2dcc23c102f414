"""Gemma 3 as the trainer uses it: the network for a job, its base weights, the packed-attention forward
pass, LoRA merging and a greedy decode for sample generations.

Params are nested dicts as `model.init(...)["params"]` makes them. With LoRA the trained params are only
the adapter branches (`split_lora`); the frozen base is kept apart and joined to them inside the
forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import linen as nn
from gemma import gm, peft

from worker.config import TINY_MODEL, JobSpec
from worker.hf import HfImportError, is_hf_model, load_hf_params

Params = dict[str, Any]

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "270m": gm.nn.Gemma3_270M,
    "1b": gm.nn.Gemma3_1B,
    "4b": gm.nn.Gemma3_4B,
    "12b": gm.nn.Gemma3_12B,
    "27b": gm.nn.Gemma3_27B,
}
# The 4B and larger checkpoints carry a vision encoder this text-only trainer never uses.
_MULTIMODAL_SIZES = ("4b", "12b", "27b")

# For merging LoRA into the base weights: each Gemma einsum weight's axes and the axes its input
# contracts (from gemma's `_modules.py`; the LoRA `a` holds the contracted axes, `b` the others).
_EINSUM_AXES: dict[str, tuple[str, str]] = {
    "q_einsum": ("NDH", "D"),
    "kv_einsum": ("CKDH", "D"),
    "qkv_einsum": ("SNDH", "D"),
    "attn_vec_einsum": ("NHD", "NH"),
    "gating_einsum": ("NHF", "F"),
    "linear": ("HF", "H"),
}


class ModelError(Exception):
    """The job's model, weights or tokenizer do not fit together; `code` is the stable error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def tiny_config(
    vocab_size: int,
    *,
    layers: int = 2,
    embed_dim: int = 128,
    hidden_dim: int = 256,
    num_heads: int = 4,
    sliding_window: int = 32,
) -> gm.nn.config.TransformerConfig:
    """A small Gemma 3 for CPU (tests: two layers, one sliding-window and one global; the training
    benchmark scales it up): sliding-window layers, then one global layer, one KV head."""
    return gm.nn.config.TransformerConfig(
        num_embed=vocab_size,
        embed_dim=embed_dim,
        hidden_dim=hidden_dim,
        num_heads=num_heads,
        head_dim=embed_dim // num_heads,
        num_kv_heads=1,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        use_qk_norm=True,
        attention_types=(gm.nn.AttentionType.LOCAL_SLIDING,) * (layers - 1) + (gm.nn.AttentionType.GLOBAL,),
        query_pre_attn_norm=gm.nn.config.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
        sliding_window_size=sliding_window,
        transpose_gating_einsum=True,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
    )


def official_checkpoint(model_name: str) -> str:
    """The official orbax checkpoint of `gemma3-{size}-{pt|it}` (`gm.ckpts.CheckpointPath`)."""
    _, size, kind = model_name.split("-")
    return str(gm.ckpts.CheckpointPath[f"GEMMA3_{size.upper()}_{kind.upper()}"])


@dataclasses.dataclass(frozen=True)
class Model:
    """The network of a job: `module` is what runs (LoRA-wrapped for LoRA), `base` the plain Gemma."""

    name: str
    base: nn.Module
    module: nn.Module
    lora_rank: int | None
    compute_dtype: Any

    def abstract_params(self) -> tuple[Params, Params]:
        """Shapes and dtypes of (trained params, frozen params); frozen is empty for a full fine-tune."""
        return jax.eval_shape(self._init, jax.random.key(0))

    def init_params(self, seed: int, shardings: tuple[Any, Any]) -> tuple[Params, Params]:
        """Random (trained, frozen) params, created already sharded."""
        return jax.jit(self._init, out_shardings=shardings)(jax.random.key(seed))

    def init_lora(self, seed: int, sharding: Any) -> Params:
        """Fresh LoRA params (`b` is zero, so the adapted model starts equal to the base)."""
        # XLA drops the unused base-weight initialisation, so this costs only the adapter.
        return jax.jit(lambda key: self._init(key)[0], out_shardings=sharding)(jax.random.key(seed))

    def _init(self, key: jax.Array) -> tuple[Params, Params]:
        params = self.module.init(key, jnp.zeros((1, 8), jnp.int32))["params"]
        return (params, {}) if self.lora_rank is None else split_lora(params)


def split_lora(params: Params) -> tuple[Params, Params]:
    """(adapter params, base params) of a LoRA model's params; the base tree matches the plain model's."""
    base, lora = peft.split_params(params)
    return lora, _without_empty(base)


def _without_empty(tree: Params) -> Params:
    # `peft.split_params` leaves an empty dict where each adapter was.
    pruned = {key: _without_empty(value) if isinstance(value, dict) else value for key, value in tree.items()}
    return {key: value for key, value in pruned.items() if not (isinstance(value, dict) and not value)}


def build_model(
    name: str, vocab_size: int, *, lora_rank: int | None, param_dtype: Any, compute_dtype: Any
) -> Model:
    """The Gemma 3 network for `name` (`gemma3-*` or `tiny`), LoRA-wrapped when `lora_rank` is set.

    Trained params live in `param_dtype`; a frozen LoRA base only ever runs, so it is kept in `compute_dtype`.
    """
    dtype = param_dtype if lora_rank is None else compute_dtype
    if name == TINY_MODEL:
        base: nn.Module = gm.nn.Transformer(config=tiny_config(vocab_size), dtype=dtype)
    else:
        size = name.split("-")[1]
        extra = {"text_only": True} if size in _MULTIMODAL_SIZES else {}
        base = _ARCHITECTURES[size](dtype=dtype, **extra)
        if vocab_size > base.config.num_embed:
            raise ModelError(
                "tokenizer_mismatch",
                f"the tokenizer has {vocab_size} pieces but {name} embeds only {base.config.num_embed}; "
                "use the model's own tokenizer",
            )
    module = base if lora_rank is None else gm.nn.LoRA(rank=lora_rank, model=base, dtype=param_dtype)
    return Model(name=name, base=base, module=module, lora_rank=lora_rank, compute_dtype=compute_dtype)


def load_base_params(spec: JobSpec, model: Model, sharding: Any, cache_dir: Path | None = None) -> Params:
    """The base weights (official checkpoint, the user's orbax checkpoint, a full fine-tune's checkpoint, a
    Hugging Face model directory or a GGUF file), sharded; with `adapter_uri`, that LoRA adapter folded
    into them."""
    params = _base_params(spec, model, sharding, cache_dir)
    if spec.adapter_uri is not None:
        params = fold_adapter(params, spec.adapter_uri, sharding, model)
    return params


def is_run_checkpoint(uri: str) -> bool:
    """Whether `uri` is a checkpoint of a tputune run (`…/checkpoints/<step>`: its train state and data
    position), not a checkpoint of params alone."""
    return (epath.Path(uri) / "state").is_dir()


def _is_adapter(tree: Params) -> bool:
    return any(
        key.startswith("_LoRAEinsum_") or (isinstance(child, dict) and _is_adapter(child))
        for key, child in tree.items()
    )


def _run_params(uri: str, item: Params, restore_args: Params) -> Params:
    """The params of a run checkpoint's train state (not its optimizer state): `item` their tree (shapes),
    `restore_args` how each is restored (orbax RestoreArgs)."""
    args = ocp.args.PyTreeRestore(
        item={"params": item}, restore_args={"params": restore_args}, partial_restore=True
    )
    return ocp.PyTreeCheckpointer().restore(epath.Path(uri) / "state", args=args)["params"]


def _placed(target: Params) -> Params:
    """RestoreArgs that restore each array straight into its place (`target`: ShapeDtypeStructs with
    shardings), cast to its dtype."""
    return jax.tree.map(
        lambda leaf: ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=leaf.shape, dtype=leaf.dtype),
        target,
    )


def fold_adapter(params: Params, uri: str, sharding: Any, model: Model) -> Params:
    """`params` with the LoRA adapter at `uri` (an export's `final/adapter`, or a LoRA run's checkpoint)
    folded in (W + A·B), in the same shardings."""
    if not epath.Path(uri).exists():
        raise ModelError("adapter_not_found", f"there is no LoRA adapter at {uri}")
    run = is_run_checkpoint(uri)
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(epath.Path(uri) / "state" if run else uri).item_metadata.tree
    tree = tree.get("params", {}) if run else tree
    if not isinstance(tree, dict) or not _is_adapter(tree):
        raise ModelError(
            "bad_adapter",
            f"{uri} holds no LoRA adapter (a LoRA job's final/adapter or checkpoints/<step> does); full "
            "weights are a base_checkpoint_uri",
        )
    on_host = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    if run:
        adapter = _run_params(uri, tree, on_host)
    else:
        adapter = checkpointer.restore(uri, args=ocp.args.PyTreeRestore(item=tree, restore_args=on_host))
    mesh = jax.tree.leaves(sharding)[0].mesh
    replicated = jax.tree.map(
        lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), adapter
    )
    try:
        return jax.jit(merge_lora, out_shardings=sharding, donate_argnums=0)(
            params, put_global(adapter, replicated)
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ModelError("bad_adapter", f"{uri} is not a LoRA adapter of {model.name}: {error}") from error


def _base_params(spec: JobSpec, model: Model, sharding: Any, cache_dir: Path | None) -> Params:
    uri = spec.base_checkpoint_uri
    dtype = model.base.dtype
    if uri is not None and uri.endswith(".gguf"):
        from worker.gguf_import import GgufImportError, gguf_model_name, load_gguf_params

        if not Path(uri).is_file():
            raise ModelError("base_checkpoint_not_found", f"the GGUF file {uri} does not exist")
        try:
            held = gguf_model_name(uri)
            if not model.name.startswith(f"{held}-"):
                raise ModelError(
                    "bad_base_checkpoint", f"{uri} holds {held}, not the job's model {model.name}"
                )
            params = load_gguf_params(uri, cache_dir=cache_dir, dtype=dtype)["params"]
        except GgufImportError as error:
            raise ModelError("bad_base_checkpoint", str(error)) from error
        return put_global(params, sharding)
    if uri is None:
        return _load_orbax(official_checkpoint(model.name), sharding, model)
    if not epath.Path(uri).exists():
        raise ModelError("base_checkpoint_not_found", f"there is no checkpoint at {uri}")
    if is_hf_model(uri):
        try:
            return put_global(load_hf_params(uri, model.base.config, dtype), sharding)
        except HfImportError as error:
            raise ModelError("bad_base_checkpoint", str(error)) from error
    try:
        if is_run_checkpoint(uri):
            return _full_run_params(uri, _target(model, sharding))
        return _load_orbax(uri, sharding, model)
    except ValueError as error:
        raise ModelError(
            "bad_base_checkpoint", f"{uri} is not an orbax checkpoint of {model.name}: {error}"
        ) from error


def _full_run_params(uri: str, target: Params) -> Params:
    """The params of a full fine-tune's run checkpoint, restored into `target`'s places and dtypes.
    (orbax's partial restore gives back the target's own leaves for what the checkpoint lacks: the tree is
    compared first.)"""
    held = ocp.PyTreeCheckpointer().metadata(epath.Path(uri) / "state").item_metadata.tree.get("params", {})
    if _is_adapter(held):
        raise ValueError(
            "it is a LoRA job's checkpoint, which holds its adapter only: give it as adapter_uri, with the "
            "base weights that job trained on as base_checkpoint_uri"
        )
    shapes = jax.tree.map(lambda leaf: tuple(leaf.shape), held)
    if shapes != jax.tree.map(lambda leaf: tuple(leaf.shape), target):
        raise ValueError("its params are not of this model (another size, or another tokenizer's vocabulary)")
    return _run_params(uri, target, _placed(target))


def _target(model: Model, sharding: Any) -> Params:
    """The base params' shapes and dtypes, placed with `sharding`."""
    return jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
        jax.eval_shape(lambda: model.base.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]),
        sharding,
    )


def _load_orbax(path: str, sharding: Any, model: Model) -> Params:
    """Restore straight into the target shardings, cast to the model's dtype (checkpoints hold bf16)."""
    return gm.ckpts.load_params(path, params=_target(model, sharding), donate=False, text_only=True)


def put_global(tree: Params, shardings: Any) -> Params:
    """Host arrays (the same on every process) as global arrays with the given shardings."""

    def put(array: Any, sharding: jax.sharding.Sharding) -> jax.Array:
        host = np.asarray(array)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, L, L]: query i sees key j when j <= i and both lie in the same document (segment > 0)."""
    length = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same & (segment_ids[:, None, :] > 0)


def join_params(model: Model, trained: Params, frozen: Params) -> Params:
    return trained if model.lora_rank is None else peft.merge_params(frozen, trained)


def forward(
    model: Model,
    trained: Params,
    frozen: Params,
    tokens: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
) -> jax.Array:
    """Float32 logits [B, L, V] of packed rows, computed in the model's compute dtype."""
    params = jax.tree.map(lambda x: x.astype(model.compute_dtype), join_params(model, trained, frozen))
    out: Any = model.module.apply(
        {"params": params}, tokens, positions=positions, attention_mask=attention_mask(segment_ids)
    )
    return out.logits.astype(jnp.float32)


def merge_lora(base: Params, lora: Params) -> Params:
    """The base params with each LoRA adapter folded into its weight (W + A·B): a plain Gemma checkpoint."""
    merged = jax.tree.map(lambda x: x, base)  # fresh dicts: the caller's base stays as it was

    def visit(lora_node: Params, base_node: Params, node_key: str) -> None:
        for key, child in lora_node.items():
            if not key.startswith("_LoRAEinsum_"):
                visit(child, base_node[key], key)
                continue
            # `_LoRAEinsum_0` adapts this node's `w`; `_LoRAEinsum_<name>` the sibling weight `<name>`.
            suffix = key.removeprefix("_LoRAEinsum_")
            weight_key, name = ("w", node_key) if suffix == "0" else (suffix, suffix)
            weight = base_node[weight_key]
            base_node[weight_key] = weight + _lora_delta(name, child["lora"]).astype(weight.dtype)

    visit(lora, merged, "")
    return merged


def _lora_delta(name: str, adapter: Params) -> jax.Array:
    weight_axes, input_axes = _EINSUM_AXES[name]
    a_axes = "".join(c for c in weight_axes if c in input_axes) + "r"
    b_axes = "r" + "".join(c for c in weight_axes if c not in input_axes)
    return jnp.einsum(f"{a_axes},{b_axes}->{weight_axes}", adapter["a"], adapter["b"])


def make_generate(
    model: Model, replicated: jax.sharding.Sharding, max_new_tokens: int, stop_tokens: tuple[int, ...]
) -> Callable:
    """A jitted greedy decode: (trained, frozen, tokens [P, T], lengths [P]) -> tokens [P, T].

    Each step reruns the whole fixed-length buffer (no KV cache): a few dozen tokens for a handful of
    prompts, twice a run, so simplicity wins over speed here.
    """
    stops = jnp.array(stop_tokens, dtype=jnp.int32)

    def generate(trained: Params, frozen: Params, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
        width = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)
        rows = jnp.arange(tokens.shape[0])

        def step(
            _: int, carry: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            tokens, lengths, done = carry
            segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
            logits = forward(model, trained, frozen, tokens, segment_ids, positions)
            next_token = jnp.argmax(logits[rows, lengths - 1], axis=-1).astype(tokens.dtype)
            write = ~done & (lengths < width)
            at = jnp.minimum(lengths, width - 1)
            tokens = tokens.at[rows, at].set(jnp.where(write, next_token, tokens[rows, at]))
            return tokens, lengths + write, done | (write & jnp.isin(next_token, stops))

        done = jnp.zeros(tokens.shape[0], dtype=jnp.bool_)
        return jax.lax.fori_loop(0, max_new_tokens, step, (tokens, lengths, done))[0]

    return jax.jit(generate, out_shardings=replicated)


def sample_texts(
    generate: Callable,
    trained: Params,
    frozen: Params,
    tokenizer: Any,
    prompts: list[str],
    max_new_tokens: int,
    *,
    chat: bool,
) -> list[str]:
    """Greedy continuations of `prompts`; with `chat`, each prompt is a user turn the model answers."""
    encoded = [_prompt_ids(tokenizer, prompt, chat) for prompt in prompts]
    width = max(len(ids) for ids in encoded) + max_new_tokens
    tokens = np.zeros((len(encoded), width), dtype=np.int32)
    for row, ids in enumerate(encoded):
        tokens[row, : len(ids)] = ids
    lengths = np.array([len(ids) for ids in encoded], dtype=np.int32)
    out = np.asarray(generate(trained, frozen, tokens, lengths))
    stops = {tokenizer.eos_id, tokenizer.end_of_turn_id} if chat else {tokenizer.eos_id}
    texts = []
    for row, ids in enumerate(encoded):
        new = [int(t) for t in out[row, len(ids) :]]
        end = next((i for i, t in enumerate(new) if t in stops), len(new))
        texts.append(tokenizer.decode(new[:end]))
    return texts


def _prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return [tokenizer.bos_id, *tokenizer.encode(prompt)]
    start, end = tokenizer.start_of_turn_id, tokenizer.end_of_turn_id
    return [
        tokenizer.bos_id,
        start,
        *tokenizer.encode(f"user\n{prompt}"),
        end,
        *tokenizer.encode("\n"),
        start,
        *tokenizer.encode("model\n"),
    ]
