"""Followed streams (`GET /jobs/{id}/events?follow=true`) against the real API on both databases: one key's
share and the server's cap, and the streams of a revoked key ending (api.streams). And a key's share in
the file `tputune serve --workers N`'s processes share (SharedKeyStreams; the server in
test_serve_workers), with real processes alive and dead."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from api.auth import Principal
from api.client import ApiError, Client
from api.errors import ApiError as Refused
from api.models import ApiKey
from api.settings import Settings
from api.streams import EVENTS, LOGS, SHUTDOWN, SharedKeyStreams, Streams
from tests.conftest import LiveApi

ADMIN = "admin-secret-0123456789"


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def make_key(api: LiveApi, tenant: str) -> tuple[str, str]:
    """(key id, plaintext)"""
    with api.client() as http:
        created = http.post("/admin/keys", json={"tenant": tenant, "name": "k"}, headers=bearer(ADMIN))
    assert created.status_code == 201, created.text
    return created.json()["id"], created.json()["key"]


def create_job(api: LiveApi, key: str | None, dataset: Path) -> str:
    with api.client() as http:
        created = http.post(
            "/jobs", json={"name": "f", "model": "tiny", "dataset_uri": str(dataset)}, headers=bearer(key)
        )
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def wait_gauge(api: LiveApi, name: str, value: float, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while api.gauge(name) != value:
        assert time.monotonic() < deadline, f"{name} is {api.gauge(name)}, not {value}"
        time.sleep(0.05)


class Follower:
    """One followed event stream, its lines read as they come (kept open until closed)."""

    def __init__(self, stack: contextlib.ExitStack, api: LiveApi, key: str | None, job_id: str) -> None:
        self._stack = contextlib.ExitStack()
        stack.callback(self.close)
        http = self._stack.enter_context(httpx.Client(base_url=api.url, timeout=10, headers=bearer(key)))
        self.response = self._stack.enter_context(
            http.stream("GET", f"/jobs/{job_id}/events", params={"follow": "true"})
        )
        self.lines: Iterator[str] = self.response.iter_lines()

    def next_event(self) -> tuple[str, str]:
        """The next event's (type, data), past comments."""
        kind = ""
        for line in self.lines:
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: ") and kind:
                return kind, line.removeprefix("data: ")
        raise AssertionError("the stream ended")

    def until(self, kind: str) -> str:
        while True:
            seen, data = self.next_event()
            if seen == kind:
                return data

    def ended(self) -> bool:
        """Whether the stream ends with nothing more (it is read to its end)."""
        return all(not line for line in self.lines)

    def close(self) -> None:
        self._stack.close()


def refused(api: LiveApi, key: str | None, job_id: str) -> httpx.Response:
    with api.client() as http:
        return http.get(f"/jobs/{job_id}/events", params={"follow": "true"}, headers=bearer(key))


def test_a_key_follows_at_most_its_share_and_the_server_at_most_its_cap(
    live_api: Callable[..., LiveApi], dataset: Path
) -> None:
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN, max_streams_per_key=2, max_event_followers=3)
    _, first = make_key(api, "team")
    _, second = make_key(api, "team")
    job_id = create_job(api, first, dataset)
    with contextlib.ExitStack() as stack:
        held = [Follower(stack, api, first, job_id) for _ in range(2)]
        for follower in held:
            assert follower.response.status_code == 200 and follower.until("status")
        over_share = refused(api, first, job_id)
        assert over_share.status_code == 429, over_share.text
        assert over_share.json()["error"]["code"] == "too_many_streams"
        assert over_share.headers["retry-after"] == "10"
        # Another key still follows: the share is the key's, not the tenant's or the server's.
        Follower(stack, api, second, job_id).until("status")
        assert api.gauge("tputune_event_followers") == 3
        over_cap = refused(api, second, job_id)
        assert over_cap.status_code == 429 and over_cap.json()["error"]["code"] == "too_many_event_followers"
        # The paged route is not a stream, and not capped.
        with api.client() as http:
            assert http.get(f"/jobs/{job_id}/events", headers=bearer(first)).status_code == 200
        # A follower that leaves gives its place back.
        held[0].close()
        wait_gauge(api, "tputune_event_followers", 2)
        Follower(stack, api, first, job_id).until("status")
    wait_gauge(api, "tputune_event_followers", 0)


