"""Tenants' limits, what their jobs hold now and what they used: a team sees its own, an admin sees (and
sets) every team's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from api import audit
from api.auth import TENANT_NAME
from api.deps import LimitsAdminDep, PrincipalDep, SessionDep, SettingsDep, json_response, own_tenant_only
from api.errors import ApiError
from api.models import ApiKey, Tenant, as_utc, utcnow
from api.schemas import ErrorResponse, error_responses
from api.settings import Settings
from api.tenants import ANYWHERE, LIMITS, UNLIMITED, Limits, Spent, Usage, load, spent, usage
from api.validation import chip_unit
from worker.config import check_prefix

router = APIRouter(tags=["tenants"], responses=error_responses(401, 413, 422, 429, 503))

LIMIT_MAX = 1_000_000
PREFIXES_MAX = 32  # a tenant's own data prefixes
PREFIX_LENGTH_MAX = 1024


class LimitValues(BaseModel):
    max_active_jobs: int | None = Field(
        description="Jobs of the tenant starting, running or cancelling at once; more wait queued."
    )
    max_active_chips: int | None = Field(
        description="TPU chips (local executor: processes) its active jobs may hold at once; more wait "
        "queued, and a job that needs more is refused."
    )
    max_queued_jobs: int | None = Field(
        description="Jobs it may have waiting to start; POST /jobs over it is refused (429)."
    )
    max_chip_hours_per_month: int | None = Field(
        description="Chip-hours (local executor: process-hours) its jobs may hold in a calendar month "
        "(UTC); once they have, its queued jobs wait for the next month (running ones go on)."
    )


class OwnLimitValues(BaseModel):
    max_active_jobs: int | Literal["unlimited"] | None
    max_active_chips: int | Literal["unlimited"] | None
    max_queued_jobs: int | Literal["unlimited"] | None
    max_chip_hours_per_month: int | Literal["unlimited"] | None


def _own(row: Tenant | None, field: str) -> int | Literal["unlimited"] | None:
    """A tenant's own limit as the API shows it."""
    value = getattr(row, field) if row is not None else None
    return "unlimited" if value == UNLIMITED else value


def _own_prefixes(row: Tenant | None) -> list[str] | Literal["any"] | None:
    """A tenant's own data prefixes as the API shows them."""
    value = row.data_prefixes if row is not None else None
    return ANYWHERE if value == ANYWHERE else value if isinstance(value, list) else None


def _shown(row: Tenant, field: str) -> Any:
    """A tenant's own limit or data prefixes, as the API (and the audit log) shows them."""
    return _own_prefixes(row) if field == "data_prefixes" else _own(row, field)


class TenantUsage(BaseModel):
    active_jobs: int = Field(description="Jobs starting, running or cancelling: what max_active_jobs counts.")
    queued_jobs: int = Field(description="Jobs waiting to start.")
    chips: int = Field(description="TPU chips (local executor: processes) its active jobs hold.")
    chip_hours_this_month: float = Field(
        description="Chip-hours its jobs held this calendar month (UTC), as GET /usage counts them: what "
        "max_chip_hours_per_month counts (read at most every 30 s)."
    )


