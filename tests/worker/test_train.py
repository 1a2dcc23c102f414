"""The trainer on the tiny model, in this process: loss, LoRA, packed attention, accumulation, failures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from gemma import gm
from gguf import GGUFReader
from safetensors.numpy import load_file

from tests.worker.helpers import (  # noqa: F401
    TEST_OPTIONS,
    Recorder,
    compile_cache,
    losses,
    parse_reports,
    run_hf,
    start_worker,
    tiny_config,
)
from worker import convert, train
from worker import data as worker_data
from worker import model as gemma
from worker.checkpoint import export_params
from worker.config import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, Hyperparameters, JobSpec
from worker.data import TrainData, read_documents
from worker.gguf_import import gguf_tensor_name
from worker.hf import export_hf
from worker.stories import generate_stories, write_txt
from worker.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("compile_cache")

SEQ = 64


@pytest.fixture(scope="module")
def batch(story_corpus: Path, tiny_tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    data = TrainData(read_documents(str(story_corpus))[:40], tiny_tokenizer, SEQ, 8, 0, [0], 1)
    return data.batch(0)


@pytest.fixture(scope="module")
def full_run(
    tmp_path_factory: pytest.TempPathFactory, story_corpus: Path, tiny_tokenizer_path: Path
) -> tuple[Path, Recorder]:
    """A full fine-tune of the tiny model with eval, checkpoints and samples: (output dir, its reports)."""
    output = tmp_path_factory.mktemp("full")
    config = tiny_config(
        output,
        story_corpus,
        tiny_tokenizer_path,
        spec={"validation_split": 0.05, "sample_prompts": ["Once upon a time"]},
        n_evals=2,  # (of its 12 steps: every 6, as test_e2e's eval_every_steps)
        n_checkpoints=2,
    )
    recorder = Recorder()
    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_OK
    return output, recorder


def test_full_fine_tune_lowers_the_loss_and_exports(full_run: tuple[Path, Recorder]) -> None:
    output, recorder = full_run
    curve = losses(recorder.reports)
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1] - 0.5
    metrics = recorder.of_kind("metrics")[-1]
    assert metrics.total_steps == 12 and metrics.tokens_per_second > 0 and metrics.eta_seconds == 0
    trained = [m.trained_tokens for m in recorder.of_kind("metrics")]
    assert trained == sorted(set(trained)) and trained[0] > 0
    evals = recorder.of_kind("eval")
    # A baseline at step 0, then n_evals spread over the run; the loss on held-out stories falls.
    assert [e.step for e in evals] == [0, 6, 12]
    assert evals[2].eval_loss < evals[1].eval_loss < evals[0].eval_loss
    # Token accuracy, training and held out, rises as the loss falls.
    accuracy = {m.step: m.accuracy for m in recorder.of_kind("metrics")}
    assert all(0 <= a <= 1 for a in accuracy.values()) and accuracy[12] > accuracy[1]
    assert 0 <= evals[0].eval_accuracy < evals[2].eval_accuracy <= 1
    checkpoints = recorder.of_kind("checkpoint")
    assert [c.step for c in checkpoints] == [6, 12] and checkpoints[0].loss == curve[6]
    assert (checkpoints[0].accuracy, checkpoints[0].eval_accuracy) == (accuracy[6], evals[1].eval_accuracy)
    assert checkpoints[1].eval_loss == evals[2].eval_loss
    assert [s.phase for s in recorder.of_kind("sample")] == ["before", "after"]
    (result,) = recorder.of_kind("result")
    assert result.output_uri == str(output / "final") and result.loss == curve[12]
    assert (result.accuracy, result.eval_accuracy) == (accuracy[12], evals[2].eval_accuracy)
    assert result.trained_tokens == metrics.trained_tokens
    # The export is a plain Gemma checkpoint that gemma's own loader reads.
    params = gm.ckpts.load_params(output / "final" / "params")
    assert params["embedder"]["input_embedding"].shape == (1000, 128)


def test_what_the_data_came_to_is_reported(
    full_run: tuple[Path, Recorder], story_corpus: Path, tiny_tokenizer: Tokenizer
) -> None:
    """Once packed, the data's figures go to the API: each story (5% held out for validation) with its
    tokens, bos and eos included; the rows they fill, their padding; the steps they make."""
    _, recorder = full_run
    (data,) = recorder.of_kind("data")
    stories = read_documents(str(story_corpus))
    assert data.documents + data.validation_documents == len(stories) and data.validation_documents == 20
    tokens = sum(len(tiny_tokenizer.encode(str(story))) + 2 for story in stories)
    assert data.tokens + data.validation_tokens == tokens
    # Every token a target but each row piece's first (a story split over rows is more than one piece).
    assert data.tokens - data.documents - data.rows <= data.target_tokens < data.tokens
    assert data.row_tokens == SEQ and data.rows * (SEQ + 1) >= data.tokens
    # (a piece that goes on in the next row starts with the token the last ended on: fewer pad slots)
    assert 0 < data.pad_fraction <= 1 - data.tokens / (data.rows * (SEQ + 1))
    assert data.steps_per_epoch == data.rows // 8 and data.total_steps == 12


def test_lora_on_a_trained_base_trains_only_the_adapter(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path, full_run: tuple[Path, Recorder]
) -> None:
    # Four stories pack into one batch: every step sees (nearly) the same rows, so the curve is smooth.
    small = write_txt(tmp_path / "small.txt", read_documents(str(story_corpus))[:4])
    base_uri = full_run[0] / "final" / "params"
    config = tiny_config(
        tmp_path / "out",
        small,
        tiny_tokenizer_path,
        spec={
            "base_checkpoint_uri": str(base_uri),
            "method": {
                "type": "lora",
                "lora_rank": 4,
                "export_merged": True,
                "export_hf": True,
                "export_gguf": "f32",
            },
        },
        learning_rate=2e-2,
        max_steps=24,
        epochs=24,
    )
    recorder = Recorder()

    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_OK

    curve = [loss for _, loss in sorted(losses(recorder.reports).items())]
    # The adapter starts at zero, so LoRA starts from the trained base's loss, not a random model's ~6.9.
    assert len(curve) == 24 and curve[0] < 6.0
    assert np.mean(curve[-4:]) < np.mean(curve[:4]) - 0.08
    base = gm.ckpts.load_params(base_uri)
    adapter = gm.ckpts.load_params(tmp_path / "out" / "final" / "adapter")
    merged = gm.ckpts.load_params(tmp_path / "out" / "final" / "params")
    # Only the einsum weights that carry an adapter move; embeddings and norms are the base's.
    np.testing.assert_array_equal(merged["embedder"]["input_embedding"], base["embedder"]["input_embedding"])
    norm = merged["layer_1"]["pre_ffw_norm"]["scale"]
    np.testing.assert_array_equal(norm, base["layer_1"]["pre_ffw_norm"]["scale"])
    assert not np.allclose(
        merged["layer_0"]["attn"]["q_einsum"]["w"], base["layer_0"]["attn"]["q_einsum"]["w"]
    )
    # And the merged weights compute what base + adapter compute.
    lora = gemma.build_model("tiny", 1000, lora_rank=4, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    plain = gemma.build_model(
        "tiny", 1000, lora_rank=None, param_dtype=jnp.float32, compute_dtype=jnp.float32
    )
    tokens = np.arange(4, 36, dtype=np.int32)[None]
    segments, positions = np.ones_like(tokens), np.arange(32, dtype=np.int32)[None]
    np.testing.assert_allclose(
        gemma.forward(plain, merged, {}, tokens, segments, positions),
        gemma.forward(lora, adapter, base, tokens, segments, positions),
        atol=2e-4,
        rtol=1e-4,
    )
    # export_hf: the same weights as a Hugging Face model, which transformers runs to the same logits.
    export = json.loads((tmp_path / "out" / "final" / "export.json").read_text())
    assert export["hf"] == str(tmp_path / "out" / "final" / "hf")
    # and the adapter alone for PEFT, not tied to a Hugging Face id: its base is a run's, not the official
    peft = json.loads((tmp_path / "out" / "final" / "hf_adapter" / "adapter_config.json").read_text())
    assert export["hf_adapter"] == str(tmp_path / "out" / "final" / "hf_adapter")
    assert (peft["r"], peft["base_model_name_or_path"]) == (4, None)
    _, logits = run_hf(Path(export["hf"]), tmp_path / "hf-side", tokens=tokens)
    expected = plain.base.apply({"params": merged}, tokens).logits
    np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=1e-4)
    # export_gguf: the same weights in one GGUF file, as llama.cpp's reader reads it (in float32 exactly
    # the Hugging Face model's tensors; norms as 1 + scale), named after the job.
    final = tmp_path / "out" / "final"
    assert export["gguf"] == str(final / "model-f32.gguf")
    reader = GGUFReader(export["gguf"])
    assert reader.fields["general.name"].contents() == "job-1"
    gguf_tensors = {tensor.name: np.asarray(tensor.data) for tensor in reader.tensors}
    hf_weights = load_file(final / "hf" / "model.safetensors")
    for name, array in hf_weights.items():
        gguf_name = gguf_tensor_name(name.removeprefix("model."))
        shift = 1 if name.endswith("norm.weight") else 0
        np.testing.assert_array_equal(gguf_tensors.pop(gguf_name), array + shift, err_msg=name)
    assert not gguf_tensors
    # worker.convert, run afterwards on that export, writes the same files; on a copy without the merged
    # weights (export_merged off), it merges the adapter into the base weights read again, to the same.
    written = {name: (final / "hf" / name).read_bytes() for name in ("model.safetensors", "config.json")}
    adapter_bytes = (final / "hf_adapter" / "adapter_model.safetensors").read_bytes()
    gguf_bytes = (final / "model-f32.gguf").read_bytes()
    shutil.rmtree(final / "hf")
    (final / "model-f32.gguf").unlink()
    assert convert.main([str(final)]) == 0
    assert {name: (final / "hf" / name).read_bytes() for name in written} == written
    assert (final / "hf_adapter" / "adapter_model.safetensors").read_bytes() == adapter_bytes
    assert not (final / "model-f32.gguf").exists()  # (Hugging Face only, unless asked)
    assert convert.main([str(final), "--gguf", "f32"]) == 0
    assert (final / "model-f32.gguf").read_bytes() == gguf_bytes
    unmerged = tmp_path / "unmerged"
    shutil.copytree(final, unmerged, ignore=shutil.ignore_patterns("params", "hf", "hf_adapter", "*.gguf"))
    exports = ("params", "hf", "hf_adapter", "gguf")
    trimmed = {key: value for key, value in export.items() if key not in exports}
    (unmerged / "export.json").write_text(json.dumps(trimmed))
    assert convert.convert(str(unmerged)) == {
        "hf": str(unmerged / "hf"),
        "hf_adapter": str(unmerged / "hf_adapter"),
    }
    again = load_file(unmerged / "hf" / "model.safetensors")
    for name, array in load_file(final / "hf" / "model.safetensors").items():
        np.testing.assert_allclose(again[name], array, rtol=1e-6, atol=1e-6, err_msg=name)
    assert json.loads((unmerged / "export.json").read_text())["hf"] == str(unmerged / "hf")
    assert convert.main([str(tmp_path)]) == 2  # (no export there)


def test_a_run_starts_from_another_runs_checkpoint(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path, full_run: tuple[Path, Recorder]
) -> None:
    """A full fine-tune's checkpoint (`…/checkpoints/<step>`) as base_checkpoint_uri: its params (not its
    optimizer state) are the base weights, and a run from them starts at that run's loss, not a fresh
    model's."""
    checkpoint = full_run[0] / "checkpoints" / "6"
    config = tiny_config(
        tmp_path,
        story_corpus,
        tiny_tokenizer_path,
        spec={"base_checkpoint_uri": str(checkpoint)},
        max_steps=2,
    )
    model = gemma.build_model(
        "tiny", 1000, lora_rank=None, param_dtype=jnp.float32, compute_dtype=jnp.float32
    )
    shardings = train.tree_shardings(train.make_mesh(1), model.abstract_params()[0])
    loaded = gemma.load_base_params(config.spec, model, shardings)
    assert same_arrays(loaded, saved_params(checkpoint / "state"))
    recorder = Recorder()
    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_OK
    before = losses(full_run[1].reports)
    assert losses(recorder.reports)[1] < before[1] - 0.5 * (before[1] - before[6])