def test_the_streams_of_a_revoked_key_end(live_api: Callable[..., LiveApi], dataset: Path) -> None:
    """A key is checked when a request starts; a stream lasts hours. Revoked through this process, its
    streams end at once; revoked elsewhere (another API process, straight in the database), at the next
    recheck. Streams of the keys still valid go on."""
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN, stream_recheck_seconds=0.3)
    here_id, here = make_key(api, "team")
    elsewhere_id, elsewhere = make_key(api, "team")
    _, valid = make_key(api, "team")
    job_id = create_job(api, valid, dataset)
    with contextlib.ExitStack() as stack:
        followers = {key: Follower(stack, api, key, job_id) for key in (here, elsewhere, valid)}
        for follower in followers.values():
            follower.until("status")  # (the job's first event; then the stream waits)

        started = time.monotonic()
        with api.client() as http:
            assert http.delete(f"/admin/keys/{here_id}", headers=bearer(ADMIN)).status_code == 200
        closed = followers[here].until("closed")
        assert '"code": "key_revoked"' in closed and followers[here].ended()
        assert time.monotonic() - started < 2.0

        engine = api.server.config.app.state.engine  # type: ignore[union-attr]
        with engine.begin() as connection:
            connection.execute(
                update(ApiKey).where(ApiKey.id == elsewhere_id).values(revoked_at=datetime.now(UTC))  # type: ignore[arg-type]
            )
        assert '"key_revoked"' in followers[elsewhere].until("closed") and followers[elsewhere].ended()
        wait_gauge(api, "tputune_event_followers", 1)
        # The valid key's stream lived through those rechecks, and still hears the job.
        with api.client() as http:
            assert http.post(f"/jobs/{job_id}/cancel", headers=bearer(valid)).status_code == 200
        assert '"cancelled"' in followers[valid].until("status")
        assert followers[valid].until("end") == "{}"
    wait_gauge(api, "tputune_event_followers", 0)


def test_the_client_waits_for_a_place_and_stops_when_its_key_is_revoked(
    live_api: Callable[..., LiveApi], dataset: Path
) -> None:
    """`tputune events --follow` (api.client.follow_events) waits out a 429 as its Retry-After says, then
    follows; a revoked key ends it with the server's reason, not a resume loop."""
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN, max_event_followers=1)
    key_id, key = make_key(api, "team")
    job_id = create_job(api, key, dataset)
    seen: list[dict] = []
    raised: list[ApiError] = []

    def follow() -> None:
        with Client(api.url, api_key=key) as client:
            try:
                seen.extend(client.follow_events(job_id))
            except ApiError as error:
                raised.append(error)

    with contextlib.ExitStack() as stack:
        holder = Follower(stack, api, key, job_id)  # the server's only place
        holder.until("status")
        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        time.sleep(1.0)
        assert not seen and thread.is_alive()  # refused (429), waiting
        holder.close()
        deadline = time.monotonic() + 15  # (Retry-After: 10)
        while not seen:
            assert time.monotonic() < deadline, "the client did not follow after the place was free"
            time.sleep(0.1)
    assert seen[0]["type"] == "status" and not raised
    with api.client() as http:
        assert http.delete(f"/admin/keys/{key_id}", headers=bearer(ADMIN)).status_code == 200
    thread.join(timeout=5)
    assert not thread.is_alive() and raised and raised[0].code == "key_revoked"


def test_idle_followers_share_one_look_for_new_events(
    live_api: Callable[..., LiveApi], dataset: Path
) -> None:
    """While nothing happens, a follower reads nothing: the process looks for new events of all followed
    jobs in one statement a tick (EventWatch), and only the followers of a job that changed read its
    events, one read for all of them (each looked for itself before, two statements twice a second)."""
    api = live_api(dispatcher_enabled=False)
    reader = api.server.config.app.state.job_reader  # type: ignore[union-attr]
    polled: list[str] = []
    looked: list[list[str]] = []
    poll_events, event_heads = reader.poll_events, reader.event_heads

    async def counted_poll(tenant: str, poll: Any) -> Any:
        polled.append(poll.job_id)
        return await poll_events(tenant, poll)

    async def counted_heads(job_ids: list[str]) -> Any:
        looked.append(job_ids)
        return await event_heads(job_ids)

    reader.poll_events, reader.event_heads = counted_poll, counted_heads
    job_ids = [create_job(api, None, dataset) for _ in range(4)]
    with contextlib.ExitStack() as stack:
        followers = {job_id: [Follower(stack, api, None, job_id) for _ in range(3)] for job_id in job_ids}
        for each in followers.values():
            for follower in each:
                follower.until("status")
        time.sleep(1.0)  # (each follower's second read, which finds nothing new, is done)
        polled.clear(), looked.clear()
        time.sleep(2.0)
        assert polled == []
        assert 2 <= len(looked) <= 6 and all(sorted(ids) == sorted(job_ids) for ids in looked), looked
        with api.client() as http:
            assert http.post(f"/jobs/{job_ids[0]}/cancel").status_code == 200
        for follower in followers[job_ids[0]]:
            assert '"cancelled"' in follower.until("status") and follower.until("end") == "{}"
        time.sleep(0.6)
        # One read for the job's three followers, woken together (EventWatch.read); none for the others.
        assert polled == [job_ids[0]], polled


