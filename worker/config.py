"""The job spec: one schema shared by the API (what users POST and what is stored) and the worker
(what `python -m worker --config job.json` reads). Pure pydantic: importing it never imports JAX.

Checks that need the service's settings (allowed local roots, whether the tiny model is enabled, the
TPU catalogue) live in the API; what is checked here holds for every deployment.
"""

from __future__ import annotations

import math
import posixpath
import re
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

GEMMA3_SIZES = ("270m", "1b", "4b", "12b", "27b")
MODELS: tuple[str, ...] = tuple(f"gemma3-{size}-{kind}" for size in GEMMA3_SIZES for kind in ("pt", "it"))
TINY_MODEL = "tiny"

DEFAULT_SAMPLE_PROMPT = "Once upon a time, there was a girl named Amy."

# Exit codes the worker uses; the executors map them to job states (and JobSet failure rules).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 65  # bad data or config: fail at once, never retry
EXIT_PREEMPTED = 75  # SIGTERM: a checkpoint was saved, restart and resume

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def check_text(value: str) -> str:
    """Refuse the NUL character: PostgreSQL's text cannot hold it (SQLite's can), and a path cannot."""
    if "\x00" in value:
        raise PydanticCustomError("nul_character", "must not contain the NUL character (\\u0000); remove it")
    return value


Text = Annotated[str, AfterValidator(check_text)]


class _Strict(BaseModel):
    # No infinity or NaN in any number (1e999 is infinity): PostgreSQL's JSON cannot hold them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# The types of a GGUF export's matrices (`method.export_gguf`): llama.cpp's converter's own choices.
GgufType = Literal["f32", "f16", "bf16", "q8_0"]
GGUF_TYPES: tuple[str, ...] = get_args(GgufType)


def gguf_file_name(outtype: str) -> str:
    """A GGUF export's file name under a job's `{output_uri}/final`: `model-q8_0.gguf`."""
    return f"model-{outtype}.gguf"


DEFAULT_DPO_BETA = 0.1
# A dpo job's learning rate where its spec gives none, by method type. At SFT's, DPO and SimPO widen the
# margin by making every reply far less likely, until the model no longer writes fluent text: on Gemma 3
# 270M (`bench/dpo.py`), a full job's held-out chosen replies fell 11.9 nats a token in 20 steps at 1e-4,
# 2.0 at 5e-6, none at 1e-6 (88% of pairs preferred rightly, from 75%); a LoRA job's 2.3 in 60 steps at
# 5e-5, 0.2 at 2e-5 (92%). (TRL's DPO default is 1e-6.)
DPO_DEFAULT_LEARNING_RATES = {"lora": 2e-5, "full": 1e-6}  # (Hyperparameters.learning_rate says so)


