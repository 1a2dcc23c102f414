"""Training throughput on CPU: our packed pipeline against the reference tutorial's pad-to-max-length loader.

    .venv/bin/python bench/train_throughput.py            # default: a few minutes on a 2-core CPU
    .venv/bin/python bench/train_throughput.py --quick    # smoke check: small corpus, few steps

Both methods train the same Gemma 3 architecture (4 layers, embed 256, 3 sliding-window + 1 global layer,
built as `worker.model.tiny_config` builds its config), on the same generated stories (`worker.stories`),
with the same tokenizer (a SentencePiece BPE model trained here in seconds, as tests/worker/conftest.py
does), the same optimizer (`worker.train.make_optimizer`), float32 compute, and the same number of real
target tokens per optimizer step (the batch size that matters to the optimizer): (b) takes `--batch-size`
rows of max_seq_len tokens per step, mostly padding; (a) takes as many packed rows as hold the same real
tokens on average (`--packed-batch-size` overrides it; equal rows would give (a) ~2x the tokens per step
and (b) ~2x the optimizer steps for the same tokens, which wins short runs on step count alone):

(a) ours: `worker.data.TrainData` (tokenized once, best-fit packed rows, segment-aware attention, positions
    restarting per document, loss mask on real targets), stepped by `worker.train.make_train_step`.
(b) reference: each story tokenized in the loader ([bos] + ids + [eos]), padded/truncated to max_seq_len+1,
    plain causal mask (one segment per row), positions 0..L-1, no loss mask (pad targets count in the loss,
    which is averaged over every position), stepped by the same train step with an all-ones loss mask.

Trained target tokens are real (non-pad) next-token targets in both. (a) runs `--steps` steps; (b) runs
until it has trained at least as many real target tokens, so the eval losses compare equal token counts
(after about as many optimizer steps).
Eval: a held-out set of stories (a different generator seed), packed as `worker.data.EvalData` packs it,
loss averaged over real targets only, the same batches for both models.

MFU: model FLOPs per step (6 * matmul params * positions + 12 * layers * heads * head_dim * L per position,
the PaLM formula; all positions of the batch, padding included, since they are computed) over the step
time, against a peak the process measures: the best of a few jitted f32 matmuls of the model's shapes.
"Useful" MFU counts only the real target tokens' FLOPs. The first step of each method (compile) is not
timed. Epoch wall time is extrapolated from the mean timed step time times the steps of one epoch.

Prints a table; the LAST line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from gemma import gm

from worker import model as gemma
from worker.config import Hyperparameters
from worker.data import EvalData, TrainData
from worker.stories import generate_stories
from worker.tokenizer import Tokenizer, train_bpe_model
from worker.train import (
    batch_sharding,
    global_batch,
    make_eval_step,
    make_mesh,
    make_optimizer,
    make_train_step,
    tree_shardings,
)

TARGET_SPEEDUP = 2.0
# The first call compiles; the second compiles again (the state comes back committed to the device).
WARMUP_STEPS = 2


def bench_config(vocab_size: int, args: argparse.Namespace) -> gm.nn.config.TransformerConfig:
    """tiny_config scaled up: 4 layers (Gemma 3's local/global interleave), embed 256."""
    return gemma.tiny_config(
        vocab_size,
        layers=args.layers,
        embed_dim=args.embed,
        hidden_dim=args.hidden,
        num_heads=args.heads,
        sliding_window=args.window,
    )


def train_tokenizer(directory: Path, vocab_size: int) -> Tokenizer:
    # The stories hold ~2,300 pieces at most: no hard vocabulary limit.
    stories = generate_stories(400, 1)
    return Tokenizer.load(train_bpe_model(stories, directory / "bench", vocab_size, hard_vocab_limit=False))


class ReferenceLoader:
    """The tutorial's loader: per batch, tokenize each story, pad/truncate to max_seq_len + 1, no mask."""

    def __init__(
        self, stories: list[str], tokenizer: Tokenizer, max_seq_len: int, batch_size: int, seed: int
    ):
        self.stories = stories
        self.tokenizer = tokenizer
        self.row_len = max_seq_len + 1
        self.batch_size = batch_size
        self.seed = seed
        self.steps_per_epoch = len(stories) // batch_size

    def batch(self, step: int) -> tuple[dict[str, np.ndarray], int]:
        """(batch, real target tokens in it)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.stories))
        rows = np.zeros((self.batch_size, self.row_len), np.int32)  # pad id 0
        real = 0
        tok = self.tokenizer
        for r, i in enumerate(order[index * self.batch_size : (index + 1) * self.batch_size]):
            ids = [tok.bos_id, *tok.encode(self.stories[i]), tok.eos_id][: self.row_len]
            rows[r, : len(ids)] = ids
            real += len(ids) - 1
        length = self.row_len - 1
        batch = {
            "tokens": rows[:, :-1].copy(),
            "targets": rows[:, 1:].copy(),
            "segment_ids": np.ones((self.batch_size, length), np.int32),  # plain causal mask
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (self.batch_size, length)).copy(),
            "loss_mask": np.ones((self.batch_size, length), np.float32),  # pads count in the loss
        }
        return batch, real


def matmul_params(params: dict) -> int:
    """Parameters that take part in matmuls: every >=2-D weight (the tied embedding once, as logits)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params) if x.ndim >= 2)


