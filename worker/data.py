"""The input pipeline: read documents, tokenize them once, pack them into rows and serve batches by step.

Documents come from `.txt` (separated by `<|endoftext|>`), `.jsonl` (`{"text": ...}`, chat
`{"messages": [...]}` in the shape OpenAI's and Together's fine-tuning take, or `{"prompt": ...,
"completion": ...}`) or `.parquet` (a `text` column, or `messages`, or `prompt` and `completion`: as those
records), on a local path or `gs://bucket/path`.

Each document becomes `[bos] + tokens + [eos]`. Documents are shuffled by the seed and dealt to data shards
(document i of the shuffled order goes to shard i % num_shards); each process tokenizes and packs only its
own shards. Packing is best-fit decreasing into rows of `max_seq_len + 1` tokens, so padding only fills the
end of a row that no remaining document fits. A document longer than a row has to be cut anyway: its pieces
fill the widest gaps first, and overlap by one token, so every next-token target is trained exactly once.

A batch is a dict of numpy arrays of shape [rows, max_seq_len]: `tokens`, `targets`, `segment_ids`
(0 = pad, 1..k = the document within the row), `positions` (restarting at 0 in each segment) and
`loss_mask` (1.0 where the target is a trained token of the input token's own segment). The model attends
causally within equal non-zero segment ids. `TrainData.batch(step)` is a pure function of the global step.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from worker.config import ENV_GCS_FUSE_ROOT, JobSpec
from worker.tokenizer import Tokenizer, TokenizerError

if TYPE_CHECKING:
    from google.cloud import storage

TXT_SEPARATOR = "<|endoftext|>"
FORMATS = (".txt", ".jsonl", ".parquet")
CHAT_ROLES = ("user", "model", "system")
# Other names of a chat role, as OpenAI's and Together's data name them.
ROLE_ALIASES = {"assistant": "model"}
ENV_STORAGE_EMULATOR_HOST = "STORAGE_EMULATOR_HOST"

# Independent random streams drawn from the one job seed.
_SPLIT_STREAM = 0
_SHARD_STREAM = 1
_EPOCH_STREAM = 2

Batch = dict[str, np.ndarray]


class DataError(Exception):
    """The dataset cannot be used; `code` is stable for machines, `message` says what to fix."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    trained: bool = True  # (a model turn: whether its reply carries loss; OpenAI's `"weight": 0` is False)


