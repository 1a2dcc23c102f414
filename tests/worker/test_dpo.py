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
from tests.worker.test_train import same_arrays, saved_params
from worker import model as gemma
from worker import train
from worker.config import EXIT_OK
from worker.data import EncodedDocument, EvalData, Preference, encode_documents
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


def scored(document: EncodedDocument) -> tuple[np.ndarray, np.ndarray]:
    """An encoded reply's (tokens, which of them are trained)."""
    assert document.trained is not None
    return document.tokens, document.trained


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
    loss_sum, (count, correct, tokens, rewards) = train.preference_sums(model, policy, base, batch, beta)
    # Per pair and reply (chosen, rejected): log p under the policy and the reference, and tokens scored.
    logprobs, references, lengths = [], [], []
    for pair in pairs:
        replies = [scored(document) for document in encode_documents([pair], tiny_tokenizer)]
        logprobs.append([reply_logprob(model, policy, tokens, trained) for tokens, trained in replies])
        references.append([reply_logprob(model, base, tokens, trained) for tokens, trained in replies])
        lengths.append([int(trained[1:].sum()) for _, trained in replies])
    policy_lp, reference_lp, length = np.array(logprobs), np.array(references), np.array(lengths)
    ratios = beta * (policy_lp - reference_lp)
    margins = ratios[:, 0] - ratios[:, 1]
    expected = np.sum(np.logaddexp(0, -margins))
    assert int(count) == len(pairs) and int(tokens) == length.sum()
    assert int(correct) == np.sum(margins > 0) and 0 < int(correct) < len(pairs)
    np.testing.assert_allclose(float(loss_sum), expected, rtol=1e-4)
    np.testing.assert_allclose(
        [float(rewards["chosen_reward"]), float(rewards["rejected_reward"])], ratios.sum(axis=0), rtol=1e-4
    )
    chosen_nll = -policy_lp[:, 0] / length[:, 0]
    with_nll = train.preference_sums(model, policy, base, batch, beta, rpo_alpha=0.3)[0]
    np.testing.assert_allclose(float(with_nll), expected + 0.3 * chosen_nll.sum(), rtol=1e-4)
    same = train.preference_sums(model, base, base, batch, beta)
    np.testing.assert_allclose(float(same[0]), len(pairs) * LN2, rtol=1e-6)
    assert int(same[1][1]) == 0 and abs(float(same[1][3]["chosen_reward"])) < 1e-5

    # Length-normalized: each reply's log-ratio a token.
    per_token = beta * (policy_lp - reference_lp) / length
    loss_sum, (_, correct, _, rewards) = train.preference_sums(
        model, policy, base, batch, beta, per_token=True
    )
    margins = per_token[:, 0] - per_token[:, 1]
    np.testing.assert_allclose(float(loss_sum), np.sum(np.logaddexp(0, -margins)), rtol=1e-4)
    assert int(correct) == np.sum(margins > 0)
    np.testing.assert_allclose(float(rewards["rejected_reward"]), per_token[:, 1].sum(), rtol=1e-4)

    # SimPO: no reference (none given: it is not read), each reply's mean log-probability, a margin gamma.
    simpo = beta * policy_lp / length
    margins = simpo[:, 0] - simpo[:, 1]
    loss_sum, (_, correct, _, rewards) = train.preference_sums(
        model, policy, {}, batch, beta, simpo_gamma=0.2
    )
    np.testing.assert_allclose(float(loss_sum), np.sum(np.logaddexp(0, 0.2 - margins)), rtol=1e-4)
    assert int(correct) == np.sum(margins > 0) and 0 < int(correct) < len(pairs)
    np.testing.assert_allclose(
        [float(rewards["chosen_reward"]), float(rewards["rejected_reward"])], simpo.sum(axis=0), rtol=1e-4
    )


def held_out_sums(
    config: Any, tokenizer: Path, model: gemma.Model, params: Any, frozen: Any, beta: float, **variant: Any
) -> tuple[float, float, float]:
    """A job's validation pairs measured again as `preference_sums` measures them: (loss, chosen reward,
    pairs), each summed over the pairs."""
    _, held_out = train.load_data(config.spec, Tokenizer.load(tokenizer), 1)
    assert held_out is not None
    total = chosen = count = 0.0
    for batch in held_out.eval_batches():
        loss_sum, (pairs, _, _, rewards) = train.preference_sums(
            model, params, frozen, batch, beta, **variant
        )
        total, chosen = total + float(loss_sum), chosen + float(rewards["chosen_reward"])
        count += float(pairs)
    return total, chosen, count


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
    # Rewards: none at first (the model is its reference), then the chosen replies' above the rejected.
    assert first.chosen_reward == pytest.approx(0, abs=1e-6) and first.rejected_reward == pytest.approx(
        0, abs=1e-6
    )
    assert evals[0].eval_chosen_reward == pytest.approx(0, abs=1e-6)
    assert evals[-1].eval_chosen_reward is not None and evals[-1].eval_rejected_reward is not None
    assert evals[-1].eval_chosen_reward - evals[-1].eval_rejected_reward > 0.5
    last = recorder.of_kind("metrics")[-1]
    assert last.chosen_reward is not None and last.rejected_reward is not None
    assert last.chosen_reward > last.rejected_reward
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
    total, chosen, count = held_out_sums(config, tiny_tokenizer_path, model, final, base, 0.1)
    assert count == 30
    assert total / count == pytest.approx(evals[-1].eval_loss, rel=1e-5)
    assert chosen / count == pytest.approx(evals[-1].eval_chosen_reward, rel=1e-4)


