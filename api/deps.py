"""Dependencies shared by the routes, named by what they give."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlmodel import Session

from api.auth import COOKIE_NAME, Authenticator, Principal
from api.dispatcher import Dispatcher
from api.errors import ApiError
from api.executors import Executor
from api.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    with Session(request.app.state.engine, expire_on_commit=False) as session:
        yield session


_api_key = HTTPBearer(
    scheme_name="ApiKey", description="A tputune API key (`tputune keys create`).", auto_error=False
)


def get_principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_api_key)]
) -> Principal:
    key = credentials.credentials if credentials else request.cookies.get(COOKIE_NAME)
    auth: Authenticator = request.app.state.auth
    principal = auth.authenticate(key)
    auth.check_rate(principal)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_tenant(principal: PrincipalDep) -> str:
    return principal.tenant


def get_admin(principal: PrincipalDep) -> Principal:
    if not principal.is_admin:
        raise ApiError(403, "admin_only", "Only the admin key may manage API keys.")
    return principal


def get_executor(request: Request) -> Executor:
    return request.app.state.executor


def get_dispatcher(request: Request) -> Dispatcher | None:
    return request.app.state.dispatcher


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
TenantDep = Annotated[str, Depends(get_tenant)]
AdminDep = Annotated[Principal, Depends(get_admin)]
ExecutorDep = Annotated[Executor, Depends(get_executor)]
DispatcherDep = Annotated[Dispatcher | None, Depends(get_dispatcher)]
