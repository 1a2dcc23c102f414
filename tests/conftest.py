from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from api.main import create_app
from api.migrate import upgrade
from api.runner import process_start_time
from api.settings import Settings

pytest_plugins = ["tests.support.fixtures"]

FAKE_WORKER = Path(__file__).parent / "fake_worker.py"

# Tests that train with JAX (in the test process or in worker processes), each on every core. With the tests
# in several processes (`make test`: pytest-xdist), they run one after another in one of them, from the
# start, beside the other tests: two at once slowed each by half, and the last ones left a long tail.
TRAINING_FILES = {
    f"tests/worker/test_{name}.py" for name in ("e2e", "distributed", "checkpoint", "gguf_import", "train")
}

# Files whose tests rely on running in file order, in one process (a test checks what the one before left).
IN_ORDER_FILES = {"tests/test_support.py"}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduler by scopes (work units), each test a scope of its own but the training tests,
    one scope together, and each of IN_ORDER_FILES; the biggest scope first (`--loadscope-reorder`, the
    default). (`--dist loadgroup` with `xdist_group` marks would do it, but it ignores the marks under
    pytest 9.2: pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class TrainingApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            if path in TRAINING_FILES:
                return "training"
            return path if path in IN_ORDER_FILES else nodeid

    return TrainingApart(config, log)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated database of each kind: the API tests run on both."""
    url = (
        f"sqlite:///{tmp_path / 'tputune.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_db_url")
    )
    upgrade(url)
    return url


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    return root


@pytest.fixture
def make_settings(tmp_path: Path, database_url: str, data_root: Path) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "data_dir": tmp_path / "state",
            "database_url": database_url,
            "allowed_data_roots": [data_root],
            "allow_tiny_model": True,
            "worker_command": f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE_WORKER))}",
            "dispatch_interval_seconds": 0.1,
            "cancel_grace_seconds": 2.0,
        }
        values.update(overrides)
        return Settings(**values)

    return make


@pytest.fixture
def client(make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    """The API in-process, without the dispatcher (jobs stay queued)."""
    with TestClient(create_app(make_settings(dispatcher_enabled=False))) as test_client:
        yield test_client


@pytest.fixture
def dataset(data_root: Path) -> Path:
    path = data_root / "train.txt"
    path.write_text("Once upon a time.\n<|endoftext|>\nThe end.\n")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveApi:
    """The real app under uvicorn on a free port, in a thread; `restart()` is a new API process's view."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.headers: dict[str, str] = {}  # (what client() sends: e.g. an API key)

    @property
    def url(self) -> str:
        return self.settings.resolved_public_url

    def start(self) -> None:
        app = create_app(self.settings)
        # No log_config (as `tputune serve`): uvicorn's would go through logging.config.dictConfig, which
        # closes every logging handler the process ever made, absl's among them once a worker test imported
        # it, and that one's stream is pytest's capture of stderr, which every later test then lost.
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.settings.port, log_level="warning", log_config=None
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("API did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        assert self.server is not None and self.thread is not None
        self.server.should_exit = True
        self.thread.join(timeout=20)

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10, headers=self.headers)

    def gauge(self, name: str) -> float:
        """A metric without labels, as /metrics shows it now."""
        with self.client() as http:
            text = http.get("/metrics").text
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"{name} ")))

    def wait_for(self, job_id: str, predicate: Callable[[dict], bool], timeout: float = 60) -> dict:
        # (60 s: the dispatcher process's start, 2.6 s of CPU alone, took 25 s in CI beside the other xdist
        # worker's training; a wait of 30 s for a first launch timed out twice.)
        deadline = time.monotonic() + timeout
        with self.client() as http:
            while True:
                job = http.get(f"/jobs/{job_id}").json()
                if predicate(job):
                    return job
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out; job is {job['status']}: {job.get('status_message')}")
                time.sleep(0.05)


@pytest.fixture
def live_api(make_settings: Callable[..., Settings]) -> Iterator[Callable[..., LiveApi]]:
    started: list[LiveApi] = []

    def start(**overrides: Any) -> LiveApi:
        api = LiveApi(make_settings(port=free_port(), **overrides))
        api.start()
        started.append(api)
        return api

    yield start
    for api in started:
        if api.server is not None and not api.server.should_exit:
            api.stop()
        kill_runs(api.settings.jobs_dir)


def kill_runs(jobs_dir: Path) -> None:
    """Leave no worker behind: kill every run's process group under `jobs_dir` that still runs. Its runner
    is checked by its start time, as the executor checks it: the pid of a run that ended long ago may be
    another test's process now (pids wrap at 32,768 here), a worker whose job then failed, killed."""
    for runner_file in jobs_dir.glob("*/runner.json"):
        runner = json.loads(runner_file.read_text())
        if process_start_time(runner["pid"]) != runner.get("start_time"):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(runner["pid"], signal.SIGKILL)
