"""Webhooks: a tenant's endpoints are told when its jobs start, pause and end, as hosted services do
(OpenAI's `fine_tuning.job.succeeded`...), signed as Standard Webhooks says (standardwebhooks.com).

The job events are the outbox. Every move of a job writes a status event in the transaction that moves
it (api.jobs.transition, fail_queued), whoever makes it: the dispatcher, a worker's report, a cancel. The
sender (a thread beside the dispatcher, on the leader only) reads the status events after its cursor,
writes a delivery for each endpoint that wants one (the body fixed then: every attempt sends the same),
and posts the deliveries that are due, retrying with backoff. At least once: an endpoint may get one
twice (`webhook-id` is the same each time, to drop the second).

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

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, get_args
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy import delete, func, tuple_
from sqlalchemy import select as sa_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

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
CURSOR_GRACE_SECONDS = 60.0  # PostgreSQL: longer than any transaction that writes job events
LATE_CHECK_SECONDS = 5.0  # how often the cursor moves (PostgreSQL: the events after it read again)
SCAN_PAGE = 1_000  # status events one pass reads at most
SEND_PAGE = 256  # due deliveries one pass reads at most
PER_ENDPOINT = 8  # of those, the most it sends to one endpoint (one round of SENDERS)
SENDERS = 8  # deliveries posted at once
USER_AGENT = "tputune-webhooks/0.1"
STOP_WAIT_SECONDS = 3.0


def new_webhook_id() -> str:
    return "wh_" + secrets.token_hex(8)


def new_secret() -> str:
    """A Standard Webhooks secret: `whsec_` and 32 random bytes, base64."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def sign(secret: str, message_id: str, timestamp: int, body: str) -> str:
    """The `webhook-signature` header: `v1,` and the base64 HMAC-SHA256, keyed by the secret's bytes, of
    `{id}.{timestamp}.{body}`."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    digest = hmac.new(key, f"{message_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


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


def resolve(host: str, port: int, allow_private: bool) -> str:
    """The address to connect to for `host`: every address it resolves to must be public (unless
    private ones are allowed), not just the first, so that an answer cannot mix one in."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise Refused(f"could not resolve {host}: {exc}") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise Refused(f"{host} resolves to no address")
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


