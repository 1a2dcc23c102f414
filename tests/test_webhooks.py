"""Webhooks: endpoints per tenant, signed deliveries of jobs' moves, retries, and the address rules.

The endpoint is a real HTTP server on this machine; the sender is the real one, run a pass at a time
(`step`: a pass and its posts), in its own thread, or in the dispatcher of a running app with a worker
process."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlmodel import Session, select

from api import jobs as service
from api import webhooks
from api.main import create_app
from api.models import Job, JobEvent, WebhookCursor, WebhookDelivery
from api.settings import Settings
from api.states import JobStatus
from api.webhooks import WebhookSender
from tests.conftest import LiveApi
from tests.support.proxy import ConnectProxy
from tests.test_auth import ADMIN, bearer, make_key

OPEN = {"webhook_allow_http": True, "webhook_allow_private": True}


class Receiver:
    """An endpoint: records each request (headers, body) and answers the statuses queued in `answers`
    (then 200)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.server_names: list[str | None] = []  # (TLS: the names clients asked for, SNI)
        self.answers: list[int] = []
        self.fail_once: str | None = None  # an event type: the first request of that type gets a 500
        self.delay = 0.0  # seconds each answer waits (after the request is recorded)
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"])).decode()
                with receiver.arrived:
                    status = receiver.answers.pop(0) if receiver.answers else 200
                    if receiver.fail_once is not None and json.loads(body)["type"] == receiver.fail_once:
                        receiver.fail_once, status = None, 500
                    receiver.requests.append(
                        {
                            "path": self.path,
                            "headers": {k.lower(): v for k, v in self.headers.items()},
                            "body": body,
                        }
                    )
                    receiver.arrived.notify_all()
                time.sleep(receiver.delay)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/tputune?team=a"
        if tls is not None:
            tls.sni_callback = lambda _socket, name, _context: self.server_names.append(name)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
            self.url = f"https://localhost:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(request["body"]) for request in self.requests]

    def wait(self, count: int, timeout: float = 30) -> list[dict[str, Any]]:
        with self.arrived:
            if not self.arrived.wait_for(lambda: len(self.requests) >= count, timeout):
                raise AssertionError(f"{len(self.requests)} requests arrived, not {count}")
        return self.events()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    endpoint = Receiver()
    yield endpoint
    endpoint.close()


@pytest.fixture
def open_client(make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    """The API without the dispatcher, posting to http:// and local endpoints; no retry waits."""
    settings = make_settings(dispatcher_enabled=False, webhook_retry_seconds=[0.0, 0.0], **OPEN)
    with TestClient(create_app(settings)) as test_client:
        yield test_client


_senders: list[WebhookSender] = []


@pytest.fixture(autouse=True)
def _close_senders() -> Iterator[None]:
    yield
    while _senders:
        _senders.pop().stop()


def sender(client: TestClient, **overrides: Any) -> WebhookSender:
    settings = client.app.state.settings.model_copy(update=overrides)  # type: ignore[attr-defined]
    send = WebhookSender(client.app.state.engine, settings)  # type: ignore[attr-defined]
    _senders.append(send)
    return send


def step(send: WebhookSender) -> bool:
    """One pass, then its posts waited for and recorded (what the next pass would do); whether there
    is more to do."""
    more = send.tick()
    return send.settle() > 0 or more


def drain(send: WebhookSender) -> None:
    """Passes until one finds nothing to do (a job's moves go one a pass)."""
    for _ in range(20):
        if not step(send):
            return
    raise AssertionError("the sender still had work after 20 passes")


def verify(secret: str, request: dict[str, Any]) -> bool:
    """Standard Webhooks' check, written from its specification (not api.webhooks.sign)."""
    headers = request["headers"]
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.{request['body']}".encode()
    key = base64.b64decode(secret.split("_", 1)[1])
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(
        version == "v1" and hmac.compare_digest(signature, expected)
        for version, _, signature in (part.partition(",") for part in headers["webhook-signature"].split(" "))
    )


def new_job(client: TestClient, dataset: Path, **headers: str) -> str:
    body = {"name": "t", "model": "tiny", "dataset_uri": str(dataset)}
    response = client.post("/jobs", json=body, headers=headers)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def move(client: TestClient, job_id: str, *statuses: JobStatus, **fields: Any) -> None:
    """Move the job through `statuses` as the dispatcher and workers do (api.jobs.transition)."""
    with Session(client.app.state.engine, expire_on_commit=False) as session:  # type: ignore[attr-defined]
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        for status in statuses:
            extra = fields if status in (JobStatus.failed,) else {}
            assert service.transition(session, job, status, **extra)


def deliveries(client: TestClient, webhook_id: str, query: str = "", **headers: str) -> list[dict[str, Any]]:
    response = client.get(f"/webhooks/{webhook_id}/deliveries{query}", headers=headers)
    assert response.status_code == 200, response.text
    return list(response.json()["data"])


def test_endpoints_are_created_listed_and_deleted_with_the_secret_shown_once(client: TestClient) -> None:
    created = client.post(
        "/webhooks",
        json={"url": "https://ci.example.com/hook", "events": ["job.failed", "job.running", "job.failed"]},
    )
    assert created.status_code == 201, created.text
    hook = created.json()
    assert hook["id"].startswith("wh_") and hook["tenant"] == "default"
    assert hook["events"] == ["job.running", "job.failed"]  # (once each, in the order of a job's life)
    secret = hook.pop("secret")
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 32
    default = client.post(
        "/webhooks", json={"url": "https://ci.example.com/other", "description": "CI"}
    ).json()
    assert default["events"] == ["job.succeeded", "job.failed", "job.cancelled"]
    listed = client.get("/webhooks").json()["data"]
    assert [row["id"] for row in listed] == [hook["id"], default["id"]]
    assert all("secret" not in row for row in listed)
    assert client.get(f"/webhooks/{hook['id']}").json() == hook
    assert client.delete(f"/webhooks/{hook['id']}").json() == hook
    gone = client.get(f"/webhooks/{hook['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "webhook_not_found"
    assert [row["id"] for row in client.get("/webhooks").json()["data"]] == [default["id"]]


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("http://ci.example.com/hook", "webhook_url_not_https"),
        ("https://127.0.0.1/hook", "webhook_url_private"),
        ("https://10.1.2.3:8443/hook", "webhook_url_private"),
        ("https://169.254.169.254/computeMetadata/v1/", "webhook_url_private"),
        ("https://[::1]/hook", "webhook_url_private"),
        ("https://[::ffff:127.0.0.1]/hook", "webhook_url_private"),
        ("https://localhost/hook", "webhook_url_private"),
        ("https://api.localhost/hook", "webhook_url_private"),
        ("https://user:pass@ci.example.com/hook", "invalid_webhook_url"),
        ("https://ci.example.com/hook#x", "invalid_webhook_url"),
        ("https://ci.example.com:99999/hook", "invalid_webhook_url"),
        ("ftp://ci.example.com/hook", "invalid_webhook_url"),
        ("not a url", "invalid_webhook_url"),
    ],
)
def test_urls_that_are_refused(client: TestClient, url: str, code: str) -> None:
    response = client.post("/webhooks", json={"url": url})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, "url") and error["message"].endswith(".")
    assert client.get("/webhooks").json()["data"] == []


