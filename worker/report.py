"""Progress reports from the worker to the API (`worker/protocol.py` is the contract).

`Reporter.send` never blocks on the network: reports go into a bounded buffer that a background thread
posts in batches to `POST {api_url}/jobs/{job_id}/progress`, retrying with exponential backoff while the
API is away. When the buffer is full the oldest metrics go first, then other minor reports; results and
errors are never dropped. A batch the API refuses whole (413, 422) goes again in halves, down to the
reports it refuses. Every report is also written to stdout as one JSON line, so the run's log tells its
progress; without an API URL (standalone) that is all that happens.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import sys
import threading
import time
from typing import TextIO

import httpx

from worker.config import ENV_API_URL, ENV_JOB_TOKEN
from worker.protocol import MAX_REPORTS_PER_BATCH, ProgressAck, ProgressBatch, Report

log = logging.getLogger(__name__)

_KEPT_KINDS = ("result", "error")


class Reporter:
    """Buffers reports and delivers them to the API from a background thread.

    `cancel_requested` turns true once the API answers that the job is being cancelled, `pause_requested`
    once it answers that the job is being paused.
    A disabled reporter (processes other than 0) accepts reports and does nothing with them.
    """

    def __init__(
        self,
        job_id: str,
        api_url: str | None = None,
        token: str | None = None,
        *,
        enabled: bool = True,
        echo: TextIO | None = sys.stdout,
        max_buffer: int = 10_000,
        flush_interval: float = 1.0,
        min_backoff: float = 0.5,
        max_backoff: float = 30.0,
        request_timeout: float = 10.0,
    ) -> None:
        self.job_id = job_id
        self.enabled = enabled
        self.echo = echo if enabled else None
        self.max_buffer = max_buffer
        self.flush_interval = flush_interval
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.dropped = 0
        self.batch_size = MAX_REPORTS_PER_BATCH  # (halved while the API finds a batch too large)
        self._url = f"{api_url.rstrip('/')}/jobs/{job_id}/progress" if api_url and enabled else None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = request_timeout
        self._buffer: collections.deque[Report] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._cancel = threading.Event()
        self._pause = threading.Event()
        self._thread: threading.Thread | None = None
        if self._url is not None:
            self._thread = threading.Thread(target=self._deliver, name="progress-reporter", daemon=True)
            self._thread.start()

    @classmethod
    def from_env(cls, job_id: str, *, enabled: bool) -> Reporter:
        """A reporter for `TPUTUNE_API_URL` / `TPUTUNE_JOB_TOKEN`; standalone when the URL is unset."""
        return cls(
            job_id, os.environ.get(ENV_API_URL) or None, os.environ.get(ENV_JOB_TOKEN), enabled=enabled
        )

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    @property
    def pause_requested(self) -> bool:
        return self._pause.is_set()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._buffer)

    def send(self, report: Report) -> None:
        if not self.enabled:
            return
        if report.time is None:
            report = report.model_copy(update={"time": time.time()})
        if self.echo is not None:
            self.echo.write(report.model_dump_json(exclude_none=True) + "\n")
            self.echo.flush()
        if self._url is None:
            return
        with self._lock:
            self._buffer.append(report)
            self._trim()

    def close(self, timeout: float = 30.0) -> bool:
        """Deliver what is buffered, waiting at most `timeout` seconds; True when nothing is left."""
        if self._thread is None:
            return True
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout)
        left = self.pending
        if left:
            log.warning("%d progress reports could not be delivered to the API", left)
        return left == 0

    def _trim(self) -> None:
        """Keep the buffer within `max_buffer` (caller holds the lock)."""
        while len(self._buffer) > self.max_buffer:
            victim = _oldest(self._buffer, ("metrics",)) or _oldest(self._buffer, None)
            if victim is None:
                return  # only results and errors are left: those are never dropped
            self._buffer.remove(victim)
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("the API is unreachable and the report buffer is full: %d dropped", self.dropped)

    def _deliver(self) -> None:
        failures = 0
        with httpx.Client(timeout=self._timeout, headers=self._headers) as client:
            while True:
                closing = self._closing.is_set()
                while True:
                    with self._lock:
                        batch = [
                            self._buffer.popleft() for _ in range(min(len(self._buffer), self.batch_size))
                        ]
                    if not batch:
                        break
                    if self._post(client, batch):
                        failures = 0
                        continue
                    with self._lock:
                        self._buffer.extendleft(reversed(batch))
                        self._trim()
                    failures += 1
                    break
                if closing and (failures == 0 or not self.pending):
                    return
                self._wake.wait(self._backoff(failures) if failures else self.flush_interval)
                self._wake.clear()

    def _backoff(self, failures: int) -> float:
        # Jitter keeps the workers of many jobs from retrying in lockstep after an API restart.
        return min(self.max_backoff, self.min_backoff * 2 ** (failures - 1)) * random.uniform(0.8, 1.2)

    def _post(self, client: httpx.Client, batch: list[Report]) -> bool:
        """POST one batch; True when it is done with (delivered, or refused for good), False to retry.

        A batch the API refuses whole, as too large (413) or invalid (422), goes again in halves, down to
        the reports it refuses: those alone are dropped. It was all dropped: up to 1,000 reports, a gap in
        the loss history (long status messages and samples can add up past the API's 1 MiB limit, and an
        API newer than the worker image may refuse what the image sends). A half delivered before a
        failure is sent again with the batch: the API stores each report once."""
        assert self._url is not None
        body = ProgressBatch(reports=batch).model_dump_json(exclude_none=True)
        try:
            response = client.post(self._url, content=body, headers={"Content-Type": "application/json"})
        except httpx.HTTPError as error:
            log.info("progress report failed, will retry: %s", error)
            return False
        if response.is_success:
            try:
                status = ProgressAck.model_validate_json(response.content).job_status
            except ValueError:
                status = None
            if status in ("cancelling", "cancelled"):
                self._cancel.set()
            elif status in ("pausing", "paused"):
                self._pause.set()
            return True
        if response.status_code in (413, 422) and len(batch) > 1:
            if response.status_code == 413:
                self.batch_size = min(self.batch_size, max(1, len(batch) // 2))
            log.info(
                "the API refused %d progress reports (%d); sending them in halves",
                len(batch),
                response.status_code,
            )
            half = len(batch) // 2
            return self._post(client, batch[:half]) and self._post(client, batch[half:])
        if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
            log.error(
                "the API refused %d progress reports (%d): %s",
                len(batch),
                response.status_code,
                response.text[:500],
            )
            return True
        log.info("progress report got %d, will retry", response.status_code)
        return False


def _oldest(buffer: collections.deque[Report], kinds: tuple[str, ...] | None) -> Report | None:
    """The oldest report of `kinds` (None: of any kind that may be dropped)."""
    for report in buffer:
        if (report.kind in kinds) if kinds is not None else (report.kind not in _KEPT_KINDS):
            return report
    return None