def measure_peak(shapes: list[tuple[int, int, int]], repeats: int) -> tuple[float, dict[str, float]]:
    """Best f32 FLOP/s of jitted matmuls [m,k]@[k,n]."""
    results: dict[str, float] = {}
    for m, k, n in shapes:
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
        f = jax.jit(lambda x, y: x @ y)
        f(a, b).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            f(a, b).block_until_ready()
            times.append(time.perf_counter() - start)
        results[f"{m}x{k}x{n}"] = 2 * m * k * n / min(times)
    return max(results.values()), results


def run_method(name, next_batch, step_fn, state, sharding, stop_when, max_steps, log, at_step=None):
    """Train until stop_when(real_tokens, steps) or max_steps; the WARMUP_STEPS (compiles) are untimed.

    at_step: (step count, callback(state)) run once when that many steps are done.
    """
    real_total, steps, timed, timed_real = 0, 0, [], 0
    losses = []
    stop = jnp.zeros((), jnp.int32)
    while steps < max_steps and not stop_when(real_total, steps):
        start = time.perf_counter()
        host, real = next_batch(steps)
        state, metrics = step_fn(state, {}, global_batch(host, sharding), stop)
        loss = float(metrics["loss"])  # blocks
        elapsed = time.perf_counter() - start
        if steps >= WARMUP_STEPS:
            timed.append(elapsed)
            timed_real += real
        losses.append(loss)
        real_total += real
        steps += 1
        if at_step is not None and steps == at_step[0]:
            at_step[1](state)
        log(f"  {name} step {steps}: loss {loss:.3f}  {elapsed:.2f}s  real targets {real}")
    return state, {
        "steps": steps,
        "real_target_tokens": real_total,
        "timed_steps": len(timed),
        "step_seconds_mean": statistics.mean(timed) if timed else float("nan"),
        "step_seconds_median": statistics.median(timed) if timed else float("nan"),
        "tokens_per_second": timed_real / sum(timed) if timed else float("nan"),
        "final_train_loss": losses[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small corpus, few steps")
    parser.add_argument("--stories", type=int, default=2000, help="training stories")
    parser.add_argument("--eval-stories", type=int, default=64)
    parser.add_argument(
        "--steps", type=int, default=12, help="steps of (a); (b) runs to the same real tokens"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="reference batch in rows")
    parser.add_argument(
        "--packed-batch-size",
        type=int,
        default=None,
        help="packed rows per step (default: the reference's real tokens per step, in packed rows)",
    )
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.stories, args.eval_stories, args.steps, args.batch_size = 400, 16, 6, 4
        args.warmup_steps = 1

    def log(message: str) -> None:
        print(message, flush=True)

    log(
        f"jax {jax.__version__} on {jax.default_backend()} ({len(jax.devices())} device(s)), "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_tokenizer(Path(tmp), args.vocab)
    stories = generate_stories(args.stories, 0)
    held_out = generate_stories(args.eval_stories, 2)
    lengths = np.array([len(ids) + 2 for ids in tokenizer.encode_batch(stories)])
    log(
        f"corpus: {len(stories)} stories, tokens per story (bos/eos incl.) median {np.median(lengths):.0f}, "
        f"mean {lengths.mean():.0f}, p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()}, "
        f"{(lengths > args.max_seq_len + 1).mean():.1%} longer than a row; vocab {tokenizer.vocab_size}"
    )

    ref_real = int(np.minimum(lengths, args.max_seq_len + 1).sum() - len(lengths))
    ref_pad = 1 - ref_real / (len(lengths) * args.max_seq_len)
    start = time.perf_counter()
    train = TrainData(stories, tokenizer, args.max_seq_len, args.batch_size, args.seed, [0], 1)
    pack_seconds = time.perf_counter() - start
    if args.packed_batch_size is None:
        packed_real_per_row = train.stats.target_tokens / train.stats.rows
        args.packed_batch_size = max(
            1, round(args.batch_size * ref_real / len(lengths) / packed_real_per_row)
        )
        train = TrainData(stories, tokenizer, args.max_seq_len, args.packed_batch_size, args.seed, [0], 1)
    hyper = Hyperparameters(
        batch_size=args.batch_size,
        max_seq_len=args.max_seq_len,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
    )
    spec: Any = SimpleNamespace(hyperparameters=hyper)  # make_optimizer reads only .hyperparameters

    evaluation = EvalData(held_out, tokenizer, args.max_seq_len, args.batch_size, args.seed, [0], 1)
    reference = ReferenceLoader(stories, tokenizer, args.max_seq_len, args.batch_size, args.seed)
    log(
        f"packed: {train.stats.rows} rows, pad {train.stats.pad_fraction:.1%}, "
        f"{args.packed_batch_size} rows/step, "
        f"{train.stats.target_tokens} targets, {train.steps_per_epoch} steps/epoch "
        f"(tokenize+pack {pack_seconds:.2f}s)"
    )
    log(
        f"reference: {args.batch_size} rows/step, {reference.steps_per_epoch} steps/epoch, "
        f"pad {ref_pad:.1%}, "
        f"{ref_real} real targets/epoch"
    )

    mesh = make_mesh(1)
    sharding = batch_sharding(mesh)
    # As build_model builds "tiny", with the bigger config: float32 params and compute.
    base = gm.nn.Transformer(config=bench_config(tokenizer.vocab_size, args), dtype=jnp.float32)
    model = gemma.Model(name="bench", base=base, module=base, lora_rank=None, compute_dtype=jnp.float32)
    abstract = model.abstract_params()
    shardings = tree_shardings(mesh, abstract)
    n_matmul = matmul_params(abstract[0])
    n_total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract[0]))
    L = args.max_seq_len
    flops_per_position = 6 * n_matmul + 12 * args.layers * args.heads * (args.embed // args.heads) * L
    log(
        f"model: {n_total / 1e6:.2f}M params ({n_matmul / 1e6:.2f}M in matmuls), "
        f"{flops_per_position / 1e6:.1f} MFLOP per trained position"
    )

    peak, peaks = measure_peak(
        [
            (args.batch_size * L, args.embed, args.hidden),
            (args.batch_size * L, args.embed, tokenizer.vocab_size),
            (1024, 1024, 1024),
        ],
        repeats=3 if args.quick else 5,
    )
    log("peak f32 matmul: " + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items()))

    eval_batches = [global_batch(b, sharding) for b in evaluation.eval_batches()]
    eval_fn = jax.jit(make_eval_step(model, 1))

    def eval_loss(params) -> float:
        total, count = 0.0, 0.0
        for batch in eval_batches:
            s, c, *_ = eval_fn(params, {}, batch)
            total, count = total + float(s), count + float(c)
        return total / count

    results: dict[str, dict[str, Any]] = {}
    for method in ("packed", "reference"):
        params, _ = model.init_params(args.seed, shardings)
        total_steps = args.steps
        if method == "reference":
            # Steps (b) needs to reach (a)'s real tokens, estimated from the mean story, for its schedule.
            per_step = ref_real / len(lengths) * args.batch_size
            total_steps = int(np.ceil(results["packed"]["real_target_tokens"] / per_step))
        optimizer, schedule = make_optimizer(spec, total_steps)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}
        step_fn = jax.jit(make_train_step(model, optimizer, schedule, 1), donate_argnums=0)
        log(f"({'a' if method == 'packed' else 'b'}) {method}: {total_steps} planned steps")
        if method == "packed":

            def next_batch(step):
                b = train.batch(step)
                return b, int(b["loss_mask"].sum())

            state, r = run_method(
                method, next_batch, step_fn, state, sharding, lambda real, steps: False, args.steps, log
            )
            epoch_steps = train.steps_per_epoch
        else:
            goal = results["packed"]["real_target_tokens"]
            same_steps: dict[str, float] = {}
            state, r = run_method(
                method,
                reference.batch,
                step_fn,
                state,
                sharding,
                lambda real, steps, goal=goal: real >= goal,
                10 * total_steps + 10,
                log,
                (args.steps, lambda s, same=same_steps: same.setdefault("loss", eval_loss(s["params"]))),
            )
            r["eval_loss_at_packed_steps"] = same_steps.get("loss")
            epoch_steps = reference.steps_per_epoch
        r["epoch_steps"] = epoch_steps
        r["epoch_seconds_extrapolated"] = epoch_steps * r["step_seconds_mean"]
        positions = (args.packed_batch_size if method == "packed" else args.batch_size) * L
        r["rows_per_step"] = positions // L
        r["mfu"] = flops_per_position * positions / r["step_seconds_mean"] / peak
        r["useful_mfu"] = flops_per_position * r["tokens_per_second"] / peak
        r["eval_loss"] = eval_loss(state["params"])
        results[method] = r
        log(
            f"  -> {r['tokens_per_second']:.0f} real target tokens/s, {r['step_seconds_mean']:.2f}s/step, "
            f"epoch {r['epoch_seconds_extrapolated']:.0f}s (extrapolated from {r['timed_steps']} timed "
            "steps), "
            f"MFU {r['mfu']:.1%} (useful {r['useful_mfu']:.1%}), eval loss {r['eval_loss']:.4f} "
            f"after {r['real_target_tokens']} real targets in {r['steps']} steps"
        )

    # The machine may be shared: measure the peak again and keep the best, then recompute MFU.
    peak_end, peaks_end = measure_peak(
        [(1024, 1024, 1024), (args.batch_size * L, args.embed, args.hidden)], 5
    )
    if peak_end > peak:
        peak, peaks = peak_end, {**peaks, **{f"{k} (end)": v for k, v in peaks_end.items()}}
        for r in results.values():
            r["mfu"] = flops_per_position * r["rows_per_step"] * L / r["step_seconds_mean"] / peak
            r["useful_mfu"] = flops_per_position * r["tokens_per_second"] / peak
    log(
        f"peak f32 matmul (best of start and end): {peak / 1e9:.1f} GFLOP/s; MFU packed "
        f"{results['packed']['mfu']:.1%} (useful {results['packed']['useful_mfu']:.1%}), reference "
        f"{results['reference']['mfu']:.1%} (useful {results['reference']['useful_mfu']:.1%})"
    )
    a, b = results["packed"], results["reference"]
    speedup = a["tokens_per_second"] / b["tokens_per_second"]
    summary = {
        "command": "bench/train_throughput.py" + (" --quick" if args.quick else ""),
        "args": vars(args),
        "backend": jax.default_backend(),
        "load_average_end": os.getloadavg()[0],
        "params": n_total,
        "matmul_params": n_matmul,
        "flops_per_position": flops_per_position,
        "peak_flops": peak,
        "peak_flops_by_shape": peaks,
        "corpus": {
            "stories": len(stories),
            "median_tokens": float(np.median(lengths)),
            "mean_tokens": float(lengths.mean()),
            "packed_rows": train.stats.rows,
            "packed_pad_fraction": train.stats.pad_fraction,
            "reference_pad_fraction": ref_pad,
            "reference_truncated_stories": int((lengths > L + 1).sum()),
        },
        "packed": a,
        "reference": b,
        "speedup_tokens_per_second": speedup,
        "speedup_epoch_wall": b["epoch_seconds_extrapolated"] / a["epoch_seconds_extrapolated"],
        "eval_loss_delta": a["eval_loss"] - b["eval_loss"],
        "target_met": bool(speedup >= TARGET_SPEEDUP and a["eval_loss"] <= b["eval_loss"]),
    }
    log(
        f"speedup {speedup:.2f}x real target tokens/s (target {TARGET_SPEEDUP}x); "
        f"eval loss packed {a['eval_loss']:.4f} vs reference {b['eval_loss']:.4f} at equal real targets "
        f"({a['steps']} vs {b['steps']} optimizer steps); reference after {a['steps']} steps: "
        f"{b['eval_loss_at_packed_steps']:.4f}"
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