def test_a_dpo_run_that_unlearns_the_chosen_replies_says_so(
    tmp_path: Path, full_dpo: tuple[Path, Recorder], pairs_path: Path, tiny_tokenizer_path: Path
) -> None:
    """At a learning rate too high, DPO widens the margin by making the chosen replies far less likely too:
    the worker warns at an eval where they are over a nat a token below the reference."""
    recorder = dpo_run(tmp_path, pairs_path, tiny_tokenizer_path, learning_rate=1e-2)
    (warning,) = recorder.of_kind("warning")
    assert warning.step == 3 and "nats a token less likely than before training" in warning.message
    assert "method.rpo_alpha" in warning.message
    evals = recorder.of_kind("eval")
    assert [e.step for e in evals] == [0, 3, 6] and evals[1].eval_chosen_reward < 0
    # The run at a tenth of that learning rate keeps them: no warning.
    assert not full_dpo[1].of_kind("warning")


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


def test_a_simpo_run_needs_no_reference(
    tmp_path: Path, pairs_path: Path, tiny_tokenizer_path: Path, tiny: tuple[gemma.Model, Any]
) -> None:
    """With `simpo_gamma`, a full job's loss is SimPO's: its first eval is the base weights' mean
    log-probabilities with the margin asked for (not ln 2), it learns, and it never loads a reference
    model, not even when resumed."""
    spec = {"method": {"objective": "dpo", "simpo_gamma": 0.5, "dpo_beta": 2.0}, "validation_split": 0.1}
    stopped = {**DPO_HYPERPARAMETERS, "max_steps": 3}
    config = tiny_config(tmp_path, pairs_path, tiny_tokenizer_path, spec=spec, **stopped)
    first = Recorder()
    assert train.run(config, first, TEST_OPTIONS) == EXIT_OK
    config = tiny_config(tmp_path, pairs_path, tiny_tokenizer_path, spec=spec, **DPO_HYPERPARAMETERS)
    resumed = Recorder()
    assert train.run(config, resumed, TEST_OPTIONS) == EXIT_OK
    statuses = [s.message for s in first.of_kind("status") + resumed.of_kind("status")]
    assert "resumed from the checkpoint at step 3" in statuses
    assert not [message for message in statuses if "reference" in message]

    model, base = tiny  # (the run's initial weights)
    total, _, count = held_out_sums(config, tiny_tokenizer_path, model, base, {}, 2.0, simpo_gamma=0.5)
    evals = first.of_kind("eval") + resumed.of_kind("eval")
    assert [e.step for e in evals] == [0, 3, 6]
    assert evals[0].eval_loss == pytest.approx(total / count, rel=1e-5)
    assert abs(evals[0].eval_loss - LN2) > 0.05
    assert evals[-1].eval_loss < evals[0].eval_loss - 0.1
    assert evals[-1].eval_accuracy > evals[0].eval_accuracy
    assert evals[-1].eval_chosen_reward > evals[-1].eval_rejected_reward


def test_a_simpo_run_that_unlearns_the_chosen_replies_says_so_after_a_resume(
    tmp_path: Path, pairs_path: Path, tiny_tokenizer_path: Path
) -> None:
    """SimPO has no reference: the worker measures the held-out chosen replies against its first eval, and
    keeps that figure in its checkpoints. At a learning rate that collapses them, stopped at step 3 (not yet
    a nat below) and resumed, the resumed run, which evaluates no step 0, warns at step 6."""
    spec = {"method": {"objective": "dpo", "simpo_gamma": 0.5, "dpo_beta": 2.0}, "validation_split": 0.1}
    harsh = {**DPO_HYPERPARAMETERS, "learning_rate": 3e-2}
    config = tiny_config(tmp_path, pairs_path, tiny_tokenizer_path, spec=spec, **{**harsh, "max_steps": 3})
    first = Recorder()
    assert train.run(config, first, TEST_OPTIONS) == EXIT_OK
    assert [e.step for e in first.of_kind("eval")] == [0, 3] and not first.of_kind("warning")
    config = tiny_config(tmp_path, pairs_path, tiny_tokenizer_path, spec=spec, **harsh)
    resumed = Recorder()
    assert train.run(config, resumed, TEST_OPTIONS) == EXIT_OK
    assert "resumed from the checkpoint at step 3" in [s.message for s in resumed.of_kind("status")]
    (warning,) = resumed.of_kind("warning")
    assert warning.step == 6 and "nats a token less likely than before training" in warning.message
    # The fall it names is from the first run's step 0: SimPO's chosen reward over beta, then and now.
    start, end = first.of_kind("eval")[0], resumed.of_kind("eval")[-1]
    assert start.eval_chosen_reward is not None and end.eval_chosen_reward is not None
    fall = (start.eval_chosen_reward - end.eval_chosen_reward) / 2.0
    assert fall > 1.0 and f"are {fall:.2f} nats a token" in warning.message


