"""Preference fine-tuning (DPO) on the tiny model: each pair's loss against the weights a job started from."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from tests.worker.helpers import (  # noqa: F401
    TEST_OPTIONS,
    Recorder,
    compile_cache,
    preference_pairs,
    tiny_config,
    write_preference_pairs,
)
from tests.worker.test_train import saved_params
from worker import model as gemma
from worker import train
from worker.config import EXIT_OK
from worker.data import EvalData, Preference, encode_documents
from worker.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("compile_cache")

LN2 = math.log(2)
# A constant learning rate: a run resumed halfway goes the same way as one never stopped.
DPO_HYPERPARAMETERS: dict[str, Any] = {
    "learning_rate": 1e-3,
    "lr_scheduler": "constant",
    "warmup_steps": 0,
    "eval_every_steps": 3,
    "max_steps": 6,
}


@pytest.fixture(scope="module")
def pairs_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_preference_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 300, 0)


def rows_of(pairs: list[Preference], tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    packed = EvalData(pairs, tokenizer, 128, 1, 0, [0], 1)
    batches = packed.eval_batches()
    return {name: np.concatenate([batch[name] for batch in batches]) for name in batches[0]}


def reply_logprob(model: gemma.Model, params: Any, tokens: np.ndarray, trained: np.ndarray) -> float:
    """log p(reply | prompt): one document alone in a row, its trained targets' log-probabilities summed."""
    inputs = tokens[None, :-1].astype(np.int32)
    logits = gemma.forward(
        model, params, {}, inputs, np.ones_like(inputs), np.arange(inputs.shape[1], dtype=np.int32)[None]
    )
    logprobs = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    targets = tokens[1:]
    return float(np.sum(logprobs[np.arange(len(targets)), targets] * trained[1:]))


