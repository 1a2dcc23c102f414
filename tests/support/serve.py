"""`tputune serve` as a real process (python -m api.cli serve), for tests that kill or restart it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
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
