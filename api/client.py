"""A small Python client for the tputune REST API (what the CLI uses; handy in notebooks).

from api.client import Client
client = Client()                       # TPUTUNE_API_URL / TPUTUNE_API_KEY, or arguments
job = client.create_job({"name": "demo", "model": "gemma3-270m-pt", "dataset_uri": "gs://my-bucket/train.txt"})
for event in client.follow_events(job["id"]):
    print(event["type"], event["message"])
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
FINAL_STATUSES = ("succeeded", "failed", "cancelled")


class ApiError(Exception):
    """An error answer from the API: its stable code and its sentence."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return f"{self.message} ({self.code})"


class KeyExpiresSoon(UserWarning):
    """The API key this client sends expires within `Client.EXPIRY_WARNING` (the server says when in every
    answer: X-Tputune-Key-Expires)."""


class Client:
    EXPIRY_WARNING = timedelta(days=7)

    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, timeout: float = 30.0
    ) -> None:
        self.base_url = (base_url or os.environ.get("TPUTUNE_API_URL") or DEFAULT_URL).rstrip("/")
        key = api_key or os.environ.get("TPUTUNE_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.key_expires_at: datetime | None = None  # the key's expiry, once an answer has said it
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, event_hooks={"response": [self._expiry]}
        )

    def _expiry(self, response: httpx.Response) -> None:
        """Note the key's expiry, and warn once when it is near (a key that expired gets 401 instead)."""
        said = response.headers.get("x-tputune-key-expires")
        if not said:
            return
        try:
            expires = datetime.strptime(said, "%Y-%m-%d %H:%M:%S UTC").replace(tzinfo=UTC)
        except ValueError:
            return
        first = self.key_expires_at is None
        self.key_expires_at = expires
        left = expires - datetime.now(UTC)
        if first and left < self.EXPIRY_WARNING:
            hours = max(0, int(left.total_seconds() // 3600))
            when = f"in {hours // 24} days" if hours >= 48 else f"in {hours} hours"
            warnings.warn(
                KeyExpiresSoon(f"this API key expires at {said} ({when}): ask your admin to rotate it"),
                stacklevel=2,
            )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(
                0, "api_unreachable", f"Cannot reach the tputune API at {self.base_url}: {exc}"
            ) from None
        if response.status_code >= 400:
            raise _error_of(response)
        return response.json()

    # --- jobs ---

    def create_job(self, spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._request("POST", "/jobs", json=spec, headers=headers)

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/jobs/{job_id}")

    def list_jobs(
        self,
        status: list[str] | None = None,
        limit: int = 20,
        after: str | None = None,
        metadata: dict[str, str] | None = None,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """A page of jobs; `tenant`: only that tenant's (the admin key sees every tenant's by default)."""
        params: list[tuple[str, str | int]] = [("limit", limit)]
        params += [("status", s) for s in status or []]
        params += [(f"metadata[{k}]", v) for k, v in (metadata or {}).items()]
        if after:
            params.append(("after", after))
        if tenant:
            params.append(("tenant", tenant))
        return self._request("GET", "/jobs", params=params)

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/jobs/{job_id}/cancel")

    def pause_job(self, job_id: str) -> dict[str, Any]:
        """Pause the job: a queued one is `paused` at once; a starting or running one is `pausing` while its
        workers save a checkpoint and stop. ApiError 409 `job_not_pausable` once it finished or is being
        cancelled; a pausing or paused job is answered unchanged."""
        return self._request("POST", f"/jobs/{job_id}/pause")

    def resume_job(self, job_id: str) -> dict[str, Any]:
        """Queue a paused or failed job again; it goes on from its last checkpoint. ApiError 409
        `job_not_paused` (it is pausing, succeeded or cancelled), 429 `too_many_queued_jobs`; a queued or
        running job is answered unchanged."""
        return self._request("POST", f"/jobs/{job_id}/resume")

    def delete_job(self, job_id: str) -> dict[str, Any]:
        """Delete a job that ended, with its events and logs (not its outputs). ApiError 409
        `job_not_ended` while it has not ended (cancel it first)."""
        return self._request("DELETE", f"/jobs/{job_id}")

    def events(
        self, job_id: str, after: int | None = None, limit: int = 100, types: list[str] | None = None
    ) -> dict[str, Any]:
        params: list[tuple[str, str | int]] = [("limit", limit), *(("type", t) for t in types or [])]
        if after is not None:
            params.append(("after", after))
        return self._request("GET", f"/jobs/{job_id}/events", params=params)

    def metrics(
        self,
        job_id: str,
        min_step: int | None = None,
        max_step: int | None = None,
        limit: int | None = None,
    ) -> dict[str, Any]:
        """One page of the job's metrics per step (`has_more`: ask again from the step after the last)."""
        given = {"min_step": min_step, "max_step": max_step, "limit": limit}
        params = {name: value for name, value in given.items() if value is not None}
        return self._request("GET", f"/jobs/{job_id}/metrics", params=params)

    def metric_points(
        self, job_id: str, min_step: int | None = None, max_step: int | None = None, page: int = 10_000
    ) -> Iterator[dict[str, Any]]:
        """Every point of the job's metrics from `min_step` to `max_step`, page after page."""
        while True:
            answer = self.metrics(job_id, min_step, max_step, page)
            yield from answer["data"]
            if not answer["has_more"] or not answer["data"]:
                return
            min_step = answer["data"][-1]["step"] + 1

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/jobs/{job_id}/checkpoints")

    def logs(
        self, job_id: str, tail: int = 200, previous: bool = False, run: int | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"tail": tail}
        if previous:
            params["previous"] = "true"
        if run is not None:
            params["run"] = run
        return self._request("GET", f"/jobs/{job_id}/logs", params=params)

    # --- API keys (admin key only) ---

    def create_key(
        self,
        tenant: str,
        name: str,
        expires_in_days: int | None = None,
        admin: bool = False,
        read_only: bool = False,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"tenant": tenant, "name": name, "admin": admin, "read_only": read_only}
        if expires_in_days is not None:
            body["expires_in_days"] = expires_in_days
        return self._request("POST", "/admin/keys", json=body)

    def rotate_key(
        self, key_id: str, grace_seconds: int = 0, expires_in_days: int | None = None
    ) -> dict[str, Any]:
        """A new key for the old one's tenant and name (shown once, in `key`); the old one stops working
        after `grace_seconds`."""
        body: dict[str, Any] = {"grace_seconds": grace_seconds}
        if expires_in_days is not None:
            body["expires_in_days"] = expires_in_days
        return self._request("POST", f"/admin/keys/{key_id}/rotate", json=body)

    def list_keys(self, tenant: str | None = None) -> dict[str, Any]:
        return self._request("GET", "/admin/keys", params={"tenant": tenant} if tenant else None)

    def revoke_key(self, key_id: str) -> dict[str, Any]:
        return self._request("DELETE", f"/admin/keys/{key_id}")

    # --- webhooks ---

    def create_webhook(
        self,
        url: str,
        events: list[str] | None = None,
        description: str | None = None,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """An endpoint told of the tenant's jobs' moves; its signing secret is in `secret`, shown once."""
        body: dict[str, Any] = {"url": url}
        for name, value in (("events", events), ("description", description), ("tenant", tenant)):
            if value is not None:
                body[name] = value
        return self._request("POST", "/webhooks", json=body)

    def list_webhooks(self, tenant: str | None = None) -> dict[str, Any]:
        return self._request("GET", "/webhooks", params={"tenant": tenant} if tenant else None)

    def update_webhook(self, webhook_id: str, **fields: Any) -> dict[str, Any]:
        """Change `url`, `events`, `description` or `enabled` (PATCH: the fields given only)."""
        return self._request("PATCH", f"/webhooks/{webhook_id}", json=fields)

    def rotate_webhook_secret(self, webhook_id: str, old_secret_hours: float | None = None) -> dict[str, Any]:
        """A new signing secret (in `secret`, shown once); the old one signs too for `old_secret_hours`."""
        body = {} if old_secret_hours is None else {"old_secret_hours": old_secret_hours}
        return self._request("POST", f"/webhooks/{webhook_id}/rotate-secret", json=body)

    def retry_delivery(self, webhook_id: str, delivery_id: int) -> dict[str, Any]:
        """Send a failed (or delivered) delivery again, with its retries anew."""
        return self._request("POST", f"/webhooks/{webhook_id}/deliveries/{delivery_id}/retry")

    def delete_webhook(self, webhook_id: str) -> dict[str, Any]:
        return self._request("DELETE", f"/webhooks/{webhook_id}")

    def test_webhook(self, webhook_id: str) -> dict[str, Any]:
        return self._request("POST", f"/webhooks/{webhook_id}/test")

    def webhook_deliveries(
        self, webhook_id: str, limit: int = 20, status: str | None = None, after: int | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if status is not None:
            params["status"] = status
        if after is not None:
            params["after"] = after
        return self._request("GET", f"/webhooks/{webhook_id}/deliveries", params=params)

    # --- tenants' limits ---

    def tenant(self) -> dict[str, Any]:
        """The caller's team: its limits and what its jobs hold now."""
        return self._request("GET", "/tenant")

    def list_tenants(self) -> dict[str, Any]:
        return self._request("GET", "/admin/tenants")

    def get_tenant(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"/admin/tenants/{name}")

    def set_tenant_limits(self, name: str, **limits: int | str | list[str] | None) -> dict[str, Any]:
        """Change `max_active_jobs`, `max_active_chips` and/or `max_queued_jobs` (None: the server's limit
        holds again; "unlimited": none, whatever the server's), and/or `data_prefixes` (a list of prefixes,
        "any", or None: the server's)."""
        return self._request("PATCH", f"/admin/tenants/{name}", json=limits)

    def usage(
        self, since: str | None = None, until: str | None = None, tenant: str | None = None
    ) -> dict[str, Any]:
        """Each team's jobs that ran between `since` and `until` (ISO 8601; default: the last 30 days):
        chip-hours and trained tokens. A tenant's key sees its own team's."""
        params = {
            name: value for name, value in (("since", since), ("until", until), ("tenant", tenant)) if value
        }
        return self._request("GET", "/usage", params=params)

    def audit(
        self,
        tenant: str | None = None,
        actions: list[str] | None = None,
        actor: str | None = None,
        target: str | None = None,
        since: str | None = None,
        after: int | None = None,
        limit: int = 20,
    ) -> dict[str, Any]:
        """A page of the audit log, newest first: who changed keys, teams' limits and webhooks (a tenant's
        key: its own team's). Pass `next_after` as `after` for the next page."""
        params: dict[str, Any] = {"limit": limit}
        for name, value in (
            ("tenant", tenant),
            ("action", actions),
            ("actor", actor),
            ("target", target),
            ("since", since),
            ("after", after),
        ):
            if value:
                params[name] = value
        return self._request("GET", "/audit", params=params)

    def follow_events(self, job_id: str, after: int | None = None) -> Iterator[dict[str, Any]]:
        """Events as they happen (Server-Sent Events), until the job ends; reconnects and resumes, also
        after a 429 (the server or this key follows as many streams as it may) or 503, when Retry-After
        says. ApiError when the server closes the stream (the key was revoked)."""
        last_id = after
        while True:
            headers = {"Last-Event-ID": str(last_id)} if last_id is not None else {}
            try:
                with self._http.stream(
                    "GET", f"/jobs/{job_id}/events", params={"follow": "true"}, headers=headers, timeout=None
                ) as response:
                    if response.status_code in (429, 503):
                        response.read()
                        time.sleep(_retry_after(response))
                        continue
                    if response.status_code >= 400:
                        response.read()
                        raise _error_of(response)
                    for event_type, data, event_id in _sse(response.iter_lines()):
                        if event_type == "end":
                            return
                        if event_type == "closed":
                            closed = json.loads(data)
                            raise ApiError(401, closed["code"], closed["message"])
                        if event_id is not None:
                            last_id = event_id
                        yield json.loads(data)
            except httpx.TransportError:
                time.sleep(1.0)  # the API restarted or the connection dropped: resume after last_id

    def wait(self, job_id: str, poll_seconds: float = 1.0, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get_job(job_id)
            if job["status"] in FINAL_STATUSES:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['status']} after {timeout}s")
            time.sleep(poll_seconds)


def _retry_after(response: httpx.Response, longest: float = 60.0) -> float:
    """The seconds a 429 or 503 asks to wait (1 if it does not say), at most `longest`."""
    value = response.headers.get("retry-after", "")
    return min(float(value), longest) if value.isdigit() else 1.0


def _error_of(response: httpx.Response) -> ApiError:
    try:
        error = response.json()["error"]
        return ApiError(response.status_code, error["code"], error["message"], error.get("param"))
    except (ValueError, KeyError, TypeError):
        return ApiError(
            response.status_code, "http_error", f"HTTP {response.status_code}: {response.text[:200]}"
        )


def _sse(lines: Iterator[str]) -> Iterator[tuple[str, str, int | None]]:
    event_type, data, event_id = "message", "", None
    for line in lines:
        if not line:
            if data:
                yield event_type, data, event_id
            event_type, data, event_id = "message", "", None
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                event_type = value
            elif field == "data":
                data = value
            elif field == "id" and value.isdigit():
                event_id = int(value)
