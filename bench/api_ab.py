"""A/B of API builds under load: one phase of bench/api_load.py (POST /jobs, GET /jobs/{id}, workers'
progress reports or healthz) against `tputune serve` run from each build in turn, round after round.

    .venv/bin/python bench/api_ab.py --build new=. --build old=/tmp/old            # POST /jobs, SQLite
    .venv/bin/python bench/api_ab.py --build new=. --build old=/tmp/old --path get --database postgres
    .venv/bin/python bench/api_ab.py --build new=. --build old=/tmp/old --path progress  # 8 jobs, 20 a batch
    .venv/bin/python bench/api_ab.py --build on=. --build off=. --env off:TPUTUNE_DISPATCHER_ENABLED=false

A build is a directory holding api/, worker/ and migrations/ (`.`: this checkout; an older one:
`git worktree add /tmp/old <commit>`). The machine's speed drifts by a third over minutes, so the builds
take turns, and what counts is how they compare within a round. Per run: req/s, p50/p99/max latency,
answers by status, CPU of the API process's busiest threads (% of a core, /proc), of the dispatcher
process, and (SQLite) the jobs still queued when wrk stopped, i.e. how far the dispatcher is behind. Each
run has a fresh server and database (1,000 jobs for GET, 8 running ones for progress, none for the
others), a 2 s warm-up and the same wrk as api_load.py. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from api.db import make_engine  # noqa: E402
from bench.api_cpu import job_body  # noqa: E402
from bench.api_load import (  # noqa: E402
    LUA_POST,
    MEASURED_STEP,
    WARMUP_STEP,
    ApiServer,
    create_jobs,
    ingest_script,
    lua_string,
    proc_cpu_seconds,
    run_wrk,
    setup_ingest_jobs,
    stop_ingest_jobs,
)
from tests.support.serve import api_workers, dispatchers  # noqa: E402


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid`, by "name:tid" (the name is the process's: Python does not
    name its threads for the OS; the event loop's thread is the main one, tid = pid)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def one_run(
    label: str, source: Path, env: dict[str, str], args: argparse.Namespace, pg_url: str | None
) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"api-ab-{label}-"))
    server = ApiServer(workdir, pg_url, source, args.workers, env)
    engine = None
    ingest_ids: list[str] = []
    try:
        server.start()
        datasets = server.data_dir / "datasets"
        datasets.mkdir(parents=True, exist_ok=True)
        missing = datasets / "does-not-exist.txt"  # as api_load.py: the dispatcher fails each job
        script, path, expect = "", "/healthz", 200
        warmup = script
        if args.path == "post":
            script = warmup = f"BODY = {lua_string(json.dumps(job_body(missing, 'ab')))}\n" + LUA_POST
            path, expect = "/jobs", 201
        elif args.path == "get":
            ids = create_jobs(server.url, [job_body(missing, f"g{i}") for i in range(1000)])
            path = f"/jobs/{ids[0]}"
        elif args.path == "progress":  # as api_load.py's ingest phase: 8 running jobs, batches of 20
            real = datasets / "train.txt"
            real.write_text("Once upon a time.\n<|endoftext|>\nThe end.\n")
            engine = make_engine(server.database_url)
            ingest = setup_ingest_jobs(server, engine, real, 8, ingest_ids)
            warmup = ingest_script(ingest, 20, WARMUP_STEP)
            script = ingest_script(ingest, 20, MEASURED_STEP)
            path = "/jobs"
        run_wrk(server.url + path, warmup, 2, args.concurrency, workdir)  # warm-up
        server.settle()
        serving = api_workers(server.pid) or [server.pid]
        before = {pid: thread_cpu(pid) for pid in serving}
        dispatcher_before = sum(map(proc_cpu_seconds, dispatchers(server.pid)))
        started = time.monotonic()
        raw, _ = run_wrk(server.url + path, script, args.seconds, args.concurrency, workdir)
        wall = time.monotonic() - started
        after = {pid: thread_cpu(pid) for pid in serving}
        dispatcher_pct = (
            100 * (sum(map(proc_cpu_seconds, dispatchers(server.pid))) - dispatcher_before) / wall
        )
        queued = None
        if pg_url is None and args.path == "post":
            with sqlite3.connect(server.data_dir / "tputune.db") as db:
                queued = db.execute("SELECT count(*) FROM jobs WHERE status = 'queued'").fetchone()[0]
        threads = {}
        for pid in serving:
            for name, cpu in after[pid].items():
                pct = 100 * (cpu - before[pid].get(name, 0.0)) / wall
                if pct >= 2:
                    threads[f"{pid}/{name}"] = round(pct)
        seconds = raw["duration_us"] / 1e6
        latency = raw["latency_us"]
        return {
            "build": label,
            "rps": round(raw["codes"].get(str(expect), 0) / seconds, 1),
            "p50_ms": round(latency["p50"] / 1000, 1),
            "p99_ms": round(latency["p99"] / 1000, 1),
            "max_ms": round(latency["max"] / 1000, 1),
            "codes": raw["codes"],
            "api_threads_pct": threads,
            "dispatcher_pct": round(dispatcher_pct),
            "queued_at_end": queued,
        }
    finally:
        if engine is not None:
            if ingest_ids and server.proc is not None:
                stop_ingest_jobs(server, engine, ingest_ids)
            engine.dispose()
        server.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--build", action="append", required=True, metavar="LABEL=DIR", help="a build (one or more)"
    )
    p.add_argument(
        "--env", action="append", default=[], metavar="LABEL:NAME=VALUE", help="a setting of one build"
    )
    p.add_argument("--path", choices=["post", "get", "progress", "healthz"], default="post")
    p.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--seconds", type=float, default=10.0, help="each run (10)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each build, in turns (3)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workers", type=int, default=None, help="TPUTUNE_WORKERS for every build")
    p.add_argument("--keep", action="store_true", help="keep each run's temp dir (server log, database)")
    args = p.parse_args(argv)
    args.builds = {}
    for item in args.build:
        label, _, directory = item.partition("=")
        if not label or not (Path(directory) / "api").is_dir():
            p.error(f"--build {item}: LABEL=DIR, with DIR holding api/, worker/ and migrations/")
        args.builds[label] = Path(directory).resolve()
    args.envs = {label: {} for label in args.builds}
    for item in args.env:
        label, _, setting = item.partition(":")
        name, _, value = setting.partition("=")
        if label not in args.builds or not name.startswith("TPUTUNE_"):
            p.error(f"--env {item}: LABEL:TPUTUNE_NAME=VALUE, LABEL one of the builds")
        args.envs[label][name] = value
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is needed: apt-get install -y wrk", file=sys.stderr)
        return 1
    pg = None
    if args.database == "postgres":
        from tests.support.postgres import PostgresServer, find_pg_bindir

        pg = PostgresServer(find_pg_bindir(), database="tputune_ab")
        pg.start()
    runs = []
    try:
        for round_ in range(args.rounds):
            for label, source in args.builds.items():
                url = None
                if pg is not None:  # a new database for each run, as SQLite gets a new file
                    name = f"ab_{round_}_{len(runs)}"
                    pg.create_database(name)
                    url = pg.url_for(name)
                run = one_run(label, source, args.envs[label], args, url)
                run["round"] = round_
                runs.append(run)
                busiest = sorted(run["api_threads_pct"].items(), key=lambda item: -item[1])
                threads = " ".join(f"{name.split('/')[1]}={pct}" for name, pct in busiest)
                queued = "" if run["queued_at_end"] is None else f" queued at end {run['queued_at_end']}"
                print(
                    f"round {round_} {label:<12} {run['rps']:>8.0f} req/s  p50 {run['p50_ms']:>6.1f}  "
                    f"p99 {run['p99_ms']:>6.1f}  max {run['max_ms']:>6.1f} ms  codes {run['codes']}  "
                    f"cpu% {threads} dispatcher={run['dispatcher_pct']}{queued}",
                    flush=True,
                )
    finally:
        if pg is not None:
            pg.close()
    print(json.dumps({"benchmark": "api_ab", "path": args.path, "database": args.database, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
