"""What clients following a job's events cost the API while nothing happens (a dashboard left open).

`--followers` clients follow `GET /jobs/{id}/events?follow=true` of `--jobs` queued jobs (the dispatcher
is off, so nothing changes); the API looks for new events of the followed jobs twice a second (each
stream for itself before api.streams.EventWatch, one statement for all since). After they are all in, the
script measures for `--seconds` the CPU the API process (and PostgreSQL's, with `--database postgres`)
uses, and how long a plain `GET /jobs/{id}/events` takes meanwhile. Last line: one JSON object.

    .venv/bin/python bench/api_followers.py                         # 200 followers, SQLite
    .venv/bin/python bench/api_followers.py --database postgres --followers 1000 --jobs 1000
    .venv/bin/python bench/api_followers.py --source /tmp/old       # another checkout's api/, to compare
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_load import ROOT, ApiServer, CpuWatch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--followers", type=int, default=200, help="clients following the job's events (200)")
    p.add_argument("--jobs", type=int, default=1, help="jobs the followers follow, round robin (1)")
    p.add_argument("--seconds", type=float, default=10.0, help="how long to measure once all follow (10)")
    p.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--source", type=Path, default=ROOT, help="run the server from this checkout")
    p.add_argument(
        "--active",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the jobs run (a fake worker, tests/fake_worker.py) and report a step every SECONDS",
    )
    return p.parse_args(argv)


async def follow(url: str, job_id: str, started: list[int], refused: list[int], events: list[int]) -> None:
    async with (
        httpx.AsyncClient(base_url=url, timeout=None) as http,
        http.stream("GET", f"/jobs/{job_id}/events", params={"follow": "true"}) as response,
    ):
        if response.status_code != 200:  # (429 past TPUTUNE_MAX_EVENT_FOLLOWERS)
            refused.append(response.status_code)
            started.append(0)
            return
        lines = response.aiter_lines()
        await lines.__anext__()  # the job's first event: the stream is up
        started.append(1)
        async for line in lines:
            if line.startswith("id: "):
                events.append(1)


async def measure(args: argparse.Namespace, server: ApiServer, postmaster: int | None) -> dict[str, Any]:
    dataset = server.data_dir / "train.txt"
    dataset.write_text("Once upon a time.\n")
    body: dict[str, Any] = {"name": "followed", "model": "gemma3-270m-pt", "dataset_uri": str(dataset)}
    if args.active:
        body["metadata"] = {"fake": "succeed", "steps": "100000000", "interval": str(args.active)}
    job_ids = []
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        for _ in range(args.jobs):
            created = await http.post("/jobs", json=body)
            created.raise_for_status()
            job_ids.append(created.json()["id"])
        while args.active:  # until they all run
            statuses = [(await http.get(f"/jobs/{job_id}")).json()["status"] for job_id in job_ids]
            if all(status == "running" for status in statuses):
                break
            if any(status not in ("queued", "starting") for status in statuses):
                raise RuntimeError(f"a job did not run: {statuses}")
            await asyncio.sleep(0.2)
    job_id = job_ids[0]
    started: list[int] = []
    refused: list[int] = []
    events: list[int] = []
    tasks = [
        asyncio.create_task(follow(server.url, job_ids[i % args.jobs], started, refused, events))
        for i in range(args.followers)
    ]
    try:
        deadline = time.monotonic() + 60
        while len(started) < args.followers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(started)} of {args.followers} followers got their stream")
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)
        cpu = CpuWatch(server.pid, postmaster)
        cpu.start()
        t0, events0 = time.monotonic(), len(events)
        await asyncio.sleep(args.seconds)
        used, t1, events1 = cpu.stop(), time.monotonic(), len(events)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            took = []
            for _ in range(20):
                begun = time.perf_counter()
                (await http.get(f"/jobs/{job_id}/events")).raise_for_status()
                took.append(time.perf_counter() - begun)
        took.sort()
        return {
            "followers": args.followers - len(refused),
            "jobs": args.jobs,
            "refused": len(refused),
            "api_cpu_pct": used["server_pct"],
            "postgres_cpu_pct": used["postgres_pct"],
            "get_events_p50_ms": round(1000 * took[len(took) // 2], 2),
            "events_per_second": round((events1 - events0) / (t1 - t0), 1),  # (received, all followers)
        }
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tputune-followers-") as tmp:
        pg = None
        postmaster = None
        database_url = None
        if args.database == "postgres":
            from tests.support.postgres import PostgresServer, find_pg_bindir

            pg = PostgresServer(find_pg_bindir(), database="tputune_bench")
            pg.start()
            database_url = pg.url
            postmaster = int((pg.data_dir / "postmaster.pid").read_text().split()[0])
        env = {"TPUTUNE_DISPATCHER_ENABLED": "false"}
        if args.active:
            worker = f"{sys.executable} {ROOT / 'tests' / 'fake_worker.py'}"
            env = {"TPUTUNE_WORKER_COMMAND": worker, "TPUTUNE_TENANT_MAX_ACTIVE_JOBS": str(args.jobs)}
        server = ApiServer(Path(tmp), database_url, args.source, env=env)
        try:
            server.start()
            result = asyncio.run(measure(args, server, postmaster))
        finally:
            server.stop()
            if args.active:  # (a local run outlives its server, by design: the fake workers go too)
                from tests.conftest import kill_runs

                kill_runs(server.data_dir / "jobs")
            if pg is not None:
                pg.close()
    pg_part = f", PostgreSQL {result['postgres_cpu_pct']}%" if postmaster is not None else ""
    refused = f" ({result['refused']} more refused)" if result["refused"] else ""
    print(
        f"{result['followers']} {'active' if args.active else 'idle'} followers{refused} of {args.jobs} jobs "
        f"({args.database}, api/ of "
        f"{args.source}): API process {result['api_cpu_pct']}% of a core{pg_part}; "
        f"GET /jobs/{{id}}/events p50 {result['get_events_p50_ms']} ms meanwhile; "
        f"{result['events_per_second']} events/s received"
    )
    print(json.dumps({"benchmark": "api_followers", "database": args.database, **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
