"""The progress contract between the worker and the API: `POST /jobs/{id}/progress`.

The worker (process 0 only) sends `Authorization: Bearer <TPUTUNE_JOB_TOKEN>` and a JSON body
`{"reports": [Report, ...]}` with 1-1000 reports. Each report has a `kind`, the training `step` it
belongs to and the fields of its kind. The API stores each report once per (job, kind, step, key):
a retried batch is harmless, so the worker retries a batch until it gets a 2xx, or a 4xx that says
the batch can never succeed. The response is `{"accepted": n, "duplicates": m, "job_status": s}`;
`job_status` lets the worker notice a cancel (`cancelling`) or a pause (`pausing`) without a second call.

Kinds:
- `status`:     a phase change or message (`message`, optional `phase` in loading|compiling|training|
                evaluating|saving|exporting); give each message at one step its own `key`, or it is
                taken for a retry of the first. The first report of any kind moves the job to `running`.
                A run that goes on from a checkpoint says so (`resumed_from`: its step) before any step.
- `metrics`:    one training step's figures (loss, token accuracy, learning rate, ...); the job's latest
                metrics and progress follow the highest step received.
- `eval`:       an eval loss (and token accuracy) at a step.
- `checkpoint`: a checkpoint saved (`uri`), with the metrics at that step and the steps of those kept.
- `sample`:     generated text for a prompt (`phase` before|after training).
- `result`:     the output URI and the figures of the weights it holds: the last step's, or with
                export_best those of the lowest eval loss (`exported_step`); the worker then exits 0.
- `error`:      why the run failed (`code`, `message`); the worker then exits non-zero.
- `warning`:    something the user should know that does not stop the run.

Text (messages, samples, keys, URIs) may hold any character; a NUL is stored as U+FFFD (PostgreSQL's
text cannot hold it), not refused: the batch is not lost.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

MAX_REPORTS_PER_BATCH = 1000
# What the API's columns hold (PostgreSQL's INTEGER and BIGINT): a report past them is refused (422).
MAX_STEP = 2**31 - 1
MAX_COUNT = 2**63 - 1


# The share of a step's (or an eval's) target tokens the model ranked first (OpenAI's mean token accuracy).
Accuracy = Annotated[float, Field(ge=0, le=1)]


def _replace_nul(value: object) -> object:
    return value.replace("\x00", "\ufffd") if isinstance(value, str) else value


# The worker's text: a NUL (a sample decoded from a byte token, a message quoting the data) is replaced
# with U+FFFD, not refused: PostgreSQL's text cannot hold it, and a refused batch would lose its reports.
Reported = Annotated[str, BeforeValidator(_replace_nul)]


class _Report(BaseModel):
    # No infinity or NaN anywhere (PostgreSQL's JSON cannot hold them, nor can a browser's JSON.parse), but
    # a loss or gradient norm that diverged: stored as missing (see _nan_to_none).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    step: Annotated[int, Field(ge=0, le=MAX_STEP)] = 0
    key: Annotated[Reported, Field(max_length=64)] = Field(
        default="", description="Tells apart reports of one kind at one step (e.g. one per prompt)."
    )
    time: float | None = Field(default=None, description="Unix time the worker made the report.")


class StatusReport(_Report):
    kind: Literal["status"] = "status"
    phase: Literal["loading", "compiling", "training", "evaluating", "saving", "exporting"] | None = None
    message: Annotated[Reported, Field(max_length=2000)]
    resumed_from: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = Field(
        default=None,
        description="This run goes on from its checkpoint at this step: what an earlier run reported of "
        "the steps after it (a crash's since its last checkpoint) is dropped, and the job's progress goes "
        "back to it; this run's reports of those steps take their place.",
    )


def _finite_or_none(value: object) -> object:
    """A float that is not finite (NaN, infinity) as missing."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


_CHOSEN_REWARD = (
    "A dpo job's: the mean over the pairs of the chosen reply's reward, beta times how much more likely the "
    "model makes it than the weights it started from (log-probability ratio; SimPO: beta times its mean "
    "log-probability a token). Falling below 0: the chosen replies grow less likely too."
)
_REJECTED_REWARD = "A dpo job's: the same for the rejected replies; the gap to the chosen's is the margin."
# A dpo job's rewards, training and held out: in checkpoint and result reports, the figures of the weights
# they hold.
REWARDS = ("chosen_reward", "rejected_reward", "eval_chosen_reward", "eval_rejected_reward")


class MetricsReport(_Report):
    kind: Literal["metrics"] = "metrics"
    total_steps: Annotated[int, Field(ge=1, le=MAX_STEP)] | None = None
    epoch: Annotated[float, Field(ge=0)] | None = None
    loss: float | None = Field(default=None, description="Mean loss over the step's real target tokens.")
    accuracy: Accuracy | None = Field(
        default=None, description="The share of the step's target tokens the model ranked first."
    )
    chosen_reward: float | None = Field(default=None, description=_CHOSEN_REWARD)
    rejected_reward: float | None = Field(default=None, description=_REJECTED_REWARD)
    learning_rate: float | None = None
    grad_norm: float | None = None
    tokens_per_second: Annotated[float, Field(ge=0)] | None = None
    trained_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = Field(
        default=None, description="Non-pad target tokens trained on so far (all processes)."
    )
    eta_seconds: Annotated[float, Field(ge=0)] | None = None

    # A NaN loss is reported as an error report; the metric itself is stored as missing.
    _nan_to_none = field_validator("loss", "grad_norm", "chosen_reward", "rejected_reward", mode="before")(
        _finite_or_none
    )


