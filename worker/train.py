"""The training run: distributed setup, mesh and shardings, the jitted train step and the host loop.

One mesh spans every device of every process with axes ("data", "fsdp"): params and optimizer state are
sharded over "fsdp" on their largest divisible dimension (small arrays are replicated), batches over both
axes. Each process packs its own data shards and contributes its rows to the global batch.

The host loop dispatches step k before it reads step k-1's metrics, so the devices never wait for Python.
Stop requests (SIGTERM, a cancel or pause from the API) ride along in each step's input and come back in its
metrics, so every process sees them at the same step and they all stop together, at most two steps after
the request; the run then saves a checkpoint and exits (EXIT_PREEMPTED on SIGTERM or a pause, EXIT_OK on a
cancel).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from worker import model as gemma
from worker.checkpoint import Checkpoints, export_params, join, write_json
from worker.config import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_PREEMPTED,
    TINY_MODEL,
    Hyperparameters,
    JobSpec,
    WorkerConfig,
)
from worker.data import (
    Batch,
    DataError,
    DataStats,
    EvalData,
    TrainData,
    load_train_data,
)
from worker.exports import export_formats
from worker.hf import hf_tokenizer, is_hf_model
from worker.protocol import (
    REWARDS,
    CheckpointReport,
    DataReport,
    ErrorReport,
    EvalReport,
    MetricsReport,
    ResultReport,
    SampleReport,
    StatusReport,
    WarningReport,
)
from worker.report import Reporter
from worker.tokenizer import OFFICIAL_TOKENIZER_URI, Tokenizer, TokenizerError

log = logging.getLogger(__name__)

ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

MESH_AXES = ("data", "fsdp")
# Arrays smaller than this are replicated: sharding them saves little memory and costs a gather each.
MIN_SHARDED_SIZE = 2**14
# Stop codes carried through the train step; the larger wins when processes disagree.
STOP_NONE, STOP_CANCEL, STOP_PAUSE, STOP_PREEMPT = 0, 1, 2, 3
# Cosine decay ends at this fraction of the peak learning rate.
END_LR_FRACTION = 0.1

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How (not what) a job trains; the what is the JobSpec."""

    param_dtype: str = "float32"  # trained params and optimizer state
    compute_dtype: str = "auto"  # the forward and backward pass (and the frozen LoRA base); see resolve
    sample_tokens: int = 48  # tokens generated per sample prompt
    data_shards: int | None = None  # data shards of the job (a multiple of the process count); None: one each
    cache_dir: Path | None = None  # where downloaded or converted files are kept


class Evaluated(NamedTuple):
    """An eval at a step: its loss and token accuracy over the held-out rows (a dpo job's: its pair
    accuracy, and its pairs' mean rewards)."""

    step: int
    loss: float
    accuracy: float
    chosen_reward: float | None = None
    rejected_reward: float | None = None

    def reported(self) -> dict[str, Any]:
        """Its figures as eval, checkpoint and result reports name them."""
        return {
            "eval_loss": self.loss,
            "eval_accuracy": self.accuracy,
            "eval_chosen_reward": self.chosen_reward,
            "eval_rejected_reward": self.rejected_reward,
        }


# A step's figures that its checkpoints and the result report (the weights' at that step): a dpo job's
# rewards besides the loss and accuracy.
STEP_FIGURES = ("loss", "accuracy", *REWARDS[:2])


def _step_figures(values: Mapping[str, Any]) -> dict[str, float]:
    """The `STEP_FIGURES` in `values` (a step's metrics, a checkpoint's position) that it has: not a dpo
    job's rewards for other jobs, nor a figure a checkpoint saved before it was kept."""
    return {name: values[name] for name in STEP_FIGURES if values.get(name) is not None}


class LossNotFinite(Exception):
    def __init__(self, step: int, loss: float, what: str = "training loss") -> None:
        super().__init__(f"the {what} became {loss} at step {step}")
        self.step = step


# --- Distributed setup, mesh and shardings ----------------------------------------------------------------


def resolve_compute_dtype(name: str) -> str:
    """`auto`: bfloat16 on accelerators, float32 on CPU (where XLA runs bfloat16 matmuls slower)."""
    if name != "auto":
        return name
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def init_distributed() -> None:
    """Join the job's JAX processes: from the environment off TPU, auto-detected on a multi-host TPU slice.

    Must run before anything touches a JAX device.
    """
    if os.environ.get(ENV_COORDINATOR_ADDRESS):
        count = int(os.environ.get(ENV_NUM_PROCESSES, "1"))
        if count > 1:
            # CPU processes exchange collectives over Gloo; TPUs and GPUs ignore this.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(
                coordinator_address=os.environ[ENV_COORDINATOR_ADDRESS],
                num_processes=count,
                process_id=int(os.environ[ENV_PROCESS_ID]),
            )
    elif "," in os.environ.get("TPU_WORKER_HOSTNAMES", "") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()


def make_mesh(slices: int) -> Mesh:
    """("data", "fsdp") over all devices: data parallel across TPU slices, FSDP within one."""
    devices = jax.devices()
    data = slices if slices > 1 and len(devices) % slices == 0 else 1
    shape = (data, len(devices) // data)
    axis_types = (AxisType.Auto, AxisType.Auto)  # gemma's embedding lookup rejects Explicit axes
    if data > 1 and hasattr(devices[0], "slice_index"):
        grid = mesh_utils.create_hybrid_device_mesh((1, shape[1]), (data, 1), devices)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)


def fsdp_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Shard the largest dimension divisible by the FSDP axis; replicate small or indivisible arrays."""
    size = mesh.shape["fsdp"]
    spec: list[str | None] = [None] * len(shape)
    divisible = [axis for axis, dim in enumerate(shape) if dim % size == 0]
    if size > 1 and math.prod(shape) >= MIN_SHARDED_SIZE and divisible:
        spec[max(divisible, key=lambda axis: shape[axis])] = "fsdp"
    return NamedSharding(mesh, P(*spec))


def tree_shardings(mesh: Mesh, tree: Any) -> Any:
    return jax.tree.map(lambda leaf: fsdp_sharding(mesh, tuple(leaf.shape)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(MESH_AXES))


def global_batch(local: Batch, sharding: NamedSharding) -> dict[str, jax.Array]:
    """This process's rows of each array, assembled into the global batch."""
    return {
        name: jax.make_array_from_process_local_data(
            sharding, rows, (rows.shape[0] * jax.process_count(), *rows.shape[1:])
        )
        for name, rows in local.items()
    }


