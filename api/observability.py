"""Prometheus metrics, structured JSON logs, and a request id on every request and log line."""

from __future__ import annotations

import contextvars
import json
import logging
import secrets
import time
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import tenants as tenant_limits
from api import webhooks
from api.models import Job
from api.settings import Settings
from api.states import JobStatus

CALLER = "tputune.caller"  # scope["state"][CALLER]: the request's Principal, once known (api.deps.caller)
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
job_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("job_id", default=None)


class Metrics:
    """One registry per app (tests build many apps in one process). The dispatcher's figures are kept here
    when it runs in this process (a thread), else read from `dispatcher_stats` (its process's).

    `multiprocess`: this is one of `tputune serve --workers N`'s processes. The request and report counts
    then live in files under PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode, which that
    variable turns on when the module is first imported), and /metrics sums every worker's, whichever
    worker a scrape reaches."""

    def __init__(
        self,
        engine: Engine,
        dispatcher_stats: Collector | None = None,
        multiprocess: bool = False,
        *,
        settings: Settings,
        month_spent: tenant_limits.MonthSpent,
    ) -> None:
        self.registry = CollectorRegistry()
        own: CollectorRegistry | None = self.registry
        if multiprocess:
            if values.ValueClass is values.MutexValue:
                raise RuntimeError(
                    "PROMETHEUS_MULTIPROC_DIR was not set before prometheus_client was imported"
                )
            MultiProcessCollector(self.registry)
            own = None  # the values are in the files, which the collector reads
        self.requests = Counter(
            "tputune_http_requests", "HTTP requests", ["method", "route", "status"], registry=own
        )
        self.latency = Histogram(
            "tputune_http_request_duration_seconds",
            "HTTP request latency",
            ["method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=own,
        )
        self.reports = Counter("tputune_worker_reports", "Worker reports stored", registry=own)
        self.log_followers = Gauge(
            "tputune_log_followers",
            "Job logs followed now (GET /jobs/{id}/logs?follow=true)",
            registry=own,
            multiprocess_mode="livesum",
        )
        self.event_followers = Gauge(
            "tputune_event_followers",
            "Job event streams followed now (GET /jobs/{id}/events?follow=true)",
            registry=own,
            multiprocess_mode="livesum",
        )
        self.launches: Counter | None = None
        self.stalls: Counter | None = None
        self.last_pass: Gauge | None = None
        if dispatcher_stats is not None:
            self.registry.register(dispatcher_stats)
        else:
            self.launches = Counter(LAUNCHES[0], LAUNCHES[1], registry=own)
            self.stalls = Counter(STALLS[0], STALLS[1], registry=own)
            self.last_pass = Gauge(LAST_PASS[0], LAST_PASS[1], registry=own, multiprocess_mode="max")
        self.registry.register(_JobsByStatus(engine, settings, month_spent))

    # --- DispatcherStats, for a dispatcher thread ---

    def passed(self) -> None:
        if self.last_pass is not None:
            self.last_pass.set_to_current_time()

    def launched(self) -> None:
        if self.launches is not None:
            self.launches.inc()

    def stalled(self) -> None:
        if self.stalls is not None:
            self.stalls.inc()


LAUNCHES = ("tputune_launches", "Worker launches (incl. restarts)")
STALLS = ("tputune_stalls", "Runs stopped as stalled: no report for TPUTUNE_STALL_MINUTES")
LAST_PASS = (
    "tputune_dispatcher_last_pass_timestamp_seconds",
    "When the dispatcher last finished a pass (reconcile lag = now - this)",
)


class DispatcherStats(Protocol):
    """What the dispatcher counts for /metrics."""

    def passed(self) -> None: ...

    def launched(self) -> None: ...

    def stalled(self) -> None: ...


# Each tenant's limits (api.tenants.LIMITS), as gauges: tputune_tenant_<limit>.
_LIMITS_HELP = {
    "max_active_jobs": "The jobs each tenant may have active at once (tenants with unfinished jobs or own "
    "limits)",
    "max_active_chips": "The TPU chips (local executor: processes) each tenant's active jobs may hold",
    "max_queued_jobs": "The jobs each tenant may have queued; POST /jobs over it gets 429",
    "max_chip_hours_per_month": "The chip-hours (local executor: process-hours) each tenant's jobs may hold "
    "in a calendar month (UTC)",
}


class _JobsByStatus(Collector):
    """`tputune_jobs` by status; for each tenant with unfinished jobs, those by status and the chips its
    active jobs hold (api.tenants.usage: what its chip limit caps), to watch the shared quota and
    each team's share of it; each tenant's chip-hours this month (api.tenants.MonthSpent: read at most
    every 30 s); and each tenant's limits (api.tenants), where it has one, beside them."""

    def __init__(self, engine: Engine, settings: Settings, month_spent: tenant_limits.MonthSpent) -> None:
        self.engine = engine
        self.settings = settings
        self.month_spent = month_spent

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tputune_jobs", "Jobs by status", labels=["status"])
        tenants = GaugeMetricFamily(
            "tputune_tenant_jobs", "Unfinished jobs of each tenant, by status", labels=["tenant", "status"]
        )
        held = GaugeMetricFamily(
            "tputune_tenant_chips",
            "TPU chips (local executor: processes) each tenant's active jobs hold",
            labels=["tenant"],
        )
        month = GaugeMetricFamily(
            "tputune_tenant_chip_hours_this_month",
            "The chip-hours (local executor: process-hours) each tenant's jobs held this calendar month "
            "(UTC), as GET /usage counts them (read at most every 30 s): what its monthly budget counts",
            labels=["tenant"],
        )
        limit_families = {
            name: GaugeMetricFamily(f"tputune_tenant_{name}", text, labels=["tenant"])
            for name, text in _LIMITS_HELP.items()
        }
        deliveries = GaugeMetricFamily(
            "tputune_webhook_deliveries",
            "Webhook deliveries kept, by status (pending: not yet delivered; failed: given up)",
            labels=["status"],
        )
        endpoints = GaugeMetricFamily(
            "tputune_webhooks",
            "Webhook endpoints, by state (failing: every delivery failing lately; disabled: nothing sent)",
            labels=["state"],
        )
        counts = dict.fromkeys((s.value for s in JobStatus), 0)
        with Session(self.engine) as session:
            for status, count in session.exec(select(Job.status, func.count()).group_by(Job.status)):
                counts[status] = count
            used = tenant_limits.usage(session, self.settings)
            own = tenant_limits.load(session)
            hours = self.month_spent.hours(session)
            delivery_counts = webhooks.count_by_status(session)
            endpoint_counts = webhooks.count_endpoints(session)
        for status, count in counts.items():
            family.add_metric([status], count)
        yield family
        for tenant, entry in used.items():
            for status, count in entry.statuses.items():
                tenants.add_metric([tenant, status], count)
        yield tenants
        for tenant, entry in sorted(used.items()):
            held.add_metric([tenant], entry.chips)
        yield held
        for tenant, spent in sorted(hours.items()):
            month.add_metric([tenant], spent)
        yield month
        for tenant in sorted(set(used) | set(own)):
            limits = tenant_limits.Limits.of(own.get(tenant), self.settings, tenant)
            for name, limit_family in limit_families.items():
                if (value := getattr(limits, name)) is not None:
                    limit_family.add_metric([tenant], value)
        yield from limit_families.values()
        for status, count in delivery_counts.items():
            deliveries.add_metric([status], count)
        yield deliveries
        for state, count in endpoint_counts.items():
            endpoints.add_metric([state], count)
        yield endpoints


access_log = logging.getLogger("tputune.access")


class RequestLoad:
    """When the last request arrived: the dispatcher defers to the API while requests keep coming.
    (Not requests in flight: an open event stream would count as load for as long as it stays open.)"""

    WINDOW_SECONDS = 0.02

    def __init__(self) -> None:
        self.last_request = -1.0

    def busy(self) -> bool:
        return time.monotonic() - self.last_request < self.WINDOW_SECONDS


class RequestContext:
    """Request id (X-Request-ID in, or a new one; echoed back), latency and count per route, and the
    access log: a line per request with its request id, and the caller's key id and tenant once known (JSON
    logs: `http` holds the fields; a 429 names the key that was limited). It replaces
    uvicorn's, which `tputune serve` turns off: that one had no request id and logged query strings.

    A line costs about what uvicorn's did, ~0.04 ms of CPU on 2 cores: a third of a trivial route's (healthz
    at 64 clients: 6,100 req/s, 9,500 with TPUTUNE_ACCESS_LOG=false)."""

    def __init__(
        self, app: ASGIApp, metrics: Metrics, log_requests: bool = True, load: RequestLoad | None = None
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.log_requests = log_requests
        self.load = load  # only a dispatcher thread reads it
        # The children of the metrics by method, route and status: as many as prometheus_client keeps (the
        # HTTP parser takes only the methods it knows; routes are templates or "unmatched").
        self._series: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming[:64] if incoming.isprintable() and incoming else secrets.token_hex(8)
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        if self.load is not None:
            self.load.last_request = time.monotonic()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                caller = (scope.get("state") or {}).get(CALLER)
                if caller is not None and caller.expires is not None:  # (clients warn before it comes)
                    headers.append((b"x-tputune-key-expires", caller.expires.encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - started
            route = scope.get("route")
            label = getattr(route, "path", "unmatched")
            method = scope["method"]
            series = self._series.get((method, label, status))
            if series is None:  # (labels() checks and looks up the labels each time: 2% of a POST /jobs)
                series = self._series[method, label, status] = (
                    self.metrics.requests.labels(method, label, str(status)),
                    self.metrics.latency.labels(method, label),
                )
            series[0].inc()
            series[1].observe(elapsed)
            if self.log_requests:
                self._log(scope, method, status, elapsed)
            request_id_var.reset(token)

    @staticmethod
    def _log(scope: Scope, method: str, status: int, elapsed: float) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        path = scope.get("root_path", "") + scope["path"]  # no query string: it may hold what users typed
        if not path.isprintable():  # (%0A in a path would start a line of its own in the text log)
            path = "".join(c if c.isprintable() else f"%{ord(c):02X}" for c in path)
        client = scope.get("client")
        address = f"{client[0]}:{client[1]}" if client else "-"
        http: dict[str, Any] = {
            "method": method,
            "path": path,
            "status": status,
            "ms": round(elapsed * 1000, 1),
        }
        caller = (scope.get("state") or {}).get(CALLER)
        who = ""
        if caller is not None and caller.key_id != "anonymous":  # (not the keyless single-user mode)
            http["key"], http["tenant"] = caller.key_id, caller.tenant  # (the key's id, never the key)
            who = f" key={caller.key_id} tenant={caller.tenant}"
        access_log.info(
            "%s %s %s %d %.1f ms%s", address, method, path, status, elapsed * 1000, who, extra={"http": http}
        )


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the request and job ids when there are any."""

    _last: tuple[int, str] = (-1, "")  # a second and its text, swapped as one (threads log too)

    def _time(self, created: float) -> str:
        """`created` as formatTime(record, "%Y-%m-%dT%H:%M:%S") writes it, made once a second (a busy
        server logs thousands of lines in one)."""
        last = self._last
        if last[0] != int(created):
            last = self._last = (int(created), time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(created)))
        return last[1]

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self._time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, var in (("request_id", request_id_var), ("job_id", job_id_var)):
            value = var.get()
            if value:
                entry[key] = value
        http = getattr(record, "http", None)
        if http is not None:
            entry["http"] = http
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, json_logs: bool) -> None:
    # No thread, process or asyncio task names in the records: no format shows them, and looking them up
    # was a third of the cost of an access log line (the logging HOWTO's "Optimization").
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging.logAsyncioTasks = False  # type: ignore[attr-defined]  # (3.12: not in typeshed)
    # Nor where the call was made (file, line, function): no format shows it either, and finding it walked
    # the stack for each record, a third of an access log line (the same HOWTO).
    logging._srcfile = None
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if json_logs else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
