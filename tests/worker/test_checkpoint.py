"""Checkpoints: a sharded round trip, keeping the last N, and resuming a stopped or killed run exactly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.worker.helpers import (
    TEST_OPTIONS,
    Recorder,
    compile_cache,  # noqa: F401
    losses,
    parse_reports,
    start_worker,
    tiny_config,
)
from worker import train
from worker.checkpoint import Checkpoints
from worker.config import EXIT_OK, EXIT_PREEMPTED
from worker.protocol import Report

pytestmark = pytest.mark.usefixtures("compile_cache")

EVERY = 4


def test_checkpoints_round_trip_and_keep_the_last(tmp_path: Path) -> None:
    mesh = train.make_mesh(1)
    params = {"w": jnp.arange(12.0).reshape(3, 4), "scale": jnp.ones(4)}
    state = {"step": jnp.int32(0), "params": params, "opt_state": optax.adam(1e-3).init(params)}
    checkpoints = Checkpoints(str(tmp_path), keep=2)
    for step in (1, 2, 3):
        checkpoints.save(step, jax.tree.map(lambda x, s=step: x + s, state), {"step": step, "epoch": 0})
    checkpoints.close()

    reopened = Checkpoints(str(tmp_path), keep=2)
    assert reopened.latest_step() == 3 and list(reopened.manager.all_steps()) == [2, 3]
    replicated = NamedSharding(mesh, P())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state)
    restored, position = reopened.restore(3, abstract)
    reopened.close()

    assert position == {"step": 3, "epoch": 0}
    assert int(restored["step"]) == 3 and restored["params"]["w"].sharding == replicated
    np.testing.assert_array_equal(restored["params"]["w"], np.arange(12.0).reshape(3, 4) + 3)
    assert type(restored["opt_state"]) is type(state["opt_state"])


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory, story_corpus: Path, tiny_tokenizer_path: Path
) -> dict[int, float]:
    """The losses of the uninterrupted run."""
    config = tiny_config(
        tmp_path_factory.mktemp("reference"), story_corpus, tiny_tokenizer_path, checkpoint_every_steps=EVERY
    )
    recorder = Recorder()
    assert train.run(config, recorder, TEST_OPTIONS) == EXIT_OK
    return losses(recorder.reports)


def test_sigterm_saves_a_checkpoint_and_the_restart_resumes_exactly(
    tmp_path: Path, story_corpus: Path, tiny_tokenizer_path: Path, reference: dict[int, float]
) -> None:
    config = tiny_config(tmp_path, story_corpus, tiny_tokenizer_path, checkpoint_every_steps=EVERY)

    def sigterm_at_step_5(report: Report) -> None:
        if report.kind == "metrics" and report.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)

    first = Recorder(sigterm_at_step_5)
    assert train.run(config, first, TEST_OPTIONS) == EXIT_PREEMPTED

    # Steps already dispatched finish: the stop request rides with the next step and is read a step later.
    stopped = first.of_kind("checkpoint")[-1].step
    assert 5 < stopped <= 8 and max(losses(first.reports)) == stopped
    assert "SIGTERM" in first.of_kind("status")[-1].message and not first.of_kind("result")

    second = Recorder()
    assert train.run(config, second, TEST_OPTIONS) == EXIT_OK

    assert f"resumed from the checkpoint at step {stopped}" in [s.message for s in second.of_kind("status")]
    # The API keeps one status report per (step, key): none of the restart's may pass for the first's.
    keys = [{(s.step, s.key) for s in attempt.of_kind("status")} for attempt in (first, second)]
    assert not keys[0] & keys[1]
    resumed = losses(second.reports)
    assert sorted(resumed) == list(range(stopped + 1, 13))
    combined = {**losses(first.reports), **resumed}
    np.testing.assert_allclose(
        [combined[s] for s in range(1, 13)], [reference[s] for s in range(1, 13)], rtol=1e-6
    )
    assert second.of_kind("result")[0].trained_tokens == second.of_kind("metrics")[-1].trained_tokens


@pytest.mark.slow
def test_a_worker_killed_after_a_checkpoint_resumes_from_it(
    tmp_path: Path,
    story_corpus: Path,
    tiny_tokenizer_path: Path,
    reference: dict[int, float],
    compile_cache: dict[str, str],  # noqa: F811
) -> None:
    config = tiny_config(tmp_path / "out", story_corpus, tiny_tokenizer_path, checkpoint_every_steps=EVERY)
    worker = start_worker(config, tmp_path, env=compile_cache)
    assert worker.stdout is not None
    seen = []
    for line in worker.stdout:
        seen += parse_reports(line)
        if seen and seen[-1]["kind"] == "checkpoint":
            break
    assert seen and seen[-1]["kind"] == "checkpoint", (tmp_path / "worker.log").read_text()[-3000:]
    saved = seen[-1]["step"]
    deadline = time.monotonic() + 60
    while not (tmp_path / "out" / "checkpoints" / str(saved)).is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)  # the write finishes in the background; the kill comes once it is committed
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=30)

    resumed = Recorder()
    assert train.run(config, resumed, TEST_OPTIONS) == EXIT_OK

    start = min(losses(resumed.reports)) - 1
    assert start >= saved and start % EVERY == 0
    curve = losses(resumed.reports)
    np.testing.assert_allclose(
        [curve[s] for s in sorted(curve)], [reference[s] for s in sorted(curve)], rtol=1e-5
    )
