"""The FastAPI application: `create_app(settings)` wires the database, executor and dispatcher."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from fastapi import FastAPI
from sqlalchemy.engine import Engine
from sqlmodel import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import errors
from api.auth import (
    BUCKETS_FILE,
    NO_ADMIN_KEY,
    Authenticator,
    LocalBuckets,
    SharedBuckets,
    admin_keys_working,
)
from api.db import make_engine
from api.deps import CloseSessions, Wakes
from api.direct_routes import DirectLane, serve_directly
from api.dispatch_process import STATS_FILE, WAKE_FILE, DispatcherProcess, SharedStats, Waker
from api.dispatcher import Dispatcher, make_dispatcher
from api.executors import Closeable, make_executor
from api.observability import Metrics, RequestContext, RequestLoad
from api.reader import QueuePlaces, make_reader
from api.routes import audit, dashboard, health, jobs, keys, tenants, webhooks
from api.settings import Settings
from api.streams import EVENTS, LOGS, EventWatch, SharedKeyStreams, Streams
from api.tenants import LimitsCache, MonthSpent
from api.usage import USAGE_STATS_FILE, UsageStats
from api.writer import make_writer

log = logging.getLogger(__name__)

DESCRIPTION = """Fine-tune Gemma 3 with JAX: on a GKE TPU slice as a JobSet, or as local worker processes.

Create a job with `POST /jobs`, follow it with `GET /jobs/{id}` and `GET /jobs/{id}/events`.
Errors always look like `{"error": {"code": "...", "message": "...", "param": "..."}}`.
"""


class RequestLimits:
    """Refuse bodies over the limit with 413, whether or not the client sent Content-Length; and a path or
    query with the NUL character (%00) with 422: PostgreSQL's text cannot hold it (a job id, a cursor, a
    metadata filter), and the error is the same on SQLite. (JSON bodies: worker.config.Text.)"""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if "\x00" in scope["path"] or b"%00" in scope["query_string"] or b"\x00" in scope["query_string"]:
            where = "path" if "\x00" in scope["path"] else "query"
            text = f"The request's {where} contains the NUL character (%00); remove it."
            await self._reject(send, 422, "nul_character", text, where)
            return
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > self.max_bytes:
                    await self._too_large(send)
                    return
                await self.app(scope, receive, send)  # the server holds the body to its declared length
                return
            chunked = chunked or name == b"transfer-encoding"
        if not chunked:  # neither header: no body at all (most GETs)
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read the body here, within the limit, then hand it on.
        messages: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        message = f"The request body is larger than {self.max_bytes} bytes; send less."
        await self._reject(send, 413, "body_too_large", message)

    @staticmethod
    async def _reject(send: Send, status: int, code: str, message: str, param: str | None = None) -> None:
        body = errors.error_json(code, message, param)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def record_key_uses(auth: Authenticator) -> None:
    """Until cancelled: write when this process's API keys were last used, every `use_flush_seconds`."""
    while True:
        await asyncio.sleep(auth.use_flush_seconds)
        try:
            await anyio.to_thread.run_sync(auth.flush_uses)
        except Exception as error:  # (the next one writes them)
            log.warning("could not record when API keys were last used: %s", error)


def _say_if_no_admin_key(engine: Engine) -> None:
    """With the bootstrap key retired, say (an error in the log) when no admin key is left to manage keys."""
    try:
        with Session(engine) as session:
            if not admin_keys_working(session):
                log.error(NO_ADMIN_KEY)
    except Exception as error:  # (the database may be away: requests say so)
        log.warning("could not count the admin keys: %s", error)