@dataclass
class Attempt:
    """How one post went: delivered (2xx), or why not."""

    delivered: bool
    response_status: int | None = None
    error: str | None = None


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
        self._pool: ThreadPoolExecutor | None = None
        self._client: httpx.Client | None = None
        self._last_cleanup = 0.0
        self._seen: int | None = None  # the last event id this process read (None: the cursor's)
        self._late_checked = 0.0  # (time.monotonic)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="tputune-webhooks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the loop; a post still in flight is not waited for past a few seconds (its delivery stays
        pending, and is sent again)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT_SECONDS)
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            more = False
            try:
                more = self.tick()
            except Exception:
                log.exception("webhook pass failed; retrying")
            if not more:
                self._wake.wait(self.interval)

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
            hooks = list(session.exec(select(Webhook)).all())
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
        query = (
            sa_select(
                read.c.id,
                read.c.created_at,
                read.c.data,
                jobs.c.id.label("job_id"),
                jobs.c.tenant,
                jobs.c.error_code,
                jobs.c.error_message,
            )
            .join(jobs, jobs.c.seq == read.c.job_seq)
            .order_by(read.c.id)
        )
        rows = list(session.connection().execute(query).all())
        last = rows[-1].id if rows else None
        return [row for row in rows if row.tenant in tenants], last, limit is not None and len(rows) == limit

    def _write(self, session: Session, hooks: list[Webhook], rows: Sequence[Any]) -> set[tuple[str, int]]:
        """Insert the deliveries of `rows` (those not written yet); returns their (endpoint, event) pairs,
        for `_written` once committed."""
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
            for hook in by_tenant.get(row.tenant, []):
                if event_type not in hook.events or (hook.id, row.id) in self._written:
                    continue
                if created < as_utc(hook.created_at):  # type: ignore[operator]
                    continue  # (a move made before the endpoint was)
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
            table = WebhookDelivery.__table__  # type: ignore[attr-defined]
            statement = upsert_insert(self.engine)(table).on_conflict_do_nothing(
                index_elements=["webhook_id", "event_id"]
            )
            session.execute(statement, deliveries)
        return pairs

    # --- sending ---

    def send_due(self) -> bool:
        """Post the deliveries that are due (SEND_PAGE at most, SENDERS at once) and record how each went.
        A job's later move waits for its earlier one to be delivered or given up. True if it sent any."""
        deliveries, hooks = WebhookDelivery.__table__, Webhook.__table__  # type: ignore[attr-defined]
        query = (
            sa_select(deliveries.c.id, deliveries.c.body, deliveries.c.attempts, deliveries.c.job_id)
            .add_columns(hooks.c.id.label("hook"), hooks.c.url, hooks.c.secret)
            .join(hooks, hooks.c.id == deliveries.c.webhook_id)
            .where(deliveries.c.status == PENDING, deliveries.c.next_attempt_at <= utcnow())
            .order_by(deliveries.c.next_attempt_at, deliveries.c.id)
            .limit(SEND_PAGE)
        )
        with self.engine.connect() as connection:
            rows = list(connection.execute(query).all())
            # A few an endpoint a pass: one that times out on every post must not hold up every other's.
            # A job's moves reach an endpoint in order: of a job's, only its oldest pending delivery is
            # sent (which may wait for a retry, and not be due). Looked up for the candidates only.
            per_hook: dict[str, int] = {}
            candidates = []
            for row in rows:
                per_hook[row.hook] = per_hook.get(row.hook, 0) + 1
                if per_hook[row.hook] <= 2 * PER_ENDPOINT:
                    candidates.append(row)
            pairs = sorted({(row.hook, row.job_id) for row in candidates if row.job_id is not None})
            first: dict[tuple[str, str], int] = {}
            if pairs:
                pair = tuple_(deliveries.c.webhook_id, deliveries.c.job_id)
                oldest = (
                    sa_select(deliveries.c.webhook_id, deliveries.c.job_id, func.min(deliveries.c.id))
                    .where(deliveries.c.status == PENDING, pair.in_(pairs))
                    .group_by(deliveries.c.webhook_id, deliveries.c.job_id)
                )
                first = {(hook, job): seq for hook, job, seq in connection.execute(oldest)}
        taken: dict[str, int] = {}
        due = []
        for row in candidates:
            if row.job_id is not None and first.get((row.hook, row.job_id)) != row.id:
                continue
            taken[row.hook] = taken.get(row.hook, 0) + 1
            if taken[row.hook] <= PER_ENDPOINT:
                due.append(row)
        if not due:
            return False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=SENDERS, thread_name_prefix="tputune-webhook-post")
        results = list(self._pool.map(self._post, due))
        retry = self.settings.webhook_retry_seconds
        with session_scope(self.engine) as session:
            for row, result in zip(due, results, strict=True):
                attempts = row.attempts + 1
                values: dict[str, Any] = {
                    "attempts": attempts,
                    "last_attempt_at": utcnow(),
                    "response_status": result.response_status,
                    "last_error": (result.error or "")[:500] or None,
                }
                if result.delivered:
                    values.update(status=DELIVERED, next_attempt_at=None)
                elif attempts <= len(retry):
                    values["next_attempt_at"] = utcnow() + timedelta(seconds=retry[attempts - 1])
                else:
                    values.update(status=FAILED, next_attempt_at=None)
                    log.warning(
                        "webhook %s: delivery %d failed after %d attempts: %s",
                        row.hook,
                        row.id,
                        attempts,
                        result.error,
                    )
                session.execute(
                    deliveries.update()
                    .where(deliveries.c.id == row.id, deliveries.c.status == PENDING)
                    .values(**values)
                )
            session.commit()
        return True  # (the next of a job's moves may be due now: another pass at once)

    def _post(self, row: Any) -> Attempt:
        """Post one delivery to the address its host resolves to now (checked), with the signature."""
        try:
            parts = urlsplit(row.url)
            host = parts.hostname or ""
            port = parts.port or (443 if parts.scheme == "https" else 80)
            address = resolve(host, port, self.settings.webhook_allow_private)
        except Refused as exc:
            return Attempt(False, error=str(exc))
        except ValueError as exc:
            return Attempt(False, error=f"invalid URL: {exc}")
        netloc = f"[{address}]" if ":" in address else address
        target = urlunsplit((parts.scheme, f"{netloc}:{port}", parts.path or "/", parts.query, ""))
        message_id = json.loads(row.body)["id"]
        timestamp = int(time.time())
        headers = {
            "host": parts.netloc.rpartition("@")[2],
            "content-type": "application/json",
            "user-agent": USER_AGENT,
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(row.secret, message_id, timestamp, row.body),
        }
        extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
        try:
            with self._http().stream(
                "POST", target, content=row.body, headers=headers, extensions=extensions
            ) as r:
                if 200 <= r.status_code < 300:
                    return Attempt(True, r.status_code)
                note = " (redirects are not followed)" if 300 <= r.status_code < 400 else ""
                return Attempt(False, r.status_code, f"HTTP {r.status_code}{note}")
        except httpx.TimeoutException:
            return Attempt(False, error=f"no answer within {self.settings.webhook_timeout_seconds:g} s")
        except httpx.HTTPError as exc:
            return Attempt(False, error=f"{type(exc).__name__}: {exc}")

    def _http(self) -> httpx.Client:
        if self._client is None:
            bundle = self.settings.webhook_ca_bundle
            self._client = httpx.Client(
                verify=ssl.create_default_context(cafile=str(bundle)) if bundle is not None else True,
                timeout=self.settings.webhook_timeout_seconds,
                follow_redirects=False,
                limits=httpx.Limits(max_connections=SENDERS * 2),
            )
        return self._client

    def cleanup(self) -> None:
        """Forget deliveries done (delivered or failed) longer ago than the server keeps them."""
        self._last_cleanup = time.monotonic()
        before = utcnow() - timedelta(days=self.settings.webhook_retention_days)
        with session_scope(self.engine) as session:
            session.execute(
                delete(WebhookDelivery).where(
                    col(WebhookDelivery.status) != PENDING, col(WebhookDelivery.created_at) < before
                )
            )
            session.commit()


def count_by_status(session: Session) -> dict[str, int]:
    counts = dict.fromkeys((PENDING, DELIVERED, FAILED), 0)
    query = select(WebhookDelivery.status, func.count()).group_by(WebhookDelivery.status)
    for status, count in session.exec(query):
        counts[status] = count
    return counts