class Method(_Strict):
    """Full fine-tune or LoRA; supervised or on preferences (DPO)."""

    type: Literal["full", "lora"] = "full"
    objective: Literal["sft", "dpo"] = Field(
        default="sft",
        description="`sft`: learn the data's texts, replies and completions (supervised fine-tuning). `dpo`: "
        "learn which of two replies to a prompt is preferred (Direct Preference Optimization, as OpenAI's "
        "and Together's `dpo` method): the data holds preference pairs, the loss and accuracy are the "
        "pairs', measured against the weights the job starts from.",
    )
    dpo_beta: Annotated[float, Field(gt=0, le=10)] | None = Field(
        default=None,
        description="DPO only: how far the model may move from the weights it starts from to follow the "
        "preferences (lower: further); default 0.1.",
    )
    rpo_alpha: Annotated[float, Field(ge=0, le=100)] | None = Field(
        default=None,
        description="DPO only: also train on the chosen reply, this weight times its negative log-likelihood "
        "a token (RPO, as Together's `rpo_alpha`): DPO alone can make both replies less likely while it "
        "widens the gap between them. Default off.",
    )
    dpo_normalize_logratios_by_length: bool = Field(
        default=False,
        description="DPO only: each reply's log-probability ratio a token, not summed over its tokens (as "
        "Together's): a long reply does not weigh more for being long.",
    )
    simpo_gamma: Annotated[float, Field(ge=0, le=100)] | None = Field(
        default=None,
        description="DPO only: above 0, SimPO (as Together's `simpo_gamma`): no reference model, each "
        "reply's reward is beta times its mean log-probability a token, and the chosen must beat the "
        "rejected by this margin; cheaper than DPO (no reference's forward pass, and a full job keeps no "
        "second copy of the weights). SimPO's paper used beta 2 to 10, simpo_gamma about half of beta. 0 or "
        "unset: off.",
    )
    lora_rank: Annotated[int, Field(ge=1, le=1024)] | None = Field(
        default=None, description="LoRA rank; default 8 for `lora`, must be unset for `full`."
    )
    export_merged: bool = Field(
        default=False, description="LoRA only: also export the base weights with the adapter merged in."
    )
    export_hf: bool = Field(
        default=False,
        description="Also export the weights as a Hugging Face model (`Gemma3ForCausalLM`: safetensors, "
        "config and tokenizer) under `{output_uri}/final/hf`, for transformers, vLLM and the tools that read "
        "it; a LoRA job's with the adapter merged in, and its adapter alone for PEFT under "
        "`final/hf_adapter`.",
    )
    export_gguf: GgufType | None = Field(
        default=None,
        description="Also export the weights as one GGUF file, its matrices in this type, for llama.cpp, "
        "ollama and LM Studio: `{output_uri}/final/model-{type}.gguf` (a LoRA job's with the adapter merged "
        "in), with the tokenizer and Gemma's chat template. `q8_0` is a quarter of `f32`'s size; smaller "
        "quantizations are llama.cpp's `llama-quantize` on this file.",
    )

    @model_validator(mode="after")
    def _rank_matches_type(self) -> Method:
        if self.type == "full":
            if self.lora_rank is not None:
                raise ValueError("lora_rank is only valid with method type 'lora'")
            if self.export_merged:
                raise ValueError("export_merged is only valid with method type 'lora'")
        elif self.lora_rank is None:
            self.lora_rank = 8
        for name in ("dpo_beta", "rpo_alpha", "simpo_gamma", "dpo_normalize_logratios_by_length"):
            value = getattr(self, name)
            if self.objective == "sft" and value is not None and value is not False:
                raise PydanticCustomError(
                    "conflicting_fields",
                    f"{name} is only valid with objective 'dpo': drop it, or set objective dpo",
                )
        if self.objective == "dpo" and self.dpo_beta is None:
            self.dpo_beta = DEFAULT_DPO_BETA
        return self

    @property
    def simpo(self) -> bool:
        """A dpo job's loss is SimPO's: reference-free, each reply's log-probability a token."""
        return self.objective == "dpo" and bool(self.simpo_gamma)

    @property
    def needs_reference(self) -> bool:
        """Its loss measures the model against the weights it starts from (DPO, not SimPO)."""
        return self.objective == "dpo" and not self.simpo