def create_app(settings: Settings | None = None, *, engine: Any = None, worker: bool = False) -> FastAPI:
    """The app. `worker`: one of `tputune serve --workers N`'s processes (api.server): its parent runs the
    dispatcher, metrics are summed over the workers (PROMETHEUS_MULTIPROC_DIR), the rate limits and
    each key's share of followed streams are shared with them."""
    settings = settings or Settings()
    settings.ensure_dirs()
    own_engine = engine is None
    engine = engine or make_engine(settings.resolved_database_url, settings.database_pool_size)
    executor = make_executor(settings)
    job_reader = make_reader(engine)
    load = None
    month_spent = MonthSpent(settings)  # (GET /tenant's, and /metrics')
    dispatcher: Dispatcher | DispatcherProcess | None = None
    wakes: Wakes | None = None
    if settings.dispatcher_enabled and (settings.dispatcher_process or worker):
        if worker:
            stats = SharedStats(settings.data_dir / STATS_FILE)  # (the parent's DispatcherProcess made it)
        else:
            dispatcher = DispatcherProcess(settings)
            stats = dispatcher.stats
        metrics = Metrics(
            engine, dispatcher_stats=stats, multiprocess=worker, settings=settings, month_spent=month_spent
        )
        wakes = Waker(settings.data_dir / WAKE_FILE, stats)
    else:
        metrics = Metrics(engine, multiprocess=worker, settings=settings, month_spent=month_spent)
        if settings.dispatcher_enabled:
            load = RequestLoad()  # a dispatcher thread yields to requests (a process does not share the GIL)
            dispatcher = wakes = make_dispatcher(engine, executor, settings, metrics, api_busy=load.busy)
    if settings.usage_sync_seconds > 0:  # (the server's pass, api.usage, writes them)
        metrics.registry.register(UsageStats(settings.data_dir / USAGE_STATS_FILE))
    job_writer = make_writer(engine, on_commit=wakes.wake if wakes is not None else None)
    buckets = SharedBuckets(settings.data_dir / BUCKETS_FILE) if worker else LocalBuckets()
    streams = Streams(
        settings,
        {EVENTS: metrics.event_followers, LOGS: metrics.log_followers},
        SharedKeyStreams.for_settings(settings) if worker else None,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Sync routes run on this many threads: more only fight over the GIL (measured on 2 cores: 40, the
        # default, served half the list calls per second that 4 or 8 did at 64 clients).
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.worker_threads
        if dispatcher is not None:
            dispatcher.start()
        auth: Authenticator = app.state.auth
        if settings.require_api_keys and settings.admin_key is None:
            await anyio.to_thread.run_sync(_say_if_no_admin_key, engine)

        async def valid_keys(key_ids: set[str]) -> set[str]:
            return await anyio.to_thread.run_sync(auth.valid_key_ids, key_ids)

        # (without keys there is nothing to revoke, and no key's use to record)
        watch = uses = None
        if settings.auth_enabled:
            watch = asyncio.create_task(streams.watch(valid_keys, auth.forget))
            uses = asyncio.create_task(record_key_uses(auth))
        try:
            yield
        finally:
            if watch is not None:
                watch.cancel()
            if uses is not None:
                uses.cancel()
                with contextlib.suppress(Exception):  # (the database may be away: logged before)
                    await anyio.to_thread.run_sync(auth.flush_uses)
            await job_writer.aclose()
            if dispatcher is not None:
                dispatcher.stop()
            if isinstance(wakes, Waker):
                wakes.close()
            if isinstance(executor, Closeable):
                executor.close()
            await job_reader.close()
            if own_engine:  # (its pooled connections closed now, not by the garbage collector, perhaps
                engine.dispose()  # after the database went away)

    # FastAPI's own OpenTelemetry is off: tputune's figures are /metrics and its logs, and asking whether
    # a tracer was configured cost 5% of a request's CPU time (it reads the environment every time).
    telemetry: Any = {"tracing": False, "metrics": False, "logs": False}
    app = FastAPI(
        title="tputune", version="0.1.0", description=DESCRIPTION, lifespan=lifespan, telemetry=telemetry
    )

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            errors.add_schemas(FastAPI.openapi(app), jobs.SELF_READ_BODIES)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.settings = settings
    app.state.engine = engine
    app.state.job_reader = job_reader
    app.state.queue_places = QueuePlaces(job_reader, settings.executor)
    app.state.job_writer = job_writer
    app.state.executor = executor
    app.state.dispatcher = wakes
    app.state.leader = dispatcher.leader if isinstance(dispatcher, Dispatcher) else None
    app.state.auth = Authenticator(engine, settings, buckets)
    app.state.tenant_limits = LimitsCache(engine, settings)
    app.state.month_spent = month_spent
    app.state.metrics = metrics
    app.state.streams = streams
    app.state.event_watch = EventWatch(job_reader)
    errors.install(app)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(keys.router)
    app.include_router(tenants.router)
    app.include_router(webhooks.router)
    app.include_router(audit.router)
    app.include_router(dashboard.router)
    serve_directly(app, jobs.create_job, jobs.get_job, health.healthz)
    app.add_middleware(DirectLane, fastapi_app=app)
    app.add_middleware(CloseSessions)
    app.add_middleware(RequestLimits, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContext, metrics=metrics, log_requests=settings.access_log, load=load)
    logging.getLogger("api").setLevel(settings.log_level.upper())
    return app
