"""The input pipeline: parsing, bad data, packing, sharding, determinism, validation and GCS sources."""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from api import cli
from tests.support.gcs import GcsEmulator
from worker import data
from worker.config import JobSpec
from worker.data import (
    TXT_SEPARATOR,
    DataError,
    EvalData,
    Message,
    Preference,
    TrainData,
    encode_documents,
    load_train_data,
    pack,
    pack_pairs,
    read_documents,
    shard_documents,
    split_validation,
)
from worker.stories import generate_stories, write_txt
from worker.tokenizer import Tokenizer

CHAT = {
    "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Who is Amy?"},
        {"role": "model", "content": "Amy is a girl."},
        {"role": "user", "content": "Where does she live?"},
        {"role": "model", "content": "In a small house."},
    ]
}
CHAT_TEMPLATE = (
    "<start_of_turn>user\nAnswer briefly.\n\nWho is Amy?<end_of_turn>\n"
    "<start_of_turn>model\nAmy is a girl.<end_of_turn>\n"
    "<start_of_turn>user\nWhere does she live?<end_of_turn>\n"
    "<start_of_turn>model\nIn a small house.<end_of_turn>\n"
)


def write(path: Path, content: str | bytes) -> str:
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return str(path)


def jsonl(*records: object) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


def texts(path: Path) -> list[str]:
    """The documents of a plain-text dataset."""
    documents = read_documents(str(path))
    assert all(isinstance(document, str) for document in documents)
    return [document for document in documents if isinstance(document, str)]


def all_rows(
    documents: Sequence[data.Document], tokenizer: Tokenizer, max_seq_len: int
) -> dict[str, np.ndarray]:
    """Every packed row of one shard, once, as a single batch."""
    eval_data = EvalData(documents, tokenizer, max_seq_len, 1, 0, [0], 1)
    return {
        key: np.concatenate([batch[key] for batch in eval_data.eval_batches()])
        for key in eval_data.eval_batches()[0]
    }


def segments_of(batch: dict[str, np.ndarray], row: int) -> list[np.ndarray]:
    """The column indices of each non-pad segment of a row, in order."""
    ids = batch["segment_ids"][row]
    return [np.flatnonzero(ids == segment) for segment in range(1, int(ids.max()) + 1)]


# --- Parsing ---------------------------------------------------------------------------------------------


def test_txt_documents_are_split_on_endoftext_stripped_and_empties_dropped(tmp_path: Path) -> None:
    text = f"  First story.\nIt has two lines.  \n{TXT_SEPARATOR}\n\n{TXT_SEPARATOR}\nSecond story.\n"
    assert read_documents(write(tmp_path / "a.txt", text)) == [
        "First story.\nIt has two lines.",
        "Second story.",
    ]


def test_jsonl_text_records_skip_blank_lines_and_empty_texts(tmp_path: Path) -> None:
    uri = write(
        tmp_path / "a.jsonl", jsonl({"text": "One."}, {"text": "  "}) + "\n" + jsonl({"text": "Two."})
    )
    assert read_documents(uri) == ["One.", "Two."]


def test_jsonl_chat_record_is_a_tuple_of_messages(tmp_path: Path) -> None:
    [chat] = read_documents(write(tmp_path / "chat.jsonl", jsonl(CHAT)))
    assert chat == tuple(Message(m["role"], m["content"]) for m in CHAT["messages"])


def test_openai_chat_records_read_as_gemma_chats(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    """OpenAI's and Together's chat data as it is: `assistant` is Gemma's `model`, content may be a list of
    text parts, and an assistant message of `"weight": 0` is not trained (OpenAI's meaning)."""
    openai = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Who is "}, {"type": "text", "text": "Amy?"}],
            },
            {"role": "assistant", "content": "Amy is a girl.", "weight": 0},
            {"role": "user", "content": "Where does she live?", "name": "tom"},
            {"role": "assistant", "content": "In a small house.", "weight": 1},
        ]
    }
    [chat] = read_documents(write(tmp_path / "openai.jsonl", jsonl(openai)))
    [gemma] = read_documents(write(tmp_path / "gemma.jsonl", jsonl(CHAT)))
    assert isinstance(chat, tuple) and [(m.role, m.content) for m in chat] == [
        (m.role, m.content) for m in gemma
    ]
    assert [m.trained for m in chat] == [True, True, False, True, True]
    [weighted], [plain] = encode_documents([chat], tiny_tokenizer), encode_documents([gemma], tiny_tokenizer)
    assert weighted.tokens.tolist() == plain.tokens.tolist()
    assert weighted.trained is not None
    assert tiny_tokenizer.decode(weighted.tokens[weighted.trained]) == "In a small house.<end_of_turn>"
    # train_on_inputs trains the rest, but not a reply of weight 0.
    [every] = encode_documents([chat], tiny_tokenizer, train_on_inputs=True)
    assert every.trained is not None and not every.trained[1:].all()
    untrained = tiny_tokenizer.decode(every.tokens[1:][~every.trained[1:]])
    assert untrained == "Amy is a girl.<end_of_turn>"


