"""Dependencies shared by the routes, named by what they give."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Protocol

import anyio
from fastapi import Depends, Request, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from api.auth import COOKIE_NAME, READS, Authenticator, Principal, read_only_refused
from api.errors import ApiError
from api.executors import Executor
from api.observability import CALLER
from api.settings import Settings

log = logging.getLogger(__name__)

# The dependencies are `async def` and do no blocking I/O on the event loop: a plain `def` one costs a
# trip through the thread pool per request (and a generator two), which was most of a GET's CPU time.


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_session(request: Request) -> Session:
    """A session for the request; it connects on first use, on the route's worker thread, and
    CloseSessions closes it when the response is sent (a `yield` dependency cost ~15% of a GET's CPU)."""
    session = Session(request.app.state.engine, expire_on_commit=False)
    request.scope.setdefault("state", {})[_SESSION] = session
    return session


_SESSION = "tputune.session"


class CloseSessions:
    """Closes the request's database session (get_session) once the app is done with the request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            session: Session | None = (scope.get("state") or {}).pop(_SESSION, None)
            if session is not None:
                if session.in_transaction() and session.get_bind().dialect.name != "sqlite":
                    # Returning the connection rolls back: a round trip to the server, kept off the event
                    # loop (shielded: a client that went away must not leave the connection checked out).
                    # Not on the routes' threads: they may all be waiting for a pooled connection that
                    # only a close can give back.
                    with anyio.CancelScope(shield=True):
                        await asyncio.get_running_loop().run_in_executor(_CLOSERS, _close, session)
                else:
                    _close(session)


def _close(session: Session) -> None:
    """Close without raising: the response is already on its way, and a database that went away while it
    was made (its rollback fails) must not turn into a dropped connection for the client."""
    try:
        session.close()
    except Exception as exc:
        log.warning("dropped a database connection that could not be returned: %s", exc)
        with contextlib.suppress(Exception):
            session.invalidate()


def json_response(model: BaseModel, status_code: int = 200) -> Response:
    """`model` as the JSON response, made on the route's worker thread. Every sync route that reads
    through the request's session answers with it (tests/test_api.py's deadlock test covers them).

    Returning a model instead makes FastAPI validate and serialize it on a second trip through the thread
    pool, while the request's session still holds its database connection: slower, and under load the
    requests holding connections waited there for threads held by requests waiting for connections (on
    PostgreSQL, whose pool has a cap, until the pool's timeout answered them 503).
    """
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


_CLOSERS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tputune-session-close")


async def caller(request: Request) -> Principal:
    """Who is calling, from `Authorization: Bearer <key>` or the dashboard's cookie; the key's rate limit
    applied. Routes get it through the dependencies below; the busiest one calls it itself."""
    scheme, _, credentials = (request.headers.get("authorization") or "").partition(" ")
    key = credentials.strip() if scheme.lower() == "bearer" else None
    key = key or request.cookies.get(COOKIE_NAME)
    auth: Authenticator = request.app.state.auth
    principal = auth.authenticate_cached(key)
    if principal is None:  # a key not looked up in the last few seconds: ask the database
        principal = await run_in_threadpool(auth.authenticate, key)
    request.scope.setdefault("state", {})[CALLER] = principal  # (for the access log)
    auth.check_rate(principal)
    if principal.read_only and request.method not in READS:
        raise read_only_refused()
    return principal


class _Caller(HTTPBearer):
    """`caller` as one dependency that is also the `ApiKey` security scheme of the OpenAPI document
    (HTTPBearer nested under a resolver, and the tenant under that, were three to solve per request)."""

    def __init__(self, resolve: Callable[[Principal], Any]) -> None:
        super().__init__(scheme_name=API_KEY_SCHEME, description=API_KEY_DESCRIPTION, auto_error=False)
        self.resolve = resolve

    async def __call__(self, request: Request) -> Any:  # type: ignore[override]
        return self.resolve(await caller(request))


API_KEY_SCHEME = "ApiKey"
API_KEY_DESCRIPTION = "A tputune API key (`tputune keys create`)."
# For a route that calls `caller` itself: the security requirement its dependency would have declared.
API_KEY_REQUIRED: dict[str, Any] = {"security": [{API_KEY_SCHEME: []}]}


def _admin(what: str) -> Callable[[Principal], Principal]:
    def admin(principal: Principal) -> Principal:
        if not principal.is_admin:
            raise ApiError(
                403,
                "admin_only",
                f"Only an admin key (TPUTUNE_ADMIN_KEY, or one created as admin) may {what}.",
            )
        return principal

    return admin


def own_tenant_only(tenant: str | None, scope: str | None, what: str) -> None:
    """A `tenant` query parameter: a tenant's key (`scope`) may name only its own (403 admin_only)."""
    if tenant is not None and scope is not None and tenant != scope:
        raise ApiError(
            403,
            "admin_only",
            f"Only an admin key sees another tenant's {what}; this key belongs to tenant '{scope}': leave "
            "out `tenant`.",
            param="tenant",
        )


get_principal = _Caller(lambda principal: principal)
get_tenant = _Caller(lambda principal: principal.scope)
get_admin = _Caller(_admin("manage API keys"))
get_limits_admin = _Caller(_admin("set tenants' limits"))
PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def get_executor(request: Request) -> Executor:
    return request.app.state.executor


class Wakes(Protocol):
    """Wakes the dispatcher: its thread (api.dispatcher), or its process (api.dispatch_process.Waker)."""

    def wake(self) -> None: ...


async def get_dispatcher(request: Request) -> Wakes | None:
    return request.app.state.dispatcher


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
TenantDep = Annotated[str | None, Depends(get_tenant)]  # None: every tenant's jobs (the admin key)
AdminDep = Annotated[Principal, Depends(get_admin)]
LimitsAdminDep = Annotated[Principal, Depends(get_limits_admin)]
ExecutorDep = Annotated[Executor, Depends(get_executor)]
DispatcherDep = Annotated[Wakes | None, Depends(get_dispatcher)]
