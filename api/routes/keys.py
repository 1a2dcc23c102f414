"""API keys (admin only) and the dashboard's browser session (a cookie holding the caller's key)."""

from __future__ import annotations

import contextlib
import math
from datetime import datetime, timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Body, Query, Request, Response
from pydantic import BaseModel, Field
from sqlmodel import Session, col, select

from api import audit
from api.auth import COOKIE_NAME, TENANT_NAME, admin_keys_working, new_api_key
from api.deps import AdminDep, SessionDep, SettingsDep, json_response
from api.errors import ApiError
from api.models import ApiKey, as_utc, utcnow
from api.schemas import ErrorResponse, error_responses
from api.settings import KEY_DAYS_MAX
from worker.config import Text

router = APIRouter(tags=["keys"], responses=error_responses(413, 422, 503))


class KeyCreate(BaseModel):
    tenant: Annotated[str, Field(min_length=1, max_length=64, pattern=TENANT_NAME)]
    name: Annotated[Text, Field(min_length=1, max_length=128)]
    expires_in_days: int | None = Field(
        default=None,
        ge=1,
        le=KEY_DAYS_MAX,
        description="The key stops working this many days from now. Default: never, or the server's "
        "`TPUTUNE_KEY_MAX_DAYS` where it sets one (then at most that).",
    )
    admin: bool = Field(
        default=False,
        description="An admin key: it manages keys, and sees and acts on every tenant's jobs, as the "
        "server's TPUTUNE_ADMIN_KEY does (which can then stay in a vault). Rate-limited like any key.",
    )
    read_only: bool = Field(
        default=False,
        description="A read-only key: it reads (GET) and changes nothing; anything else is refused (403 "
        "read_only_key). For dashboards, monitoring and CI status; with `admin`, an auditor's key (every "
        "team's jobs, keys, usage and audit log).",
    )

    model_config = {
        "json_schema_extra": {
            "examples": [{"tenant": "research", "name": "ci pipeline", "expires_in_days": 90}]
        }
    }


Role = Literal["member", "admin", "reader", "auditor"]


def role(admin: bool, read_only: bool) -> Role:
    """A key's role, of its two flags: admin, member, or their read-only kinds: auditor (every team's),
    reader (its own team's)."""
    if read_only:
        return "auditor" if admin else "reader"
    return "admin" if admin else "member"


class KeyPublic(BaseModel):
    id: str
    tenant: str
    name: str
    prefix: str = Field(description="The key's visible start, to recognise it.")
    admin: bool = Field(description="Whether it is an admin key.")
    read_only: bool = Field(description="Whether it only reads.")
    role: Role = Field(
        description="Of `admin` and `read_only`: `member` (its team's jobs), `admin` (every team's, and "
        "keys, limits), `reader` (reads its team's) or `auditor` (reads every team's)."
    )
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None = Field(description="When the key stops working; null: never.")
    last_used_at: datetime | None = Field(
        description="When the key was last used, to about a minute; null: never used."
    )

    @classmethod
    def of(cls, row: ApiKey) -> KeyPublic:
        return cls(
            id=row.id,
            tenant=row.tenant,
            name=row.name,
            prefix=row.prefix,
            admin=row.admin,
            read_only=row.read_only,
            role=role(row.admin, row.read_only),
            created_at=as_utc(row.created_at),  # type: ignore[arg-type]
            revoked_at=as_utc(row.revoked_at),
            expires_at=as_utc(row.expires_at),
            last_used_at=as_utc(row.last_used_at),
        )


class KeyCreated(KeyPublic):
    key: str = Field(description="The secret key. It is shown only now: store it.")


class KeyList(BaseModel):
    object: str = "list"
    data: list[KeyPublic]


_admin_errors: dict[int | str, dict] = {
    401: {"model": ErrorResponse, "description": "No or wrong key."},
    403: {"model": ErrorResponse, "description": "Not the admin key."},
}


class KeyRotate(BaseModel):
    grace_seconds: int = Field(
        default=0,
        ge=0,
        le=30 * 86_400,
        description="How long the old key goes on working beside the new one (time to hand the new one "
        "out); 0: it stops now.",
    )
    expires_in_days: int | None = Field(
        default=None,
        ge=1,
        le=KEY_DAYS_MAX,
        description="The new key's lifetime. Default: the old key's, or as for a key created now.",
    )

    model_config = {"json_schema_extra": {"examples": [{"grace_seconds": 3600}]}}


class KeyRotated(KeyCreated):
    replaces: KeyPublic = Field(description="The old key: it stops working at its `expires_at`.")


