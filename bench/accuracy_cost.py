"""What counting token accuracy costs a train step: the argmax over the vocabulary next to the loss.

    .venv/bin/python bench/accuracy_cost.py            # Gemma 3's 262,144-token vocabulary, ~1 min
    .venv/bin/python bench/accuracy_cost.py --vocab 1000

The tiny Gemma 3 architecture (2 layers, embed 128) with the real vocabulary: its output layer dominates the
step, as it does Gemma 3 270M's (where the vocabulary is 170M of the 270M parameters), so the argmax's
share here is an upper bound of the real models'. Two jitted train steps (`worker.train.make_train_step`):
as the worker runs it, and with `loss_sums` without the argmax (patched in, the rest the same), timed
alternately after compiling. Prints a line each; the LAST line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from worker import model as gemma
from worker import train


def without_accuracy(model, trained, frozen, batch):  # type: ignore[no-untyped-def]
    """`train.loss_sums` as it was before token accuracy: no argmax (its count is 0)."""
    logits = gemma.forward(model, trained, frozen, batch["tokens"], batch["segment_ids"], batch["positions"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"]
    return jnp.sum(losses * mask), (jnp.sum(mask), jnp.zeros(()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each, alternately")
    args = parser.parse_args()

    model = gemma.build_model(
        "tiny", args.vocab, lora_rank=None, param_dtype=jnp.float32, compute_dtype=jnp.float32
    )
    mesh = train.make_mesh(1)
    params, _ = model.init_params(0, (train.tree_shardings(mesh, model.abstract_params()[0]), {}))
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, args.vocab, (args.batch, args.seq + 1), dtype=np.int32)
    batch = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": np.ones((args.batch, args.seq), np.int32),
        "positions": np.broadcast_to(np.arange(args.seq, dtype=np.int32), (args.batch, args.seq)).copy(),
        "loss_mask": np.ones((args.batch, args.seq), np.float32),
    }
    optimizer = optax.adamw(1e-4)
    stop = jnp.zeros(1, jnp.int32)

    def compiled(loss_sums):  # type: ignore[no-untyped-def]
        original, train.loss_sums = train.loss_sums, loss_sums
        try:
            step = jax.jit(train.make_train_step(model, optimizer, optax.constant_schedule(1e-4), 1))
            state = {"step": jnp.int32(0), "params": params, "opt_state": optimizer.init(params)}
            jax.block_until_ready(step(state, {}, batch, stop))  # (compiles)
            return step, state
        finally:
            train.loss_sums = original

    runs = {"with_accuracy": compiled(train.loss_sums), "without": compiled(without_accuracy)}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.steps):
        for name, (step, state) in runs.items():
            began = time.perf_counter()
            jax.block_until_ready(step(state, {}, batch, stop))
            seconds[name].append(time.perf_counter() - began)
    median = {name: statistics.median(times) for name, times in seconds.items()}
    for name, value in median.items():
        print(f"{name:>14}: {value * 1000:8.1f} ms a step (median of {args.steps})")
    cost = median["with_accuracy"] / median["without"] - 1
    print(
        f"token accuracy costs {cost:+.1%} of a step (vocab {args.vocab:,}, {args.batch}x{args.seq} tokens)"
    )
    figures = {
        "vocab": args.vocab,
        "tokens": args.batch * args.seq,
        "cpus": os.cpu_count(),
        "ms_with_accuracy": round(median["with_accuracy"] * 1000, 2),
        "ms_without": round(median["without"] * 1000, 2),
        "cost": round(cost, 4),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