class Hyperparameters(_Strict):
    epochs: Annotated[int, Field(ge=1, le=1000)] = 1
    max_steps: Annotated[int, Field(ge=1, le=10_000_000)] | None = Field(
        default=None, description="Stop after this many optimizer steps (overrides `epochs` when smaller)."
    )
    batch_size: Annotated[int, Field(ge=1, le=65_536)] = Field(
        default=8, description="Global batch size in packed rows of `max_seq_len` tokens."
    )
    gradient_accumulation_steps: Annotated[int, Field(ge=1, le=1024)] = 1
    learning_rate: Annotated[float, Field(gt=0, le=1)] = Field(
        default=1e-4,
        description="The peak learning rate (after any warmup). Default 1e-4; a dpo job's (DPO and SimPO) "
        "2e-5 for LoRA, 1e-6 for a full fine-tune.",
    )
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field(
        default="cosine",
        description="The learning rate after the warmup: a cosine or linear decay from `learning_rate` to "
        "`min_lr_ratio` times it at the last step, or constant.",
    )
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] | None = Field(
        default=None,
        description="Where a decaying `lr_scheduler` ends, as a fraction of `learning_rate` (default 0.1).",
    )
    warmup_steps: Annotated[int, Field(ge=0, le=1_000_000)] = Field(
        default=0, description="Steps of linear warmup from 0 to `learning_rate`."
    )
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        default=None,
        description="The warmup as a fraction of the job's steps, rounded (instead of `warmup_steps`).",
    )
    weight_decay: Annotated[float, Field(ge=0, le=1)] = 0.0
    max_grad_norm: Annotated[float, Field(gt=0)] | None = 1.0  # (None: no clipping)
    max_seq_len: Annotated[int, Field(ge=8, le=131_072)] = 512
    train_on_inputs: bool = Field(
        default=False,
        description="Chat data: train on every turn's tokens (the user's and the system prompt too), not "
        "only the model's replies. Plain text is trained whole either way.",
    )
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    eval_every_steps: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    n_evals: Annotated[int, Field(ge=1, le=10_000)] | None = Field(
        default=None,
        description="Evals spread evenly over the run, the last at its end (instead of `eval_every_steps`, "
        "for a run whose steps you do not know before its data is read).",
    )
    checkpoint_every_steps: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    n_checkpoints: Annotated[int, Field(ge=1, le=10_000)] | None = Field(
        default=None,
        description="Checkpoints spread evenly over the run, the last at its end (instead of "
        "`checkpoint_every_steps`).",
    )
    keep_checkpoints: Annotated[int, Field(ge=1, le=100)] = 3
    early_stopping_patience: Annotated[int, Field(ge=1, le=1000)] | None = Field(
        default=None,
        description="Stop once this many evals in a row have not lowered the eval loss (by more than "
        "`early_stopping_threshold`) below its best; the job then succeeds with the weights it has, "
        "its steps short of `total_steps`. Needs validation data and evals.",
    )
    early_stopping_threshold: Annotated[float, Field(ge=0)] = Field(
        default=0.0, description="How much lower than the best an eval loss must be to count as better."
    )
    export_best: bool | None = Field(
        default=None,
        description="Export the weights of the eval with the lowest eval loss, not the last step's: a "
        "checkpoint is saved at each new lowest and kept past `keep_checkpoints` until a lower one. Default: "
        "on with `early_stopping_patience`, else off. Needs validation data and evals.",
    )

    @property
    def exports_best(self) -> bool:
        """Whether the run exports the weights of its lowest eval loss (`export_best`, as defaulted)."""
        return self.early_stopping_patience is not None if self.export_best is None else self.export_best

    def intervals(self, total_steps: int) -> tuple[int | None, int | None]:
        """(steps between evals, steps between checkpoints) in a run of `total_steps`: given, or
        `n_evals` / `n_checkpoints` spread evenly (the last at the end, where a run always does both)."""

        def spread(count: int | None) -> int | None:
            return None if count is None else max(1, math.ceil(total_steps / count))

        return (
            self.eval_every_steps or spread(self.n_evals),
            self.checkpoint_every_steps or spread(self.n_checkpoints),
        )

    @model_validator(mode="after")
    def _one_of_each_and_a_decay_to_end(self) -> Hyperparameters:
        for every, count in (
            ("warmup_steps", "warmup_ratio"),
            ("eval_every_steps", "n_evals"),
            ("checkpoint_every_steps", "n_checkpoints"),
        ):
            if getattr(self, every) and getattr(self, count) is not None:
                raise PydanticCustomError("conflicting_fields", f"give {every} or {count}, not both")
        if self.lr_scheduler == "constant" and self.min_lr_ratio is not None:
            raise PydanticCustomError(
                "conflicting_fields",
                "min_lr_ratio is where a decay ends, and a constant lr_scheduler has none: drop it, or "
                "pick lr_scheduler cosine or linear",
            )
        return self


