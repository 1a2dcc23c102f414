"""Each tenant's own limits (PATCH /admin/tenants/{name}): what a team sees of them, what the API refuses
and what the dispatcher holds back; on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from api import jobs as service
from api import tenants
from api.db import make_engine
from api.main import create_app
from api.models import Job, JobEvent, Tenant
from api.settings import Settings
from api.states import JobStatus
from tests.test_auth import ADMIN, bearer, make_key

FINAL = {"succeeded", "failed", "cancelled"}


def server(make_settings: Callable[..., Settings], **changed: Any) -> TestClient:
    """An API process with keys on, no dispatcher, and a server-wide chip limit of 8 (or as `changed`)."""
    settings = make_settings(
        **{
            "dispatcher_enabled": False,
            "admin_key": ADMIN,
            "rate_limit_per_second": 0,
            "tenant_max_active_chips": 8,
            "max_local_processes": 8,
            **changed,
        }
    )
    return TestClient(create_app(settings))


@pytest.fixture
def app_client(make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    with server(make_settings) as test_client:
        yield test_client


def body(dataset: Path, processes: int = 1, fake: str = "succeed") -> dict[str, Any]:
    return {
        "name": f"fake-{fake}",
        "model": "tiny",
        "dataset_uri": str(dataset),
        "resources": {"processes": processes},
        "hyperparameters": {"batch_size": 24},
        "metadata": {"fake": fake},
    }


def limits(
    jobs: int | None, chips: int | None, queued: int | None = None, hours: int | None = None
) -> dict[str, int | None]:
    return {
        "max_active_jobs": jobs,
        "max_active_chips": chips,
        "max_queued_jobs": queued,
        "max_chip_hours_per_month": hours,
    }


def test_an_admin_sets_a_tenants_limits_and_the_team_sees_them(app_client: TestClient, dataset: Path) -> None:
    research, vision = make_key(app_client, "research"), make_key(app_client, "vision")
    mine = app_client.get("/tenant", headers=bearer(research))
    assert mine.status_code == 200, mine.text
    assert mine.json() == {
        "object": "tenant",
        "name": "research",
        "limits": limits(None, 8),  # the server's
        "own_limits": limits(None, None),
        "usage": {"active_jobs": 0, "queued_jobs": 0, "chips": 0, "chip_hours_this_month": 0.0},
        "budget_pauses_running": False,
        "chip_unit": "processes",
        "data_prefixes": None,  # (anywhere: the server has no TPUTUNE_TENANT_DATA_PREFIXES)
        "own_data_prefixes": None,
        "shared_read_prefixes": ["gs://gemma-data"],
        "updated_at": None,
        "updated_by": None,
    }

    refused = app_client.patch(
        "/admin/tenants/research", json={"max_active_jobs": 9}, headers=bearer(research)
    )
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
    assert "may set tenants' limits" in refused.json()["error"]["message"]
    assert app_client.get("/admin/tenants", headers=bearer(research)).status_code == 403
    assert app_client.get("/admin/tenants/vision", headers=bearer(research)).status_code == 403

    admin = bearer(ADMIN)
    set_both = app_client.patch("/admin/tenants/research", json=limits(1, 2), headers=admin)
    assert set_both.status_code == 200, set_both.text
    assert set_both.json()["limits"] == set_both.json()["own_limits"] == limits(1, 2)
    assert set_both.json()["updated_by"] == "the admin" and set_both.json()["updated_at"]
    # A field left out stays; null gives the server's back.
    back = app_client.patch("/admin/tenants/research", json={"max_active_chips": None}, headers=admin)
    assert back.json()["own_limits"] == limits(1, None) and back.json()["limits"] == limits(1, 8)
    assert app_client.get("/tenant", headers=bearer(research)).json()["limits"] == limits(1, 8)
    assert app_client.get("/tenant", headers=bearer(vision)).json()["limits"] == limits(None, 8)

    for wrong, param in [
        ({"max_active_jobs": -1}, "max_active_jobs"),  # (not how `unlimited` is said, though so stored)
        ({"max_active_chips": "Unlimited"}, "max_active_chips"),
        ({"max_queued_jobs": "none"}, "max_queued_jobs"),
        ({"max_active_chips": 0}, "max_active_chips"),
        ({"max_active_jobs": "many"}, "max_active_jobs"),
        ({"max_queued_jobs": -1}, "max_queued_jobs"),
        ({"max_queued_jobs": 1_000_001}, "max_queued_jobs"),
        ({"max_chip_hours_per_month": -3}, "max_chip_hours_per_month"),
        ({"max_chip_hours_per_month": 1.5}, "max_chip_hours_per_month"),
        ({"max_jobs": 3}, "max_jobs"),
    ]:
        response = app_client.patch("/admin/tenants/research", json=wrong, headers=admin)
        assert response.status_code == 422, (wrong, response.text)
        assert response.json()["error"]["param"].endswith(param), response.json()
        if param != "max_jobs":  # (one sentence saying what a limit may be)
            assert response.json()["error"]["code"] == "invalid_limit", response.json()
            assert '"unlimited" (no limit for the tenant)' in response.json()["error"]["message"]
    bad_name = app_client.patch("/admin/tenants/Bad%20Name", json=limits(1, 1), headers=admin)
    assert bad_name.status_code == 422
    assert app_client.get("/tenant", headers=bearer(research)).json()["own_limits"] == limits(1, None)

    # Every team with a key, limits or jobs, with what its jobs hold.
    assert app_client.post("/jobs", json=body(dataset, 2), headers=bearer(vision)).status_code == 201
    made = app_client.patch("/admin/tenants/newteam", json={"max_active_chips": 16}, headers=admin)
    assert made.json()["usage"] == {
        "active_jobs": 0,
        "queued_jobs": 0,
        "chips": 0,
        "chip_hours_this_month": 0.0,
    }
    listed = app_client.get("/admin/tenants", headers=admin).json()["data"]
    assert [t["name"] for t in listed] == ["newteam", "research", "vision"]
    by_name = {t["name"]: t for t in listed}
    assert by_name["vision"]["usage"] == {
        "active_jobs": 0,
        "queued_jobs": 1,
        "chips": 0,
        "chip_hours_this_month": 0.0,
    }
    assert by_name["newteam"]["limits"] == limits(None, 16)
    one = app_client.get("/admin/tenants/vision", headers=admin).json()
    assert one == by_name["vision"]
    unknown = app_client.get("/admin/tenants/nobody", headers=admin).json()
    assert unknown["limits"] == limits(None, 8) and unknown["usage"]["queued_jobs"] == 0


def test_a_team_exempt_from_the_servers_limits_has_none(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """`unlimited`: none for the team, whatever the server's; null gives the server's back."""
    with server(make_settings, tenant_max_active_chips=2, tenant_max_queued_jobs=1) as app_client:
        settings = app_client.app.state.settings  # type: ignore[attr-defined]
        research, vision = bearer(make_key(app_client, "research")), bearer(make_key(app_client, "vision"))
        admin = bearer(ADMIN)
        every = dict.fromkeys(tenants.LIMITS, "unlimited")
        exempt = app_client.patch("/admin/tenants/research", json=every, headers=admin)
        assert exempt.status_code == 200, exempt.text
        assert exempt.json()["own_limits"] == every and exempt.json()["limits"] == limits(None, None)
        assert app_client.get("/tenant", headers=research).json()["own_limits"] == every
        # The server's limits (2 chips, 1 job queued) hold for another team, not for this one (at once:
        # in this process).
        refused = app_client.post("/jobs", json=body(dataset, 3), headers=vision)
        assert refused.json()["error"]["code"] == "over_tenant_chip_limit"
        assert app_client.post("/jobs", json=body(dataset), headers=vision).status_code == 201
        assert app_client.post("/jobs", json=body(dataset), headers=vision).status_code == 429
        for _ in range(2):
            assert app_client.post("/jobs", json=body(dataset, 3), headers=research).status_code == 201
        # Stored as such: another process (a replica) reads it so.
        with Session(app_client.app.state.engine) as session:  # type: ignore[attr-defined]
            row = session.get(Tenant, "research")
        assert tenants.Limits.of(row, settings, "research") == tenants.Limits(None, None, None)
        # One limit given, the others stay unlimited; null: the server's again.
        one = app_client.patch("/admin/tenants/research", json={"max_active_jobs": 2}, headers=admin)
        assert one.json()["own_limits"] == {**every, "max_active_jobs": 2}
        back = app_client.patch("/admin/tenants/research", json={"max_active_chips": None}, headers=admin)
        assert back.json()["limits"] == limits(2, 2) and back.json()["own_limits"]["max_active_chips"] is None
        refused = app_client.post("/jobs", json=body(dataset, 3), headers=research)
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "over_tenant_chip_limit"


def test_usage_counts_active_jobs_and_their_chips(app_client: TestClient, dataset: Path) -> None:
    research = bearer(make_key(app_client, "research"))
    ids = [app_client.post("/jobs", json=body(dataset, n), headers=research).json()["id"] for n in (1, 2, 3)]
    engine = app_client.app.state.engine  # type: ignore[attr-defined]
    with Session(engine) as session:  # (no dispatcher here: two of them as if it had started them)
        for job_id, status in zip(ids, ["running", "cancelling"], strict=False):
            session.execute(update(Job).where(Job.id == job_id).values(status=status))  # type: ignore[arg-type]
        session.commit()
    mine = app_client.get("/tenant", headers=research).json()
    assert mine["usage"] == {"active_jobs": 2, "queued_jobs": 1, "chips": 3, "chip_hours_this_month": 0.0}


def test_a_job_bigger_than_its_teams_chip_limit_is_refused(
    app_client: TestClient,
    dataset: Path,
    make_settings: Callable[..., Settings],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tenants, "CACHE_SECONDS", 0.2)
    research, vision = bearer(make_key(app_client, "research")), bearer(make_key(app_client, "vision"))
    # Another process of the server (a replica) read the limits before the change.
    with server(make_settings) as other:
        for process in (app_client, other):  # (each has read the limits)
            assert process.post("/jobs", json=body(dataset, 3), headers=research).status_code == 201

        app_client.patch("/admin/tenants/research", json={"max_active_chips": 2}, headers=bearer(ADMIN))
        refused = app_client.post("/jobs", json=body(dataset, 3), headers=research)  # (at once, here)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["code"] == "over_tenant_chip_limit" and error["param"] == "resources"
        assert "needs 3 local processes, more than your team may use at once (2)" in error["message"]
        assert app_client.post("/jobs", json=body(dataset, 2), headers=research).status_code == 201
        assert app_client.post("/jobs", json=body(dataset, 3), headers=vision).status_code == 201

        deadline = time.monotonic() + 5  # the other process: once it reads them again
        while other.post("/jobs", json=body(dataset, 3), headers=research).status_code == 201:
            assert time.monotonic() < deadline, "the other process kept the old limit"
            time.sleep(0.1)
        assert other.post("/jobs", json=body(dataset, 3), headers=vision).status_code == 201


def queued_ids(app_client: TestClient, key: dict[str, str]) -> set[str]:
    page = app_client.get("/jobs", params={"status": "queued", "limit": 100}, headers=key).json()
    return {job["id"] for job in page["data"]}


def test_a_team_with_as_many_jobs_queued_as_it_may_is_refused_more(
    app_client: TestClient, dataset: Path
) -> None:
    research, vision, admin = (
        bearer(make_key(app_client, "research")),
        bearer(make_key(app_client, "vision")),
        bearer(ADMIN),
    )
    changed = app_client.patch("/admin/tenants/research", json={"max_queued_jobs": 2}, headers=admin)
    assert changed.json()["limits"] == limits(None, 8, 2)
    keyed = app_client.post("/jobs", json=body(dataset), headers={**research, "Idempotency-Key": "k1"})
    assert keyed.status_code == 201
    assert app_client.post("/jobs", json=body(dataset), headers=research).status_code == 201

    for headers in (research, {**research, "Idempotency-Key": "k2"}):
        refused = app_client.post("/jobs", json=body(dataset), headers=headers)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "30"
        error = refused.json()["error"]
        assert error["code"] == "too_many_queued_jobs"
        assert error["message"] == (
            "Your team (research) has 2 jobs queued and may have 2: submit this one once some have started, "
            "or cancel some."
        )
    # The refused jobs were not stored (their rows rolled back), and their key is free for a retry.
    assert len(queued_ids(app_client, research)) == 2
    # A retry of a job that was created answers with it, full queue or not.
    again = app_client.post("/jobs", json=body(dataset), headers={**research, "Idempotency-Key": "k1"})
    assert again.status_code == 200 and again.json()["id"] == keyed.json()["id"]
    # Another team's queue is its own.
    assert app_client.post("/jobs", json=body(dataset), headers=vision).status_code == 201
    # A job leaving the queue makes room for one.
    assert app_client.post(f"/jobs/{keyed.json()['id']}/cancel", headers=research).status_code == 200
    retried = app_client.post("/jobs", json=body(dataset), headers={**research, "Idempotency-Key": "k2"})
    assert retried.status_code == 201, retried.text
    assert app_client.post("/jobs", json=body(dataset), headers=research).status_code == 429
    assert app_client.get("/tenant", headers=research).json()["usage"]["queued_jobs"] == 2

    # 0: no new job is accepted; a lower limit leaves the queued ones be.
    app_client.patch("/admin/tenants/research", json={"max_queued_jobs": 0}, headers=admin)
    paused = app_client.post("/jobs", json=body(dataset), headers=research)
    assert paused.status_code == 429
    assert paused.json()["error"]["message"] == (
        "Your team (research) may not queue jobs now (its limit of queued jobs is 0); ask an admin to "
        "raise it."
    )
    assert len(queued_ids(app_client, research)) == 2
    # null: the server's (none here).
    app_client.patch("/admin/tenants/research", json={"max_queued_jobs": None}, headers=admin)
    assert app_client.post("/jobs", json=body(dataset), headers=research).status_code == 201
    assert len(queued_ids(app_client, research)) == 3


def test_concurrent_submissions_across_replicas_keep_to_the_limit_on_queued_jobs(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """The server's TPUTUNE_TENANT_MAX_QUEUED_JOBS, four API processes on one database: with one place
    left in the queue, 8 requests at once (half with Idempotency-Keys) get it for one job.
    Each count of the queued jobs is held a moment before its transaction commits, so that the replicas'
    writes overlap."""
    settings = make_settings(
        dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0, tenant_max_queued_jobs=5
    )

    def slow_commit(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("SELECT jobs.tenant, count(*)"):
            time.sleep(0.1)  # (a count done: the transaction's commit waits)

    event.listen(Engine, "after_cursor_execute", slow_commit)
    with contextlib.ExitStack() as stack:
        stack.callback(event.remove, Engine, "after_cursor_execute", slow_commit)
        replicas = [stack.enter_context(TestClient(create_app(settings))) for _ in range(4)]
        key, other = bearer(make_key(replicas[0], "research")), bearer(make_key(replicas[0], "vision"))
        assert replicas[1].get("/tenant", headers=key).json()["limits"] == limits(None, None, 5)

        def submit(n: int, team: dict[str, str] = key) -> int:
            headers = {**team, "Idempotency-Key": f"job-{n}"} if n % 2 else team
            return replicas[n % 4].post("/jobs", json=body(dataset), headers=headers).status_code

        assert [submit(n) for n in range(4)] == [201] * 4
        with ThreadPoolExecutor(12) as pool:  # (and 4 of another team's, whose queue has room)
            theirs = [pool.submit(submit, n, other) for n in range(100, 104)]
            codes = list(pool.map(submit, range(4, 12)))
        assert sorted(codes) == [201] + [429] * 7, codes
        assert [future.result() for future in theirs] == [201] * 4
        assert len(queued_ids(replicas[0], key)) == 5 and len(queued_ids(replicas[0], other)) == 4


def test_concurrent_resumes_across_replicas_keep_to_the_limit_on_queued_jobs(
    make_settings: Callable[..., Settings], dataset: Path
) -> None:
    """With one place left in the queue, 8 paused jobs resumed at once through four API processes: one is
    queued, 7 are refused and stay paused. Each count of the queued jobs is held a moment before the
    transaction goes on, so that the resumes overlap (before, each counted before its move: all 8 fit)."""
    settings = make_settings(
        dispatcher_enabled=False, admin_key=ADMIN, rate_limit_per_second=0, tenant_max_queued_jobs=3
    )

    def slow_count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("SELECT jobs.tenant, count(*)"):
            time.sleep(0.1)

    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(TestClient(create_app(settings))) for _ in range(4)]
        key = bearer(make_key(replicas[0], "research"))
        paused = []
        for _ in range(8):
            job_id = replicas[0].post("/jobs", json=body(dataset), headers=key).json()["id"]
            assert replicas[0].post(f"/jobs/{job_id}/pause", headers=key).json()["status"] == "paused"
            paused.append(job_id)
        for _ in range(2):
            assert replicas[0].post("/jobs", json=body(dataset), headers=key).status_code == 201
        event.listen(Engine, "after_cursor_execute", slow_count)
        stack.callback(event.remove, Engine, "after_cursor_execute", slow_count)

        def resume(n: int) -> int:
            return replicas[n % 4].post(f"/jobs/{paused[n]}/resume", headers=key).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(resume, range(8)))
        assert sorted(codes) == [200] + [429] * 7, codes
        assert len(queued_ids(replicas[0], key)) == 3
        statuses = [replicas[0].get(f"/jobs/{job_id}", headers=key).json()["status"] for job_id in paused]
        assert sorted(statuses) == ["paused"] * 7 + ["queued"]


def test_concurrent_changes_to_a_new_tenant_all_succeed(app_client: TestClient) -> None:
    """The first change makes the tenant's row: requests racing to make it do not fail."""

    def change(n: int) -> int:
        response = app_client.patch(
            f"/admin/tenants/team{n % 3}", json={"max_active_jobs": n}, headers=bearer(ADMIN)
        )
        return response.status_code

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(change, range(24))) == {200}
    listed = app_client.get("/admin/tenants", headers=bearer(ADMIN)).json()["data"]
    assert [t["name"] for t in listed] == ["team0", "team1", "team2"]