class TenantPublic(BaseModel):
    object: str = "tenant"
    name: str
    limits: LimitValues = Field(description="What holds now; null: no limit.")
    own_limits: OwnLimitValues = Field(
        description="The limits an admin set for this tenant (`unlimited`: none, whatever the server's); "
        "null: the server's (TPUTUNE_TENANT_MAX_ACTIVE_JOBS/CHIPS, TPUTUNE_TENANT_MAX_QUEUED_JOBS) hold."
    )
    usage: TenantUsage
    budget_pauses_running: bool = Field(
        description="Once its jobs held its monthly chip-hours (`max_chip_hours_per_month`), its running "
        "jobs are stopped too (each saves a checkpoint and waits in the queue to go on from it); false: they "
        "run to their end, and only queued jobs wait. The server's TPUTUNE_TENANT_BUDGET_PAUSES_RUNNING."
    )
    chip_unit: str = Field(
        description="What `chips` counts on this server: `TPU chips` (on Kubernetes) or `processes` (the "
        "local executor, whose processes stand in for TPU VMs).",
        examples=["TPU chips"],
    )
    data_prefixes: list[str] | None = Field(
        description="Where its jobs may read and write (gs://bucket/path or local directories, and what is "
        "under them); they may also read under `shared_read_prefixes`. null: anywhere."
    )
    own_data_prefixes: list[str] | Literal["any"] | None = Field(
        description="The data prefixes an admin set for this tenant (`any`: anywhere, whatever the "
        "server's); null: the server's (TPUTUNE_TENANT_DATA_PREFIXES, `{tenant}` standing for its name)."
    )
    shared_read_prefixes: list[str] = Field(
        description="Where every team's jobs may also read, where data prefixes hold: the official weights."
    )
    updated_at: datetime | None = Field(description="When an admin last set its limits.")
    updated_by: str | None = Field(description="Who did.")

    @classmethod
    def of(
        cls, name: str, row: Tenant | None, used: Usage | None, hours: float, settings: Settings
    ) -> TenantPublic:
        limits = Limits.of(row, settings, name)
        prefixes = limits.data_prefixes
        return cls(
            name=name,
            limits=LimitValues(**{field: getattr(limits, field) for field in LIMITS}),
            own_limits=OwnLimitValues(**{field: _own(row, field) for field in LIMITS}),
            usage=TenantUsage(
                active_jobs=used.active_jobs if used else 0,
                queued_jobs=used.queued_jobs if used else 0,
                chips=used.chips if used else 0,
                chip_hours_this_month=round(hours, 4),
            ),
            budget_pauses_running=settings.tenant_budget_pauses_running,
            chip_unit=chip_unit(settings),
            data_prefixes=list(prefixes) if prefixes is not None else None,
            own_data_prefixes=_own_prefixes(row),
            shared_read_prefixes=settings.shared_read_prefixes,
            updated_at=as_utc(row.updated_at) if row else None,
            updated_by=row.updated_by if row else None,
        )


class TenantList(BaseModel):
    object: str = "list"
    data: list[TenantPublic]


