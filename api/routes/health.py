from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.db import ping
from api.schemas import Health

router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=PlainTextResponse,
    responses={404: {"description": "Metrics are turned off (TPUTUNE_METRICS_ENABLED)."}},
)
def metrics(request: Request) -> PlainTextResponse:
    if not request.app.state.settings.metrics_enabled:
        return PlainTextResponse("metrics are turned off\n", status_code=404)
    return PlainTextResponse(
        generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )


@router.get("/healthz", response_model=Health, summary="The process is up")
async def healthz(request: Request) -> Response:
    # On the event loop: a liveness probe must not queue behind busy route threads. Served directly
    # (api.direct_routes), as the busiest routes are: bench/api_load.py measures them against it as the
    # framework's ceiling.
    return Response(_OK, media_type="application/json")


_OK = Health(status="ok").model_dump_json()


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
