"""Load benchmark of the tputune API: a real `tputune serve` process driven by wrk, on SQLite and PostgreSQL.

    .venv/bin/python bench/api_load.py                # full run: 20 s phases, 64 clients, both databases
    .venv/bin/python bench/api_load.py --quick        # smoke check (3 s phases, 20,000 stored jobs)
    .venv/bin/python bench/api_load.py --databases sqlite --seconds 10 --concurrency 32

Prints a table per database and, as its last line, one JSON object with every figure. Not a test: it
checks the targets and says which are met, and exits 0 either way (1 only if the run itself broke).

What runs, per database:
- `tputune serve` (uvicorn's defaults: uvloop + httptools when installed, access log on) with default
  settings except TPUTUNE_DATA_DIR (a temp dir), TPUTUNE_PORT (a free port), TPUTUNE_DATABASE_URL
  (PostgreSQL only: a throwaway server from tests/support/postgres.py), TPUTUNE_WORKER_COMMAND (a Python
  process that only sleeps) and, given `--workers N`, TPUTUNE_WORKERS. The dispatcher runs as always: a
  child process of the server, whose CPU is reported apart (`disp`); `server` is the CPU of the server's
  process and of its API workers together.
- Jobs the benchmark creates through `POST /jobs` name a dataset under the data dir that does not exist:
  the API accepts them (it checks only that the path is under an allowed root) and the dispatcher fails
  each one at its first pass (`dataset_not_found`): one status transition, no process started. That is
  the least work the dispatcher can do per job, so POST /jobs figures include it but no worker launches.
- The progress jobs (`--ingest-jobs`, default 8) name a dataset that exists, so the dispatcher launches
  them for real; their "worker" is the sleeping process, which never reports, so the job stays
  `starting` until the benchmark posts. The benchmark then replaces the job's token hash in the
  database with one it knows (`api.jobs.new_job_token`, as tests/test_progress.py does), posts a status
  report (the job becomes `running`) and measures `POST /jobs/{id}/progress` with batches of
  `--batch` metrics reports, every batch with new steps (nothing is a duplicate). The dispatcher follows
  these jobs every second as it would real ones. At the end they are cancelled through the API.
- Stored jobs for `GET /jobs`: 1,000 created through the API (the progress jobs among them), then
  `--jobs-large` - 1,000 more inserted directly with SQL (batches of 5,000, RETURNING seq), cloned from
  a job the API and dispatcher made (same spec, metadata row and its three events, new id/name/times).

Phases (each `--seconds` long after a 2 s warm-up whose leftover requests are drained first,
`--concurrency` connections, one wrk thread): healthz (the framework's ceiling: an async route returning a
small model), GET /jobs?limit=50 first page and deep cursor (100th-oldest job) with 1,000 jobs, the same
with --jobs-large jobs, GET /jobs/{id}, progress ingest, POST /jobs; GET /jobs/{id} and POST /jobs again
"paced" (`--paced-fraction`: each client pauses so that together they ask for half the rate reached flat
out, which shows the latency of a loaded but not saturated server). Server CPU ms per request, and CPU
use of the server, PostgreSQL, wrk and the whole machine are reported per phase, with the load average
at its start (the machine may be shared: figures are noisy; CPU per request is the steadiest).
`--source DIR` runs the server from another copy of the code (api/, worker/, migrations/) to compare.

Needs wrk (`apt-get install -y wrk`) and, for PostgreSQL, the server binaries
(`apt-get install -y postgresql`; found like the tests find them, see tests/support/postgres.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from sqlalchemy import Table, func, insert, select, update  # noqa: E402
from sqlalchemy.engine import Engine  # noqa: E402

from api.db import make_engine  # noqa: E402
from api.jobs import new_job_id, new_job_token  # noqa: E402
from api.models import Job, JobEvent, JobMetadata, utcnow  # noqa: E402
from bench.api_cpu import job_body  # noqa: E402
from tests.support.serve import api_workers, children, dispatchers  # noqa: E402

JOBS: Table = Job.__table__  # type: ignore[attr-defined]
EVENTS: Table = JobEvent.__table__  # type: ignore[attr-defined]
METADATA: Table = JobMetadata.__table__  # type: ignore[attr-defined]
CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGET_GET_VS_HEALTHZ = 0.5
TARGET_P99_MS = 50.0
TARGET_REPORTS_PER_S = 1000.0
TARGET_LIST_RATIO = 1.5
SMALL_JOBS = 1000
DEEP_FROM_END = 100  # the deep cursor: the 100th-oldest job (a full page and more follow it)
INSERT_BATCH = 5000
SLEEPER = "import time; time.sleep(3600)"  # the "worker": ends by itself after an hour, whatever happens

# --- wrk scripts -------------------------------------------------------------------------------------------

# Common part: count status codes per thread; at the end print one JSON line with the figures.
LUA_COMMON = r"""
local threads = {}
function setup(thread)
  table.insert(threads, thread)
end
codes = {}
sent = 0
function response(status, headers, body)
  codes[status] = (codes[status] or 0) + 1
end
if request == nil then
  local fixed
  function request()
    fixed = fixed or wrk.format()
    sent = sent + 1
    return fixed
  end
else
  local make = request
  function request()
    sent = sent + 1
    return make()
  end