def test_a_run_starts_from_a_hugging_face_model(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path, full_run: tuple[Path, Recorder]
) -> None:
    """A Hugging Face model directory (here a run's weights exported as one) as base_checkpoint_uri: exactly
    those weights, its tokenizer.model the job's tokenizer, and a run from them starts at that run's loss."""
    trained = saved_params(full_run[0] / "final" / "params")
    model = gemma.build_model(
        "tiny", 1000, lora_rank=None, param_dtype=jnp.float32, compute_dtype=jnp.float32
    )
    hf_dir = tmp_path / "hf"
    export_hf(
        trained,
        str(hf_dir),
        config=model.base.config,
        model_name="tiny",
        tokenizer=Tokenizer.load(tiny_tokenizer_path),
        max_shard_bytes=300_000,
    )
    spec = {"base_checkpoint_uri": str(hf_dir), "tokenizer_uri": None}
    config = tiny_config(tmp_path / "out", story_corpus, tiny_tokenizer_path, spec=spec, max_steps=2)
    for tokenizer_uri in (None, str(hf_dir)):  # (its own, or the directory named as tokenizer_uri)
        spec_now = config.spec.model_copy(update={"tokenizer_uri": tokenizer_uri})
        tokenizer = train.load_tokenizer(spec_now, TEST_OPTIONS)
        assert tokenizer.processor.serialized_model_proto() == tiny_tokenizer_path.read_bytes()
    shardings = train.tree_shardings(train.make_mesh(1), model.abstract_params()[0])
    assert same_arrays(gemma.load_base_params(config.spec, model, shardings), trained)
    recorder = Recorder()
    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_OK
    before = losses(full_run[1].reports)
    assert losses(recorder.reports)[1] < before[1] - 0.5 * (before[1] - before[12])
    # Another size's config: refused with what does not fit.
    settings = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**settings, "num_hidden_layers": 3}))
    with pytest.raises(gemma.ModelError) as refused:
        gemma.load_base_params(config.spec, model, shardings)
    assert refused.value.code == "bad_base_checkpoint"
    assert refused.value.message == f"{hf_dir}/config.json has num_hidden_layers 3, where this model has 2"
    (hf_dir / "tokenizer.model").unlink()
    with pytest.raises(gemma.ModelError) as refused:
        train.load_tokenizer(config.spec.model_copy(update={"tokenizer_uri": str(hf_dir)}), TEST_OPTIONS)
    assert refused.value.code == "bad_tokenizer" and "without a tokenizer.model" in refused.value.message


