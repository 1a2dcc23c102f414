"""CPU time per request of the busiest routes, through the app in-process (no HTTP server, no client).

`api_load.py` measures the whole stack under wrk, and its figures move with the VM's speed by a third.
This one sends requests straight to the ASGI app, `--concurrency` at a time, and divides the process's CPU
time by the requests answered: a steadier figure for comparing two versions of the route code
(`--source`). What it leaves out: the HTTP server (uvicorn, httptools), the access log (off here), other
processes (the dispatcher is off; the job writer's thread is counted).

    .venv/bin/python bench/api_cpu.py                      # SQLite in a temp dir
    .venv/bin/python bench/api_cpu.py --source /tmp/old    # another checkout's api/, e.g. to compare
    .venv/bin/python bench/api_cpu.py --auth               # as a tenant's API key (keys on, rate limited)

It prints a line per route and round, and as its last line one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000, help="requests per route and round (10,000)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at once (64)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per route (3); the figure is the median")
    p.add_argument("--source", type=Path, default=ROOT, help="the checkout whose api/ to load")
    p.add_argument(
        "--auth",
        action="store_true",
        help="serve with keys (TPUTUNE_ADMIN_KEY) and call with a tenant's API key, its rate limit on but "
        "never reached: a production server's path (without it, the keyless single-user one)",
    )
    args = p.parse_args(argv)
    if args.requests < args.concurrency or args.concurrency < 1 or args.rounds < 1:
        p.error("--requests must be at least --concurrency, both and --rounds at least 1")
    return args


class Asgi:
    """Requests to an ASGI app without a server: one body, then wait (as a client that keeps the
    connection open would)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.headers: list[tuple[bytes, bytes]] = []

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        headers = [(b"host", b"bench"), *self.headers]
        if body:
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        sent = False
        status = 0
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays; never disconnects
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        path, _, query = path.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8000),
        }
        await self.app(scope, receive, send)
        return status, b"".join(chunks)