end
function done(summary, latency, requests)
  local all = {}
  local total_sent = 0
  for _, t in ipairs(threads) do
    local c = t:get("codes")
    if c then
      for k, v in pairs(c) do all[k] = (all[k] or 0) + v end
    end
    total_sent = total_sent + (t:get("sent") or 0)
  end
  local parts = {}
  for k, v in pairs(all) do table.insert(parts, string.format('"%d":%d', k, v)) end
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"sent":%d,"duration_us":%d,"bytes":%d,' ..
    '"socket_errors":{"connect":%d,"read":%d,"write":%d,"timeout":%d},"status_errors":%d,' ..
    '"latency_us":{"p50":%d,"p90":%d,"p99":%d,"max":%d,"mean":%.1f},"codes":{%s}}\n',
    summary.requests, total_sent, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean,
    table.concat(parts, ",")))
end
"""

LUA_POST = r"""
wrk.method = "POST"
wrk.body = BODY
wrk.headers["Content-Type"] = "application/json"
"""

# One batch per request, round-robin over the progress jobs; steps never repeat (START_STEP is per run).
LUA_INGEST = r"""
local counter = 0
local next_step = {}
function request()
  counter = counter + 1
  local j = (counter % #JOBS) + 1
  local s = next_step[j] or START_STEP
  next_step[j] = s + BATCH
  local parts = {}
  for i = 0, BATCH - 1 do
    local step = s + i
    parts[#parts + 1] = string.format(
      '{"kind":"metrics","step":%d,"total_steps":2000000000,"epoch":%.6f,"loss":%.5f,' ..
      '"learning_rate":0.0001,"grad_norm":0.8,"tokens_per_second":15300.5,"trained_tokens":%d,' ..
      '"eta_seconds":1300.0,"time":%d}',
      step, step / 1000000.0, 2.0 + 1.0 / (1 + step % 1000), step * 4096, os.time())
  end
  local body = '{"reports":[' .. table.concat(parts, ",") .. ']}'
  return wrk.format("POST", "/jobs/" .. JOBS[j][1] .. "/progress",
    {["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. JOBS[j][2]}, body)
end
"""


WARMUP_STEP, MEASURED_STEP = 1, 100_000_000  # where each run's steps start: no report is a duplicate


def ingest_script(jobs: list[tuple[str, str]], batch: int, start_step: int) -> str:
    """wrk's script for the progress load: batches of `batch` metrics reports, round-robin over `jobs` (id,
    token), steps from `start_step` on."""
    jobs_lua = "{" + ",".join(f"{{{lua_string(i)},{lua_string(t)}}}" for i, t in jobs) + "}"
    return f"JOBS = {jobs_lua}\nBATCH = {batch}\nSTART_STEP = {start_step}\n" + LUA_INGEST


def lua_string(value: str) -> str:
    return "[==[" + value + "]==]"


# --- measuring CPU -----------------------------------------------------------------------------------------


def proc_cpu_seconds(pid: int, reaped_children: bool = False) -> float:
    """utime + stime of a process (all its threads), plus its reaped children's; 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLK_TCK


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    total = sum(values[:8])
    return float(total - idle), float(total)


@dataclass
class CpuWatch:
    server_pid: int
    postmaster_pid: int | None = None
    _start: dict[str, float] = field(default_factory=dict)

    def _postgres(self) -> float:
        """The postmaster and its live backends, plus the backends that ended (the postmaster reaps them)."""
        if self.postmaster_pid is None:
            return 0.0
        live = sum(proc_cpu_seconds(p) for p in children(self.postmaster_pid, zombies=True))
        return proc_cpu_seconds(self.postmaster_pid, reaped_children=True) + live

    def _sample(self) -> dict[str, float]:
        busy, total = machine_cpu()
        waited = resource.getrusage(resource.RUSAGE_CHILDREN)
        workers = api_workers(self.server_pid)
        return {
            "wall": time.monotonic(),
            "server": proc_cpu_seconds(self.server_pid) + sum(map(proc_cpu_seconds, workers)),
            # Its other children: the dispatcher process (TPUTUNE_DISPATCHER_PROCESS, the default), and
            # one that ended.
            "dispatcher": sum(
                proc_cpu_seconds(p) for p in children(self.server_pid, zombies=True) if p not in workers
            ),
            "postgres": self._postgres(),
            "wrk": waited.ru_utime + waited.ru_stime,  # only wrk ends (is waited for) in a phase
            "busy": busy,
            "total": total,
        }

    def start(self) -> None:
        self._start = self._sample()

    def stop(self) -> dict[str, float | None]:
        end = self._sample()
        wall = end["wall"] - self._start["wall"]

        def pct(key: str) -> float:
            return round(100.0 * (end[key] - self._start[key]) / wall, 1)

        total = end["total"] - self._start["total"]
        return {
            "server_cpu_s": round(end["server"] - self._start["server"], 2),
            "server_pct": pct("server"),
            "dispatcher_pct": pct("dispatcher"),
            "postgres_pct": pct("postgres") if self.postmaster_pid is not None else None,
            "wrk_pct": pct("wrk"),
            "machine_busy_pct": round(100.0 * (end["busy"] - self._start["busy"]) / total, 1)
            if total
            else None,
        }


# --- the server under test ---------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ApiServer:
    """`tputune serve` as a subprocess, with default settings but for the ones named in the docstring."""

    def __init__(
        self,
        workdir: Path,
        database_url: str | None,
        source: Path = ROOT,
        workers: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.source = source
        self.workers = workers
        self.env = env or {}  # more TPUTUNE_* settings (bench/api_ab.py)
        self.workdir = workdir
        self.data_dir = workdir / "state"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database_url = database_url or f"sqlite:///{self.data_dir / 'tputune.db'}"
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    def command(self) -> list[str]:
        script = Path(sys.executable).parent / "tputune"
        return [str(script), "serve"] if script.exists() else [sys.executable, "-m", "api.cli", "serve"]

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TPUTUNE_")}
        env.update(
            {
                "TPUTUNE_DATA_DIR": str(self.data_dir),
                "TPUTUNE_PORT": str(self.port),
                "TPUTUNE_WORKER_COMMAND": f"{sys.executable} -c {shlex.quote(SLEEPER)}",
                # `api` and `worker` from --source (this checkout by default), ahead of the installed ones.
                "PYTHONPATH": os.pathsep.join(filter(None, [str(self.source), env.get("PYTHONPATH")])),
            }
        )
        if not self.database_url.startswith("sqlite"):
            env["TPUTUNE_DATABASE_URL"] = self.database_url
        if self.workers is not None:
            env["TPUTUNE_WORKERS"] = str(self.workers)
        env.update(self.env)
        with open(self.log_path, "ab") as log:
            # cwd: the temp dir, so no `.env` file of the checkout changes the settings.
            self.proc = subprocess.Popen(
                self.command(), cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tputune serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"tputune serve did not come up in 120 s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def loop_setup(self) -> dict[str, Any]:
        """What the running server really loaded: uvloop and httptools show up in its memory map."""
        import uvicorn

        workers = api_workers(self.pid)
        serving = workers[0] if workers else self.pid
        maps = Path(f"/proc/{serving}/maps").read_text()
        threads = len(os.listdir(f"/proc/{serving}/task"))
        return {
            "uvicorn": uvicorn.__version__,
            "workers": len(workers) or 1,
            "loop": "uvloop" if "/uvloop/" in maps else "asyncio",
            "http": "httptools" if "/httptools/" in maps else "h11",
            "access_log": "on (tputune.access, the default; to server.log)",
            "threads_at_start": threads,
            "dispatcher_processes": len(dispatchers(self.pid)),  # TPUTUNE_DISPATCHER_PROCESS, the default
            "command": " ".join(self.command()),
        }

    def new_log_problems(self) -> list[str]:
        """Lines of the server log since the last call that say ERROR or Traceback."""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            text = log.read().decode(errors="replace")
            self._log_offset = log.tell()
        return [line for line in text.splitlines() if " ERROR " in line or line.startswith("Traceback")]

    def settle(self) -> None:
        """Wait until the requests wrk left in the server are done (they would count in the next phase)."""
        self.answers(timeout=120)
        time.sleep(0.5)

    def answers(self, timeout: float = 10.0) -> bool:
        """Whether a database route answers within `timeout` (it needs a worker thread and a connection)."""
        try:
            return httpx.get(f"{self.url}/jobs?limit=1", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- wrk ---------------------------------------------------------------------------------------------------


def run_wrk(
    url: str, script: str, seconds: float, concurrency: int, workdir: Path, cpu: CpuWatch | None = None
) -> tuple[dict[str, Any], dict[str, float | None] | None]:
    path = workdir / "wrk.lua"
    path.write_text(script + LUA_COMMON)
    cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--timeout", "10s", "-s"]
    if cpu is not None:
        cpu.start()
    done = subprocess.run([*cmd, str(path), url], capture_output=True, text=True, check=False)
    usage = cpu.stop() if cpu is not None else None
    for line in done.stdout.splitlines():
        if line.startswith("WRKJSON "):
            return json.loads(line[len("WRKJSON ") :]), usage
    raise RuntimeError(f"wrk gave no figures (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")


@dataclass
class Phase:
    name: str
    method: str
    path: str
    expect: int
    script: str = ""
    rate: float | None = None  # paced: each connection waits concurrency/rate s on average between requests

    def lua(self, concurrency: int) -> str:
        if self.rate is None:
            return self.script
        # Random pauses (uniform, twice the mean at most): fixed ones keep the clients in step, sending
        # in bursts of `concurrency` requests at once.
        mean_ms = round(1000 * concurrency / self.rate)
        return (
            self.script
            + f"math.randomseed(os.time())\nfunction delay() return math.random(0, {2 * mean_ms}) end\n"
        )


def measure(
    server: ApiServer,
    phase: Phase,
    args: argparse.Namespace,
    workdir: Path,
    cpu: CpuWatch,
    url: str | None = None,
    warmup: bool = True,
) -> dict[str, Any]:
    url = url or server.url + phase.path
    script = phase.lua(args.concurrency)
    if warmup:
        run_wrk(url, script, args.warmup, args.concurrency, workdir)  # warm-up: pools, caches
    server.settle()
    server.new_log_problems()
    load = os.getloadavg()[0]
    raw, usage = run_wrk(url, script, args.seconds, args.concurrency, workdir, cpu)
    seconds = raw["duration_us"] / 1e6
    codes = {int(k): v for k, v in raw["codes"].items()}
    unexpected = sum(v for k, v in codes.items() if k != phase.expect)
    socket_errors = sum(raw["socket_errors"].values())
    # wrk leaves up to `concurrency` requests unanswered when it stops; they only count as errors when
    # the server has stopped answering (wrk 4.1 does not count its own timeouts).
    unanswered = raw["sent"] - raw["requests"]
    stalled = raw["requests"] == 0 or not server.answers(timeout=30)
    lat = raw["latency_us"]
    result = {
        "method": phase.method,
        "path": phase.path,
        "seconds": round(seconds, 2),
        "concurrency": args.concurrency,
        "paced_rate": phase.rate,
        "requests": raw["requests"],
        "rps": round(codes.get(phase.expect, 0) / seconds, 1),
        "p50_ms": round(lat["p50"] / 1000, 2),
        "p90_ms": round(lat["p90"] / 1000, 2),
        "p99_ms": round(lat["p99"] / 1000, 2),
        "max_ms": round(lat["max"] / 1000, 2),
        "mean_ms": round(lat["mean"] / 1000, 2),
        "errors": unexpected + socket_errors + (unanswered if stalled else 0),
        "server_cpu_ms_per_request": round(1000 * (usage["server_cpu_s"] or 0.0) / raw["requests"], 2)
        if usage and raw["requests"]
        else None,
        "codes": {str(k): v for k, v in sorted(codes.items())},
        "unanswered_at_end": unanswered,
        "server_stalled": stalled,
        "socket_errors": raw["socket_errors"],
        "cpu": usage,
        "loadavg_1m_at_start": round(load, 2),
    }

    def cpu_of(key: str) -> str:
        value = usage.get(key) if usage else None
        return "-" if value is None else f"{value:.0f}"

    problems = server.new_log_problems()
    if problems:
        result["server_log_errors"] = len(problems)
        result["server_log_first_error"] = problems[0][:300]
    print(
        f"  {phase.name:<22} {result['rps']:>8.1f} req/s  p50 {result['p50_ms']:>7.2f} ms  "
        f"p99 {result['p99_ms']:>7.2f} ms  errors {result['errors']:<4}{' STALLED' if stalled else ''} "
        f"server {result['server_cpu_ms_per_request'] or '-'} ms cpu/req  "
        f"cpu% server {cpu_of('server_pct')} disp {cpu_of('dispatcher_pct')} pg {cpu_of('postgres_pct')} "
        f"wrk {cpu_of('wrk_pct')} "
        f"machine {cpu_of('machine_busy_pct')}  load {load:.1f}",
        flush=True,
    )
    return result


# --- jobs --------------------------------------------------------------------------------------------------


def create_jobs(url: str, bodies: list[dict[str, Any]]) -> list[str]:
    with httpx.Client(base_url=url, timeout=60) as client:

        def one(body: dict[str, Any]) -> str:
            response = client.post("/jobs", json=body)
            if response.status_code != 201:
                raise RuntimeError(f"POST /jobs answered {response.status_code}: {response.text}")
            return str(response.json()["id"])

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, bodies))


def wait_until(check: Any, what: str, timeout: float = 300.0) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - started


def count_jobs(engine: Engine, *where: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(JOBS).where(*where)).scalar_one())


def dispatcher_idle(engine: Engine) -> bool:
    """No job waits for the dispatcher: nothing queued, nothing starting but not yet launched."""
    c = JOBS.c
    waiting = (c.status == "queued") | ((c.status == "starting") & c.launched_at.is_(None))
    return count_jobs(engine, waiting) == 0


def bulk_insert(engine: Engine, template_id: str, count: int) -> float:
    """Insert `count` jobs shaped like `template_id` (and its metadata and events); returns seconds."""
    with engine.connect() as conn:
        job_row = dict(conn.execute(select(JOBS).where(JOBS.c.id == template_id)).mappings().one())
        seq = job_row.pop("seq")
        by_job = select(EVENTS).where(EVENTS.c.job_seq == seq).order_by(EVENTS.c.id)
        event_rows = [dict(r) for r in conn.execute(by_job).mappings()]
        by_job = select(METADATA).where(METADATA.c.job_seq == seq)
        meta_rows = [dict(r) for r in conn.execute(by_job).mappings()]
    for row in event_rows:
        row.pop("id")
    started = time.monotonic()
    base = utcnow() - timedelta(days=30)
    done = 0
    while done < count:
        n = min(INSERT_BATCH, count - done)
        rows = []
        for i in range(done, done + n):
            created = base + timedelta(seconds=i * 2)
            name = f"bulk-{i}"
            rows.append(
                {
                    **job_row,
                    "id": new_job_id(),
                    "name": name,
                    "spec": {**job_row["spec"], "name": name},
                    "created_at": created,
                    "updated_at": created + timedelta(seconds=1),
                    "finished_at": created + timedelta(seconds=1) if job_row["finished_at"] else None,
                }
            )
        with engine.begin() as conn:
            returning = insert(JOBS).returning(JOBS.c.seq, sort_by_parameter_order=True)
            seqs = list(conn.execute(returning, rows).scalars())
            pairs = list(zip(seqs, rows, strict=True))
            events = [
                {**e, "job_seq": s, "created_at": r["created_at"]} for s, r in pairs for e in event_rows
            ]
            if events:
                conn.execute(insert(EVENTS), events)
            metadata = [{**m, "job_seq": s} for s in seqs for m in meta_rows]
            if metadata:
                conn.execute(insert(METADATA), metadata)
        done += n
    return time.monotonic() - started


def refresh_statistics(engine: Engine) -> None:
    """PostgreSQL: VACUUM ANALYZE the tables the bulk insert grew. Otherwise autovacuum does it during the
    next phase (measured: PostgreSQL at 113% CPU through `list first page` with 20,000 jobs and idle in
    the next one), which measures the insert, not the list. A table that grows as jobs come runs it in
    small steps."""
    if engine.dialect.name != "postgresql":
        return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in (JOBS, EVENTS, METADATA):
            conn.exec_driver_sql(f"VACUUM ANALYZE {table.name}")


def deep_cursor(engine: Engine) -> str:
    """The id of the DEEP_FROM_END-th oldest job: `after` it, a full page and more follow."""
    mine = JOBS.c.tenant == "default"
    with engine.connect() as conn:
        total = conn.execute(select(func.count()).select_from(JOBS).where(mine)).scalar_one()
        query = select(JOBS.c.id).where(mine).order_by(JOBS.c.seq.desc()).offset(total - DEEP_FROM_END)
        return str(conn.execute(query.limit(1)).scalar_one())


def setup_ingest_jobs(
    server: ApiServer, engine: Engine, dataset: Path, count: int, ids: list[str]
) -> list[tuple[str, str]]:
    """Jobs launched for real (a sleeping worker), with a token the benchmark knows, then running.

    Their ids go into `ids` as soon as they exist, so that the caller can stop them whatever happens."""
    ids.extend(create_jobs(server.url, [job_body(dataset, f"ingest-{i}") for i in range(count)]))
    launched = JOBS.c.id.in_(ids) & JOBS.c.launched_at.is_not(None)
    wait_until(lambda: count_jobs(engine, launched) == count, "the progress jobs to be launched", 120)
    pairs = []
    with engine.begin() as conn:
        for job_id in ids:
            # As tests/test_progress.py does; the dispatcher wrote the worker's hash before launch_at.
            token, token_hash = new_job_token()
            conn.execute(update(JOBS).where(JOBS.c.id == job_id).values(token_hash=token_hash))
            pairs.append((job_id, token))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for job_id, token in pairs:
            response = client.post(
                f"/jobs/{job_id}/progress",
                json={"reports": [{"kind": "status", "phase": "training", "message": "Training started."}]},
                headers={"Authorization": f"Bearer {token}"},
            )
            if response.status_code != 200 or response.json()["job_status"] != "running":
                raise RuntimeError(f"first report to {job_id}: {response.status_code} {response.text}")
    return pairs


def stop_ingest_jobs(server: ApiServer, engine: Engine, ids: list[str]) -> None:
    """Cancel the progress jobs through the API; kill what is left of their sleeping workers."""
    cancelled = JOBS.c.id.in_(ids) & (JOBS.c.status == "cancelled")
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for job_id in ids:
                client.post(f"/jobs/{job_id}/cancel")
        wait_until(lambda: count_jobs(engine, cancelled) == len(ids), "the progress jobs to be cancelled", 30)
    except Exception as exc:
        print(f"  (cancelling the progress jobs: {exc}; stopping their workers directly)", flush=True)
    # Each run is a process group led by its runner, recorded on the job (see api/executors/local.py).
    with engine.connect() as conn:
        rows = conn.execute(select(JOBS.c.id, JOBS.c.launch).where(JOBS.c.id.in_(ids))).all()
    for job_id, launch in rows:
        pgid = int((launch or {}).get("pgid") or 0)
        try:
            mine = pgid > 0 and job_id in Path(f"/proc/{pgid}/cmdline").read_text()
        except OSError:
            mine = False  # already gone
        if mine:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def settled_count(engine: Engine, ids: list[str]) -> int:
    """The metrics events of `ids` once requests still in the server (wrk left them) are done."""
    last, stable_since = -1, time.monotonic()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = count_metrics_events(engine, ids)
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > 1.0:
            break
        time.sleep(0.2)
    return last


def count_metrics_events(engine: Engine, ids: list[str]) -> int:
    with engine.connect() as conn:
        seqs = list(conn.execute(select(JOBS.c.seq).where(JOBS.c.id.in_(ids))).scalars())
        query = select(func.count()).select_from(EVENTS)
        query = query.where(EVENTS.c.job_seq.in_(seqs), EVENTS.c.type == "metrics")
        return int(conn.execute(query).scalar_one())


# --- one database ------------------------------------------------------------------------------------------


def run_database(kind: str, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    workdir = base / kind
    workdir.mkdir()
    pg = None
    postmaster: int | None = None
    database_url = None
    if kind == "postgres":
        from tests.support.postgres import PostgresServer, find_pg_bindir

        pg = PostgresServer(find_pg_bindir(), database="tputune_bench")
        pg.start()
        database_url = pg.url
        postmaster = int((pg.data_dir / "postmaster.pid").read_text().split()[0])
    server = ApiServer(workdir, database_url, args.source, args.workers)
    engine = make_engine(server.database_url)
    phases: dict[str, Any] = {}
    result: dict[str, Any] = {"database": kind, "phases": phases}
    ingest_ids: list[str] = []
    try:
        print(f"\n== {kind} ==", flush=True)
        server.start()
        result["server"] = server.loop_setup()
        cpu = CpuWatch(server.pid, postmaster)
        datasets = server.data_dir / "datasets"
        datasets.mkdir(parents=True, exist_ok=True)
        real = datasets / "train.txt"
        real.write_text("Once upon a time.\n<|endoftext|>\nThe end.\n")
        missing = datasets / "does-not-exist.txt"

        # 1,000 jobs through the API: the progress jobs, then the rest (failed by the dispatcher).
        started = time.monotonic()
        ingest = setup_ingest_jobs(server, engine, real, args.ingest_jobs, ingest_ids)
        rest = create_jobs(
            server.url, [job_body(missing, f"setup-{i}") for i in range(SMALL_JOBS - len(ingest))]
        )
        wait_until(lambda: dispatcher_idle(engine), "the dispatcher to fail the setup jobs")
        result["setup"] = {"jobs_via_api": SMALL_JOBS, "seconds": round(time.monotonic() - started, 1)}
        print(f"  setup: {SMALL_JOBS} jobs via the API in {result['setup']['seconds']} s", flush=True)

        phases["healthz"] = measure(server, Phase("healthz", "GET", "/healthz", 200), args, workdir, cpu)
        deep = deep_cursor(engine)
        phases["list_first_1k"] = measure(
            server, Phase("list first page, 1k", "GET", "/jobs?limit=50", 200), args, workdir, cpu
        )
        phases["list_deep_1k"] = measure(
            server,
            Phase("list deep cursor, 1k", "GET", f"/jobs?limit=50&after={deep}", 200),
            args,
            workdir,
            cpu,
        )

        extra = args.jobs_large - SMALL_JOBS
        took = bulk_insert(engine, rest[0], extra)
        refresh_statistics(engine)
        stored = count_jobs(engine)
        result["bulk_insert"] = {
            "jobs": extra,
            "seconds": round(took, 1),
            "jobs_per_s": round(extra / took),
            "jobs_stored": stored,
        }
        print(
            f"  bulk insert: {extra} jobs (+ their events, metadata) in {took:.1f} s; {stored} stored",
            flush=True,
        )
        deep = deep_cursor(engine)
        large = f"{args.jobs_large // 1000}k"
        phases["list_first_large"] = measure(
            server, Phase(f"list first page, {large}", "GET", "/jobs?limit=50", 200), args, workdir, cpu
        )
        phases["list_deep_large"] = measure(
            server,
            Phase(f"list deep cursor, {large}", "GET", f"/jobs?limit=50&after={deep}", 200),
            args,
            workdir,
            cpu,
        )

        # The ceiling again, just before and just after GET: the machine's speed drifts by a third over
        # minutes (a shared VM), and the first healthz phase was measured minutes earlier.
        healthz = Phase("healthz, before GET", "GET", "/healthz", 200)
        phases["healthz_before_get"] = measure(server, healthz, args, workdir, cpu)
        get_phase = Phase("GET /jobs/{id}", "GET", f"/jobs/{ingest_ids[0]}", 200)
        phases["get_job"] = measure(server, get_phase, args, workdir, cpu)
        healthz.name = "healthz, after GET"
        phases["healthz_after_get"] = measure(server, healthz, args, workdir, cpu)
        if args.paced_fraction and phases["get_job"]["rps"]:
            get_phase.name += " paced"
            get_phase.rate = args.paced_fraction * phases["get_job"]["rps"]
            phases["get_job_paced"] = measure(server, get_phase, args, workdir, cpu)

        before = count_metrics_events(engine, ingest_ids)
        # warm-up and measured runs each start their steps far above the previous run's.
        url = server.url + "/jobs"
        warmup = ingest_script(ingest, args.batch, WARMUP_STEP)
        run_wrk(url, warmup, args.warmup, args.concurrency, workdir)
        after_warmup = settled_count(engine, ingest_ids)
        server.new_log_problems()
        measured = ingest_script(ingest, args.batch, MEASURED_STEP)
        phase = Phase("progress ingest", "POST", "/jobs/{id}/progress", 200, measured)
        ingest_result = measure(server, phase, args, workdir, cpu, url=url, warmup=False)
        stored_reports = settled_count(engine, ingest_ids) - after_warmup
        ingest_result.update(
            {
                "batch": args.batch,
                "jobs": args.ingest_jobs,
                "batches_per_s": ingest_result["rps"],
                "reports_per_s": round(ingest_result["rps"] * args.batch, 1),
                # Acknowledged batches must all be stored; a few more may be (in flight when wrk stopped).
                "reports_stored": stored_reports,
                "reports_acknowledged": ingest_result["codes"].get("200", 0) * args.batch,
                "warmup_reports_stored": after_warmup - before,
            }
        )
        print(
            f"  {'':<22} = {ingest_result['reports_per_s']:.0f} reports/s in batches of {args.batch}; "
            f"{ingest_result['reports_acknowledged']} acknowledged, {stored_reports} stored",
            flush=True,
        )
        phases["progress_ingest"] = ingest_result

        body = json.dumps(job_body(missing, "bench"))
        before_jobs = count_jobs(engine)
        post_phase = Phase("POST /jobs", "POST", "/jobs", 201, f"BODY = {lua_string(body)}\n" + LUA_POST)
        phases["post_job"] = measure(server, post_phase, args, workdir, cpu)
        drained = wait_until(lambda: dispatcher_idle(engine), "the dispatcher to fail the created jobs", 600)
        created = count_jobs(engine) - before_jobs
        phases["post_job"]["jobs_stored"] = created
        phases["post_job"]["dispatcher_drain_seconds_after"] = round(drained, 1)
        print(
            f"  {'':<22} {created} jobs stored (warm-up included); dispatcher done with them "
            f"{drained:.1f} s after the phase",
            flush=True,
        )
        if args.paced_fraction and phases["post_job"]["rps"]:
            post_phase.name += " paced"
            post_phase.rate = args.paced_fraction * phases["post_job"]["rps"]
            phases["post_job_paced"] = measure(server, post_phase, args, workdir, cpu)
            wait_until(lambda: dispatcher_idle(engine), "the dispatcher to fail the created jobs", 600)
        result["targets"] = targets(phases)
    except Exception as exc:  # keep the figures measured so far; say what broke
        result["failed"] = f"{type(exc).__name__}: {exc}"
        print(f"  FAILED: {result['failed']}", file=sys.stderr, flush=True)
        print(f"  server log tail:\n{server.log_tail(15)}", file=sys.stderr, flush=True)
    finally:
        if ingest_ids and server.proc is not None:
            stop_ingest_jobs(server, engine, ingest_ids)
        engine.dispose()
        server.stop()
        if pg is not None:
            pg.close()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return result


def targets(phases: dict[str, Any]) -> dict[str, Any]:
    """The brief's targets, each {value, target, met}; `info` entries explain and are not targets."""
    healthz, get, post = phases["healthz"], phases["get_job"], phases["post_job"]
    ingest = phases["progress_ingest"]
    around = [phases[k]["rps"] for k in ("healthz_before_get", "healthz_after_get") if k in phases]
    ceiling = sum(around) / len(around) if around else healthz["rps"]

    def answered(phase: dict[str, Any]) -> bool:
        return bool(phase["requests"]) and not phase["server_stalled"]

    checks: dict[str, Any] = {}
    ratio = get["rps"] / ceiling if ceiling else 0.0
    checks["get_vs_healthz"] = {
        "value": round(ratio, 3),
        "ceiling_rps": round(ceiling, 1),
        "ceiling": "mean of healthz just before and just after GET /jobs/{id}",
        "target": f">= {TARGET_GET_VS_HEALTHZ}",
        "met": ratio >= TARGET_GET_VS_HEALTHZ,
    }
    for name, phase in (("get", get), ("post", post)):
        checks[f"{name}_p99_ms"] = {
            "value": phase["p99_ms"],
            "target": f"<= {TARGET_P99_MS:g} at {phase['concurrency']} clients flat out",
            "met": answered(phase) and phase["p99_ms"] <= TARGET_P99_MS,
        }
    errors = sum(p["errors"] for p in phases.values())
    stalled = [name for name, p in phases.items() if not answered(p)]
    checks["errors_all_phases"] = {
        "value": errors,
        "stalled_phases": stalled,
        "target": "== 0, no phase stalled",
        "met": errors == 0 and not stalled,
    }
    checks["ingest_reports_per_s"] = {
        "value": ingest["reports_per_s"],
        "target": f">= {TARGET_REPORTS_PER_S:.0f}",
        "met": ingest["reports_per_s"] >= TARGET_REPORTS_PER_S,
    }
    checks["ingest_all_stored"] = {
        "value": ingest["reports_stored"] >= ingest["reports_acknowledged"] > 0,
        "target": "stored >= acknowledged > 0",
        "met": ingest["reports_stored"] >= ingest["reports_acknowledged"] > 0,
    }
    for which in ("first", "deep"):
        small, large = phases[f"list_{which}_1k"], phases[f"list_{which}_large"]
        p50 = large["p50_ms"] / small["p50_ms"] if small["p50_ms"] else float("inf")
        rps = small["rps"] / large["rps"] if large["rps"] else float("inf")
        cpu_small, cpu_large = small["server_cpu_ms_per_request"], large["server_cpu_ms_per_request"]
        value = max(p50, rps)
        checks[f"list_{which}_slowdown"] = {
            "value": round(value, 3),
            "p50_ratio": round(p50, 3),
            "rps_ratio": round(rps, 3),
            "server_cpu_per_request_ratio": round(cpu_large / cpu_small, 3)
            if cpu_small and cpu_large
            else None,
            "target": f"<= {TARGET_LIST_RATIO} (p50 and req/s, {large['path']} vs 1,000 jobs)",
            "met": answered(small) and answered(large) and value <= TARGET_LIST_RATIO,
        }
    checks["all_met"] = all(c["met"] for c in checks.values())
    info: dict[str, Any] = {}
    for name in ("get_job_paced", "post_job_paced"):
        if name in phases:
            paced = phases[name]
            info[f"{name}_p99_ms"] = {
                "value": paced["p99_ms"],
                "rps": paced["rps"],
                "note": f"{paced['concurrency']} clients paced to {paced['paced_rate']:.0f} req/s in all",
            }
    info["little_law_rps_needed_for_p99_target"] = round(healthz["concurrency"] / (TARGET_P99_MS / 1000))
    checks["info"] = info
    return checks


# --- main --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=None, help="length of each measured phase (default 20)")
    p.add_argument("--concurrency", type=int, default=64, help="wrk connections (default 64)")
    p.add_argument("--databases", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    p.add_argument("--quick", action="store_true", help="smoke check: 3 s phases, 20,000 stored jobs")
    p.add_argument("--jobs-large", type=int, default=None, help="jobs stored for the large list (100,000)")
    p.add_argument("--ingest-jobs", type=int, default=8, help="running jobs the progress load spreads over")
    p.add_argument("--batch", type=int, default=20, help="metrics reports per progress batch (default 20)")
    p.add_argument(
        "--paced-fraction",
        type=float,
        default=0.5,
        help="also run GET /jobs/{id} and POST /jobs paced at this fraction of the rate each reached "
        "flat out (the latency of a loaded but not saturated server); 0: skip (default 0.5)",
    )
    p.add_argument(
        "--source",
        type=Path,
        default=ROOT,
        help="run the server from this copy of the code (its api/, worker/ and migrations/), e.g. an older "
        "version to compare with; default: this checkout",
    )
    p.add_argument(
        "--workers", type=int, default=None, help="TPUTUNE_WORKERS of the server (default: its default)"
    )
    p.add_argument("--keep", action="store_true", help="keep the temp dirs (server logs, databases)")
    args = p.parse_args(argv)
    args.seconds = args.seconds or (3.0 if args.quick else 20.0)
    args.warmup = 1.0 if args.quick else 2.0
    args.jobs_large = args.jobs_large or (20_000 if args.quick else 100_000)
    args.databases = [d.strip() for d in args.databases.split(",") if d.strip()]
    for db in args.databases:
        if db not in ("sqlite", "postgres"):
            p.error(f"unknown database {db!r}: use sqlite, postgres")
    if args.jobs_large <= SMALL_JOBS:
        p.error(f"--jobs-large must be more than {SMALL_JOBS}")
    if not 1 <= args.ingest_jobs < SMALL_JOBS or not 1 <= args.batch <= 1000:
        p.error("--ingest-jobs must be 1..999 and --batch 1..1000")
    return args


def preflight(args: argparse.Namespace) -> None:
    if shutil.which("wrk") is None:
        sys.exit("bench/api_load.py needs wrk (the HTTP load generator): apt-get install -y wrk")
    if "postgres" in args.databases:
        from tests.support.postgres import PostgresNotAvailable, find_pg_bindir

        try:
            find_pg_bindir()
        except PostgresNotAvailable as exc:
            sys.exit(
                f"PostgreSQL server binaries not found ({exc}): apt-get install -y postgresql, "
                "or run with --databases sqlite"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preflight(args)
    print(
        f"tputune API load: {args.seconds:g} s phases, {args.concurrency} connections (wrk, 1 thread), "
        f"{args.jobs_large} jobs for the large list, databases {','.join(args.databases)}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    report: dict[str, Any] = {
        "benchmark": "api_load",
        "config": {
            "source": str(args.source),
            "seconds": args.seconds,
            "warmup_seconds": args.warmup,
            "concurrency": args.concurrency,
            "wrk_threads": 1,
            "jobs_small": SMALL_JOBS,
            "jobs_large": args.jobs_large,
            "ingest_jobs": args.ingest_jobs,
            "batch": args.batch,
            "cpus": os.cpu_count(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "post_jobs_dataset": "a missing path under the data dir: the dispatcher fails each job "
            "(dataset_not_found), no worker starts",
            "ingest_worker": "sleeping python process (TPUTUNE_WORKER_COMMAND); token hash set in the DB",
        },
        "databases": {},
    }
    status = 0
    base = Path(tempfile.mkdtemp(prefix="tputune-bench-"))
    try:
        for kind in args.databases:
            report["databases"][kind] = run_database(kind, args, base)
            if "failed" in report["databases"][kind]:
                status = 1
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"kept {base}")
    print("\ntargets:")
    for kind, result in report["databases"].items():
        checks = result.get("targets", {})
        for name, check in checks.items():
            if isinstance(check, dict) and "met" in check:
                mark = "met" if check["met"] else "MISSED"
                print(f"  {kind:<9} {name:<22} {check['value']!s:>10} (target {check['target']}): {mark}")
        for name, item in checks.get("info", {}).items():
            print(
                f"  {kind:<9} {name:<22} {item if not isinstance(item, dict) else item['value']!s:>10} (info)"
            )
    report["all_targets_met"] = status == 0 and all(
        r.get("targets", {}).get("all_met", False) for r in report["databases"].values()
    )
    print(json.dumps(report, separators=(",", ":")))
    return status


if __name__ == "__main__":
    sys.exit(main())