def test_an_adapter_is_folded_into_its_base(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path, full_run: tuple[Path, Recorder]
) -> None:
    """adapter_uri: a LoRA run's checkpoint or export folded into the base it was trained on gives what its
    merged export holds (W + A·B), and a run from them trains those weights."""
    base_uri = str(full_run[0] / "final" / "params")
    lora = tmp_path / "lora"
    method = {"type": "lora", "lora_rank": 4, "export_merged": True}
    config = tiny_config(
        lora,
        story_corpus,
        tiny_tokenizer_path,
        spec={"base_checkpoint_uri": base_uri, "method": method},
        learning_rate=2e-2,
        max_steps=4,
        checkpoint_every_steps=2,
    )
    assert train.run(config, Recorder(), TEST_OPTIONS) == EXIT_OK
    model = gemma.build_model(
        "tiny", 1000, lora_rank=None, param_dtype=jnp.float32, compute_dtype=jnp.float32
    )
    shardings = train.tree_shardings(train.make_mesh(1), model.abstract_params()[0])

    def folded(adapter: Path) -> Any:
        spec = config.spec.model_copy(update={"adapter_uri": str(adapter)})  # (the base, with this adapter)
        return jax.device_get(gemma.load_base_params(spec, model, shardings))

    merged = saved_params(lora / "final" / "params")
    for adapter in (lora / "final" / "adapter", lora / "checkpoints" / "4"):
        jax.tree.map(
            lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6), folded(adapter), merged
        )
    at_2 = folded(lora / "checkpoints" / "2")
    assert not np.allclose(
        at_2["layer_0"]["attn"]["q_einsum"]["w"], merged["layer_0"]["attn"]["q_einsum"]["w"]
    )
    base = saved_params(Path(base_uri))
    np.testing.assert_array_equal(at_2["embedder"]["input_embedding"], base["embedder"]["input_embedding"])

    # A full fine-tune from base + adapter; the errors that name what to give instead.
    recorder = Recorder()
    spec = {"base_checkpoint_uri": base_uri, "adapter_uri": str(lora / "checkpoints" / "4")}
    more = tiny_config(tmp_path / "more", story_corpus, tiny_tokenizer_path, spec=spec, max_steps=2)
    assert train.run(more, recorder, TEST_OPTIONS) == EXIT_OK
    export = json.loads((tmp_path / "more" / "final" / "export.json").read_text())
    assert (export["base_checkpoint_uri"], export["adapter_uri"]) == (base_uri, spec["adapter_uri"])
    for spec, code, says in (
        ({"base_checkpoint_uri": base_uri, "adapter_uri": base_uri}, "bad_adapter", "holds no LoRA adapter"),
        (
            {"base_checkpoint_uri": base_uri, "adapter_uri": str(tmp_path / "none")},
            "adapter_not_found",
            "none",
        ),
        (
            {"base_checkpoint_uri": str(lora / "checkpoints" / "4")},
            "bad_base_checkpoint",
            "give it as adapter_uri",
        ),
    ):
        failed = Recorder()
        bad = tiny_config(tmp_path / code, story_corpus, tiny_tokenizer_path, spec=spec, max_steps=2)
        assert train.run(bad, failed, TEST_OPTIONS) == EXIT_BAD_INPUT
        (error,) = failed.of_kind("error")
        assert error.code == code and says in error.message, error


