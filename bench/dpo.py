"""Preference fine-tuning (DPO, and SimPO) of the real Gemma 3 270M beside supervised fine-tuning (SFT) on
the same preferred replies: what a step costs, and whether the model learns the preference.

    .venv/bin/python bench/dpo.py                        # LoRA, 20 steps each: ~7 min on 2 cores
    .venv/bin/python bench/dpo.py --steps 10 --method full
    .venv/bin/python bench/dpo.py --objectives sft,dpo   # (sft, dpo and simpo by default)

Pairs from generated stories (`worker.stories`): the prompt a story's first sentence, the chosen reply its
next two sentences, the rejected reply the next two sentences of another story (prose as fluent, that does
not follow). The jobs run through the worker (`worker.train.run`) on the packaged Gemma 3 270M (the demo's
weights), rows of 128 tokens, held-out pairs (a file of their own) evaluated at the start and the end: the
dpo job on the pairs, the simpo job too (a dpo job with `simpo_gamma`: no reference model; beta 2,
gamma 1, as SimPO's paper), with `--objectives` an rpo job too (dpo with `rpo_alpha` 1), the sft job on
the same prompts with their chosen replies. Figures per job:
seconds a step (the median, past the first), and the share of held-out pairs whose chosen reply the model
finds likelier than the rejected one (log-probabilities of the replies' tokens summed), and the replies'
mean log-probability a token (does the chosen reply grow likelier, or only less unlikely than the
rejected?), before and after;
the dpo and simpo jobs' eval loss, accuracy (pairs it prefers rightly, by its own rewards) and mean
rewards of the chosen and rejected replies too. The LAST line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pairs(count: int, seed: int) -> list[dict[str, str]]:
    """{"prompt", "chosen", "rejected"} records from generated stories."""
    from worker.stories import generate_stories

    stories = [
        [s.strip() + "." for s in story.split(".") if s.strip()]
        for story in generate_stories(count + 1, seed)
    ]
    records = []
    for story, other in itertools.pairwise(stories):
        if len(story) >= 3 and len(other) >= 3:
            records.append(
                {
                    "prompt": story[0],
                    "chosen": " " + " ".join(story[1:3]),
                    "rejected": " " + " ".join(other[1:3]),
                }
            )
    return records


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--method", choices=["lora", "full"], default="lora")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=None, help="default 5e-4 (LoRA), 2e-5 (full)")
    parser.add_argument(
        "--job-default-lr",
        action="store_true",
        help="give the jobs no learning rate: each takes the service's default for its method and objective",
    )
    parser.add_argument("--held-out", type=int, default=24)
    parser.add_argument(
        "--objectives",
        default="sft,dpo,simpo",
        help="which jobs, of sft, dpo, simpo and rpo (dpo, rpo_alpha 1)",
    )
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    from worker import model as gemma
    from worker import train
    from worker.config import EXIT_OK, WorkerConfig
    from worker.data import EvalData, read_documents
    from worker.gguf_import import gguf_default_path, gguf_tokenizer_model, load_gguf_params
    from worker.protocol import EvalReport, MetricsReport
    from worker.report import Reporter
    from worker.tokenizer import Tokenizer

    class Timed(Reporter):
        def __init__(self) -> None:
            super().__init__("bench", echo=None)
            self.metrics: list[tuple[float, MetricsReport]] = []
            self.evals: list[EvalReport] = []

        def send(self, report: Any) -> None:
            if isinstance(report, MetricsReport):
                self.metrics.append((time.monotonic(), report))
            elif isinstance(report, EvalReport):
                self.evals.append(report)

    gguf = gguf_default_path()
    tokenizer = Tokenizer.load(gguf_tokenizer_model(gguf))
    records = pairs(args.steps * args.batch_size + args.held_out + 8, 11)
    train_pairs, held_out = records[args.held_out :], records[: args.held_out]
    learning_rate = (
        None if args.job_default_lr else args.learning_rate or (5e-4 if args.method == "lora" else 2e-5)
    )
    figures: dict[str, Any] = {"method": args.method, "steps": args.steps, "learning_rate": learning_rate}
    with tempfile.TemporaryDirectory() as temp:
        work = Path(temp)
        held_pairs = write_jsonl(work / "held_out.jsonl", held_out)
        # The model's own preference: log p(chosen | prompt) > log p(rejected | prompt), per held-out pair.
        rows = EvalData(read_documents(held_pairs), tokenizer, 128, 1, 0, [0], 1).eval_batches()
        plain = gemma.build_model(
            "gemma3-270m-pt",
            tokenizer.vocab_size,
            lora_rank=None,
            param_dtype=jnp.float32,
            compute_dtype=jnp.float32,
        )

        @jax.jit
        def replies(params: Any, batch: dict[str, Any]) -> Any:
            return train.sequence_logprobs(gemma.forward(plain, params, {}, *train._inputs(batch)), batch)

        def preference(params: Any) -> tuple[float, float, float]:
            """(the share of held-out pairs whose chosen reply the model finds likelier, the mean
            log-probability a token of the chosen replies, of the rejected ones)."""
            right = total = 0
            per_token: list[Any] = []
            for batch in rows:
                sums, counts = (np.asarray(x) for x in replies(params, batch))
                real = (counts[..., 0] > 0) & (counts[..., 1] > 0)
                right += int(((sums[..., 0] > sums[..., 1]) & real).sum())
                total += int(real.sum())
                per_token.append((sums / np.maximum(counts, 1))[real])
            means = np.concatenate(per_token).mean(axis=0)
            return right / total, float(means[0]), float(means[1])

        for objective in args.objectives.split(","):
            if objective != "sft":
                data, validation = write_jsonl(work / "train.jsonl", train_pairs), held_pairs
            else:
                completions = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in train_pairs]
                data = write_jsonl(work / "train_sft.jsonl", completions)
                validation = write_jsonl(
                    work / "held_out_sft.jsonl",
                    [{"prompt": r["prompt"], "completion": r["chosen"]} for r in held_out],
                )
            method: dict[str, Any] = {
                "type": args.method,
                "objective": "sft" if objective == "sft" else "dpo",
            }
            if objective == "simpo":
                method.update(simpo_gamma=1.0, dpo_beta=2.0)
            elif objective == "rpo":
                method.update(rpo_alpha=1.0)
            if args.method == "lora":
                method["export_merged"] = True
            spec = {
                "name": f"bench {objective}",
                "model": "gemma3-270m-pt",
                "base_checkpoint_uri": str(gguf),
                "method": method,
                "dataset_uri": data,
                "validation_uri": validation,
                "sample_prompts": [],
                "hyperparameters": {
                    "max_steps": args.steps,
                    "batch_size": args.batch_size,
                    **({} if learning_rate is None else {"learning_rate": learning_rate}),
                    "lr_scheduler": "constant",
                    "max_seq_len": 128,
                    "eval_every_steps": args.steps,
                },
            }
            output = work / objective
            config = WorkerConfig.model_validate(
                {"job_id": objective, "output_uri": str(output), "spec": spec}
            )
            reporter = Timed()
            started = time.monotonic()
            if train.run(config, reporter, train.RunOptions(sample_tokens=1)) != EXIT_OK:
                print(f"the {objective} job failed", file=sys.stderr)
                return 1
            seconds = time.monotonic() - started
            times = [t for t, _ in reporter.metrics]
            step_s = (
                statistics.median(b - a for a, b in itertools.pairwise(times)) if len(times) > 2 else None
            )
            final = ocp.StandardCheckpointer().restore(output / "final" / "params")
            if "base_prefers_chosen" not in figures:
                base = preference(load_gguf_params(gguf, dtype="float32")["params"])
                figures["base_prefers_chosen"] = round(base[0], 3)
                figures["base_logprob_per_token"] = [round(base[1], 3), round(base[2], 3)]
            prefers, chosen_lp, rejected_lp = preference(final)
            job: dict[str, Any] = {
                "learning_rate": config.spec.hyperparameters.learning_rate,
                "seconds": round(seconds, 1),
                "step_s": round(step_s, 2) if step_s else None,
                "tokens_per_s": round(reporter.metrics[-1][1].tokens_per_second or 0, 1),
                "prefers_chosen": round(prefers, 3),
                "logprob_per_token": [round(chosen_lp, 3), round(rejected_lp, 3)],
                "eval_loss": [round(e.eval_loss, 4) for e in reporter.evals],
                "eval_accuracy": [round(e.eval_accuracy or 0, 3) for e in reporter.evals],
            }
            rewards = ""
            if objective != "sft":
                last = reporter.evals[-1]
                job["eval_rewards"] = [
                    round(last.eval_chosen_reward or 0, 3),
                    round(last.eval_rejected_reward or 0, 3),
                ]
                rewards = (
                    f", rewards chosen {job['eval_rewards'][0]:+.3f} rejected {job['eval_rewards'][1]:+.3f}"
                )
            figures[objective] = job
            print(
                f"{objective}: {args.steps} {args.method} steps at lr {job['learning_rate']:g}, "
                f"{job['step_s']} s a step, {seconds:.0f} s in all; eval loss {job['eval_loss'][0]} -> "
                f"{job['eval_loss'][-1]}, accuracy "
                f"{job['eval_accuracy'][0]} -> {job['eval_accuracy'][-1]}{rewards}; prefers the chosen reply "
                f"in {job['prefers_chosen']:.0%} of {len(held_out)} held-out pairs; log p a token: chosen "
                f"{chosen_lp:.3f}, rejected {rejected_lp:.3f}"
            )
    print(
        f"base model: prefers the chosen reply in {figures['base_prefers_chosen']:.0%} of the held-out "
        "pairs; "
        f"log p a token: chosen {figures['base_logprob_per_token'][0]:.3f}, rejected "
        f"{figures['base_logprob_per_token'][1]:.3f}"
    )
    for objective in ("dpo", "simpo", "rpo"):
        if figures.get("sft", {}).get("step_s") and figures.get(objective, {}).get("step_s"):
            cost = figures[f"{objective}_step_cost"] = round(
                figures[objective]["step_s"] / figures["sft"]["step_s"], 2
            )
            print(f"a {objective} step costs {cost}x an sft step of as many rows")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
