from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api.db import ping
from api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is up")
def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Health,
    summary="The database is reachable",
    responses={503: {"model": Health, "description": "The database is unreachable."}},
)
def readyz(request: Request) -> Health | JSONResponse:
    try:
        ping(request.app.state.engine)
    except Exception:
        return JSONResponse(status_code=503, content={"status": "database unavailable"})
    return Health(status="ok")