def events(http: Any, job_id: str, key: dict[str, str]) -> list[dict[str, Any]]:
    response = http.get(f"/jobs/{job_id}/events", params={"limit": 1000}, headers=key)
    return list(response.json()["data"])


def test_the_dispatcher_holds_each_tenants_jobs_to_its_own_limits(live_api, dataset: Path) -> None:  # type: ignore[no-untyped-def]
    api = live_api(admin_key=ADMIN, rate_limit_per_second=0, tenant_max_active_jobs=3, max_local_processes=8)
    api.headers = bearer(ADMIN)
    with api.client() as http:
        keys = {}
        for team in ("research", "vision"):
            made = http.post("/admin/keys", json={"tenant": team, "name": team})
            keys[team] = bearer(made.json()["key"])
        assert http.patch("/admin/tenants/research", json={"max_active_jobs": 1}).status_code == 200

        def submit(team: str, fake: str, processes: int = 1) -> str:
            response = http.post("/jobs", json=body(dataset, processes, fake), headers=keys[team])
            assert response.status_code == 201, response.text
            return str(response.json()["id"])

        first, second = submit("research", "slow"), submit("research", "slow")
        api.headers = keys["research"]
        api.wait_for(first, lambda j: j["status"] == "running")
        waiting = api.wait_for(second, lambda j: "limit 1" in (j["status_message"] or ""))
        assert waiting["status"] == "queued"
        # Why it waits is in its events too, once (the dispatcher's passes meanwhile add none).
        time.sleep(0.5)
        said = [e for e in events(http, second, keys["research"]) if (e["data"] or {}).get("waiting")]
        assert [(e["type"], e["message"], e["data"]) for e in said] == [
            ("status", "Waiting: 1 job of your team is running (limit 1).", {"waiting": "team_limit"})
        ]
        # vision has the server's limit (3): both run.
        api.headers = keys["vision"]
        for job_id in (submit("vision", "slow"), submit("vision", "slow")):
            api.wait_for(job_id, lambda j: j["status"] == "running")

        # Lifted (no limit, not even the server's): the waiting job starts, without anything else changing.
        lifted = http.patch("/admin/tenants/research", json={"max_active_jobs": "unlimited"})
        assert lifted.json()["limits"]["max_active_jobs"] is None
        api.headers = keys["research"]
        api.wait_for(second, lambda j: j["status"] == "running", timeout=15)
        mine = http.get("/tenant", headers=keys["research"]).json()
        assert {key: mine["usage"][key] for key in ("active_jobs", "queued_jobs", "chips")} == {
            "active_jobs": 2,
            "queued_jobs": 0,
            "chips": 2,
        }
        assert mine["usage"]["chip_hours_this_month"] < 0.1  # (2 processes for seconds, read within 30 s)

        # 0: nothing new starts; what runs goes on.
        assert http.patch("/admin/tenants/research", json={"max_active_jobs": 0}).status_code == 200
        third = submit("research", "succeed")
        paused = api.wait_for(third, lambda j: "may run no jobs now" in (j["status_message"] or ""))
        assert paused["status"] == "queued"
        assert http.get(f"/jobs/{first}", headers=keys["research"]).json()["status"] == "running"

        big = submit("research", "succeed", processes=2)  # (accepted: the chip limit is the server's 8)
        api.wait_for(big, lambda j: "may run no jobs now" in (j["status_message"] or ""))

        # A chip limit lowered below what runs, and below a queued job's size: they wait, saying why.
        lowered = http.patch("/admin/tenants/research", json=limits(None, 1))
        assert lowered.json()["limits"] == limits(3, 1)
        api.wait_for(
            third,
            lambda j: (
                j["status_message"]
                == ("Waiting: your team's running jobs hold 2 of its 1 processes; this job needs 1.")
            ),
        )
        too_big = api.wait_for(big, lambda j: "more than your team may hold" in (j["status_message"] or ""))
        assert too_big["status"] == "queued"
        assert too_big["status_message"] == (
            "Waiting: this job needs 2 processes, more than your team may hold at once (1); it starts if "
            "an admin raises the limit, or cancel it."
        )
        for job_id in (first, second):
            http.post(f"/jobs/{job_id}/cancel", headers=keys["research"])
        assert api.wait_for(third, lambda j: j["status"] in FINAL, timeout=30)["status"] == "succeeded"
        assert http.get(f"/jobs/{big}", headers=keys["research"]).json()["status"] == "queued"
        assert http.patch("/admin/tenants/research", json={"max_active_chips": None}).status_code == 200
        assert api.wait_for(big, lambda j: j["status"] in FINAL, timeout=30)["status"] == "succeeded"
        # Its reasons changed while it waited (no jobs now, then too big): one event, the first reason.
        said = [e["message"] for e in events(http, big, keys["research"]) if (e["data"] or {}).get("waiting")]
        assert said == ["Waiting: your team may run no jobs now (limit 0); ask your admin to raise it."]
        # What they ran, from the status events the dispatcher wrote: each job that ran, its processes for
        # as long as it ran (the big one 2 processes).
        used = {row["tenant"]: row for row in http.get("/usage").json()["data"]}
        assert used["research"]["jobs"] == 4 and 0 < used["research"]["chip_hours"] < 0.1
        history = events(http, big, keys["research"])
        moves = [(e["created_at"], e["data"]["status"]) for e in history if "status" in (e["data"] or {})]
        ran = [at for at, status in moves if status == "running"] + [moves[-1][0]]
        assert [status for _, status in moves][-2:] == ["running", "succeeded"]
        mine = http.get("/usage", params={"tenant": "research"}).json()["data"][0]["chip_hours"]
        assert (
            mine
            >= 2 * (datetime.fromisoformat(ran[-1]) - datetime.fromisoformat(ran[0])).total_seconds() / 3600
        )


