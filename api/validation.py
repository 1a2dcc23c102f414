"""Checks on a job spec that depend on this deployment's settings (the spec checks itself otherwise)."""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api import tpu
from api.errors import ApiError
from api.jobset import service_account, tpu_request
from api.models import job_spec
from api.settings import SERVICE_ACCOUNT, Settings
from worker.config import TENANT, TINY_MODEL, JobSpec, Resources, for_tenant

if TYPE_CHECKING:
    from api.tenants import Limits


def _under_roots(path: str, roots: list[Path]) -> bool:
    return _within(real_path(path), roots)


def _within(real: str, roots: list[Path]) -> bool:
    return any(real == str(root) or real.startswith(os.path.join(root, "")) for root in roots)


def real_path(path: str) -> str:
    """os.path.realpath(path), with the kernel's help: its directory opened with O_PATH and the name of that
    open file read back (/proc/self/fd), then its last component looked at there. realpath is a loop in
    Python with a system call per component: on a busy server the check of a job's dataset path took a
    quarter of POST /jobs's CPU time on the event loop; this is four system calls. The last component as
    realpath takes it: appended when it does not exist (a dataset not uploaded yet) or is not a symlink; a
    symlink, a path ending in . or .., and anything the kernel does not answer plainly go to realpath."""
    head, name = os.path.split(path)
    if _O_PATH_DIRECTORY is None or name in ("", ".", ".."):
        return os.path.realpath(path)
    try:
        fd = os.open(head or ".", _O_PATH_DIRECTORY)
    except OSError:  # no such directory (realpath resolves what exists of it), or not one
        return os.path.realpath(path)
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            link = False
    except OSError:
        return os.path.realpath(path)
    finally:
        os.close(fd)
    if link or not real.startswith("/") or real.endswith(" (deleted)"):  # unreachable from here, or removed
        return os.path.realpath(path)
    return os.path.join(real, name)


_O_PATH_DIRECTORY = (
    os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
    if hasattr(os, "O_PATH") and os.stat in os.supports_dir_fd and os.path.isdir("/proc/self/fd")
    else None
)


# The places a job reads and writes, by the spec's field.
URI_FIELDS = (
    "dataset_uri",
    "validation_uri",
    "output_uri",
    "base_checkpoint_uri",
    "adapter_uri",
    "tokenizer_uri",
)
# The fields `from_job` sets (api.jobs.resolve_from_job): another job's weights, of its own team's.
FROM_JOB_FIELDS = ("base_checkpoint_uri", "adapter_uri")


def output_roots(settings: Settings, tenant: str) -> list[str]:
    """The gs:// places of the jobs' own outputs (TPUTUNE_K8S_OUTPUT_BASE_URI), which a job reads only as
    `from_job`: the base, or with `{tenant}` in it the team's own and, where the teams' lie under one path
    (gs://outputs/tputune/{tenant}), that path."""
    base = (settings.k8s_output_base_uri or "").rstrip("/")
    if not base or TENANT not in base:
        return [base] if base else []
    head = base[: base.index(TENANT)]
    shared = [head.rstrip("/")] if head.endswith("/") and head != "gs://" else []
    return [for_tenant(base, tenant), *shared]


def check_local_paths(spec: JobSpec, settings: Settings, tenant: str) -> dict[str, str]:
    """ApiError if a path of `spec` is not one this server's jobs may use; returns the local ones as the
    kernel resolves them, by field."""
    resolved: dict[str, str] = {}
    fields = {field: getattr(spec, field) for field in URI_FIELDS}
    roots = settings.data_roots
    outputs = output_roots(settings, tenant)
    for field, uri in fields.items():
        if uri is None:
            continue
        # The jobs' own directories hold every team's runs and weights: a job reads another's only as
        # `from_job`, whose team the server checked (api.jobs.resolve_from_job), and writes only its own.
        own_export = field in FROM_JOB_FIELDS and spec.from_job is not None
        if uri.startswith("gs://"):
            inside = next((root for root in outputs if _under(uri, root)), None)
            if inside is not None and not own_export:
                raise _inside_jobs(field, uri, inside, "a gs:// path elsewhere")
            continue
        if settings.executor == "kubernetes":
            raise ApiError(
                422,
                "local_path_not_supported",
                f"{field}: {uri} is a local path, which TPU pods cannot see; use a gs://bucket/path URI.",
                param=field,
            )
        real = resolved[field] = real_path(uri)
        if not _within(real, roots):
            allowed = ", ".join(str(r) for r in roots)
            raise ApiError(
                422,
                "path_not_allowed",
                f"{field}: the local path {uri} is outside the allowed data roots ({allowed}); "
                "move the file under one of them, or add its directory to TPUTUNE_ALLOWED_DATA_ROOTS.",
                param=field,
            )
        if not own_export and _within(real, [settings.jobs_root]):
            raise _inside_jobs(field, uri, str(settings.jobs_dir), "an allowed data root")
    return resolved