class TenantLimitsUpdate(BaseModel):
    """The limits to change; a field left out stays as it is, null gives the tenant the server's, and
    `unlimited` none at all, whatever the server's (a team exempt from a server-wide limit)."""

    max_active_jobs: Annotated[int, Field(ge=0, le=LIMIT_MAX)] | Literal["unlimited"] | None = Field(
        default=None,
        description="Jobs it may have starting, running or cancelling at once (0: none start; the "
        "running ones go on); null: the server's TPUTUNE_TENANT_MAX_ACTIVE_JOBS.",
    )
    max_active_chips: Annotated[int, Field(ge=1, le=LIMIT_MAX)] | Literal["unlimited"] | None = Field(
        default=None,
        description="TPU chips (local executor: processes) its active jobs may hold at once; null: the "
        "server's TPUTUNE_TENANT_MAX_ACTIVE_CHIPS.",
    )
    max_queued_jobs: Annotated[int, Field(ge=0, le=LIMIT_MAX)] | Literal["unlimited"] | None = Field(
        default=None,
        description="Jobs it may have waiting to start; a new job over it is refused with 429 "
        "too_many_queued_jobs (0: none are accepted); null: the server's TPUTUNE_TENANT_MAX_QUEUED_JOBS.",
    )
    max_chip_hours_per_month: Annotated[int, Field(ge=0, le=LIMIT_MAX)] | Literal["unlimited"] | None = Field(
        default=None,
        description="Chip-hours (local executor: process-hours) its jobs may hold in a calendar month (UTC), "
        "as GET /usage counts them; once they have, its queued jobs wait for the next month or a higher "
        "budget, and running ones go on unless the server stops them too (`budget_pauses_running`) (0: "
        "none start); null: the server's TPUTUNE_TENANT_MAX_CHIP_HOURS_PER_MONTH.",
    )

    data_prefixes: list[str] | Literal["any"] | None = Field(
        default=None,
        description="Where its jobs may read and write: gs://bucket/path or absolute local directory "
        f"prefixes (1 to {PREFIXES_MAX}), `{{tenant}}` standing for its name; a job with data or an output "
        "elsewhere is refused, and one queued fails. `any`: anywhere, whatever the server's; null: the "
        "server's TPUTUNE_TENANT_DATA_PREFIXES.",
    )

    @field_validator("data_prefixes", mode="before")
    @classmethod
    def _prefixes(cls, value: Any) -> Any:
        if value is None or value == ANYWHERE:
            return value
        if (
            not isinstance(value, list)
            or not 1 <= len(value) <= PREFIXES_MAX
            or not all(isinstance(prefix, str) and 0 < len(prefix) <= PREFIX_LENGTH_MAX for prefix in value)
        ):
            raise PydanticCustomError(
                "invalid_prefixes",
                f"expected a list of 1 to {PREFIXES_MAX} prefixes (gs://bucket/path or absolute local "
                f'directories of up to {PREFIX_LENGTH_MAX} characters), "any" (anywhere), or null (the '
                "server's)",
            )
        return list(dict.fromkeys(check_prefix(prefix) for prefix in value))

    @field_validator(*LIMITS, mode="wrap")
    @classmethod
    def _one_sentence(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        """One error saying what a limit may be, not one for each kind it could have been."""
        try:
            return handler(value)
        except ValidationError:
            least = 1 if info.field_name == "max_active_chips" else 0  # (0 jobs, hours: none start)
            raise PydanticCustomError(
                "invalid_limit",
                f'expected a whole number from {least} to {LIMIT_MAX:,}, "unlimited" (no limit for the '
                "tenant), or null (the server's limit)",
            ) from None

    model_config = {
        "extra": "forbid",
        "json_schema_extra": {
            "examples": [
                {"max_active_jobs": 4, "max_active_chips": 64, "max_queued_jobs": 100},
                {"max_chip_hours_per_month": 20000},
                {"max_active_jobs": "unlimited", "max_active_chips": "unlimited"},
                {"data_prefixes": ["gs://ml-data/teams/research", "gs://ml-data/shared/eval"]},
            ]
        },
    }


_admin_errors: dict[int | str, dict] = {
    403: {"model": ErrorResponse, "description": "Not an admin key."},
}
TenantName = Annotated[str, Path(min_length=1, max_length=64, pattern=TENANT_NAME)]


def _tenant(request: Request, session: Session, settings: Settings, name: str) -> TenantPublic:
    hours = request.app.state.month_spent.hours(session, name).get(name, 0.0)
    row, used = session.get(Tenant, name), usage(session, settings, name).get(name)
    return TenantPublic.of(name, row, used, hours, settings)


@router.get(
    "/tenant",
    response_model=TenantPublic,
    summary="Your team: its limits, and what its jobs hold now",
)
def own_tenant(
    request: Request, principal: PrincipalDep, session: SessionDep, settings: SettingsDep
) -> Response:
    """The tenant of the caller's key (of an admin key: the one it was made for)."""
    return json_response(_tenant(request, session, settings, principal.tenant))


@router.get(
    "/admin/tenants",
    response_model=TenantList,
    responses=_admin_errors,
    summary="Every tenant: limits and use",
)
def list_tenants(
    request: Request, session: SessionDep, settings: SettingsDep, _admin: LimitsAdminDep
) -> Response:
    """Every tenant that has limits of its own, API keys, or unfinished jobs, by name."""
    rows = load(session)
    used = usage(session, settings)
    hours = request.app.state.month_spent.hours(session)
    names = set(rows) | set(used) | set(session.exec(select(ApiKey.tenant).distinct()))
    data = [
        TenantPublic.of(name, rows.get(name), used.get(name), hours.get(name, 0.0), settings)
        for name in sorted(names)
    ]
    return json_response(TenantList(data=data))


@router.get(
    "/admin/tenants/{name}",
    response_model=TenantPublic,
    responses=_admin_errors,
    summary="A tenant's limits and use",
)
def get_tenant(
    name: TenantName, request: Request, session: SessionDep, settings: SettingsDep, _admin: LimitsAdminDep
) -> Response:
    """Any tenant name: one without keys or jobs yet has the server's limits and uses nothing."""
    return json_response(_tenant(request, session, settings, name))


@router.patch(
    "/admin/tenants/{name}",
    response_model=TenantPublic,
    responses=_admin_errors,
    summary="Set a tenant's limits, and where its jobs may read and write",
)
def set_tenant_limits(
    name: TenantName,
    body: TenantLimitsUpdate,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    admin: LimitsAdminDep,
) -> Response:
    """The fields given change; null gives the tenant the server's limit back. Its queued jobs start at
    once if they now fit; running jobs go on even if they no longer do. A lower chip limit refuses new
    jobs bigger than it (a job already queued that needs more waits, saying so). A lower limit on queued
    jobs refuses new ones until the queue is below it; the queued ones stay. Narrower data prefixes refuse
    new jobs with data or an output outside them, and fail such jobs still queued (running ones go on)."""
    asked = body.model_dump(include=body.model_fields_set)
    changes = {field: UNLIMITED if value == "unlimited" else value for field, value in asked.items()}
    row = session.get(Tenant, name)
    for attempt in range(2):
        if row is None:
            row = Tenant(name=name)
        before = {field: _shown(row, field) for field in changes}
        for field, value in changes.items():
            setattr(row, field, value)
        row.updated_at, row.updated_by = utcnow(), admin.who
        session.add(row)
        details = audit.changes(before, {field: _shown(row, field) for field in changes})
        if details:  # (a limit set to what it was changes nothing)
            audit.record(session, admin, "tenant.updated", name, name, details)
        try:
            session.commit()
            break
        except IntegrityError:  # another request made its row meanwhile: change that one
            session.rollback()
            if attempt:
                raise
            row = session.get(Tenant, name)
    assert row is not None  # (what changed, by whom: the audit event's log line)
    request.app.state.tenant_limits.put(row)
    if request.app.state.dispatcher is not None:
        request.app.state.dispatcher.wake()  # (queued jobs that now fit start)
    return json_response(_tenant(request, session, settings, name))


class TenantSpent(BaseModel):
    tenant: str
    jobs: int = Field(description="Jobs that held their chips in the window, for some of it at least.")
    chip_hours: float = Field(
        description="Chips (local executor: processes) times the hours each job held them, in the window: "
        "from its launch (or, where Kueue held it, its admission) until it ended, or now: while it was "
        "starting, running or cancelling, less any time back in the queue after a preemption."
    )
    trained_tokens: int = Field(description="The tokens those jobs trained on, all of each.")


class UsageReport(BaseModel):
    object: str = "usage"
    since: datetime
    until: datetime
    chip_unit: str = Field(description="What `chip_hours` counts: `TPU chips` or (local) `processes`.")
    data: list[TenantSpent] = Field(description="By tenant; one that ran nothing is left out.")


USAGE_DAYS = 30  # the window when no `since` is given


def query_time(value: datetime, param: str) -> datetime:
    """A query's time in UTC (a time without a zone is UTC)."""
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:
        raise ApiError(
            422, "invalid_time", f"{param} is out of range; give a time after year 1.", param=param
        ) from None


# A route where an admin key names any tenant (`?tenant=`), and another key only its own.
OWN_TENANT_ONLY: dict[int | str, dict] = {
    403: {"model": ErrorResponse, "description": "Another tenant's, asked with a tenant's key."}
}


@router.get(
    "/usage",
    response_model=UsageReport,
    responses=OWN_TENANT_ONLY,
    summary="What each team's jobs ran: chip-hours and tokens",
)
def usage_report(
    principal: PrincipalDep,
    session: SessionDep,
    settings: SettingsDep,
    since: Annotated[
        datetime | None, Query(description=f"From (ISO 8601; default: {USAGE_DAYS} days before `until`).")
    ] = None,
    until: Annotated[datetime | None, Query(description="Until (ISO 8601; default: now).")] = None,
    tenant: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=64,
            description="Only this tenant's. An admin key sees every tenant's by default; another key only "
            "its own tenant's.",
        ),
    ] = None,
) -> Response:
    """For chargeback, or to see who used the shared quota: each tenant's jobs that ran between `since`
    and `until`, the chip-hours they held then, and the tokens they trained on."""
    scope = principal.scope
    own_tenant_only(tenant, scope, "usage")
    end = query_time(until, "until") if until is not None else utcnow()
    if since is not None:
        start = query_time(since, "since")
    else:
        try:
            start = end - timedelta(days=USAGE_DAYS)
        except OverflowError:
            start = datetime.min.replace(tzinfo=UTC)
    if start >= end:
        raise ApiError(422, "empty_window", "`since` must be before `until`.", param="since")
    wanted = tenant or scope
    found = spent(session, settings, start, end, wanted)
    if wanted is not None:
        found.setdefault(wanted, Spent())  # (a team sees its own line, also with nothing run)
    data = [
        TenantSpent(
            tenant=name,
            jobs=entry.jobs,
            chip_hours=round(entry.chip_seconds / 3600, 4),
            trained_tokens=entry.trained_tokens,
        )
        for name, entry in sorted(found.items())
    ]
    return json_response(UsageReport(since=start, until=end, chip_unit=chip_unit(settings), data=data))