def test_packed_documents_never_attend_across(tiny: tuple[gemma.Model, dict]) -> None:
    model, params = tiny
    rng = np.random.default_rng(0)
    doc_a, doc_b = rng.integers(4, 1000, 40), rng.integers(4, 1000, 16)
    pad = SEQ - len(doc_a) - len(doc_b)

    def logits(first: np.ndarray) -> np.ndarray:
        tokens = np.concatenate([first, doc_b, np.zeros(pad, int)])[None].astype(np.int32)
        segments = np.repeat([1, 2, 0], [len(first), len(doc_b), pad])[None].astype(np.int32)
        positions = np.concatenate([np.arange(len(first)), np.arange(len(doc_b)), np.zeros(pad, int)])
        return np.asarray(
            gemma.forward(model, params, {}, tokens, segments, positions[None].astype(np.int32))
        )

    packed = logits(doc_a)
    changed = logits(rng.integers(4, 1000, 40))
    b = slice(len(doc_a), len(doc_a) + len(doc_b))
    np.testing.assert_allclose(changed[0, b], packed[0, b], atol=1e-5)
    assert not np.allclose(changed[0, : len(doc_a)], packed[0, : len(doc_a)], atol=1e-3)
    # Document B alone at the start of a row gets the very logits it gets packed behind A.
    alone = np.concatenate([doc_b, np.zeros(SEQ - len(doc_b), int)])[None].astype(np.int32)
    segments = (np.arange(SEQ) < len(doc_b)).astype(np.int32)[None]
    positions = np.where(segments[0] > 0, np.arange(SEQ), 0).astype(np.int32)[None]
    single = np.asarray(gemma.forward(model, params, {}, alone, segments, positions))
    np.testing.assert_allclose(single[0, : len(doc_b)], packed[0, b], atol=1e-4)


def test_pad_targets_carry_no_loss(tiny: tuple[gemma.Model, dict], batch: dict[str, np.ndarray]) -> None:
    model, params = tiny
    # Row 0 ends in 20 pad slots (zero in every field, as the packer leaves them).
    padded = {name: array.copy() for name, array in batch.items()}
    for array in padded.values():
        array[0, -20:] = 0
    padded["loss_mask"][0, -21] = 0
    masked = padded["loss_mask"] == 0
    loss_sum, (count, _) = train.loss_sums(model, params, {}, padded)
    assert count == padded["loss_mask"].sum()

    changed = (padded["targets"] + 7) % 1000
    scrambled = dict(padded, targets=np.where(masked, changed, padded["targets"]))
    assert np.isclose(float(train.loss_sums(model, params, {}, scrambled)[0]), float(loss_sum), rtol=1e-6)
    real = dict(padded, targets=np.where(masked, padded["targets"], changed))
    assert not np.isclose(float(train.loss_sums(model, params, {}, real)[0]), float(loss_sum), rtol=1e-5)


def test_token_accuracy_counts_the_trained_targets_the_model_ranks_first(
    tiny: tuple[gemma.Model, dict], batch: dict[str, np.ndarray]
) -> None:
    """OpenAI's mean token accuracy: of the targets that carry loss, the share that are the model's argmax;
    a target without loss (a pad, a prompt) never counts, whatever it is."""
    model, params = tiny
    logits = gemma.forward(model, params, {}, batch["tokens"], batch["segment_ids"], batch["positions"])
    first = np.asarray(jnp.argmax(logits, axis=-1))
    trained = batch["loss_mask"] > 0
    # Every third trained target is the model's first choice, the rest not; every untrained one is.
    chosen = trained & (np.cumsum(trained).reshape(trained.shape) % 3 == 0)
    targets = np.where(chosen | ~trained, first, (first + 1) % 1000).astype(batch["targets"].dtype)
    _, (count, correct) = train.loss_sums(model, params, {}, dict(batch, targets=targets))
    assert int(count) == trained.sum() and int(correct) == chosen.sum() > 0
    # The train step reports it as a share of the step's trained targets.
    optimizer = optax.sgd(0.0)
    state = {"step": jnp.int32(0), "params": params, "opt_state": optimizer.init(params)}
    step = jax.jit(train.make_train_step(model, optimizer, optax.constant_schedule(0.0), 2))
    _, metrics = step(state, {}, dict(batch, targets=targets), jnp.zeros(1, jnp.int32))
    np.testing.assert_allclose(float(metrics["accuracy"]), chosen.sum() / trained.sum(), rtol=1e-6)
    eval_step = jax.jit(train.make_eval_step(model, 2))
    sums = eval_step(params, {}, dict(batch, targets=targets))
    assert [int(x) for x in sums[1:4]] == [trained.sum(), chosen.sum(), trained.sum()] and sums[4] == {}


