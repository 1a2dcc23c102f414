"""What sharing API keys' use of their limits between replicas costs (api.usage): one pass's time.

Two replicas' state (each a data dir's mapped buckets and streams table, as `tputune serve` keeps them)
over one database; `--keys` keys spend a token on each replica before each of its passes (every key's row
is written, and read by the other), then the passes run with nothing new (the cost of a quiet second: the
other replica's rows read, the revoked keys counted). Wall time of a pass (the database's share in it);
a server makes one every TPUTUNE_USAGE_SYNC_SECONDS (1 s). Last line: one JSON object.

    .venv/bin/python bench/usage_sync.py                      # SQLite and PostgreSQL, 10 and 1,000 keys
    .venv/bin/python bench/usage_sync.py --databases sqlite --keys 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from api.auth import SharedBuckets  # noqa: E402
from api.db import make_engine  # noqa: E402
from api.migrate import upgrade  # noqa: E402
from api.streams import SharedKeyStreams  # noqa: E402
from api.usage import UsageSync  # noqa: E402
from bench.databases import Databases  # noqa: E402

PASSES = 20
RATE, BURST = 1000.0, 1e9  # (never refused: every take is spent)


def measure(url: str, keys: int, workdir: Path) -> dict[str, float]:
    upgrade(url)
    engine = make_engine(url, 2)
    replicas = []
    for name in ("a", "b"):
        buckets = SharedBuckets(workdir / f"{name}.buckets", reset=True)
        streams = SharedKeyStreams(workdir / f"{name}.streams", rows=4096, reset=True)
        replicas.append((buckets, UsageSync(engine, buckets, streams, RATE, BURST, replica=name)))
    busy, quiet = [], []
    for _ in range(PASSES):
        for buckets, sync in replicas:
            for key in range(keys):
                buckets.take(f"key_{key}", RATE, BURST)
            started = time.perf_counter()
            sync.sync()
            busy.append(time.perf_counter() - started)
    for _ in range(PASSES):
        for _, sync in replicas:
            started = time.perf_counter()
            sync.sync()
            quiet.append(time.perf_counter() - started)
    engine.dispose()
    return {
        "busy_pass_ms": round(statistics.median(busy[4:]) * 1000, 2),  # (after the rows exist)
        "quiet_pass_ms": round(statistics.median(quiet) * 1000, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--databases", default="sqlite,postgres", help="comma-separated (sqlite,postgres)")
    p.add_argument("--keys", default="10,1000", help="comma-separated numbers of keys (10,1000)")
    args = p.parse_args(argv)
    figures: list[dict[str, Any]] = []
    databases = Databases()
    try:
        for database in args.databases.split(","):
            for keys in map(int, args.keys.split(",")):
                url, workdir = databases.new(database, "tputune-usage-")
                row = {"database": database, "keys": keys, **measure(url, keys, workdir)}
                print(
                    f"{database:8} {keys:6} keys: a pass {row['busy_pass_ms']:6.2f} ms with every key's row "
                    f"written, {row['quiet_pass_ms']:6.2f} ms with nothing new",
                    flush=True,
                )
                figures.append(row)
    finally:
        databases.close()
    print(json.dumps({"passes": figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