def _lifetime(days: int | None, most: int | None) -> int | None:
    """The days a new key lives: `days` asked for (more than the server's most is refused), else the
    server's most (None: until revoked)."""
    if most is not None and days is not None and days > most:
        raise ApiError(
            422,
            "key_lifetime_too_long",
            f"Keys on this server expire within {most} days (TPUTUNE_KEY_MAX_DAYS); "
            f"ask for expires_in_days of at most {most}.",
            param="expires_in_days",
        )
    return days or most


def _new_key(tenant: str, name: str, days: int | None, admin: bool, read_only: bool) -> tuple[ApiKey, str]:
    """A new key's row, and its secret (shown once)."""
    key_id, prefix, plaintext, digest = new_api_key()
    now = utcnow()
    expires_at = now + timedelta(days=days) if days is not None else None
    row = ApiKey(
        id=key_id,
        tenant=tenant,
        name=name,
        prefix=prefix,
        key_hash=digest,
        created_at=now,
        expires_at=expires_at,
        admin=admin,
        read_only=read_only,
    )
    return row, plaintext


def _audited(row: ApiKey) -> dict[str, object]:
    """What the audit log keeps of a key (never its secret or hash)."""
    return {
        "name": row.name,
        "prefix": row.prefix,
        "admin": row.admin,
        "read_only": row.read_only,
        "expires_at": audit.when(row.expires_at),
    }


def _key(session: Session, key_id: str) -> ApiKey:
    """The key with this id, or a 404."""
    row = session.get(ApiKey, key_id)
    if row is None:
        raise ApiError(
            404, "key_not_found", f"No API key with id '{key_id}'; list them with GET /admin/keys."
        )
    return row


@router.post(
    "/admin/keys", status_code=201, response_model=KeyCreated, responses=_admin_errors, summary="Create a key"
)
def create_key(body: KeyCreate, session: SessionDep, settings: SettingsDep, admin: AdminDep) -> Response:
    days = _lifetime(body.expires_in_days, settings.key_max_days)
    row, plaintext = _new_key(body.tenant, body.name, days, body.admin, body.read_only)
    session.add(row)
    audit.record(session, admin, "key.created", row.tenant, row.id, _audited(row))
    session.commit()
    return json_response(KeyCreated(**KeyPublic.of(row).model_dump(), key=plaintext), 201)


@router.post(
    "/admin/keys/{key_id}/rotate",
    status_code=201,
    response_model=KeyRotated,
    responses={
        **_admin_errors,
        404: {"model": ErrorResponse, "description": "No such key."},
        409: {"model": ErrorResponse, "description": "The key was revoked."},
    },
    summary="Rotate a key: a new one for the same tenant and name; the old one expires",
)
def rotate_key(
    key_id: str,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    admin: AdminDep,
    body: Annotated[KeyRotate | None, Body()] = None,
) -> Response:
    """The old key stops working after `grace_seconds` (at once: 0), or at its own expiry if sooner; the
    new key lives as long as the old one was made to (or `expires_in_days`). Nothing else changes: the
    tenant's jobs are the tenant's, whichever key made them."""
    body = body or KeyRotate()
    old = _key(session, key_id)
    if old.revoked_at is not None:
        raise ApiError(
            409, "key_revoked", f"Key {key_id} was revoked; create a new one with POST /admin/keys."
        )
    days = body.expires_in_days
    created, expires = as_utc(old.created_at), as_utc(old.expires_at)
    if days is None and created is not None and expires is not None:  # the old key's, in whole days
        days = max(1, math.ceil((expires - created).total_seconds() / 86_400))
        days = min(days, settings.key_max_days or days)
    lifetime = _lifetime(days, settings.key_max_days)
    row, plaintext = _new_key(old.tenant, old.name, lifetime, old.admin, old.read_only)
    stops = row.created_at + timedelta(seconds=body.grace_seconds)
    old.expires_at = stops if expires is None else min(expires, stops)
    session.add_all([row, old])
    details = {
        **_audited(old),  # (its expiry: the new one, when it stops)
        "new_key_id": row.id,
        "new_prefix": row.prefix,
        "new_expires_at": audit.when(row.expires_at),
    }
    audit.record(session, admin, "key.rotated", old.tenant, old.id, details)
    session.commit()
    # Every process of the server forgets its key cache (the old key's new expiry holds at once) and
    # rechecks its streams' keys; with no grace the old key's streams end now. (Other replicas: when it
    # expires, their next usage pass counts it with the revoked keys, api.usage.)
    request.app.state.auth.forget()
    if body.grace_seconds == 0:
        request.app.state.streams.revoke({old.id})
    else:
        request.app.state.streams.revoked()
    new = KeyPublic.of(row).model_dump()
    return json_response(KeyRotated(**new, key=plaintext, replaces=KeyPublic.of(old)), 201)


