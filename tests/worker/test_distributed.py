"""Two JAX processes (Gloo over localhost, 2 CPU devices each) train like one process on the same batches."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from gemma import gm
from gguf import GGUFReader
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from tests.worker.conftest import TINY_VOCAB_SIZE
from tests.worker.helpers import (
    TEST_OPTIONS,
    Recorder,
    compile_cache,  # noqa: F401
    free_port,
    losses,
    parse_reports,
    report_losses,
    start_worker,
    tiny_config,
    write_preference_pairs,
)
from worker import model as gemma
from worker import train
from worker.config import EXIT_OK, WorkerConfig
from worker.gguf_import import gguf_tensor_name
from worker.hf import hf_tensors

STEPS = 6


def start_pair(
    config: WorkerConfig, tmp_path: Path, cache_env: dict[str, str], name: str
) -> Callable[[], list[str]]:
    """Two worker processes (2 CPU devices each, Gloo over localhost) running `config` as one job; returns
    what waits for both to exit EXIT_OK and gives their outputs (their logs: `{name}{index}.log`)."""
    coordinator = f"127.0.0.1:{free_port()}"
    processes = [
        start_worker(
            config,
            tmp_path,
            env={
                **cache_env,
                "JAX_NUM_CPU_DEVICES": "2",
                "JAX_COORDINATOR_ADDRESS": coordinator,
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(index),
            },
            name=f"{name}{index}",
        )
        for index in (0, 1)
    ]

    def finished() -> list[str]:
        outputs = [process.communicate(timeout=500)[0] for process in processes]
        for index, process in enumerate(processes):
            assert process.returncode == EXIT_OK, (tmp_path / f"{name}{index}.log").read_text()[-3000:]
        return outputs

    return finished


def test_fsdp_shards_the_largest_divisible_dimension_and_replicates_small_arrays() -> None:
    mesh = AbstractMesh((2, 4), train.MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))

    def spec(*shape: int) -> P:
        return train.fsdp_sharding(mesh, shape).spec  # type: ignore[arg-type]

    assert spec(262_144, 640) == P("fsdp", None)
    assert spec(4, 640, 256) == P(None, "fsdp", None)
    assert spec(2, 1, 640, 256) == P(None, None, "fsdp", None)
    assert spec(3, 5001, 7) == P(None, None, None)  # nothing divides by 4
    assert spec(640) == P(None)  # a norm scale: too small to be worth it
    assert spec() == P()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_reproduce_the_single_process_losses(
    tmp_path: Path,
    story_corpus: Path,
    tiny_tokenizer_path: Path,
    compile_cache: dict[str, str],  # noqa: F811
) -> None:
    # With an eval every step and export_best: the lowest eval loss (step 3's of 6 at this constant learning
    # rate) is found by both, and its checkpoint restored and exported by every process.
    hyper = {"max_steps": STEPS, "eval_every_steps": 1, "export_best": True, "learning_rate": 3e-2}
    hyper |= {"lr_scheduler": "constant", "warmup_steps": 0}
    spec = {"validation_split": 0.05}
    # The pair also exports a Hugging Face model and a GGUF file: each weight gathered from both processes
    # to the first.
    pair_spec = {**spec, "method": {"type": "full", "export_hf": True, "export_gguf": "f32"}}
    pair = tiny_config(tmp_path / "pair", story_corpus, tiny_tokenizer_path, spec=pair_spec, **hyper)
    finished = start_pair(pair, tmp_path, compile_cache, "process")
    # Meanwhile this process, holding both data shards, builds exactly the global batches the pair builds.
    single = Recorder()
    config = tiny_config(tmp_path / "single", story_corpus, tiny_tokenizer_path, spec=spec, **hyper)
    assert train.run(config, single, dataclasses.replace(TEST_OPTIONS, data_shards=2)) == EXIT_OK
    outputs = finished()
    assert parse_reports(outputs[1]) == []  # only process 0 reports
    pair_losses = report_losses(parse_reports(outputs[0]))
    single_losses = losses(single.reports)
    assert sorted(pair_losses) == sorted(single_losses) == list(range(1, STEPS + 1))
    # Four devices against this process's one: the same sums, added in another order.
    np.testing.assert_allclose(
        [pair_losses[s] for s in range(1, STEPS + 1)],
        [single_losses[s] for s in range(1, STEPS + 1)],
        rtol=1e-4,
    )
    assert (tmp_path / "pair" / "final" / "params").is_dir()
    (pair_result,) = [report for report in parse_reports(outputs[0]) if report["kind"] == "result"]
    (single_result,) = single.of_kind("result")
    assert pair_result["exported_step"] == single_result.exported_step == 3, (pair_result, single_result)
    np.testing.assert_allclose(pair_result["eval_loss"], single_result.eval_loss, rtol=1e-4)
    # (the pair's export is its own checkpoint's params: the two runs' weights differ in the last bits)
    state, checkpointer = tmp_path / "pair" / "checkpoints" / "3" / "state", ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(state).item_metadata.tree["params"]
    on_host = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    only = {"item": {"params": tree}, "restore_args": {"params": on_host}, "partial_restore": True}
    kept = checkpointer.restore(state, args=ocp.args.PyTreeRestore(**only))["params"]
    jax.tree.map(
        np.testing.assert_array_equal, gm.ckpts.load_params(tmp_path / "pair" / "final" / "params"), kept
    )
    hf = load_file(tmp_path / "pair" / "final" / "hf" / "model.safetensors")
    expected = dict(hf_tensors(kept, gemma.tiny_config(TINY_VOCAB_SIZE)))
    assert hf.keys() == expected.keys()
    for name, array in expected.items():
        np.testing.assert_array_equal(hf[name], array, err_msg=name)
    gguf = {
        t.name: np.asarray(t.data) for t in GGUFReader(tmp_path / "pair" / "final" / "model-f32.gguf").tensors
    }
    for name, array in expected.items():
        shift = 1 if name.endswith("norm.weight") else 0
        np.testing.assert_array_equal(gguf.pop(gguf_tensor_name(name.removeprefix("model."))), array + shift)
    assert not gguf
    # Each process packed its own shard: what process 0 reports is the two shards' sum.
    (pair_data,) = [report for report in parse_reports(outputs[0]) if report["kind"] == "data"]
    (single_data,) = single.of_kind("data")
    assert {**pair_data, "time": None} == {
        **single_data.model_dump(mode="json", exclude_none=True),
        "time": None,
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_reproduce_a_single_process_dpo_run(
    tmp_path: Path,
    tiny_tokenizer_path: Path,
    compile_cache: dict[str, str],  # noqa: F811
) -> None:
    """Preference pairs, each process packing its own shard's, and a full job's reference (its initial
    weights, copied across both processes' devices): the same losses as one process holding both shards."""
    pairs = write_preference_pairs(tmp_path / "pairs.jsonl", 120, 5)
    hyper = {"max_steps": 4, "eval_every_steps": 2, "learning_rate": 1e-3, "lr_scheduler": "constant"}
    spec = {"validation_split": 0.1, "method": {"objective": "dpo"}}
    pair = tiny_config(tmp_path / "pair", pairs, tiny_tokenizer_path, spec=spec, **hyper)
    finished = start_pair(pair, tmp_path, compile_cache, "dpo")
    single = Recorder()
    config = tiny_config(tmp_path / "single", pairs, tiny_tokenizer_path, spec=spec, **hyper)
    assert train.run(config, single, dataclasses.replace(TEST_OPTIONS, data_shards=2)) == EXIT_OK
    reports = parse_reports(finished()[0])
    pair_losses, single_losses = report_losses(reports), losses(single.reports)
    assert sorted(pair_losses) == sorted(single_losses) == [1, 2, 3, 4]
    assert pair_losses[1] == pytest.approx(math.log(2), abs=1e-6)  # (the model is its reference)
    np.testing.assert_allclose(
        [pair_losses[s] for s in range(1, 5)], [single_losses[s] for s in range(1, 5)], rtol=1e-4
    )
    pair_evals = [(r["step"], r["eval_loss"]) for r in reports if r["kind"] == "eval"]
    single_evals = [(e.step, e.eval_loss) for e in single.of_kind("eval")]
    assert [s for s, _ in pair_evals] == [s for s, _ in single_evals] == [0, 2, 4]
    np.testing.assert_allclose([v for _, v in pair_evals], [v for _, v in single_evals], rtol=1e-4)
    assert pair_evals[-1][1] < math.log(2)
    (pair_data,) = [report for report in reports if report["kind"] == "data"]
    (single_data,) = single.of_kind("data")
    assert pair_data["preference_pairs"] and pair_data["documents"] == single_data.documents == 108
    assert pair_data["rows"] == single_data.rows