def into_the_month(monkeypatch: pytest.MonkeyPatch) -> tuple[datetime, datetime, datetime]:
    """(now, this month's start, the tenants' clock now): that clock at least 3 hours into the month (a
    test's jobs held their processes for the last two hours), and its months' hours read each time."""
    real = datetime.now(UTC)
    start = tenants.month_start(real)
    now = real if real - start >= timedelta(hours=3) else start + timedelta(days=1)
    monkeypatch.setattr(tenants, "utcnow", lambda: now + (datetime.now(UTC) - real))
    monkeypatch.setattr(tenants.MonthSpent, "SECONDS", 0.0)  # (read again each time: no 30 s to wait)
    return real, start, now


def team_keys(http: Any) -> dict[str, dict[str, str]]:
    """An API key each for research and vision, made with the admin's."""
    made = {
        team: http.post("/admin/keys", json={"tenant": team, "name": team}) for team in ("research", "vision")
    }
    return {team: bearer(answer.json()["key"]) for team, answer in made.items()}


def ran_before(api: Any, *runs: tuple[str, datetime, datetime]) -> None:
    """Jobs (id, began, ended) written as the dispatcher would have after they ran then."""
    engine = make_engine(api.settings.database_url)
    with Session(engine) as session:
        for job_id, began, ended in runs:
            job = session.exec(select(Job).where(Job.id == job_id)).one()
            job.status, job.admitted_at, job.started_at, job.finished_at = "succeeded", began, began, ended
            session.add(job)
        session.commit()
    engine.dispose()


