"""Fine-tuned weights as one GGUF file (llama.cpp's format: llama.cpp, ollama, LM Studio run it), written
straight from the params: what llama.cpp's `convert_hf_to_gguf.py` writes from the Hugging Face export
(`worker.hf`), without a second copy of the model on disk.

- The tensors are transformers' (`worker.hf.hf_tensors`) under llama.cpp's names (`worker.gguf_import`'s
  mapping, read backwards), each RMSNorm weight stored as `1 + scale`, as llama.cpp computes `x * weight`.
- `f32`, `f16`, `bf16` or `q8_0` (llama.cpp's converter's own choices): norms stay float32, and a `q8_0`
  tensor whose rows are not whole 32-value blocks is written `f16`, as the converter does. Smaller
  quantizations (Q4_K_M, ...) are llama.cpp's `llama-quantize` on this file.
- The tokenizer is the job's SentencePiece model laid out as the converter lays out Gemma's from the
  Hugging Face tokenizer: special tokens (the turn markers, `<unusedN>`, `<mask>`) are CONTROL, other
  user-defined ones hold real spaces where SentencePiece has `▁` (llama.cpp matches them in raw text), and
  all of them score -1000. The importer reads such a file back to the same vocabulary.
- The chat template is the Hugging Face export's (`CHAT_TEMPLATE`): llama.cpp recognises Gemma's turns.

llama.cpp fixes part of Gemma 3's architecture instead of reading it: every 6th layer global, the others
sliding-window with rotary base 10,000, queries scaled by the head size (by width / heads for 27B). Every
official size is built so (`tests/worker/test_gguf_export.py` checks their configs); the tests' `tiny`
model is not (its second layer is global): its file holds its weights, which llama.cpp would run otherwise.

Each tensor is gathered to the first JAX process, converted and written by it, one at a time.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from gemma import gm
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys, LlamaFileType, TokenType
from gguf.quants import quant_shape_to_byte_shape, quantize
from sentencepiece.sentencepiece_model_pb2 import ModelProto  # type: ignore[attr-defined]

from worker.gguf_import import gguf_tensor_name
from worker.hf import CHAT_TEMPLATE, abstract_tensors, gathered, hf_tensors, max_positions
from worker.tokenizer import END_OF_TURN, START_OF_TURN, Tokenizer

Params = dict[str, Any]

# The outtypes of llama.cpp's converter this writes: the type of the file's matrices, and its file type.
OUTTYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
}
ARCHITECTURE = "gemma3"
_ALIGNMENT = 32  # GGUF's default (`general.alignment`)
_VERSION = 3
# The score llama.cpp's converter gives the tokens Hugging Face lists as added (special or user-defined).
_ADDED_TOKEN_SCORE = -1000.0

_Piece = ModelProto.SentencePiece
# User-defined pieces the converter marks CONTROL: those Gemma's Hugging Face tokenizer lists as special
# (the turn markers), and those its `does_token_look_special` does (`<unusedN>`, `<mask>`, `<|...|>`).
_SPECIAL_PIECES = {START_OF_TURN, END_OF_TURN, "<mask>", "<2mass>", "[@BOS@]"}
_LOOKS_SPECIAL = re.compile(r"<unused\d+>|<\|.*\|>")


def export_gguf(
    params: Params,
    uri: str,
    *,
    config: gm.nn.config.TransformerConfig,
    model_name: str,
    tokenizer: Tokenizer,
    outtype: str,
    name: str | None = None,
) -> None:
    """Write `params` (the plain Gemma tree) as the GGUF file `uri`, its matrices in `outtype` (a key of
    `OUTTYPES`, those of `worker.config.GGUF_TYPES`); `name` is its `general.name` (default: `model_name`).

    Every JAX process must call it (the tensors are gathered collectively); the first one writes."""
    qtype, file_type = OUTTYPES[outtype]
    vocab = tokenizer.vocab_size

    def tensors(tree: Params) -> Iterator[tuple[str, Any]]:
        """transformers' tensors, the embedding's rows past the vocabulary dropped (a tokenizer may have
        fewer pieces than the model embeds): llama.cpp wants a row per token, and its converter drops them."""
        for name, array in hf_tensors(tree, config):
            yield name, array[:vocab] if name == "model.embed_tokens.weight" else array

    infos = [
        (gguf_tensor_name(name.removeprefix("model.")), leaf.shape, _tensor_type(name, leaf.shape, qtype))
        for name, leaf in abstract_tensors(tensors, params)
    ]
    writer = jax.process_index() == 0
    metadata = gguf_metadata(config, model_name, tokenizer, file_type=file_type, name=name or model_name)
    handle = None
    if writer:
        epath.Path(uri).parent.mkdir(parents=True, exist_ok=True)
        handle = epath.Path(uri).open("wb")
    try:
        if handle is not None:
            handle.write(_header(metadata, infos))
        for (hf_name, array), (_, shape, kind) in zip(tensors(params), infos, strict=True):
            host = gathered(array)
            if handle is None:
                continue
            data = _encode(host, kind, norm=_is_norm(hf_name))
            assert data.nbytes == _tensor_bytes(shape, kind), hf_name
            handle.write(data.tobytes())
            handle.write(b"\0" * (-data.nbytes % _ALIGNMENT))
    finally:
        if handle is not None:
            handle.close()


def gguf_metadata(
    config: gm.nn.config.TransformerConfig,
    model_name: str,
    tokenizer: Tokenizer,
    *,
    file_type: LlamaFileType,
    name: str,
) -> list[tuple[str, GGUFValueType, Any]]:
    """The file's key/value metadata, in order: (key, GGUF type, value); arrays as (item type, values)."""
    u32, f32, string = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    llm = {
        Keys.LLM.CONTEXT_LENGTH: (u32, max_positions(model_name)),
        Keys.LLM.EMBEDDING_LENGTH: (u32, config.embed_dim),
        Keys.LLM.BLOCK_COUNT: (u32, config.num_layers),
        Keys.LLM.FEED_FORWARD_LENGTH: (u32, config.hidden_dim),
        Keys.Attention.HEAD_COUNT: (u32, config.num_heads),
        Keys.Attention.LAYERNORM_RMS_EPS: (f32, 1e-6),
        Keys.Attention.KEY_LENGTH: (u32, config.head_dim),
        Keys.Attention.VALUE_LENGTH: (u32, config.head_dim),
        Keys.Rope.FREQ_BASE: (f32, float(config.global_base_frequency)),  # (the global layers')
        Keys.Attention.SLIDING_WINDOW: (u32, config.sliding_window_size),
        Keys.Attention.HEAD_COUNT_KV: (u32, config.num_kv_heads),
    }
    if config.global_scale_factor != 1.0:  # 4B and larger: linear scaling of the global layers' rotations
        llm[Keys.Rope.SCALING_TYPE] = (string, "linear")
        llm[Keys.Rope.SCALING_FACTOR] = (f32, float(config.global_scale_factor))
    entries: list[tuple[str, GGUFValueType, Any]] = [
        (Keys.General.ARCHITECTURE, string, ARCHITECTURE),
        (Keys.General.TYPE, string, "model"),
        (Keys.General.NAME, string, name),
        (Keys.General.QUANTIZATION_VERSION, u32, 2),
        (Keys.General.FILE_TYPE, u32, int(file_type)),
    ]
    entries += [(key.format(arch=ARCHITECTURE), kind, value) for key, (kind, value) in llm.items()]
    entries += gguf_tokenizer_metadata(tokenizer)
    end_of_turn = tokenizer.piece_to_id(END_OF_TURN)
    if model_name.endswith("-it") and end_of_turn is not None:
        # An instruction-tuned model ends its turn with <end_of_turn> (as the Hugging Face export's eos list
        # says): llama.cpp stops there (it also finds the piece by name; this says so outright).
        entries.append((Keys.Tokenizer.EOT_ID, GGUFValueType.UINT32, end_of_turn))
    return entries