def schedule(total_steps: int, **hyper: Any) -> list[float]:
    """The learning rate at each step 0..total_steps of a job with these hyperparameters, as its optimizer
    applies it."""
    spec = JobSpec(
        name="s", model="tiny", dataset_uri="/d.txt", hyperparameters={"learning_rate": 1.0, **hyper}
    )
    _, learning_rate = train.make_optimizer(spec, total_steps)
    return [float(learning_rate(step)) for step in range(total_steps + 1)]


def test_learning_rate_schedules() -> None:
    """A warmup (steps, or a share of them) from 0, then a cosine or linear decay to min_lr_ratio of the
    peak at the last step, or the peak kept."""
    cosine = schedule(100, warmup_steps=10)  # (the default, as before: 0.1 at the end)
    np.testing.assert_allclose(
        [cosine[0], cosine[5], cosine[10], cosine[55], cosine[100]], [0, 0.5, 1, 0.55, 0.1]
    )
    assert (np.diff(cosine[10:]) < 0).all()
    # The same as warmup_ratio, and as optax's own warmup-cosine with those figures.
    np.testing.assert_allclose(schedule(100, warmup_ratio=0.1), cosine)
    optax_own = optax.warmup_cosine_decay_schedule(0.0, 1.0, 10, 100, 0.1)
    np.testing.assert_allclose(cosine, [float(optax_own(step)) for step in range(101)], rtol=1e-6)
    linear = schedule(100, lr_scheduler="linear", warmup_ratio=0.2, min_lr_ratio=0.0)
    np.testing.assert_allclose([linear[10], linear[20], linear[60], linear[100]], [0.5, 1, 0.5, 0], atol=1e-6)
    np.testing.assert_allclose(np.diff(linear[20:]), -1 / 80, rtol=1e-4)
    constant = schedule(50, lr_scheduler="constant", warmup_steps=4)
    np.testing.assert_allclose(constant[:5], [0, 0.25, 0.5, 0.75, 1])
    assert constant[4:] == [1.0] * 47
    assert schedule(20, lr_scheduler="constant") == [1.0] * 21
    # No warmup: a decay from the first step.
    np.testing.assert_allclose(schedule(10, lr_scheduler="linear")[::5], [1, 0.55, 0.1], rtol=1e-6)


def test_evals_and_checkpoints_spread_over_a_run() -> None:
    """n_evals / n_checkpoints: evenly over the steps, the last at the end (a run always evaluates and
    saves there); or every so many steps as given."""

    def spread(total_steps: int, **hyper: Any) -> tuple[int | None, int | None]:
        return Hyperparameters(**hyper).intervals(total_steps)

    assert spread(100, n_evals=4, n_checkpoints=3) == (25, 34)  # (34, 68, then the end: 3)
    assert spread(10, n_evals=50) == (1, None)  # (no more than one a step)
    assert spread(100, eval_every_steps=7, checkpoint_every_steps=9) == (7, 9)
    assert spread(100) == (None, None)


def test_gradient_accumulation_equals_one_batch(
    tiny: tuple[gemma.Model, dict], batch: dict[str, np.ndarray]
) -> None:
    model, params = tiny
    # Plain SGD, so the new params show the gradient itself (Adam would amplify float noise).
    optimizer = optax.sgd(1.0)
    state = {"step": jnp.int32(0), "params": params, "opt_state": optimizer.init(params)}
    stop = jnp.zeros(1, jnp.int32)
    (state_1, metrics_1), (state_4, metrics_4) = [
        jax.jit(train.make_train_step(model, optimizer, optax.constant_schedule(1.0), accumulation))(
            state, {}, batch, stop
        )
        for accumulation in (1, 4)
    ]
    assert float(metrics_1["tokens"]) == float(metrics_4["tokens"]) == batch["loss_mask"].sum()
    np.testing.assert_allclose(metrics_4["loss"], metrics_1["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics_4["accuracy"], metrics_1["accuracy"], rtol=1e-6)
    np.testing.assert_allclose(metrics_4["grad_norm"], metrics_1["grad_norm"], rtol=1e-4)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), state_4["params"], state_1["params"]
    )


def test_a_loss_that_is_not_finite_stops_the_run(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path, tiny: tuple[gemma.Model, dict]
) -> None:
    _, params = tiny
    broken = jax.tree.map(np.array, params)
    broken["final_norm"]["scale"][:] = np.nan
    export_params(broken, str(tmp_path / "broken"))
    config = tiny_config(
        tmp_path / "out",
        story_corpus,
        tiny_tokenizer_path,
        spec={"base_checkpoint_uri": str(tmp_path / "broken")},
    )
    recorder = Recorder()

    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_FAILED

    (error,) = recorder.of_kind("error")
    assert error.code == "loss_not_finite" and error.step == 1
    assert "nan" in error.message and not recorder.of_kind("result")


