"""The API's wire format (a contract); tables live in api/models.py."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api import tpu
from api.models import Job, JobEvent, as_utc, job_spec, utcnow
from api.states import JobStatus
from worker.config import JobSpec, gguf_file_name
from worker.protocol import DataFigures

EXAMPLE_JOB: dict[str, Any] = {
    "name": "stories-lora",
    "model": "gemma3-270m-pt",
    "method": {"type": "lora", "lora_rank": 8},
    "dataset_uri": "gs://my-bucket/tinystories/train.txt",
    "validation_split": 0.01,
    "hyperparameters": {
        "epochs": 1,
        "batch_size": 32,
        "learning_rate": 0.0001,
        "lr_scheduler": "cosine",
        "warmup_ratio": 0.03,
        "max_seq_len": 512,
        "n_evals": 10,
        "n_checkpoints": 5,
    },
    "resources": {"accelerator": "v6e", "topology": "2x4"},
    "metadata": {"team": "research"},
}


class JobCreate(JobSpec):
    """A fine-tuning job as submitted (the same schema the worker reads)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [EXAMPLE_JOB]})


class ErrorBody(BaseModel):
    code: str = Field(description="Stable machine-readable code.")
    message: str = Field(description="What was wrong and what to do.")
    param: str | None = Field(default=None, description="The request field at fault, if one.")
    details: list[dict[str, Any]] | None = Field(default=None, description="Every field error, for 422s.")


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error answers a route can give (all share ErrorResponse)."""
    text = {
        400: "Bad request parameters.",
        401: "No API key, or an unknown, revoked or expired one.",
        403: "The key may not do this.",
        404: "No such job (or not one of your tenant's).",
        409: "Conflicts with the job's state or an earlier request.",
        413: "The body is too large.",
        422: "Invalid input; `error.code` says how and `error.details` lists every field.",
        429: "Too many requests, or followed streams, for this key or server; see Retry-After.",
        503: "The database is unreachable, or the server is shutting down; retry.",
    }
    return {code: {"model": ErrorResponse, "description": text[code]} for code in codes}


class JobProgress(BaseModel):
    step: int
    total_steps: int | None
    epoch: float | None
    fraction: float | None = Field(description="step / total_steps, 0..1.")
    eta_seconds: float | None


# A dpo job's rewards: in its metrics history, its job object and its checkpoints.
_CHOSEN_REWARD = (
    "A dpo job's: the mean reward of {when} chosen replies, beta times how much more likely the model "
    "makes them than the weights it started from (their log-probability ratio; SimPO: beta times their mean "
    "log-probability a token). Below 0: the chosen replies grow less likely too (`method.rpo_alpha` counters "
    "it). Null for other jobs."
)
_REJECTED_REWARD = "A dpo job's: the same for the rejected replies; the gap between the two is the margin."
_EVAL_CHOSEN_REWARD = "`chosen_reward` on the validation pairs."
_EVAL_REJECTED_REWARD = "`rejected_reward` on the validation pairs."


class JobMetrics(BaseModel):
    """While it runs, its latest step's and eval's figures; once it succeeded, those of the weights it
    exported (`exported_step`: with `export_best`, the lowest eval loss's step)."""

    loss: float | None
    eval_loss: float | None
    accuracy: float | None = Field(
        description="Token accuracy at the latest step: the share of its trained target tokens the model "
        "ranked first (0..1)."
    )
    eval_accuracy: float | None = Field(
        description="Token accuracy on the validation data at the latest eval."
    )
    chosen_reward: float | None = Field(description=_CHOSEN_REWARD.format(when="the latest step's"))
    rejected_reward: float | None = Field(description=_REJECTED_REWARD)
    eval_chosen_reward: float | None = Field(description=_EVAL_CHOSEN_REWARD + " (the latest eval's)")
    eval_rejected_reward: float | None = Field(description=_EVAL_REJECTED_REWARD + " (the latest eval's)")
    learning_rate: float | None
    tokens_per_second: float | None


class JobUsage(BaseModel):
    chips: int = Field(description="What it holds while it runs: TPU chips (every slice), or processes.")
    chip_unit: str = Field(description="What `chips` counts: `TPU chips` or (local executor) `processes`.")
    held_seconds: float = Field(
        description="How long it has held them: from its launch (or, where Kueue held it, its admission) "
        "until it ended, or now (as of at most 0.1 s before); not while it waited in the queue, before or "
        "after a preemption."
    )
    chip_hours: float = Field(
        description="`chips` times the hours it held them: what GET /usage counts for it (there, within the "
        "report's window)."
    )


class JobError(BaseModel):
    code: str
    message: str


class JobExports(BaseModel):
    """Where a job that succeeded left its weights, by what its spec asked for."""

    uri: str = Field(description="`{output_uri}/final`: all of them, and `export.json` (which step, ...).")
    params: str | None = Field(
        description="The whole model's weights (orbax, `gm.ckpts.load_params`): a full fine-tune's, or a "
        "LoRA job's with `method.export_merged`."
    )
    adapter: str | None = Field(description="LoRA: the adapter alone (orbax; a later job's `adapter_uri`).")
    hf: str | None = Field(
        description="With `method.export_hf`: a Hugging Face `Gemma3ForCausalLM` (safetensors, config, "
        "tokenizer), a LoRA job's with the adapter merged in."
    )
    hf_adapter: str | None = Field(description="LoRA with `method.export_hf`: the adapter for PEFT.")
    gguf: str | None = Field(
        description="With `method.export_gguf`: one GGUF file (`model-{type}.gguf`) for llama.cpp, ollama "
        "and LM Studio, a LoRA job's with the adapter merged in."
    )

    @classmethod
    def of(cls, output_uri: str, spec: JobSpec) -> JobExports:
        final = f"{output_uri.rstrip('/')}/final"
        method = spec.method
        lora = method.type == "lora"
        return cls.model_construct(
            uri=final,
            params=f"{final}/params" if not lora or method.export_merged else None,
            adapter=f"{final}/adapter" if lora else None,
            hf=f"{final}/hf" if method.export_hf else None,
            hf_adapter=f"{final}/hf_adapter" if lora and method.export_hf else None,
            gguf=f"{final}/{gguf_file_name(method.export_gguf)}" if method.export_gguf else None,
        )


class JobPublic(BaseModel):
    id: str
    object: str = "fine_tuning.job"
    tenant: str = Field(description="The tenant (team) the job belongs to: its API key's.")
    name: str
    status: str = Field(
        description="queued, starting, running, succeeded, failed or cancelled; cancelling while its "
        "workers stop, pausing and paused for a job paused (POST /jobs/{id}/pause) until resumed."
    )
    queue_position: int | None = Field(
        None,
        description="Of a queued job, in GET /jobs/{id} only (null in lists and other answers): its place "
        "in the queue, 1 for the next to start. Jobs start in the order they were submitted (a resumed job "
        "keeps its place), every team's, as each team's limits allow (a job behind its team's limit waits "
        "and the next starts: `status_message` says so). Counted: itself and the jobs ahead of it but other "
        "teams' held back by their own limits (they start after it). Null for a job the platform holds "
        "(Kueue: its quota decides; see `status_message`) and for any other status. With more than 1,000 "
        "jobs queued it may be a second old.",
    )
    status_message: str | None
    model: str
    method: str
    executor: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    progress: JobProgress
    metrics: JobMetrics
    trained_tokens: int
    data_stats: DataFigures | None = Field(
        description="What its training data came to, as its worker read, tokenized and packed it (null "
        "until then): documents, tokens, packed rows, padding, steps an epoch and in all."
    )
    restarts: int = Field(description="How often its workers were restarted (after a failure or preemption).")
    preemptions: int = Field(
        description="How often the platform (Kueue) stopped it while running to give its chips to other "
        "work: it waited `queued` again, and resumed from its last checkpoint once readmitted."
    )
    pauses: int = Field(
        description="How often it was paused (POST /jobs/{id}/pause): its workers saved a checkpoint and "
        "stopped, its chips were let go; once resumed, it continued from that checkpoint."
    )
    retries: int = Field(
        description="How often it was resumed after it failed (POST /jobs/{id}/resume): queued again, its "
        "new run went on from the last checkpoint the failed one saved."
    )
    usage: JobUsage = Field(description="What it has held: chips, and for how long.")
    error: JobError | None
    output_uri: str
    exported_step: int | None = Field(
        description="Of a job that succeeded: the step whose weights its export (`output_uri`/final) holds, "
        "its last or, with `hyperparameters.export_best`, the one of its lowest eval loss; else null."
    )
    exports: JobExports | None = Field(
        description="Of a job that succeeded: where its weights are; else null."
    )
    checkpoint_uri: str | None
    metadata: dict[str, str]
    spec: JobSpec

    @classmethod
    def of(cls, job: Job, spec: JobSpec | None = None) -> JobPublic:
        """`job` (a Job or a row with its columns) as the API shows it; `spec`: its spec if at hand (a
        new job's), else validated once and cached (`job_spec`)."""
        # Built without validation: every value comes from the database row, typed by the model, and
        # validating 50 jobs per page was a third of a list call's CPU time.
        spec = spec or job_spec(job)
        fraction = None
        if job.total_steps:
            fraction = min(1.0, job.step / job.total_steps)
        return cls.model_construct(
            id=job.id,
            tenant=job.tenant,
            name=job.name,
            status=job.status,
            status_message=job.status_message,
            model=job.model,
            method=job.method,
            executor=job.executor,
            created_at=as_utc(job.created_at),
            started_at=as_utc(job.started_at),
            finished_at=as_utc(job.finished_at),
            progress=JobProgress.model_construct(
                step=job.step,
                total_steps=job.total_steps,
                epoch=job.epoch,
                fraction=fraction,
                eta_seconds=job.eta_seconds,
            ),
            metrics=JobMetrics.model_construct(
                loss=job.loss,
                eval_loss=job.eval_loss,
                accuracy=job.accuracy,
                eval_accuracy=job.eval_accuracy,
                chosen_reward=job.chosen_reward,
                rejected_reward=job.rejected_reward,
                eval_chosen_reward=job.eval_chosen_reward,
                eval_rejected_reward=job.eval_rejected_reward,
                learning_rate=job.learning_rate,
                tokens_per_second=job.tokens_per_second,
            ),
            trained_tokens=job.trained_tokens,
            data_stats=_data_stats(job.data_stats),
            restarts=job.restarts,
            preemptions=job.preemptions,
            pauses=job.pauses,
            retries=job.retries,
            usage=job_usage(job, spec),
            error=(
                JobError.model_construct(code=job.error_code, message=job.error_message or "")
                if job.error_code
                else None
            ),
            output_uri=job.output_uri,
            exported_step=job.exported_step,
            exports=JobExports.of(job.output_uri, spec) if job.status == JobStatus.succeeded else None,
            checkpoint_uri=job.checkpoint_uri,
            metadata=spec.metadata,
            spec=spec,
        )


def _data_stats(stored: dict[str, Any] | str | None) -> DataFigures | None:
    """The job's data figures as stored (SQLite's reader gives JSON text; JSON's null, as a row written
    before the column said None is NULL, is none)."""
    figures = json.loads(stored) if isinstance(stored, str) else stored
    return DataFigures.model_construct(**figures) if figures else None


def held_seconds(job: Job) -> float:
    """How long `job` (a Job or a row with its columns) has held its chips: before it last let them go,
    then since it last took them (`admitted_at`), until it ended or now."""
    held = job.held_seconds or 0.0
    if (admitted := as_utc(job.admitted_at)) is not None:
        held += max(0.0, ((as_utc(job.finished_at) or utcnow()) - admitted).total_seconds())
    return held


def holding_now(job: Job) -> bool:
    """Whether `job` holds its chips now: its `usage` grows with the clock."""
    return job.admitted_at is not None and job.finished_at is None


def job_usage(job: Job, spec: JobSpec) -> JobUsage:
    chips = tpu.chips_of(spec.resources, job.executor)
    held, hours = usage_figures(chips, held_seconds(job))
    return JobUsage.model_construct(
        chips=chips, chip_unit=tpu.chip_unit(job.executor), held_seconds=held, chip_hours=hours
    )


def usage_figures(chips: int, held: float) -> tuple[float, float]:
    """`held_seconds` and `chip_hours` as a job's `usage` shows them."""
    return round(held, 3), round(chips * held / 3600, 4)


class JobPage(BaseModel):
    object: str = "list"
    data: list[JobPublic]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next page.")


class JobDeleted(BaseModel):
    """What DELETE /jobs/{id} answers (as OpenAI's deletes do)."""

    id: str
    object: Literal["job"] = "job"
    deleted: Literal[True] = True
    output_uri: str = Field(
        description="Where the job wrote its model and checkpoints: not deleted with it (delete them there)."
    )


class EventPublic(BaseModel):
    id: int
    created_at: datetime
    type: str = Field(
        description="status, metrics, eval, checkpoint, sample, result, restart, warning, error"
    )
    level: str
    message: str
    step: int | None
    data: dict[str, Any] | None

    @classmethod
    def of(cls, event: JobEvent | Any) -> EventPublic:
        """`event`: a JobEvent, or a row with its columns (`api.jobs.EVENT_COLUMNS`, as api.reader reads)."""
        return cls(
            id=event.id or 0,
            created_at=as_utc(event.created_at),  # type: ignore[arg-type]
            type=event.type,
            level=event.level,
            message=event.message,
            step=event.step,
            data=event.data,
        )


class EventPage(BaseModel):
    object: str = "list"
    data: list[EventPublic]
    has_more: bool
    next_after: int | None


class LogsResponse(BaseModel):
    job_id: str
    lines: list[str]
    truncated: bool = Field(description="True when older lines were left out (see `tail`).")
    saved_at: datetime | None = Field(
        default=None,
        description="Set when the lines are those saved as one of the job's runs ended (Kubernetes: its "
        "pods, and their logs, are gone): when they were saved.",
    )
    run: int | None = Field(
        default=None,
        description="Set with `saved_at`: which run's log this is. A job's first run is 0; each pause, and "
        "each resume after a failure, starts the next (a restart within a run does not).",
    )


class Health(BaseModel):
    status: str


class MetricPoint(BaseModel):
    step: int
    loss: float | None
    eval_loss: float | None
    accuracy: float | None
    eval_accuracy: float | None
    learning_rate: float | None
    grad_norm: float | None
    tokens_per_second: float | None
    trained_tokens: int | None
    epoch: float | None
    chosen_reward: float | None = Field(default=None, description=_CHOSEN_REWARD.format(when="the step's"))
    rejected_reward: float | None = Field(default=None, description=_REJECTED_REWARD)
    eval_chosen_reward: float | None = Field(default=None, description=_EVAL_CHOSEN_REWARD)
    eval_rejected_reward: float | None = Field(default=None, description=_EVAL_REJECTED_REWARD)


class MetricsPage(BaseModel):
    object: str = "list"
    job_id: str
    data: list[MetricPoint]
    has_more: bool = Field(
        description="More points past `limit`: ask again with min_step after the last one."
    )


class CheckpointMetrics(BaseModel):
    loss: float | None
    eval_loss: float | None
    accuracy: float | None
    eval_accuracy: float | None
    chosen_reward: float | None = Field(default=None, description=_CHOSEN_REWARD.format(when="its step's"))
    rejected_reward: float | None = Field(default=None, description=_REJECTED_REWARD)
    eval_chosen_reward: float | None = Field(
        default=None, description=_EVAL_CHOSEN_REWARD + " (its step's eval, if one ran then)"
    )
    eval_rejected_reward: float | None = Field(
        default=None, description=_EVAL_REJECTED_REWARD + " (its step's eval, if one ran then)"
    )


class CheckpointPublic(BaseModel):
    step: int
    uri: str | None
    kept: bool | None = Field(
        description="Whether it is still there: a job keeps its last `keep_checkpoints` (and with "
        "`export_best` its lowest eval loss's), as its worker last said; null where it did not say."
    )
    created_at: datetime
    metrics: CheckpointMetrics


class CheckpointList(BaseModel):
    object: str = "list"
    job_id: str
    data: list[CheckpointPublic]
