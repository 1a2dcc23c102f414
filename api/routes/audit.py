"""GET /audit: who made, rotated or revoked keys, set teams' limits and data prefixes, and added, changed or
deleted webhook endpoints (api.audit). An admin key sees every team's; another key its own team's."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import BaseModel, Field

from api import audit
from api.auth import ANONYMOUS, Principal
from api.deps import PrincipalDep, SessionDep, json_response, own_tenant_only
from api.errors import ApiError
from api.models import MAX_ID, AuditEvent, as_utc
from api.routes.tenants import OWN_TENANT_ONLY, query_time
from api.schemas import error_responses

router = APIRouter(tags=["audit"], responses=error_responses(401, 413, 422, 429, 503))


class Actor(BaseModel):
    key_id: str | None = Field(
        description="The caller's API key (`admin`: the server's TPUTUNE_ADMIN_KEY); null: a server "
        "without keys, or the server itself (`who`: the server)."
    )
    tenant: str | None = Field(description="The team of that key; null: the server itself.")
    who: str | None = Field(
        description="As a job's events and `updated_by` name the caller; `the server` for what it did on its "
        "own (an endpoint that failed for TPUTUNE_WEBHOOK_DISABLE_AFTER_HOURS, disabled)."
    )


class AuditEventPublic(BaseModel):
    object: Literal["audit.event"] = "audit.event"
    id: int
    at: datetime
    action: audit.Action = Field(
        description="key.created, key.rotated, key.revoked (`target`: the key's id); tenant.updated (the "
        "team's name: its limits or data prefixes); webhook.created, webhook.updated, "
        "webhook.secret_rotated, webhook.deleted (the endpoint's id); job.deleted (the job's id: its name, "
        "status and output_uri in `details`)."
    )
    tenant: str = Field(description="The team whose key, limits, endpoint or job it was (`*`: every team's).")
    target: str
    actor: Actor
    request_id: str | None = Field(description="The request's X-Request-Id, as the server's logs show it.")
    details: dict[str, Any] = Field(
        description="What changed: for tenant.updated each field set, `from` and `to`; for a key its "
        "name, prefix, whether admin, expiry; for an endpoint where it posts (scheme and host: the path "
        "can hold a token), its events. Never a secret."
    )

    @classmethod
    def of(cls, row: AuditEvent) -> AuditEventPublic:
        assert row.id is not None
        server = row.actor_key_id == audit.SERVER.key_id
        key_id = None if row.actor_key_id == ANONYMOUS.key_id or server else row.actor_key_id
        who = Principal(tenant=row.actor_tenant, key_id=row.actor_key_id).who  # (as the caller was named)
        return cls(
            id=row.id,
            at=as_utc(row.at),  # type: ignore[arg-type]
            action=row.action,  # type: ignore[arg-type]
            tenant=row.tenant,
            target=row.target,
            actor=Actor(key_id=key_id, tenant=None if server else row.actor_tenant, who=who),
            request_id=row.request_id,
            details=row.details,
        )


class AuditPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[AuditEventPublic]
    has_more: bool
    next_after: int | None = Field(description="Pass as `after` for the next (older) page.")


@router.get(
    "/audit",
    response_model=AuditPage,
    responses=OWN_TENANT_ONLY,
    summary="Who changed keys, teams' limits and webhooks, newest first",
)
def list_audit_events(
    principal: PrincipalDep,
    session: SessionDep,
    tenant: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=64,
            description="Only this team's. An admin key sees every team's by default; another key only its "
            "own team's.",
        ),
    ] = None,
    action: Annotated[
        list[audit.Action] | None, Query(max_length=len(audit.ACTIONS), description="Only these actions.")
    ] = None,
    actor: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=32,
            description="Only what this key did (its id, `admin`, or `server`: what the server did itself).",
        ),
    ] = None,
    target: Annotated[
        str | None,
        Query(min_length=1, max_length=64, description="Only about this key, team or endpoint."),
    ] = None,
    since: Annotated[datetime | None, Query(description="From (ISO 8601).")] = None,
    until: Annotated[datetime | None, Query(description="Until (ISO 8601).")] = None,
    after: Annotated[int | None, Query(ge=1, le=MAX_ID, description="An event id: older ones.")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Response:
    """Kept as long as the database keeps them (they are few: one per change an admin or team makes)."""
    scope = principal.scope
    own_tenant_only(tenant, scope, "audit events")
    start = query_time(since, "since") if since is not None else None
    end = query_time(until, "until") if until is not None else None
    if start is not None and end is not None and start >= end:
        raise ApiError(422, "empty_window", "`since` must be before `until`.", param="since")
    query = audit.Query(
        tenant=tenant or scope,
        actions=tuple(sorted(set(action or ()))),
        actor_key_id=actor,
        target=target,
        since=start,
        until=end,
        after=after,
        limit=limit,
    )
    rows, more = audit.events(session, query)
    page = AuditPage(
        data=[AuditEventPublic.of(row) for row in rows],
        has_more=more,
        next_after=rows[-1].id if more and rows else None,
    )
    return json_response(page)