def test_the_dpo_loss_is_each_pairs_own_against_the_reference(
    tiny: tuple[gemma.Model, Any], tiny_tokenizer: Tokenizer
) -> None:
    """`preference_sums` over packed rows = DPO computed pair by pair, each document alone: -log sigmoid of
    beta times how much more the model than the reference favours the chosen reply; ln 2 a pair where the
    model is the reference. With rpo_alpha, plus that times the chosen reply's NLL a token."""
    model, base = tiny
    leaves, tree = jax.tree.flatten(base)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    policy = tree.unflatten(
        [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    )
    pairs = preference_pairs(7, 3)
    batch = rows_of(pairs, tiny_tokenizer)
    assert (batch["segment_ids"].max(axis=1) > 2).any()  # (rows that hold more than one pair)
    beta = 0.5
    loss_sum, (count, correct, tokens) = train.preference_sums(model, policy, base, batch, beta)
    margins, chosen_nll, scored = [], [], 0
    for pair in pairs:
        ratios = []
        for index, document in enumerate(encode_documents([pair], tiny_tokenizer)):
            assert document.trained is not None
            logprob = reply_logprob(model, policy, document.tokens, document.trained)
            ratios.append(logprob - reply_logprob(model, base, document.tokens, document.trained))
            if index == 0:  # (the chosen reply's)
                chosen_nll.append(-logprob / document.trained[1:].sum())
            scored += int(document.trained[1:].sum())
        margins.append(beta * (ratios[0] - ratios[1]))
    expected = sum(math.log1p(math.exp(-margin)) for margin in margins)
    assert int(count) == len(pairs) and int(tokens) == scored
    assert int(correct) == sum(margin > 0 for margin in margins) and 0 < int(correct) < len(pairs)
    np.testing.assert_allclose(float(loss_sum), expected, rtol=1e-4)
    with_nll = train.preference_sums(model, policy, base, batch, beta, rpo_alpha=0.3)[0]
    np.testing.assert_allclose(float(with_nll), expected + 0.3 * sum(chosen_nll), rtol=1e-4)
    same = train.preference_sums(model, base, base, batch, beta)
    np.testing.assert_allclose(float(same[0]), len(pairs) * LN2, rtol=1e-6)
    assert int(same[1][1]) == 0


def dpo_run(output: Path, pairs_path: Path, tokenizer: Path, method: str = "full", **hyper: Any) -> Recorder:
    spec = {"method": {"type": method, "objective": "dpo"}, "validation_split": 0.1}
    config = tiny_config(output, pairs_path, tokenizer, spec=spec, **{**DPO_HYPERPARAMETERS, **hyper})
    recorder = Recorder()
    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_OK
    return recorder


@pytest.fixture(scope="module")
def full_dpo(
    tmp_path_factory: pytest.TempPathFactory, pairs_path: Path, tiny_tokenizer_path: Path
) -> tuple[Path, Recorder]:
    output = tmp_path_factory.mktemp("dpo")
    return output, dpo_run(output, pairs_path, tiny_tokenizer_path)


def test_a_dpo_run_learns_the_preferences_against_its_initial_weights(
    full_dpo: tuple[Path, Recorder],
    pairs_path: Path,
    tiny_tokenizer_path: Path,
    tiny: tuple[gemma.Model, Any],
) -> None:
    """It starts at ln 2 a pair (the model is its reference), learns which reply is preferred, and its eval
    loss is the validation pairs' against the weights it started from, not against later ones."""
    output, recorder = full_dpo
    (data,) = recorder.of_kind("data")
    assert data.preference_pairs and data.documents == 270 and data.validation_documents == 30
    evals = recorder.of_kind("eval")
    assert [e.step for e in evals] == [0, 3, 6]
    assert evals[0].eval_loss == pytest.approx(LN2, abs=1e-6) and evals[0].eval_accuracy == 0
    first = recorder.of_kind("metrics")[0]
    assert first.loss == pytest.approx(LN2, abs=1e-6)
    assert evals[-1].eval_loss < LN2 - 0.1 and evals[-1].eval_accuracy >= 0.8
    (result,) = recorder.of_kind("result")
    assert result.eval_loss == evals[-1].eval_loss
    # The final eval loss, measured again from the exported weights against the initial ones.
    model, base = tiny
    final = saved_params(output / "final" / "params")
    config = tiny_config(
        output,
        pairs_path,
        tiny_tokenizer_path,
        spec={"method": {"objective": "dpo"}, "validation_split": 0.1},
    )
    _, held_out = train.load_data(config.spec, Tokenizer.load(tiny_tokenizer_path), 1)
    assert held_out is not None
    total, count = 0.0, 0.0
    for batch in held_out.eval_batches():
        loss_sum, (pairs, _, _) = train.preference_sums(model, final, base, batch, 0.1)
        total, count = total + float(loss_sum), count + float(pairs)
    assert count == 30
    assert total / count == pytest.approx(evals[-1].eval_loss, rel=1e-5)


def test_a_resumed_dpo_run_keeps_the_weights_it_started_from_as_its_reference(
    tmp_path: Path, full_dpo: tuple[Path, Recorder], pairs_path: Path, tiny_tokenizer_path: Path
) -> None:
    """Stopped at step 3 and resumed from that checkpoint, a full dpo run still measures against its initial
    weights (loaded again), so it ends where the run never stopped ends."""
    dpo_run(tmp_path, pairs_path, tiny_tokenizer_path, max_steps=3)
    resumed = dpo_run(tmp_path, pairs_path, tiny_tokenizer_path)
    assert "resumed from the checkpoint at step 3" in [s.message for s in resumed.of_kind("status")]
    (straight,) = [e for e in full_dpo[1].of_kind("eval") if e.step == 6]
    (after,) = resumed.of_kind("eval")
    assert after.step == 6 and after.eval_loss == pytest.approx(straight.eval_loss, rel=1e-5)


def test_a_lora_dpo_run_measures_against_its_base(
    tmp_path: Path, pairs_path: Path, tiny_tokenizer_path: Path
) -> None:
    recorder = dpo_run(tmp_path, pairs_path, tiny_tokenizer_path, "lora", learning_rate=3e-3)
    evals = recorder.of_kind("eval")
    assert evals[0].eval_loss == pytest.approx(LN2, abs=1e-6)
    assert evals[-1].eval_loss < LN2 - 0.05 and evals[-1].eval_accuracy >= 0.8