def test_a_team_that_used_its_months_chip_hours_waits_for_a_higher_budget(  # type: ignore[no-untyped-def]
    live_api, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A monthly chip-hour budget: once a team's jobs held it this month (as GET /usage counts them), its
    queued jobs wait, saying until when, and another team's run; the team sees the hours; a higher budget
    starts them. Counted from the month's start: a job of last month's counts for its hours in this one."""
    _, start, now = into_the_month(monkeypatch)
    api = live_api(admin_key=ADMIN, rate_limit_per_second=0, dispatcher_process=False, max_local_processes=8)
    api.headers = bearer(ADMIN)
    with api.client() as http:
        keys = team_keys(http)
        # research's jobs held 4 processes for the last two hours, and 4 more for the last hour of last month
        # (written as the dispatcher would have; they stay queued until then)
        assert http.patch("/admin/tenants/research", json={"max_active_jobs": 0}).status_code == 200
        ran = [http.post("/jobs", json=body(dataset, 4), headers=keys["research"]).json()["id"] for _ in "ab"]
        ran_before(api, (ran[0], now - timedelta(hours=2), now), (ran[1], start - timedelta(hours=1), start))
        # (SQLite's julianday() may make the 8 hours 7.99999: a budget of 7 is clearly held)
        budget = {"max_active_jobs": None, "max_chip_hours_per_month": 7}
        set_budget = http.patch("/admin/tenants/research", json=budget).json()
        assert set_budget["limits"]["max_chip_hours_per_month"] == 7
        assert set_budget["own_limits"]["max_chip_hours_per_month"] == 7
        mine = http.get("/tenant", headers=keys["research"]).json()
        assert mine["usage"]["chip_hours_this_month"] == pytest.approx(8, abs=0.02)

        waiting = http.post("/jobs", json=body(dataset), headers=keys["research"]).json()["id"]
        until = tenants.next_month(now)
        api.headers = keys["research"]
        held = api.wait_for(waiting, lambda j: "chip-hours this month" in (j["status_message"] or ""))
        assert held["status"] == "queued"
        assert held["status_message"] == (
            f"Waiting: your team's jobs held 8 of its 7 chip-hours this month; it starts on "
            f"{until:%Y-%m-%d} (UTC), or once an admin raises the budget."
        )
        api.headers = keys["vision"]
        other = http.post("/jobs", json=body(dataset), headers=keys["vision"]).json()["id"]
        assert api.wait_for(other, lambda j: j["status"] in FINAL)["status"] == "succeeded"
        api.headers = keys["research"]
        assert http.get(f"/jobs/{waiting}", headers=keys["research"]).json()["status"] == "queued"

        assert http.patch("/admin/tenants/research", json={"max_chip_hours_per_month": 9}).status_code == 200
        assert api.wait_for(waiting, lambda j: j["status"] in FINAL)["status"] == "succeeded"
        said = [e for e in events(http, waiting, keys["research"]) if (e["data"] or {}).get("waiting")]
        assert [e["message"] for e in said] == [held["status_message"]]
        listed = {t["name"]: t for t in http.get("/admin/tenants", headers=bearer(ADMIN)).json()["data"]}
        assert listed["research"]["usage"]["chip_hours_this_month"] >= 8
        assert listed["vision"]["limits"]["max_chip_hours_per_month"] is None


def test_past_its_budget_a_teams_running_job_stops_with_a_checkpoint_and_goes_on_with_a_higher_one(  # type: ignore[no-untyped-def]
    live_api, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TPUTUNE_TENANT_BUDGET_PAUSES_RUNNING: once a team's jobs held its month's chip-hours, its running job
    is stopped as a pause stops it (its worker saves a checkpoint), told as paused, and waits in the queue
    saying why; another team's job runs on; a higher budget starts it again, from its checkpoint."""
    real, _, now = into_the_month(monkeypatch)
    api = live_api(
        admin_key=ADMIN,
        rate_limit_per_second=0,
        dispatcher_process=False,
        max_local_processes=8,
        tenant_budget_pauses_running=True,
    )
    api.headers = bearer(ADMIN)
    with api.client() as http:
        keys = team_keys(http)
        # research's jobs held 4 processes for the last two hours (one written as the dispatcher would have)
        assert http.patch("/admin/tenants/research", json={"max_active_jobs": 0}).status_code == 200
        ran = http.post("/jobs", json=body(dataset, 4), headers=keys["research"]).json()["id"]
        ran_before(api, (ran, now - timedelta(hours=2), now))
        assert http.patch("/admin/tenants/research", json={"max_active_jobs": None}).status_code == 200

        slow = {**body(dataset, fake="slow"), "metadata": {"fake": "slow", "resume": "checkpoint"}}
        mine, other = (http.post("/jobs", json=slow, headers=keys[team]).json()["id"] for team in keys)
        for team, job_id in (("research", mine), ("vision", other)):
            api.headers = keys[team]
            api.wait_for(job_id, lambda j: j["status"] == "running" and j["progress"]["step"] >= 3)
        api.headers = keys["research"]

        # A budget below what the team held: the running job stops, with a checkpoint, and waits.
        # (SQLite's julianday() may make the 8 hours 7.99999: a budget of 7 is clearly held)
        assert http.patch("/admin/tenants/research", json={"max_chip_hours_per_month": 7}).status_code == 200
        waiting = api.wait_for(mine, lambda j: j["status"] == "queued", timeout=20)
        until = tenants.next_month(real)
        assert waiting["status_message"] == (
            "Waiting: your team's jobs held 8 of its 7 chip-hours this month; it starts "
            f"on {until:%Y-%m-%d} (UTC), or once an admin raises the budget."
        )
        assert waiting["pauses"] == 1 and waiting["preemptions"] == 0
        history = events(http, mine, keys["research"])
        moves = [e for e in history if "status" in (e["data"] or {})]
        assert [e["data"]["status"] for e in moves] == [
            "queued", "starting", "running", "pausing", "paused", "queued"
        ]  # fmt: skip
        assert moves[3]["data"]["for"] == "budget"
        assert moves[3]["message"].startswith(
            "running → pausing: Pausing: your team's jobs held 8 of its 7 chip-hours this month; the workers "
            "save a checkpoint"
        )
        stopped_at = json.loads(Path(waiting["output_uri"], "checkpoint.json").read_text())
        assert stopped_at["step"] >= 3
        time.sleep(0.5)  # (a few passes: it stays queued, and says why once)
        assert http.get(f"/jobs/{mine}", headers=keys["research"]).json()["status"] == "queued"
        said = [e for e in events(http, mine, keys["research"]) if (e["data"] or {}).get("waiting")]
        assert [e["message"] for e in said] == [f"paused → queued: {waiting['status_message']}"]
        assert http.get(f"/jobs/{other}", headers=keys["vision"]).json()["status"] == "running"

        # A higher budget: it starts again, and goes on from its checkpoint.
        raised = {"max_chip_hours_per_month": 9}
        assert http.patch("/admin/tenants/research", json=raised).status_code == 200
        again = api.wait_for(
            mine, lambda j: j["status"] == "running" and j["progress"]["step"] > stopped_at["step"]
        )
        assert again["pauses"] == 1
        for team, job_id in (("research", mine), ("vision", other)):
            http.post(f"/jobs/{job_id}/cancel", headers=keys[team])
            api.headers = keys[team]
            assert api.wait_for(job_id, lambda j: j["status"] in FINAL)["status"] == "cancelled"


def test_a_months_chip_hours_are_read_once_for_every_team_and_again_in_a_new_month(
    app_client: TestClient, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """api.tenants.MonthSpent: every team's hours read once serve each team's (a team that ran nothing has
    none) for SECONDS; a new month is read again, whatever the cache says."""
    real = datetime.now(UTC)
    now = tenants.month_start(real) + timedelta(days=10)  # (mid-month, whenever this runs)
    clock = {"now": now}
    monkeypatch.setattr(tenants, "utcnow", lambda: clock["now"])
    engine = app_client.app.state.engine  # type: ignore[attr-defined]
    settings = app_client.app.state.settings  # type: ignore[attr-defined]
    for team, processes in (("research", 2), ("vision", 1)):
        key = bearer(make_key(app_client, team))
        job_id = app_client.post("/jobs", json=body(dataset, processes), headers=key).json()["id"]
        with Session(engine) as session:
            job = session.exec(select(Job).where(Job.id == job_id)).one()
            began = now - timedelta(hours=3)
            job.status, job.admitted_at, job.started_at, job.finished_at = "succeeded", began, began, now
            session.add(job)
            session.commit()
    month = tenants.MonthSpent(settings)
    with Session(engine) as session:
        every = month.hours(session)
        assert every == pytest.approx({"research": 6.0, "vision": 3.0}, abs=0.01)
        with Session(engine) as other:  # (another job of research's since: not seen for SECONDS)
            other.execute(
                update(Job).where(col(Job.tenant) == "research").values(finished_at=now + timedelta(hours=1))
            )
            other.commit()
        assert month.hours(session, "research") == pytest.approx({"research": 6.0}, abs=0.01)
        assert month.hours(session, "nobody") == {}
        clock["now"] = now + timedelta(hours=2)  # (still this month: what it read holds)
        assert month.hours(session)["research"] == pytest.approx(6.0, abs=0.01)
        month.forget()
        assert month.hours(session, "research") == pytest.approx({"research": 8.0}, abs=0.01)
        # The next month: read again (the jobs ended in this one: nothing).
        clock["now"] = tenants.next_month(now) + timedelta(hours=1)
        assert month.hours(session) == {}


def test_a_change_made_here_outlives_a_read_that_began_before_it() -> None:
    """An API process's cache of the limits, read again in the background: a read that began before a
    change made through this process (it may hold the old row) does not put the old limit back."""
    cache = tenants.LimitsCache(engine=None, settings=Settings(tenant_max_active_jobs=5))  # type: ignore[arg-type]
    stored = {"research": Tenant(name="research", max_active_jobs=1)}
    reading, release = threading.Event(), threading.Event()

    def load() -> dict[str, Tenant]:
        read = dict(stored)  # (what the database holds as the read begins)
        reading.set()
        assert release.wait(5)
        return read

    cache._load = load  # type: ignore[method-assign]

    async def jobs_limit() -> int | None:
        return (await cache.of("research")).max_active_jobs

    async def scenario() -> list[int | None]:
        release.set()
        seen = [await jobs_limit()]  # the first read, awaited
        release.clear()
        reading.clear()
        cache._read_at = -float("inf")  # (stale: the next call reads again, in the background)
        seen.append(await jobs_limit())  # the old limit meanwhile
        task = cache._reading
        assert task is not None
        await anyio.to_thread.run_sync(reading.wait, 5)  # the read holds the old row
        stored["research"] = changed = Tenant(name="research", max_active_jobs=3)
        cache.put(changed)  # (a PATCH through this process)
        seen.append(await jobs_limit())
        release.set()
        await task
        seen.append(await jobs_limit())
        return seen

    assert asyncio.run(scenario()) == [1, 1, 3, 3]


def test_usage_reports_each_teams_chip_hours_and_tokens(app_client: TestClient, dataset: Path) -> None:
    research, vision = bearer(make_key(app_client, "research")), bearer(make_key(app_client, "vision"))
    idle = bearer(make_key(app_client, "idle"))
    now = datetime.now(UTC)
    hour, day = timedelta(hours=1), timedelta(days=1)
    # (processes, key, its moves after it was queued: (status, how long ago), tokens): the history as the
    # dispatcher and workers would write it
    # (a worker's report of its phase is a status event too, as is why a job waits: not moves)
    preempted = [("running", 10 * hour), ("phase", 9.8 * hour), ("queued", 9 * hour), ("waiting", 8.9 * hour)]
    preempted += [("starting", 8.2 * hour)]
    preempted += [("running", 8 * hour), ("succeeded", 7 * hour)]
    # Held by Kueue after its launch (it waits queued), admitted 4 h ago: from then.
    admitted = [("starting", 6 * hour), ("queued", 5.9 * hour), ("starting", 4 * hour)]
    admitted += [("running", 3.9 * hour), ("succeeded", 3 * hour)]
    held = [
        ("starting", 6 * hour),
        ("queued", 5.9 * hour),
        ("cancelling", 5 * hour),
        ("cancelled", 4.9 * hour),
    ]
    history = [
        # From its launch (starting: the model loads) until it ended: 2.1 h
        (2, research, [("starting", 3.1 * hour), ("running", 3 * hour), ("succeeded", hour)], 1_000),
        (1, research, [("running", 40 * day), ("succeeded", 29 * day)], 500),  # one day of it in the last 30
        (1, research, [("running", 60 * day), ("succeeded", 31 * day)], 7),  # before the window
        (1, research, [("running", 20 * hour), ("cancelling", 19.5 * hour), ("cancelled", 19 * hour)], 0),
        (1, research, admitted, 0),  # 1 h
        (1, research, held, 0),  # held until it was cancelled: it never took its chips
        (1, vision, [("running", 2 * hour)], 300),  # running: until now
        (1, vision, [], 0),  # never ran
        # Preempted (Kueue): back to the queue for an hour, then it ran again; the wait is not counted.
        (1, vision, preempted, 0),
        (1, vision, [("running", 5 * hour), ("queued", 4 * hour)], 0),  # preempted, and waiting still: 1 h
    ]
    engine = app_client.app.state.engine  # type: ignore[attr-defined]
    for processes, key, moves, tokens in history:
        job_id = app_client.post("/jobs", json=body(dataset, processes), headers=key).json()["id"]
        with Session(engine) as session:
            job = session.exec(select(Job).where(Job.id == job_id)).one()
            status, admitted_at = "queued", None
            for target, ago in moves:
                data: dict[str, Any] = {"status": target, "from": status}
                if target == "phase":
                    data = {"kind": "status", "phase": "training", "message": "Training."}
                elif target == "waiting":
                    data = {"waiting": "team_limit"}
                else:
                    # (as the dispatcher and transition do)
                    job.preemptions += status == "running" and target == "queued"
                    if status == "queued" and target in ("starting", "running"):
                        admitted_at = now - ago
                    elif target == "queued":
                        admitted_at = None
                    status = target
                session.add(JobEvent(job_seq=job.seq, created_at=now - ago, type="status", data=data))
            runs = [now - ago for target, ago in moves if target == "running"]
            job.status, job.trained_tokens = status, tokens
            job.started_at, job.admitted_at = (runs[0] if runs else None), admitted_at
            job.created_at = now - (moves[0][1] + 0.1 * hour if moves else 0 * hour)
            job.finished_at = now - moves[-1][1] if status in FINAL else None
            session.add(job)
            session.commit()

    def report(key: dict[str, str], **params: str) -> dict[str, Any]:
        response = app_client.get("/usage", params=params, headers=key)
        assert response.status_code == 200, response.text
        return dict(response.json())

    every = report(bearer(ADMIN))
    assert every["chip_unit"] == "processes"
    assert datetime.fromisoformat(every["until"]) - datetime.fromisoformat(every["since"]) == 30 * day
    rows = {row["tenant"]: row for row in every["data"]}
    assert rows.keys() == {"research", "vision"}  # (idle ran nothing)
    assert rows["research"]["jobs"] == 4 and rows["research"]["trained_tokens"] == 1_500
    # (cancelling: held)
    assert rows["research"]["chip_hours"] == pytest.approx(2 * 2.1 + 24 + 1 + 1, abs=0.01)
    assert rows["vision"]["jobs"] == 3 and rows["vision"]["chip_hours"] == pytest.approx(
        2 + 2.2 + 1, abs=0.01
    )

    # A window: what ran in it only.
    since, until = (now - 2.5 * hour).isoformat(), (now - 1.5 * hour).isoformat()
    rows = {row["tenant"]: row for row in report(bearer(ADMIN), since=since, until=until)["data"]}
    assert rows["research"]["chip_hours"] == pytest.approx(2 * 1, abs=0.001)
    assert rows["vision"]["chip_hours"] == pytest.approx(0.5, abs=0.001)
    # The preempted job's last half hour of one run, and 0.7 h of the next (from its start); not the hour
    # in the queue between.
    since, until = (now - 9.5 * hour).isoformat(), (now - 7.5 * hour).isoformat()
    rows = {row["tenant"]: row for row in report(bearer(ADMIN), since=since, until=until)["data"]}
    assert rows["vision"]["chip_hours"] == pytest.approx(1.2, abs=0.001)
    assert rows["vision"]["jobs"] == 1
    # A job preempted and waiting in the queue holds nothing, and has not run in a window since.
    waiting = report(bearer(ADMIN), since=(now - 3.5 * hour).isoformat(), until=(now - 3 * hour).isoformat())
    assert [row["tenant"] for row in waiting["data"]] == ["research"]

    # A team sees its own, and its line also when it ran nothing; not another team's.
    assert [row["tenant"] for row in report(research)["data"]] == ["research"]
    assert report(idle)["data"] == [{"tenant": "idle", "jobs": 0, "chip_hours": 0.0, "trained_tokens": 0}]
    other = app_client.get("/usage", params={"tenant": "vision"}, headers=research)
    assert other.status_code == 403 and other.json()["error"]["code"] == "admin_only"
    assert [row["tenant"] for row in report(bearer(ADMIN), tenant="vision")["data"]] == ["vision"]
    assert report(vision, tenant="vision")["data"][0]["jobs"] == 3

    for params, code in [
        ({"since": until, "until": since}, "empty_window"),
        ({"since": "yesterday"}, "invalid_request"),
        ({"until": "0001-01-01T00:00:00+05:00"}, "invalid_time"),
    ]:
        refused = app_client.get("/usage", params=params, headers=research)
        assert refused.status_code == 422, (params, refused.text)
        assert refused.json()["error"]["code"] == code, refused.json()
    early = report(research, until="0001-01-02T00:00:00Z")  # (30 days before: the start of time)
    assert early["data"][0]["jobs"] == 0


def replay(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, job_id: str, moves: list[tuple[str, float]]
) -> None:
    """Play a job's history through the code that writes it (api.jobs' moves, pause and resume; the
    dispatcher's launch), each move at its time (hours ago): the clock of api.jobs is set to it, and the
    events each move wrote are dated then."""
    now = datetime.now(UTC)
    with Session(engine) as session:
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        assert job.seq is not None

        def date(at: datetime) -> None:
            """The events written since the last move (and the job's row, for its first), at `at`."""
            written = update(JobEvent).where(col(JobEvent.job_seq) == job.seq, col(JobEvent.id) > last)
            session.execute(written.values(created_at=at))
            session.commit()

        last = 0
        created = now - timedelta(hours=moves[0][1] + 0.1)
        session.execute(update(Job).where(col(Job.seq) == job.seq).values(created_at=created))
        date(created)
        for what, ago in moves:
            at = now - timedelta(hours=ago)
            last = max(session.exec(select(JobEvent.id).where(JobEvent.job_seq == job.seq)).all(), default=0)
            monkeypatch.setattr(service, "utcnow", lambda at=at: at)
            if what in ("launch", "claim"):  # the dispatcher's claim (api.dispatcher: _claim)
                assert service.transition(session, job, JobStatus.starting, "Checking the dataset.")
            if what in ("launch", "launched"):  # and its launch (_launch): at once, or once storage answers
                job.launch = {"pid": 1}
                job.launched_at = job.admitted_at = at
                service.add_event(session, job, "launch", "Workers started.", data={"executor": "local"})
                session.add(job)
                session.commit()
            if what == "pause":
                service.request_pause(session, None, job_id)
            elif what == "resume":
                service.request_resume(session, None, job_id)
            elif what not in ("launch", "claim", "launched"):
                assert service.transition(session, job, JobStatus(what))
            date(at)


def test_a_paused_job_is_charged_for_its_running_time_only(
    app_client: TestClient, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usage report (GET /usage) and each job's own `usage` agree on a job paused and resumed: its
    chips are counted while it runs and while it pauses (its workers save a checkpoint), not while it
    waits paused or queued after."""
    research, vision = bearer(make_key(app_client, "research")), bearer(make_key(app_client, "vision"))
    engine = app_client.app.state.engine  # type: ignore[attr-defined]

    def submit(key: dict[str, str], processes: int, moves: list[tuple[str, float]]) -> str:
        job_id = str(app_client.post("/jobs", json=body(dataset, processes), headers=key).json()["id"])
        replay(engine, monkeypatch, job_id, moves)
        monkeypatch.undo()
        return job_id

    # Ran 2.1 h (paused 8 h ago: the pause took 0.1 h), paused 2.9 h, queued 0.1 h, ran 1 h more: 3.1 h.
    resumed = [("launch", 10), ("running", 9.9), ("pause", 8), ("paused", 7.9), ("resume", 5)]
    resumed += [("launch", 4.9), ("running", 4.8), ("succeeded", 3.9)]
    # Ran 3 h and paused since 2.9 h ago (the pause took 0.1 h): 3.1 h.
    still_paused = [("launch", 6), ("running", 5.9), ("pause", 3), ("paused", 2.9)]
    # Paused before it started, resumed; ran 1 h, paused 1 h, runs again since 2 h ago: 3.05 h until now.
    twice = [("pause", 7), ("resume", 6), ("launch", 5), ("running", 4.9), ("pause", 4), ("paused", 3.95)]
    twice += [("resume", 3), ("launch", 2), ("running", 1.9)]
    jobs = {
        "resumed": submit(research, 2, resumed),
        "still_paused": submit(research, 1, still_paused),
        "twice": submit(vision, 1, twice),
    }

    def own(name: str) -> dict[str, Any]:
        key = vision if name == "twice" else research
        return dict(app_client.get(f"/jobs/{jobs[name]}", headers=key).json())

    shown = {name: own(name) for name in jobs}
    assert {name: (job["status"], job["pauses"]) for name, job in shown.items()} == {
        "resumed": ("succeeded", 1),
        "still_paused": ("paused", 1),
        "twice": ("running", 2),
    }
    hour = 3600
    assert shown["resumed"]["usage"]["held_seconds"] == pytest.approx(3.1 * hour, abs=1)
    assert shown["resumed"]["usage"]["chip_hours"] == pytest.approx(6.2, abs=1e-3)
    assert shown["still_paused"]["usage"]["held_seconds"] == pytest.approx(3.1 * hour, abs=1)
    assert shown["twice"]["usage"]["held_seconds"] == pytest.approx(3.05 * hour, abs=60)

    def report(**params: str) -> dict[str, dict[str, Any]]:
        response = app_client.get("/usage", params=params, headers=bearer(ADMIN))
        assert response.status_code == 200, response.text
        return {row["tenant"]: row for row in response.json()["data"]}

    rows = report()
    assert rows["research"]["jobs"] == 2
    assert rows["research"]["chip_hours"] == pytest.approx(6.2 + 3.1, abs=1e-3)
    assert rows["vision"]["jobs"] == 1 and rows["vision"]["chip_hours"] == pytest.approx(3.05, abs=0.01)
    # The report and the jobs' own figures agree.
    assert rows["research"]["chip_hours"] == pytest.approx(
        own("resumed")["usage"]["chip_hours"] + own("still_paused")["usage"]["chip_hours"], abs=1e-3
    )
    assert rows["vision"]["chip_hours"] == pytest.approx(own("twice")["usage"]["chip_hours"], abs=1e-3)

    def window(since: float, until: float) -> dict[str, dict[str, Any]]:
        now = datetime.now(UTC)
        return report(
            since=(now - timedelta(hours=since)).isoformat(), until=(now - timedelta(hours=until)).isoformat()
        )

    # While the first was paused (7.9 h to 5 h ago) and the third paused then queued (7 h to 5 h ago):
    # only the second ran, from its launch 6 h ago.
    rows = window(7.5, 5.5)
    assert rows.keys() == {"research"} and rows["research"]["jobs"] == 1
    assert rows["research"]["chip_hours"] == pytest.approx(0.5, abs=1e-3)
    # Across the pauses: the first's pausing and 0.4 h of its second run (2 chips), the second's 1.5 h,
    # the third's 0.5 h.
    rows = window(8.5, 4.5)
    assert rows["research"]["jobs"] == 2
    assert rows["research"]["chip_hours"] == pytest.approx(2 * (0.6 + 0.4) + 1.5, abs=1e-3)
    assert rows["vision"]["jobs"] == 1 and rows["vision"]["chip_hours"] == pytest.approx(0.5, abs=1e-3)
    # The third while paused (4 h ago to 3 h ago, less the pause's 0.05 h): nothing.
    assert "vision" not in window(3.9, 3.1)


def test_a_preempted_job_is_charged_from_its_launch_not_its_claim(
    app_client: TestClient, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose dataset check waited (storage away) holds nothing until it is launched: the report reads
    a preempted job's moves, and its launch, as the job's own `usage` does."""
    research = bearer(make_key(app_client, "research"))
    engine = app_client.app.state.engine  # type: ignore[attr-defined]
    job_id = str(app_client.post("/jobs", json=body(dataset, 1), headers=research).json()["id"])
    # Claimed 10 h ago, launched an hour later; preempted after 1 h, let run again an hour later; 1 h more.
    moves = [("claim", 10), ("launched", 9), ("running", 8.9), ("queued", 8), ("starting", 7)]
    replay(engine, monkeypatch, job_id, [*moves, ("running", 6.9), ("succeeded", 6)])
    monkeypatch.undo()
    job = app_client.get(f"/jobs/{job_id}", headers=research).json()
    assert job["preemptions"] == 1 and job["usage"]["held_seconds"] == pytest.approx(2 * 3600, abs=1)
    rows = app_client.get("/usage", headers=bearer(ADMIN)).json()["data"]
    assert [(row["tenant"], row["chip_hours"]) for row in rows] == [("research", pytest.approx(2, abs=1e-3))]


def test_a_job_held_by_kueue_then_paused_is_charged_as_its_own_usage_says(
    app_client: TestClient, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    research = bearer(make_key(app_client, "research"))
    engine = app_client.app.state.engine  # type: ignore[attr-defined]
    job_id = str(app_client.post("/jobs", json=body(dataset, 1), headers=research).json()["id"])
    # Launched 6 h ago, held by Kueue 0.1 h later (it lets its chips go), paused while held: its JobSet
    # deleted in the 0.1 h the pause took.
    replay(engine, monkeypatch, job_id, [("launch", 6), ("queued", 5.9), ("pause", 5), ("paused", 4.9)])
    monkeypatch.undo()
    job = app_client.get(f"/jobs/{job_id}", headers=research).json()
    assert job["status"] == "paused" and job["pauses"] == 1
    assert job["usage"]["chip_hours"] == pytest.approx(0.1, abs=1e-3)
    rows = {row["tenant"]: row for row in app_client.get("/usage", headers=research).json()["data"]}
    assert rows["research"]["chip_hours"] == pytest.approx(job["usage"]["chip_hours"], abs=1e-3)


def test_a_job_held_by_kueue_after_its_launch_is_charged_as_its_own_usage_says(
    app_client: TestClient, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held back by Kueue after its launch (it went back to `queued`, not a preemption: it was not running),
    then cancelled, or let run: the report reads its moves, as for a preempted one (its row's `admitted_at`
    is its last admission, or none), and counts what its own `usage` counts."""
    research = bearer(make_key(app_client, "research"))
    engine = app_client.app.state.engine  # type: ignore[attr-defined]
    histories = [
        [("launch", 6), ("queued", 5.9), ("cancelling", 5), ("cancelled", 4.9)],  # 0.1 h
        [("launch", 4), ("queued", 3.9), ("starting", 3), ("running", 2.9), ("succeeded", 2)],  # 0.1 + 1 h
    ]
    own = []
    for moves in histories:
        job_id = str(app_client.post("/jobs", json=body(dataset, 1), headers=research).json()["id"])
        replay(engine, monkeypatch, job_id, moves)
        monkeypatch.undo()
        job = app_client.get(f"/jobs/{job_id}", headers=research).json()
        assert job["preemptions"] == job["pauses"] == job["retries"] == 0
        own.append(job["usage"]["chip_hours"])
    assert own == [pytest.approx(0.1, abs=1e-3), pytest.approx(1.1, abs=1e-3)]
    [row] = app_client.get("/usage", headers=research).json()["data"]
    assert (row["jobs"], row["chip_hours"]) == (2, pytest.approx(sum(own), abs=1e-3))


def test_deleted_jobs_stay_counted_in_usage(
    app_client: TestClient, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DELETE /jobs/{id} takes a job's events, from which the report reads when a preempted, paused or
    retried job ran: what each deleted job held is kept, and the report over any window is as it was."""
    research, vision = bearer(make_key(app_client, "research")), bearer(make_key(app_client, "vision"))
    engine = app_client.app.state.engine  # type: ignore[attr-defined]
    day = 24.0
    preempted = [("launch", 12), ("running", 11.9), ("queued", 11), ("starting", 10.5), ("running", 10.4)]
    paused = [("launch", 9), ("running", 8.9), ("pause", 8), ("paused", 7.9), ("resume", 7), ("launch", 6.9)]
    retried = [("launch", 5), ("running", 4.9), ("failed", 4.5), ("resume", 4), ("launch", 3.9)]
    held = [("launch", 6), ("queued", 5.9), ("cancelling", 5), ("cancelled", 4.9)]  # (Kueue held it)
    histories = [  # (key, processes, its moves (hours ago), trained tokens)
        (research, 2, [("launch", 10), ("running", 9.9), ("succeeded", 8)], 100),
        (research, 1, [*preempted, ("succeeded", 9)], 200),
        (research, 2, [*paused, ("running", 6.8), ("succeeded", 6)], 400),
        (vision, 1, [*retried, ("running", 3.8), ("failed", 3)], 800),  # (failed, resumed, failed again)
        (vision, 4, [("launch", 2), ("running", 1.9), ("cancelling", 1.5), ("cancelled", 1.4)], 16),
        (vision, 1, [("cancelled", 5)], 0),  # (never ran)
        (vision, 1, held, 0),
        (vision, 1, [("launch", 40 * day), ("running", 40 * day - 0.1), ("succeeded", 29 * day)], 32),
        (research, 1, [("launch", 3), ("running", 2.9)], 64),  # (running still: not deleted)
    ]
    ids = []
    for key, processes, moves, tokens in histories:
        job_id = str(app_client.post("/jobs", json=body(dataset, processes), headers=key).json()["id"])
        replay(engine, monkeypatch, job_id, moves)
        monkeypatch.undo()
        with Session(engine) as session:
            session.execute(update(Job).where(col(Job.id) == job_id).values(trained_tokens=tokens))
            session.commit()
        ids.append(job_id)
    now = datetime.now(UTC)

    def reports() -> list[list[tuple[str, int, float, int]]]:
        found = []
        windows: list[dict[str, str]] = [{}, {"tenant": "vision"}]
        for start in range(14):  # (windows of 1.25 h, overlapping, over the last 14 h; and the last 45 days)
            since, until = now - timedelta(hours=start + 1.25), now - timedelta(hours=start)
            windows.append({"since": since.isoformat(), "until": until.isoformat()})
        windows.append({"since": (now - timedelta(days=45)).isoformat(), "until": now.isoformat()})
        for params in windows:
            response = app_client.get("/usage", params=params, headers=bearer(ADMIN))
            assert response.status_code == 200, response.text
            rows = response.json()["data"]
            found.append([(r["tenant"], r["jobs"], r["chip_hours"], r["trained_tokens"]) for r in rows])
        return found

    before = reports()
    # (not the one that never ran; the one Kueue held, for the 0.1 h from its launch; the 40-day-old one's
    # last day, 11 in 45 days)
    assert [(row[0], row[1]) for row in before[0]] == [("research", 4), ("vision", 4)]
    assert before[-1][1][2] == pytest.approx(before[0][1][2] + 10 * day, abs=1e-3)
    for job_id, (key, *_) in zip(ids[:-1], histories, strict=False):
        deleted = app_client.delete(f"/jobs/{job_id}", headers=key)
        assert deleted.status_code == 200, deleted.text
        assert app_client.get(f"/jobs/{job_id}", headers=key).status_code == 404
    with Session(engine) as session:
        assert session.exec(select(Job.id)).all() == [ids[-1]]
    after = reports()
    for was, now_is in zip(before, after, strict=True):
        # (the default window's `until` is now: the running job's figure grew meanwhile)
        assert now_is == [(t, jobs, pytest.approx(hours, abs=1e-3), tokens) for t, jobs, hours, tokens in was]