@router.get("/admin/keys", response_model=KeyList, responses=_admin_errors, summary="List keys")
def list_keys(
    request: Request,
    session: SessionDep,
    _admin: AdminDep,
    tenant: Annotated[
        str | None, Query(min_length=1, max_length=64, description="Only this tenant's.")
    ] = None,
) -> Response:
    """Every key (oldest first), or one tenant's: none of them holds its secret."""
    with contextlib.suppress(Exception):  # (this process's latest uses; the next flush retries a failure)
        request.app.state.auth.flush_uses()
    query = select(ApiKey).order_by(col(ApiKey.created_at))
    rows = session.exec(query if tenant is None else query.where(ApiKey.tenant == tenant)).all()
    return json_response(KeyList(data=[KeyPublic.of(row) for row in rows]))


@router.delete(
    "/admin/keys/{key_id}",
    response_model=KeyPublic,
    responses={
        **_admin_errors,
        404: {"model": ErrorResponse, "description": "No such key."},
        409: {
            "model": ErrorResponse,
            "description": "The last admin key that works, on a server without TPUTUNE_ADMIN_KEY.",
        },
    },
    summary="Revoke a key",
)
def revoke_key(
    key_id: str, request: Request, session: SessionDep, settings: SettingsDep, admin: AdminDep
) -> Response:
    """Revoke it (at once, on every replica within seconds). Without TPUTUNE_ADMIN_KEY (the bootstrap key
    retired, TPUTUNE_REQUIRE_API_KEYS), the last admin key that works is not revoked: keys could no longer
    be managed."""
    row = _key(session, key_id)
    if row.admin and settings.admin_key is None and admin_keys_working(session) == {row.id}:
        raise ApiError(
            409,
            "last_admin_key",
            f"Key {row.id} is the last admin key that works (a read-only one does not count), and this "
            "server has no TPUTUNE_ADMIN_KEY: revoked, nobody could manage keys. Create another admin key "
            "first, then revoke this one.",
        )
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.add(row)
        audit.record(session, admin, "key.revoked", row.tenant, row.id, _audited(row))
        session.commit()
    request.app.state.auth.forget()
    # Its streams end, here and in the server's other processes (other replicas: at their next recheck).
    request.app.state.streams.revoke({row.id})
    return json_response(KeyPublic.of(row))


class SessionLogin(BaseModel):
    key: Annotated[str, Field(min_length=1, max_length=256)]


@router.post(
    "/auth/session",
    status_code=204,
    responses={401: {"model": ErrorResponse, "description": "Unknown key."}},
    summary="Sign the browser in (sets a cookie with the key)",
)
def login(body: Annotated[SessionLogin, Body()], request: Request, response: Response) -> Response:
    request.app.state.auth.authenticate(body.key)
    response.set_cookie(COOKIE_NAME, body.key, httponly=True, samesite="strict", max_age=7 * 24 * 3600)
    response.status_code = 204
    return response


class SessionState(BaseModel):
    auth_required: bool = Field(description="Whether this server needs an API key.")
    signed_in: bool = Field(description="Whether this browser's cookie holds a valid key.")
    tenant: str | None = Field(description="The signed-in key's tenant.")
    admin: bool = Field(default=False, description="Whether it is an admin key (every tenant's jobs).")
    read_only: bool = Field(default=False, description="Whether the key only reads.")


@router.get("/auth/session", response_model=SessionState, summary="Whether the browser is signed in")
def session_state(request: Request) -> SessionState:
    auth = request.app.state.auth
    key = request.cookies.get(COOKIE_NAME)
    if not auth.settings.auth_enabled or not key:
        return SessionState(auth_required=auth.settings.auth_enabled, signed_in=False, tenant=None)
    try:
        principal = auth.authenticate(key)
    except ApiError:
        return SessionState(auth_required=True, signed_in=False, tenant=None)
    return SessionState(
        auth_required=True,
        signed_in=True,
        tenant=principal.tenant,
        admin=principal.is_admin,
        read_only=principal.read_only,
    )


@router.delete("/auth/session", status_code=204, summary="Sign the browser out")
def logout(response: Response) -> Response:
    response.delete_cookie(COOKIE_NAME)
    response.status_code = 204
    return response