class Resources(_Strict):
    """Where the job runs: a TPU shape on Kubernetes, or a number of local processes."""

    accelerator: Literal["v5e", "v5p", "v6e"] | None = Field(
        default=None, description="TPU generation (Kubernetes executor)."
    )
    topology: Text | None = Field(
        default=None, description="TPU slice topology, e.g. `2x4` or `2x2x2` (Kubernetes executor)."
    )
    slices: Annotated[int, Field(ge=1, le=64)] = 1
    processes: Annotated[int, Field(ge=1, le=64)] | None = Field(
        default=None, description="Local executor: number of JAX processes (default 1)."
    )

    @model_validator(mode="after")
    def _topology_needs_accelerator(self) -> Resources:
        if self.topology is not None and self.accelerator is None:
            raise ValueError("topology needs an accelerator")
        return self


DATASET_SUFFIXES = (".txt", ".jsonl", ".parquet")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")  # (dotted names up to 222, each part up to 63)


def check_uri(value: str) -> str:
    """Accept `gs://bucket/path` or an absolute local path without `..`.

    Errors carry a stable code (the pydantic error type), which the API returns as the error code.
    """
    check_text(value)
    if value.startswith("gs://"):
        bucket, _, path = value[len("gs://") :].partition("/")
        if not bucket or not path.strip("/"):
            raise PydanticCustomError(
                "invalid_uri",
                "a gs:// URI needs a bucket and an object path, like gs://bucket/data/train.jsonl",
            )
        _check_segments(value, "path")
        return value
    if "://" in value or value.startswith("file:"):
        scheme = value.split(":", 1)[0]
        raise PydanticCustomError(
            "unsupported_uri_scheme",
            "the '{scheme}' scheme is not supported; use gs://bucket/path or an absolute local path",
            {"scheme": scheme},
        )
    if not value.startswith("/"):
        raise PydanticCustomError("invalid_uri", "a local path must be absolute, like /data/train.jsonl")
    _check_segments(value, "path")
    return posixpath.normpath(value)


TENANT = "{tenant}"  # in a prefix, a service account's name or the output base: the job's team's name


def for_tenant(template: str, tenant: str) -> str:
    """`template` (a data prefix, the workers' service account, the output base) for `tenant`."""
    return template.replace(TENANT, tenant)


def check_prefix(value: str) -> str:
    """A place jobs may read or write under: gs://bucket[/path] or an absolute local directory, `{tenant}`
    standing for a team's name (a whole segment or part of one: gs://ml-{tenant}/data); without its
    trailing '/'. What is under it: the place itself and what follows it after a '/'. Judged as a URI is
    (check_uri), with any team's name in it."""
    check_text(value)
    sample = for_tenant(value, "team")
    if "{" in sample or "}" in sample:
        raise PydanticCustomError(
            "invalid_prefix", "only {tenant} may stand for something in a prefix, like gs://data/{tenant}"
        )
    if not sample.startswith(("gs://", "/")):
        raise PydanticCustomError(
            "invalid_prefix", "a prefix is gs://bucket/path or an absolute local directory, like /data/team"
        )
    _check_segments(sample, "prefix")
    return value.rstrip("/") if sample.startswith("gs://") else posixpath.normpath(value)


def _check_segments(value: str, what: str) -> None:
    """The bucket of gs:// `value`, and no '.' or '..' segment in it (nor '..' in a local one): no path
    reaches another place through them (the pods read buckets through GCS FUSE, where '..' goes up)."""
    if value.startswith("gs://"):
        bucket, _, path = value[len("gs://") :].partition("/")
        check_bucket(bucket)
        if {".", ".."} & set(path.split("/")):
            raise PydanticCustomError(
                "path_traversal", f"a gs:// {what} must not contain '.' or '..' segments"
            )
    elif ".." in value.split("/"):
        raise PydanticCustomError("path_traversal", f"a local {what} must not contain '..'")


