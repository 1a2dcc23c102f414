"""Supervisor of one local run: `python -m api.runner --job-dir DIR --processes N -- CMD...`.

The local executor starts this as the leader of a new process group. It starts N worker processes
(with the jax.distributed coordinator, count and id in their environment when N > 1), sends their
output to DIR/worker.log (process 0) and DIR/worker-<i>.log, and when they end writes DIR/exit.json
with the run's exit status. The API reads that file, so it learns the outcome even after it
restarted and the run is no longer its child. Imports nothing heavy: it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

EXIT_FILE = "exit.json"
RUNNER_FILE = "runner.json"
PEER_GRACE_SECONDS = 10.0


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/pid/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has finished; only its parent's wait is missing
        return None
    return int(fields[19])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def run(job_dir: Path, processes: int, command: list[str], peer_grace: float = PEER_GRACE_SECONDS) -> int:
    write_json_atomic(
        job_dir / RUNNER_FILE, {"pid": os.getpid(), "start_time": process_start_time(os.getpid())}
    )
    stopping = False

    def _on_term(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    children: list[subprocess.Popen[bytes]] = []
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    coordinator = f"127.0.0.1:{_free_port()}"
    for index in range(processes):
        if stopping:  # (told to stop before all started: those started have the signal; start no more)
            break
        env = dict(os.environ)
        if processes > 1:
            env.update(
                JAX_COORDINATOR_ADDRESS=coordinator,
                JAX_NUM_PROCESSES=str(processes),
                JAX_PROCESS_ID=str(index),
            )
        log_name = "worker.log" if index == 0 else f"worker-{index}.log"
        with open(job_dir / log_name, "ab") as log:
            children.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))

    exit_code: int | None = None
    first_failure_at: float | None = None
    while True:
        codes = [child.poll() for child in children]
        for code in codes:
            if code not in (None, 0) and exit_code is None:
                exit_code = _status(code)
                first_failure_at = time.monotonic()
        if all(code is not None for code in codes):
            break
        # One process failed: its peers would block in collectives forever, so stop them.
        if first_failure_at is not None and not stopping and time.monotonic() - first_failure_at > peer_grace:
            for child in children:
                if child.poll() is None:
                    child.terminate()
            first_failure_at = time.monotonic() + 3600
        time.sleep(0.05)
    if exit_code is None and len(children) < processes:
        exit_code = 128 + signal.SIGTERM  # (stopped before its workers started: it did not finish)
    final = exit_code if exit_code is not None else 0
    write_json_atomic(job_dir / EXIT_FILE, {"exit_code": final, "finished_at": time.time()})
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m api.runner")
    parser.add_argument("--job-dir", required=True, type=Path)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--peer-grace", type=float, default=PEER_GRACE_SECONDS)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    return run(args.job_dir, args.processes, command, args.peer_grace)


if __name__ == "__main__":
    sys.exit(main())
