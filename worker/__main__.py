"""`python -m worker --config job.json`: run one fine-tuning job (a `WorkerConfig`), then exit with its code.

Reports go to `TPUTUNE_API_URL` when set (process 0 only) and always to stdout as JSON lines; logs go to
stderr. Several processes form one job through `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
`JAX_PROCESS_ID` (or by themselves on a multi-host TPU slice).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from worker.config import WorkerConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the WorkerConfig JSON file")
    parser.add_argument("--param-dtype", default="float32", help="dtype of the trained params and optimizer")
    parser.add_argument(
        "--compute-dtype",
        default="auto",
        help="dtype of the forward and backward pass (auto: bfloat16 on TPU/GPU, float32 on CPU)",
    )
    parser.add_argument("--sample-tokens", type=int, default=48, help="tokens generated per sample prompt")
    parser.add_argument(
        "--data-shards", type=int, default=None, help="data shards of the job (default: one per process)"
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="cache for downloaded and converted files"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it touches at INFO
    config = WorkerConfig.model_validate_json(args.config.read_bytes())

    # JAX is imported only now: the distributed setup must come before anything touches a device.
    import jax

    from worker import train
    from worker.report import Reporter

    train.init_distributed()
    reporter = Reporter.from_env(config.job_id, enabled=jax.process_index() == 0)
    logging.getLogger(__name__).info(
        "job %s: process %d of %d, %d devices",
        config.job_id,
        jax.process_index(),
        jax.process_count(),
        jax.device_count(),
    )
    options = train.RunOptions(
        param_dtype=args.param_dtype,
        compute_dtype=args.compute_dtype,
        sample_tokens=args.sample_tokens,
        data_shards=args.data_shards,
        cache_dir=args.cache_dir,
    )
    try:
        return train.run(config, reporter, options)
    finally:
        reporter.close()


if __name__ == "__main__":
    sys.exit(main())