def agree(value: int, reduce: Callable[[np.ndarray], Any]) -> int:
    """`reduce` of one integer over all processes."""
    if jax.process_count() == 1:
        return value
    return int(reduce(np.asarray(multihost_utils.process_allgather(np.int64(value)))))


_SUMMED = ("documents", "tokens", "target_tokens", "rows", "pad_tokens")


def summed(stats: DataStats) -> DataStats:
    """This process's data figures summed over all processes (each packed its own shards), in one
    collective."""
    if jax.process_count() == 1:
        return stats
    counts = np.asarray([getattr(stats, name) for name in _SUMMED], np.int64)
    totals = np.asarray(multihost_utils.process_allgather(counts)).sum(axis=0)
    return dataclasses.replace(
        stats, **{name: int(total) for name, total in zip(_SUMMED, totals, strict=True)}
    )


# --- Optimizer, loss and steps ----------------------------------------------------------------------------


def make_schedule(hyper: Hyperparameters, total_steps: int) -> optax.Schedule:
    """The learning rate at each step: a linear warmup from 0 over `warmup_steps` (or `warmup_ratio` of
    the steps), then `lr_scheduler`: a cosine or linear decay that reaches `min_lr_ratio` x the peak at the
    last step, or the peak kept."""
    peak = hyper.learning_rate
    warmup = hyper.warmup_steps
    if hyper.warmup_ratio is not None:
        warmup = round(hyper.warmup_ratio * total_steps)
    end = peak * (END_LR_FRACTION if hyper.min_lr_ratio is None else hyper.min_lr_ratio)
    after = max(total_steps - warmup, 1)  # (the steps after the warmup; 1 if it takes them all)
    if hyper.lr_scheduler == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, warmup + after, end)
    if hyper.lr_scheduler == "linear":
        decay = optax.linear_schedule(peak, end, after)
    else:
        decay = optax.constant_schedule(peak)
    if not warmup:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def make_optimizer(spec: JobSpec, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW on `make_schedule`'s learning rate; decay skips vectors (norm scales); optional clipping."""
    hyper = spec.hyperparameters
    schedule = make_schedule(hyper, total_steps)
    adamw = optax.adamw(
        schedule,
        weight_decay=hyper.weight_decay,
        mask=lambda params: jax.tree.map(lambda x: x.ndim > 1, params),
    )
    if hyper.max_grad_norm is None:
        return adamw, schedule
    return optax.chain(optax.clip_by_global_norm(hyper.max_grad_norm), adamw), schedule


def loss_sums(
    model: gemma.Model, trained: Params, frozen: Params, batch: dict[str, jax.Array]
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(sum of token cross-entropies over `loss_mask`, (number of those tokens, how many of them the
    model ranks first: its token accuracy's numerator))."""
    logits = gemma.forward(model, trained, frozen, batch["tokens"], batch["segment_ids"], batch["positions"])
    targets, mask = batch["targets"], batch["loss_mask"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    # The target ranked first: its logit is the highest. (Not argmax == target: argmax's (value, index)
    # reduction over a 262,144-token vocabulary cost a fifth of a step on CPU; a max and a gather do not.)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = jnp.sum((target_logits >= jnp.max(logits, axis=-1)) * mask)
    return jnp.sum(losses * mask), (jnp.sum(mask), correct)


# What a job's step minimizes, on one microbatch: (loss sum, (the count it is averaged over, how many of
# those the model gets right, tokens trained, {figure: sum} more figures averaged over the same count)).
Sums = tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]]


def _sft_sums(model: gemma.Model, trained: Params, frozen: Params, batch: dict[str, jax.Array]) -> Sums:
    """`loss_sums`, with its token count twice: as what the loss is averaged over, and as tokens trained."""
    loss_sum, (count, correct) = loss_sums(model, trained, frozen, batch)
    return loss_sum, (count, correct, count, {})


def sequence_logprobs(logits: jax.Array, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """([B, P, 2] summed log-probabilities of the trained targets of each row's segments 2k - 1 and 2k (a
    preference pair's chosen and rejected documents, as `data.pack_pairs` lays them out), [B, P, 2] how many
    targets each sum has). P is an upper bound of the pairs a row holds (each document has >= 3 tokens)."""
    rows, length = batch["segment_ids"].shape
    slots = 2 * (length // 4 + 1) + 1  # (segment 0, padding, and up to 2P documents)
    logprobs = -optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]) * batch["loss_mask"]
    index = (batch["segment_ids"] + slots * jnp.arange(rows)[:, None]).reshape(-1)

    def per_segment(values: jax.Array) -> jax.Array:
        summed = jax.ops.segment_sum(values.reshape(-1), index, num_segments=rows * slots)
        return summed.reshape(rows, slots)[:, 1:].reshape(rows, -1, 2)

    return per_segment(logprobs), per_segment(batch["loss_mask"])


def reference_logits(model: gemma.Model, frozen: Params, batch: dict[str, jax.Array]) -> jax.Array:
    """The logits of a dpo job's reference model, the weights it started from: a LoRA job's base alone (the
    adapter off: the plain network on its frozen params), a full fine-tune's initial weights (`frozen`)."""
    if model.lora_rank is not None:
        model = dataclasses.replace(model, module=model.base, lora_rank=None)
    return gemma.forward(model, frozen, {}, *_inputs(batch))


# A dpo job's figure the worker watches but does not report (`preference_sums`): the chosen replies' mean
# log-probability a token.
CHOSEN_LOGP = "chosen_logp"
# How far below their likelihood before training, in nats a token, the held-out chosen replies may fall
# before the worker warns (`bench/dpo.py`: 4.9 and 5.9 at learning rates that broke the model, 0.09 at one
# that did not).
LIKELIHOOD_WARNING_NATS = 1.0


def preference_sums(
    model: gemma.Model,
    trained: Params,
    frozen: Params,
    batch: dict[str, jax.Array],
    beta: float,
    rpo_alpha: float = 0.0,
    *,
    per_token: bool = False,
    simpo_gamma: float | None = None,
) -> Sums:
    """DPO over a batch of preference pairs: (sum of the pairs' losses -log sigmoid(margin), (number of
    pairs, how many the model prefers rightly: margin > 0, replies' tokens scored, {"chosen_reward",
    "rejected_reward": sums of the pairs' rewards, CHOSEN_LOGP: of their chosen replies' mean
    log-probability a token})).

    A reply's reward is beta times how much more likely the model makes it than the reference does (its
    log-probability ratio, the reply's tokens summed; with `per_token`, their mean), and the margin is the
    chosen reply's reward less the rejected one's. With `simpo_gamma`, SimPO: no reference, a reply's reward
    is beta times its mean log-probability a token, and the loss asks for a margin above `simpo_gamma`.
    With `rpo_alpha`, each pair's loss also has that weight times the chosen reply's negative
    log-likelihood a token (RPO)."""
    policy, counts = sequence_logprobs(gemma.forward(model, trained, frozen, *_inputs(batch)), batch)
    lengths = jnp.maximum(counts, 1.0)
    pairs = ((counts[..., 0] > 0) & (counts[..., 1] > 0)).astype(jnp.float32)
    if simpo_gamma is None:
        reference, _ = sequence_logprobs(jax.lax.stop_gradient(reference_logits(model, frozen, batch)), batch)
        ratios = (policy - reference) / lengths if per_token else policy - reference
    else:
        ratios = policy / lengths
    rewards = beta * ratios
    margin = rewards[..., 0] - rewards[..., 1]
    chosen_logp = policy[..., 0] / lengths[..., 0]
    losses = jax.nn.softplus((simpo_gamma or 0.0) - margin) - rpo_alpha * chosen_logp
    more = {
        # Well below its first eval's is DPO unlearning the chosen replies while it widens the margin
        # (`_Run._watch_likelihood`).
        CHOSEN_LOGP: jnp.sum(chosen_logp * pairs),
        "chosen_reward": jnp.sum(rewards[..., 0] * pairs),
        "rejected_reward": jnp.sum(rewards[..., 1] * pairs),
    }
    return (
        jnp.sum(losses * pairs),
        (jnp.sum(pairs), jnp.sum((margin > 0) * pairs), jnp.sum(counts.sum(axis=-1) * pairs), more),
    )


def _inputs(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    return batch["tokens"], batch["segment_ids"], batch["positions"]


Objective = Callable[[gemma.Model, Params, Params, dict[str, jax.Array]], Sums]


def objective(spec: JobSpec) -> Objective:
    """What a job's step minimizes: `(model, trained, frozen, batch) -> Sums`: tokens' cross-entropy (sft)
    or pairs' DPO loss (dpo; SimPO's with `simpo_gamma`)."""
    method = spec.method
    if method.objective == "dpo":
        beta, alpha = method.dpo_beta, method.rpo_alpha or 0.0
        assert beta is not None
        return lambda model, trained, frozen, batch: preference_sums(
            model,
            trained,
            frozen,
            batch,
            beta,
            alpha,
            per_token=method.dpo_normalize_logratios_by_length,
            simpo_gamma=method.simpo_gamma if method.simpo else None,
        )
    return _sft_sums


def microbatches(batch: dict[str, jax.Array], count: int) -> dict[str, jax.Array]:
    """[B, ...] -> [count, B/count, ...]; microbatch j holds rows j, j+count, ... (no row moves device)."""
    return {
        name: x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1) for name, x in batch.items()
    }


def make_train_step(
    model: gemma.Model,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    accumulation: int,
    objective: Objective = _sft_sums,
) -> Callable:
    """(state, frozen, batch, stop) -> (state, metrics): one optimizer step over the global batch.

    Gradients of the loss *sums* are accumulated over microbatches and divided by the global count of
    trained tokens (dpo: of pairs) once, so the step equals one without accumulation.
    """

    def train_step(state: Params, frozen: Params, batch: dict[str, jax.Array], stop: jax.Array) -> tuple:
        params = state["params"]
        grad_fn = jax.value_and_grad(lambda p, micro: objective(model, p, frozen, micro), has_aux=True)

        def accumulate(grads: Params, micro: dict[str, jax.Array]) -> tuple:
            (loss_sum, (count, correct, tokens, more)), micro_grads = grad_fn(params, micro)
            return jax.tree.map(jnp.add, grads, micro_grads), (loss_sum, count, correct, tokens, more)

        zeros = jax.tree.map(jnp.zeros_like, params)
        per_micro: tuple
        grads, per_micro = jax.lax.scan(accumulate, zeros, microbatches(batch, accumulation))
        loss_sum, count, correct, tokens, more = jax.tree.map(jnp.sum, per_micro)
        denominator = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denominator, grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        metrics = {
            # (not the watched figure: only evals read it)
            **{name: total / denominator for name, total in more.items() if name != CHOSEN_LOGP},
            "loss": loss_sum / denominator,
            "accuracy": correct / denominator,
            "tokens": tokens,
            "grad_norm": optax.global_norm(grads),
            "learning_rate": schedule(state["step"]),
            "stop": jnp.max(stop),
        }
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
        }
        return new_state, metrics

    return train_step


def make_eval_step(model: gemma.Model, accumulation: int, objective: Objective = _sft_sums) -> Callable:
    """(params, frozen, batch) -> the objective's sums over the batch: (loss sum, token count, tokens
    predicted, token count, {}) (dpo: pairs, pairs preferred rightly, their replies' tokens, their rewards),
    in the same microbatches as training."""

    def eval_step(params: Params, frozen: Params, batch: dict[str, jax.Array]) -> tuple:
        def sums(micro: dict[str, jax.Array]) -> tuple:
            loss_sum, (count, correct, tokens, more) = objective(model, params, frozen, micro)
            return loss_sum, count, correct, tokens, more

        return jax.tree.map(jnp.sum, jax.lax.map(sums, microbatches(batch, accumulation)))

    return eval_step


# --- Inputs -----------------------------------------------------------------------------------------------


def load_tokenizer(spec: JobSpec, options: RunOptions) -> Tokenizer:
    """The job's tokenizer: `tokenizer_uri` (a SentencePiece model, a GGUF file's or a Hugging Face model
    directory's `tokenizer.model`), else the GGUF base weights' own or a Hugging Face base model's, else
    the official Gemma 3 one."""
    uri, base = spec.tokenizer_uri, spec.base_checkpoint_uri
    if uri is None and base is not None and not base.endswith(".gguf"):
        uri = hf_tokenizer(base)
    elif uri is not None and not uri.endswith(".gguf") and is_hf_model(uri):
        uri = str(epath.Path(uri) / "tokenizer.model")
        if not epath.Path(uri).is_file():
            raise gemma.ModelError(
                "bad_tokenizer",
                f"{spec.tokenizer_uri} is a Hugging Face model directory without a tokenizer.model",
            )
    gguf = uri if uri is not None and uri.endswith(".gguf") else None
    if uri is None and base is not None and base.endswith(".gguf"):
        gguf = base
    if gguf is not None:
        from worker.gguf_import import GgufImportError, gguf_tokenizer_model

        try:
            uri = str(gguf_tokenizer_model(gguf, cache_dir=options.cache_dir))
        except (GgufImportError, OSError) as error:
            code = "bad_tokenizer" if gguf == spec.tokenizer_uri else "bad_base_checkpoint"
            raise gemma.ModelError(code, f"no tokenizer from the GGUF file: {error}") from error
    return Tokenizer.load(uri or OFFICIAL_TOKENIZER_URI, options.cache_dir)


def load_data(
    spec: JobSpec, tokenizer: Tokenizer, data_shards: int | None
) -> tuple[TrainData, EvalData | None]:
    """This process's data: shards [i*k, (i+1)*k) of `data_shards` (k per process; default one each)."""
    return load_train_data(spec, tokenizer, jax.process_index(), jax.process_count(), data_shards)


# --- The run ----------------------------------------------------------------------------------------------


def _every(interval: int | None, step: int) -> bool:
    return interval is not None and step % interval == 0


def out_of_memory(error: BaseException) -> str | None:
    """XLA's out-of-memory error (the accelerators' memory: HBM on a TPU, the host's on CPU), at compile
    time or run time, as a sentence saying what to change; None for any other error."""
    text = str(error)
    if not isinstance(error, jax.errors.JaxRuntimeError) or not text.startswith("RESOURCE_EXHAUSTED"):
        return None
    if "memory" not in text.lower():
        return None
    first = text.splitlines()[0][:300]
    return (
        f"The job does not fit in the accelerators' memory ({first}). Raise "
        "hyperparameters.gradient_accumulation_steps (the same batch in smaller pieces), lower batch_size "
        "or max_seq_len, fine-tune with LoRA (method.type lora), or give it more chips (a bigger topology)."
    )


_ROOT = Path(__file__).resolve().parent.parent
_OWN = ("worker/", "api/")


def where(error: BaseException) -> str:
    """Where `error` came from, for an internal error's message (the traceback is in the worker's log, which
    on GKE goes with its pod): the deepest line of tputune's own code it passed through, and the line that
    raised it where that is elsewhere (a library), as " (at worker/data.py:444 in __init__; raised in
    numpy/_core/fromnumeric.py:57 in _wrapfunc)"; "" without a traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""

    def name(frame: traceback.FrameSummary) -> str:
        path = frame.filename
        if path.startswith(str(_ROOT) + os.sep):
            path = os.path.relpath(path, _ROOT)
        elif "site-packages" + os.sep in path:
            path = path.rpartition("site-packages" + os.sep)[2]
        return f"{path}:{frame.lineno} in {frame.name}"

    own = [frame for frame in frames if name(frame).startswith(_OWN)]
    parts = [f"at {name(own[-1])}"] if own else []
    if not own or own[-1] is not frames[-1]:
        parts.append(f"raised in {name(frames[-1])}")
    return f" ({'; '.join(parts)})"


class StopSignals:
    """While installed, SIGTERM (and Ctrl-C) asks the run to stop after the current step with a checkpoint."""

    def __init__(self) -> None:
        self.preempted = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, lambda *_: self.preempted.set())
        return self

    def __exit__(self, *_: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def run(config: WorkerConfig, reporter: Reporter, options: RunOptions | None = None) -> int:
    """Train the job; returns the process exit code. Errors are reported before returning."""
    try:
        with StopSignals() as signals:
            return _Run(config, reporter, options or RunOptions(), signals).execute()
    except (DataError, gemma.ModelError) as error:
        code, message, step, exit_code = error.code, error.message, 0, EXIT_BAD_INPUT
    except TokenizerError as error:
        code, message, step, exit_code = "bad_tokenizer", str(error), 0, EXIT_BAD_INPUT
    except LossNotFinite as error:
        advice = "lower the learning rate or check the data and base weights"
        code, message, step, exit_code = "loss_not_finite", f"{error}; {advice}", error.step, EXIT_FAILED
    except Exception as error:
        log.exception("the run failed")
        if (too_big := out_of_memory(error)) is not None:  # (the job's settings: run again, it fails again)
            code, message, step, exit_code = "out_of_memory", too_big, 0, EXIT_BAD_INPUT
        else:
            code, message, step, exit_code = (
                "internal_error",
                f"{type(error).__name__}: {error}{where(error)}",
                0,
                EXIT_FAILED,
            )
    log.error("%s: %s", code, message)
    reporter.send(ErrorReport(step=step, code=code, message=message[:4000]))
    return exit_code


class _Run:
    """One attempt at a job: set up, resume if a checkpoint exists, train, export."""

    def __init__(self, config: WorkerConfig, reporter: Reporter, options: RunOptions, signals: StopSignals):
        self.config = config
        self.spec = config.spec
        self.hyper = config.spec.hyperparameters
        self.reporter = reporter
        self.options = options
        self.signals = signals
        self.trained_tokens = 0
        # The last step's `STEP_FIGURES`, as its checkpoints and the result report them.
        self.last_step: dict[str, float] = {}
        self.last_eval: Evaluated | None = None
        # Early stopping: the best eval so far, and how many evals since have not bettered it.
        self.best_eval: tuple[int, float] | None = None
        self.stale_evals = 0
        # The eval of the lowest loss so far: export_best exports its weights (a checkpoint kept, or at step
        # 0 the initial ones). (Early stopping's best moves only by more than its threshold; this by any.)
        self.lowest_eval: Evaluated | None = None
        self.warned_likelihood = False  # (`_watch_likelihood`)
        # A dpo job's held-out chosen replies' log-probability a token at its first eval, before training
        # (DPO's reference's; SimPO has none): what it watches them against. Kept in its checkpoints.
        self.chosen_logp_start: float | None = None
        self.status_count = 0
        # Tells this attempt's status messages from an earlier one's: a restarted worker says "loading ..."
        # at step 0 again, which the API would otherwise drop as a retry of the first attempt's report.
        self.attempt = secrets.token_hex(4)

    def status(self, message: str, phase: Any = None, step: int = 0, resumed_from: int | None = None) -> None:
        log.info("%s", message)
        # Several messages can share a step: the key keeps each one (the API stores one per kind/step/key).
        self.status_count += 1
        key = f"{phase or 'note'}-{self.attempt}-{self.status_count}"
        self.reporter.send(
            StatusReport(step=step, phase=phase, message=message, key=key, resumed_from=resumed_from)
        )

    def _report_data(self, steps_per_epoch: int) -> None:
        """What the data came to, summed over the processes (each read and packed its own shards)."""
        train = summed(self.train_data.stats)
        held_out = summed(self.eval_data.stats) if self.eval_data else None
        # (only chats can have none: every reply of weight 0, the inputs untrained)
        for what, figures in (
            ("training data has no token to train on", train),
            ("validation data has no token to evaluate", held_out),
        ):
            if figures is not None and figures.target_tokens == 0:
                raise DataError(
                    "no_trained_tokens",
                    f"the {what}: every model (assistant) reply has weight 0; give some replies weight 1, or "
                    "set train_on_inputs to train on the rest",
                )
        self.reporter.send(
            DataReport(
                documents=train.documents,
                tokens=train.tokens,
                target_tokens=train.target_tokens,
                rows=train.rows,
                row_tokens=self.hyper.max_seq_len,
                pad_fraction=train.pad_fraction,
                steps_per_epoch=steps_per_epoch,
                total_steps=self.total_steps,
                validation_documents=held_out.documents if held_out else None,
                validation_tokens=held_out.tokens if held_out else None,
                preference_pairs=self.train_data.pairs,
            )
        )

    def execute(self) -> int:
        spec, hyper = self.spec, self.hyper
        self.status("loading the tokenizer and data", "loading")
        self.tokenizer = load_tokenizer(spec, self.options)
        self.train_data, self.eval_data = load_data(spec, self.tokenizer, self.options.data_shards)
        steps_per_epoch = agree(self.train_data.local_steps_per_epoch, np.min)
        self.train_data.use_steps_per_epoch(steps_per_epoch)
        epoch_steps = hyper.epochs * steps_per_epoch
        self.total_steps = epoch_steps if hyper.max_steps is None else min(hyper.max_steps, epoch_steps)
        self.eval_batches = agree(self.eval_data.num_batches, np.max) if self.eval_data else 0
        self._report_data(steps_per_epoch)

        self.mesh = make_mesh(spec.resources.slices)
        devices = self.mesh.size
        if hyper.batch_size % (devices * hyper.gradient_accumulation_steps):
            raise DataError(
                "batch_size_not_divisible",
                f"batch_size {hyper.batch_size} must be a multiple of {devices} devices times "
                f"{hyper.gradient_accumulation_steps} gradient accumulation steps",
            )
        self.model = gemma.build_model(
            spec.model,
            self.tokenizer.vocab_size,
            lora_rank=spec.method.lora_rank if spec.method.type == "lora" else None,
            param_dtype=jnp.dtype(self.options.param_dtype),
            compute_dtype=jnp.dtype(resolve_compute_dtype(self.options.compute_dtype)),
        )
        self.optimizer, schedule = make_optimizer(spec, self.total_steps)
        self.checkpoints = Checkpoints(self.config.output_uri, hyper.keep_checkpoints)
        try:
            return self._train(schedule)
        finally:
            self.checkpoints.close()

    def _setup_state(self) -> tuple[Params, Params, int]:
        """(state, frozen params, first step): from the latest checkpoint, else from the base weights."""
        abstract_trained, abstract_frozen = self.model.abstract_params()
        shardings = (tree_shardings(self.mesh, abstract_trained), tree_shardings(self.mesh, abstract_frozen))

        def new_state(params: Params) -> Params:
            return {
                "step": jnp.zeros((), jnp.int32),
                "params": params,
                "opt_state": self.optimizer.init(params),
            }

        abstract_state = jax.eval_shape(new_state, abstract_trained)
        self.state_shardings = tree_shardings(self.mesh, abstract_state)
        self.param_shardings = shardings
        # The state as a checkpoint restores it: shapes, dtypes and where each array goes.
        self.placed_state = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            abstract_state,
            self.state_shardings,
        )
        latest = self.checkpoints.latest_step()
        # A full dpo job's reference model is its initial weights, kept apart (as its `frozen`) from the
        # trained ones: `reference_logits`. (A LoRA job's is its frozen base.)
        full_reference = self.spec.method.needs_reference and self.model.lora_rank is None
        if latest is None:
            trained, frozen = self._initial_params(shardings)
            if full_reference:
                copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=shardings[0])
                frozen = copy(trained)
            state = jax.jit(new_state, out_shardings=self.state_shardings, donate_argnums=0)(trained)
            return state, frozen, 0
        # A resumed full fine-tune takes all its weights from the checkpoint; LoRA still needs the base, and
        # a full dpo job its reference, the weights it started from.
        if self.model.lora_rank is not None:
            frozen = self._initial_params(shardings)[1]
        else:
            frozen = self._initial_params(shardings, "the reference model: ")[0] if full_reference else {}
        state, position = self.checkpoints.restore(latest, self.placed_state)
        self.trained_tokens, self.last_step = int(position.get("trained_tokens", 0)), _step_figures(position)
        self.chosen_logp_start = position.get("chosen_logp_start")
        if position.get("best_eval_step") is not None:
            self.best_eval = (int(position["best_eval_step"]), float(position["best_eval_loss"]))
            self.stale_evals = int(position.get("stale_evals", 0))
        if position.get("lowest_eval_step") is not None:
            self.lowest_eval = Evaluated(
                int(position["lowest_eval_step"]),
                float(position["lowest_eval_loss"]),
                float(position["lowest_eval_accuracy"]),
                position.get("lowest_eval_chosen_reward"),
                position.get("lowest_eval_rejected_reward"),
            )
            if self.hyper.exports_best:
                self.checkpoints.keep(self.lowest_eval.step)
        self.status(
            f"resumed from the checkpoint at step {latest}", "loading", step=latest, resumed_from=latest
        )
        return state, frozen, latest

    def _initial_params(self, shardings: tuple[Any, Any], why: str = "") -> tuple[Params, Params]:
        """(trained, frozen) before training: the base weights, or a fresh adapter on the frozen base."""
        self.status(f"{why}loading the base weights of {self.spec.model}", "loading")
        seed = self.hyper.seed
        if self.spec.model == TINY_MODEL and self.spec.base_checkpoint_uri is None:
            if self.spec.adapter_uri is not None:
                raise gemma.ModelError(
                    "bad_adapter",
                    "the tiny model's base weights are random without base_checkpoint_uri: give the base "
                    "the adapter was trained on",
                )
            return self.model.init_params(seed, shardings)
        trained_shardings, frozen_shardings = shardings
        cache_dir = self.options.cache_dir
        if self.model.lora_rank is None:
            return gemma.load_base_params(self.spec, self.model, trained_shardings, cache_dir), {}
        base = gemma.load_base_params(self.spec, self.model, frozen_shardings, cache_dir)
        return self.model.init_lora(seed, trained_shardings), base

    def _train(self, schedule: optax.Schedule) -> int:
        hyper = self.hyper
        state, frozen, start = self._setup_state()
        rows = batch_sharding(self.mesh)
        self.status("compiling the train step", "compiling", step=start)
        local = self.train_data.batch(start)
        abstract_batch = {
            name: jax.ShapeDtypeStruct(
                (x.shape[0] * jax.process_count(), *x.shape[1:]), x.dtype, sharding=rows
            )
            for name, x in local.items()
        }
        stop_abstract = jax.ShapeDtypeStruct((self.mesh.size,), jnp.int32, sharding=rows)
        replicated = NamedSharding(self.mesh, P())
        step_fn = (
            jax.jit(
                make_train_step(
                    self.model,
                    self.optimizer,
                    schedule,
                    hyper.gradient_accumulation_steps,
                    objective(self.spec),
                ),
                out_shardings=(self.state_shardings, replicated),
                donate_argnums=0,
            )
            .lower(state, frozen, abstract_batch, stop_abstract)
            .compile()
        )
        self.eval_fn = jax.jit(
            make_eval_step(self.model, hyper.gradient_accumulation_steps, objective(self.spec)),
            out_shardings=replicated,
        )
        self.generate = gemma.make_generate(
            self.model, replicated, self.options.sample_tokens, self._stop_tokens()
        )
        eval_every, checkpoint_every = hyper.intervals(self.total_steps)
        if start == 0:
            self._sample(state, frozen, "before", 0)
            if self.eval_data is not None and eval_every is not None:
                # The baseline every later eval loss is read against (early stopping's first best).
                self._no_better(self._evaluate(state, frozen, 0))

        self.status(
            f"training for {self.total_steps - start} of {self.total_steps} steps", "training", step=start
        )
        started = time.monotonic()
        self._clock: tuple[float, float | None] = (started, None)
        pending: tuple[int, dict[str, jax.Array]] | None = None
        stop = STOP_NONE
        step = start
        while step < self.total_steps and stop == STOP_NONE:
            batch = global_batch(self.train_data.batch(step), rows)
            state, metrics = step_fn(state, frozen, batch, self._stop_flags(rows))
            if pending is not None:
                stop = self._record(*pending)
            pending = (step, metrics)
            step += 1
            checkpoint_due = _every(checkpoint_every, step)
            eval_due = self.eval_data is not None and _every(eval_every, step)
            if stop != STOP_NONE or step == self.total_steps or not (checkpoint_due or eval_due):
                continue
            # Read this step's metrics now, so its checkpoint report carries them.
            stop, pending = self._record(*pending), None
            early, new_lowest = None, False
            if stop == STOP_NONE and eval_due:
                now = self._evaluate(state, frozen, step)
                early, new_lowest = self._no_better(now), now is self.lowest_eval
            # export_best: the weights of each new lowest eval loss are saved, to be exported at the end.
            if stop == STOP_NONE and (checkpoint_due or (new_lowest and hyper.exports_best)):
                self._save(state, step)
            if early is not None:  # (every process saw the same eval loss: they all stop here)
                self.status(early, step=step)
                break
        if pending is not None:
            stop = max(stop, self._record(*pending))
        train_seconds = time.monotonic() - started

        if stop != STOP_NONE:
            self._save(state, step)
            if stop == STOP_PREEMPT:
                self.status(
                    f"stopped at step {step} on SIGTERM; the checkpoint there resumes the run", step=step
                )
                return EXIT_PREEMPTED
            if stop == STOP_PAUSE:  # (as a preemption: the run goes on from its checkpoint when resumed)
                self.status(f"paused by the user at step {step}; resumed, it goes on from there", step=step)
                return EXIT_PREEMPTED
            self.status(f"cancelled by the user at step {step}; a checkpoint was saved", step=step)
            return EXIT_OK

        evaluated = self.last_eval if self.last_eval is not None and self.last_eval.step == step else None
        if evaluated is None and self.eval_data is not None:
            evaluated = self._evaluate(state, frozen, step)
        if self.checkpoints.latest_step() != step:
            self._save(state, step)
        exported, lowest = step, self.lowest_eval
        if hyper.exports_best and lowest is not None and lowest.step != step:
            if lowest.step == 0 or lowest.step in self.checkpoints.steps():
                del state  # (its memory, before the lowest eval's weights are loaded)
                state, evaluated, exported = self._lowest_state(frozen), lowest, lowest.step
            else:  # (not kept: removed by hand)
                self.reporter.send(
                    WarningReport(
                        step=step,
                        message=f"export_best: the checkpoint of step {lowest.step}, of the lowest eval "
                        "loss, is gone; the weights exported are the last step's",
                    )
                )
        output = self._export(state, frozen, exported, step)
        self._sample(state, frozen, "after", step)
        self.reporter.send(
            ResultReport(
                step=step,
                exported_step=exported,
                output_uri=output,
                **self._figures(evaluated),
                trained_tokens=self.trained_tokens,
                train_seconds=train_seconds,
            )
        )
        return EXIT_OK

    def _stop_flags(self, sharding: NamedSharding) -> jax.Array:
        if self.signals.preempted.is_set():
            flag = STOP_PREEMPT
        elif self.reporter.pause_requested:
            flag = STOP_PAUSE
        elif self.reporter.cancel_requested:
            flag = STOP_CANCEL
        else:
            flag = STOP_NONE
        local = np.full(jax.local_device_count(), flag, dtype=np.int32)
        return jax.make_array_from_process_local_data(sharding, local, (self.mesh.size,))

    def _record(self, step: int, metrics: dict[str, jax.Array]) -> int:
        """Read one step's metrics (blocking until it is done), report them; returns the stop code."""
        values = {name: float(value) for name, value in jax.device_get(metrics).items()}
        if not math.isfinite(values["loss"]):
            raise LossNotFinite(step + 1, values["loss"])
        now = time.monotonic()
        last_time, step_seconds = self._clock
        elapsed = now - last_time
        # A smoothed step time for the ETA: steps vary with packing and host noise.
        step_seconds = elapsed if step_seconds is None else 0.9 * step_seconds + 0.1 * elapsed
        self._clock = (now, step_seconds)
        self.trained_tokens += int(values["tokens"])
        self.last_step = _step_figures(values)
        self.reporter.send(
            MetricsReport(
                step=step + 1,
                total_steps=self.total_steps,
                epoch=(step + 1) / self.train_data.steps_per_epoch,
                loss=values["loss"],
                accuracy=values["accuracy"],
                chosen_reward=values.get("chosen_reward"),
                rejected_reward=values.get("rejected_reward"),
                learning_rate=values["learning_rate"],
                grad_norm=values["grad_norm"],
                tokens_per_second=values["tokens"] / elapsed if elapsed > 0 else None,
                trained_tokens=self.trained_tokens,
                eta_seconds=max(0.0, (self.total_steps - step - 1) * step_seconds),
            )
        )
        return int(values["stop"])

    def _evaluate(self, state: Params, frozen: Params, step: int) -> Evaluated:
        assert self.eval_data is not None
        rows = batch_sharding(self.mesh)
        sums: Any = None
        for local in self.eval_data.eval_batches(self.eval_batches):
            batch_sums = jax.device_get(self.eval_fn(state["params"], frozen, global_batch(local, rows)))
            sums = batch_sums if sums is None else jax.tree.map(np.add, sums, batch_sums)
        total, count, correct, tokens, more = jax.tree.map(float, sums)
        chosen_logp = more.pop(CHOSEN_LOGP, None)
        means = {name: value / max(count, 1.0) for name, value in more.items()}  # (a dpo job's rewards)
        evaluated = Evaluated(step, total / max(count, 1.0), correct / max(count, 1.0), **means)
        if not math.isfinite(evaluated.loss):
            raise LossNotFinite(step, evaluated.loss, "eval loss")
        self.last_eval = evaluated
        if self.lowest_eval is None or evaluated.loss < self.lowest_eval.loss:
            self.lowest_eval = evaluated
            if self.hyper.exports_best:  # (its checkpoint, saved next: kept from that save on)
                self.checkpoints.keep(step)
        self.reporter.send(EvalReport(step=step, eval_tokens=int(tokens), **evaluated.reported()))
        if chosen_logp is not None:
            chosen_logp /= max(count, 1.0)
            if step == 0:
                self.chosen_logp_start = chosen_logp
            if self.chosen_logp_start is not None:
                self._watch_likelihood(step, chosen_logp - self.chosen_logp_start, evaluated.accuracy)
        return evaluated

    def _watch_likelihood(self, step: int, chosen_logratio: float, accuracy: float) -> None:
        """A dpo job's held-out chosen replies fallen well below the likelihood they had before training
        (`chosen_logratio`, nats a token, against its first eval): DPO and SimPO can widen the margin by
        making both replies less likely, until the model writes nonsense. Warn, once a run."""
        if self.warned_likelihood or chosen_logratio > -LIKELIHOOD_WARNING_NATS:
            return
        self.warned_likelihood = True
        self.reporter.send(
            WarningReport(
                step=step,
                key="likelihood",
                message=f"At step {step} the held-out chosen replies are {-chosen_logratio:.2f} nats a token "
                f"less likely than before training (pair accuracy {accuracy:.0%}: the margin widens as both "
                "replies grow less likely), and the model's text may no longer be fluent. Lower "
                "hyperparameters.learning_rate, or set method.rpo_alpha (1 keeps the chosen replies likely).",
            )
        )

    def _no_better(self, evaluated: Evaluated) -> str | None:
        """Early stopping: why the run stops now, if `early_stopping_patience` evals in a row have not
        bettered the best eval loss (by more than `early_stopping_threshold`)."""
        patience = self.hyper.early_stopping_patience
        if patience is None:
            return None
        if self.best_eval is None or evaluated.loss < self.best_eval[1] - self.hyper.early_stopping_threshold:
            self.best_eval, self.stale_evals = (evaluated.step, evaluated.loss), 0
            return None
        self.stale_evals += 1
        if self.stale_evals < patience:
            return None
        best_step, best = self.best_eval
        exported = (
            "those of the lowest eval loss"
            if self.hyper.exports_best
            else "this step's (the checkpoints list each eval's loss)"
        )
        return (
            f"stopping early at step {evaluated.step} of {self.total_steps}: {self.stale_evals} evals in a "
            f"row have not bettered the eval loss of step {best_step} ({best:.4f}); the weights exported are "
            f"{exported}"
        )

    def _lowest_state(self, frozen: Params) -> Params:
        """The state (its params) of the lowest eval loss, for export_best: from its checkpoint (kept), or
        at step 0 the initial weights. Sets the train figures to that step's."""
        lowest = self.lowest_eval
        assert lowest is not None
        self.checkpoints.wait()
        if lowest.step == 0:  # (the base model's: a fresh adapter on it, or the base weights again)
            self.last_step = {}
            if self.model.lora_rank is not None:
                return {"params": self.model.init_lora(self.hyper.seed, self.param_shardings[0])}
            if frozen:  # (a full dpo job's reference: its initial weights, in memory; not a second copy)
                return {"params": frozen}
            why = "the lowest eval loss was before training: "
            return {"params": self._initial_params(self.param_shardings, why)[0]}
        state, position = self.checkpoints.restore(lowest.step, self.placed_state)
        self.last_step = _step_figures(position)
        return state

    def _save(self, state: Params, step: int) -> None:
        best_step, best = self.best_eval if self.best_eval is not None else (None, None)
        lowest = self.lowest_eval
        position = {
            **self.train_data.position(step),
            "trained_tokens": self.trained_tokens,
            **self.last_step,
            "best_eval_step": best_step,
            "best_eval_loss": best,
            "stale_evals": self.stale_evals,
            "lowest_eval_step": lowest.step if lowest else None,
            "lowest_eval_loss": lowest.loss if lowest else None,
            "lowest_eval_accuracy": lowest.accuracy if lowest else None,
            "lowest_eval_chosen_reward": lowest.chosen_reward if lowest else None,
            "lowest_eval_rejected_reward": lowest.rejected_reward if lowest else None,
            "chosen_logp_start": self.chosen_logp_start,
        }
        self.checkpoints.save(step, state, position)
        evaluated = self.last_eval if self.last_eval is not None and self.last_eval.step == step else None
        self.reporter.send(
            CheckpointReport(
                step=step,
                uri=self.checkpoints.uri(step),
                kept=self.checkpoints.steps(),
                **self._figures(evaluated),
            )
        )

    def _figures(self, evaluated: Evaluated | None) -> dict[str, Any]:
        """What a checkpoint or result reports of the weights it holds: their last step's figures, and
        those of `evaluated` (their step's eval), if any."""
        held_out = evaluated.reported() if evaluated else {}
        return {**self.last_step, **held_out}

    def _export(self, state: Params, frozen: Params, weights_step: int, step: int) -> str:
        """Write the weights of step `weights_step` (the run ended at `step`) under `{output_uri}/final`;
        returns that URI."""
        if weights_step == step:
            self.status("exporting the final weights", "exporting", step=step)
        else:
            assert self.lowest_eval is not None
            self.status(
                f"exporting the weights of step {weights_step}, of the lowest eval loss "
                f"({self.lowest_eval.loss:.4f}); the run ended at step {step}",
                "exporting",
                step=step,
            )
        final = join(self.config.output_uri, "final")
        method = self.spec.method
        exported: dict[str, str] = {}
        # Exported in the compute dtype, as the official checkpoints are.
        cast = jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(self.model.compute_dtype), tree))
        weights = None  # (the whole network's, cast: a LoRA job's with its adapter merged in)
        if method.type == "full":
            weights = cast(state["params"])
        else:
            adapter = cast(state["params"])
            export_params(adapter, join(final, "adapter"))
            exported["adapter"] = join(final, "adapter")
            if method.export_merged or method.export_hf or method.export_gguf:
                weights = cast(jax.jit(gemma.merge_lora)(frozen, state["params"]))
        if method.type == "full" or method.export_merged:
            export_params(weights, join(final, "params"))
            exported["params"] = join(final, "params")
        if method.export_hf or method.export_gguf:
            assert weights is not None
            formats = " and ".join(
                kind
                for kind, wanted in (("a Hugging Face model", method.export_hf), ("GGUF", method.export_gguf))
                if wanted
            )
            self.status(f"exporting the weights as {formats}", "exporting", step=step)
            exported |= export_formats(
                weights,
                adapter if method.type == "lora" else None,
                final,
                spec=self.spec,
                config=self.model.base.config,
                tokenizer=self.tokenizer,
                hf=method.export_hf,
                gguf=method.export_gguf,
                name=self.config.job_id,
            )
        if jax.process_index() == 0:
            write_json(
                join(final, "export.json"),
                {
                    "job_id": self.config.job_id,
                    "model": self.spec.model,
                    "method": method.model_dump(),
                    "step": weights_step,
                    "last_step": step,
                    "tokenizer_uri": self.spec.tokenizer_uri,
                    "base_checkpoint_uri": self.spec.base_checkpoint_uri,
                    "adapter_uri": self.spec.adapter_uri,  # (folded into that base before training)
                    "dtype": str(jnp.dtype(self.model.compute_dtype)),
                    **exported,
                },
            )
        return final

    def _stop_tokens(self) -> tuple[int, ...]:
        if self.spec.model.endswith("-it"):
            return (self.tokenizer.eos_id, self.tokenizer.end_of_turn_id)
        return (self.tokenizer.eos_id,)

    def _sample(self, state: Params, frozen: Params, phase: Any, step: int) -> None:
        prompts = self.spec.sample_prompts
        if not prompts:
            return
        texts = gemma.sample_texts(
            self.generate,
            state["params"],
            frozen,
            self.tokenizer,
            prompts,
            self.options.sample_tokens,
            chat=self.spec.model.endswith("-it"),
        )
        for index, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
            self.reporter.send(SampleReport(step=step, key=str(index), phase=phase, prompt=prompt, text=text))
