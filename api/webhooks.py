"""Webhooks: a tenant's endpoints are told when its jobs start, pause and end, as hosted services do
(OpenAI's `fine_tuning.job.succeeded`...), signed as Standard Webhooks says (standardwebhooks.com).

The job events are the outbox. Every move of a job writes a status event in the transaction that moves
it (api.jobs.transition, fail_queued), whoever makes it: the dispatcher, a worker's report, a cancel. The
sender (a thread beside the dispatcher, on the leader only) reads the status events after its cursor,
writes a delivery for each endpoint that wants one (the body fixed then: every attempt sends the same),
and posts the deliveries that are due, retrying with backoff. At least once: an endpoint may get one
twice (`webhook-id` is the same each time, to drop the second). Posts run on an event loop of the
sender's and a pass does not wait for them: an endpoint that answers slowly, or never, holds only its own
deliveries (PER_ENDPOINT in flight). One whose every delivery failed for TPUTUNE_WEBHOOK_DISABLE_AFTER_HOURS
is disabled (as Svix does) until its team enables it again.

On PostgreSQL event ids are taken when a transaction inserts, and it may commit after one that took a
later id: a reader that had moved past the later one would never see the earlier. Each pass reads the
events after the last one it read (delivered at once); every LATE_CHECK_SECONDS it reads again those
after the cursor, which moves only past events older than CURSOR_GRACE_SECONDS (their transactions ended
long since), and writes what it missed (once: a delivery is unique per endpoint and event). SQLite writes
one transaction at a time, so its ids come in commit order.

An endpoint's URL comes from a user and the server posts from inside the cluster: it must be https, and
it must not lead to a private address (the metadata server, the cluster's services) unless the server
allows it (TPUTUNE_WEBHOOK_ALLOW_HTTP / _PRIVATE). The address is checked when each delivery is sent and
the connection goes to the address checked (no second lookup an attacker's DNS could answer otherwise).
Redirects are not followed. Logs name the endpoint's id, never its URL (it may hold a token).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import hmac
import ipaddress
import json
import logging
import queue
import secrets
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, get_args
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy import bindparam, case, delete, func, true, tuple_
from sqlalchemy import select as sa_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from api import audit
from api.db import session_scope, upsert_insert
from api.errors import ApiError
from api.models import Job, JobEvent, Webhook, WebhookCursor, WebhookDelivery, as_utc, utcnow
from api.settings import Settings

log = logging.getLogger(__name__)

# The moves an endpoint may ask to hear of: `job.<status>` of a status event.
EventType = Literal["job.running", "job.paused", "job.succeeded", "job.failed", "job.cancelled"]
EVENT_TYPES: tuple[EventType, ...] = get_args(EventType)
DEFAULT_EVENTS: tuple[EventType, ...] = ("job.succeeded", "job.failed", "job.cancelled")
TEST_EVENT = "webhook.test"
DeliveryStatus = Literal["pending", "delivered", "failed"]
PENDING, DELIVERED, FAILED = get_args(DeliveryStatus)
SECRET_PREFIX = "whsec_"
EVERY_TENANT = "*"  # an endpoint's tenant: told of every tenant's jobs (the platform team's; admin keys)
CURSOR_GRACE_SECONDS = 60.0  # PostgreSQL: longer than any transaction that writes job events
LATE_CHECK_SECONDS = 5.0  # how often the cursor moves (PostgreSQL: the events after it read again)
SCAN_PAGE = 1_000  # status events one pass reads at most
SEND_PAGE = 256  # due deliveries one pass reads at most
MAX_IN_FLIGHT = 256  # posts in flight at once
PER_ENDPOINT = 8  # of those, the most to one endpoint
LOOKUPS = 32  # address lookups at once (threads)
RESOLVED_SECONDS = 5.0  # how long an address checked is used again for its host
GATHER_SECONDS = 0.02  # between passes while posts are in flight: their ends are recorded together
LEASE_MARGIN_SECONDS = 30.0  # a delivery in flight is not due again until its timeout and this have passed
USER_AGENT = "tputune-webhooks/0.1"
STOP_WAIT_SECONDS = 3.0


def in_order(events: Sequence[str]) -> list[str]:
    """An endpoint's events as stored: each once, in EVENT_TYPES' order."""
    return [event for event in EVENT_TYPES if event in events]


def new_webhook_id() -> str:
    return "wh_" + secrets.token_hex(8)


def new_secret() -> str:
    """A Standard Webhooks secret: `whsec_` and 32 random bytes, base64."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(secret: str, message_id: str, timestamp: int, body: str) -> str:
    """A `webhook-signature`: `v1,` and the base64 HMAC-SHA256, keyed by the secret's bytes, of
    `{id}.{timestamp}.{body}`."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    digest = hmac.new(key, f"{message_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signatures(row: Any, message_id: str, timestamp: int, body: str) -> str:
    """The `webhook-signature` header: with the endpoint's secret and, for a while after a rotation, its
    old one too (space-separated, as Standard Webhooks allows: a receiver accepts either)."""
    header = sign(row.secret, message_id, timestamp, body)
    until = as_utc(row.old_secret_until)
    if row.old_secret is not None and until is not None and until > utcnow():
        header += " " + sign(row.old_secret, message_id, timestamp, body)
    return header


# --- endpoints' URLs ---------------------------------------------------------------------------------


def _invalid_url(message: str, code: str = "invalid_webhook_url") -> ApiError:
    return ApiError(422, code, message, param="url")


def check_url(url: str, settings: Settings) -> str:
    """The URL as stored, or a 422 saying what to fix. A host name is looked up when a delivery is sent,
    not now: it may not resolve yet, and what it resolves to may change."""
    try:
        parts = urlsplit(url.strip())
        _ = parts.port  # (a port out of range raises)
    except ValueError as exc:
        message = f"The webhook URL is not a valid URL ({exc}); give e.g. https://example.com/hook."
        raise _invalid_url(message) from None
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise _invalid_url(
            "The webhook URL must be an https:// URL with a host, e.g. https://example.com/hook."
        )
    if parts.scheme == "http" and not settings.webhook_allow_http:
        raise _invalid_url(
            "The webhook URL must be https:// (this server does not post to http:// endpoints: "
            "TPUTUNE_WEBHOOK_ALLOW_HTTP).",
            "webhook_url_not_https",
        )
    if parts.username is not None or parts.password is not None:
        raise _invalid_url(
            "Leave credentials out of the webhook URL: check the signature of each delivery instead."
        )
    if parts.fragment:
        raise _invalid_url("The webhook URL has a #fragment, which is never sent; leave it out.")
    host = parts.hostname
    if not settings.webhook_allow_private:
        literal = _ip(host)
        if (
            host == "localhost"
            or host.endswith(".localhost")
            or (literal is not None and not _public(literal))
        ):
            raise _invalid_url(
                f"The webhook URL's host {host} is a private or local address; this server posts only to "
                "public ones (TPUTUNE_WEBHOOK_ALLOW_PRIVATE).",
                "webhook_url_private",
            )
    return urlunsplit(parts)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


class Refused(Exception):
    """A delivery not sent: its URL's host resolved to no address it may go to."""