@dataclass(frozen=True)
class Completion:
    """A prompt and the completion trained on it (a plain text pair; no chat template)."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class Preference:
    """A prompt and two replies to it, `chosen` preferred to `rejected` (a dpo job's data). The prompt is a
    chat's messages up to the reply (the last one a user turn), or a plain text."""

    prompt: tuple[Message, ...] | str
    chosen: str
    rejected: str

    def documents(self) -> tuple[PlainDocument, PlainDocument]:
        """The prompt with each reply, as the documents a job encodes: only the reply is trained (scored)."""
        if isinstance(self.prompt, str):
            return Completion(self.prompt, self.chosen), Completion(self.prompt, self.rejected)
        # (a model turn within the prompt is context: the reply alone is compared)
        context = tuple(Message(m.role, m.content, trained=False) for m in self.prompt)
        return (*context, Message("model", self.chosen)), (*context, Message("model", self.rejected))


# A plain text, a chat (the messages of one conversation), a prompt and its completion, or a preference.
PlainDocument = str | tuple[Message, ...] | Completion
Document = PlainDocument | Preference

# The record shapes of preference data, for the errors that name them.
PREFERENCE_SHAPES = (
    '{"input": {"messages": [...]}, "preferred_output": [...], "non_preferred_output": [...]} (OpenAI\'s), '
    'or {"prompt", "chosen", "rejected"}'
)


# --- Sources ---------------------------------------------------------------------------------------------


def split_gcs_uri(uri: str) -> tuple[str, str]:
    """`gs://bucket/path/to/object` -> ("bucket", "path/to/object")."""
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    return bucket, name


def fuse_path(uri: str) -> Path | None:
    """The file for a `gs://` URI on the GCS FUSE mount under $TPUTUNE_GCS_FUSE_ROOT, if it is there."""
    root = os.environ.get(ENV_GCS_FUSE_ROOT)
    if not root:
        return None
    bucket, name = split_gcs_uri(uri)
    path = Path(root) / bucket / name
    return path if path.is_file() else None


def gcs_client() -> storage.Client:
    """A GCS client: the emulator at $STORAGE_EMULATOR_HOST, else default credentials, else anonymous."""
    from google.auth.credentials import AnonymousCredentials
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import storage

    emulator = os.environ.get(ENV_STORAGE_EMULATOR_HOST)
    if emulator:
        return storage.Client(
            project=os.environ.get("GOOGLE_CLOUD_PROJECT", "tputune"),
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": emulator},
        )
    try:
        return storage.Client()
    except DefaultCredentialsError:
        # Public buckets (the official tokenizer's) need no credentials.
        return storage.Client.create_anonymous_client()


def gcs_blob(uri: str) -> storage.Blob | None:
    """The object at a `gs://` URI, or None when it (or its bucket) does not exist."""
    bucket, name = split_gcs_uri(uri)
    return gcs_client().bucket(bucket).get_blob(name)


def read_bytes(uri: str) -> bytes:
    """The contents of a local path or a `gs://` URI (read on the FUSE mount when it has the file)."""
    if uri.startswith("gs://"):
        mounted = fuse_path(uri)
        if mounted is None:
            from google.api_core.exceptions import Forbidden

            try:
                blob = gcs_blob(uri)
            except Forbidden as error:
                raise DataError("dataset_not_found", f"{uri} cannot be read: permission denied") from error
            if blob is None:
                raise DataError("dataset_not_found", f"{uri} does not exist")
            return bytes(blob.download_as_bytes())
        uri = str(mounted)
    path = Path(uri)
    if not path.is_file():
        raise DataError("dataset_not_found", f"{uri} does not exist or is not a file")
    return path.read_bytes()


# --- Parsing ---------------------------------------------------------------------------------------------


def read_documents(uri: str) -> list[Document]:
    """The documents of a `.txt`, `.jsonl` or `.parquet` file, in file order; raises DataError."""
    suffix = Path(split_gcs_uri(uri)[1] if uri.startswith("gs://") else uri).suffix.lower()
    if suffix not in FORMATS:
        raise DataError(
            "unsupported_format",
            f"{uri} has the extension '{suffix}'; use one of {', '.join(FORMATS)}",
        )
    data = read_bytes(uri)
    if not data.strip():
        raise DataError("dataset_empty", f"{uri} is empty")
    documents = _parse_parquet(uri, data) if suffix == ".parquet" else _parse_text(uri, suffix, data)
    if not documents:
        raise DataError("no_documents", f"{uri} holds no non-empty documents")
    return documents


def _parse_text(uri: str, suffix: str, data: bytes) -> list[Document]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise DataError(
            "dataset_not_utf8",
            f"{uri} is not UTF-8 text: byte {error.start} (line {line}) is not valid UTF-8",
        ) from error
    if suffix == ".txt":
        return [document for part in text.split(TXT_SEPARATOR) if (document := part.strip())]
    return _parse_jsonl(uri, text)


def _parse_jsonl(uri: str, text: str) -> list[Document]:
    documents: list[Document] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                "invalid_jsonl",
                f"{uri}: line {number} is not valid JSON ({error.msg} at column {error.colno})",
            ) from error
        if not isinstance(record, dict):
            raise DataError("invalid_jsonl", f"{uri}: line {number} is not a JSON object")
        if PREFERENCE_KEYS & record.keys():
            documents.append(_parse_preference(uri, f"line {number}", record))
            continue
        kinds = [kind for kind in ("text", "messages", "prompt") if kind in record]
        if kinds == ["messages"]:
            documents.append(_parse_chat(uri, f"line {number}", record["messages"]))
        elif kinds == ["text"]:
            if not isinstance(record["text"], str):
                raise DataError("invalid_jsonl", f'{uri}: line {number} has a "text" that is not a string')
            if record["text"].strip():
                documents.append(record["text"])
        elif kinds == ["prompt"] and "completion" in record:
            documents.append(_parse_completion(uri, f"line {number}", record["prompt"], record["completion"]))
        else:
            raise DataError(
                "invalid_jsonl",
                f'{uri}: line {number} needs exactly one of a "text" string, a "messages" list, a '
                '"prompt" and a "completion" string, or a preference pair: ' + PREFERENCE_SHAPES,
            )
    return documents


# The keys that make a record a preference pair: OpenAI's (and Together's) and TRL's.
OPENAI_PREFERENCE = ("input", "preferred_output", "non_preferred_output")
PAIR_PREFERENCE = ("prompt", "chosen", "rejected")
PREFERENCE_KEYS = {"preferred_output", "non_preferred_output", "chosen", "rejected"}


