"""The dispatcher in a process of its own (`tputune serve`; TPUTUNE_DISPATCHER_PROCESS, the default).

Why: the API serves requests on one interpreter, and a dispatcher thread there takes its share of the GIL.
Capped by TPUTUNE_DISPATCHER_BUSY_SHARE it still cost POST /jobs about a third of its throughput while it
failed the jobs being created (bench/README.md). In a process of its own it runs on another core.

How:
- The server starts `python -m api.dispatch_process` and writes the settings to its stdin as one JSON line.
  With `--workers N` that is the parent process, which serves no requests itself; else the one API process.
- The child stops when that pipe closes: when the server stops, or dies (SIGKILL included). It ends the
  step it is in first; each step is one idempotent move of one job, so the next dispatcher picks up there.
- A byte written to the FIFO `<data_dir>/dispatcher.wake` asks for a pass now (a job was created or
  cancelled). Every API process can write there, whichever of them started the child (Waker).
- One dispatcher per data dir at a time: the child holds flock(2) of `<data_dir>/dispatcher.lock` while it
  runs, and only then reads the FIFO. One started while an older one still ends its step waits for it.
- The server starts another child if one exits on its own (a crash), after a pause.
- SQLite writes of all the processes queue on one lock (api.db), not in SQLite's busy handler.
- The child's figures for /metrics (its last pass, launches), and whether a wake-up is pending, are in
  `<data_dir>/dispatcher.stats`, a small file all the processes map.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import SecretStr

from api.settings import Settings

if TYPE_CHECKING:
    from api.dispatcher import Dispatcher

log = logging.getLogger("api.dispatch_process")  # (run as __main__)

LOCK_FILE = "dispatcher.lock"
STATS_FILE = "dispatcher.stats"
WAKE_FILE = "dispatcher.wake"
RESTART_SECONDS = 1.0  # before starting another child after one exited on its own
STOP_SECONDS = 15.0  # a child that has not ended its step by then is killed
_STATS = struct.Struct("ddd")  # the last pass (Unix time), launches, stalls
_WAKE_PENDING = _STATS.size  # then a byte: 1 while a wake-up byte is in the FIFO, unread


class SharedStats(Collector):
    """The dispatcher's figures in a file mapped by all the processes: the child writes (DispatcherStats),
    the API's /metrics reads (a Prometheus collector). And whether a wake-up is pending (see Waker)."""

    def __init__(self, path: Path, reset: bool = False) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if reset:
                os.ftruncate(fd, 0)  # a new server: its counters start at zero
            os.ftruncate(fd, _STATS.size + 1)
            self._map = mmap.mmap(fd, _STATS.size + 1)
        finally:
            os.close(fd)

    def read(self) -> tuple[float, float, float]:
        last_pass, launches, stalls = _STATS.unpack_from(self._map)
        return last_pass, launches, stalls

    def passed(self) -> None:
        struct.pack_into("d", self._map, 0, time.time())

    def launched(self) -> None:
        launches = self.read()[1]
        struct.pack_into("d", self._map, 8, launches + 1)  # one writer: the child's dispatcher thread

    def stalled(self) -> None:
        struct.pack_into("d", self._map, 16, self.read()[2] + 1)

    def wake_pending(self) -> bool:
        return self._map[_WAKE_PENDING] == 1

    def set_wake_pending(self, pending: bool) -> None:
        self._map[_WAKE_PENDING] = int(pending)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        from api.observability import LAST_PASS, LAUNCHES, STALLS

        last_pass, launches, stalls = self.read()
        yield CounterMetricFamily(LAUNCHES[0], LAUNCHES[1], value=launches)
        yield CounterMetricFamily(STALLS[0], STALLS[1], value=stalls)
        yield GaugeMetricFamily(LAST_PASS[0], LAST_PASS[1], value=last_pass)


def settings_line(settings: Settings) -> bytes:
    """The settings as the child rebuilds them: every field, secrets included (over a pipe, not argv)."""
    values = settings.model_dump(mode="json")
    for name, value in settings:
        if isinstance(value, SecretStr):
            values[name] = value.get_secret_value()
    return json.dumps(values).encode() + b"\n"


def make_fifo(path: Path) -> None:
    """The wake-up FIFO; it stays (writers keep it open across dispatcher restarts)."""
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            os.unlink(path)
            os.mkfifo(path, 0o600)


