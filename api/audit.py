"""The audit log: who changed who may do what, and what a team may use, and who deleted a job. Each change
to a key, a team's limits or data prefixes, or a webhook endpoint, and each job deleted, is recorded in
the change's own transaction (`record`, before the route's commit), so a change is never stored without
its event, nor an event without its change. Never a secret: a key's visible prefix, not the key; a
webhook's address without its path or query (a Slack-style URL is itself a secret)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from sqlmodel import Session, col, select

from api import (
    observability,  # (the module, not its names: it imports the webhook sender, which imports this)
)
from api.auth import Principal
from api.models import AuditEvent, as_utc, utcnow

log = logging.getLogger(__name__)

Action = Literal[
    "key.created",
    "key.rotated",
    "key.revoked",
    "tenant.updated",
    "webhook.created",
    "webhook.updated",
    "webhook.secret_rotated",
    "webhook.deleted",
    "job.deleted",
]
ACTIONS: tuple[str, ...] = get_args(Action)
# The server itself, for what it changes on its own: an endpoint failing for long, disabled by the sender.
SERVER = Principal(tenant="", key_id="server")


def record(
    session: Session,
    principal: Principal,
    action: Action,
    tenant: str,
    target: str,
    details: dict[str, Any] | None = None,
) -> AuditEvent:
    """Add the event to `session`: it is stored with the change when the caller commits."""
    event = AuditEvent(
        at=utcnow(),
        action=action,
        tenant=tenant,
        target=target,
        actor_key_id=principal.key_id,
        actor_tenant=principal.tenant,
        request_id=observability.request_id_var.get(),
        details=details or {},
    )
    session.add(event)
    who = principal.who or "the single user"
    log.info("audit: %s %s (tenant %s) by %s: %s", action, target, tenant, who, event.details)
    return event


def changes(before: dict[str, Any], after: dict[str, Any], *also: str) -> dict[str, Any]:
    """The fields whose value differs between `before` and `after` (and those of `also`, changed in a way
    the shown values do not tell), each `{"from", "to"}`: an event's details."""
    return {
        field: {"from": before[field], "to": value}
        for field, value in after.items()
        if before[field] != value or field in also
    }


def where(url: str) -> str:
    """Where a webhook posts, as the log keeps it: scheme, host and port; the path and query (which can
    hold a token) left out."""
    parts = urlsplit(url)
    rest = "/…" if parts.path not in ("", "/") or parts.query else ""
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{rest}"


def when(value: datetime | None) -> str | None:
    stamp = as_utc(value)
    return stamp.isoformat() if stamp is not None else None


@dataclass(frozen=True)
class Query:
    """Which events to list, newest first: all of them (None) or only these."""

    tenant: str | None = None
    actions: tuple[str, ...] = ()
    actor_key_id: str | None = None
    target: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    after: int | None = None  # an event id: the events older than it (the next page)
    limit: int = 50


def events(session: Session, query: Query) -> tuple[list[AuditEvent], bool]:
    """A page of events, and whether there are more."""
    statement = select(AuditEvent).order_by(col(AuditEvent.id).desc()).limit(query.limit + 1)
    if query.tenant is not None:
        statement = statement.where(AuditEvent.tenant == query.tenant)
    if query.actions:
        statement = statement.where(col(AuditEvent.action).in_(query.actions))
    if query.actor_key_id is not None:
        statement = statement.where(AuditEvent.actor_key_id == query.actor_key_id)
    if query.target is not None:
        statement = statement.where(AuditEvent.target == query.target)
    if query.since is not None:
        statement = statement.where(col(AuditEvent.at) >= query.since)
    if query.until is not None:
        statement = statement.where(col(AuditEvent.at) < query.until)
    if query.after is not None:
        statement = statement.where(col(AuditEvent.id) < query.after)
    rows = list(session.exec(statement).all())
    return rows[: query.limit], len(rows) > query.limit