def test_a_dpo_runs_checkpoints_and_export_carry_the_rewards_of_their_weights(
    tmp_path: Path, pairs_path: Path, tiny_tokenizer_path: Path
) -> None:
    """Each checkpoint reports its step's rewards (and its eval's); with export_best, the result those of
    the weights exported. SimPO at a harsh learning rate, an eval a step: stopped at step 4 (its lowest eval
    loss), resumed to 5 (a higher one), the result is step 4's, as its checkpoint kept them."""
    spec = {"method": {"objective": "dpo", "simpo_gamma": 0.5, "dpo_beta": 2.0}, "validation_split": 0.1}
    hyper = {**DPO_HYPERPARAMETERS, "learning_rate": 3e-2, "eval_every_steps": 1, "export_best": True}
    config = tiny_config(tmp_path, pairs_path, tiny_tokenizer_path, spec=spec, **{**hyper, "max_steps": 4})
    first = Recorder()
    assert train.run(config, first, TEST_OPTIONS) == EXIT_OK
    steps = {m.step: m for m in first.of_kind("metrics")}
    evals = {e.step: e for e in first.of_kind("eval")}
    for saved in first.of_kind("checkpoint"):
        assert saved.chosen_reward is not None and saved.eval_chosen_reward is not None
        trained, evaluated = steps[saved.step], evals[saved.step]
        assert (saved.chosen_reward, saved.rejected_reward) == (
            trained.chosen_reward,
            trained.rejected_reward,
        )
        assert (saved.eval_chosen_reward, saved.eval_rejected_reward) == (
            evaluated.eval_chosen_reward,
            evaluated.eval_rejected_reward,
        )
    (result,) = first.of_kind("result")
    assert (result.exported_step, result.chosen_reward) == (4, steps[4].chosen_reward)

    config = tiny_config(tmp_path, pairs_path, tiny_tokenizer_path, spec=spec, **{**hyper, "max_steps": 5})
    resumed = Recorder()
    assert train.run(config, resumed, TEST_OPTIONS) == EXIT_OK
    (last,) = resumed.of_kind("eval")
    assert last.step == 5 and last.eval_loss > evals[4].eval_loss  # (the premise)
    (result,) = resumed.of_kind("result")
    assert (result.step, result.exported_step) == (5, 4)
    assert (result.chosen_reward, result.rejected_reward) == (
        steps[4].chosen_reward,
        steps[4].rejected_reward,
    )
    assert (result.eval_chosen_reward, result.eval_rejected_reward) == (
        evals[4].eval_chosen_reward,
        evals[4].eval_rejected_reward,
    )
    assert result.chosen_reward != resumed.of_kind("metrics")[-1].chosen_reward


def test_a_full_dpo_run_that_exports_its_initial_weights_takes_its_reference_from_memory(
    tmp_path: Path, pairs_path: Path, tiny_tokenizer_path: Path, tiny: tuple[gemma.Model, Any]
) -> None:
    """export_best of a full dpo job whose eval at step 0 stays the lowest (a learning rate that makes the
    first step worse; early stopping ends the run there): the weights exported are the initial ones, taken
    from its reference in memory, not loaded a second time (for a large model, minutes and another copy)."""
    hyper = {"learning_rate": 0.3, "eval_every_steps": 1, "early_stopping_patience": 1}
    recorder = dpo_run(tmp_path, pairs_path, tiny_tokenizer_path, **hyper)
    evals = recorder.of_kind("eval")
    assert [e.step for e in evals] == [0, 1] and evals[1].eval_loss > evals[0].eval_loss  # (the premise)
    (result,) = recorder.of_kind("result")
    assert (result.step, result.exported_step, result.loss, result.chosen_reward) == (1, 0, None, None)
    assert same_arrays(saved_params(tmp_path / "final" / "params"), tiny[1])
    loads = [s.message for s in recorder.of_kind("status") if "loading the base weights" in s.message]
    assert loads == ["loading the base weights of tiny"]  # (once, at the start)