class Waker:
    """Asks the dispatcher process for a pass: a byte in its FIFO, from any API process.

    Only when no wake-up is pending: the child clears the flag when it reads the FIFO, before the pass
    it asks for, so a commit made while it is set is seen by that pass. (A write per commit cost the job
    writer a fifth of its time: the kernel ran the woken reader at once.)"""

    def __init__(self, path: Path, stats: SharedStats) -> None:
        self.path = path
        self.stats = stats
        self._fd: int | None = None
        self._lock = threading.Lock()

    def wake(self) -> None:
        if self.stats.wake_pending():
            return
        with self._lock:
            if self._fd is None:
                try:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                except OSError:  # no dispatcher reads it now (ENXIO): the next one passes when it starts
                    return
            self.stats.set_wake_pending(True)
            try:
                os.write(self._fd, b"w")
            except BlockingIOError:
                pass  # a full FIFO holds wake-ups enough
            except OSError:  # EPIPE: the dispatcher is gone; its successor passes when it starts
                os.close(self._fd)
                self._fd = None
                self.stats.set_wake_pending(False)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class DispatcherProcess:
    """The server's side: starts the child, restarts it if it dies, stops it. (Waker wakes it.)"""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # A new server: the counters start at zero, and no wake-up is pending.
        self.stats = SharedStats(settings.data_dir / STATS_FILE, reset=True)
        make_fifo(settings.data_dir / WAKE_FILE)
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._guard = threading.Lock()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        with self._guard:
            self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="tputune-dispatcher-watch", daemon=True)
        self._watcher.start()

    def _spawn(self) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "api.dispatch_process"], stdin=subprocess.PIPE)
        stdin: IO[bytes] = proc.stdin  # type: ignore[assignment]
        try:
            stdin.write(settings_line(self.settings))
            stdin.flush()
        except BrokenPipeError:
            pass  # it died at once: _watch says so and starts another
        self._proc = proc

    def _watch(self) -> None:
        while True:
            proc = self._proc
            assert proc is not None
            code = proc.wait()
            if self._stopping.is_set():
                return
            log.error(
                "the dispatcher process exited with status %s; starting another in %.0f s",
                code,
                RESTART_SECONDS,
            )
            if self._stopping.wait(RESTART_SECONDS):
                return
            with self._guard:
                if self._stopping.is_set():
                    return
                assert proc.stdin is not None
                proc.stdin.close()
                self._spawn()

    def stop(self) -> None:
        self._stopping.set()
        with self._guard:
            proc = self._proc
            if proc is None:
                return
            assert proc.stdin is not None
            proc.stdin.close()  # the child ends its step and exits
        try:
            proc.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning("the dispatcher process did not stop within %.0f s; killing it", STOP_SECONDS)
            proc.kill()
            proc.wait()
        if self._watcher is not None:
            self._watcher.join(timeout=5)


# --- the child ---


def _lock(path: Path, stopping: threading.Event) -> int | None:
    """Hold flock(2) of `path` (kept until the process exits); None if told to stop while waiting."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if not waited:
                log.info("another dispatcher runs on %s; waiting for it to stop", path.parent)
                waited = True
        if stopping.wait(0.1):
            os.close(fd)
            return None


def _read_wakes(path: Path, stats: SharedStats, dispatcher: Dispatcher) -> None:
    """Open the wake-up FIFO (DispatcherProcess made it) and, in a thread, turn each read into a pass."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    # A writer of our own: reads wait for bytes instead of seeing end-of-file while no API process holds
    # the FIFO open. (Kept until the process exits.)
    os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    os.set_blocking(fd, True)
    stats.set_wake_pending(False)  # left set by a predecessor that died? the first pass sees every commit

    def read() -> None:
        while True:
            os.read(fd, 4096)
            stats.set_wake_pending(False)  # before the pass: a later commit asks for another
            dispatcher.wake()

    threading.Thread(target=read, name="tputune-dispatcher-wakes", daemon=True).start()


def main() -> int:
    # The server stops us by closing stdin; Ctrl-C in a terminal reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    settings = Settings(**json.loads(line))

    from api.observability import configure_logging

    configure_logging(settings.log_level, settings.log_format == "json")
    stopping = threading.Event()
    dispatcher: Dispatcher | None = None

    def watch_stdin() -> None:
        while os.read(0, 4096):
            pass
        stopping.set()  # EOF: the server stopped or died
        if dispatcher is not None:
            dispatcher.request_stop()

    threading.Thread(target=watch_stdin, name="tputune-dispatcher-stdin", daemon=True).start()
    if _lock(settings.data_dir / LOCK_FILE, stopping) is None:
        return 0

    from api.db import make_engine
    from api.dispatcher import make_dispatcher
    from api.executors import Closeable, make_executor

    stats = SharedStats(settings.data_dir / STATS_FILE)
    engine = make_engine(settings.resolved_database_url, pool_size=2)
    executor = make_executor(settings)
    dispatcher = make_dispatcher(engine, executor, settings, stats)
    if stopping.is_set():  # (before `dispatcher` was set, watch_stdin could not tell it)
        return 0
    # Set up (2.6 s of CPU, imports mostly) at the server's priority, then nice: CPU to the API's requests
    # first, the dispatcher catches up after. Jobs wait for its first pass after every restart: beside four
    # busy processes it came 7.6 s after the spawn niced from the start, 6.6 s so (three runs each).
    if settings.dispatcher_nice:
        os.nice(settings.dispatcher_nice)
    # Only the dispatcher that holds the lock reads wake-ups: one waiting for it would take them.
    _read_wakes(settings.data_dir / WAKE_FILE, stats, dispatcher)
    log.info("dispatcher process %d started", os.getpid())
    if dispatcher.leader is not None:
        dispatcher.leader.start()
    try:
        dispatcher.run()
    finally:
        dispatcher.stop()  # the leader hands the Lease over
        if isinstance(executor, Closeable):
            executor.close()
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