def _inside_jobs(field: str, uri: str, jobs: str, elsewhere: str) -> ApiError:
    return ApiError(
        422,
        "path_not_allowed",
        f"{field}: {uri} is inside the server's job directories ({jobs}), which hold every team's runs; "
        f"to start from a job's weights use from_job, else move the file to {elsewhere}.",
        param=field,
    )


def check_resources(spec: JobSpec, settings: Settings) -> None:
    res = spec.resources
    if settings.executor == "kubernetes":
        check_tpu_resources(spec, settings)
        return
    if settings.executor == "local":
        if res.accelerator is not None or res.topology is not None or res.slices != 1:
            raise ApiError(
                422,
                "resources_not_supported",
                "This server runs jobs as local processes: leave out resources.accelerator, topology and "
                "slices, and set resources.processes instead.",
                param="resources",
            )
        processes = res.processes or 1
        if processes > settings.max_local_processes:
            raise ApiError(
                422,
                "too_many_processes",
                f"resources.processes is {processes}; this server allows at most "
                f"{settings.max_local_processes}.",
                param="resources.processes",
            )
        if spec.hyperparameters.batch_size % processes:
            raise ApiError(
                422,
                "batch_size_not_divisible",
                f"hyperparameters.batch_size ({spec.hyperparameters.batch_size}) must be a multiple of "
                f"resources.processes ({processes}) so every process gets the same number of rows.",
                param="hyperparameters.batch_size",
            )


def check_tpu_resources(spec: JobSpec, settings: Settings) -> None:
    res = spec.resources
    if res.processes is not None:
        raise ApiError(
            422,
            "resources_not_supported",
            "This server runs jobs on TPU slices: leave out resources.processes; the accelerator and "
            "topology decide the processes (one per TPU VM).",
            param="resources.processes",
        )
    try:
        tpus = tpu_request(spec, settings)
    except tpu.TpuShapeError as exc:
        raise ApiError(422, exc.code, exc.message, param=exc.param) from None
    hyper = spec.hyperparameters
    per_step = tpus.devices * hyper.gradient_accumulation_steps
    if hyper.batch_size % per_step:
        raise ApiError(
            422,
            "batch_size_not_divisible",
            f"hyperparameters.batch_size ({hyper.batch_size}) must be a multiple of {per_step}: the "
            f"{tpus.devices} TPU chips of {res.slices} x {res.accelerator} {res.topology} times "
            f"{hyper.gradient_accumulation_steps} gradient accumulation steps.",
            param="hyperparameters.batch_size",
        )
    if spec.output_uri is None and settings.k8s_output_base_uri is None:
        raise ApiError(
            422,
            "output_uri_required",
            "output_uri is required on this server (gs://bucket/path), as no default output location "
            "(TPUTUNE_K8S_OUTPUT_BASE_URI) is configured.",
            param="output_uri",
        )


def job_uris(spec: dict[str, Any]) -> dict[str, str]:
    """The places a job (its spec as stored) reads and writes, by field; its `from_job` weights left out
    (a job of its own team's, which the server checked: api.jobs.resolve_from_job)."""
    uris = {field: spec.get(field) for field in URI_FIELDS}
    if spec.get("from_job") is not None:
        for field in FROM_JOB_FIELDS:
            uris.pop(field)
    return {field: uri for field, uri in uris.items() if uri is not None}