def gguf_tokenizer_metadata(tokenizer: Tokenizer) -> list[tuple[str, GGUFValueType, Any]]:
    """The `tokenizer.*` metadata of `tokenizer`'s vocabulary, as llama.cpp's converter writes Gemma's."""
    proto = ModelProto()
    proto.ParseFromString(tokenizer.processor.serialized_model_proto())
    tokens, scores, kinds = [], [], []
    for piece in proto.pieces:
        kind = TokenType(piece.type)  # (llama.cpp numbers its token types as SentencePiece its pieces)
        text, score = piece.piece, piece.score
        if piece.type in (_Piece.UNKNOWN, _Piece.CONTROL) or (
            piece.type == _Piece.USER_DEFINED and (text in _SPECIAL_PIECES or _LOOKS_SPECIAL.fullmatch(text))
        ):
            kind, score = TokenType.CONTROL, _ADDED_TOKEN_SCORE
        elif piece.type == _Piece.USER_DEFINED:
            text, score = text.replace("▁", " "), _ADDED_TOKEN_SCORE
        tokens.append(text)
        scores.append(score)
        kinds.append(kind)
    u32, string, boolean = GGUFValueType.UINT32, GGUFValueType.STRING, GGUFValueType.BOOL
    processor = tokenizer.processor
    return [
        (Keys.Tokenizer.MODEL, string, "llama"),  # (llama.cpp's name for SentencePiece)
        (Keys.Tokenizer.PRE, string, "default"),
        (Keys.Tokenizer.LIST, GGUFValueType.ARRAY, (string, tokens)),
        (Keys.Tokenizer.SCORES, GGUFValueType.ARRAY, (GGUFValueType.FLOAT32, scores)),
        (Keys.Tokenizer.TOKEN_TYPE, GGUFValueType.ARRAY, (GGUFValueType.INT32, kinds)),
        (Keys.Tokenizer.BOS_ID, u32, tokenizer.bos_id),
        (Keys.Tokenizer.EOS_ID, u32, tokenizer.eos_id),
        (Keys.Tokenizer.UNK_ID, u32, processor.unk_id()),
        (Keys.Tokenizer.PAD_ID, u32, tokenizer.pad_id),
        (Keys.Tokenizer.ADD_BOS, boolean, True),
        (Keys.Tokenizer.ADD_SEP, boolean, False),
        (Keys.Tokenizer.ADD_EOS, boolean, False),
        (Keys.Tokenizer.ADD_PREFIX, boolean, False),
        (Keys.Tokenizer.CHAT_TEMPLATE, string, CHAT_TEMPLATE),
    ]