class Unresolved(Refused):
    """Its URL's host resolved to no address at all (here: behind a proxy, the proxy's network may know
    it)."""


def resolve(host: str, port: int, allow_private: bool) -> str:
    """The address to connect to for `host`: every address it resolves to must be public (unless
    private ones are allowed), not just the first, so that an answer cannot mix one in."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise Unresolved(f"could not resolve {host}: {exc}") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise Unresolved(f"{host} resolves to no address")
    if not allow_private:
        private = [a for a in addresses if not _public(ipaddress.ip_address(a.split("%")[0]))]
        if private:
            raise Refused(
                f"{host} resolves to a private or local address ({private[0]}); this server posts only to "
                "public ones (TPUTUNE_WEBHOOK_ALLOW_PRIVATE)"
            )
    return addresses[0]


# --- what endpoints are sent ----------------------------------------------------------------------------


def event_body(event_id: int, event_type: str, created: datetime, data: dict[str, Any]) -> str:
    return json.dumps(
        {
            "id": f"evt_{event_id}",
            "object": "event",
            "type": event_type,
            "created_at": int(created.timestamp()),
            "data": data,
        },
        separators=(",", ":"),
        ensure_ascii=False,
    )


def ping_body(webhook: Webhook) -> str:
    payload = {
        "id": "evt_test_" + secrets.token_hex(8),
        "object": "event",
        "type": TEST_EVENT,
        "created_at": int(time.time()),
        "data": {"webhook_id": webhook.id, "tenant": webhook.tenant},
    }
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False)


def _job_data(row: Any, status: str) -> dict[str, Any]:
    error = None
    if status == "failed":
        error = {"code": row.error_code, "message": row.error_message}
    return {
        "id": row.job_id,
        "object": "job",
        "status": status,
        "previous_status": row.data.get("from"),
        "tenant": row.tenant,
        "error": error,
    }


_deliveries = WebhookDelivery.__table__  # type: ignore[attr-defined]
_hooks = Webhook.__table__  # type: ignore[attr-defined]


# What a due delivery is read with: the delivery's, and its endpoint's (where and how to sign it).
_HOOK_COLUMNS = (
    _hooks.c.id.label("hook"),
    _hooks.c.url,
    _hooks.c.secret,
    _hooks.c.old_secret,
    _hooks.c.old_secret_until,
)


def _delivery_columns(table: Any) -> tuple[Any, ...]:
    return (table.c.id, table.c.body, table.c.attempts, table.c.job_id, table.c.next_attempt_at)


_DUE_NOW = (
    _deliveries.c.status == PENDING,
    _deliveries.c.next_attempt_at <= bindparam("now"),
    # (a disabled endpoint is still sent its tests: to check it before enabling it again)
    _hooks.c.disabled_at.is_(None) | (_deliveries.c.type == TEST_EVENT),
)
_OLDEST_FIRST = (_deliveries.c.next_attempt_at, _deliveries.c.id)


def _due_statement() -> Any:
    """The deliveries due at `now`, oldest first: `page` at most, less those of the endpoints `full`
    (PER_ENDPOINT in flight). Built once: building a statement cost more than running it."""
    return (
        sa_select(*_delivery_columns(_deliveries), *_HOOK_COLUMNS)
        .join(_hooks, _hooks.c.id == _deliveries.c.webhook_id)
        .where(*_DUE_NOW, _deliveries.c.webhook_id.not_in(bindparam("full", expanding=True)))
        .order_by(*_OLDEST_FIRST)
        .limit(bindparam("page"))
    )


def _due_of_endpoints_statement(dialect: str) -> Any:
    """Every endpoint's oldest due deliveries (twice PER_ENDPOINT each at most), less those of the endpoints
    `full`, in one query, each endpoint's read on its own index (ix_webhook_deliveries_hook_due): on
    PostgreSQL a LATERAL join over the endpoints, on SQLite (no LATERAL) each endpoint's ids from a
    correlated subquery. With 1,000 endpoints, a query each (a round trip each) took a pass 430-490 ms on
    PostgreSQL and 100 on SQLite; this, and `_due` looking up only the candidates it needs, 55 and 38
    (bench/webhooks.py)."""
    own = (_deliveries.c.webhook_id == _hooks.c.id, *_DUE_NOW)
    others = _hooks.c.id.not_in(bindparam("full", expanding=True))
    if dialect == "postgresql":
        oldest = (
            sa_select(*_delivery_columns(_deliveries))
            .where(*own)
            .order_by(*_OLDEST_FIRST)
            .limit(2 * PER_ENDPOINT)
            .lateral("due")
        )
        return (
            sa_select(*_delivery_columns(oldest), *_HOOK_COLUMNS)
            .select_from(_hooks.join(oldest, true()))
            .where(others)
        )
    ids = sa_select(_deliveries.c.id).where(*own).order_by(*_OLDEST_FIRST).limit(2 * PER_ENDPOINT)
    due = _deliveries.alias("due")
    return (
        sa_select(*_delivery_columns(due), *_HOOK_COLUMNS)
        .select_from(_hooks.join(due, due.c.id.in_(ids.correlate(_hooks).scalar_subquery())))
        .where(others)
    )


_DUE = _due_statement()
_DUE_OF_ENDPOINTS = {dialect: _due_of_endpoints_statement(dialect) for dialect in ("postgresql", "sqlite")}
# The pending deliveries of some (endpoint, job) pairs: which is each job's oldest, and when it is due.
_PENDING_OF_JOBS = (
    sa_select(_deliveries.c.webhook_id, _deliveries.c.job_id, _deliveries.c.id, _deliveries.c.next_attempt_at)
    .where(
        _deliveries.c.status == PENDING,
        tuple_(_deliveries.c.webhook_id, _deliveries.c.job_id).in_(bindparam("pairs", expanding=True)),
    )
    .order_by(_deliveries.c.id)
)
# Deliveries leased while they are in flight (`ids`): not due again until `until`.
_LEASE = (
    _deliveries.update()
    .where(_deliveries.c.id.in_(bindparam("ids", expanding=True)), _deliveries.c.status == PENDING)
    .values(next_attempt_at=bindparam("until"))
)
# A delivery put off until `until` (a job's later move, behind an earlier one waiting for its retry).
_PUT_OFF = (
    _deliveries.update()
    .where(_deliveries.c.id == bindparam("delivery"), _deliveries.c.status == PENDING)
    .values(next_attempt_at=bindparam("until"))
)
# How a post went (executemany: one statement for a pass's posts); not for a delivery no longer pending
# (given up meanwhile: its endpoint disabled).
_RECORD = (
    _deliveries.update()
    .where(_deliveries.c.id == bindparam("delivery"), _deliveries.c.status == PENDING)
    .values(
        {
            name: bindparam(name)
            for name in (
                "attempts",
                "last_attempt_at",
                "response_status",
                "last_error",
                "status",
                "next_attempt_at",
            )
        }
    )
)


def disable(session: Session, hook: Webhook, reason: str, now: datetime | None = None) -> None:
    """Stop sending to `hook` (no new deliveries are written for it) and give up its pending ones, but
    its tests; `reason` says why, and what to do. (In the caller's transaction.)"""
    now = now or utcnow()
    hook.disabled_at = now
    hook.disabled_reason = reason
    session.add(hook)
    _give_up_pending(session, hook)


def enable(session: Session, hook: Webhook) -> None:
    """Send to `hook` again: the moves made from now on (those made while it was disabled are not; nor one
    the sender wrote as it was being disabled)."""
    hook.disabled_at = hook.disabled_reason = hook.failing_since = None
    hook.enabled_at = utcnow()
    session.add(hook)
    _give_up_pending(session, hook)


def _give_up_pending(session: Session, hook: Webhook) -> None:
    """Its pending deliveries, but its tests, failed: not sent while it was disabled."""
    session.execute(
        _deliveries.update()
        .where(
            _deliveries.c.webhook_id == hook.id,
            _deliveries.c.status == PENDING,
            _deliveries.c.type != TEST_EVENT,
        )
        .values(status=FAILED, next_attempt_at=None, last_error="not sent: the endpoint was disabled")
    )


@dataclass
class Attempt:
    """How one post went: delivered (2xx), or why not."""

    delivered: bool
    response_status: int | None = None
    error: str | None = None


def write_deliveries(
    session: Session, hooks: list[Webhook], rows: Sequence[Any], written: Collection[tuple[str, int]] = ()
) -> set[tuple[str, int]]:
    """Insert the deliveries of the status events `rows` (as `WebhookSender._status_events` reads them) for
    the endpoints `hooks` wants them, but those `written` already (or in the table: unique per endpoint and
    event); returns their (endpoint, event) pairs."""
    by_tenant: dict[str, list[Webhook]] = {}
    for hook in hooks:
        by_tenant.setdefault(hook.tenant, []).append(hook)
    deliveries = []
    pairs: set[tuple[str, int]] = set()
    now = utcnow()
    for row in rows:
        data = row.data or {}
        status = data.get("status")
        if status is None or "from" not in data:  # (a note, not a move)
            continue
        event_type = f"job.{status}"
        if event_type not in EVENT_TYPES:
            continue
        created = as_utc(row.created_at)
        assert created is not None
        body = None
        for hook in by_tenant.get(row.tenant, []) + by_tenant.get(EVERY_TENANT, []):
            if event_type not in hook.events or (hook.id, row.id) in written:
                continue
            if created < as_utc(hook.enabled_at or hook.created_at):  # type: ignore[operator]
                continue  # (a move made before the endpoint was, or while it was disabled)
            body = body or event_body(row.id, event_type, created, _job_data(row, status))
            deliveries.append(
                {
                    "webhook_id": hook.id,
                    "event_id": row.id,
                    "type": event_type,
                    "job_id": row.job_id,
                    "body": body,
                    "status": PENDING,
                    "attempts": 0,
                    "created_at": now,
                    "next_attempt_at": now,
                }
            )
            pairs.add((hook.id, row.id))
    if deliveries:
        statement = upsert_insert(session.get_bind())(_deliveries).on_conflict_do_nothing(
            index_elements=["webhook_id", "event_id"]
        )
        session.execute(statement, deliveries)
    return pairs


def _with_jobs(events: Any, jobs: Any) -> Any:
    """SELECT of the status events of `events` (the table, or a page of it) with what their deliveries'
    bodies need of their jobs (`write_deliveries`)."""
    return sa_select(
        events.c.id,
        events.c.created_at,
        events.c.data,
        jobs.c.id.label("job_id"),
        jobs.c.tenant,
        jobs.c.error_code,
        jobs.c.error_message,
    ).join(jobs, jobs.c.seq == events.c.job_seq)


def deliver_before_deleting(session: Session, job_seqs: Sequence[int]) -> int:
    """Write the deliveries of the jobs' status events that the sender has not read yet (those after its
    cursor), in the transaction that deletes the jobs: their events go with them, and a job deleted as it
    ended would otherwise never be told of. The sender reads them again (those it read already) as ever:
    a delivery is unique per endpoint and event. How many it wrote."""
    hooks = list(session.exec(select(Webhook).where(col(Webhook.disabled_at).is_(None))).all())
    if not hooks:
        return 0
    cursor = session.get(WebhookCursor, 1)
    events, jobs = JobEvent.__table__, Job.__table__  # type: ignore[attr-defined]
    query = (
        _with_jobs(events, jobs)
        .where(
            events.c.job_seq.in_(job_seqs),
            events.c.type == "status",
            events.c.id > (cursor.event_id if cursor is not None else 0),
        )
        .order_by(events.c.id)
    )
    return len(write_deliveries(session, hooks, list(session.connection().execute(query))))


class WebhookSender:
    """Reads the job events into deliveries and sends them: a thread of its own (start/stop), working only
    while `is_leader` says this process leads (the dispatcher's Lease: one sender for all replicas)."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        is_leader: Callable[[], bool] | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.is_leader = is_leader
        self.interval = settings.dispatch_interval_seconds
        self.grace = 0.0 if engine.dialect.name == "sqlite" else CURSOR_GRACE_SECONDS
        self.late_check_seconds = LATE_CHECK_SECONDS
        # (endpoint, event) pairs written since the cursor (or found written): not written again while
        # their events are read again (PostgreSQL's grace)
        self._written: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # Posts run on an event loop of their own thread; how each went comes back through `_done`.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._lookups: ThreadPoolExecutor | None = None
        self._client: httpx.AsyncClient | None = None  # (the loop's)
        # (the loop's) (host, port) → (address, until); None: left to the proxy
        self._resolved: dict[tuple[str, int], tuple[str | None, float]] = {}
        self._in_flight: dict[int, str] = {}  # delivery id → endpoint id (the sender's thread only)
        self._futures: dict[int, concurrent.futures.Future[Attempt]] = {}
        self._done: queue.SimpleQueue[tuple[Any, Attempt]] = queue.SimpleQueue()
        self._last_cleanup = 0.0
        self._seen: int | None = None  # the last event id this process read (None: the cursor's)
        self._late_checked = 0.0  # (time.monotonic)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="tputune-webhooks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the loop; posts still in flight are not waited for past a few seconds (their deliveries stay
        pending, and are sent again once their lease ends)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT_SECONDS)
        self.close()

    def close(self) -> None:
        """Cancel the posts in flight, close the connections, end the event loop."""
        loop, thread = self._loop, self._loop_thread
        if loop is None or thread is None:
            return
        self._loop = None

        async def shutdown() -> None:
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()
            if self._client is not None:
                await self._client.aclose()
                self._client = None

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(STOP_WAIT_SECONDS)
        except Exception:
            log.warning("webhook posts did not stop within %g s", STOP_WAIT_SECONDS)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_WAIT_SECONDS)
        if not thread.is_alive():
            loop.close()
        if self._lookups is not None:
            self._lookups.shutdown(wait=False, cancel_futures=True)

    def run(self) -> None:
        while not self._stop.is_set():
            self.step()

    def step(self) -> None:
        """A pass, then the wait before the next: none while work is left, else until a post ends or the
        dispatcher's interval has passed; then, while posts are in flight, until they end or a moment has
        passed (a pass records the ends of several, not one each)."""
        self._wake.clear()
        more = False
        try:
            more = self.tick()
        except Exception:
            log.exception("webhook pass failed; retrying")
        if not more:
            self._wake.wait(self.interval)
        if self._futures:  # (until all have ended, or a moment has passed: one endpoint may never answer)
            concurrent.futures.wait(list(self._futures.values()), GATHER_SECONDS)

    def tick(self) -> bool:
        """One pass: read new events into deliveries, send those due. True if it left work for the next."""
        if self.is_leader is not None and not self.is_leader():
            return False
        more = self.scan()
        more = self.send_due() or more
        if time.monotonic() - self._last_cleanup > 3600:
            self.cleanup()
        return more

    # --- events into deliveries ---

    def scan(self) -> bool:
        """Write the deliveries of the status events not yet read; move the cursor. True if it read a full
        page (more wait).

        Each pass reads the events after the last one this process read (`_seen`). Every
        LATE_CHECK_SECONDS the cursor moves up to them (on PostgreSQL, to the events older than the grace,
        after reading again those after the cursor: an event committed late, behind one read already)."""
        with session_scope(self.engine) as session:
            cursor = session.get_one(WebhookCursor, 1)  # (migration 0011 makes it)
            start = cursor.event_id
            seen = max(self._seen or 0, start)
            # The events to read now: up to the last one visible (read first: SQLite's reads stop there).
            top = session.scalar(sa_select(func.max(JobEvent.id)).where(col(JobEvent.id) > seen)) or seen
            # Every `late_check_seconds` (not on every pass: it is a write) the cursor moves on; on
            # PostgreSQL the events after it are read again first.
            late = time.monotonic() - self._late_checked >= self.late_check_seconds
            horizon = None
            if late:
                horizon = top if self.grace == 0 else self._horizon(session, start)
                self._late_checked = time.monotonic()
            hooks = list(session.exec(select(Webhook).where(col(Webhook.disabled_at).is_(None))).all())
            full = False
            written: set[tuple[str, int]] = set()
            if hooks:
                tenants = {hook.tenant for hook in hooks}
                rows, last, full = self._status_events(session, seen, tenants, top, SCAN_PAGE)
                if late and self.grace > 0 and seen > start:
                    written |= self._write(
                        session, hooks, self._status_events(session, start, tenants, seen)[0]
                    )
                written |= self._write(session, hooks, rows)
                seen = last if full and last is not None else top
            else:
                seen = top
            if horizon is not None and min(horizon, seen) > start:
                cursor.event_id = min(horizon, seen)
                cursor.updated_at = utcnow()
                session.add(cursor)
            session.commit()
        # (only once committed: if the commit fails, the next pass reads the same events again)
        self._seen = seen
        self._written = {pair for pair in self._written | written if pair[1] > cursor.event_id}
        return full

    def _horizon(self, session: Session, after: int) -> int:
        """PostgreSQL: the last event id the cursor may move to, of the events older than the grace (every
        one up to it is committed)."""
        before = utcnow() - timedelta(seconds=self.grace)
        query = sa_select(func.max(JobEvent.id)).where(
            col(JobEvent.id) > after, col(JobEvent.created_at) < before
        )
        return session.scalar(query) or after

    def _status_events(
        self,
        session: Session,
        after: int,
        tenants: set[str],
        until: int | None = None,
        limit: int | None = None,
    ) -> tuple[list[Any], int | None, bool]:
        """The status events with ids in (after, until], oldest first, `limit` at most: those of `tenants`'
        jobs, the last id read, and whether it read `limit`. (The events first, then their jobs by key:
        joined in one plan, PostgreSQL may read every job of the tenants.)"""
        events, jobs = JobEvent.__table__, Job.__table__  # type: ignore[attr-defined]
        page = sa_select(events.c.id, events.c.created_at, events.c.data, events.c.job_seq).where(
            events.c.id > after, events.c.type == "status"
        )
        if until is not None:
            page = page.where(events.c.id <= until)
        page = page.order_by(events.c.id)
        if limit is not None:
            page = page.limit(limit)
        read = page.subquery()
        query = _with_jobs(read, jobs).order_by(read.c.id)
        rows = list(session.connection().execute(query).all())
        last = rows[-1].id if rows else None
        full = limit is not None and len(rows) == limit
        if EVERY_TENANT not in tenants:
            rows = [row for row in rows if row.tenant in tenants]
        return rows, last, full

    def _write(self, session: Session, hooks: list[Webhook], rows: Sequence[Any]) -> set[tuple[str, int]]:
        """Insert the deliveries of `rows` (those not written yet); returns their (endpoint, event) pairs,
        for `_written` once committed."""
        return write_deliveries(session, hooks, rows, self._written)

    # --- sending ---

    def send_due(self) -> bool:
        """Record how the posts that ended went, and start posting the deliveries now due: SEND_PAGE a pass
        at most, PER_ENDPOINT in flight to one endpoint, MAX_IN_FLIGHT in all. Posts run on the sender's
        event loop and are not waited for: an endpoint that answers slowly, or not at all, holds only its
        own deliveries. A job's later move waits for its earlier one to be delivered or given up. True if
        it recorded any (the next of a job's moves may be due now) or left due deliveries for the next."""
        finished = self._finished()
        now = utcnow()
        with session_scope(self.engine) as session:
            if finished:
                self._record(session, finished, now)
            room = MAX_IN_FLIGHT - len(self._in_flight)
            due = self._due(session, min(room, SEND_PAGE)) if room > 0 else []
            if due:
                # Leased while it is in flight: not due again unless this process ends before it records
                # how it went (then it is sent again: at least once).
                lease = now + timedelta(seconds=self.settings.webhook_timeout_seconds + LEASE_MARGIN_SECONDS)
                session.connection().execute(_LEASE, {"ids": [row.id for row in due], "until": lease})
            session.commit()
        for row in due:
            self._submit(row)
        # (the posts' ends wake the next pass)
        return bool(finished) or len(due) == SEND_PAGE

    def _due(self, session: Session, room: int) -> list[Any]:
        """The deliveries to post now: `room` at most, PER_ENDPOINT in flight to one endpoint, and of a
        job's, only its oldest pending one (a job's moves reach an endpoint in order).

        One query reads the oldest due (_DUE). Where that is a full page, each endpoint's oldest are read
        instead, one query each: else an endpoint with a backlog (one that fails fast, say) would fill
        every page and hold up every other's for as long as it lasts (bench/webhooks.py). A job's later
        move found behind an earlier one that waits for its retry is put off until then: it cannot go
        before, and it would come back in every page meanwhile."""
        in_flight = Counter(self._in_flight.values())
        full = sorted(hook for hook, count in in_flight.items() if count >= PER_ENDPOINT)
        connection = session.connection()
        now = utcnow()
        rows = list(connection.execute(_DUE, {"now": now, "full": full, "page": SEND_PAGE}))
        if len(rows) == SEND_PAGE:
            statement = _DUE_OF_ENDPOINTS[connection.dialect.name]
            rows = list(connection.execute(statement, {"now": now, "full": full}))
            rows.sort(key=lambda row: (as_utc(row.next_attempt_at), row.id))
        taken: Counter[str] = Counter()
        candidates: list[tuple[int, int, Any]] = []
        for row in rows:
            if row.id not in self._in_flight and in_flight[row.hook] + taken[row.hook] < 2 * PER_ENDPOINT:
                taken[row.hook] += 1
                candidates.append((taken[row.hook], len(candidates), row))
        # Taken in turns: each endpoint's oldest, then each one's second... (where `room` is short)
        candidates.sort(key=lambda candidate: candidate[:2])
        due: list[Any] = []
        put_off = []
        # A few more than `room` at a time, in that order, until `room` are due: with many endpoints only
        # the first turns are sent (each job's oldest pending delivery, looked up for 3,000 candidates at
        # once, took most of a pass with 1,000 endpoints on PostgreSQL).
        step = 2 * room  # (room > 0: send_due asks for none otherwise)
        for start in range(0, len(candidates), step):
            if len(due) >= room:
                break
            chunk = [row for *_, row in candidates[start : start + step]]
            pairs = sorted({(row.hook, row.job_id) for row in chunk if row.job_id is not None})
            first: dict[tuple[str, str], Any] = {}
            if pairs:
                for pending in connection.execute(_PENDING_OF_JOBS, {"pairs": pairs}):
                    first.setdefault((pending.webhook_id, pending.job_id), pending)
            for row in chunk:
                earlier = first.get((row.hook, row.job_id)) if row.job_id is not None else None
                if earlier is not None and earlier.id != row.id:
                    until = as_utc(earlier.next_attempt_at)
                    if earlier.id not in self._in_flight and until is not None and until > now:
                        put_off.append({"delivery": row.id, "until": until})
                    continue
                if in_flight[row.hook] < PER_ENDPOINT and len(due) < room:
                    in_flight[row.hook] += 1
                    due.append(row)
        if put_off:
            connection.execute(_PUT_OFF, put_off)
        return due

    def _record(self, session: Session, finished: list[tuple[Any, Attempt]], now: datetime) -> None:
        """Store how each post went; an endpoint's failure streak starts or ends; one that has failed every
        attempt for TPUTUNE_WEBHOOK_DISABLE_AFTER_HOURS is disabled."""
        retry = self.settings.webhook_retry_seconds
        delivered: set[str] = set()
        failing: set[str] = set()
        updates = []
        for row, result in finished:
            attempts = row.attempts + 1
            values: dict[str, Any] = {
                "delivery": row.id,
                "attempts": attempts,
                "last_attempt_at": now,
                "response_status": result.response_status,
                "last_error": (result.error or "")[:500] or None,
                "status": PENDING,
                "next_attempt_at": None,
            }
            if result.delivered:
                values["status"] = DELIVERED
                delivered.add(row.hook)
            else:
                failing.add(row.hook)
                if attempts <= len(retry):
                    values["next_attempt_at"] = now + timedelta(seconds=retry[attempts - 1])
                else:
                    values["status"] = FAILED
                    log.warning(
                        "webhook %s: delivery %d failed after %d attempts: %s",
                        row.hook,
                        row.id,
                        attempts,
                        result.error,
                    )
            updates.append(values)
        session.connection().execute(_RECORD, updates)
        if delivered:
            session.execute(
                _hooks.update()
                .where(_hooks.c.id.in_(sorted(delivered)), _hooks.c.failing_since.is_not(None))
                .values(failing_since=None)
            )
        failing -= delivered
        if not failing:
            return
        session.execute(
            _hooks.update()
            .where(_hooks.c.id.in_(sorted(failing)), _hooks.c.failing_since.is_(None))
            .values(failing_since=now)
        )
        hours = self.settings.webhook_disable_after_hours
        if hours <= 0:
            return
        expired = select(Webhook).where(
            col(Webhook.id).in_(sorted(failing)),
            col(Webhook.disabled_at).is_(None),
            col(Webhook.failing_since) <= now - timedelta(hours=hours),
        )
        for hook in session.exec(expired).all():
            since = as_utc(hook.failing_since)
            assert since is not None
            reason = (
                f"Every delivery failed since {since:%Y-%m-%d %H:%M} UTC ({hours:g} hours or more): fix the "
                "endpoint, send it a test, and enable it again (PATCH /webhooks/{id} with enabled: true)."
            )
            disable(session, hook, reason, now)
            changed = {"enabled": {"from": True, "to": False}, "reason": reason}
            audit.record(session, audit.SERVER, "webhook.updated", hook.tenant, hook.id, changed)
            log.warning("webhook %s disabled: every delivery failed since %s", hook.id, since.isoformat())

    def _finished(self) -> list[tuple[Any, Attempt]]:
        """The posts that ended since the last pass (and no longer in flight)."""
        finished: list[tuple[Any, Attempt]] = []
        while True:
            try:
                row, result = self._done.get_nowait()
            except queue.Empty:
                return finished
            self._in_flight.pop(row.id, None)
            self._futures.pop(row.id, None)
            finished.append((row, result))

    def settle(self, timeout: float = 60.0) -> int:
        """Wait for the posts in flight to end and record how they went (what the next pass would do);
        how many it recorded. For tests and benches that run the sender a pass at a time."""
        concurrent.futures.wait(list(self._futures.values()), timeout)
        finished = self._finished()
        if finished:
            with session_scope(self.engine) as session:
                self._record(session, finished, utcnow())
                session.commit()
        return len(finished)

    def _submit(self, row: Any) -> None:
        future = asyncio.run_coroutine_threadsafe(self._post(row), self._event_loop())
        self._in_flight[row.id] = row.hook
        self._futures[row.id] = future
        future.add_done_callback(lambda done: self._posted(row, done))

    def _posted(self, row: Any, future: concurrent.futures.Future[Attempt]) -> None:
        if future.cancelled():  # (stopping: the delivery stays pending, and is sent again)
            return
        self._done.put((row, future.result()))
        self._wake.set()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            # Address lookups run on threads: enough that slow DNS for one host leaves others theirs.
            self._lookups = ThreadPoolExecutor(max_workers=LOOKUPS, thread_name_prefix="tputune-webhook-dns")
            loop.set_default_executor(self._lookups)
            self._loop_thread = threading.Thread(
                target=loop.run_forever, name="tputune-webhook-posts", daemon=True
            )
            self._loop_thread.start()
            self._loop = loop
        return self._loop

    async def _post(self, row: Any) -> Attempt:
        """Post one delivery (within the timeout, from the lookup to the answer)."""
        timeout = self.settings.webhook_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                return await self._attempt(row)
        except (TimeoutError, httpx.TimeoutException):
            return Attempt(False, error=f"no answer within {timeout:g} s")

    async def _address(self, host: str, port: int) -> str | None:
        """`resolve` on a lookup thread; an address checked is used again for RESOLVED_SECONDS (a burst to
        one endpoint looks it up once: the lookup's thread hop cost as much CPU as the post's parsing).
        What is connected to is still an address that was checked. Behind a proxy (TPUTUNE_WEBHOOK_PROXY),
        None for a name that does not resolve here: the proxy looks it up (egress proxies often are the
        only way to names outside); one that resolves here to a private address is still refused."""
        key = (host, port)
        now = time.monotonic()
        cached = self._resolved.get(key)
        if cached is not None and cached[1] > now:
            return cached[0]
        allow = self.settings.webhook_allow_private
        address: str | None = None
        try:
            address = await asyncio.get_running_loop().run_in_executor(None, resolve, host, port, allow)
        except Unresolved:
            if self.settings.webhook_proxy is None:
                raise
        if len(self._resolved) >= 1024:
            self._resolved.clear()
        self._resolved[key] = (address, now + RESOLVED_SECONDS)
        return address

    async def _attempt(self, row: Any) -> Attempt:
        """Post to the address its host resolves to now (checked), with the signature; behind a proxy, by
        the host's name (the proxy connects: CONNECT host:port for https), once checked as above."""
        try:
            parts = urlsplit(row.url)
            host = parts.hostname or ""
            port = parts.port or (443 if parts.scheme == "https" else 80)
            address = await self._address(host, port)
        except Refused as exc:
            return Attempt(False, error=str(exc))
        except ValueError as exc:
            return Attempt(False, error=f"invalid URL: {exc}")
        via = host if self.settings.webhook_proxy is not None else address
        assert via is not None  # (None only behind a proxy)
        netloc = f"[{via}]" if ":" in via else via
        target = urlunsplit((parts.scheme, f"{netloc}:{port}", parts.path or "/", parts.query, ""))
        message_id = json.loads(row.body)["id"]
        timestamp = int(time.time())
        headers = {
            "host": parts.netloc.rpartition("@")[2],
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signatures(row, message_id, timestamp, row.body),
        }
        extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
        try:
            async with self._http().stream(
                "POST", target, content=row.body, headers=headers, extensions=extensions
            ) as r:
                if 200 <= r.status_code < 300:
                    return Attempt(True, r.status_code)
                note = " (redirects are not followed)" if 300 <= r.status_code < 400 else ""
                return Attempt(False, r.status_code, f"HTTP {r.status_code}{note}")
        except httpx.TimeoutException:
            raise  # (_post says it as it says its own deadline: "no answer within ...")
        except httpx.HTTPError as exc:
            return Attempt(False, error=f"{type(exc).__name__}: {exc}")

    def _http(self) -> httpx.AsyncClient:
        """(On the event loop only.)"""
        if self._client is None:
            bundle = self.settings.webhook_ca_bundle
            proxy = self.settings.webhook_proxy
            self._client = httpx.AsyncClient(
                proxy=proxy.get_secret_value() if proxy is not None else None,
                trust_env=False,  # (not HTTPS_PROXY: posts go to the address checked, or the proxy set)
                verify=ssl.create_default_context(cafile=str(bundle)) if bundle is not None else True,
                timeout=self.settings.webhook_timeout_seconds,
                follow_redirects=False,
                limits=httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=64),
            )
        return self._client

    def cleanup(self) -> None:
        """Forget deliveries done (delivered or failed) longer ago than the server keeps them, and secrets
        rotated out."""
        self._last_cleanup = time.monotonic()
        before = utcnow() - timedelta(days=self.settings.webhook_retention_days)
        with session_scope(self.engine) as session:
            session.execute(
                delete(WebhookDelivery).where(
                    col(WebhookDelivery.status) != PENDING, col(WebhookDelivery.created_at) < before
                )
            )
            # a rotated secret no longer signs: not kept either
            session.execute(
                _hooks.update()
                .where(_hooks.c.old_secret.is_not(None), _hooks.c.old_secret_until <= utcnow())
                .values(old_secret=None, old_secret_until=None)
            )
            session.commit()


def count_endpoints(session: Session) -> dict[str, int]:
    """Endpoints by state: enabled, failing (enabled, every delivery failing lately) or disabled."""
    state = case(
        (col(Webhook.disabled_at).is_not(None), "disabled"),
        (col(Webhook.failing_since).is_not(None), "failing"),
        else_="enabled",
    )
    counts = dict.fromkeys(("enabled", "failing", "disabled"), 0)
    for name, count in session.exec(select(state, func.count()).group_by(state)):
        counts[name] = count
    return counts


def count_by_status(session: Session) -> dict[str, int]:
    counts = dict.fromkeys((PENDING, DELIVERED, FAILED), 0)
    query = select(WebhookDelivery.status, func.count()).group_by(WebhookDelivery.status)
    for status, count in session.exec(query):
        counts[status] = count
    return counts
