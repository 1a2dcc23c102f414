"""The audit log (GET /audit): every change to keys, teams' limits and data prefixes, and webhook endpoints,
with who made it, in which request, and what changed; never a secret; each team sees its own; on SQLite and
PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from api.audit import ACTIONS
from api.settings import Settings
from tests.test_auth import ADMIN, bearer, make_key
from tests.test_tenants import server

HOOK_URL = "https://hooks.example.com/services/T000/B000/s3cr3tT0ken?channel=ops"


def audit(client: TestClient, key: str = ADMIN, **params: Any) -> list[dict[str, Any]]:
    answer = client.get("/audit", params=params, headers=bearer(key))
    assert answer.status_code == 200, answer.text
    return list(answer.json()["data"])


def test_every_change_to_keys_limits_and_webhooks_is_logged_with_who_and_what(
    make_settings: Callable[..., Settings],
) -> None:
    with server(make_settings, webhook_allow_private=True) as client:
        admin = bearer(ADMIN)
        created = client.post(
            "/admin/keys", json={"tenant": "research", "name": "ci", "expires_in_days": 30}, headers=admin
        )
        research_key = created.json()
        ops = client.post(
            "/admin/keys", json={"tenant": "ops", "name": "oncall", "admin": True}, headers=admin
        )
        ops_key = ops.json()
        ops_admin = bearer(ops_key["key"])
        rotated = client.post(
            f"/admin/keys/{research_key['id']}/rotate", json={"grace_seconds": 60}, headers=ops_admin
        ).json()
        revoked = client.delete(f"/admin/keys/{research_key['id']}", headers=ops_admin)
        assert revoked.status_code == 200
        limits = client.patch(
            "/admin/tenants/research",
            json={"max_active_jobs": 4, "data_prefixes": ["gs://ml-data/teams/research/"]},
            headers=ops_admin,
        )
        assert limits.status_code == 200, limits.text
        client.patch("/admin/tenants/research", json={"max_active_jobs": "unlimited"}, headers=admin)

        research = bearer(rotated["key"])
        hook = client.post("/webhooks", json={"url": HOOK_URL, "events": ["job.failed"]}, headers=research)
        assert hook.status_code == 201, hook.text
        hook_id = hook.json()["id"]
        changed = client.patch(
            f"/webhooks/{hook_id}",
            json={"url": HOOK_URL.replace("B000", "B001"), "events": ["job.failed", "job.succeeded"]},
            headers=research,
        )
        assert changed.status_code == 200, changed.text
        client.patch(f"/webhooks/{hook_id}", json={"enabled": False}, headers=research)
        new_secret = client.post(f"/webhooks/{hook_id}/rotate-secret", headers=research).json()["secret"]
        deleted = client.delete(f"/webhooks/{hook_id}", headers=admin)
        assert deleted.status_code == 200

        events = audit(client, limit=100)
        assert [(e["action"], e["tenant"], e["target"], e["actor"]["key_id"]) for e in events][::-1] == [
            ("key.created", "research", research_key["id"], "admin"),
            ("key.created", "ops", ops_key["id"], "admin"),
            ("key.rotated", "research", research_key["id"], ops_key["id"]),
            ("key.revoked", "research", research_key["id"], ops_key["id"]),
            ("tenant.updated", "research", "research", ops_key["id"]),
            ("tenant.updated", "research", "research", "admin"),
            ("webhook.created", "research", hook_id, rotated["id"]),
            ("webhook.updated", "research", hook_id, rotated["id"]),
            ("webhook.updated", "research", hook_id, rotated["id"]),
            ("webhook.secret_rotated", "research", hook_id, rotated["id"]),
            ("webhook.deleted", "research", hook_id, "admin"),
        ]
        by_action = {e["action"]: e for e in reversed(events)}  # (the last of each)
        first = events[-1]
        assert first["details"] == {
            "name": "ci",
            "prefix": research_key["prefix"],
            "admin": False,
            "read_only": False,
            "expires_at": research_key["expires_at"].replace("Z", "+00:00"),
        }
        assert first["actor"] == {"key_id": "admin", "tenant": "default", "who": "the admin"}
        assert first["request_id"] == created.headers["x-request-id"]
        assert events[-2]["details"]["admin"] is True  # (an admin key made: the log says so)
        assert by_action["key.rotated"]["details"]["new_key_id"] == rotated["id"]
        assert by_action["key.rotated"]["details"]["new_prefix"] == rotated["prefix"]
        assert by_action["key.rotated"]["actor"] == {
            "key_id": ops_key["id"],
            "tenant": "ops",
            "who": f"key {ops_key['id']}",
        }
        assert by_action["key.revoked"]["request_id"] == revoked.headers["x-request-id"]
        assert events[-5]["details"] == {
            "max_active_jobs": {"from": None, "to": 4},
            "data_prefixes": {"from": None, "to": ["gs://ml-data/teams/research"]},
        }
        assert events[-6]["details"] == {"max_active_jobs": {"from": 4, "to": "unlimited"}}
        assert events[-7]["details"] == {
            "url": "https://hooks.example.com/…",
            "events": ["job.failed"],
            "description": None,
            "enabled": True,
        }
        # The URL's path changed: said so, though neither path is shown; the events each way.
        assert events[-8]["details"] == {
            "url": {"from": "https://hooks.example.com/…", "to": "https://hooks.example.com/…"},
            "events": {"from": ["job.failed"], "to": ["job.succeeded", "job.failed"]},
        }
        assert events[-9]["details"] == {"enabled": {"from": True, "to": False}}
        assert by_action["webhook.secret_rotated"]["details"]["old_secret_until"] is not None

        # No secret anywhere: keys, their hashes, the endpoint's secret, the token in its URL.
        text = client.get("/audit", params={"limit": 100}, headers=admin).text
        for secret in (
            research_key["key"],
            ops_key["key"],
            rotated["key"],
            new_secret,
            "s3cr3tT0ken",
            "T000",
        ):
            assert secret not in text


def test_refused_and_unchanged_requests_log_nothing(make_settings: Callable[..., Settings]) -> None:
    with server(make_settings, webhook_allow_private=True, webhook_max_per_tenant=1) as client:
        admin = bearer(ADMIN)
        key = make_key(client, "research")
        research = bearer(key)
        hook_id = client.post("/webhooks", json={"url": "https://a.example.com/h"}, headers=research).json()[
            "id"
        ]
        before = audit(client)
        assert [e["action"] for e in before] == ["webhook.created", "key.created"]

        # Refused: not an admin, a bad value, one endpoint too many, a bad URL, another team's endpoint.
        assert (
            client.post("/admin/keys", json={"tenant": "x", "name": "n"}, headers=research).status_code == 403
        )
        assert (
            client.patch("/admin/tenants/research", json={"max_active_jobs": -5}, headers=admin).status_code
            == 422
        )
        too_many = client.post("/webhooks", json={"url": "https://b.example.com/h"}, headers=research)
        assert too_many.status_code == 409
        bad = client.patch(f"/webhooks/{hook_id}", json={"url": "ftp://a.example.com"}, headers=research)
        assert bad.status_code == 422
        vision = bearer(make_key(client, "vision"))
        assert client.delete(f"/webhooks/{hook_id}", headers=vision).status_code == 404
        # Unchanged: a limit set to what it is, the same events again; a key revoked twice is revoked once.
        assert client.patch("/admin/tenants/research", json={}, headers=admin).status_code == 200
        assert (
            client.patch("/admin/tenants/vision", json={"max_active_jobs": None}, headers=admin).status_code
            == 200
        )
        same = client.patch(
            f"/webhooks/{hook_id}",
            json={"events": ["job.succeeded", "job.failed", "job.cancelled"]},
            headers=research,
        )
        assert same.status_code == 200
        key_id = before[-1]["target"]
        assert client.delete(f"/admin/keys/{key_id}", headers=admin).status_code == 200
        assert client.delete(f"/admin/keys/{key_id}", headers=admin).status_code == 200

        after = audit(client)
        assert [e["action"] for e in after] == [
            "key.revoked",
            "key.created",
            "webhook.created",
            "key.created",
        ]


def test_each_team_sees_its_own_events_and_an_admin_filters_and_pages_them(
    make_settings: Callable[..., Settings],
) -> None:
    with server(make_settings) as client:
        admin = bearer(ADMIN)
        research, vision = make_key(client, "research"), make_key(client, "vision")
        for value in range(1, 6):
            for team in ("research", "vision"):
                assert (
                    client.patch(
                        f"/admin/tenants/{team}", json={"max_queued_jobs": value}, headers=admin
                    ).status_code
                    == 200
                )
        mine = audit(client, research, limit=100)
        assert {e["tenant"] for e in mine} == {"research"} and len(mine) == 6  # (its key, five changes)
        other = client.get("/audit", params={"tenant": "vision"}, headers=bearer(research))
        assert other.status_code == 403 and other.json()["error"]["code"] == "admin_only"
        assert len(audit(client, vision, tenant="vision")) == 6

        # Pages, newest first, by `after`.
        seen, after = [], None
        while True:
            params: dict[str, Any] = {"tenant": "research", "action": "tenant.updated", "limit": 2}
            if after is not None:
                params["after"] = after
            page = client.get("/audit", params=params, headers=admin).json()
            seen += [e["details"]["max_queued_jobs"]["to"] for e in page["data"]]
            assert page["has_more"] == (page["next_after"] is not None)
            if not page["has_more"]:
                break
            after = page["next_after"]
        assert seen == [5, 4, 3, 2, 1]

        both = audit(client, action=["key.created", "tenant.updated"], limit=100)
        assert len(both) == 12
        assert [e["action"] for e in audit(client, target="vision", limit=100)] == ["tenant.updated"] * 5
        assert len(audit(client, actor="admin", limit=100)) == 12
        assert audit(client, actor="key_nobody") == []
        now = datetime.now(UTC)
        assert len(audit(client, since=(now - timedelta(minutes=5)).isoformat(), limit=100)) == 12
        assert audit(client, until=(now - timedelta(minutes=5)).isoformat()) == []

        for params, code in (
            ({"action": "key.stolen"}, "invalid_request"),
            ({"since": now.isoformat(), "until": (now - timedelta(hours=1)).isoformat()}, "empty_window"),
            ({"limit": 0}, "invalid_request"),
        ):
            answer = client.get("/audit", params=params, headers=admin)
            assert answer.status_code == 422, answer.text
            assert answer.json()["error"]["code"] == code


def test_without_keys_the_single_user_is_named(client: TestClient) -> None:
    hook = client.post("/webhooks", json={"url": "https://ci.example.com/hook"})
    assert hook.status_code == 201, hook.text
    (event,) = client.get("/audit").json()["data"]
    assert event["action"] == "webhook.created" and event["tenant"] == "default"
    assert event["actor"] == {"key_id": None, "tenant": "default", "who": None}


def test_the_audit_pages_action_filter_offers_every_action() -> None:
    """The dashboard's audit page lists the actions by hand: each one the API logs, and only those."""
    page = (Path(__file__).resolve().parent.parent / "api/static/audit.html").read_text()
    offered = re.findall(r"<option>([a-z_.]+)</option>", page)
    assert offered == list(ACTIONS)