def _parse_preference(uri: str, where: str, record: dict, code: str = "invalid_preference") -> Preference:
    """A preference pair: OpenAI's `input.messages` with `preferred_output` and `non_preferred_output` (each
    one assistant message), or `prompt` with `chosen` and `rejected` (strings; or, as TRL's conversational
    data, the prompt a list of messages and each reply a list of one assistant message)."""

    def invalid(problem: str) -> DataError:
        return DataError(code, f"{uri}: {where}: {problem}")

    keys = (
        OPENAI_PREFERENCE
        if "preferred_output" in record or "non_preferred_output" in record
        else PAIR_PREFERENCE
    )
    missing = [key for key in keys if record.get(key) is None]
    extra = [
        key
        for key in ("text", "messages", "completion", *OPENAI_PREFERENCE, *PAIR_PREFERENCE)
        if key not in keys and record.get(key) is not None
    ]
    if missing or extra:
        problem = (
            f"lacks {', '.join(map(repr, missing))}" if missing else f"mixes in {', '.join(map(repr, extra))}"
        )
        raise invalid(f"a preference pair {problem}; give {PREFERENCE_SHAPES}")
    prompt, chosen, rejected = (record[key] for key in keys)
    if keys == OPENAI_PREFERENCE:
        if not isinstance(prompt, dict) or "messages" not in prompt:
            raise invalid('"input" must be an object with the "messages" of the prompt')
        prompt = prompt["messages"]

    def reply(value: object, name: str) -> str:
        if isinstance(value, list):
            if len(value) != 1 or not isinstance(value[0], dict):
                raise invalid(f'"{name}" must be a list of exactly one assistant message')
            role = value[0].get("role")
            if ROLE_ALIASES.get(role, role) != "model":  # type: ignore[arg-type]
                raise invalid(f'"{name}" must be an assistant (model) message, not {role!r}')
            value = _content_text(value[0].get("content"))
        if not isinstance(value, str):
            raise invalid(f'"{name}" needs a text reply (a string, or one message with a "content" string)')
        if not value.strip():
            raise invalid(f'"{name}" is empty: there is no reply to compare')
        return value

    chosen_text, rejected_text = reply(chosen, keys[1]), reply(rejected, keys[2])
    if chosen_text == rejected_text:
        raise invalid(f'"{keys[1]}" and "{keys[2]}" are the same reply: there is no preference to learn')
    if isinstance(prompt, str):
        if isinstance(chosen, list):
            raise invalid(f'a "{keys[0]}" string goes with string replies; give the prompt as messages')
        return Preference(prompt, chosen_text, rejected_text)
    if not isinstance(prompt, list) or not prompt:
        raise invalid(f'"{keys[0]}" must be a string or a non-empty list of messages')
    # The prompt's messages and the reply, checked as one chat (so the prompt ends with a user turn).
    chat = _parse_chat(uri, where, [*prompt, {"role": "model", "content": chosen_text}])
    return Preference(chat[:-1], chosen_text, rejected_text)


def _parse_completion(
    uri: str, where: str, prompt: object, completion: object, code: str = "invalid_jsonl"
) -> Completion:
    """A prompt and completion pair; `where` names its line (or row) in the errors, raised as `code`."""
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DataError(code, f'{uri}: {where}: "prompt" and "completion" must be strings')
    if not completion.strip():
        raise DataError(code, f'{uri}: {where} has an empty "completion": nothing to train')
    return Completion(prompt, completion)


def _content_text(content: object) -> str | None:
    """A message's content as text: a string, or OpenAI's list of text parts joined; None if it is neither."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    return None


def _parse_chat(uri: str, where: str, messages: object) -> tuple[Message, ...]:
    """A chat's messages; `where` names its line (or row) in the errors."""

    def invalid(problem: str) -> DataError:
        return DataError("invalid_chat", f"{uri}: {where}: {problem}")

    if not isinstance(messages, list) or not messages:
        raise invalid('"messages" must be a non-empty list of {"role", "content"} objects')
    chat: list[Message] = []
    for index, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise invalid(f"message {index} is not a JSON object")
        role = message.get("role")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in CHAT_ROLES:
            names = ", ".join([*CHAT_ROLES, *ROLE_ALIASES])
            raise invalid(f"message {index} has role {message.get('role')!r}; use one of {names}")
        content = _content_text(message.get("content"))
        if content is None:
            raise invalid(
                f'message {index} needs a "content" string (or a list of {{"type": "text", "text"}} parts)'
            )
        weight = message.get("weight")  # (None: not given; a Parquet struct has the field, null)
        if weight is not None and (role != "model" or weight not in (0, 1) or isinstance(weight, bool)):
            raise invalid(
                f"message {index} has weight {weight!r}; only a model (assistant) message takes a weight, "
                "0 (not trained) or 1"
            )
        chat.append(Message(role, content, trained=weight != 0))
    turns = chat[1:] if chat[0].role == "system" else chat
    for index, message in enumerate(turns):
        expected = "user" if index % 2 == 0 else "model"
        if message.role != expected:
            position = index + 1 + len(chat) - len(turns)
            raise invalid(
                f"message {position} is a {message.role} turn where a {expected} turn belongs; "
                "after an optional first system message, turns alternate user, model, user, ..."
            )
    if len(turns) < 2:
        raise invalid("there is no model turn to train on")
    return tuple(chat)