def check_bucket(bucket: str) -> None:
    """A Cloud Storage bucket name. (The pods mount each bucket at /gcs/<bucket>: a bad name failed there,
    after the wait for TPUs.)"""
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or any(len(p) > 63 for p in bucket.split(".")):
        raise PydanticCustomError(
            "invalid_uri",
            "'{bucket}' is not a Cloud Storage bucket name: 3-63 lowercase letters, digits, '-', '_' or "
            "'.', starting and ending with a letter or digit",
            {"bucket": bucket},
        )


def check_dataset_uri(value: str) -> str:
    value = check_uri(value)
    if not value.lower().endswith(DATASET_SUFFIXES):
        raise PydanticCustomError(
            "unsupported_dataset_format",
            "a dataset must be a .txt (documents separated by <|endoftext|>), .jsonl or .parquet file",
        )
    return value


Uri = Annotated[str, Field(min_length=1, max_length=2048)]


class JobSpec(_Strict):
    """A fine-tuning job as submitted to `POST /jobs`."""

    name: Annotated[Text, Field(min_length=1, max_length=128)]
    model: str = Field(description="`gemma3-{270m,1b,4b,12b,27b}-{pt,it}` (or `tiny` where enabled).")
    base_checkpoint_uri: Uri | None = Field(
        default=None,
        description="The base weights: an orbax checkpoint dir of params, a tputune checkpoint of a full "
        "fine-tune (`…/checkpoints/<step>`), a `.gguf` file or a Hugging Face model directory (`config.json` "
        "and safetensors); default: the official ones.",
    )
    adapter_uri: Uri | None = Field(
        default=None,
        description="A LoRA adapter folded into the base weights before training: a LoRA job's export "
        "(`…/final/adapter`) or checkpoint (`…/checkpoints/<step>`), of the same base weights. `from_job` "
        "sets it for a LoRA job's weights.",
    )
    tokenizer_uri: Uri | None = Field(
        default=None,
        description="A SentencePiece model, or a `.gguf` file (its tokenizer); default: a GGUF base's own, "
        "else the official Gemma 3 tokenizer.",
    )
    from_job: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$")] | None = Field(
        default=None,
        description="Start from the weights of an earlier job of your team (its id), the same model: its "
        "final export (a job that succeeded), or with `from_step` its checkpoint at that step. They become "
        "`base_checkpoint_uri` (a LoRA job's: its base, and its adapter `adapter_uri`); its tokenizer is "
        "the default.",
    )
    from_step: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = Field(
        default=None,
        description="With `from_job`: start from that job's checkpoint at this step (one it saved and still "
        "keeps: GET /jobs/{id}/checkpoints), from a job that succeeded, failed, was cancelled or still "
        "runs.",
    )
    method: Method = Field(default_factory=Method)
    dataset_uri: Uri = Field(
        description="`gs://bucket/path` or an absolute local path (.txt, .jsonl, .parquet)."
    )
    validation_uri: Uri | None = None
    validation_split: Annotated[float, Field(gt=0, lt=1)] | None = Field(
        default=None,
        description="Fraction of the dataset held out for eval loss (instead of validation_uri).",
    )
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    resources: Resources = Field(default_factory=Resources)
    output_uri: Uri | None = Field(
        default=None, description="Where checkpoints and the final weights go; default a per-job location."
    )
    sample_prompts: Annotated[
        list[Annotated[Text, Field(min_length=1, max_length=2000)]], Field(max_length=8)
    ] = Field(default_factory=lambda: [DEFAULT_SAMPLE_PROMPT])
    stall_minutes: Annotated[float, Field(gt=0, le=1440)] | None = Field(
        default=None,
        description="Minutes its running workers may report nothing (they report every step) before the "
        "server takes the run for stalled and starts it again from its last checkpoint; default the "
        "server's (TPUTUNE_STALL_MINUTES). For a model whose first step compiles, or an eval or export, for "
        "longer.",
    )
    metadata: dict[str, str] = Field(default_factory=dict, description="Up to 16 string pairs of your own.")

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value not in MODELS and value != TINY_MODEL:
            raise PydanticCustomError(
                "unknown_model",
                "unknown model '{model}'; use one of {models}",
                {"model": value, "models": ", ".join(MODELS)},
            )
        return value

    @field_validator("dataset_uri", "validation_uri")
    @classmethod
    def _dataset(cls, value: str | None) -> str | None:
        return None if value is None else check_dataset_uri(value)

    @field_validator("output_uri", "base_checkpoint_uri", "adapter_uri", "tokenizer_uri")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        return None if value is None else check_uri(value)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} metadata pairs")
        for key, item in value.items():
            if not key or len(key) > MAX_METADATA_KEY:
                raise ValueError(f"metadata keys must be 1-{MAX_METADATA_KEY} characters")
            if len(item) > MAX_METADATA_VALUE:
                raise ValueError(f"metadata values must be at most {MAX_METADATA_VALUE} characters")
            check_text(key)
            check_text(item)
        return value

    @model_validator(mode="after")
    def _one_validation_source_and_evals_where_needed(self) -> JobSpec:
        if self.validation_uri is not None and self.validation_split is not None:
            raise ValueError("give validation_uri or validation_split, not both")
        if self.from_step is not None and self.from_job is None:
            raise PydanticCustomError(
                "from_step_needs_from_job", "from_step is a step of the job from_job names: give from_job too"
            )
        hyper = self.hyperparameters
        if self.method.objective == "dpo" and "learning_rate" not in hyper.model_fields_set:
            hyper.learning_rate = DPO_DEFAULT_LEARNING_RATES[self.method.type]
        if self.method.objective == "dpo" and hyper.train_on_inputs:
            raise PydanticCustomError(
                "conflicting_fields",
                "train_on_inputs trains on the prompts, and a dpo job compares replies to the same prompt: "
                "drop train_on_inputs, or use objective sft",
            )
        evals = (self.validation_uri is not None or self.validation_split is not None) and (
            hyper.eval_every_steps is not None or hyper.n_evals is not None
        )
        if hyper.early_stopping_patience is not None and not evals:
            raise PydanticCustomError(
                "early_stopping_needs_evals",
                "early_stopping_patience counts evals of the eval loss: give validation_uri or "
                "validation_split, and hyperparameters.eval_every_steps or n_evals",
            )
        if hyper.export_best and not evals:
            raise PydanticCustomError(
                "export_best_needs_evals",
                "export_best picks the weights of the lowest eval loss: give validation_uri or "
                "validation_split, and hyperparameters.eval_every_steps or n_evals",
            )
        return self


class WorkerConfig(_Strict):
    """What the executor hands the worker: the spec plus where this run writes and reports."""

    job_id: str
    spec: JobSpec
    output_uri: str = Field(description="Resolved output location (local dir or gs://).")


# The worker reads where to report from its environment, never from the config file:
ENV_API_URL = "TPUTUNE_API_URL"  # base URL of the API; unset runs standalone (reports go to the log)
ENV_JOB_TOKEN = "TPUTUNE_JOB_TOKEN"  # per-job bearer token for POST /jobs/{id}/progress
ENV_JOB_ID = "TPUTUNE_JOB_ID"
# Where GCS FUSE mounts buckets in the pod (one dir per bucket): the worker reads gs:// data there.
ENV_GCS_FUSE_ROOT = "TPUTUNE_GCS_FUSE_ROOT"