def _is_norm(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight")


def _tensor_type(hf_name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """As the converter chooses: float32 for norms (any vector), f16 for rows that are not whole blocks."""
    if len(shape) <= 1 or _is_norm(hf_name):
        return GGMLQuantizationType.F32
    block_size = GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block_size:
        return GGMLQuantizationType.F16
    return qtype


def _tensor_bytes(shape: tuple[int, ...], kind: GGMLQuantizationType) -> int:
    return int(np.prod(quant_shape_to_byte_shape(shape, kind)))


def _encode(array: np.ndarray, kind: GGMLQuantizationType, *, norm: bool) -> np.ndarray:
    """The tensor's bytes in the file, as `kind`; a norm's weight as llama.cpp's `1 + scale`."""
    values = np.asarray(array, dtype=np.float32)
    if norm:
        values = values + 1
    if kind == GGMLQuantizationType.F32:
        return values.astype("<f4")
    if kind == GGMLQuantizationType.F16:
        return values.astype("<f2")
    if kind == GGMLQuantizationType.BF16:  # (rounded to nearest even, as llama.cpp's converter rounds)
        return values.astype(jnp.bfloat16).view("<u2")
    return quantize(values, kind)


def _header(
    metadata: list[tuple[str, GGUFValueType, Any]], infos: list[tuple[str, tuple[int, ...], Any]]
) -> bytes:
    """GGUF's header: magic, version, counts, the metadata, each tensor's name, dimensions (innermost
    first), type and offset in the data, then padding to the alignment where the data starts."""
    out = [b"GGUF", struct.pack("<IQQ", _VERSION, len(infos), len(metadata))]
    for key, kind, value in metadata:
        out += [_string(key), struct.pack("<I", kind), _value(kind, value)]
    offset = 0
    for name, shape, kind in infos:
        out += [_string(name), struct.pack("<I", len(shape))]
        out += [struct.pack("<Q", dim) for dim in reversed(shape)]
        out.append(struct.pack("<IQ", kind, offset))
        size = _tensor_bytes(shape, kind)
        offset += size + (-size % _ALIGNMENT)
    header = b"".join(out)
    return header + b"\0" * (-len(header) % _ALIGNMENT)


_SCALARS = {
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
}


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: GGUFValueType, value: Any) -> bytes:
    if kind == GGUFValueType.STRING:
        return _string(value)
    if kind == GGUFValueType.ARRAY:
        item_kind, items = value
        head = struct.pack("<IQ", item_kind, len(items))
        if item_kind == GGUFValueType.STRING:
            return head + b"".join(_string(item) for item in items)
        return head + np.asarray(items, dtype=_SCALARS[item_kind]).tobytes()
    return struct.pack(_SCALARS[kind], value)