def _parse_parquet(uri: str, data: bytes) -> list[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
    except pa.ArrowException as error:
        raise DataError("invalid_parquet", f"{uri} is not a readable Parquet file: {error}") from error
    schema = parquet.schema_arrow
    if "text" in schema.names:
        column_type = schema.field("text").type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise DataError(
                "parquet_no_text_column", f"{uri} has a 'text' column of {column_type}, not strings"
            )
        texts = parquet.read(columns=["text"]).column("text").to_pylist()
        return [text for text in texts if text is not None and text.strip()]
    # The shapes Hugging Face datasets store chats and pairs in: as the JSONL records, a row each.
    if "messages" in schema.names:
        rows = parquet.read(columns=["messages"]).column("messages").to_pylist()
        return [_parse_chat(uri, f"row {number}", chat) for number, chat in enumerate(rows, start=1)]
    if {"chosen", "rejected"} <= set(schema.names) or {"preferred_output", "non_preferred_output"} <= set(
        schema.names
    ):
        names = [name for name in (*OPENAI_PREFERENCE, *PAIR_PREFERENCE) if name in schema.names]
        table = parquet.read(columns=names).to_pylist()
        return [
            _parse_preference(uri, f"row {number}", row, "invalid_parquet")
            for number, row in enumerate(table, start=1)
        ]
    if {"prompt", "completion"} <= set(schema.names):
        table = parquet.read(columns=["prompt", "completion"]).to_pylist()
        return [
            _parse_completion(uri, f"row {number}", row["prompt"], row["completion"], "invalid_parquet")
            for number, row in enumerate(table, start=1)
        ]
    raise DataError(
        "parquet_no_text_column",
        f"{uri} has no 'text' column, nor a 'messages' one, nor 'prompt' and 'completion' ones, nor a "
        f"preference pair's 'prompt', 'chosen' and 'rejected' (its columns: {', '.join(schema.names)})",
    )


def check_objective(documents: Sequence[Document], uri: str, objective: str) -> None:
    """Raise DataError unless the documents are what a job of `objective` trains on: preference pairs for
    `dpo`, texts, chats and completions for `sft`."""
    pairs = sum(isinstance(document, Preference) for document in documents)
    if pairs and pairs < len(documents):
        raise DataError(
            "mixed_preference_data",
            f"{uri} holds {pairs} preference pairs and {len(documents) - pairs} other records; a job trains "
            "on one or the other: preference pairs with objective dpo, the rest with objective sft",
        )
    if objective == "dpo" and not pairs:
        raise DataError(
            "not_preference_data",
            f"{uri} holds no preference pairs, and a dpo job learns from them: give records of "
            f"{PREFERENCE_SHAPES}, or use objective sft to train on these",
        )
    if objective != "dpo" and pairs:
        raise DataError(
            "preference_data_needs_dpo",
            f"{uri} holds preference pairs (a prompt, a chosen and a rejected reply); set method.objective "
            "to dpo to learn from them",
        )


def split_validation(
    documents: Sequence[Document], fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """(train, validation): `fraction` of the documents (at least one) held out at random by `seed`."""
    if len(documents) < 2:
        raise DataError("no_documents", "validation_split needs at least 2 documents; the dataset has only 1")
    held_out = min(len(documents) - 1, max(1, round(fraction * len(documents))))
    order = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(len(documents))
    return [documents[i] for i in order[held_out:]], [documents[i] for i in order[:held_out]]


def shard_documents(documents: Sequence[Document], seed: int, shard: int, num_shards: int) -> list[Document]:
    """The documents of one data shard: those at i % num_shards == shard in the seed's shuffled order."""
    order = np.random.default_rng([seed, _SHARD_STREAM]).permutation(len(documents))
    return [documents[i] for i in order[shard::num_shards]]


# --- Tokenizing ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedDocument:
    tokens: np.ndarray  # int32, [bos] + ... + [eos]
    trained: np.ndarray | None  # bool per token: trained when it is a target; None: all of them


def _render_chat(chat: tuple[Message, ...]) -> list[Message]:
    """The turns, the system message folded into the first user turn as Gemma 3 does."""
    if chat[0].role != "system":
        return list(chat)
    first = chat[1]
    return [Message(first.role, f"{chat[0].content}\n\n{first.content}"), *chat[2:]]


def _documents(document: Document) -> tuple[PlainDocument, ...]:
    return document.documents() if isinstance(document, Preference) else (document,)


def _ids(tokens: list[int]) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def encode_documents(
    documents: Sequence[Document],
    tokenizer: Tokenizer,
    num_threads: int = -1,
    train_on_inputs: bool = False,
) -> list[EncodedDocument]:
    """Tokenize all documents in one multithreaded SentencePiece call and lay out bos/eos and chat turns.

    A chat is `<start_of_turn>{role}\\n{content}<end_of_turn>\\n` per turn; only a model turn's content and
    its `<end_of_turn>` are trained (`train_on_inputs`: every token, as in plain text), and not those of a
    model turn marked untrained (`"weight": 0`), either way. A user turn is encoded as one text, as a prompt
    is at sampling time; a model turn's content is encoded apart from its header, so the trained span starts
    exactly at the content. Markers are inserted by id, so a tokenizer that has them as control pieces works
    too. A prompt and completion is `[bos] + prompt + completion + [eos]`, each encoded apart; the
    completion and the eos are trained (`train_on_inputs`: the prompt too). A preference pair is two
    documents, the prompt with the chosen reply and with the rejected one, in that order.
    """
    # (a preference pair: its two documents, next to each other: chosen, rejected)
    plain = [part for document in documents for part in _documents(document)]
    rendered = [_render_chat(document) if isinstance(document, tuple) else document for document in plain]
    texts = [
        text
        for item in rendered
        for text in (
            [item]
            if isinstance(item, str)
            else [item.prompt, item.completion]
            if isinstance(item, Completion)
            else [turn.content if turn.role == "model" else f"{turn.role}\n{turn.content}" for turn in item]
        )
    ]
    encoded = iter(tokenizer.encode_batch_arrays(texts, num_threads))
    bos, eos = _ids([tokenizer.bos_id]), _ids([tokenizer.eos_id])
    if any(isinstance(item, list) for item in rendered):
        try:
            start, end = _ids([tokenizer.start_of_turn_id]), _ids([tokenizer.end_of_turn_id])
        except TokenizerError as error:
            raise DataError("invalid_chat", f"the dataset has chat records, but {error}") from error
        model_header, newline = _ids(tokenizer.encode("model\n")), _ids(tokenizer.encode("\n"))
    result = []
    for item in rendered:
        if isinstance(item, str):
            result.append(EncodedDocument(np.concatenate([bos, next(encoded), eos]), None))
            continue
        # (each part's tokens, and whether they are trained)
        parts: list[tuple[np.ndarray, bool]] = [(bos, False)]
        if isinstance(item, Completion):
            parts += [(next(encoded), train_on_inputs), (next(encoded), True), (eos, True)]
        else:
            for turn in item:
                if turn.role == "model":
                    reply = [
                        (model_header, train_on_inputs),
                        (next(encoded), turn.trained),
                        (end, turn.trained),
                    ]
                else:
                    reply = [(next(encoded), train_on_inputs), (end, train_on_inputs)]
                parts += [(start, train_on_inputs), *reply, (newline, train_on_inputs)]
            parts.append((eos, train_on_inputs))
        tokens = np.concatenate([part for part, _ in parts])
        flags = np.concatenate([np.full(len(part), flag) for part, flag in parts])
        # (all of them: as plain text; the bos, never a target, does not count)
        result.append(EncodedDocument(tokens, None if flags[1:].all() else flags))
    return result


# --- Packing ---------------------------------------------------------------------------------------------

# A piece of a long document must be at least this long to fill a gap: shorter gaps stay padding rather
# than cut documents into scraps with next to no context.
MIN_FILL = 16


@dataclass(frozen=True)
class Piece:
    """Tokens [start, stop) of a document, placed at `offset` in `row` as that row's segment `segment`."""

    document: int
    start: int
    stop: int
    row: int
    offset: int
    segment: int


class _Rows:
    """Rows being filled, with the open ones indexed by how much room they have left."""

    def __init__(self, row_len: int) -> None:
        self.row_len = row_len
        self.used: list[int] = []
        self.segments: list[int] = []
        self.by_room: list[list[int]] = [[] for _ in range(row_len + 1)]
        self.has_room = np.zeros(row_len + 1, dtype=bool)

    def place(self, size: int) -> tuple[int, int, int]:
        """Put `size` tokens in the open row with the least room that fits them, or a new row.

        Returns (row, offset, segment)."""
        room = size + int(np.argmax(self.has_room[size:]))
        if self.has_room[room]:
            row = self.by_room[room].pop()
            self.has_room[room] = bool(self.by_room[room])
        else:
            row = len(self.used)
            self.used.append(0)
            self.segments.append(0)
        offset = self.used[row]
        self.used[row] += size
        self.segments[row] += 1
        room = self.row_len - self.used[row]
        # A segment holds at least two tokens (an input and its target); a smaller gap stays padding.
        if room >= 2:
            self.by_room[room].append(row)
            self.has_room[room] = True
        return row, offset, self.segments[row]

    def widest_room(self) -> int:
        """The most room an open row has; 0 when none is open."""
        open_rooms = np.flatnonzero(self.has_room)
        return int(open_rooms[-1]) if len(open_rooms) else 0


def pack(lengths: Sequence[int], row_len: int) -> tuple[list[Piece], int]:
    """Pack documents of the given lengths into rows of `row_len` tokens; returns (pieces, number of rows).

    Documents that fit a row are packed whole, best-fit decreasing. Longer documents must be cut anyway:
    their pieces first fill the widest gaps left (down to MIN_FILL tokens), then whole rows, and the last
    piece is placed best-fit. Consecutive pieces of a document overlap by one token, so the target that
    crosses a cut is still trained, exactly once.
    """
    rows = _Rows(row_len)
    pieces: list[Piece] = []
    short = [index for index, length in enumerate(lengths) if length <= row_len]
    for document in sorted(short, key=lambda index: -lengths[index]):
        pieces.append(Piece(document, 0, lengths[document], *rows.place(lengths[document])))
    for document, length in enumerate(lengths):
        start = 0
        while length - start > row_len:
            room = rows.widest_room()
            size = room if room >= MIN_FILL else row_len
            pieces.append(Piece(document, start, start + size, *rows.place(size)))
            start += size - 1
        if start:
            pieces.append(Piece(document, start, length, *rows.place(length - start)))
    return pieces, len(rows.used)


def _fit_pair(chosen: int, rejected: int, row_len: int) -> tuple[int, int]:
    """How many tokens of each of a pair's documents a row keeps: all, else the shorter whole (when it takes
    at most half) and the longer cut to the rest, else half each."""
    if chosen + rejected <= row_len:
        return chosen, rejected
    half = row_len // 2
    if chosen <= half:
        return chosen, row_len - chosen
    if rejected <= half:
        return row_len - rejected, rejected
    return half, row_len - half


def pack_pairs(lengths: Sequence[int], row_len: int) -> tuple[list[Piece], int]:
    """Pack preference pairs (documents 2i, 2i + 1: chosen, rejected) into rows, best-fit decreasing; a
    pair's documents lie side by side in one row as segments 2k - 1 and 2k, cut at their ends where the two
    do not fit a row together (see `_fit_pair`). Returns (pieces, number of rows)."""
    rows = _Rows(row_len)
    pieces: list[Piece] = []
    kept = [_fit_pair(lengths[i], lengths[i + 1], row_len) for i in range(0, len(lengths), 2)]
    for pair in sorted(range(len(kept)), key=lambda index: -sum(kept[index])):
        chosen, rejected = kept[pair]
        row, offset, unit = rows.place(chosen + rejected)
        pieces.append(Piece(2 * pair, 0, chosen, row, offset, 2 * unit - 1))
        pieces.append(Piece(2 * pair + 1, 0, rejected, row, offset + chosen, 2 * unit))
    return pieces, len(rows.used)


@dataclass(frozen=True)
class DataStats:
    documents: int
    tokens: int  # document tokens, bos and eos included
    target_tokens: int  # targets that carry loss
    rows: int
    row_len: int
    pad_tokens: int  # row slots that hold padding

    @property
    def pad_fraction(self) -> float:
        return self.pad_tokens / (self.rows * self.row_len) if self.rows else 0.0

    @staticmethod
    def total(parts: Sequence[DataStats]) -> DataStats:
        return DataStats(
            documents=sum(part.documents for part in parts),
            tokens=sum(part.tokens for part in parts),
            target_tokens=sum(part.target_tokens for part in parts),
            rows=sum(part.rows for part in parts),
            row_len=parts[0].row_len,
            pad_tokens=sum(part.pad_tokens for part in parts),
        )


class PackedShard:
    """One data shard's documents packed into rows of `row_len` tokens."""

    def __init__(
        self, documents: Sequence[EncodedDocument], row_len: int, pad_id: int, pairs: bool = False
    ) -> None:
        """`pairs`: the documents are preference pairs, chosen and rejected by turns (`pack_pairs`)."""
        sizes = [len(document.tokens) for document in documents]
        if pairs:
            pieces, num_rows = pack_pairs(sizes, row_len)
        else:
            pieces, num_rows = pack(sizes, row_len)
        self.row_len = row_len
        self.pad_id = pad_id
        self.tokens = np.full((num_rows, row_len), pad_id, dtype=np.int32)
        self.segments = np.zeros((num_rows, row_len), dtype=np.min_scalar_type(row_len // 2))
        self.trained = np.zeros((num_rows, row_len), dtype=bool)
        if pieces:
            # Scatter all pieces to their places in one vectorized step, not one Python loop per piece.
            lengths = np.array([piece.stop - piece.start for piece in pieces])
            starts = np.array([piece.row * row_len + piece.offset for piece in pieces])
            into = np.arange(int(lengths.sum())) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
            self.segments.reshape(-1)[into] = np.repeat([piece.segment for piece in pieces], lengths)
            self.tokens.reshape(-1)[into] = np.concatenate(
                [documents[piece.document].tokens[piece.start : piece.stop] for piece in pieces]
            )
            trained = [documents[piece.document].trained for piece in pieces]
            self.trained.reshape(-1)[into] = np.concatenate(
                [
                    np.ones(piece.stop - piece.start, bool)
                    if flags is None
                    else flags[piece.start : piece.stop]
                    for piece, flags in zip(pieces, trained, strict=True)
                ]
            )
        if pairs:
            _check_pairs_scored(documents, pieces, row_len)
        self.stats = DataStats(
            documents=len(documents) // 2 if pairs else len(documents),
            tokens=sum(len(document.tokens) for document in documents),
            target_tokens=int(_loss_mask(self.segments, self.trained).sum()),
            rows=num_rows,
            row_len=row_len,
            pad_tokens=int((self.segments == 0).sum()),
        )

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, segments, trained) of the given rows; an index past the end gives an all-pad row."""
        tokens = np.full((len(indices), self.row_len), self.pad_id, dtype=np.int32)
        segments = np.zeros((len(indices), self.row_len), dtype=self.segments.dtype)
        trained = np.zeros((len(indices), self.row_len), dtype=bool)
        real = indices < self.num_rows
        tokens[real], segments[real], trained[real] = (
            self.tokens[indices[real]],
            self.segments[indices[real]],
            self.trained[indices[real]],
        )
        return tokens, segments, trained


def _check_pairs_scored(documents: Sequence[EncodedDocument], pieces: Sequence[Piece], row_len: int) -> None:
    """Raise DataError if a pair's document was cut before its reply: nothing of it left to compare."""
    unscored = {
        piece.document // 2
        for piece in pieces
        if (flags := documents[piece.document].trained) is not None and not flags[1 : piece.stop].any()
    }
    if unscored:
        raise DataError(
            "preference_too_long",
            f"{len(unscored)} preference pairs have a prompt so long that a row of {row_len - 1} tokens "
            "holds none of a reply once both replies share it; raise max_seq_len (to fit the prompt and "
            "both replies), or shorten those prompts",
        )


def _loss_mask(segments: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """Per input position: the next token is a trained target in the same (real) segment."""
    return (segments[:, :-1] != 0) & (segments[:, :-1] == segments[:, 1:]) & trained[:, 1:]


def _positions(segments: np.ndarray) -> np.ndarray:
    """Each token's index within its segment; 0 on padding."""
    columns = np.arange(segments.shape[1])
    starts = np.ones(segments.shape, dtype=bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
    return np.where(segments != 0, columns - first, 0).astype(np.int32)


def make_batch(tokens: np.ndarray, segments: np.ndarray, trained: np.ndarray) -> Batch:
    """The model's batch from packed rows of `max_seq_len + 1` tokens."""
    inputs = segments[:, :-1]
    return {
        "tokens": np.ascontiguousarray(tokens[:, :-1]),
        "targets": np.ascontiguousarray(tokens[:, 1:]),
        "segment_ids": inputs.astype(np.int32),
        "positions": _positions(inputs),
        "loss_mask": _loss_mask(segments, trained).astype(np.float32),
    }


# --- Train and eval data ---------------------------------------------------------------------------------


class _ShardedData:
    """The packed shards this process holds; each shard contributes `global_batch_size / num_shards` rows."""

    def __init__(
        self,
        documents: Sequence[Document],
        tokenizer: Tokenizer,
        max_seq_len: int,
        global_batch_size: int,
        seed: int,
        shard_indices: Sequence[int],
        num_shards: int,
        num_threads: int = -1,
        train_on_inputs: bool = False,
    ) -> None:
        if num_shards < 1 or not shard_indices or any(not 0 <= s < num_shards for s in shard_indices):
            raise ValueError(
                f"shard_indices {list(shard_indices)} must be a non-empty subset of 0..{num_shards - 1}"
            )
        if len(set(shard_indices)) != len(shard_indices):
            raise ValueError(f"shard_indices {list(shard_indices)} repeat a shard")
        if global_batch_size % num_shards:
            raise DataError(
                "batch_size_not_divisible",
                f"batch_size {global_batch_size} does not split evenly over {num_shards} data shards "
                f"(processes); use a multiple of {num_shards}",
            )
        self.max_seq_len = max_seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.num_shards = num_shards
        self.shard_indices = sorted(shard_indices)
        self.shard_batch_size = global_batch_size // num_shards
        # Tokenizer models without a pad piece say -1; pad slots are masked, so any valid id serves.
        pad_id = max(tokenizer.pad_id, 0)
        self.pairs = any(isinstance(document, Preference) for document in documents)
        check_objective(documents, "the data", "dpo" if self.pairs else "sft")  # (pairs alone, or none)
        mine = [shard_documents(documents, seed, shard, num_shards) for shard in self.shard_indices]
        documents_here = [d for shard in mine for d in shard]
        encoded = encode_documents(documents_here, tokenizer, num_threads, train_on_inputs)
        # Each encoded document's tokens (a preference pair's two replies apart), for `summarize`.
        self.document_tokens = np.fromiter((len(d.tokens) for d in encoded), np.int64, len(encoded))
        per_document = 2 if self.pairs else 1
        rest = iter(encoded)
        self.shards = [
            PackedShard(
                [next(rest) for _ in range(per_document * len(shard))], max_seq_len + 1, pad_id, self.pairs
            )
            for shard in mine
        ]
        self.stats = DataStats.total([shard.stats for shard in self.shards])
        self._check_rows()

    def _check_rows(self) -> None:
        """Raise DataError if the packed rows cannot serve this kind of data."""

    @property
    def rows_per_shard(self) -> list[int]:
        return [shard.num_rows for shard in self.shards]

    def _batch(self, indices: Sequence[np.ndarray]) -> Batch:
        parts = [shard.rows(rows) for shard, rows in zip(self.shards, indices, strict=True)]
        return make_batch(*(np.concatenate(arrays) for arrays in zip(*parts, strict=True)))


class TrainData(_ShardedData):
    """Training batches as a pure function of the global step: resuming at step k replays exactly.

    Rows are reshuffled every epoch within each shard by a (seed, epoch, shard) generator. The local
    `steps_per_epoch` is what the smallest held shard allows; a multi-process trainer agrees on the
    minimum over all processes and sets it with `use_steps_per_epoch`.
    """

    def _check_rows(self) -> None:
        for shard, rows in zip(self.shard_indices, self.rows_per_shard, strict=True):
            if rows < self.shard_batch_size:
                raise DataError("too_few_rows", self._too_few_rows(shard, rows))
        self.local_steps_per_epoch = min(rows // self.shard_batch_size for rows in self.rows_per_shard)
        self.steps_per_epoch = self.local_steps_per_epoch
        self._epoch_orders: tuple[int, list[np.ndarray]] | None = None

    def _too_few_rows(self, shard: int, rows: int) -> str:
        where = f" on data shard {shard} of {self.num_shards}" if self.num_shards > 1 else ""
        fewer = f"fewer than one batch of {self.global_batch_size} rows"
        if self.num_shards > 1:
            fewer += f" ({self.shard_batch_size} per shard)"
        if rows == 0:
            advice = "add documents or run on fewer processes"
        else:
            advice = f"use batch_size {rows * self.num_shards} or less, a smaller max_seq_len, or more data"
        return (
            f"the training data packs into {rows} rows of {self.max_seq_len} tokens{where}, {fewer}; {advice}"
        )

    def use_steps_per_epoch(self, steps: int) -> None:
        """Adopt the epoch length agreed across processes (the minimum of their `local_steps_per_epoch`)."""
        if not 1 <= steps <= self.local_steps_per_epoch:
            raise ValueError(f"steps_per_epoch {steps} must be in 1..{self.local_steps_per_epoch}")
        self.steps_per_epoch = steps
        self._epoch_orders = None

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def batch(self, step: int) -> Batch:
        """The local batch of global step `step`: each held shard's rows, concatenated in shard order."""
        epoch, index = divmod(step, self.steps_per_epoch)
        orders = self._orders(epoch)
        size = self.shard_batch_size
        return self._batch([order[index * size : (index + 1) * size] for order in orders])

    def position(self, step: int) -> dict[str, int]:
        """Where the data stands before `step`, for a checkpoint."""
        return {"step": step, "epoch": self.epoch_of(step), "seed": self.seed}

    def _orders(self, epoch: int) -> list[np.ndarray]:
        if self._epoch_orders is None or self._epoch_orders[0] != epoch:
            orders = [
                np.random.default_rng([self.seed, _EPOCH_STREAM, epoch, shard]).permutation(rows)
                for shard, rows in zip(self.shard_indices, self.rows_per_shard, strict=True)
            ]
            self._epoch_orders = (epoch, orders)
        return self._epoch_orders[1]


class EvalData(_ShardedData):
    """The validation set in fixed batches that cover it once; short shards are topped up with all-pad rows
    (zero loss_mask), so every process can run the same number of eval steps."""

    @property
    def num_batches(self) -> int:
        """Batches this process needs; a multi-process trainer runs the maximum over processes."""
        return max(math.ceil(rows / self.shard_batch_size) for rows in self.rows_per_shard)

    def eval_batches(self, num_batches: int | None = None) -> list[Batch]:
        count = self.num_batches if num_batches is None else num_batches
        if count < self.num_batches:
            raise ValueError(
                f"{count} eval batches would leave out validation rows; at least {self.num_batches}"
            )
        size = self.shard_batch_size
        return [
            self._batch([np.arange(index * size, (index + 1) * size)] * len(self.shards))
            for index in range(count)
        ]


def load_train_data(
    spec: JobSpec,
    tokenizer: Tokenizer,
    process_index: int,
    process_count: int,
    data_shards: int | None = None,
    num_threads: int = -1,
) -> tuple[TrainData, EvalData | None]:
    """Read, tokenize and pack this process's shards of the job's training (and validation) data.

    There are `data_shards` shards (default one per process); process i holds the i-th run of
    `data_shards / process_count` consecutive shards, so one process holding shards [0, 1] reproduces two.
    Raises DataError for data the job cannot use, before anything is compiled.
    """
    shards = data_shards or process_count
    if shards % process_count:
        raise DataError(
            "bad_data_shards", f"{shards} data shards do not split evenly over {process_count} processes"
        )
    per_process = shards // process_count
    hyper = spec.hyperparameters
    objective = spec.method.objective
    documents = read_documents(spec.dataset_uri)
    check_objective(documents, spec.dataset_uri, objective)
    validation: list[Document] | None = None
    if spec.validation_uri is not None:
        validation = read_documents(spec.validation_uri)
        check_objective(validation, spec.validation_uri, objective)
    elif spec.validation_split is not None:
        documents, validation = split_validation(documents, spec.validation_split, hyper.seed)
    indices = list(range(process_index * per_process, (process_index + 1) * per_process))
    settings = (tokenizer, hyper.max_seq_len, hyper.batch_size, hyper.seed, indices, shards, num_threads)
    # (the validation data's loss is the same objective's: its prompts count as training's do)
    train = TrainData(documents, *settings, train_on_inputs=hyper.train_on_inputs)
    return train, None if validation is None else EvalData(
        validation, *settings, train_on_inputs=hyper.train_on_inputs
    )


@dataclass(frozen=True)
class DatasetSummary:
    """What a dataset is, by kind of record, and what it packs into (`tputune check-data`)."""

    texts: int
    chats: int
    completions: int  # prompt/completion pairs
    preferences: int  # preference pairs (a prompt, a chosen and a rejected reply)
    lengths: list[int]  # each document's tokens, bos and eos included (a preference pair's: both replies')
    stats: DataStats  # packed into rows of max_seq_len + 1 tokens, as one process of a job packs them

    @property
    def cut(self) -> int:
        """Documents longer than a row: packed in pieces (preference pairs: their replies cut short)."""
        return sum(length > self.stats.row_len for length in self.lengths)


def summarize(
    documents: Sequence[Document], tokenizer: Tokenizer, max_seq_len: int, train_on_inputs: bool = False
) -> DatasetSummary:
    """The documents' kinds, tokens and trained tokens, packed as one process of a job of `max_seq_len`
    packs them (its validation data: all of them, in the order of seed 0)."""
    packed = EvalData(documents, tokenizer, max_seq_len, 1, 0, [0], 1, train_on_inputs=train_on_inputs)
    tokens = packed.document_tokens
    lengths = (tokens.reshape(-1, 2).sum(axis=1) if packed.pairs else tokens).tolist()  # (a pair's: both)
    return DatasetSummary(
        texts=sum(isinstance(document, str) for document in documents),
        chats=sum(isinstance(document, tuple) for document in documents),
        completions=sum(isinstance(document, Completion) for document in documents),
        preferences=sum(isinstance(document, Preference) for document in documents),
        lengths=lengths,
        stats=packed.stats,
    )
