"""Shared pieces of the trainer tests: tiny job configs, a recording reporter and worker subprocesses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from worker.config import WorkerConfig
from worker.data import Preference
from worker.protocol import MetricsReport, Report
from worker.report import Reporter
from worker.stories import generate_stories
from worker.train import RunOptions

REPO_ROOT = Path(__file__).resolve().parents[2]

# One set of hyperparameters for most runs, so their compiled steps are shared through the cache.
TINY_HYPERPARAMETERS: dict[str, Any] = {
    "max_steps": 12,
    "batch_size": 8,
    "max_seq_len": 64,
    "learning_rate": 3e-3,
    "warmup_steps": 2,
}
# float32 compute makes runs on different device layouts comparable to tight tolerances.
TEST_OPTIONS = RunOptions(compute_dtype="float32", sample_tokens=4)


def tiny_config(
    output: Path,
    corpus: Path,
    tokenizer: Path,
    *,
    job_id: str = "job-1",
    spec: dict | None = None,
    **hyper: Any,
) -> WorkerConfig:
    """A WorkerConfig for the tiny model; `spec` and `hyper` override the defaults."""
    body: dict[str, Any] = {
        "name": "tiny test",
        "model": "tiny",
        "dataset_uri": str(corpus),
        "tokenizer_uri": str(tokenizer),
        "sample_prompts": [],
        "hyperparameters": {**TINY_HYPERPARAMETERS, **hyper},
        **(spec or {}),
    }
    return WorkerConfig.model_validate({"job_id": job_id, "output_uri": str(output), "spec": body})


class Recorder(Reporter):
    """Keeps every report in memory; `on_report` sees each one as it is sent."""

    def __init__(self, on_report: Callable[[Report], None] | None = None) -> None:
        super().__init__("test", echo=None)
        self.reports: list[Report] = []
        self.on_report = on_report
        self.cancel = False
        self.pause = False

    @property
    def cancel_requested(self) -> bool:
        return self.cancel

    @property
    def pause_requested(self) -> bool:
        return self.pause

    def send(self, report: Report) -> None:
        self.reports.append(report)
        if self.on_report is not None:
            self.on_report(report)

    def of_kind(self, kind: str) -> list[Any]:
        return [report for report in self.reports if report.kind == kind]


def losses(reports: list[Any]) -> dict[int, float]:
    """Step -> loss of the metrics reports."""
    return {r.step: r.loss for r in reports if isinstance(r, MetricsReport) and r.loss is not None}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_worker(
    config: WorkerConfig,
    workdir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    name: str = "worker",
    memory_gib: float | None = None,
) -> subprocess.Popen[str]:
    """`python -m worker --config ...` in float32; stdout (the JSON reports) is a pipe, stderr a file.
    `memory_gib`: the most memory the process may map (RLIMIT_AS), as an accelerator has no more."""
    path = workdir / f"{name}.json"
    path.write_text(config.model_dump_json())
    stderr = (workdir / f"{name}.log").open("w")
    start = ["-m", "worker"]
    if memory_gib is not None:
        most = int(memory_gib * 2**30)
        start = [
            "-c",
            f"import resource, runpy; resource.setrlimit(resource.RLIMIT_AS, ({most}, {most})); "
            "runpy.run_module('worker', run_name='__main__', alter_sys=True)",
        ]
    return subprocess.Popen(
        [sys.executable, *start, "--config", str(path), "--compute-dtype", "float32", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def parse_reports(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def report_losses(reports: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in reports if r["kind"] == "metrics" and "loss" in r}


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A persistent XLA compilation cache for this session's runs, in-process and in subprocesses.

    Returns the environment that points a worker subprocess at it.
    """
    import jax

    path = str(tmp_path_factory.mktemp("jax-cache"))
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return {"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def run_hf(
    model_dir: Path,
    workdir: Path,
    *,
    tokens: Any = None,
    texts: list[str] | None = None,
    chats: list[list[dict[str, str]]] | None = None,
    config: bool = False,
    adapter: Path | None = None,
    gguf_file: str | None = None,
) -> tuple[dict[str, Any], Any]:
    """What transformers makes of an exported Hugging Face model (`tests/worker/hf_side.py`, in a process of
    its own), or of the GGUF file `gguf_file` in `model_dir`: (its result, with `config`, `texts`, `chats`,
    `dtype`; the logits for `tokens`, with the PEFT `adapter` on the model if given, or None)."""
    import numpy as np

    workdir.mkdir(parents=True, exist_ok=True)
    request: dict[str, Any] = {"model": str(model_dir), "texts": texts or [], "chats": chats or []}
    request["config"] = config
    request["adapter"] = str(adapter) if adapter else None
    request["gguf_file"] = gguf_file
    if tokens is not None:
        np.save(workdir / "tokens.npy", np.asarray(tokens))
        request["tokens"] = str(workdir / "tokens.npy")
    (workdir / "request.json").write_text(json.dumps(request))
    done = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "tests" / "worker" / "hf_side.py"),
            str(workdir / "request.json"),
            str(workdir),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((workdir / "result.json").read_text())
    return result, np.load(workdir / "logits.npy") if tokens is not None else None


def preference_pairs(count: int, seed: int) -> list[Preference]:
    """Story openings, each with its next words (chosen) and those words backwards (rejected): a preference
    a model can learn, short enough that a pair fits a row of 64 tokens."""
    pairs = []
    for story in generate_stories(count, seed):
        words = story.split()
        reply = words[5:13]
        pairs.append(Preference(" ".join(words[:5]), " " + " ".join(reply), " " + " ".join(reply[::-1])))
    return pairs


def write_preference_pairs(path: Path, count: int, seed: int) -> Path:
    """`preference_pairs` as a JSONL dataset of `{"prompt", "chosen", "rejected"}` records."""
    records = [
        {"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}
        for p in preference_pairs(count, seed)
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path