def check_data_scope(
    uris: dict[str, str],
    settings: Settings,
    prefixes: Sequence[str] | None,
    resolved: dict[str, str] | None = None,
) -> None:
    """ApiError (422 path_not_allowed) if a job would read or write outside its team's data `prefixes`
    (api.tenants.Limits.data_prefixes; None: anywhere). It may also read under the shared read prefixes
    (the official weights). A local path is compared as the kernel resolves it (a symlink out is out;
    `resolved`: those check_local_paths resolved, by field)."""
    if prefixes is None:
        return
    for field, uri in uris.items():
        writes = field == "output_uri"
        allowed = [*prefixes] if writes else [*prefixes, *settings.shared_read_prefixes]
        if not uri.startswith("gs://"):
            real = (resolved or {}).get(field) or real_path(uri)
            inside = any(_under(real, _real_prefix(p)) for p in allowed if not p.startswith("gs://"))
        else:
            inside = any(_under(uri, p) for p in allowed if p.startswith("gs://"))
        if not inside:
            raise ApiError(
                422,
                "path_not_allowed",
                f"{field}: {uri} is outside where your team's jobs may {'write' if writes else 'read'} "
                f"({', '.join(allowed)}); move it under one of them, or ask your admin to give your team "
                "this place (PATCH /admin/tenants/{name}, data_prefixes).",
                param=field,
            )


def _under(uri: str, prefix: str) -> bool:
    """Whether `uri` is `prefix` or under it (a directory: gs://b/a holds gs://b/a/x, not gs://b/ab)."""
    prefix = prefix.rstrip("/")
    return uri == prefix or uri.startswith(f"{prefix}/")


@functools.lru_cache(maxsize=1024)
def _real_prefix(prefix: str) -> str:
    """A local prefix as the kernel resolves it, once a process (realpath cost 10 us a check; the teams'
    directories are set up before their jobs are submitted)."""
    return os.path.realpath(prefix)


def check_service_account(settings: Settings, tenant: str) -> None:
    """On Kubernetes with a service account for each team (`{tenant}`), the team's must be a valid name."""
    if settings.executor == "kubernetes" and TENANT in settings.k8s_worker_service_account:
        name = service_account(settings, tenant)
        if not SERVICE_ACCOUNT.fullmatch(name):
            raise ApiError(
                422,
                "tenant_name_not_allowed",
                f"Your team's jobs run as the Kubernetes service account {name!r}, which is not a valid name "
                "(lowercase letters, digits, '-' and '.'); ask your admin for a key of a team named so.",
            )


def check_spec(spec: JobSpec, settings: Settings, limits: Limits, tenant: str) -> None:
    """ApiError if `spec` does not fit this deployment, reads or writes outside its tenant's data prefixes,
    or needs more chips than its tenant's running jobs may hold at once (`limits`): it could never start."""
    chip_limit = limits.max_active_chips
    if spec.model == TINY_MODEL and not settings.allow_tiny_model:
        raise ApiError(
            422,
            "unknown_model",
            "The 'tiny' test model is not enabled on this server (TPUTUNE_ALLOW_TINY_MODEL); "
            "use a gemma3-* model.",
            param="model",
        )
    resolved = check_local_paths(spec, settings, tenant)
    if limits.data_prefixes is not None:
        fields = {field: getattr(spec, field) for field in (*URI_FIELDS, "from_job")}
        check_data_scope(job_uris(fields), settings, limits.data_prefixes, resolved)
    check_service_account(settings, tenant)
    check_resources(spec, settings)
    if chip_limit is not None and (chips := job_chips(spec, settings)) > chip_limit:
        what = "TPU chips" if settings.executor == "kubernetes" else "local processes"
        raise ApiError(
            422,
            "over_tenant_chip_limit",
            f"This job needs {chips} {what}, more than your team may use at once ({chip_limit}), so it "
            "could never start; use a smaller topology or fewer slices (processes), or ask your admin to "
            "raise your team's limit.",
            param="resources",
        )


def chip_unit(settings: Settings) -> str:
    """What a job's chips are on this server: TPU chips, or (the local executor) processes."""
    return tpu.chip_unit(settings.executor)


def held_chips(job: Any, settings: Settings) -> int:
    """`job_chips` of a stored job (a Job or a row with its `id` and `spec`); 0 for a spec this server's
    settings no longer accept: it still holds what it holds, but nothing here can tell how much."""
    try:
        return job_chips(job_spec(job), settings)
    except Exception:
        return 0


def job_chips(spec: JobSpec, settings: Settings) -> int:
    """What a job holds while it runs, for the tenant cap: its TPU chips (every slice) on Kubernetes,
    its processes (each stands in for a TPU VM) on the local executor."""
    return resource_chips(spec.resources, settings)


def resource_chips(resources: Resources, settings: Settings) -> int:
    """`job_chips` of a job with these resources (0: a TPU shape not offered)."""
    return tpu.chips_of(resources, settings.executor)
