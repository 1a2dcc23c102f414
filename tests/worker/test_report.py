"""The progress reporter against a real local HTTP server that speaks the contract."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from worker.protocol import ErrorReport, MetricsReport, ProgressBatch, ResultReport, StatusReport
from worker.report import Reporter

TOKEN = "job-token"


class ProgressApi:
    """`POST /jobs/{id}/progress` on a port of its own; starts and stops on demand, records what it got."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.requests: list[dict[str, Any]] = []
        self.status_code = 200
        self.job_status = "running"
        self.max_body_bytes: int | None = None  # (over it: 413, as the API's RequestLimits)
        self.too_large = 0
        self.refused_message: str | None = None  # (a batch with a status report saying it: 422)
        self._server: ThreadingHTTPServer | None = None

    @property
    def reports(self) -> list[dict[str, Any]]:
        return [report for request in self.requests for report in request["body"]["reports"]]

    def start(self) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                if api.max_body_bytes is not None and length > api.max_body_bytes:
                    self.rfile.read(length)
                    api.too_large += 1
                    self.send_response(413)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = json.loads(self.rfile.read(length))
                refused = api.refused_message
                if refused is not None and any(r.get("message") == refused for r in body["reports"]):
                    self.send_response(422)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                ProgressBatch.model_validate(body)  # the worker speaks the contract
                api.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": body}
                )
                reply = json.dumps(
                    {"accepted": len(body["reports"]), "duplicates": 0, "job_status": api.job_status}
                )
                self.send_response(api.status_code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(reply.encode())

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@pytest.fixture
def api() -> Iterator[ProgressApi]:
    with socket.socket() as probe:  # a free port, so the API can also start later on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ProgressApi(port)
    yield server
    server.stop()


def reporter(api: ProgressApi, **options: Any) -> Reporter:
    settings = {"flush_interval": 0.05, "min_backoff": 0.05, "max_backoff": 0.2, "echo": None, **options}
    return Reporter("job-1", api.url, TOKEN, **settings)


def metrics(step: int) -> MetricsReport:
    return MetricsReport(step=step, total_steps=100, loss=5.0 - step / 100)


def test_reports_go_in_batches_with_the_job_token(api: ProgressApi) -> None:
    api.start()
    sender = reporter(api, flush_interval=0.3)
    for step in range(1, 51):
        sender.send(metrics(step))
    sender.send(ResultReport(step=50, loss=4.5))

    assert sender.close(timeout=10)

    assert [r["step"] for r in api.reports] == [*range(1, 51), 50]
    assert api.reports[-1]["kind"] == "result" and api.reports[0]["time"] > 0
    assert len(api.requests) <= 3
    assert {(r["path"], r["auth"]) for r in api.requests} == {("/jobs/job-1/progress", f"Bearer {TOKEN}")}


def test_reports_wait_for_an_api_that_is_down_and_arrive_in_order(api: ProgressApi) -> None:
    sender = reporter(api)
    for step in range(1, 11):
        sender.send(metrics(step))
    time.sleep(0.5)  # several failed attempts
    assert api.requests == [] and sender.pending == 10

    api.start()
    sender.send(ResultReport(step=10, loss=4.9))
    assert sender.close(timeout=10)

    assert [r["step"] for r in api.reports] == [*range(1, 11), 10]
    assert sender.dropped == 0


def test_a_full_buffer_drops_the_oldest_metrics_and_never_results_or_errors(api: ProgressApi) -> None:
    sender = reporter(api, max_buffer=5, flush_interval=60)  # nothing is sent while the buffer fills
    for step in (1, 2, 3):
        sender.send(metrics(step))
    sender.send(ErrorReport(step=3, code="loss_not_finite", message="nan"))
    sender.send(ResultReport(step=3))
    for step in (4, 5, 6):
        sender.send(metrics(step))
    for step in (7, 8, 9, 10):
        sender.send(ResultReport(step=step))
    assert sender.dropped == 6 and sender.pending == 6

    api.start()
    assert sender.close(timeout=10)

    assert [(r["kind"], r["step"]) for r in api.reports] == [
        ("error", 3),
        ("result", 3),
        ("result", 7),
        ("result", 8),
        ("result", 9),
        ("result", 10),
    ]


def test_a_cancelling_job_raises_the_cancel_flag(api: ProgressApi) -> None:
    api.start()
    api.job_status = "cancelling"
    sender = reporter(api)
    assert not sender.cancel_requested

    sender.send(StatusReport(message="training", phase="training"))
    deadline = time.monotonic() + 10
    while not sender.cancel_requested and time.monotonic() < deadline:
        time.sleep(0.02)

    assert sender.cancel_requested
    sender.close(timeout=5)


def test_a_pausing_job_raises_the_pause_flag(api: ProgressApi) -> None:
    api.start()
    api.job_status = "pausing"
    sender = reporter(api)
    assert not sender.pause_requested

    sender.send(StatusReport(message="training", phase="training"))
    deadline = time.monotonic() + 10
    while not sender.pause_requested and time.monotonic() < deadline:
        time.sleep(0.02)

    assert sender.pause_requested and not sender.cancel_requested
    sender.close(timeout=5)


def test_a_batch_the_api_refuses_for_good_is_not_retried(api: ProgressApi) -> None:
    api.start()
    api.status_code = 422
    sender = reporter(api)
    sender.send(metrics(1))

    assert sender.close(timeout=5)
    assert len(api.requests) == 1


def test_a_batch_over_the_apis_body_limit_is_sent_in_halves(api: ProgressApi) -> None:
    """A batch the API finds too large (413) was refused for good: every report in it was lost."""
    api.start()
    api.max_body_bytes = 20_000
    sender = reporter(api, flush_interval=0.5)
    for step in range(1, 201):
        sender.send(metrics(step))
        sender.send(StatusReport(step=step, message="m" * 300))
    sender.send(StatusReport(step=201, message="x" * 2000))
    sender.send(ResultReport(step=201, loss=1.0))

    assert sender.close(timeout=20)
    assert api.too_large >= 1 and sender.batch_size < 401
    assert [(r["kind"], r["step"]) for r in api.reports] == [
        *((kind, step) for step in range(1, 201) for kind in ("metrics", "status")),
        ("status", 201),
        ("result", 201),
    ]
    assert all(len(json.dumps(request["body"])) <= 20_000 for request in api.requests)


def test_a_report_the_api_refuses_is_dropped_alone(api: ProgressApi) -> None:
    """An API newer than the worker image may refuse one report of a batch (422): the rest arrive."""
    api.start()
    api.refused_message = "refused"
    sender = reporter(api, flush_interval=0.5)
    for step in range(1, 101):
        sender.send(metrics(step))
        if step == 37:
            sender.send(StatusReport(step=step, message="refused"))
    sender.send(ResultReport(step=100, loss=1.0))

    assert sender.close(timeout=20)
    assert [(r["kind"], r["step"]) for r in api.reports] == [
        *(("metrics", step) for step in range(1, 101)),
        ("result", 100),
    ]
    assert sender.batch_size == 1000  # (a refusal is not about size)


def test_a_single_report_over_the_limit_is_dropped_and_the_rest_go(api: ProgressApi) -> None:
    api.start()
    api.max_body_bytes = 2_000
    sender = reporter(api, flush_interval=0.5)
    sender.send(metrics(1))
    sender.send(StatusReport(step=1, message="y" * 1999))
    sender.send(metrics(2))

    assert sender.close(timeout=10)
    assert [(r["kind"], r["step"]) for r in api.reports] == [("metrics", 1), ("metrics", 2)]


def test_standalone_only_writes_json_lines() -> None:
    out = io.StringIO()
    sender = Reporter("job-1", echo=out)
    sender.send(metrics(7))

    assert sender.close(timeout=1)
    (line,) = out.getvalue().splitlines()
    assert json.loads(line)["kind"] == "metrics" and json.loads(line)["step"] == 7


def test_other_processes_report_nothing() -> None:
    out = io.StringIO()
    sender = Reporter("job-1", "http://127.0.0.1:9", TOKEN, enabled=False, echo=out)
    sender.send(metrics(1))

    assert sender.close(timeout=1) and out.getvalue() == "" and sender.pending == 0
