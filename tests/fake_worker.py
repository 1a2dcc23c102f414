"""A test double for the worker, at the process boundary: it speaks the real progress contract
(worker/protocol.py) to the real API and behaves as the job's `metadata["fake"]` says:

succeed (default), fail, bad_input, silent_crash, hang (ignores SIGTERM), slow (runs until SIGTERM,
then exits with the preempted code), preempt_once (exits preempted the first time, succeeds the next),
stall (reports nothing after step 3, alive, until SIGTERM), stall_once (stalls on its first run only).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.config import EXIT_BAD_INPUT, EXIT_PREEMPTED, WorkerConfig


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    config = WorkerConfig.model_validate_json(Path(parser.parse_args().config).read_text())
    mode = config.spec.metadata.get("fake", "succeed")
    steps = int(config.spec.metadata.get("steps", "5"))
    interval = float(config.spec.metadata.get("interval", "0.01"))
    url, token = os.environ.get("TPUTUNE_API_URL"), os.environ.get("TPUTUNE_JOB_TOKEN")
    client = httpx.Client(timeout=10)
    stop = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "hang" else on_term)
    print(f"fake worker {config.job_id} pid {os.getpid()} mode {mode}", flush=True)

    pending: list[dict] = []

    def send(*reports: dict) -> None:
        # Like the real worker: keep reports while the API is away, deliver them when it is back.
        pending.extend(reports)
        if not url:
            return
        try:
            response = client.post(
                f"{url}/jobs/{config.job_id}/progress",
                json={"reports": pending},
                headers={"Authorization": f"Bearer {token}"},
            )
            response.raise_for_status()
            pending.clear()
        except httpx.HTTPError as exc:
            print(f"report failed: {exc}", flush=True)

    out = Path(config.output_uri)
    out.mkdir(parents=True, exist_ok=True)
    send({"kind": "status", "step": 0, "phase": "training", "message": "Training."})
    print(f"step interval {interval}", flush=True)
    if mode == "fail":
        send(
            {
                "kind": "error",
                "step": 0,
                "code": "loss_not_finite",
                "message": "The loss became NaN at step 0.",
            }
        )
        return 1
    if mode == "bad_input":
        send({"kind": "error", "step": 0, "code": "dataset_empty", "message": "No documents in the dataset."})
        return EXIT_BAD_INPUT
    if mode == "silent_crash":
        print("about to crash", flush=True)
        os._exit(3)
    if mode == "preempt_once" and not (out / "preempted").exists():
        (out / "preempted").write_text("1")
        return EXIT_PREEMPTED
    if mode == "preempt_n":  # its first `preempts` runs are preempted at once
        runs = int((out / "runs").read_text()) if (out / "runs").exists() else 0
        (out / "runs").write_text(str(runs + 1))
        if runs < int(config.spec.metadata.get("preempts", "1")):
            return EXIT_PREEMPTED
    step = 0
    # total_steps: more than it runs, as a run that stops early (early_stopping_patience) reports them.
    total = int(config.spec.metadata.get("total_steps", steps))
    if config.spec.metadata.get("resume") == "checkpoint" and (out / "checkpoint.json").exists():
        step = json.loads((out / "checkpoint.json").read_text())["step"]  # (as the real worker resumes)
        print(f"resumed from the checkpoint at step {step}", flush=True)
    # stall: after step 3 it reports nothing more, alive, until SIGTERM (a host hung in a collective);
    # stall_once: on its first run only.
    stalls = mode == "stall" or (mode == "stall_once" and not (out / "stalled").exists())
    while mode in ("hang", "slow") or step < steps:
        step += 1
        send(
            {
                "kind": "metrics",
                "step": step,
                "total_steps": total,
                "loss": 3.0 / step,
                "learning_rate": 1e-4,
            }
        )
        if mode == "crash_once" and step == 3 and not (out / "crashed").exists():
            # On its first run: saves a checkpoint at step 3, then dies (a fault its owner retries).
            (out / "crashed").write_text("1")
            (out / "checkpoint.json").write_text(json.dumps({"step": step}))
            send({"kind": "checkpoint", "step": step, "uri": str(out / "checkpoint.json")})
            print(f"crashing at step {step}", flush=True)
            os._exit(3)
        if stalls and step >= 3:
            (out / "stalled").write_text("1")
            print(f"stalled at step {step}", flush=True)
            while not stop:
                time.sleep(0.05)
        if stop:
            (out / "checkpoint.json").write_text(json.dumps({"step": step}))
            return EXIT_PREEMPTED
        time.sleep(0.1 if mode in ("hang", "slow") else interval)
    (out / "final.json").write_text(json.dumps({"step": step}))
    send(
        {"kind": "checkpoint", "step": step, "uri": str(out / "final.json")},
        {"kind": "result", "step": step, "output_uri": str(out), "loss": 3.0 / step},
    )
    deadline = time.monotonic() + 30
    while pending and time.monotonic() < deadline:
        time.sleep(0.2)
        send()
    return 0


if __name__ == "__main__":
    sys.exit(main())