def test_prompt_completion_records_train_the_completion(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    """`{"prompt", "completion"}` (Together's instruction data, OpenAI's earlier format): bos, the prompt,
    the completion and eos, each part encoded apart; the completion and eos carry the loss (with
    train_on_inputs, the prompt too), in packed batches as well."""
    records = [
        {"prompt": "Q: Who is Amy?\nA:", "completion": " A girl."},
        {"prompt": "", "completion": "Hi."},
    ]
    documents = read_documents(write(tmp_path / "pairs.jsonl", jsonl(*records)))
    assert documents == [data.Completion("Q: Who is Amy?\nA:", " A girl."), data.Completion("", "Hi.")]
    first, second = encode_documents(documents, tiny_tokenizer)
    bos, eos = tiny_tokenizer.bos_id, tiny_tokenizer.eos_id
    prompt, completion = tiny_tokenizer.encode("Q: Who is Amy?\nA:"), tiny_tokenizer.encode(" A girl.")
    assert first.tokens.tolist() == [bos, *prompt, *completion, eos]
    assert first.trained is not None
    assert first.trained.tolist() == [False] * (1 + len(prompt)) + [True] * (len(completion) + 1)
    assert second.trained is None  # (an empty prompt: every target is trained, as in plain text)
    [every, _] = encode_documents(documents, tiny_tokenizer, train_on_inputs=True)
    assert every.trained is None
    # Packed: the trained targets are the completions and their eos, of both (the second's bos is no target).
    batch = all_rows(documents, tiny_tokenizer, 64)
    trained_targets = sorted(batch["targets"][batch["loss_mask"] == 1].tolist())
    assert trained_targets == sorted([*completion, eos, *tiny_tokenizer.encode("Hi."), eos])


def test_parquet_chats_and_pairs_read_as_their_jsonl_records(tmp_path: Path) -> None:
    """Parquet as Hugging Face datasets store chats (a `messages` column of role/content structs, a weight
    where some have one) and prompt/completion pairs: the same documents as the JSONL records."""
    given = [dict(message) for message in CHAT["messages"]]
    given[2] = {"role": "assistant", "content": "Amy is a girl.", "weight": 0}
    # (a Parquet struct has every field: null where a message has no weight)
    chats = pa.table({"messages": [[{"weight": None, **m} for m in chat] for chat in (given, given[1:])]})
    read = read_documents(write(tmp_path / "chats.parquet", _parquet_bytes(chats)))
    records = jsonl({"messages": given}, {"messages": given[1:]})
    expected = read_documents(write(tmp_path / "chats.jsonl", records))
    assert read == expected and len(read) == 2
    assert isinstance(read[0], tuple) and [m.trained for m in read[0]] == [True, True, False, True, True]
    pairs = pa.table({"prompt": ["Q: hi\nA:", ""], "completion": [" hello", "Hi."], "id": [1, 2]})
    assert read_documents(write(tmp_path / "pairs.parquet", _parquet_bytes(pairs))) == [
        data.Completion("Q: hi\nA:", " hello"),
        data.Completion("", "Hi."),
    ]


# A preference pair in OpenAI's shape: the prompt's messages (a model turn among them) and two replies.
PREFERENCE = {
    "input": {"messages": CHAT["messages"][:4]},
    "preferred_output": [{"role": "assistant", "content": "In a small house."}],
    "non_preferred_output": [{"role": "assistant", "content": [{"type": "text", "text": "I do not know."}]}],
}
PREFERENCE_PROMPT = tuple(Message(m["role"], m["content"]) for m in CHAT["messages"][:4])


def test_preference_pairs_read_in_openai_trl_and_parquet_shapes(tmp_path: Path) -> None:
    """OpenAI's (and Together's) `input`/`preferred_output`/`non_preferred_output`, TRL's `prompt`/`chosen`/
    `rejected` as strings or as messages, and both as Parquet columns: the same pairs."""
    chat = Preference(PREFERENCE_PROMPT, "In a small house.", "I do not know.")
    text = Preference("Q: hi\nA:", " hello", " go away")
    trl_chat = {
        "prompt": CHAT["messages"][:4],
        "chosen": [{"role": "assistant", "content": "In a small house."}],
        "rejected": [{"role": "model", "content": "I do not know."}],
    }
    trl_text = {"prompt": "Q: hi\nA:", "chosen": " hello", "rejected": " go away"}
    uri = write(tmp_path / "pairs.jsonl", jsonl(PREFERENCE, trl_text, trl_chat))
    assert read_documents(uri) == [chat, text, chat]
    openai = pa.Table.from_pylist([{**PREFERENCE, "non_preferred_output": trl_chat["rejected"]}] * 2)
    assert read_documents(write(tmp_path / "openai.parquet", _parquet_bytes(openai))) == [chat, chat]
    trl = pa.Table.from_pylist([trl_text, {**trl_text, "id": 2}])
    assert read_documents(write(tmp_path / "trl.parquet", _parquet_bytes(trl))) == [text, text]


def test_a_preference_pair_is_its_prompt_with_each_reply_only_the_reply_trained(
    tiny_tokenizer: Tokenizer,
) -> None:
    """A pair encodes as two documents, chosen then rejected: the prompt rendered as a chat (or a plain
    prompt) with each reply; only the reply and its end are trained, not a model turn of the prompt."""
    pair = Preference(PREFERENCE_PROMPT, "In a small house.", "I do not know.")
    chosen, rejected = encode_documents([pair], tiny_tokenizer)
    assert tiny_tokenizer.decode(chosen.tokens[1:-1]) == CHAT_TEMPLATE
    for document, reply in ((chosen, "In a small house."), (rejected, "I do not know.")):
        assert document.trained is not None
        assert tiny_tokenizer.decode(document.tokens[document.trained]) == f"{reply}<end_of_turn>"
    prompt = len(tiny_tokenizer.encode(CHAT_TEMPLATE.rsplit("model\n", 1)[0]))
    assert chosen.tokens[:prompt].tolist() == rejected.tokens[:prompt].tolist()
    text = Preference("Q: hi\nA:", " hello", " go away")
    pair_documents = encode_documents([text], tiny_tokenizer)
    completions = encode_documents(
        [data.Completion("Q: hi\nA:", r) for r in (" hello", " go away")], tiny_tokenizer
    )
    for got, expected in zip(pair_documents, completions, strict=True):
        assert got.tokens.tolist() == expected.tokens.tolist()
        assert np.array_equal(got.trained, expected.trained)  # type: ignore[arg-type]


def test_fit_pair_keeps_a_shorter_reply_whole_and_cuts_the_longer() -> None:
    assert data._fit_pair(30, 34, 64) == (30, 34)
    assert data._fit_pair(20, 60, 64) == (20, 44)
    assert data._fit_pair(60, 20, 64) == (44, 20)
    assert data._fit_pair(50, 40, 65) == (32, 33)


@pytest.mark.parametrize("row_len", [17, 65, 257])
def test_pack_pairs_lays_each_pair_side_by_side_in_one_row(row_len: int) -> None:
    """A pair's documents: one row, adjacent, segments 2k - 1 (chosen) and 2k (rejected); whole when they fit
    together, else cut at their ends to fill the row; no slot used twice."""
    rng = np.random.default_rng(row_len)
    lengths = [int(n) for n in rng.lognormal(np.log(row_len * 0.35), 0.6, size=400).clip(3)]
    pieces, num_rows = pack_pairs(lengths, row_len)
    assert len(pieces) == len(lengths)
    by_document = {piece.document: piece for piece in pieces}
    occupied = np.zeros((num_rows, row_len), dtype=int)
    for pair in range(len(lengths) // 2):
        chosen, rejected = by_document[2 * pair], by_document[2 * pair + 1]
        assert (
            chosen.row == rejected.row and chosen.segment % 2 == 1 and rejected.segment == chosen.segment + 1
        )
        assert rejected.offset == chosen.offset + chosen.stop and chosen.start == rejected.start == 0
        kept = (chosen.stop, rejected.stop)
        assert kept == data._fit_pair(lengths[2 * pair], lengths[2 * pair + 1], row_len)
        assert (sum(kept) == row_len) if lengths[2 * pair] + lengths[2 * pair + 1] > row_len else True
        occupied[chosen.row, chosen.offset : rejected.offset + rejected.stop] += 1
    assert occupied.max() == 1
    assert any(len({p.segment for p in pieces if p.row == row}) > 2 for row in range(num_rows))


def test_preference_batches_score_each_reply_in_its_segment(tiny_tokenizer: Tokenizer) -> None:
    """Packed, a pair's chosen document is an odd segment and its rejected the next, each trained on its
    reply alone; a prompt that leaves no room for a reply in a row is preference_too_long."""
    pairs = [
        Preference(f"Story {i}: Amy had a ball.", f" It was red {i}.", f" Go away {i}.") for i in range(6)
    ]
    batch = all_rows(pairs, tiny_tokenizer, 64)
    mask = batch["loss_mask"] == 1
    replies = []
    for row in range(len(mask)):
        ids = batch["segment_ids"][row]
        for segment in range(1, int(ids.max()) + 1):
            replies.append(tiny_tokenizer.decode(batch["targets"][row][(ids == segment) & mask[row]]))
    expected = [reply for i in range(6) for reply in (f" It was red {i}.", f" Go away {i}.")]
    assert sorted(replies) == sorted(expected) and replies.index(" It was red 0.") % 2 == 0
    assert replies[replies.index(" It was red 0.") + 1] == " Go away 0."
    assert EvalData(pairs, tiny_tokenizer, 64, 1, 0, [0], 1).stats.documents == 6
    long_prompt = Preference(" ".join(generate_stories(3, 0)), "Yes.", "No.")
    with pytest.raises(DataError) as error:
        EvalData([long_prompt, *pairs], tiny_tokenizer, 64, 1, 0, [0], 1)
    assert error.value.code == "preference_too_long"
    assert error.value.message.startswith("1 preference pairs have a prompt so long that a row of 64 tokens")


def test_a_job_learns_from_preference_pairs_only_with_objective_dpo(
    tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    pairs = write(tmp_path / "pairs.jsonl", jsonl(*[PREFERENCE] * 8))
    stories = str(write_txt(tmp_path / "stories.txt", generate_stories(8, 0)))
    mixed = write(tmp_path / "mixed.jsonl", jsonl(PREFERENCE, CHAT))

    def load(dataset: str, objective: str, **spec: str) -> str:
        body = {"name": "t", "model": "tiny", "dataset_uri": dataset, "method": {"objective": objective}}
        with pytest.raises(DataError) as error:
            load_train_data(JobSpec.model_validate({**body, **spec}), tiny_tokenizer, 0, 1)
        return f"{error.value.code}: {error.value.message}"

    assert load(pairs, "sft") == (
        f"preference_data_needs_dpo: {pairs} holds preference pairs (a prompt, a chosen and a rejected "
        "reply); set method.objective to dpo to learn from them"
    )
    assert load(stories, "dpo").startswith(f"not_preference_data: {stories} holds no preference pairs")
    assert load(pairs, "dpo", validation_uri=stories).startswith(f"not_preference_data: {stories} holds no")
    assert load(mixed, "dpo") == (
        f"mixed_preference_data: {mixed} holds 1 preference pairs and 1 other records; a job trains on one "
        "or the other: preference pairs with objective dpo, the rest with objective sft"
    )
    spec = {"name": "t", "model": "tiny", "dataset_uri": pairs, "method": {"objective": "dpo"}}
    train, _ = load_train_data(
        JobSpec.model_validate({**spec, "hyperparameters": {"batch_size": 2, "max_seq_len": 128}}),
        tiny_tokenizer,
        0,
        1,
    )
    assert train.pairs and train.stats.documents == 8 and train.stats.rows >= 4


def test_check_data_says_what_a_dataset_holds_and_packs_into(
    tmp_path: Path, tiny_tokenizer_path: Path, tiny_tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tputune check-data`: the records by kind, tokens and trained tokens, and the rows a job of that
    max_seq_len packs them into, as the job's own pipeline counts them; bad data: its code and sentence."""
    records = [
        CHAT,
        {"prompt": "Q: hi\nA:", "completion": " hello"},
        *({"text": s} for s in generate_stories(6, 1)),
    ]
    uri = write(tmp_path / "mixed.jsonl", jsonl(*records))
    args = ["check-data", uri, "--tokenizer", str(tiny_tokenizer_path), "--max-seq-len", "64"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    documents = read_documents(uri)
    stats = EvalData(documents, tiny_tokenizer, 64, 1, 0, [0], 1).stats
    assert out.startswith(f"{uri}: 8 documents (6 texts, 1 chat, 1 prompt/completion pair)\n")
    share = stats.target_tokens / stats.tokens
    assert f"  tokens: {stats.tokens:,}, trained {stats.target_tokens:,} ({share:.1%});" in out
    assert f"  max_seq_len 64: {stats.rows:,} rows, {stats.pad_fraction:.1%} padding" in out
    lengths = sorted(len(d.tokens) for d in encode_documents(documents, tiny_tokenizer))
    assert f"; per document median {lengths[4]:,}, longest {lengths[-1]:,}\n" in out
    longer = sum(length > 65 for length in lengths)
    assert longer > 0 and f"; {longer} documents longer than a row, packed in pieces" in out
    # train_on_inputs trains the chat's user turn and the prompt too.
    assert cli.main([*args, "--train-on-inputs"]) == 0
    every = EvalData(documents, tiny_tokenizer, 64, 1, 0, [0], 1, train_on_inputs=True).stats
    assert every.target_tokens > stats.target_tokens
    assert f"trained {every.target_tokens:,} " in capsys.readouterr().out
    assert cli.main([*args[:-1], "4"]) == 2
    assert "error: --max-seq-len: Input should be greater than or equal to 8" in capsys.readouterr().err
    assert cli.main([*args[:2], "--tokenizer", uri]) == 3
    assert f"error: cannot read the tokenizer {uri}: " in capsys.readouterr().err
    # Preference pairs: counted as pairs, their replies' tokens scored; no --train-on-inputs for them.
    pairs = write(tmp_path / "pairs.jsonl", jsonl(*[PREFERENCE] * 3))
    tokenizer = ["--tokenizer", str(tiny_tokenizer_path)]
    assert cli.main(["check-data", pairs, *tokenizer]) == 0
    out = capsys.readouterr().out
    scored = EvalData(read_documents(pairs), tiny_tokenizer, 512, 1, 0, [0], 1).stats
    assert out.startswith(f"{pairs}: 3 records (3 preference pairs)\n")
    both = sum(len(d.tokens) for d in encode_documents(read_documents(pairs)[:1], tiny_tokenizer))
    assert f"; per pair median {both:,}, longest {both:,}\n" in out  # (its chosen and rejected replies)
    assert f"  tokens: {scored.tokens:,}, scored {scored.target_tokens:,} (" in out
    assert cli.main(["check-data", pairs, *tokenizer, "--train-on-inputs"]) == 2
    assert "preference pairs train on their replies alone" in capsys.readouterr().err
    assert cli.main(["check-data", write(tmp_path / "mixed.jsonl", jsonl(PREFERENCE, CHAT)), *tokenizer]) == 3
    assert "(mixed_preference_data)" in capsys.readouterr().err
    bad = write(tmp_path / "bad.jsonl", jsonl({"messages": [{"role": "tool", "content": "x"}]}))
    assert cli.main(["check-data", bad, "--tokenizer", str(tiny_tokenizer_path)]) == 3
    assert "message 1 has role 'tool'; use one of user, model, system, assistant (invalid_chat)" in (
        capsys.readouterr().err
    )


def test_parquet_text_column_drops_nulls_and_empties(tmp_path: Path) -> None:
    table = pa.table({"text": ["One.", None, "", "Two."], "id": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "a.parquet")
    assert read_documents(str(tmp_path / "a.parquet")) == ["One.", "Two."]


def test_generated_stories_round_trip_through_the_txt_format(tmp_path: Path) -> None:
    stories = generate_stories(20, 3)
    assert read_documents(str(write_txt(tmp_path / "s.txt", stories))) == stories


# --- Bad data --------------------------------------------------------------------------------------------


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return bytes(sink.getvalue())


def openai_pair(messages: list[dict], preferred: list[dict], rejected: list[dict]) -> bytes:
    """One preference record in OpenAI's shape, as a JSONL file's bytes."""
    record = {
        "input": {"messages": messages},
        "preferred_output": preferred,
        "non_preferred_output": rejected,
    }
    return jsonl(record).encode()


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


BAD_FILES = [
    ("empty.txt", b"", "dataset_empty", "is empty"),
    ("blank.jsonl", b" \n\n ", "dataset_empty", "is empty"),
    ("separators.txt", f"\n{TXT_SEPARATOR}\n  {TXT_SEPARATOR}".encode(), "no_documents", "no non-empty"),
    ("blank_texts.jsonl", jsonl({"text": ""}, {"text": " "}).encode(), "no_documents", "no non-empty"),
    ("latin1.txt", "Once upon a time\nthere was a caf\xe9".encode("latin-1"), "dataset_not_utf8", "(line 2)"),
    ("data.csv", b"text\nhello\n", "unsupported_format", "'.csv'"),
    (
        "seven.jsonl",
        (jsonl(*[{"text": "ok"}] * 6) + "[1, 2]\n").encode(),
        "invalid_jsonl",
        "line 7 is not a JSON object",
    ),
    ("broken.jsonl", b'{"text": "ok"}\n{"text": \n', "invalid_jsonl", "line 2 is not valid JSON"),
    (
        "number.jsonl",
        jsonl({"text": 5}).encode(),
        "invalid_jsonl",
        'line 1 has a "text" that is not a string',
    ),
    (
        "neither.jsonl",
        jsonl({"prompt": "hi"}).encode(),
        "invalid_jsonl",
        'exactly one of a "text" string, a "messages" list, a "prompt" and a "completion" string, or a '
        'preference pair: {"input": {"messages": [...]}, "preferred_output": [...]',
    ),
    (
        "both.jsonl",
        jsonl({"text": "a", "prompt": "b", "completion": "c"}).encode(),
        "invalid_jsonl",
        'line 1 needs exactly one of a "text" string',
    ),
    (
        "prompt_number.jsonl",
        jsonl({"prompt": 1, "completion": "c"}).encode(),
        "invalid_jsonl",
        'line 1: "prompt" and "completion" must be strings',
    ),
    (
        "no_completion.jsonl",
        jsonl({"prompt": "Q", "completion": " "}).encode(),
        "invalid_jsonl",
        'line 1 has an empty "completion": nothing to train',
    ),
    (
        "tool.jsonl",
        jsonl({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "yo"}]}).encode(),
        "invalid_chat",
        "line 1: message 2 has role 'tool'; use one of user, model, system, assistant",
    ),
    (
        "content.jsonl",
        jsonl({"text": "ok"}, {"messages": [{"role": "user", "content": ["hi"]}]}).encode(),
        "invalid_chat",
        'line 2: message 1 needs a "content" string (or a list of {"type": "text", "text"} parts)',
    ),
    (
        "image.jsonl",
        jsonl({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}).encode(),
        "invalid_chat",
        'message 1 needs a "content" string',
    ),
    (
        "user_weight.jsonl",
        jsonl(
            {"messages": [{"role": "user", "content": "a", "weight": 0}, {"role": "model", "content": "b"}]}
        ).encode(),
        "invalid_chat",
        "message 1 has weight 0; only a model (assistant) message takes a weight, 0 (not trained) or 1",
    ),
    (
        "half_weight.jsonl",
        jsonl(
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b", "weight": 0.5},
                ]
            }
        ).encode(),
        "invalid_chat",
        "message 2 has weight 0.5",
    ),
    (
        "order.jsonl",
        jsonl({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}).encode(),
        "invalid_chat",
        "message 2 is a user turn where a model turn belongs",
    ),
    (
        "late_system.jsonl",
        jsonl({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}).encode(),
        "invalid_chat",
        "message 2 is a system turn where a model turn belongs",
    ),
    (
        "no_model.jsonl",
        jsonl({"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]}).encode(),
        "invalid_chat",
        "no model turn",
    ),
    (
        "empty_chat.jsonl",
        jsonl({"messages": []}).encode(),
        "invalid_chat",
        '"messages" must be a non-empty list',
    ),
    ("garbage.parquet", b"this is not parquet", "invalid_parquet", "not a readable Parquet file"),
    (
        "no_text.parquet",
        _parquet_bytes(pa.table({"body": ["a"], "id": [1]})),
        "parquet_no_text_column",
        "no 'text' column, nor a 'messages' one, nor 'prompt' and 'completion' ones, nor a preference pair's "
        "'prompt', 'chosen' and 'rejected' (its columns: body, id)",
    ),
    (
        "empty_completion.parquet",
        _parquet_bytes(pa.table({"prompt": ["Q", "R"], "completion": ["A", ""]})),
        "invalid_parquet",
        'row 2 has an empty "completion"',
    ),
    (
        "bad_chat.parquet",
        _parquet_bytes(pa.table({"messages": [[{"role": "user", "content": "a"}]]})),
        "invalid_chat",
        "row 1: there is no model turn to train on",
    ),
    (
        "same_reply.jsonl",
        jsonl({"prompt": "Q", "chosen": "A", "rejected": "A"}).encode(),
        "invalid_preference",
        'line 1: "chosen" and "rejected" are the same reply: there is no preference to learn',
    ),
    (
        "no_rejected.jsonl",
        jsonl({"prompt": "Q", "chosen": "A"}).encode(),
        "invalid_preference",
        'line 1: a preference pair lacks \'rejected\'; give {"input": {"messages": [...]}, ',
    ),
    (
        "pair_and_completion.jsonl",
        jsonl({"prompt": "Q", "chosen": "A", "rejected": "B", "completion": "C"}).encode(),
        "invalid_preference",
        "a preference pair mixes in 'completion'",
    ),
    (
        "empty_reply.jsonl",
        jsonl({"prompt": "Q", "chosen": "A", "rejected": " "}).encode(),
        "invalid_preference",
        '"rejected" is empty: there is no reply to compare',
    ),
    (
        "two_replies.jsonl",
        openai_pair([user("Q")], [assistant("A")] * 2, [assistant("B")]),
        "invalid_preference",
        '"preferred_output" must be a list of exactly one assistant message',
    ),
    (
        "user_reply.jsonl",
        openai_pair([user("Q")], [assistant("A")], [user("B")]),
        "invalid_preference",
        "\"non_preferred_output\" must be an assistant (model) message, not 'user'",
    ),
    (
        "no_input.jsonl",
        jsonl({"input": [], "preferred_output": "A", "non_preferred_output": "B"}).encode(),
        "invalid_preference",
        '"input" must be an object with the "messages" of the prompt',
    ),
    (
        "prompt_ends_with_reply.jsonl",
        openai_pair([user("Q"), assistant("A")], [assistant("B")], [assistant("C")]),
        "invalid_chat",
        "line 1: message 3 is a model turn where a user turn belongs",
    ),
    (
        "same_reply.parquet",
        _parquet_bytes(pa.table({"prompt": ["Q", "R"], "chosen": ["A", "B"], "rejected": ["C", "B"]})),
        "invalid_parquet",
        'row 2: "chosen" and "rejected" are the same reply',
    ),
    (
        "int_text.parquet",
        _parquet_bytes(pa.table({"text": [1, 2]})),
        "parquet_no_text_column",
        "of int64, not strings",
    ),
]


@pytest.mark.parametrize(
    ("name", "content", "code", "message"), BAD_FILES, ids=[case[0] for case in BAD_FILES]
)
def test_bad_data_fails_with_its_code_and_a_clear_message(
    tmp_path: Path, name: str, content: bytes, code: str, message: str
) -> None:
    with pytest.raises(DataError) as error:
        read_documents(write(tmp_path / name, content))
    assert error.value.code == code
    assert message in error.value.message


def test_missing_dataset_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(DataError) as error:
        read_documents(str(tmp_path / "nowhere.jsonl"))
    assert error.value.code == "dataset_not_found"
    assert "nowhere.jsonl does not exist" in error.value.message


def test_too_few_rows_says_how_many_rows_and_which_batch_size_works(tiny_tokenizer: Tokenizer) -> None:
    stories = generate_stories(12, 0)
    with pytest.raises(DataError) as error:
        TrainData(stories, tiny_tokenizer, 256, 64, 0, [0], 1)
    rows = EvalData(stories, tiny_tokenizer, 256, 64, 0, [0], 1).stats.rows
    assert error.value.code == "too_few_rows"
    assert f"packs into {rows} rows of 256 tokens, fewer than one batch of 64 rows" in error.value.message
    assert f"use batch_size {rows} or less" in error.value.message
    TrainData(stories, tiny_tokenizer, 256, rows, 0, [0], 1)


def test_too_few_rows_on_a_shard_advises_for_that_shard(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(DataError) as error:
        TrainData(generate_stories(3, 0), tiny_tokenizer, 1024, 8, 0, [3], 4)
    assert error.value.code == "too_few_rows"
    assert "packs into 0 rows of 1024 tokens on data shard 3 of 4" in error.value.message
    assert "(2 per shard); add documents or run on fewer processes" in error.value.message


def test_batch_size_must_split_over_the_shards(tiny_tokenizer: Tokenizer) -> None:
    with pytest.raises(DataError) as error:
        TrainData(generate_stories(50, 0), tiny_tokenizer, 128, 5, 0, [0], 2)
    assert error.value.code == "batch_size_not_divisible"
    assert "use a multiple of 2" in error.value.message


def test_chat_data_needs_the_turn_markers(tmp_path: Path, plain_tokenizer: Tokenizer) -> None:
    encode_documents(["text needs no markers"], plain_tokenizer)
    with pytest.raises(DataError) as error:
        encode_documents(read_documents(write(tmp_path / "chat.jsonl", jsonl(CHAT))), plain_tokenizer)
    assert error.value.code == "invalid_chat"
    assert "has no <start_of_turn> piece" in error.value.message


# --- Tokenizing and packing ------------------------------------------------------------------------------


def test_chat_is_rendered_with_the_gemma_template_and_trains_only_model_turns(
    tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    [encoded] = encode_documents(read_documents(write(tmp_path / "chat.jsonl", jsonl(CHAT))), tiny_tokenizer)
    assert encoded.tokens[0] == tiny_tokenizer.bos_id and encoded.tokens[-1] == tiny_tokenizer.eos_id
    assert tiny_tokenizer.decode(encoded.tokens[1:-1]) == CHAT_TEMPLATE
    # The first user turn is encoded whole, as a sampling prompt is.
    first_turn = encoded.tokens[2 : list(encoded.tokens).index(tiny_tokenizer.end_of_turn_id)]
    assert first_turn.tolist() == tiny_tokenizer.encode("user\nAnswer briefly.\n\nWho is Amy?")
    assert encoded.trained is not None
    trained = tiny_tokenizer.decode(encoded.tokens[encoded.trained])
    assert trained == "Amy is a girl.<end_of_turn>In a small house.<end_of_turn>"


def test_chat_loss_mask_covers_model_turns_in_batches(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    documents = read_documents(write(tmp_path / "chat.jsonl", jsonl(CHAT, {"text": "Tim had a red ball."})))
    batch = all_rows(documents, tiny_tokenizer, 128)
    mask = batch["loss_mask"] == 1
    trained_targets = [tiny_tokenizer.decode(batch["targets"][row][mask[row]]) for row in range(len(mask))]
    assert sorted(trained_targets) == [
        "Amy is a girl.<end_of_turn>In a small house.<end_of_turn>Tim had a red ball."
    ]


def test_train_on_inputs_trains_every_turn_of_a_chat(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    """Together's train_on_inputs: a chat's user turns and system prompt carry loss too, in the training
    and the validation data (the same objective); plain text is the same either way."""
    uri = write(tmp_path / "chat.jsonl", jsonl(*[CHAT] * 8))
    [encoded] = encode_documents(read_documents(uri)[:1], tiny_tokenizer, train_on_inputs=True)
    assert tiny_tokenizer.decode(encoded.tokens[1:-1]) == CHAT_TEMPLATE and encoded.trained is None

    def load(dataset: str, train_on_inputs: bool) -> tuple[TrainData, EvalData]:
        hyper = {"batch_size": 1, "max_seq_len": 128, "train_on_inputs": train_on_inputs}
        spec = {"name": "t", "model": "tiny", "dataset_uri": dataset, "validation_split": 0.5}
        train, evaluation = load_train_data(
            JobSpec.model_validate({**spec, "hyperparameters": hyper}), tiny_tokenizer, 0, 1
        )
        assert evaluation is not None
        return train, evaluation

    replies, everything = load(uri, False), load(uri, True)
    for only, every in zip(replies, everything, strict=True):
        assert only.stats.tokens == every.stats.tokens and only.stats.target_tokens > 0
        # Every token a target but each document's first (bos); the replies alone, far fewer.
        assert every.stats.target_tokens == every.stats.tokens - every.stats.documents
        assert only.stats.target_tokens < every.stats.target_tokens / 2
    row = everything[0].batch(0)
    trained = tiny_tokenizer.decode(row["targets"][0][row["loss_mask"][0] == 1])
    assert "Who is Amy?<end_of_turn>" in trained and "In a small house." in trained
    text = str(write_txt(tmp_path / "stories.txt", generate_stories(40, 0)))
    assert [d.stats for d in load(text, False)] == [d.stats for d in load(text, True)]


def test_text_documents_become_bos_tokens_eos(tiny_tokenizer: Tokenizer) -> None:
    [encoded] = encode_documents(["Amy ran."], tiny_tokenizer)
    expected = [tiny_tokenizer.bos_id, *tiny_tokenizer.encode("Amy ran."), tiny_tokenizer.eos_id]
    assert encoded.tokens.tolist() == expected
    assert encoded.trained is None


@pytest.mark.parametrize("row_len", [16, 33, 257])
def test_pack_covers_each_document_once_with_one_token_overlap_and_no_collisions(row_len: int) -> None:
    rng = np.random.default_rng(row_len)
    lengths = [int(n) for n in rng.lognormal(np.log(row_len * 0.7), 0.8, size=300).clip(2)]
    pieces, num_rows = pack(lengths, row_len)
    by_document: dict[int, list[data.Piece]] = {}
    for piece in pieces:
        by_document.setdefault(piece.document, []).append(piece)
    for document, length in enumerate(lengths):
        chain = sorted(by_document[document], key=lambda piece: piece.start)
        assert chain[0].start == 0 and chain[-1].stop == length
        assert all(after.start == before.stop - 1 for before, after in itertools.pairwise(chain))
        assert len(chain) == 1 or length > row_len  # a document that fits a row is never cut
    occupied = np.zeros((num_rows, row_len), dtype=int)
    for piece in pieces:
        occupied[piece.row, piece.offset : piece.offset + piece.stop - piece.start] += 1
    assert occupied.max() == 1
    for row in range(num_rows):
        in_row = sorted((piece for piece in pieces if piece.row == row), key=lambda piece: piece.offset)
        assert [piece.segment for piece in in_row] == list(range(1, len(in_row) + 1))
        assert in_row[0].offset == 0
        assert all(b.offset == a.offset + a.stop - a.start for a, b in itertools.pairwise(in_row))


def test_packed_batches_keep_documents_apart(story_corpus: Path, tiny_tokenizer: Tokenizer) -> None:
    stories = texts(story_corpus)
    batch = all_rows(stories, tiny_tokenizer, 256)
    tokens, targets, mask = batch["tokens"], batch["targets"], batch["loss_mask"]
    ids, positions = batch["segment_ids"], batch["positions"]
    assert tokens.shape[1] == 256 and all(v.dtype == np.int32 for k, v in batch.items() if k != "loss_mask")
    assert mask.dtype == np.float32
    assert (tokens[:, 1:] == targets[:, :-1]).all()
    assert (mask[ids == 0] == 0).all() and (positions[ids == 0] == 0).all()
    whole = set()
    for row in range(len(tokens)):
        pad = np.flatnonzero(ids[row] == 0)
        assert (pad == np.arange(256 - len(pad), 256)).all()  # padding only at the end of a row
        for columns in segments_of(batch, row):
            assert (columns == np.arange(columns[0], columns[-1] + 1)).all()
            assert (positions[row, columns] == np.arange(len(columns))).all()
            # Every target inside the document is trained; the last input's target belongs to the next.
            assert (mask[row, columns[:-1]] == 1).all()
            assert mask[row, columns[-1]] == 0 or columns[-1] == 255
            segment = np.append(tokens[row, columns], targets[row, columns[-1]])
            if segment[0] == tiny_tokenizer.bos_id and tiny_tokenizer.eos_id in segment:
                whole.add(tiny_tokenizer.decode(segment[1 : list(segment).index(tiny_tokenizer.eos_id)]))
    fitting = {story for story in stories if len(tiny_tokenizer.encode(story)) + 2 <= 256}
    assert fitting and fitting <= whole


def test_every_next_token_target_is_trained_exactly_once(
    story_corpus: Path, tiny_tokenizer: Tokenizer
) -> None:
    stories = texts(story_corpus)
    expected = sum(len(tiny_tokenizer.encode(story)) + 2 - 1 for story in stories)
    for max_seq_len in (64, 256):
        eval_data = EvalData(stories, tiny_tokenizer, max_seq_len, 4, 0, [0], 1)
        assert eval_data.stats.target_tokens == expected
        assert sum(int(batch["loss_mask"].sum()) for batch in eval_data.eval_batches()) == expected
        assert eval_data.stats.tokens == expected + len(stories)


def test_story_corpus_packs_with_little_padding(story_corpus: Path, tiny_tokenizer: Tokenizer) -> None:
    train = TrainData(texts(story_corpus), tiny_tokenizer, 256, 8, 0, [0], 1)
    assert train.stats.documents == 400
    assert 0 < train.stats.pad_fraction < 0.05
    rows = train.stats.rows
    assert train.stats.pad_tokens == rows * 257 - int(np.sum([(s.segments != 0).sum() for s in train.shards]))


# --- Sharding and order ----------------------------------------------------------------------------------


def test_shards_are_disjoint_and_cover_all_documents() -> None:
    documents = [f"story {i}" for i in range(103)]
    shards = [shard_documents(documents, 7, shard, 4) for shard in range(4)]
    assert sorted(doc for shard in shards for doc in shard) == sorted(documents)
    assert [len(shard) for shard in shards] == [26, 26, 26, 25]
    assert shards[0] != documents[0::4]  # dealt after a shuffle, not in file order
    assert shard_documents(documents, 8, 0, 4) != shards[0]


def test_two_shards_in_one_process_equal_two_processes(story_corpus: Path, tiny_tokenizer: Tokenizer) -> None:
    stories = texts(story_corpus)
    both = TrainData(stories, tiny_tokenizer, 128, 8, 5, [0, 1], 2)
    first = TrainData(stories, tiny_tokenizer, 128, 8, 5, [0], 2)
    second = TrainData(stories, tiny_tokenizer, 128, 8, 5, [1], 2)
    agreed = min(first.local_steps_per_epoch, second.local_steps_per_epoch)
    assert both.steps_per_epoch == agreed
    first.use_steps_per_epoch(agreed)
    second.use_steps_per_epoch(agreed)
    assert both.stats.documents == first.stats.documents + second.stats.documents == 400
    for step in (0, 1, agreed - 1, agreed, 3 * agreed + 2):
        expected = {
            key: np.concatenate([first.batch(step)[key], second.batch(step)[key]]) for key in first.batch(0)
        }
        actual = both.batch(step)
        assert all(actual[key].shape == (8, 128) for key in actual)
        assert all((actual[key] == expected[key]).all() for key in actual)


def test_batches_are_a_pure_function_of_the_step(story_corpus: Path, tiny_tokenizer: Tokenizer) -> None:
    stories = texts(story_corpus)
    train = TrainData(stories, tiny_tokenizer, 128, 4, 1, [0], 1)
    again = TrainData(stories, tiny_tokenizer, 128, 4, 1, [0], 1)
    other_seed = TrainData(stories, tiny_tokenizer, 128, 4, 2, [0], 1)
    steps = train.steps_per_epoch
    late = train.batch(2 * steps + 3)
    assert (train.batch(5)["tokens"] == again.batch(5)["tokens"]).all()
    assert (train.batch(2 * steps + 3)["tokens"] == late["tokens"]).all()
    assert (again.batch(2 * steps + 3)["tokens"] == late["tokens"]).all()
    assert not (train.batch(0)["tokens"] == other_seed.batch(0)["tokens"]).all()
    assert train.position(2 * steps + 3) == {"step": 2 * steps + 3, "epoch": 2, "seed": 1}


def test_each_epoch_reshuffles_the_same_rows(story_corpus: Path, tiny_tokenizer: Tokenizer) -> None:
    train = TrainData(texts(story_corpus), tiny_tokenizer, 128, 4, 0, [0], 1)
    steps = train.steps_per_epoch

    def epoch_rows(epoch: int) -> list[bytes]:
        return [row.tobytes() for step in range(steps) for row in train.batch(epoch * steps + step)["tokens"]]

    zero, one = epoch_rows(0), epoch_rows(1)
    assert zero != one
    assert len(set(zero)) == len(zero) == steps * 4
    # Only the leftover rows (fewer than a batch) differ between the epochs' sets.
    assert len(set(zero) ^ set(one)) <= 2 * (train.stats.rows - steps * 4)


def test_agreed_epoch_length_must_not_exceed_the_local_one(
    story_corpus: Path, tiny_tokenizer: Tokenizer
) -> None:
    train = TrainData(texts(story_corpus), tiny_tokenizer, 128, 4, 0, [0], 1)
    local = train.local_steps_per_epoch
    train.use_steps_per_epoch(local - 1)
    assert train.epoch_of(local - 1) == 1
    with pytest.raises(ValueError, match="steps_per_epoch"):
        train.use_steps_per_epoch(local + 1)


# --- Validation ------------------------------------------------------------------------------------------


def test_validation_split_holds_out_a_seeded_fraction() -> None:
    documents = [f"story {i}" for i in range(50)]
    train, held_out = split_validation(documents, 0.1, 3)
    assert len(held_out) == 5 and len(train) == 45
    assert sorted(train + held_out) == sorted(documents)
    assert split_validation(documents, 0.1, 3) == (train, held_out)
    assert split_validation(documents, 0.1, 4)[1] != held_out
    assert len(split_validation(documents, 0.001, 3)[1]) == 1
    with pytest.raises(DataError, match="at least 2 documents"):
        split_validation(documents[:1], 0.5, 3)


def test_eval_batches_cover_the_validation_set_once_padded_with_empty_rows(
    story_corpus: Path, tiny_tokenizer: Tokenizer
) -> None:
    stories = texts(story_corpus)[:40]
    eval_data = EvalData(stories, tiny_tokenizer, 128, 6, 0, [0, 1], 2)
    shard_rows = eval_data.rows_per_shard
    batches = eval_data.eval_batches()
    assert len(batches) == max(-(-rows // 3) for rows in shard_rows)
    assert all(batch["tokens"].shape == (6, 128) for batch in batches)
    for part, rows in enumerate(shard_rows):
        shard_ids = np.concatenate([batch["segment_ids"][3 * part : 3 * part + 3] for batch in batches])
        assert (shard_ids[:rows].max(axis=1) > 0).all() and (shard_ids[rows:] == 0).all()
    assert sum(batch["loss_mask"].sum() for batch in batches) == eval_data.stats.target_tokens
    longer = eval_data.eval_batches(len(batches) + 2)
    assert all(batch["loss_mask"].sum() == 0 and (batch["segment_ids"] == 0).all() for batch in longer[-2:])
    with pytest.raises(ValueError, match="leave out validation rows"):
        eval_data.eval_batches(len(batches) - 1)


def test_load_train_data_from_a_job_spec(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    uri = str(write_txt(tmp_path / "train.txt", generate_stories(200, 0)))
    spec = JobSpec.model_validate(
        {
            "name": "t",
            "model": "tiny",
            "dataset_uri": uri,
            "validation_split": 0.1,
            "hyperparameters": {"batch_size": 4, "max_seq_len": 64, "seed": 9},
        }
    )
    train, evaluation = load_train_data(spec, tiny_tokenizer, 1, 2)
    assert evaluation is not None
    assert train.shard_indices == [1] and train.num_shards == 2
    assert train.batch(0)["tokens"].shape == (2, 64)
    assert 85 <= train.stats.documents <= 95 and 5 <= evaluation.stats.documents <= 15
    held_out = set(split_validation(read_documents(uri), 0.1, 9)[1])
    assert evaluation.stats.documents == len(set(shard_documents(sorted(held_out), 9, 1, 2)))

    both, _ = load_train_data(spec, tiny_tokenizer, 0, 1, data_shards=2)
    assert both.shard_indices == [0, 1] and both.batch(0)["tokens"].shape == (4, 64)
    with pytest.raises(DataError, match="3 data shards do not split evenly over 2 processes"):
        load_train_data(spec, tiny_tokenizer, 0, 2, data_shards=3)

    validation_uri = str(write_txt(tmp_path / "val.txt", generate_stories(10, 1)))
    spec = spec.model_copy(update={"validation_split": None, "validation_uri": validation_uri})
    train, evaluation = load_train_data(spec, tiny_tokenizer, 0, 1)
    assert evaluation is not None
    assert train.stats.documents == 200 and evaluation.stats.documents == 10


# --- Sources ---------------------------------------------------------------------------------------------


def test_gs_uris_are_read_through_the_gcs_client(gcs: GcsEmulator, tmp_path: Path) -> None:
    bucket = gcs.make_bucket("datasets")
    bucket.blob("stories/train.jsonl").upload_from_string(jsonl({"text": "One."}, CHAT))
    documents = read_documents("gs://datasets/stories/train.jsonl")
    assert documents[0] == "One." and isinstance(documents[1], tuple)
    for missing in ("gs://datasets/stories/nope.jsonl", "gs://no-such-bucket/train.jsonl"):
        with pytest.raises(DataError) as error:
            read_documents(missing)
        assert error.value.code == "dataset_not_found" and f"{missing} does not exist" in error.value.message


def test_gs_uris_prefer_the_fuse_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mounted = tmp_path / "datasets" / "stories" / "train.txt"
    mounted.parent.mkdir(parents=True)
    mounted.write_text("From the mount.")
    monkeypatch.setenv(data.ENV_GCS_FUSE_ROOT, str(tmp_path))

    def no_client() -> None:
        raise AssertionError("a mounted file must not be fetched with the GCS client")

    monkeypatch.setattr(data, "gcs_client", no_client)
    assert read_documents("gs://datasets/stories/train.txt") == ["From the mount."]
    with pytest.raises(AssertionError, match="must not be fetched"):
        read_documents("gs://datasets/stories/other.txt")


def test_the_gcs_client_honours_the_emulator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    client = data.gcs_client()
    assert client._connection.API_BASE_URL == "http://127.0.0.1:9"


# --- Generated stories -----------------------------------------------------------------------------------


def test_stories_are_deterministic_ascii_and_tinystories_shaped() -> None:
    stories = generate_stories(300, 0)
    assert stories == generate_stories(300, 0)
    assert stories[:10] == generate_stories(10, 0)
    assert stories != generate_stories(300, 1)
    assert all(story.isascii() and TXT_SEPARATOR not in story for story in stories)
    assert len(set(stories)) == 300
    words = [len(story.split()) for story in stories]
    assert 130 <= statistics.median(words) <= 175
    assert min(words) < 60 and max(words) > 450
    assert all(story.startswith(("Once upon a time", "There once was", "One day")) for story in stories)