async def measure(
    client: Asgi, method: str, path: str, body: bytes, expect: int, args: argparse.Namespace
) -> dict[str, Any]:
    rounds = []
    for _ in range(args.rounds):
        collections = sum(stat["collections"] for stat in gc.get_stats())
        cpu, wall = time.process_time(), time.perf_counter()
        done = 0
        while done < args.requests:
            batch = min(args.concurrency, args.requests - done)
            answers = await asyncio.gather(*(client.request(method, path, body) for _ in range(batch)))
            bad = [a for a in answers if a[0] != expect]
            if bad:
                raise RuntimeError(f"{method} {path} answered {bad[0][0]}: {bad[0][1][:300]!r}")
            done += batch
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        rounds.append(
            {
                "cpu_ms_per_request": round(1000 * cpu / done, 4),
                "requests_per_s": round(done / wall, 1),
                "gc_collections": sum(stat["collections"] for stat in gc.get_stats()) - collections,
            }
        )
        print(
            f"  {method} {path:<24} {rounds[-1]['cpu_ms_per_request']:.3f} ms CPU/request  "
            f"{rounds[-1]['requests_per_s']:>8.0f} req/s  gc {rounds[-1]['gc_collections']}",
            flush=True,
        )
    cpus = sorted(r["cpu_ms_per_request"] for r in rounds)
    return {
        "method": method,
        "path": path,
        "median_cpu_ms_per_request": cpus[len(cpus) // 2],
        "rounds": rounds,
    }


async def run(args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    import api
    from api.main import create_app
    from api.migrate import upgrade
    from api.settings import Settings

    print(f"  api/ loaded from {Path(api.__file__).parent}", flush=True)

    settings = Settings(  # only these: no TPUTUNE_* variable or .env file of the caller's
        _env_file=None,  # type: ignore[call-arg]
        data_dir=data_dir / "state",
        dispatcher_enabled=False,
        access_log=False,
        **(
            {"admin_key": ADMIN_KEY, "rate_limit_per_second": 1e9, "rate_limit_burst": 10**9}
            if args.auth
            else {}
        ),
    )
    settings.ensure_dirs()
    upgrade(settings.resolved_database_url)
    app = create_app(settings)
    client = Asgi(app)
    datasets = settings.data_dir / "datasets"
    datasets.mkdir(parents=True, exist_ok=True)
    (datasets / "train.txt").write_text("Once upon a time.\n")
    body = json.dumps(job_body(datasets / "train.txt")).encode()
    results = {}
    # A page of 50 jobs is ~50 times a GET's work: a tenth of the requests.
    list_args = argparse.Namespace(**{**vars(args), "requests": max(args.concurrency, args.requests // 10)})
    async with app.router.lifespan_context(app):
        if args.auth:
            client.headers = [(b"authorization", f"Bearer {ADMIN_KEY}".encode())]
            status, created = await client.request("POST", "/admin/keys", b'{"tenant": "t", "name": "bench"}')
            if status != 201:
                raise RuntimeError(f"POST /admin/keys answered {status}: {created[:300]!r}")
            client.headers = [(b"authorization", f"Bearer {json.loads(created)['key']}".encode())]
        ids = []
        for _ in range(LIST_JOBS):  # a full page for GET /jobs, and more
            status, created = await client.request("POST", "/jobs", body)
            if status != 201:
                raise RuntimeError(f"POST /jobs answered {status}: {created[:300]!r}")
            ids.append(json.loads(created)["id"])
        job_id, deep = ids[0], ids[-1]  # `after` the newest, a full page of older jobs
        running = ids[1]  # as the dispatcher and its first report leave it: it holds its chips
        with app.state.engine.begin() as connection:
            connection.exec_driver_sql(
                "UPDATE jobs SET status = 'running', started_at = created_at, launched_at = created_at, "
                "admitted_at = created_at WHERE id = ?",
                (running,),
            )
        gc.collect()
        gc.freeze()  # as `tputune serve` does (api.server)
        results["healthz"] = await measure(client, "GET", "/healthz", b"", 200, args)
        results["get_job"] = await measure(client, "GET", f"/jobs/{job_id}", b"", 200, args)
        # Its `usage` grows with the clock: its figures are written anew every USAGE_MAX_AGE (0.1 s).
        results["get_running_job"] = await measure(client, "GET", f"/jobs/{running}", b"", 200, args)
        results["list_jobs"] = await measure(client, "GET", "/jobs?limit=50", b"", 200, list_args)
        after = f"/jobs?limit=50&after={deep}"
        results["list_after"] = await measure(client, "GET", after, b"", 200, list_args)
        results["post_job"] = await measure(client, "POST", "/jobs", body, 201, args)
    return results


LIST_JOBS = 61
ADMIN_KEY = "bench-admin-key-0123456789"


def job_body(dataset: Path, name: str = "bench") -> dict[str, Any]:
    """The body both benchmarks POST to /jobs (here, not in api_load.py: importing that one would import
    this checkout's api/, whatever --source says)."""
    hyperparameters = {"epochs": 1, "batch_size": 8, "learning_rate": 1e-4, "max_seq_len": 512}
    hyperparameters.update(eval_every_steps=50, checkpoint_every_steps=100)
    return {
        "name": name,
        "model": "gemma3-270m-pt",
        "method": {"type": "lora", "lora_rank": 8},
        "dataset_uri": str(dataset),
        "validation_split": 0.02,
        "hyperparameters": hyperparameters,
        "metadata": {"team": "bench"},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(args.source.resolve()))  # ahead of the installed (editable) project
    for name in [name for name in os.environ if name.startswith("TPUTUNE_")]:
        del os.environ[name]
    print(
        f"tputune API CPU per request, in-process: {args.requests} requests per round, {args.concurrency} at "
        f"a time, {args.rounds} rounds; api/ from {args.source}" + ("; with an API key" if args.auth else ""),
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="tputune-api-cpu-") as tmp:
        results = asyncio.run(run(args, Path(tmp)))
    summary = {name: r["median_cpu_ms_per_request"] for name, r in results.items()}
    print("median CPU ms per request: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    print(
        json.dumps(
            {
                "benchmark": "api_cpu",
                "source": str(args.source),
                "auth": args.auth,
                "median_cpu_ms": summary,
                "routes": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