def test_a_server_shutting_down_ends_its_streams_plainly_and_admits_no_more(
    live_api: Callable[..., LiveApi], dataset: Path
) -> None:
    """What `tputune serve` does on SIGTERM before it waits for open responses (api.server; the signal
    itself in test_serve_workers): event streams end without `closed`, so clients follow again, from
    their last event, elsewhere; a stream asked for meanwhile gets 503 with Retry-After."""
    api = live_api(dispatcher_enabled=False)
    job_id = create_job(api, None, dataset)
    with contextlib.ExitStack() as stack:
        follower = Follower(stack, api, None, job_id)
        follower.until("status")
        streams = api.server.config.app.state.streams  # type: ignore[union-attr]
        started = time.monotonic()
        assert streams.end_all(SHUTDOWN) == 1
        assert follower.ended() and time.monotonic() - started < 2.0
        late = refused(api, None, job_id)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert late.headers["retry-after"] == "1"
    wait_gauge(api, "tputune_event_followers", 0)


def test_a_keys_streams_count_in_every_process_while_it_lives(tmp_path: Path) -> None:
    path = tmp_path / "streams.shared"
    here = SharedKeyStreams(path, rows=4096, reset=True)
    there = SharedKeyStreams(path, rows=4096)
    process = subprocess.Popen(["sleep", "120"])
    there.pid = process.pid  # (its rows are a real, live process's)
    try:
        assert here.take("key", 3) == (0, True)
        assert there.take("key", 3) == (1, True)
        assert there.take("key", 3) == (2, True)
        assert here.take("key", 3) == (3, False)  # the share holds whichever process asks
        assert there.take("other key", 3) == (0, True)  # (a share is a key's)
        here.give("key")  # (only this process's stream: it held none counted)
        assert here.take("key", 3) == (2, True)
        there.give("key")
        assert here.take("key", 3) == (2, True)
        assert here.take("key", 3) == (3, False)
        process.kill()
        process.wait()
        # The process died holding a stream of each key: its rows no longer count, and are freed.
        assert here.take("key", 3) == (2, True)
        assert here.take("other key", 1) == (0, True)
        # A new process that has the pid of a dead one (here: this one's) starts with none of its rows.
        again = SharedKeyStreams(path, rows=4096)
        assert again.take("key", 0) == (0, False)
        # A new server starts from an empty table, whatever the last one's processes held.
        process = subprocess.Popen(["sleep", "120"])
        there.pid = process.pid
        assert there.take("key", 3) == (0, True)
        assert again.take("key", 0) == (1, False)
        SharedKeyStreams(path, rows=4096, reset=True)
        assert again.take("key", 0) == (0, False)
    finally:
        process.kill()
        process.wait()


def test_a_key_whose_rows_are_full_is_counted_in_its_process(tmp_path: Path) -> None:
    """The table is sized for every stream the processes may hold; if a key still finds no free row near
    its place, its stream is counted in this process only, and given back there."""
    process = subprocess.Popen(["sleep", "120"])
    try:
        table = SharedKeyStreams(tmp_path / "streams.shared", rows=SharedKeyStreams.PROBES, reset=True)
        crowd = SharedKeyStreams(tmp_path / "streams.shared", rows=SharedKeyStreams.PROBES)
        crowd.pid = process.pid
        for index in range(SharedKeyStreams.PROBES):
            assert crowd.take(f"key {index}", 1) == (0, True)
        assert table.take("full", 5) == (0, False)
        settings = Settings(max_streams_per_key=2, data_dir=tmp_path)
        streams = Streams(settings, shared=table)
        principal = Principal("team", "full")
        held = [streams.admit(EVENTS, principal), streams.admit(LOGS, principal)]
        assert not any(stream.shared for stream in held)
        with pytest.raises(Refused) as refusal:
            streams.admit(EVENTS, principal)
        assert refusal.value.code == "too_many_streams"
        streams.release(held[0])
        # The crowd's rows are untouched by this process's give backs, and a freed row is used again.
        crowd.give("key 0")
        again = streams.admit(EVENTS, principal)
        assert again.shared and table.take("full", 0) == (1, False)
        assert crowd.take("key 1", 1) == (1, False)
    finally:
        process.kill()
        process.wait()


def test_a_last_event_id_that_is_not_an_event_id_is_ignored(
    live_api: Callable[..., LiveApi], dataset: Path
) -> None:
    """'²' (byte 0xB2: headers are Latin-1) is a digit to str.isdigit, not to int(): the followed stream was
    a 500. An id past every event's (past BIGINT: an OverflowError) follows from the end."""
    api = live_api(dispatcher_enabled=False)
    job_id = create_job(api, None, dataset)
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/cancel").status_code == 200  # (ended: its stream ends too)
    host, port = api.url.removeprefix("http://").split(":")
    for header, replayed in ((b"\xb2", True), (b"-1", True), (b"99999999999999999999999", False)):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                f"GET /jobs/{job_id}/events?follow=true HTTP/1.1\r\nHost: t\r\nConnection: close\r\n".encode()
                + b"Last-Event-ID: "
                + header
                + b"\r\n\r\n"
            )
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert b"event: end" in answer, answer
        assert (b"event: status" in answer) == replayed, (header, answer)