class EvalReport(_Report):
    kind: Literal["eval"] = "eval"
    eval_loss: float
    eval_accuracy: Accuracy | None = None
    eval_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None
    eval_chosen_reward: float | None = Field(default=None, description=_CHOSEN_REWARD)
    eval_rejected_reward: float | None = Field(default=None, description=_REJECTED_REWARD)

    _nan_to_none = field_validator("eval_chosen_reward", "eval_rejected_reward", mode="before")(
        _finite_or_none
    )


class CheckpointReport(_Report):
    """A checkpoint saved, with the metrics at its step; `kept`: the steps of the run's checkpoints kept
    once it is written (the last `keep_checkpoints`, and export_best's), the others removed."""

    kind: Literal["checkpoint"] = "checkpoint"
    uri: Annotated[Reported, Field(min_length=1, max_length=2048)]
    kept: Annotated[list[Annotated[int, Field(ge=0, le=MAX_STEP)]], Field(max_length=200)] | None = None
    loss: float | None = None
    eval_loss: float | None = None
    accuracy: Accuracy | None = None
    eval_accuracy: Accuracy | None = None
    chosen_reward: float | None = Field(default=None, description=_CHOSEN_REWARD)
    rejected_reward: float | None = Field(default=None, description=_REJECTED_REWARD)
    eval_chosen_reward: float | None = Field(default=None, description=_CHOSEN_REWARD)
    eval_rejected_reward: float | None = Field(default=None, description=_REJECTED_REWARD)

    _nan_to_none = field_validator(*REWARDS, mode="before")(_finite_or_none)


class SampleReport(_Report):
    kind: Literal["sample"] = "sample"
    phase: Literal["before", "after"]
    prompt: Annotated[Reported, Field(max_length=4000)]
    text: Annotated[Reported, Field(max_length=20000)]


class ResultReport(_Report):
    """The run succeeded: its export, and the figures of the weights exported (with export_best, those of
    the lowest eval loss, at `exported_step`; else the last step's)."""

    kind: Literal["result"] = "result"
    exported_step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None
    output_uri: Annotated[Reported, Field(max_length=2048)] | None = None
    loss: float | None = None
    eval_loss: float | None = None
    accuracy: Accuracy | None = None
    eval_accuracy: Accuracy | None = None
    chosen_reward: float | None = Field(default=None, description=_CHOSEN_REWARD)
    rejected_reward: float | None = Field(default=None, description=_REJECTED_REWARD)
    eval_chosen_reward: float | None = Field(default=None, description=_CHOSEN_REWARD)
    eval_rejected_reward: float | None = Field(default=None, description=_REJECTED_REWARD)
    trained_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None
    train_seconds: Annotated[float, Field(ge=0)] | None = None

    _nan_to_none = field_validator(*REWARDS, mode="before")(_finite_or_none)


class ErrorReport(_Report):
    kind: Literal["error"] = "error"
    code: Annotated[Reported, Field(min_length=1, max_length=64)]
    message: Annotated[Reported, Field(max_length=4000)]


class DataFigures(BaseModel):
    """What a job's data came to once read, tokenized and packed."""

    documents: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(description="Training documents.")
    tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(
        description="Their tokens, each document's bos and eos included."
    )
    target_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(
        description="Those that carry loss (a chat's prompts do not, unless `train_on_inputs`)."
    )
    rows: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(
        description="The rows of `row_tokens` they were packed into; a batch takes `batch_size` of them."
    )
    row_tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)] = Field(description="`max_seq_len`.")
    pad_fraction: Annotated[float, Field(ge=0, le=1)] = Field(description="Of the rows' tokens, padding.")
    steps_per_epoch: Annotated[int, Field(ge=0, le=MAX_COUNT)]
    total_steps: Annotated[int, Field(ge=0, le=MAX_COUNT)]
    validation_documents: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None
    validation_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = None
    preference_pairs: bool = Field(
        default=False,
        description="The documents are preference pairs (a dpo job's): each a prompt with a chosen and a "
        "rejected reply, its tokens both; `target_tokens` are the replies'.",
    )


class DataReport(_Report, DataFigures):
    """The job's DataFigures (each run sends them at step 0, once its data is packed)."""

    kind: Literal["data"] = "data"


class WarningReport(_Report):
    kind: Literal["warning"] = "warning"
    message: Annotated[Reported, Field(max_length=2000)]


Report = Annotated[
    StatusReport
    | MetricsReport
    | EvalReport
    | CheckpointReport
    | SampleReport
    | ResultReport
    | ErrorReport
    | WarningReport
    | DataReport,
    Field(discriminator="kind"),
]


class ProgressBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reports: Annotated[list[Report], Field(min_length=1, max_length=MAX_REPORTS_PER_BATCH)]


class ProgressAck(BaseModel):
    accepted: int
    duplicates: int
    job_status: str
