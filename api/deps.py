"""Dependencies shared by the routes, named by what they give."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlmodel import Session

from api.dispatcher import Dispatcher
from api.executors import Executor
from api.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    with Session(request.app.state.engine, expire_on_commit=False) as session:
        yield session


def get_tenant() -> str:
    # One tenant until API keys exist; every query is already scoped by it.
    return "default"


def get_executor(request: Request) -> Executor:
    return request.app.state.executor


def get_dispatcher(request: Request) -> Dispatcher | None:
    return request.app.state.dispatcher


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
TenantDep = Annotated[str, Depends(get_tenant)]
ExecutorDep = Annotated[Executor, Depends(get_executor)]
DispatcherDep = Annotated[Dispatcher | None, Depends(get_dispatcher)]