def test_bad_events_and_too_many_endpoints(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(dispatcher_enabled=False, webhook_max_per_tenant=2)
    with TestClient(create_app(settings)) as client:
        bad = client.post("/webhooks", json={"url": "https://a.example.com", "events": ["job.exploded"]})
        assert bad.status_code == 422
        assert (
            client.post("/webhooks", json={"url": "https://a.example.com", "events": []}).status_code == 422
        )
        for _ in range(2):
            assert client.post("/webhooks", json={"url": "https://a.example.com"}).status_code == 201
        third = client.post("/webhooks", json={"url": "https://a.example.com"})
        assert third.status_code == 409 and third.json()["error"]["code"] == "too_many_webhooks"


def test_each_tenant_sees_and_hears_only_its_own(
    make_settings: Callable[..., Settings], dataset: Path, receiver: Receiver
) -> None:
    settings = make_settings(dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0, **OPEN)
    with TestClient(create_app(settings)) as client:
        alpha, beta = bearer(make_key(client, "alpha")), bearer(make_key(client, "beta"))
        assert client.post("/webhooks", json={"url": receiver.url}).status_code == 401
        hook = client.post("/webhooks", json={"url": receiver.url}, headers=alpha).json()
        assert hook["tenant"] == "alpha"
        for method in ("get", "delete"):
            response = getattr(client, method)(f"/webhooks/{hook['id']}", headers=beta)
            assert response.status_code == 404, response.text
        assert client.get(f"/webhooks/{hook['id']}/deliveries", headers=beta).status_code == 404
        assert client.post(f"/webhooks/{hook['id']}/test", headers=beta).status_code == 404
        assert client.post(f"/webhooks/{hook['id']}/rotate-secret", headers=beta).status_code == 404
        assert (
            client.patch(f"/webhooks/{hook['id']}", json={"enabled": False}, headers=beta).status_code == 404
        )
        assert client.get("/webhooks", headers=beta).json()["data"] == []
        assert client.get("/webhooks?tenant=alpha", headers=beta).status_code == 403
        assert (
            client.post("/webhooks", json={"url": receiver.url, "tenant": "alpha"}, headers=beta).status_code
            == 403
        )
        # The admin sees every tenant's, and may add one for a tenant.
        made = client.post("/webhooks", json={"url": receiver.url, "tenant": "beta"}, headers=bearer(ADMIN))
        assert made.status_code == 201 and made.json()["tenant"] == "beta"
        assert [row["tenant"] for row in client.get("/webhooks", headers=bearer(ADMIN)).json()["data"]] == [
            "alpha",
            "beta",
        ]
        # A beta job's end reaches beta's endpoint only; alpha's hears of alpha's job.
        beta_job, alpha_job = new_job(client, dataset, **beta), new_job(client, dataset, **alpha)
        move(client, beta_job, JobStatus.cancelled)
        move(client, alpha_job, JobStatus.starting, JobStatus.running, JobStatus.succeeded)
        drain(sender(client))
        heard = {(json.loads(r["body"])["data"]["id"], r["headers"]["webhook-id"]) for r in receiver.requests}
        assert {job for job, _ in heard} == {beta_job, alpha_job} and len(receiver.requests) == 2
        assert [d["job_id"] for d in deliveries(client, hook["id"], **alpha)] == [alpha_job]
        assert [d["job_id"] for d in deliveries(client, made.json()["id"], **beta)] == [beta_job]


def test_the_platform_teams_endpoint_hears_every_tenants_jobs(
    make_settings: Callable[..., Settings], dataset: Path, receiver: Receiver
) -> None:
    """`tenant: "*"` (admin keys only): told of every tenant's jobs, each saying whose; no tenant's key
    sees it."""
    settings = make_settings(dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0, **OPEN)
    with TestClient(create_app(settings)) as client:
        alpha, beta = bearer(make_key(client, "alpha")), bearer(make_key(client, "beta"))
        every = {"url": receiver.url, "tenant": "*"}
        refused = client.post("/webhooks", json=every, headers=alpha)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
        for bad in ("Alpha team", "a*", "**"):
            response = client.post("/webhooks", json={**every, "tenant": bad}, headers=bearer(ADMIN))
            assert response.status_code == 422 and response.json()["error"]["param"] == "tenant", bad
        hook = client.post("/webhooks", json=every, headers=bearer(ADMIN)).json()
        assert hook["tenant"] == "*"
        assert client.get("/webhooks", headers=alpha).json()["data"] == []
        assert client.get(f"/webhooks/{hook['id']}", headers=alpha).status_code == 404
        listed = client.get("/webhooks?tenant=*", headers=bearer(ADMIN)).json()["data"]
        assert [row["id"] for row in listed] == [hook["id"]]
        jobs = {new_job(client, dataset, **alpha): "alpha", new_job(client, dataset, **beta): "beta"}
        for job_id in jobs:
            move(client, job_id, JobStatus.cancelled)
        drain(sender(client))
        assert {e["data"]["id"]: e["data"]["tenant"] for e in receiver.events()} == jobs


def test_a_jobs_end_is_posted_signed_and_retried_until_delivered(
    open_client: TestClient, dataset: Path, receiver: Receiver
) -> None:
    client = open_client
    hook = client.post("/webhooks", json={"url": receiver.url}).json()
    job_id = new_job(client, dataset)
    move(client, job_id, JobStatus.starting, JobStatus.running, JobStatus.succeeded)
    receiver.answers = [500]
    send = sender(client)
    step(send)  # the first attempt gets a 500
    assert len(receiver.requests) == 1
    [first] = deliveries(client, hook["id"])
    assert (first["status"], first["attempts"], first["response_status"]) == ("pending", 1, 500)
    assert first["last_error"] == "HTTP 500" and first["next_attempt_at"] is not None
    step(send)  # the retry (no wait: TPUTUNE_WEBHOOK_RETRY_SECONDS=0,0) gets a 200
    step(send)  # and nothing more is sent
    assert len(receiver.requests) == 2
    [done] = deliveries(client, hook["id"])
    assert (done["status"], done["attempts"], done["response_status"]) == ("delivered", 2, 200)
    assert done["next_attempt_at"] is None and done["last_error"] is None
    # Both attempts: the same message (its id too), signed with the endpoint's secret.
    one, two = receiver.requests
    assert one["body"] == two["body"] and one["headers"]["webhook-id"] == two["headers"]["webhook-id"]
    assert one["path"] == "/hooks/tputune?team=a"
    assert one["headers"]["content-type"] == "application/json"
    assert abs(int(two["headers"]["webhook-timestamp"]) - time.time()) < 60
    event = json.loads(one["body"])
    assert event["id"] == one["headers"]["webhook-id"] and event["object"] == "event"
    assert event["type"] == "job.succeeded" and done["payload"] == event
    assert event["data"] == {
        "id": job_id,
        "object": "job",
        "status": "succeeded",
        "previous_status": "running",
        "tenant": "default",
        "error": None,
    }
    # The secret is not in any answer after the creation: it is read here from where the server keeps it.
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        secret = session.exec(text("SELECT secret FROM webhooks")).scalar_one()  # type: ignore[call-overload]
    assert verify(secret, one) and verify(secret, two)
    assert not verify(secret, {**one, "body": one["body"].replace("succeeded", "failed")})


def test_a_job_deleted_as_it_ends_is_still_posted_once(
    open_client: TestClient, dataset: Path, receiver: Receiver
) -> None:
    """DELETE /jobs/{id} takes the job's events, the sender's outbox: a job deleted before the sender read
    its end is still posted (its delivery written as it goes), and one read already is not posted twice."""
    client = open_client
    hook = client.post("/webhooks", json={"url": receiver.url, "events": ["job.running", "job.succeeded"]})
    send = sender(client)
    early, late = new_job(client, dataset), new_job(client, dataset)
    move(client, early, JobStatus.starting, JobStatus.running, JobStatus.succeeded)
    drain(send)  # (early's moves read and posted)
    move(client, late, JobStatus.starting, JobStatus.running, JobStatus.succeeded)
    for job_id in (late, early):  # (late's moves not read yet)
        deleted = client.delete(f"/jobs/{job_id}")
        assert deleted.status_code == 200, deleted.text
    drain(send)
    posted = [(event["data"]["id"], event["type"]) for event in receiver.events()]
    assert sorted(posted) == sorted(
        (job_id, f"job.{status}") for job_id in (early, late) for status in ("running", "succeeded")
    )
    assert {row["job_id"] for row in deliveries(client, hook.json()["id"])} == {early, late}


def test_a_rotated_secret_signs_beside_the_new_one_for_a_while(
    open_client: TestClient, dataset: Path, receiver: Receiver
) -> None:
    client = open_client
    hook = client.post("/webhooks", json={"url": receiver.url}).json()
    old = hook["secret"]
    rotated = client.post(f"/webhooks/{hook['id']}/rotate-secret")
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()["secret"]
    assert new.startswith("whsec_") and new != old
    until = datetime.fromisoformat(rotated.json()["old_secret_until"])
    assert abs((until - datetime.now(UTC)).total_seconds() - 24 * 3600) < 60
    shown = client.get(f"/webhooks/{hook['id']}").json()
    assert "secret" not in shown and shown["old_secret_until"] == rotated.json()["old_secret_until"]
    send = sender(client)
    move(client, new_job(client, dataset), JobStatus.cancelled)
    drain(send)
    [both] = receiver.requests
    assert len(both["headers"]["webhook-signature"].split(" ")) == 2
    assert verify(new, both) and verify(old, both)
    # Rotated again at once (0 hours): the new secret only; the one before no longer signs.
    newest = client.post(f"/webhooks/{hook['id']}/rotate-secret", json={"old_secret_hours": 0}).json()
    assert newest["old_secret_until"] is None
    move(client, new_job(client, dataset), JobStatus.cancelled)
    drain(send)
    only = receiver.requests[1]
    assert verify(newest["secret"], only) and not verify(new, only) and not verify(old, only)
    refused = client.post(f"/webhooks/{hook['id']}/rotate-secret", json={"old_secret_hours": 200})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "old_secret_hours"
    # A rotated secret is forgotten once it no longer signs.
    client.post(f"/webhooks/{hook['id']}/rotate-secret", json={"old_secret_hours": 0.0001})
    time.sleep(0.5)
    send.cleanup()
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        kept = session.exec(text("SELECT old_secret, old_secret_until FROM webhooks")).one()  # type: ignore[call-overload]
    assert tuple(kept) == (None, None)
    assert client.post("/webhooks/wh_0000000000000000/rotate-secret").status_code == 404


def test_only_the_moves_asked_for_and_made_after_the_endpoint(
    open_client: TestClient, dataset: Path, receiver: Receiver
) -> None:
    client = open_client
    early = new_job(client, dataset)
    move(client, early, JobStatus.cancelled)  # before any endpoint
    hook = client.post(
        "/webhooks", json={"url": receiver.url, "events": ["job.running", "job.failed"]}
    ).json()
    job_id = new_job(client, dataset)
    move(client, job_id, JobStatus.starting, JobStatus.running)
    move(client, job_id, JobStatus.failed, error_code="worker_failed", error_message="The worker exited 1.")
    other = new_job(client, dataset)
    move(client, other, JobStatus.cancelled)  # not asked for
    drain(sender(client))
    events = receiver.events()
    assert [(e["type"], e["data"]["id"]) for e in events] == [("job.running", job_id), ("job.failed", job_id)]
    assert events[1]["data"]["error"] == {"code": "worker_failed", "message": "The worker exited 1."}
    assert events[1]["data"]["previous_status"] == "running"
    assert {d["type"] for d in deliveries(client, hook["id"])} == {"job.running", "job.failed"}


def test_a_jobs_moves_reach_an_endpoint_in_order(
    open_client: TestClient, dataset: Path, receiver: Receiver
) -> None:
    """Its later move is not sent while the earlier one waits for a retry; another job's is."""
    client = open_client
    client.post(
        "/webhooks", json={"url": receiver.url, "events": ["job.running", "job.succeeded", "job.cancelled"]}
    )
    job_id = new_job(client, dataset)
    move(client, job_id, JobStatus.starting, JobStatus.running, JobStatus.succeeded)
    other = new_job(client, dataset)
    move(client, other, JobStatus.cancelled)
    receiver.fail_once = "job.running"
    send = sender(client)
    step(send)
    assert sorted(e["type"] for e in receiver.events()) == ["job.cancelled", "job.running"]
    drain(send)
    assert [e["type"] for e in receiver.events() if e["data"]["id"] == job_id] == [
        "job.running",  # (the 500)
        "job.running",
        "job.succeeded",
    ]


def test_the_longest_error_message_is_sent_whole(
    open_client: TestClient, dataset: Path, receiver: Receiver
) -> None:
    client = open_client
    client.post("/webhooks", json={"url": receiver.url})
    job_id = new_job(client, dataset)
    message = "échec: " + "données ✗ " * 399  # 4,000 characters, the most a job's error holds
    assert len(message) <= 4000
    move(client, job_id, JobStatus.failed, error_code="bad_input", error_message=message)
    drain(sender(client))
    [event] = receiver.events()
    assert event["data"]["error"] == {"code": "bad_input", "message": message}


def test_a_delivery_gives_up_after_its_retries(
    open_client: TestClient, dataset: Path, receiver: Receiver
) -> None:
    client = open_client
    hook = client.post("/webhooks", json={"url": receiver.url}).json()
    move(client, new_job(client, dataset), JobStatus.cancelled)
    receiver.answers = [503, 503, 503, 503]
    send = sender(client)
    for _ in range(5):
        step(send)
    assert len(receiver.requests) == 3  # the first attempt and two retries (TPUTUNE_WEBHOOK_RETRY_SECONDS)
    [failed] = deliveries(client, hook["id"])
    assert (failed["status"], failed["attempts"], failed["last_error"]) == ("failed", 3, "HTTP 503")
    assert deliveries(client, hook["id"], "?status=pending") == []
    metrics = client.get("/metrics").text
    assert 'tputune_webhook_deliveries{status="failed"} 1.0' in metrics
    assert 'tputune_webhook_deliveries{status="pending"} 0.0' in metrics


def test_a_host_that_resolves_to_a_private_address_is_not_posted_to(
    open_client: TestClient, dataset: Path, receiver: Receiver
) -> None:
    """The server's rules tightened after the endpoint was made (or a public name that now resolves to a
    private address): checked when each delivery is sent, and nothing is posted."""
    client = open_client
    hook = client.post("/webhooks", json={"url": receiver.url.replace("127.0.0.1", "localhost")}).json()
    move(client, new_job(client, dataset), JobStatus.cancelled)
    step(sender(client, webhook_allow_private=False))
    assert receiver.requests == []
    [refused] = deliveries(client, hook["id"])
    assert refused["status"] == "pending" and refused["response_status"] is None
    assert "resolves to a private or local address (127.0.0.1)" in refused["last_error"]
    step(sender(client))  # allowed again: sent
    assert len(receiver.requests) == 1 and receiver.requests[0]["headers"]["host"].startswith("localhost:")


def test_a_slow_endpoint_holds_only_its_own_deliveries(
    make_settings: Callable[..., Settings], dataset: Path, receiver: Receiver
) -> None:
    """An endpoint that takes longer than the timeout to answer: another endpoint is told of the moves
    made meanwhile at once, not after the slow one's posts time out."""
    settings = make_settings(
        dispatcher_enabled=False, webhook_retry_seconds=[30.0], webhook_timeout_seconds=3.0, **OPEN
    )
    slow = Receiver()
    slow.delay = 4.0
    try:
        with TestClient(create_app(settings)) as client:
            stuck = client.post("/webhooks", json={"url": slow.url}).json()
            client.post("/webhooks", json={"url": receiver.url})
            first, second = new_job(client, dataset), new_job(client, dataset)
            send = sender(client)
            send.start()
            move(client, first, JobStatus.cancelled)
            receiver.wait(1)
            slow.wait(1)  # (its answer would come in 4 s)
            moved = time.monotonic()
            move(client, second, JobStatus.cancelled)
            receiver.wait(2, timeout=10)
            assert time.monotonic() - moved < 2.0  # (the slow post's timeout is 3 s)
            assert [e["data"]["id"] for e in receiver.events()] == [first, second]
            deadline = time.monotonic() + 10
            while not (timed_out := deliveries(client, stuck["id"], "?status=pending")) or not all(
                d["attempts"] for d in timed_out
            ):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            # The slow endpoint: both posts timed out (retried in 30 s).
            assert {d["job_id"]: d["last_error"] for d in timed_out} == {
                first: "no answer within 3 s",
                second: "no answer within 3 s",
            }
    finally:
        slow.close()


def test_an_endpoint_with_a_backlog_does_not_hold_up_another(
    make_settings: Callable[..., Settings],
    dataset: Path,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An endpoint that fails every post at once, with more due than a page (here 4): another endpoint's
    delivery goes out in the same pass, not after the backlog's. A job's later move behind an earlier one
    waiting for its retry is put off until then."""
    monkeypatch.setattr(webhooks, "SEND_PAGE", 4)
    settings = make_settings(dispatcher_enabled=False, webhook_retry_seconds=[30.0], **OPEN)
    failing = Receiver()
    failing.answers = [500] * 100
    try:
        with TestClient(create_app(settings)) as client:
            events = ["job.running", "job.cancelled"]
            backlog = client.post("/webhooks", json={"url": failing.url, "events": events}).json()
            ordered = new_job(client, dataset)
            move(client, ordered, JobStatus.starting, JobStatus.running, JobStatus.cancelling)
            move(client, ordered, JobStatus.cancelled)
            for _ in range(10):
                move(client, new_job(client, dataset), JobStatus.cancelled)
            client.post("/webhooks", json={"url": receiver.url})
            job_id = new_job(client, dataset)
            move(client, job_id, JobStatus.cancelled)
            send = sender(client)
            step(send)  # (4 a pass: SEND_PAGE)
            assert [e["data"]["id"] for e in receiver.events()] == [job_id]
            assert len(failing.requests) == 3
            step(send)
            mine = {(d["job_id"], d["type"]): d for d in deliveries(client, backlog["id"], "?limit=100")}
            running, cancelled = mine[ordered, "job.running"], mine[ordered, "job.cancelled"]
            assert (running["attempts"], running["response_status"]) == (1, 500)
            assert cancelled["attempts"] == 0 and cancelled["next_attempt_at"] == running["next_attempt_at"]
            drain(send)
            assert len(failing.requests) == 12  # (every move, of 12 jobs, but the one put off)
            heard = [(e["data"]["id"], e["type"]) for e in failing.events()]
            assert (ordered, "job.running") in heard and (ordered, "job.cancelled") not in heard
    finally:
        failing.close()


def test_an_endpoint_failing_for_long_is_disabled_until_enabled(
    make_settings: Callable[..., Settings], dataset: Path, receiver: Receiver
) -> None:
    """Every attempt failing for TPUTUNE_WEBHOOK_DISABLE_AFTER_HOURS (here 3.6 s, room for 18 attempts
    at 0.2 s; under CI's load a pass took up to 0.6 s, and 1.8 s once left only 3): the endpoint is
    disabled, its pending deliveries given up and no new ones written; a test still goes to it; enabled
    again, it hears of new moves, and a missed delivery can be sent again."""
    settings = make_settings(
        dispatcher_enabled=False,
        webhook_retry_seconds=[0.2] * 50,
        webhook_disable_after_hours=0.001,
        **OPEN,
    )
    with TestClient(create_app(settings)) as client:
        hook = client.post("/webhooks", json={"url": receiver.url}).json()
        assert (hook["enabled"], hook["disabled_reason"], hook["failing_since"]) == (True, None, None)
        missed = new_job(client, dataset)
        move(client, missed, JobStatus.cancelled)
        receiver.answers = [500] * 1000
        send = sender(client)
        started = time.monotonic()
        step(send)
        failing = client.get(f"/webhooks/{hook['id']}").json()
        assert failing["enabled"] and failing["failing_since"] is not None
        assert 'tputune_webhooks{state="failing"} 1.0' in client.get("/metrics").text
        while client.get(f"/webhooks/{hook['id']}").json()["enabled"]:
            assert time.monotonic() - started < 20
            step(send)
            time.sleep(0.05)
        assert time.monotonic() - started >= 3.6
        now = client.get(f"/webhooks/{hook['id']}").json()
        assert now["disabled_reason"].startswith("Every delivery failed since ") and now["disabled_at"]
        assert now["failing_since"] is not None
        [given_up] = deliveries(client, hook["id"])
        assert given_up["status"] == "failed" and given_up["attempts"] >= 5
        assert given_up["last_error"] == "not sent: the endpoint was disabled"
        assert 'tputune_webhooks{state="disabled"} 1.0' in client.get("/metrics").text
        # The audit log says the server did it, and why.
        logged = client.get("/audit", params={"target": hook["id"]}).json()["data"]
        assert [(e["action"], e["actor"]) for e in logged] == [
            ("webhook.updated", {"key_id": None, "tenant": None, "who": "the server"}),
            ("webhook.created", {"key_id": None, "tenant": "default", "who": None}),
        ]
        assert logged[0]["details"] == {
            "enabled": {"from": True, "to": False},
            "reason": now["disabled_reason"],
        }
        assert logged[0]["request_id"] is None
        server_did = client.get("/audit", params={"actor": "server"}).json()["data"]
        assert [e["id"] for e in server_did] == [logged[0]["id"]]
        tries = len(receiver.requests)
        # Disabled: a move is not written for it, and nothing is sent.
        move(client, new_job(client, dataset), JobStatus.cancelled)
        drain(send)
        assert len(receiver.requests) == tries and len(deliveries(client, hook["id"])) == 1
        retried = client.post(f"/webhooks/{hook['id']}/deliveries/{given_up['id']}/retry")
        assert retried.status_code == 409 and retried.json()["error"]["code"] == "webhook_disabled"
        # The endpoint fixed: a test is sent to it though it is disabled, and ends the failure streak.
        receiver.answers = []
        assert client.post(f"/webhooks/{hook['id']}/test").status_code == 202
        drain(send)
        assert receiver.events()[-1]["type"] == "webhook.test"
        now = client.get(f"/webhooks/{hook['id']}").json()
        assert now["enabled"] is False and now["failing_since"] is None
        # Enabled again: what it missed is sent again on request (the same message), new moves go out.
        enabled = client.patch(f"/webhooks/{hook['id']}", json={"enabled": True})
        assert enabled.status_code == 200, enabled.text
        assert (enabled.json()["enabled"], enabled.json()["disabled_reason"]) == (True, None)
        assert 'tputune_webhooks{state="enabled"} 1.0' in client.get("/metrics").text
        retried = client.post(f"/webhooks/{hook['id']}/deliveries/{given_up['id']}/retry")
        assert retried.status_code == 202 and retried.json()["status"] == "pending"
        again = client.post(f"/webhooks/{hook['id']}/deliveries/{given_up['id']}/retry")
        assert again.status_code == 409 and again.json()["error"]["code"] == "delivery_pending"
        later = new_job(client, dataset)
        move(client, later, JobStatus.cancelled)
        drain(send)
        sent = receiver.requests[tries + 1 :]
        assert sorted(json.loads(r["body"])["data"]["id"] for r in sent) == sorted([missed, later])
        resent = next(r for r in sent if json.loads(r["body"])["data"]["id"] == missed)
        assert resent["body"] == receiver.requests[0]["body"]
        assert resent["headers"]["webhook-id"] == receiver.requests[0]["headers"]["webhook-id"]
        assert {d["status"] for d in deliveries(client, hook["id"])} == {"delivered"}


def test_an_endpoint_is_changed_and_disabled_by_its_team(
    open_client: TestClient, dataset: Path, receiver: Receiver
) -> None:
    client = open_client
    hook = client.post("/webhooks", json={"url": "https://ci.example.com/a", "description": "CI"}).json()
    path = f"/webhooks/{hook['id']}"
    for body, code in [
        ({"url": "ftp://ci.example.com/"}, "invalid_webhook_url"),
        ({"events": []}, "invalid_request"),
        ({"events": ["job.queued"]}, "invalid_request"),
        ({"secret": "whsec_x"}, "invalid_request"),
    ]:
        refused = client.patch(path, json=body)
        assert refused.status_code == 422 and refused.json()["error"]["code"] == code, refused.text
    changed = client.patch(path, json={"url": receiver.url, "events": ["job.cancelled", "job.running"]})
    assert changed.status_code == 200, changed.text
    assert changed.json()["url"] == receiver.url and changed.json()["description"] == "CI"
    assert changed.json()["events"] == ["job.running", "job.cancelled"]
    assert client.patch(path, json={"description": None}).json()["description"] is None
    assert client.get(path).json()["url"] == receiver.url
    # Disabled by its team: its pending delivery is given up, and nothing more is sent.
    move(client, new_job(client, dataset), JobStatus.cancelled)
    sender(client).scan()
    off = client.patch(path, json={"enabled": False})
    assert off.json()["enabled"] is False and off.json()["disabled_reason"].startswith("Disabled; enable")
    [pending] = deliveries(client, hook["id"])
    assert (pending["status"], pending["last_error"]) == ("failed", "not sent: the endpoint was disabled")
    move(client, new_job(client, dataset), JobStatus.cancelled)
    drain(sender(client))
    assert receiver.requests == []
    # A delivery the sender wrote as the endpoint was being disabled (it had read the endpoints before):
    # given up when it is enabled again, not sent then.
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        body = json.dumps(pending["payload"])
        session.add(WebhookDelivery(webhook_id=hook["id"], type="job.cancelled", body=body))
        session.commit()
    assert client.patch(path, json={"enabled": True}).json()["enabled"] is True
    assert [d["status"] for d in deliveries(client, hook["id"])] == ["failed", "failed"]
    job_id = new_job(client, dataset)
    move(client, job_id, JobStatus.cancelled)
    drain(sender(client))
    assert [e["data"]["id"] for e in receiver.events()] == [job_id]
    assert client.patch("/webhooks/wh_0000000000000000", json={"enabled": True}).status_code == 404
    other = client.post(f"/webhooks/{hook['id']}/deliveries/{pending['id'] + 100}/retry")
    assert other.status_code == 404 and other.json()["error"]["code"] == "delivery_not_found"


def certificates(tmp_path: Path) -> tuple[Path, Callable[[str], ssl.SSLContext]]:
    """A CA of the test's own (its PEM file), and a server's TLS context with a certificate it signed for
    a given name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.now(UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tputune test CA")])

    def signed(subject: x509.Name, key: Any) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=1))
        )

    ca = (
        signed(ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = tmp_path / "ca.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def server(name: str) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            signed(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        pem = tmp_path / f"{name}.pem"
        pem.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pem)
        return context

    return ca_path, server


def test_an_https_endpoint_is_checked_against_its_name(
    make_settings: Callable[..., Settings], dataset: Path, tmp_path: Path
) -> None:
    """The sender connects to the address it checked, and still asks TLS for the URL's name (SNI) and
    checks the certificate against it: one made for another name, or by a CA it does not trust, fails."""
    ca, server = certificates(tmp_path)
    right, wrong = Receiver(server("localhost")), Receiver(server("elsewhere.example"))
    settings = make_settings(
        dispatcher_enabled=False,
        webhook_allow_private=True,
        webhook_ca_bundle=ca,
        webhook_retry_seconds=[0.0],
    )
    try:
        with TestClient(create_app(settings)) as client:
            good = client.post("/webhooks", json={"url": right.url}).json()
            bad = client.post("/webhooks", json={"url": wrong.url}).json()
            move(client, new_job(client, dataset), JobStatus.cancelled)
            drain(sender(client))
            assert len(right.requests) == 1 and set(right.server_names) == {"localhost"}
            assert right.requests[0]["headers"]["host"] == right.url.split("/")[2]
            assert [d["status"] for d in deliveries(client, good["id"])] == ["delivered"]
            assert wrong.requests == []
            [refused] = deliveries(client, bad["id"])
            assert refused["status"] == "failed" and "certificate" in refused["last_error"].lower()
            assert "elsewhere.example" not in right.server_names and set(wrong.server_names) == {"localhost"}
            # Without the CA (the public roots): not trusted.
            move(client, new_job(client, dataset), JobStatus.cancelled)
            drain(sender(client, webhook_ca_bundle=None))
            assert len(right.requests) == 1
            assert "CERTIFICATE_VERIFY_FAILED" in deliveries(client, good["id"])[0]["last_error"]
    finally:
        for endpoint in (right, wrong):
            endpoint.close()


def test_behind_an_egress_proxy_endpoints_are_asked_for_by_name(
    make_settings: Callable[..., Settings], dataset: Path, tmp_path: Path
) -> None:
    """With TPUTUNE_WEBHOOK_PROXY the sender asks the proxy for the endpoint by its name (CONNECT
    name:port), which only the proxy's network may resolve, and checks TLS against that name. A name that
    resolves here to a private address is still refused, without asking the proxy. Without the proxy, the
    name that does not resolve here fails."""
    ca, server = certificates(tmp_path)
    outside = Receiver(server("hooks.partner.test"))
    port = outside.server.server_address[1]
    proxy = ConnectProxy(hosts={"hooks.partner.test": "127.0.0.1"})
    settings = make_settings(
        dispatcher_enabled=False,
        webhook_allow_private=True,  # (to add the localhost endpoint; the senders below do not allow it)
        webhook_ca_bundle=ca,
        webhook_retry_seconds=[0.0],
        webhook_proxy=proxy.url.replace("http://", "http://ops:pr0xy-s3cret@"),
    )
    try:
        with TestClient(create_app(settings)) as client:
            hook = client.post("/webhooks", json={"url": f"https://hooks.partner.test:{port}/hook"}).json()
            move(client, new_job(client, dataset), JobStatus.cancelled)
            drain(sender(client, webhook_allow_private=False))
            assert proxy.tunnels == [f"hooks.partner.test:{port}"]
            assert len(outside.requests) == 1 and set(outside.server_names) == {"hooks.partner.test"}
            assert outside.requests[0]["headers"]["host"] == f"hooks.partner.test:{port}"
            assert [d["status"] for d in deliveries(client, hook["id"])] == ["delivered"]
            assert "pr0xy-s3cret" not in repr(settings)

            # A name that resolves here to a private address: refused here, the proxy not asked for it.
            inside = client.post("/webhooks", json={"url": f"https://localhost:{port}/hook"}).json()
            move(client, new_job(client, dataset), JobStatus.cancelled)
            drain(sender(client, webhook_allow_private=False))
            [refused] = deliveries(client, inside["id"])
            assert refused["status"] == "failed" and "private or local address" in refused["last_error"]
            assert proxy.tunnels == [f"hooks.partner.test:{port}"] * 2 and len(outside.requests) == 2

            # Without the proxy, the name does not resolve here.
            move(client, new_job(client, dataset), JobStatus.cancelled)
            drain(sender(client, webhook_allow_private=False, webhook_proxy=None))
            latest = deliveries(client, hook["id"])[0]
            assert latest["status"] == "failed"
            assert "could not resolve hooks.partner.test" in latest["last_error"]
            assert len(proxy.tunnels) == 2 and len(outside.requests) == 2
    finally:
        outside.close()
        proxy.close()


@pytest.mark.postgres
@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
def test_an_event_committed_after_a_later_one_is_not_missed(
    open_client: TestClient, dataset: Path, receiver: Receiver
) -> None:
    """PostgreSQL takes event ids at insert time: a transaction may commit its event after another took a
    later id and committed. The sender's cursor must not have moved past the first meanwhile."""
    client = open_client
    client.post("/webhooks", json={"url": receiver.url})
    slow, quick = new_job(client, dataset), new_job(client, dataset)
    engine = client.app.state.engine  # type: ignore[attr-defined]
    with Session(engine, expire_on_commit=False) as held:
        job = held.exec(select(Job).where(Job.id == slow)).one()
        held.add(
            JobEvent(
                job_seq=job.seq,
                type="status",
                message="queued → cancelled",
                data={"status": "cancelled", "from": "queued"},
            )
        )
        held.flush()  # its id is taken, not yet committed
        move(client, quick, JobStatus.cancelled)  # a later id, committed
        send = sender(client)
        send.late_check_seconds = 0  # (every pass reads the events after the cursor again, not every 5 s)
        step(send)
        assert [e["data"]["id"] for e in receiver.events()] == [quick]
        held.commit()
    step(send)
    assert sorted(e["data"]["id"] for e in receiver.events()) == sorted([quick, slow])
    step(send)
    assert len(receiver.requests) == 2


def test_more_moves_than_a_pass_reads_all_go_out_at_once(
    open_client: TestClient, dataset: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of moves past a page (here 3): the next pass reads on, also within the cursor's grace on
    PostgreSQL (where the cursor itself stays behind for a minute)."""
    monkeypatch.setattr(webhooks, "SCAN_PAGE", 3)
    client = open_client
    client.post("/webhooks", json={"url": receiver.url})
    ids = [new_job(client, dataset) for _ in range(8)]
    for job_id in ids:
        move(client, job_id, JobStatus.cancelled)
    drain(sender(client))
    assert sorted(e["data"]["id"] for e in receiver.events()) == sorted(ids)


def test_the_cursor_moves_on_without_endpoints(open_client: TestClient, dataset: Path) -> None:
    """With no endpoint the sender reads no events, but moves its cursor on (an endpoint made later does
    not make it read the past)."""
    client = open_client
    move(client, new_job(client, dataset), JobStatus.cancelled)
    send = sender(client)
    send.grace = 0.0
    step(send)
    with Session(client.app.state.engine) as session:  # type: ignore[attr-defined]
        cursor = session.get(WebhookCursor, 1)
        last = session.exec(text("SELECT max(id) FROM job_events")).scalar_one()  # type: ignore[call-overload]
        assert cursor is not None and cursor.event_id == last > 0
        assert session.exec(select(WebhookDelivery)).all() == []


def test_the_dispatcher_sends_them_for_a_job_a_worker_runs(
    live_api: Callable[..., LiveApi], dataset: Path, receiver: Receiver
) -> None:
    """The whole path: a worker process runs the job and reports to the API (uvicorn on a port), the
    dispatcher (a thread of the app) sends."""
    api = live_api(dispatcher_process=False, **OPEN)
    with api.client() as http:
        hook = http.post("/webhooks", json={"url": receiver.url, "events": ["job.running", "job.succeeded"]})
        hook_id = hook.json()["id"]
        ping = http.post(f"/webhooks/{hook_id}/test")
        assert ping.status_code == 202 and ping.json()["type"] == "webhook.test"
        job = http.post("/jobs", json={"name": "t", "model": "tiny", "dataset_uri": str(dataset)})
        job_id = job.json()["id"]
        events = receiver.wait(3)
        assert events[0]["type"] == "webhook.test" and events[0]["data"]["webhook_id"] == hook_id
        assert [(e["type"], e["data"]["id"]) for e in events[1:]] == [
            ("job.running", job_id),
            ("job.succeeded", job_id),
        ]
        assert http.get(f"/jobs/{job_id}").json()["status"] == "succeeded"
        deadline = time.monotonic() + 10  # (recorded once the endpoint's answer is in)
        while [d["status"] for d in http.get(f"/webhooks/{hook_id}/deliveries").json()["data"]] != [
            "delivered"
        ] * 3:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_webhooks_commands(live_api: Callable[..., LiveApi], receiver: Receiver, capsys: Any) -> None:
    from api.cli import main

    api = live_api(dispatcher_process=False, **OPEN)

    def run(*argv: str) -> str:
        assert main(["--api-url", api.url, "webhooks", *argv]) == 0
        return str(capsys.readouterr().out)

    out = run("create", receiver.url, "--events", "job.failed,job.running", "--description", "CI")
    hook_id, secret = out.split()[1], out.splitlines()[-1]
    assert out.startswith(f"created {hook_id} for tenant default (job.running, job.failed);")
    assert secret.startswith("whsec_")
    listed = run("list")
    assert hook_id in listed and receiver.url in listed and secret not in listed
    assert "job.running,job.failed" in listed
    assert f"tputune webhooks deliveries {hook_id}" in run("test", hook_id)
    [ping] = receiver.wait(1)
    assert ping["type"] == "webhook.test" and verify(secret, receiver.requests[0])
    deadline = time.monotonic() + 10
    while "delivered" not in (table := run("deliveries", hook_id)):  # (recorded after the post's answer)
        assert time.monotonic() < deadline, table
        time.sleep(0.1)
    row = table.splitlines()[1].split()
    assert row[3:7] == ["webhook.test", "-", "delivered", "1"] and row[-1] == "200"
    assert run("deliveries", hook_id, "--status", "failed").splitlines()[1:] == []
    off = run("disable", hook_id)
    assert off.startswith(f"{hook_id}: disabled (job.running, job.failed) {receiver.url}\n")
    assert f"enable it with PATCH /webhooks/{hook_id}" in off
    assert " disabled " in run("list")
    changed = run("update", hook_id, "--events", "job.succeeded", "--description", "")
    assert changed == f"{hook_id}: disabled (job.succeeded) {receiver.url}\n" + off.splitlines()[1] + "\n"
    assert run("enable", hook_id) == f"{hook_id}: enabled (job.succeeded) {receiver.url}\n"
    assert " enabled " in run("list")
    rotated = run("rotate-secret", hook_id, "--old-secret-hours", "0")
    assert rotated.startswith(f"{hook_id} has a new signing secret (the old one no longer signs)")
    secret = rotated.splitlines()[-1]
    assert secret.startswith("whsec_")
    assert run("retry", hook_id, row[0]) == f"delivery {row[0]} (webhook.test) is sent again\n"
    again = receiver.wait(2)
    assert again[1] == again[0] and receiver.requests[1]["headers"]["webhook-id"] == ping["id"]
    assert verify(secret, receiver.requests[1])  # (signed as it is sent: with the new secret)
    assert main(["--api-url", api.url, "webhooks", "retry", hook_id, "99999"]) == 3
    assert "delivery_not_found" in capsys.readouterr().err
    assert run("delete", hook_id) == f"{hook_id} deleted\n"
    assert hook_id not in run("list")
