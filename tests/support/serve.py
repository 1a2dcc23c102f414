"""`tputune serve` as a real process (python -m api.cli serve), for tests that kill or restart it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def serve(settings_env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start the server with these TPUTUNE_* variables on top of this process's environment."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "api.cli", "serve"],
            env={**os.environ, **settings_env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the API exited"
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("API did not come up")


def _state_and_parent(stat_path: str | Path) -> tuple[str, int] | None:
    """A process's state letter and parent pid from /proc/<pid>/stat (None once it is gone)."""
    try:
        stat = Path(stat_path).read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return fields[0], int(fields[1])


def children(pid: int, zombies: bool = False) -> list[int]:
    """The child processes of `pid` (zombies only if asked: their CPU time still counts)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        seen = _state_and_parent(Path(entry.path, "stat"))
        if seen is not None and seen[1] == pid and (zombies or seen[0] != "Z"):
            found.append(int(entry.name))
    return found


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


def alive(pid: int) -> bool:
    seen = _state_and_parent(f"/proc/{pid}/stat")
    return seen is not None and seen[0] != "Z"


def dispatchers(server: int) -> list[int]:
    return [pid for pid in children(server) if "api.dispatch_process" in command_line(pid)]


def api_workers(server: int) -> list[int]:
    """The API processes of `tputune serve --workers N` (uvicorn's, started by multiprocessing)."""
    return [pid for pid in children(server) if "spawn_main" in " ".join(command_line(pid))]


def wait_for(check: Callable[[], object], what: str, timeout: float = 30) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Server:
    """`tputune serve` on a data dir of its own, running the fake worker; `workers` API processes."""

    def __init__(self, tmp_path: Path, dataset: Path, workers: int = 1, **env: str) -> None:
        from tests.conftest import FAKE_WORKER, free_port  # (here: bench/api_load.py imports this module)

        self.workers = workers
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = tmp_path / "state"
        self.dataset = dataset
        self.log = tmp_path / "api.log"
        # Its temporary folders (the metrics folder of its workers) in a folder of its own: a server starting
        # removes those that servers now dead left in its temporary folder, another test's among them.
        (tmp_path / "tmp").mkdir(exist_ok=True)
        self.env = {
            "TMPDIR": str(tmp_path / "tmp"),
            "TPUTUNE_DATA_DIR": str(self.data_dir),
            "TPUTUNE_PORT": str(self.port),
            "TPUTUNE_ALLOWED_DATA_ROOTS": str(dataset.parent),
            "TPUTUNE_ALLOW_TINY_MODEL": "true",
            # A pass a minute unless woken: a job that starts in seconds was woken (through the FIFO).
            "TPUTUNE_DISPATCH_INTERVAL_SECONDS": "60",
            "TPUTUNE_WORKER_COMMAND": f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE_WORKER))}",
            "TPUTUNE_WORKERS": str(workers),
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = serve(self.env, self.log)
        wait_up(self.url, self.proc, timeout=60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def dispatcher(self) -> int:
        assert self.proc is not None
        found = wait_for(lambda: dispatchers(self.proc.pid), "the dispatcher process")  # type: ignore[union-attr]
        assert isinstance(found, list) and len(found) == 1, found
        return int(found[0])

    def submit(self, fake: str = "succeed") -> str:
        body = {"name": fake, "model": "tiny", "dataset_uri": str(self.dataset), "metadata": {"fake": fake}}
        response = httpx.post(f"{self.url}/jobs", json=body, timeout=10)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def job(self, job_id: str) -> dict[str, object]:
        return dict(httpx.get(f"{self.url}/jobs/{job_id}", timeout=10).json())

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")

    def passed(self) -> bool:
        """The dispatcher process has made its first pass (the one it makes on starting)."""
        return self.metric("tputune_dispatcher_last_pass_timestamp_seconds") > 0

    def dispatched(self, job_id: str, timeout: float) -> None:
        wait_for(lambda: self.job(job_id)["status"] != "queued", f"{job_id} to be dispatched", timeout)