def test_bad_data_fails_before_compiling(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    config = tiny_config(tmp_path, tmp_path / "missing.txt", tiny_tokenizer_path)
    recorder = Recorder()

    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_BAD_INPUT

    (error,) = recorder.of_kind("error")
    assert error.code == "dataset_not_found" and "missing.txt" in error.message
    assert not [s for s in recorder.of_kind("status") if s.phase == "compiling"]


def test_chats_with_no_reply_to_train_fail_before_compiling(
    tmp_path: Path, tiny_tokenizer_path: Path
) -> None:
    """Every assistant reply of weight 0 and the inputs untrained: nothing to train on, said before any
    compiling (not a run whose loss is 0 over no tokens), in training or validation data; with
    train_on_inputs, the inputs are trained."""
    chats = [
        {
            "messages": [
                {"role": "user", "content": story},
                {"role": "assistant", "content": "Yes.", "weight": 0},
            ]
        }
        for story in generate_stories(200, 3)
    ]
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    recorder = Recorder()
    config = tiny_config(tmp_path / "out", dataset, tiny_tokenizer_path)
    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_BAD_INPUT
    (error,) = recorder.of_kind("error")
    assert error.code == "no_trained_tokens" and "every model (assistant) reply has weight 0" in error.message
    assert not [s for s in recorder.of_kind("status") if s.phase == "compiling"]
    # Nor validation data whose replies all have weight 0: its eval loss would be 0 over nothing.
    stories = tmp_path / "stories.txt"
    write_txt(stories, generate_stories(200, 4))
    held_out = tiny_config(
        tmp_path / "out", stories, tiny_tokenizer_path, spec={"validation_uri": str(dataset)}
    )
    recorder = Recorder()
    assert train.run(held_out, recorder, TEST_OPTIONS) == EXIT_BAD_INPUT
    (error,) = recorder.of_kind("error")
    assert error.code == "no_trained_tokens" and error.message.startswith("the validation data has no token")
    hyper = {**config.spec.hyperparameters.model_dump(), "train_on_inputs": True}
    inputs = config.spec.model_copy(update={"hyperparameters": Hyperparameters.model_validate(hyper)})
    stats = train.load_data(inputs, Tokenizer.load(tiny_tokenizer_path), 1)[0].stats
    assert stats.target_tokens > stats.tokens / 2


def test_an_internal_error_says_where_it_came_from(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault of tputune's own (here packing, broken): the job's error names the line of tputune's code it
    came through and the one that raised it, as the traceback in the log would (on GKE gone with the pod)."""

    def broken_pack(lengths: Any, row_len: int) -> Any:
        return {}["rows"]

    monkeypatch.setattr(worker_data, "pack", broken_pack)
    recorder = Recorder()
    assert (
        train.run(tiny_config(tmp_path, story_corpus, tiny_tokenizer_path), recorder, TEST_OPTIONS)
        == EXIT_FAILED
    )
    (error,) = recorder.of_kind("error")
    assert error.code == "internal_error"
    line = next(
        n
        for n, text in enumerate(Path(worker_data.__file__).read_text().splitlines(), 1)
        if "= pack(" in text
    )
    assert error.message.startswith(f"KeyError: 'rows' (at worker/data.py:{line} in __init__; raised in ")
    assert error.message.endswith(" in broken_pack)") and "tests/worker/test_train.py:" in error.message


@pytest.mark.slow
def test_a_job_too_big_for_the_memory_fails_at_once_saying_what_to_change(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    """Rows of 32,768 tokens: the tiny model's attention needs some 120 GB, past the 8 GiB the worker may
    map here (as an accelerator's memory is all there is). XLA's RESOURCE_EXHAUSTED is the job's settings,
    not a fault: the "bad input" exit (a JobSet fails at once, not restarted into the same error) and an
    error report that says what to change."""
    config = tiny_config(
        tmp_path / "out", story_corpus, tiny_tokenizer_path, max_seq_len=32_768, batch_size=1, max_steps=2
    )
    worker = start_worker(config, tmp_path, memory_gib=8)
    stdout, _ = worker.communicate(timeout=240)
    assert worker.returncode == EXIT_BAD_INPUT, (tmp_path / "worker.log").read_text()[-2000:]
    (error,) = [report for report in parse_reports(stdout) if report["kind"] == "error"]
    assert error["code"] == "out_of_memory", error
    assert error["message"].startswith("The job does not fit in the accelerators' memory (RESOURCE_EXHAUSTED")
    assert "gradient_accumulation_steps" in error["message"]
    assert train.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory")) is None  # (XLA's only)


def test_early_stopping_ends_a_run_whose_eval_loss_stops_improving(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    """early_stopping_patience: so many evals in a row not better than the best (the baseline's here:
    a learning rate too small to move the loss by the threshold) end the run as a success, at that step,
    with its weights exported (export_best off: this step's)."""
    config = tiny_config(
        tmp_path,
        story_corpus,
        tiny_tokenizer_path,
        spec={"validation_split": 0.05},
        max_steps=40,
        learning_rate=1e-9,
        eval_every_steps=2,
        early_stopping_patience=2,
        early_stopping_threshold=0.01,
        export_best=False,
    )
    recorder = Recorder()
    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_OK
    assert [e.step for e in recorder.of_kind("eval")] == [0, 2, 4]  # (none again at the end)
    assert sorted(losses(recorder.reports)) == [1, 2, 3, 4]
    stopped = [s.message for s in recorder.of_kind("status") if "stopping early" in s.message]
    assert stopped == [
        "stopping early at step 4 of 40: 2 evals in a row have not bettered the eval loss of step 0 "
        f"({recorder.of_kind('eval')[0].eval_loss:.4f}); the weights exported are this step's (the "
        "checkpoints list each eval's loss)"
    ]
    (result,) = recorder.of_kind("result")
    assert result.step == 4 and result.eval_loss == recorder.of_kind("eval")[-1].eval_loss
    assert [c.step for c in recorder.of_kind("checkpoint")] == [4]
    assert (tmp_path / "final" / "params").exists()


def test_early_stopping_counts_on_across_a_resume(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    """The best eval and the evals since are kept in the checkpoint: a run resumed from it stops at the
    same eval as one that was never stopped."""
    hyper = {"learning_rate": 1e-9, "eval_every_steps": 2, "early_stopping_patience": 2}
    hyper |= {"early_stopping_threshold": 0.01, "export_best": False}
    spec = {"validation_split": 0.05}
    first = Recorder()  # (evals at 0, the best, and 2, not better; its end saved at step 3)
    config = tiny_config(tmp_path, story_corpus, tiny_tokenizer_path, spec=spec, max_steps=3, **hyper)
    assert train.run(config, first, TEST_OPTIONS) == EXIT_OK
    assert [e.step for e in first.of_kind("eval")] == [0, 2, 3] and first.of_kind("result")
    longer = tiny_config(tmp_path, story_corpus, tiny_tokenizer_path, spec=spec, max_steps=40, **hyper)
    resumed = Recorder()
    assert train.run(longer, resumed, TEST_OPTIONS) == EXIT_OK
    assert "resumed from the checkpoint at step 3" in [s.message for s in resumed.of_kind("status")]
    # The eval at 4 is the second in a row not better than step 0's.
    assert [e.step for e in resumed.of_kind("eval")] == [4]
    (result,) = resumed.of_kind("result")
    assert result.step == 4


# A constant learning rate too high for a smooth descent: the eval loss of the tiny model on the story corpus
# goes 6.92, 6.91, 6.41, 6.88, 6.56 at steps 0-4 (3e-2), and 6.92, 8.81, 7.88, 8.13, 7.54 (1e-1).
BUMPY = {"lr_scheduler": "constant", "warmup_steps": 0, "eval_every_steps": 2}


def saved_params(path: Path) -> Any:
    """The params of an export (`final/params`) or of a checkpoint's state (`checkpoints/<step>/state`)."""
    tree = ocp.StandardCheckpointer().restore(path)
    return tree["params"] if "opt_state" in tree else tree


def same_arrays(a: Any, b: Any) -> bool:
    return jax.tree.all(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b))


def test_export_best_exports_the_weights_of_the_lowest_eval_loss(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    """export_best: the eval at step 2 is the lowest, the one at 4 (the end) is not: the export holds step
    2's weights, from its checkpoint, saved at that eval and kept past keep_checkpoints (1); the result
    carries step 2's figures."""
    config = tiny_config(
        tmp_path,
        story_corpus,
        tiny_tokenizer_path,
        spec={"validation_split": 0.05},
        **BUMPY,
        learning_rate=3e-2,
        max_steps=4,
        checkpoint_every_steps=3,
        keep_checkpoints=1,
        export_best=True,
    )
    recorder = Recorder()
    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_OK
    evals = {e.step: e for e in recorder.of_kind("eval")}
    assert list(evals) == [0, 2, 4]
    assert evals[2].eval_loss < min(evals[0].eval_loss, evals[4].eval_loss), evals  # (the premise)
    # Saved at 2 (a new lowest, not a checkpoint step), 3 (one) and 4 (the end); 3 went, 2 stayed.
    assert [c.step for c in recorder.of_kind("checkpoint")] == [2, 3, 4]
    assert [c.kept for c in recorder.of_kind("checkpoint")] == [[2], [2, 3], [2, 4]]  # (as each said)
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["2", "4"]

    (result,) = recorder.of_kind("result")
    assert (result.step, result.exported_step) == (4, 2)
    assert (result.eval_loss, result.eval_accuracy) == (evals[2].eval_loss, evals[2].eval_accuracy)
    assert result.loss == losses(recorder.reports)[2]
    assert result.accuracy == next(m.accuracy for m in recorder.of_kind("metrics") if m.step == 2)
    assert (result.chosen_reward, result.eval_chosen_reward) == (None, None)  # (a dpo job's only)
    exported = saved_params(tmp_path / "final" / "params")
    assert same_arrays(exported, saved_params(tmp_path / "checkpoints" / "2" / "state"))
    assert not same_arrays(exported, saved_params(tmp_path / "checkpoints" / "4" / "state"))
    export = json.loads((tmp_path / "final" / "export.json").read_text())
    assert (export["step"], export["last_step"]) == (2, 4)
    assert (
        "exporting the weights of step 2, of the lowest eval loss "
        f"({evals[2].eval_loss:.4f}); the run ended at step 4"
    ) in [s.message for s in recorder.of_kind("status")]


@pytest.mark.parametrize("removed", [False, True], ids=["kept", "removed-by-hand"])
def test_export_best_keeps_the_lowest_eval_across_a_resume(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path, removed: bool
) -> None:
    """The lowest eval is kept in the checkpoint: a run resumed past it (from step 3) still exports step 2's
    weights, from the checkpoint the first run kept. Where that checkpoint was removed by hand, the run
    says so and exports its last weights (it does not fail at its end)."""
    hyper = {**BUMPY, "learning_rate": 3e-2, "keep_checkpoints": 1, "export_best": True}
    spec = {"validation_split": 0.05}
    first = Recorder()  # (evals at 0, 2 and 3, its end: 2 the lowest)
    config = tiny_config(tmp_path, story_corpus, tiny_tokenizer_path, spec=spec, max_steps=3, **hyper)
    assert train.run(config, first, TEST_OPTIONS) == EXIT_OK
    assert first.of_kind("result")[0].exported_step == 2
    if removed:
        shutil.rmtree(tmp_path / "checkpoints" / "2")
    longer = tiny_config(tmp_path, story_corpus, tiny_tokenizer_path, spec=spec, max_steps=4, **hyper)
    resumed = Recorder()
    assert train.run(longer, resumed, TEST_OPTIONS) == EXIT_OK
    assert "resumed from the checkpoint at step 3" in [s.message for s in resumed.of_kind("status")]
    assert [e.step for e in resumed.of_kind("eval")] == [4]
    (result,) = resumed.of_kind("result")
    if removed:
        assert (result.step, result.exported_step) == (4, 4)
        assert result.eval_loss == resumed.of_kind("eval")[0].eval_loss
        (warning,) = resumed.of_kind("warning")
        assert warning.message == (
            "export_best: the checkpoint of step 2, of the lowest eval loss, is gone; the weights exported "
            "are the last step's"
        )
        return
    assert (result.step, result.exported_step) == (4, 2)
    assert result.eval_loss == next(e.eval_loss for e in first.of_kind("eval") if e.step == 2)
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["2", "4"]
    assert same_arrays(
        saved_params(tmp_path / "final" / "params"), saved_params(tmp_path / "checkpoints" / "2" / "state")
    )
    assert not resumed.of_kind("warning")


def test_early_stopping_exports_the_base_weights_when_training_made_them_worse(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path, tiny: tuple[gemma.Model, dict]
) -> None:
    """With early stopping export_best is on by default; no eval bettered the baseline (a learning rate of
    0.1): the export holds the initial weights, the result the baseline's eval and no train loss."""
    config = tiny_config(
        tmp_path,
        story_corpus,
        tiny_tokenizer_path,
        spec={"validation_split": 0.05},
        **BUMPY,
        learning_rate=0.1,
        max_steps=40,
        early_stopping_patience=2,
    )
    assert config.spec.hyperparameters.exports_best
    recorder = Recorder()
    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_OK
    evals = recorder.of_kind("eval")
    assert [e.step for e in evals] == [0, 2, 4]
    assert evals[0].eval_loss < min(e.eval_loss for e in evals[1:]), evals  # (the premise)
    (result,) = recorder.of_kind("result")
    assert (result.step, result.exported_step, result.loss) == (4, 0, None)
    assert result.eval_loss == evals[0].eval_loss
    assert same_arrays(saved_params(tmp_path / "final" / "params"), tiny[1])
    assert recorder.of_kind("checkpoint")[-1].step == 4  # (no checkpoint at 0: the base is loaded again)
    messages = [s.message for s in recorder.of_kind("status")]
    assert any(m.endswith("; the weights exported are those of the lowest eval loss") for m in messages)
    assert "the lowest eval loss was before training: loading the base weights of tiny" in messages


def test_a_pause_from_the_api_stops_with_a_checkpoint_the_next_run_goes_on_from(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    def pause_at_step_3(report: object) -> None:
        if getattr(report, "kind", None) == "metrics" and getattr(report, "step", 0) == 3:
            paused.pause = True

    paused = Recorder(pause_at_step_3)
    config = tiny_config(tmp_path, story_corpus, tiny_tokenizer_path)

    # As a preemption: the run is to go on later, from the checkpoint.
    assert train.run(config, paused, TEST_OPTIONS) == EXIT_PREEMPTED
    (checkpoint,) = paused.of_kind("checkpoint")
    assert 4 <= checkpoint.step <= 6 and max(losses(paused.reports)) == checkpoint.step
    assert "paused by the user" in paused.of_kind("status")[-1].message
    assert not paused.of_kind("result")

    resumed = Recorder()
    assert train.run(config, resumed, TEST_OPTIONS) == EXIT_OK
    assert f"resumed from the checkpoint at step {checkpoint.step}" in [
        s.message for s in resumed.of_kind("status")
    ]
    # (which tells the API to drop what an earlier run reported past it)
    assert [s.resumed_from for s in resumed.of_kind("status") if s.resumed_from is not None] == [
        checkpoint.step
    ]
    steps = sorted(losses(resumed.reports))
    assert steps[0] == checkpoint.step + 1 and resumed.of_kind("result")


def test_a_cancel_from_the_api_stops_after_a_checkpoint(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path
) -> None:
    def cancel_at_step_3(report: object) -> None:
        if getattr(report, "kind", None) == "metrics" and getattr(report, "step", 0) == 3:
            recorder.cancel = True

    recorder = Recorder(cancel_at_step_3)
    config = tiny_config(tmp_path, story_corpus, tiny_tokenizer_path)

    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_OK

    # The flag rides along with the next dispatched step and is read one step later.
    (checkpoint,) = recorder.of_kind("checkpoint")
    assert 4 <= checkpoint.step <= 6 and max(losses(recorder.reports)) == checkpoint.step
    assert "cancelled" in recorder.of_kind("status")[-1].message
    assert not recorder.of_kind("result") and (tmp_path / "checkpoints" / str(checkpoint.step)).is_dir()
