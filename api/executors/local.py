"""The embedded executor: each job runs as a local process group under `python -m api.runner`.

A run is identified by its runner's pid *and* start time (pids are reused), recorded by the runner in
the job dir and found again by scanning /proc for the job id in a process's environment, so a crash
between "started" and "recorded" adopts the run instead of starting a second one.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from api.executors import Observation
from api.models import Job
from api.runner import EXIT_FILE, RUNNER_FILE, process_start_time, write_json_atomic
from api.settings import Settings
from worker.config import ENV_API_URL, ENV_JOB_ID, ENV_JOB_TOKEN, JobSpec, WorkerConfig

ENV_RUNNER = "TPUTUNE_RUNNER"
CONFIG_FILE = "config.json"
LOG_FILE = "worker.log"


def _read_json(path: Path) -> dict[str, Any] | None:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _alive(handle: dict[str, Any]) -> bool:
    pid, start = handle.get("pid"), handle.get("start_time")
    return pid is not None and start is not None and process_start_time(int(pid)) == start


def _runner_of(job_id: str) -> int | None:
    """The pid of a live runner process whose environment names this job, if any."""
    needle = f"{ENV_JOB_ID}={job_id}\0".encode()
    marker = f"{ENV_RUNNER}=1\0".encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes() + b"\0"
        except OSError:
            continue
        if needle in environ and marker in environ and process_start_time(int(entry.name)) is not None:
            return int(entry.name)
    return None


class LocalExecutor:
    name = "local"
    logs_outlive_runs = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._cancel_started: dict[str, float] = {}

    def job_dir(self, job: Job) -> Path:
        return self.settings.jobs_dir / job.id

    def find(self, job: Job) -> dict[str, Any] | None:
        job_dir = self.job_dir(job)
        if not job_dir.exists():
            return None  # _start makes the dir before it spawns anything: no dir, no run
        recorded = _read_json(job_dir / RUNNER_FILE)
        if recorded and _alive(recorded):
            return {**recorded, "pgid": recorded["pid"]}
        # The runner records itself first thing; only a run started without that record needs the scan.
        pid = _runner_of(job.id) if recorded is None else None
        if pid is not None:
            return {"pid": pid, "pgid": pid, "start_time": process_start_time(pid)}
        if (job_dir / EXIT_FILE).exists() and recorded:
            return {**recorded, "pgid": recorded["pid"]}  # it already ran to the end
        return None

    def launch(self, job: Job, token: str) -> dict[str, Any]:
        existing = self.find(job)
        if existing is not None:
            return existing
        return self._start(job, token)

    def restart(self, job: Job, token: str) -> dict[str, Any]:
        return self._start(job, token)

    def _start(self, job: Job, token: str) -> dict[str, Any]:
        job_dir = self.job_dir(job)
        job_dir.mkdir(parents=True, exist_ok=True)
        self.discard(job)  # (a run before, ended: its records are not this one's)
        spec = JobSpec.model_validate(job.spec)
        config = WorkerConfig(job_id=job.id, spec=spec, output_uri=job.output_uri)
        write_json_atomic(job_dir / CONFIG_FILE, config.model_dump(mode="json"))
        # Workers get the job's token, not the API's own settings (the database URL may hold a password).
        env = {k: v for k, v in os.environ.items() if not k.startswith("TPUTUNE_")}
        env.update(
            {
                ENV_API_URL: self.settings.resolved_public_url,
                ENV_JOB_TOKEN: token,
                ENV_JOB_ID: job.id,
                ENV_RUNNER: "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        # Jobs of the same shape reuse compiled steps: a restart or the next job starts in seconds.
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(self.settings.data_dir / "jax-cache"))
        command = [
            sys.executable,
            "-m",
            "api.runner",
            "--job-dir",
            str(job_dir),
            "--processes",
            str(spec.resources.processes or 1),
            "--",
            *shlex.split(self.settings.worker_command),
            "--config",
            str(job_dir / CONFIG_FILE),
        ]
        with open(job_dir / "runner.log", "ab") as runner_log:
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=runner_log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=job_dir,
                start_new_session=True,
            )
        self._children[job.id] = child
        self._cancel_started.pop(job.id, None)
        return {"pid": child.pid, "pgid": child.pid, "start_time": process_start_time(child.pid)}

    def observe(self, job: Job) -> Observation:
        child = self._children.get(job.id)
        if child is not None and child.poll() is not None:
            self._children.pop(job.id, None)
        exit_info = _read_json(self.job_dir(job) / EXIT_FILE)
        if exit_info is not None:
            return Observation("exited", exit_code=int(exit_info["exit_code"]))
        handle = job.launch or {}
        if _alive(handle):
            return Observation("running")
        return Observation("gone", reason="The worker processes ended without recording an exit status.")

    def cancel(self, job: Job) -> bool:
        handle = job.launch or {}
        if not _alive(handle):
            self.observe(job)  # reap our own child
            return True
        pgid = int(handle["pgid"])
        # SIGTERM once (the workers save a checkpoint and exit), SIGKILL past the grace. Not SIGTERM on every
        # pass: one that reached a worker as Python was ending, its handler gone, killed it (status 143).
        started = self._cancel_started.get(job.id)
        if started is None:
            self._cancel_started[job.id] = time.monotonic()
            sig = signal.SIGTERM
        elif time.monotonic() - started >= self.settings.cancel_grace_seconds:
            sig = signal.SIGKILL
        else:
            return False
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True
        return False

    def discard(self, job: Job) -> None:
        """Forget a run that no longer goes (paused, or cancelled before its launch was recorded; or before
        a new one starts): its runner's and exit status's records, so that the job's next launch starts a
        run instead of adopting the one that ended (`find`). Its log, config and checkpoints stay."""
        job_dir = self.job_dir(job)
        for record in (EXIT_FILE, RUNNER_FILE):
            (job_dir / record).unlink(missing_ok=True)

    def forget(self, job: Job) -> None:
        """What a deleted job's runs left in its directory: its config, its runner's records and log, its
        workers' logs (not its outputs, where they are in it: the default output_uri); the directory too if
        that left it empty."""
        self._children.pop(job.id, None)
        self._cancel_started.pop(job.id, None)
        job_dir = self.job_dir(job)
        if not job_dir.is_dir():
            return
        for path in job_dir.iterdir():
            name = path.name
            worker_log = name.startswith("worker") and name.endswith(".log")
            record = name in (CONFIG_FILE, EXIT_FILE, RUNNER_FILE, "runner.log") or worker_log
            leftover = name.startswith(".") and name.endswith(".tmp")  # (write_json_atomic's, cut short)
            if (record or leftover) and path.is_file():
                path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # (its outputs are in it)
            job_dir.rmdir()

    def logs(self, job: Job, tail: int) -> tuple[list[str], bool]:
        path = self.job_dir(job) / LOG_FILE
        try:
            with open(path, "rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                chunk = min(size, max(65536, tail * 400))
                handle.seek(size - chunk)
                data = handle.read()
        except FileNotFoundError:
            return [], False
        lines = data.decode("utf-8", "replace").splitlines()
        if chunk < size:
            lines = lines[1:]  # the first line may be cut
        return lines[-tail:], chunk < size or len(lines) > tail
