"""A tenant's webhook endpoints (api.webhooks): told when its jobs start, pause and end."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Response
from pydantic import BaseModel, Field
from sqlmodel import Session, col, func, select

from api import audit
from api import webhooks as service
from api.auth import TENANT_NAME
from api.deps import PrincipalDep, SessionDep, SettingsDep, TenantDep, json_response, own_tenant_only
from api.errors import ApiError
from api.models import MAX_ID, Webhook, WebhookDelivery, as_utc, utcnow
from api.schemas import ErrorResponse, error_responses
from api.webhooks import DeliveryStatus, EventType
from worker.config import Text

# a tenant's name (TENANT_NAME), or * (every tenant's)
WEBHOOK_TENANT = r"^(?:" + TENANT_NAME.removeprefix("^").removesuffix("$") + r"|\*)$"

router = APIRouter(prefix="/webhooks", tags=["webhooks"], responses=error_responses(401, 413, 422, 429, 503))

_not_found: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResponse, "description": "No such webhook (or not one of your tenant's)."}
}


class WebhookCreate(BaseModel):
    url: Annotated[str, Field(min_length=1, max_length=2048)] = Field(
        description="Where each event is posted (https; a public address unless the server allows others)."
    )
    events: list[EventType] = Field(
        default_factory=lambda: list(service.DEFAULT_EVENTS),
        min_length=1,
        max_length=len(service.EVENT_TYPES),
        description="The moves to be told of. Default: a job's end (succeeded, failed, cancelled).",
    )
    description: Annotated[Text, Field(max_length=256)] | None = None
    tenant: Annotated[str | None, Field(min_length=1, max_length=64, pattern=WEBHOOK_TENANT)] = Field(
        default=None,
        description="Whose jobs (admin keys only): a tenant's, or `*` for every tenant's (the platform "
        "team's endpoint); default: the key's tenant.",
    )

    model_config = {
        "json_schema_extra": {
            "examples": [{"url": "https://ci.example.com/tputune", "events": ["job.succeeded", "job.failed"]}]
        }
    }


class WebhookPublic(BaseModel):
    id: str
    object: Literal["webhook"] = "webhook"
    tenant: str
    url: str
    events: list[str]
    description: str | None
    created_at: datetime
    enabled: bool = Field(
        description="False while nothing is sent to it: disabled by its team, or by the server once every "
        "delivery failed for TPUTUNE_WEBHOOK_DISABLE_AFTER_HOURS (`disabled_reason` says which)."
    )
    disabled_at: datetime | None
    disabled_reason: str | None
    failing_since: datetime | None = Field(
        description="When its deliveries began to fail, every one since (null: the last was delivered)."
    )
    old_secret_until: datetime | None = Field(
        description="After its secret was rotated: until when deliveries are signed with the old one too."
    )

    @classmethod
    def of(cls, row: Webhook) -> WebhookPublic:
        return cls(
            id=row.id,
            tenant=row.tenant,
            url=row.url,
            events=row.events,
            description=row.description,
            created_at=as_utc(row.created_at),  # type: ignore[arg-type]
            enabled=row.disabled_at is None,
            disabled_at=as_utc(row.disabled_at),
            disabled_reason=row.disabled_reason,
            failing_since=as_utc(row.failing_since),
            old_secret_until=as_utc(row.old_secret_until) if row.old_secret is not None else None,
        )


class SecretRotation(BaseModel):
    old_secret_hours: float = Field(
        default=24,
        ge=0,
        le=168,
        description="How long deliveries are signed with the old secret too (while receivers move to the "
        "new one); 0: from now on, with the new one only.",
    )

    model_config = {"extra": "forbid"}


class WebhookUpdate(BaseModel):
    url: Annotated[str, Field(min_length=1, max_length=2048)] | None = Field(
        default=None, description="A new URL (checked as at creation); the secret stays."
    )
    events: list[EventType] | None = Field(
        default=None,
        min_length=1,
        max_length=len(service.EVENT_TYPES),
        description="The moves to be told of.",
    )
    description: Annotated[Text, Field(max_length=256)] | None = None
    enabled: bool | None = Field(
        default=None,
        description="false: send nothing more (its pending deliveries are given up); true: send again the "
        "moves made from now on (a disabled endpoint's failure streak is forgotten).",
    )

    model_config = {"extra": "forbid", "json_schema_extra": {"examples": [{"enabled": True}]}}


class WebhookCreated(WebhookPublic):
    secret: str = Field(
        description="The signing secret (Standard Webhooks: `whsec_` and base64). It is shown only now: "
        "store it, and check each delivery's `webhook-signature` with it."
    )


class WebhookList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookPublic]


class DeliveryPublic(BaseModel):
    id: int
    object: Literal["webhook.delivery"] = "webhook.delivery"
    webhook_id: str
    type: str = Field(description="The event: job.succeeded, ..., or webhook.test.")
    job_id: str | None
    status: DeliveryStatus = Field(
        description="pending: not yet delivered (retried until `next_attempt_at`s run out); failed: given up."
    )
    attempts: int
    created_at: datetime
    last_attempt_at: datetime | None
    next_attempt_at: datetime | None
    response_status: int | None = Field(description="The HTTP status the endpoint last answered.")
    last_error: str | None = Field(description="Why the last attempt failed.")
    payload: dict[str, Any] = Field(description="The JSON body posted.")

    @classmethod
    def of(cls, row: WebhookDelivery) -> DeliveryPublic:
        assert row.id is not None
        return cls(
            id=row.id,
            webhook_id=row.webhook_id,
            type=row.type,
            job_id=row.job_id,
            status=row.status,  # type: ignore[arg-type]
            attempts=row.attempts,
            created_at=as_utc(row.created_at),  # type: ignore[arg-type]
            last_attempt_at=as_utc(row.last_attempt_at),
            next_attempt_at=as_utc(row.next_attempt_at),
            response_status=row.response_status,
            last_error=row.last_error,
            payload=json.loads(row.body),
        )


class DeliveryPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[DeliveryPublic]
    has_more: bool
    next_after: int | None = Field(description="Pass as `after` to get the next (older) page.")


def _audited(row: Webhook) -> dict[str, Any]:
    """What the audit log keeps of an endpoint: where it posts without the path or query (which can hold a
    token), never its secret."""
    return {
        "url": audit.where(row.url),
        "events": list(row.events),
        "description": row.description,
        "enabled": row.disabled_at is None,
    }


def _webhook(session: Session, scope: str | None, webhook_id: str) -> Webhook:
    row = session.get(Webhook, webhook_id)
    if row is None or (scope is not None and row.tenant != scope):
        raise ApiError(
            404, "webhook_not_found", f"No webhook with id '{webhook_id}'; list yours with GET /webhooks."
        )
    return row


@router.post(
    "",
    status_code=201,
    response_model=WebhookCreated,
    summary="Add a webhook endpoint",
    responses=error_responses(403, 409),
)
def create_webhook(
    body: WebhookCreate, session: SessionDep, settings: SettingsDep, principal: PrincipalDep
) -> Response:
    """Its tenant's jobs' moves (`events`) are posted to `url` from now on, each signed with the secret
    this answer shows once (Standard Webhooks headers `webhook-id`, `webhook-timestamp`,
    `webhook-signature`). Failed deliveries are retried with backoff (TPUTUNE_WEBHOOK_RETRY_SECONDS)."""
    own_tenant_only(body.tenant, principal.scope, "webhooks")
    tenant = body.tenant or principal.tenant
    url = service.check_url(body.url, settings)
    count = session.scalar(select(func.count()).select_from(Webhook).where(Webhook.tenant == tenant)) or 0
    if count >= settings.webhook_max_per_tenant:
        raise ApiError(
            409,
            "too_many_webhooks",
            f"Tenant '{tenant}' has {count} webhooks, the most this server allows "
            f"(TPUTUNE_WEBHOOK_MAX_PER_TENANT); delete one first (DELETE /webhooks/{{id}}).",
        )
    row = Webhook(
        id=service.new_webhook_id(),
        tenant=tenant,
        url=url,
        events=service.in_order(body.events),
        description=body.description,
        secret=service.new_secret(),
        created_by=principal.who,
    )
    session.add(row)
    audit.record(session, principal, "webhook.created", tenant, row.id, _audited(row))
    session.commit()
    return json_response(WebhookCreated(**WebhookPublic.of(row).model_dump(), secret=row.secret), 201)


@router.get("", response_model=WebhookList, summary="List webhook endpoints", responses=error_responses(403))
def list_webhooks(
    session: SessionDep,
    scope: TenantDep,
    tenant: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=64,
            description="Only this tenant's (admin keys: default all; `*`: the endpoints told of every "
            "tenant's jobs).",
        ),
    ] = None,
) -> Response:
    """Oldest first; none holds its secret."""
    own_tenant_only(tenant, scope, "webhooks")
    query = select(Webhook).order_by(col(Webhook.created_at), col(Webhook.id))
    if tenant or scope:
        query = query.where(Webhook.tenant == (tenant or scope))
    return json_response(WebhookList(data=[WebhookPublic.of(row) for row in session.exec(query).all()]))


@router.get(
    "/{webhook_id}", response_model=WebhookPublic, summary="Get a webhook endpoint", responses=_not_found
)
def get_webhook(webhook_id: str, session: SessionDep, scope: TenantDep) -> Response:
    return json_response(WebhookPublic.of(_webhook(session, scope, webhook_id)))


@router.patch(
    "/{webhook_id}", response_model=WebhookPublic, summary="Change a webhook endpoint", responses=_not_found
)
def update_webhook(
    webhook_id: str,
    body: WebhookUpdate,
    session: SessionDep,
    settings: SettingsDep,
    principal: PrincipalDep,
) -> Response:
    """Its URL, events, description, or whether it is sent to: `{"enabled": true}` after fixing an
    endpoint the server disabled (send it a test first: a disabled endpoint is still sent its tests)."""
    row = _webhook(session, principal.scope, webhook_id)
    before, old_url = _audited(row), row.url
    if body.url is not None:
        row.url = service.check_url(body.url, settings)
    if body.events is not None:
        row.events = service.in_order(body.events)
    if "description" in body.model_fields_set:
        row.description = body.description
    if body.enabled is True and row.disabled_at is not None:
        service.enable(session, row)
    elif body.enabled is False and row.disabled_at is None:
        by = f" by {principal.who}" if principal.who else ""
        reason = f"Disabled{by}; enable it with PATCH /webhooks/{row.id}."
        service.disable(session, row, reason)
    session.add(row)
    # (a URL whose path changed looks the same as the log shows it: said changed all the same)
    changed = audit.changes(before, _audited(row), *(["url"] if row.url != old_url else []))
    if changed:
        audit.record(session, principal, "webhook.updated", row.tenant, row.id, changed)
    session.commit()
    return json_response(WebhookPublic.of(row))


@router.post(
    "/{webhook_id}/rotate-secret",
    response_model=WebhookCreated,
    summary="Give a webhook endpoint a new signing secret",
    responses=_not_found,
)
def rotate_secret(
    webhook_id: str, session: SessionDep, principal: PrincipalDep, body: SecretRotation | None = None
) -> Response:
    """A new secret, shown only in this answer. For `old_secret_hours` (24) each delivery carries two
    signatures, with the new secret and the old one (`webhook-signature: v1,<new> v1,<old>`): a receiver
    checking either goes on working while it is given the new secret."""
    row = _webhook(session, principal.scope, webhook_id)
    hours = (body or SecretRotation()).old_secret_hours
    row.old_secret = row.secret if hours else None
    row.old_secret_until = utcnow() + timedelta(hours=hours) if hours else None
    row.secret = service.new_secret()
    session.add(row)
    details = {"old_secret_until": audit.when(row.old_secret_until)}
    audit.record(session, principal, "webhook.secret_rotated", row.tenant, row.id, details)
    session.commit()
    return json_response(WebhookCreated(**WebhookPublic.of(row).model_dump(), secret=row.secret))


@router.delete(
    "/{webhook_id}", response_model=WebhookPublic, summary="Delete a webhook endpoint", responses=_not_found
)
def delete_webhook(webhook_id: str, session: SessionDep, principal: PrincipalDep) -> Response:
    """Nothing more is sent to it, and its deliveries are forgotten."""
    row = _webhook(session, principal.scope, webhook_id)
    answer = WebhookPublic.of(row)
    session.delete(row)
    audit.record(session, principal, "webhook.deleted", row.tenant, row.id, _audited(row))
    session.commit()
    return json_response(answer)


@router.post(
    "/{webhook_id}/test",
    status_code=202,
    response_model=DeliveryPublic,
    summary="Send a test event to a webhook endpoint",
    responses=_not_found,
)
def test_webhook(webhook_id: str, session: SessionDep, scope: TenantDep) -> Response:
    """A `webhook.test` event, signed and retried as any other: follow it with GET .../deliveries."""
    row = _webhook(session, scope, webhook_id)
    delivery = WebhookDelivery(
        webhook_id=row.id, type=service.TEST_EVENT, body=service.ping_body(row), next_attempt_at=utcnow()
    )
    session.add(delivery)
    session.commit()
    return json_response(DeliveryPublic.of(delivery), 202)


@router.post(
    "/{webhook_id}/deliveries/{delivery_id}/retry",
    status_code=202,
    response_model=DeliveryPublic,
    summary="Send a delivery again",
    responses={
        **_not_found,
        409: {"model": ErrorResponse, "description": "It is pending already, or the endpoint is disabled."},
    },
)
def retry_delivery(
    webhook_id: str,
    delivery_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    session: SessionDep,
    scope: TenantDep,
) -> Response:
    """A failed (or delivered) delivery is sent again, the same body and `webhook-id`, with its retries
    anew: what an endpoint missed while it was down. A job's later moves wait for it, as they would have."""
    hook = _webhook(session, scope, webhook_id)
    row = session.get(WebhookDelivery, delivery_id)
    if row is None or row.webhook_id != hook.id:
        raise ApiError(
            404,
            "delivery_not_found",
            f"Webhook {hook.id} has no delivery {delivery_id}; "
            f"list them with GET /webhooks/{hook.id}/deliveries.",
        )
    if row.status == service.PENDING:
        raise ApiError(
            409, "delivery_pending", f"Delivery {delivery_id} is pending: it is sent (and retried) already."
        )
    if hook.disabled_at is not None and row.type != service.TEST_EVENT:
        raise ApiError(
            409,
            "webhook_disabled",
            f"Webhook {hook.id} is disabled; enable it first (PATCH /webhooks/{hook.id} with enabled: true).",
        )
    row.status, row.attempts, row.next_attempt_at = service.PENDING, 0, utcnow()
    session.add(row)
    session.commit()
    return json_response(DeliveryPublic.of(row), 202)


@router.get(
    "/{webhook_id}/deliveries",
    response_model=DeliveryPage,
    summary="List a webhook endpoint's deliveries",
    responses=_not_found,
)
def list_deliveries(
    webhook_id: str,
    session: SessionDep,
    scope: TenantDep,
    after: Annotated[int | None, Query(ge=1, le=MAX_ID, description="A delivery id: older ones.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    status: Annotated[DeliveryStatus | None, Query(description="Only deliveries in this status.")] = None,
) -> Response:
    """Newest first, with how each went (kept TPUTUNE_WEBHOOK_RETENTION_DAYS once done)."""
    _webhook(session, scope, webhook_id)
    query = select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)
    if after is not None:
        query = query.where(col(WebhookDelivery.id) < after)
    if status is not None:
        query = query.where(WebhookDelivery.status == status)
    rows = list(session.exec(query.order_by(col(WebhookDelivery.id).desc()).limit(limit + 1)).all())
    more = len(rows) > limit
    rows = rows[:limit]
    page = DeliveryPage(
        data=[DeliveryPublic.of(row) for row in rows], has_more=more, next_after=rows[-1].id if more else None
    )
    return json_response(page)
