"""The web dashboard (/ui/): its routes, and its pages in headless Chromium against the real API.

Jobs are put in `running` the way the dispatcher leaves them (starting, with a worker token), then fed
reports through POST /jobs/{id}/progress as a worker would; the dispatcher is off, so nothing else
moves them. Screenshots go to test-artifacts/dashboard-*.png under the repository root.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, expect, sync_playwright
from sqlalchemy import create_engine, insert, update
from sqlmodel import Session, col, select

from api.auth import COOKIE_NAME, DEFAULT_TENANT
from api.jobs import new_job_token, save_log, transition
from api.migrate import upgrade
from api.models import Job, JobEvent, utcnow
from api.routes.dashboard import STATIC_DIR
from api.states import JobStatus
from tests.conftest import LiveApi

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REQUIRE_BROWSER_ENV = "TPUTUNE_REQUIRE_BROWSER"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
ADMIN = "admin-secret-0123456789"


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite only: the pages read the JSON API, which the other tests run on both databases."""
    url = f"sqlite:///{tmp_path / 'tputune.db'}"
    upgrade(url)
    return url


# --- routes (no browser) ---------------------------------------------------------------------------


def test_root_redirects_and_pages_are_served(client: TestClient) -> None:
    root = client.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/ui/"
    assert client.get("/ui", follow_redirects=False).headers["location"].endswith("/ui/")
    pages = (("/ui/", "jobs.js"), ("/ui/jobs/ft-anything", "job.js"), ("/ui/keys", "keys.js"))
    more = (("/ui/tenants", "tenants.js"), ("/ui/webhooks", "webhooks.js"), ("/ui/audit", "audit.js"))
    for path, script in (*pages, *more):
        page = client.get(path)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert f'src="/ui/static/{script}"' in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]


def test_assets_are_served_and_nothing_else(client: TestClient) -> None:
    for name, kind in (("job.js", "javascript"), ("chart.js", "javascript"), ("dashboard.css", "css")):
        asset = client.get(f"/ui/static/{name}")
        assert asset.status_code == 200 and kind in asset.headers["content-type"], name
    for name in ("nope.js", "job.html", "..%2Fdashboard.py"):
        missing = client.get(f"/ui/static/{name}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found", name
    assert not [path for path in client.get("/openapi.json").json()["paths"] if path.startswith("/ui")]


def test_pages_load_nothing_from_other_origins() -> None:
    """Works offline: no CDN scripts, styles, fonts or imports."""
    external = re.compile(
        r"""(src|href)\s*=\s*["']?(https?:)?//|from\s+["']https?:|url\(\s*["']?(https?:)?//"""
    )
    for path in STATIC_DIR.iterdir():
        assert not external.search(path.read_text()), path.name


# --- browser ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is not installed (apt-get install chromium)"
        if os.environ.get(REQUIRE_BROWSER_ENV, "").strip() == "1":
            pytest.fail(f"{reason} and {REQUIRE_BROWSER_ENV}=1", pytrace=False)
        pytest.skip(reason)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Tab:
    """A page that records what would break silently: script errors and requests leaving the API."""

    def __init__(self, page: Page, origin: str) -> None:
        self.page = page
        self.errors: list[str] = []
        self.foreign: list[str] = []
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        page.on("console", self._console)
        page.on("request", lambda request: self._request(request, origin))

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def _request(self, request: Request, origin: str) -> None:
        if not request.url.startswith((origin + "/", "data:")):
            self.foreign.append(request.url)

    def assert_clean(self) -> None:
        assert self.errors == [] and self.foreign == []


@pytest.fixture
def open_tab(browser: Browser) -> Iterator[Callable[[LiveApi, str], Tab]]:
    contexts = []

    def open_(api: LiveApi, path: str) -> Tab:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        contexts.append(context)
        context.set_default_timeout(10_000)
        tab = Tab(context.new_page(), api.url)
        tab.page.goto(api.url + path)
        return tab

    yield open_
    for context in contexts:
        context.close()


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=ARTIFACTS / f"dashboard-{name}.png", full_page=True)


def sign_in(page: Page, key: str) -> Page:
    """Sign `page` in with `key` through the dashboard's form, and wait until it is: the page reloads, signed
    in (a page opened before the cookie is set would ask for a key again)."""
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#signout")).to_be_visible()
    return page


def create(api: LiveApi, dataset: Path, name: str, **spec: Any) -> str:
    with api.client() as http:
        body = {"name": name, "model": "tiny", "dataset_uri": str(dataset), **spec}
        response = http.post("/jobs", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def started(api: LiveApi, dataset: Path, name: str, **spec: Any) -> tuple[str, str]:
    """A job as the dispatcher leaves it after launch: starting, with a worker token."""
    job_id = create(api, dataset, name, **spec)
    engine = api.server.config.app.state.engine  # type: ignore[union-attr]
    with Session(engine, expire_on_commit=False) as session:
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        transition(session, job, JobStatus.starting)
        token, job.token_hash = new_job_token()
        job.launched_at = job.admitted_at = utcnow() - timedelta(hours=2)  # (launched two hours ago)
        session.add(job)
        session.commit()
    return job_id, token


def preempt(api: LiveApi, job_id: str) -> None:
    """As the dispatcher moves a running job that Kueue preempted, and then admitted again."""
    engine = api.server.config.app.state.engine  # type: ignore[union-attr]
    with Session(engine) as session:
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        transition(session, job, JobStatus.queued, "Waiting for quota: Kueue has not admitted the job yet.")
        transition(session, job, JobStatus.starting)
        session.commit()


def report(api: LiveApi, job_id: str, token: str, reports: list[dict[str, Any]]) -> None:
    with api.client() as http:
        response = http.post(
            f"/jobs/{job_id}/progress",
            json={"reports": reports},
            headers={"Authorization": f"Bearer {token}"},
        )
    assert response.status_code == 200, response.text


def step(n: int, loss: float, total: int = 20) -> dict[str, Any]:
    return {
        "kind": "metrics",
        "step": n,
        "total_steps": total,
        "loss": loss,
        "accuracy": min(n * 0.03, 0.99),
        "learning_rate": 1e-4,
        "tokens_per_second": 1234.0,
        "trained_tokens": n * 64,
        "eta_seconds": float(total - n) * 30,
    }


def series(page: Page, name: str, chart: str = "loss-chart") -> list[list[float]]:
    return json.loads(page.locator(f'#{chart} path[data-series="{name}"]').get_attribute("data-points") or "")


def test_a_dpo_job_page_says_it_learns_from_preference_pairs(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False)
    job_id, token = started(api, dataset, "preferences", method={"type": "lora", "objective": "dpo"})
    figures = {"documents": 270, "tokens": 28_000, "target_tokens": 9_000, "rows": 270, "row_tokens": 64}
    figures |= {"pad_fraction": 0.1, "steps_per_epoch": 33, "total_steps": 33, "validation_documents": 30}
    report(api, job_id, token, [{"kind": "data", **figures, "preference_pairs": True}])
    page = open_tab(api, f"/ui/jobs/{job_id}").page
    expect(page.locator("#f-method")).to_have_text("lora, dpo")
    expect(page.locator("#accuracy-label")).to_have_text("Pair accuracy")
    expect(page.locator("#accuracy-heading")).to_have_text("Pair accuracy")
    expect(page.locator("#f-data")).to_have_text(
        "270 preference pairs, 28,000 tokens in 270 rows of 64 (10.0% padding); 33 steps an epoch; "
        "validation 30 preference pairs"
    )
    expect(page.locator('#events li[data-type="data"]')).to_contain_text("Data: 270 preference pairs")
    # Its rewards, chosen and rejected, on a chart of their own: from the history, then as they come; the
    # latest in its facts.
    expect(page.locator("#rewards-card")).to_be_hidden()
    expect(page.locator("#rewards-fact")).to_be_visible()
    expect(page.locator("#f-rewards")).to_have_text("—")
    expect(page.locator("#f-eval-rewards")).to_have_text("—")
    rewards = [
        {"chosen_reward": 0.0, "rejected_reward": 0.0},
        {"chosen_reward": 0.25, "rejected_reward": -0.5},
    ]
    report(api, job_id, token, [{**step(n, 0.69, total=33), **r} for n, r in enumerate(rewards, 1)])
    page.reload()
    expect(page.locator("#rewards-card")).to_be_visible()
    rewards_chart = page.locator("#rewards-chart")
    expect(rewards_chart.locator('path[data-series="chosen_reward"]')).to_have_attribute("data-count", "2")
    assert series(page, "rejected_reward", "rewards-chart") == [[1, 0.0], [2, -0.5]]
    expect(page.locator("#f-rewards")).to_have_text("chosen +0.25, rejected -0.5 (margin +0.75)")
    report(api, job_id, token, [{**step(3, 0.6, total=33), "chosen_reward": 0.5, "rejected_reward": -1.0}])
    evaluated = {"eval_chosen_reward": 0.375, "eval_rejected_reward": -0.75}
    report(api, job_id, token, [{"kind": "eval", "step": 3, "eval_loss": 0.6, **evaluated}])
    expect(rewards_chart.locator('path[data-series="chosen_reward"]')).to_have_attribute("data-count", "3")
    expect(rewards_chart.locator('path[data-series="eval_rejected_reward"]')).to_have_attribute(
        "data-count", "1"
    )
    assert series(page, "eval_chosen_reward", "rewards-chart") == [[3, 0.375]]
    expect(page.locator("#f-rewards")).to_have_text("chosen +0.5, rejected -1 (margin +1.5)")
    expect(page.locator("#f-eval-rewards")).to_have_text("chosen +0.375, rejected -0.75 (margin +1.125)")
    # A SimPO job (dpo with simpo_gamma) says so.
    method = {"type": "lora", "objective": "dpo", "simpo_gamma": 1.0, "dpo_beta": 2.0}
    simpo = create(api, dataset, "simpo", method=method)
    page.goto(f"{api.url}/ui/jobs/{simpo}")
    expect(page.locator("#f-method")).to_have_text("lora, simpo")


def test_job_page_shows_history_updates_live_and_cancels(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False)
    job_id, token = started(api, dataset, "stories-lora")
    losses = [[n, round(3.2 - 0.15 * n + (0.05 if n % 3 == 0 else 0.0), 4)] for n in range(1, 11)]
    report(api, job_id, token, [{"kind": "status", "message": "Compiling the model.", "phase": "compiling"}])
    report(api, job_id, token, [step(n, loss) for n, loss in losses[:5]])
    preempt(api, job_id)
    report(api, job_id, token, [step(n, loss) for n, loss in losses[5:]])
    report(
        api,
        job_id,
        token,
        [
            {
                "kind": "data",
                "documents": 3800,
                "tokens": 512_340,
                "target_tokens": 508_540,
                "rows": 7900,
                "row_tokens": 64,
                "pad_fraction": 0.0018,
                "steps_per_epoch": 987,
                "total_steps": 20,
                "validation_documents": 200,
                "validation_tokens": 27_000,
            },
            {"kind": "eval", "step": 5, "eval_loss": 2.61},
            {"kind": "eval", "step": 10, "eval_loss": 1.93, "eval_accuracy": 0.275},
            {
                "kind": "checkpoint",
                "step": 5,
                "uri": "/out/ckpt/5",
                "loss": 2.45,
                "eval_loss": 2.61,
                "accuracy": 0.15,
                "eval_accuracy": 0.125,
            },
            {"kind": "checkpoint", "step": 10, "uri": "/out/ckpt/10", "loss": 1.7},
            {
                "kind": "sample",
                "step": 0,
                "key": "0",
                "phase": "before",
                "prompt": "Once upon",
                "text": "zq zq",
            },
            {
                "kind": "sample",
                "step": 10,
                "key": "0",
                "phase": "after",
                "prompt": "Once upon",
                "text": "a time",
            },
            {"kind": "warning", "step": 7, "message": "Loss spiked at step 6."},
            {"kind": "status", "step": 10, "message": "Waiting for quota: 0 of 8 TPU chips free."},
        ],
    )

    tab = open_tab(api, f"/ui/jobs/{job_id}")
    page = tab.page
    chart = page.locator("#loss-chart")
    expect(chart.locator('path[data-series="loss"]')).to_have_attribute("data-count", "10")
    assert series(page, "loss") == losses
    assert series(page, "eval_loss") == [[5, 2.61], [10, 1.93]]
    expect(chart.locator("circle.marker")).to_have_count(2)
    # Token accuracy in a chart of its own, training and eval.
    expect(page.locator("#accuracy-card")).to_be_visible()
    expect(page.locator("#rewards-card")).to_be_hidden()  # (an sft job: no rewards)
    expect(page.locator("#rewards-fact")).to_be_hidden()
    expect(page.locator("#eval-rewards-fact")).to_be_hidden()
    expect(page.locator("#accuracy-heading")).to_have_text("Token accuracy")
    accuracy = page.locator("#accuracy-chart")
    expect(accuracy.locator('path[data-series="accuracy"]')).to_have_attribute("data-count", "10")
    assert series(page, "accuracy", "accuracy-chart") == [[n, pytest.approx(n * 0.03)] for n in range(1, 11)]
    assert series(page, "eval_accuracy", "accuracy-chart") == [[10, 0.275]]
    expect(page.locator("#status")).to_have_text("running")
    expect(page.locator("#status-message")).to_have_text("Waiting for quota: 0 of 8 TPU chips free.")
    expect(page.locator("#progress-text")).to_have_text("Step 10 of 20 (50%) · about 5m left")
    assert page.locator("#progress").get_attribute("value") == "0.5"
    expect(page.locator("#f-tps")).to_have_text("1,234")
    expect(page.locator("#f-accuracy")).to_have_text("30.0%")
    # What it was submitted with, defaults filled in, behind a disclosure.
    expect(page.locator("#f-spec")).to_be_hidden()
    page.locator("#spec summary").click()
    expect(page.locator("#f-spec")).to_contain_text('"lr_scheduler": "cosine"')
    with api.client() as http:
        assert json.loads(page.locator("#f-spec").inner_text()) == http.get(f"/jobs/{job_id}").json()["spec"]
    expect(page.locator("#f-eval-accuracy")).to_have_text("27.5%")
    expect(page.locator("#f-data")).to_have_text(
        "3,800 documents, 512,340 tokens in 7,900 rows of 64 (0.2% padding); 987 steps an epoch; "
        "validation 200 documents"
    )
    expect(page.locator('#events li[data-type="data"]')).to_contain_text("Data: 3,800 documents")
    expect(page.locator("#f-restarts")).to_have_text("0")
    expect(page.locator("#f-preemptions")).to_have_text("1")
    # Two hours from its launch to its preemption; and since its admission, a few seconds and counting.
    expect(page.locator("#f-chip-hours")).to_have_text(re.compile(r"^2(\.00\d*)? · 1 process for 2h$"))
    expect(page.locator("#job-error")).to_be_hidden()
    expect(page.locator("#signin")).to_be_hidden()
    sample = page.locator("#samples tbody tr")
    expect(sample).to_have_count(1)
    expect(sample.locator("th")).to_have_text("Once upon")
    expect(sample.locator(".before")).to_have_text("zq zq")
    expect(sample.locator(".after")).to_have_text("a time")
    checkpoints = page.locator("#checkpoints tbody tr")
    expect(checkpoints).to_have_count(2)
    expect(checkpoints.nth(0)).to_contain_text("/out/ckpt/5")
    expect(checkpoints.nth(0).locator("td")).to_have_text(
        ["5", "/out/ckpt/5", "2.45", "2.61", "15.0%", "12.5%", re.compile(".+")]
    )
    expect(checkpoints.nth(1)).to_contain_text("/out/ckpt/10")
    events = page.locator("#events li")
    expect(events.first).to_contain_text("Waiting for quota")
    expect(page.locator('#events li[data-type="warning"]')).to_contain_text("Loss spiked at step 6.")
    expect(page.locator('#events li[data-type="metrics"]')).to_have_count(0)
    expect(page.locator("#live")).to_have_text("● Live")

    # A worker's next reports reach the open page through the event stream within seconds.
    report(api, job_id, token, [step(11, 1.25)])
    expect(chart.locator('path[data-series="loss"]')).to_have_attribute("data-count", "11", timeout=5_000)
    assert series(page, "loss")[-1] == [11, 1.25]
    expect(accuracy.locator('path[data-series="accuracy"]')).to_have_attribute("data-count", "11")
    report(api, job_id, token, [{"kind": "eval", "step": 11, "eval_loss": 1.5, "eval_accuracy": 0.31}])
    expect(chart.locator("circle.marker")).to_have_count(3, timeout=5_000)
    expect(accuracy.locator("circle.marker")).to_have_count(2, timeout=5_000)
    report(api, job_id, token, [{"kind": "checkpoint", "step": 11, "uri": "/out/ckpt/11", "kept": [10, 11]}])
    expect(checkpoints).to_have_count(3, timeout=5_000)
    # (the one at step 5 removed, as the worker said: struck through)
    expect(page.locator("#checkpoints tbody tr.removed")).to_have_count(1)
    expect(page.locator("#checkpoints tbody tr.removed")).to_have_attribute("data-step", "5")
    expect(page.locator("#progress-text")).to_contain_text("Step 11 of 20", timeout=5_000)
    expect(page.locator("#f-accuracy")).to_have_text("33.0%")
    # A run that went on from its checkpoint at step 10 (a restart): the open page drops what the earlier
    # run reported past it, as the API did, and draws what the new run reports.
    resumed = {"kind": "status", "step": 10, "key": "loading-b-1", "phase": "loading", "resumed_from": 10}
    report(api, job_id, token, [{**resumed, "message": "resumed from the checkpoint at step 10"}])
    expect(chart.locator("circle.marker")).to_have_count(2, timeout=5_000)
    expect(chart.locator('path[data-series="loss"]')).to_have_attribute("data-count", "10")
    expect(accuracy.locator("circle.marker")).to_have_count(1)
    report(api, job_id, token, [step(11, 1.6)])
    expect(chart.locator('path[data-series="loss"]')).to_have_attribute("data-count", "11", timeout=5_000)
    assert series(page, "loss")[-1] == [11, 1.6]
    expect(page.locator("#f-exported")).to_have_text("—")
    # Its result (export_best): the weights of step 10, whose eval loss was the lowest, and their figures.
    result = {"kind": "result", "step": 11, "exported_step": 10, "output_uri": "/out/final", "loss": 1.7}
    report(api, job_id, token, [{**result, "eval_loss": 1.4, "accuracy": 0.3, "eval_accuracy": 0.35}])
    expect(page.locator("#f-exported")).to_have_text("step 10 (the lowest eval loss)", timeout=5_000)
    expect(page.locator("#f-eval-loss")).to_have_text("1.4")
    expect(page.locator('#events li[data-type="result"]')).to_contain_text("Exported the weights of step 10")
    screenshot(page, "job")

    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#cancel").click()
    expect(page.locator("#status")).to_have_text("cancelling")
    expect(page.locator("#cancel")).to_be_disabled()
    with api.client() as http:
        assert http.get(f"/jobs/{job_id}").json()["status"] == "cancelling"
    tab.assert_clean()


def test_cancel_refused_shows_the_api_sentence(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False)
    job_id = create(api, dataset, "finishes-first")
    tab = open_tab(api, f"/ui/jobs/{job_id}")
    page = tab.page
    # Keep the page from hearing that the job ends, as if it ended a moment before the click.
    page.route("**/events?follow=true*", lambda route: route.abort())
    page.reload()
    expect(page.locator("#status")).to_have_text("queued")
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#cancel").click()
    expect(page.locator("#cancel-error")).to_have_text(
        f"Job {job_id} already cancelled; only unfinished jobs can be cancelled."
    )
    expect(page.locator("#status")).to_have_text("cancelled")
    expect(page.locator("#cancel")).to_be_disabled()


def test_fresh_queued_job_renders_and_cancels(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False)
    ahead = create(api, dataset, "ahead")
    job_id = create(api, dataset, "fresh")
    tab = open_tab(api, f"/ui/jobs/{job_id}")
    page = tab.page
    expect(page.locator("#status")).to_have_text("queued")
    expect(page.locator("#status-message")).to_have_text("Waiting for the dispatcher to start it.")
    expect(page.locator("#queue-place")).to_have_text("2nd in the queue")
    expect(page.locator("#loss-chart text.empty")).to_have_text("No metrics yet")
    assert series(page, "loss") == [] and series(page, "eval_loss") == []
    expect(page.locator("#accuracy-card")).to_be_hidden()  # (none yet)
    expect(page.locator("#progress-text")).to_have_text("Step 0")
    for field in ("#f-loss", "#f-eval-loss", "#f-accuracy", "#f-eval-accuracy", "#f-tps", "#f-exported"):
        expect(page.locator(field)).to_have_text("—")
    for field in ("#f-started", "#f-finished"):
        expect(page.locator(field)).to_have_text("—")
    expect(page.locator("#samples-empty")).to_be_visible()
    expect(page.locator("#checkpoints-empty")).to_be_visible()
    expect(page.locator("#events li")).to_have_count(1)
    # The job ahead leaves the queue (no event of this job's): the page reads its place again.
    with api.client() as http:
        assert http.post(f"/jobs/{ahead}/cancel").status_code == 200
    expect(page.locator("#queue-place")).to_have_text("1st in the queue", timeout=10_000)

    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#cancel").click()
    expect(page.locator("#status")).to_have_text("cancelled")
    expect(page.locator("#queue-place")).to_have_text("")
    expect(page.locator("#cancel")).to_be_disabled()
    expect(page.locator("#live")).to_have_text("Job finished; no more updates.")
    expect(page.locator("#events li").first).to_contain_text("Cancelled before it started.")
    tab.assert_clean()


def test_an_ended_job_is_deleted_from_its_page(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    """Delete is offered once the job ended; asked first (saying where its outputs stay), then back to the
    jobs list, without it."""
    api = live_api(dispatcher_enabled=False)
    kept = create(api, dataset, "kept")
    job_id = create(api, dataset, "goes")
    tab = open_tab(api, f"/ui/jobs/{job_id}")
    page = tab.page
    expect(page.locator("#status")).to_have_text("queued")
    expect(page.locator("#delete")).to_be_disabled()
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelled"
        output = http.get(f"/jobs/{job_id}").json()["output_uri"]
    expect(page.locator("#status")).to_have_text("cancelled")
    expect(page.locator("#delete")).to_be_enabled()
    asked: list[str] = []

    def answer(dialog: Any) -> None:
        asked.append(dialog.message)
        if len(asked) == 1:
            dialog.dismiss()  # (the first time: not deleted)
        else:
            dialog.accept()

    page.on("dialog", answer)
    page.locator("#delete").click()
    with api.client() as http:
        assert http.get(f"/jobs/{job_id}").status_code == 200
    page.locator("#delete").click()
    expect(page).to_have_url(api.url + "/ui/")
    expect(page.locator("#jobs tbody tr")).to_have_count(1)
    expect(page.locator("#jobs tbody tr").first).to_have_attribute("data-job-id", kept)
    assert asked[0] == asked[1] and asked[0].startswith("Delete job goes with its events and logs?")
    assert asked[0].endswith(f"Its outputs stay at {output}.")
    with api.client() as http:
        assert http.get(f"/jobs/{job_id}").status_code == 404
    tab.assert_clean()


def test_a_succeeded_job_shows_its_hugging_face_model(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False)
    ids = []
    for method in ({"type": "lora", "export_hf": True, "export_gguf": "q8_0"}, {"type": "full"}):
        with api.client() as http:
            body = {"name": "hf", "model": "tiny", "dataset_uri": str(dataset), "method": method}
            response = http.post("/jobs", json=body)
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
        engine = api.server.config.app.state.engine  # type: ignore[union-attr]
        with Session(engine) as session:
            job = session.exec(select(Job).where(Job.id == ids[-1])).one()
            for status in (JobStatus.starting, JobStatus.running, JobStatus.succeeded):
                transition(session, job, status)
            session.commit()
    with api.client() as http:
        final = http.get(f"/jobs/{ids[0]}").json()["exports"]["uri"]
    tab = open_tab(api, f"/ui/jobs/{ids[0]}")
    expect(tab.page.locator("#f-hf")).to_have_text(f"{final}/hf (adapter for PEFT: {final}/hf_adapter)")
    expect(tab.page.locator("#f-gguf")).to_have_text(f"{final}/model-q8_0.gguf")
    tab.page.goto(f"{api.url}/ui/jobs/{ids[1]}")
    expect(tab.page.locator("#status")).to_have_text("succeeded")
    expect(tab.page.locator("#f-hf")).to_have_text("—")
    expect(tab.page.locator("#f-gguf")).to_have_text("—")
    tab.assert_clean()


def test_pause_and_resume_buttons(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    """Pause is offered while the job may run, Resume while it is paused; Cancel until it ends."""
    api = live_api(dispatcher_enabled=False)
    job_id = create(api, dataset, "pauses")
    tab = open_tab(api, f"/ui/jobs/{job_id}")
    page = tab.page
    pause, resume, cancel = page.locator("#pause"), page.locator("#resume"), page.locator("#cancel")
    expect(page.locator("#status")).to_have_text("queued")
    expect(pause).to_be_enabled()
    expect(resume).to_be_disabled()
    expect(cancel).to_be_enabled()
    expect(page.locator("#f-pauses")).to_have_text("0")

    pause.click()
    expect(page.locator("#status")).to_have_text("paused")
    expect(page.locator("#status")).to_have_attribute("data-status", "paused")
    expect(pause).to_be_disabled()
    expect(resume).to_be_enabled()
    expect(cancel).to_be_enabled()  # (a paused job can still be cancelled)
    expect(page.locator("#f-pauses")).to_have_text("1")
    expect(page.locator("#status-message")).to_have_text(
        "Paused before it started; resume it to queue it again."
    )
    expect(page.locator("#events li").first).to_contain_text("Paused before it started")  # (live)
    expect(page.locator("#live")).to_have_text("● Live")  # (paused is not the end)
    with api.client() as http:
        assert http.get(f"/jobs/{job_id}").json()["status"] == "paused"
    screenshot(page, "paused")

    resume.click()
    expect(page.locator("#status")).to_have_text("queued")
    expect(pause).to_be_enabled()
    expect(resume).to_be_disabled()
    expect(page.locator("#f-pauses")).to_have_text("1")
    expect(page.locator("#events li").first).to_contain_text("Resumed")
    with api.client() as http:
        assert http.get(f"/jobs/{job_id}").json()["status"] == "queued"

    # Another client pauses it: the page hears so and offers Resume; then Cancel ends it.
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/pause").json()["status"] == "paused"
    expect(resume).to_be_enabled(timeout=5_000)
    expect(pause).to_be_disabled()
    page.once("dialog", lambda dialog: dialog.accept())
    cancel.click()
    expect(page.locator("#status")).to_have_text("cancelled")
    for button in (pause, resume, cancel):
        expect(button).to_be_disabled()
    expect(page.locator("#events li").first).to_contain_text("Cancelled while paused.")
    tab.assert_clean()


def test_a_failed_job_offers_resume(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    """A failed job's page offers Resume (it goes on from its last checkpoint); resumed, the job is queued,
    its error gone and its Retries 1."""
    api = live_api(dispatcher_enabled=False)
    job_id, token = started(api, dataset, "fails")
    report(api, job_id, token, [step(4, 2.5)])
    engine = api.server.config.app.state.engine  # type: ignore[union-attr]
    with Session(engine, expire_on_commit=False) as session:
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        message = "The worker exited with status 3."
        transition(session, job, JobStatus.failed, message, error_code="worker_failed", error_message=message)
    tab = open_tab(api, f"/ui/jobs/{job_id}")
    page = tab.page
    expect(page.locator("#status")).to_have_text("failed")
    expect(page.locator("#resume")).to_be_enabled()
    expect(page.locator("#pause")).to_be_disabled()
    expect(page.locator("#cancel")).to_be_disabled()
    expect(page.locator("#f-retries")).to_have_text("0")
    expect(page.locator("#job-error")).to_be_visible()
    expect(page.locator("#job-error-code")).to_have_text("worker_failed")
    expect(page.locator("#live")).to_have_text("Job finished; no more updates.")

    page.locator("#resume").click()
    expect(page.locator("#status")).to_have_text("queued")
    expect(page.locator("#resume")).to_be_disabled()
    expect(page.locator("#pause")).to_be_enabled()
    expect(page.locator("#f-retries")).to_have_text("1")
    expect(page.locator("#job-error")).to_be_hidden()
    expect(page.locator("#status-message")).to_have_text(
        "Resumed after it failed (worker_failed); queued, it goes on from the start (it saved no checkpoint)."
    )
    # Followed live again: its moves from here on show as they happen.
    expect(page.locator("#live")).to_have_text("● Live", timeout=10_000)
    expect(page.locator("#events li").first).to_contain_text("Resumed after it failed")
    with api.client() as http:
        assert http.post(f"/jobs/{job_id}/pause").json()["status"] == "paused"
    expect(page.locator("#status")).to_have_text("paused")
    expect(page.locator("#events li").first).to_contain_text("Paused before it started")
    tab.assert_clean()


def test_the_log_says_when_it_was_saved(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    """A job whose run's workers are gone (on GKE, its pods and their logs) shows the lines saved as the
    run ended, and says so; one with nothing saved says it has no lines yet."""
    api = live_api(dispatcher_enabled=False)
    job_id, _ = started(api, dataset, "fails")
    engine = api.server.config.app.state.engine  # type: ignore[union-attr]
    with Session(engine, expire_on_commit=False) as session:
        job = session.exec(select(Job).where(Job.id == job_id)).one()
        save_log(session, job, ["step 1", "Traceback: boom"], truncated=False)  # as the dispatcher does
        message = "The worker exited with status 1."
        transition(session, job, JobStatus.failed, message, error_code="worker_failed", error_message=message)
    tab = open_tab(api, f"/ui/jobs/{job_id}")
    tab.page.locator("#logs summary").click()
    expect(tab.page.locator("#log-lines")).to_have_text("step 1\nTraceback: boom")
    expect(tab.page.locator("#log-saved")).to_be_visible()
    expect(tab.page.locator("#log-saved")).to_contain_text("Saved as the last run ended")

    other, _ = started(api, dataset, "quiet")
    tab.page.goto(f"{api.url}/ui/jobs/{other}")
    tab.page.locator("#logs summary").click()
    expect(tab.page.locator("#log-lines")).to_have_text("No log lines yet.")
    expect(tab.page.locator("#log-saved")).to_be_hidden()
    tab.assert_clean()


def test_a_pausing_job_offers_only_cancel(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False)
    job_id, token = started(api, dataset, "launched")
    report(api, job_id, token, [step(4, 2.5)])
    tab = open_tab(api, f"/ui/jobs/{job_id}")
    page = tab.page
    expect(page.locator("#status")).to_have_text("running")
    expect(page.locator("#progress-text")).to_have_text("Step 4 of 20 (20%) · about 8m left")
    page.locator("#pause").click()
    expect(page.locator("#status")).to_have_text("pausing")  # (until its workers stopped)
    expect(page.locator("#progress-text")).to_have_text("Step 4 of 20 (20%)")  # (no time left: it stops)
    expect(page.locator("#pause")).to_be_disabled()
    expect(page.locator("#resume")).to_be_disabled()
    expect(page.locator("#cancel")).to_be_enabled()
    expect(page.locator("#events li").first).to_contain_text("Pause requested")
    with api.client() as http:
        assert http.get(f"/jobs/{job_id}").json()["status"] == "pausing"
    tab.assert_clean()


def test_refused_pause_and_resume_show_the_api_sentence(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False)
    paused, queued = create(api, dataset, "paused"), create(api, dataset, "queued")
    with api.client() as http:
        assert http.post(f"/jobs/{paused}/pause").json()["status"] == "paused"
    refusals = {
        "resume": "is cancelled; only a paused or failed job can be resumed.",
        "pause": "already cancelled; only queued, starting or running jobs can be paused.",
    }
    for job_id, button, shown in ((paused, "resume", "paused"), (queued, "pause", "queued")):
        tab = open_tab(api, f"/ui/jobs/{job_id}")
        page = tab.page
        # Keep the page from hearing that the job ends, as if it ended a moment before the click.
        page.route("**/events?follow=true*", lambda route: route.abort())
        page.reload()
        expect(page.locator("#status")).to_have_text(shown)
        with api.client() as http:
            assert http.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelled"
        page.locator(f"#{button}").click()
        expect(page.locator("#action-error")).to_have_text(f"Job {job_id} {refusals[button]}")
        expect(page.locator("#status")).to_have_text("cancelled")
        for name in ("pause", "resume", "cancel"):
            expect(page.locator(f"#{name}")).to_be_disabled()


def test_unknown_job_shows_the_api_sentence(
    live_api: Callable[..., LiveApi], open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False)
    page = open_tab(api, "/ui/jobs/ft-missing").page
    expect(page.locator("#load-error")).to_have_text(
        "No job with id 'ft-missing'. List your jobs with GET /jobs."
    )


def test_thousands_of_points_are_kept_and_drawn_downsampled(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False)
    job_id, token = started(api, dataset, "long")
    total = 5000
    losses = {n: 3.0 - n / total for n in range(1, total + 1)}
    losses[2500] = 50.0  # one spike, which downsampling must not drop
    for first in range(1, total + 1, 1000):
        report(api, job_id, token, [step(n, losses[n], total) for n in range(first, first + 1000)])
    failure = "The loss became NaN at step 5000; lower the learning rate."
    report(api, job_id, token, [{"kind": "error", "step": total, "code": "nan_loss", "message": failure}])

    tab = open_tab(api, f"/ui/jobs/{job_id}")
    path = tab.page.locator('#loss-chart path[data-series="loss"]')
    expect(path).to_have_attribute("data-count", str(total))
    assert series(tab.page, "loss") == [[n, loss] for n, loss in losses.items()]
    drawn = [float(y) for y in re.findall(r"[ML][\d.]+,([\d.]+)", path.get_attribute("d") or "")]
    assert 100 < len(drawn) < total / 2
    assert min(drawn) < 40  # the spike reaches the top of the plot (y grows downwards)
    expect(tab.page.locator("#job-error")).to_have_text(f"nan_loss {failure}")
    expect(tab.page.locator('#events li[data-type="error"]')).to_contain_text(failure)
    screenshot(tab.page, "long")
    tab.assert_clean()


def test_jobs_list_filters_links_and_refreshes(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False)
    queued = create(api, dataset, "waiting")
    running, token = started(api, dataset, "training")
    report(api, running, token, [step(5, 2.3456)])
    cancelled = create(api, dataset, "stopped")
    with api.client() as http:
        http.post(f"/jobs/{cancelled}/cancel")

    tab = open_tab(api, "/")
    page = tab.page
    expect(page).to_have_url(api.url + "/ui/")
    rows = page.locator("#jobs tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.nth(0)).to_have_attribute("data-job-id", cancelled)
    row = page.locator(f'tr[data-job-id="{running}"]')
    expect(row.locator(".badge")).to_have_text("running")
    expect(row).to_contain_text("tiny")
    expect(row).to_contain_text("25%")
    expect(row.locator("td.num")).to_have_text("2.346")
    screenshot(page, "jobs")

    page.locator("#status-filter").select_option("running")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-job-id", running)
    expect(page).to_have_url(api.url + "/ui/?status=running")
    page.locator("#status-filter").select_option("queued")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-job-id", queued)
    page.locator("#status-filter").select_option("")
    expect(rows).to_have_count(3)
    with api.client() as http:
        assert http.post(f"/jobs/{queued}/pause").json()["status"] == "paused"
        assert http.post(f"/jobs/{running}/pause").json()["status"] == "pausing"
    for status, job_id in (("paused", queued), ("pausing", running)):
        page.locator("#status-filter").select_option(status)
        expect(rows).to_have_count(1)
        expect(rows.first).to_have_attribute("data-job-id", job_id)
        expect(rows.first.locator(".badge")).to_have_attribute("data-status", status)
    page.locator("#status-filter").select_option("")
    expect(rows).to_have_count(3)

    newer = create(api, dataset, "newer")
    expect(rows).to_have_count(4, timeout=10_000)
    expect(rows.first).to_have_attribute("data-job-id", newer)

    page.get_by_role("link", name="training").click()
    expect(page).to_have_url(f"{api.url}/ui/jobs/{running}")
    expect(page.locator("#job-name")).to_have_text("training")
    tab.assert_clean()


def test_sign_in_when_keys_are_required(
    live_api: Callable[..., LiveApi], open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN)
    page = open_tab(api, "/ui/").page
    form = page.locator("#signin")
    expect(form).to_be_visible()
    page.get_by_label("API key").fill("tpt_wrong")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#signin-error")).to_have_text(
        "This API key is unknown or revoked; ask your admin for a new one."
    )
    page.get_by_label("API key").fill(ADMIN)
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#empty")).to_be_visible()
    expect(form).to_be_hidden()
    assert httpx.get(api.url + "/jobs").status_code == 401  # the key lives in this browser's cookie only
    expect(page.locator("#session")).to_have_text(
        "Signed in as the admin: every tenant's jobs. API keys Teams Sign out"
    )
    page.get_by_role("button", name="Sign out").click()
    expect(form).to_be_visible()  # the cookie is gone: the next call asks for a key again
    expect(page.locator("#session")).to_have_count(0)
    assert not [c for c in page.context.cookies() if c["name"] == COOKIE_NAME]


def test_the_admin_sees_whose_each_job_is_and_a_tenant_only_its_own(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN)
    api.headers = {"Authorization": f"Bearer {ADMIN}"}
    ids, keys = {}, {}
    for tenant in ("alpha", "beta"):
        with api.client() as http:
            keys[tenant] = http.post("/admin/keys", json={"tenant": tenant, "name": "browser"}).json()["key"]
        api.headers = {"Authorization": f"Bearer {keys[tenant]}"}
        ids[tenant] = create(api, dataset, f"{tenant} job")
        api.headers = {"Authorization": f"Bearer {ADMIN}"}

    page = sign_in(open_tab(api, "/ui/").page, ADMIN)
    rows = page.locator("#jobs tbody tr")
    expect(rows).to_have_count(2)
    for tenant, job_id in ids.items():
        expect(page.locator(f'tr[data-job-id="{job_id}"] small')).to_have_text(f"{job_id} · {tenant}")
    page.get_by_role("link", name="beta job").click()
    expect(page.locator("#f-tenant")).to_have_text("beta")

    page = sign_in(open_tab(api, "/ui/").page, keys["alpha"])
    expect(page.locator("#session")).to_have_text("Signed in to tenant alpha. Sign out")
    expect(rows := page.locator("#jobs tbody tr")).to_have_count(1)
    expect(rows.first.locator("small")).to_have_text(ids["alpha"])  # (one tenant: no need to say whose)


def test_a_read_only_key_is_offered_nothing_that_changes_something(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN)
    api.headers = {"Authorization": f"Bearer {ADMIN}"}
    with api.client() as http:
        writer = http.post("/admin/keys", json={"tenant": "alpha", "name": "alice"}).json()["key"]
        body = {"tenant": "alpha", "name": "grafana", "read_only": True}
        reader = http.post("/admin/keys", json=body).json()["key"]
    api.headers = {"Authorization": f"Bearer {writer}"}
    job_id = create(api, dataset, "alpha job")
    with api.client() as http:
        assert http.post("/webhooks", json={"url": "https://ci.example.com/h"}).status_code == 201

    for key, read_only in ((writer, False), (reader, True)):
        page = sign_in(open_tab(api, f"/ui/jobs/{job_id}").page, key)
        expect(page.locator("#status")).to_have_text("queued")
        session = (
            "Signed in to tenant alpha, read-only. Sign out"
            if read_only
            else "Signed in to tenant alpha. Sign out"
        )
        expect(page.locator("#session")).to_have_text(session)
        cancel = page.get_by_role("button", name="Cancel job")
        expect(cancel).to_be_hidden() if read_only else expect(cancel).to_be_visible()
        page.goto(f"{api.url}/ui/webhooks")
        expect(page.locator("#webhooks tbody tr")).to_have_count(1)
        for control in (
            page.get_by_role("button", name="Add endpoint"),
            page.get_by_role("button", name="Delete"),
        ):
            expect(control).to_be_hidden() if read_only else expect(control).to_be_visible()
        expect(page.get_by_role("button", name="Deliveries")).to_be_visible()  # (a read)


def test_a_key_that_expires_within_a_week_is_pointed_out(
    live_api: Callable[..., LiveApi], open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN)
    keys = {}
    with api.client() as http:
        for days in (3, 30):
            body = {"tenant": "alpha", "name": f"{days} days", "expires_in_days": days}
            created = http.post("/admin/keys", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
            keys[days] = created.json()

    page = sign_in(open_tab(api, "/ui/").page, keys[3]["key"])
    expect(page.locator("#empty")).to_be_visible()
    said = datetime.fromisoformat(keys[3]["expires_at"]).strftime("%Y-%m-%d %H:%M:%S UTC")
    expect(page.locator("#key-expiry")).to_have_text(
        f"This API key expires at {said} (in 2 days): ask your admin to rotate it."
    )
    page = sign_in(open_tab(api, "/ui/").page, keys[30]["key"])
    expect(page.locator("#empty")).to_be_visible()
    expect(page.locator("#session")).to_be_visible()
    expect(page.locator("#key-expiry")).to_have_count(0)


def test_the_keys_page_creates_rotates_and_revokes(
    live_api: Callable[..., LiveApi], open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN)
    tab = open_tab(api, "/ui/")
    page = tab.page
    page.get_by_label("API key").fill(ADMIN)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("link", name="API keys").click()
    expect(page).to_have_url(f"{api.url}/ui/keys")
    rows = page.locator("#keys tbody tr")
    expect(rows).to_have_count(0)
    tab.errors.clear()  # (the jobs page's 401 before signing in)

    page.get_by_label("Tenant", exact=True).fill("alpha")
    page.get_by_label("Name", exact=True).fill("ci")
    page.get_by_label("Expires in days").fill("30")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#secret-key")
    expect(secret).to_have_text(re.compile(r"^tpt_[a-z0-9]{10}_"))
    first = secret.inner_text()
    with api.client() as http:  # the key shown works, and is alpha's
        assert http.get("/jobs", headers={"Authorization": f"Bearer {first}"}).status_code == 200
        listed = http.get("/admin/keys", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
    assert [(k["tenant"], k["name"], k["admin"]) for k in listed] == [("alpha", "ci", False)]
    old_id = listed[0]["id"]
    expect(rows).to_have_count(1)
    expect(rows.first.locator("td").nth(2)).to_have_text("member")
    expect(rows.first.locator(".state")).to_have_text(re.compile(r"^expires \d{4}-\d\d-\d\d \d\d:\d\d$"))
    expect(page.get_by_label("Tenant", exact=True)).to_have_value("")  # (the form is cleared)

    page.once("dialog", lambda dialog: dialog.accept("0"))  # no grace: the old key stops now
    page.get_by_role("button", name=f"Rotate {old_id}").click()
    expect(page.locator("#secret-what")).to_contain_text(f"replacing {old_id}")
    expect(secret).not_to_have_text(first)
    second = secret.inner_text()
    expect(rows).to_have_count(2)
    expect(page.locator(f'tr[data-key-id="{old_id}"] .state')).to_have_text(re.compile(r"^expired "))
    with api.client() as http:
        assert http.get("/jobs", headers={"Authorization": f"Bearer {first}"}).status_code == 401
        assert http.get("/jobs", headers={"Authorization": f"Bearer {second}"}).status_code == 200
    new_id = page.locator("#keys tbody tr").nth(1).get_attribute("data-key-id")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name=f"Revoke {new_id}").click()
    expect(page.locator(f'tr[data-key-id="{new_id}"] .state')).to_have_text(re.compile(r"^revoked "))
    expect(page.get_by_role("button", name=f"Revoke {new_id}")).to_have_count(0)
    page.get_by_label("Tenant", exact=True).fill("alpha")
    page.get_by_label("Name", exact=True).fill("grafana")
    page.get_by_label("Read-only").check()
    page.get_by_role("button", name="Create key").click()
    expect(page.locator("#secret-what")).to_contain_text("New read-only key")
    expect(rows).to_have_count(3)
    expect(rows.last.locator("td").nth(2)).to_have_text("reader")
    tab.assert_clean()

    # A member key gets the API's sentence, and no keys.
    member = open_tab(api, "/ui/keys").page
    member.get_by_label("API key").fill(first)  # (expired: refused at sign-in)
    member.get_by_role("button", name="Sign in").click()
    expect(member.locator("#signin-error")).to_contain_text("expired")
    with api.client() as http:
        body = {"tenant": "beta", "name": "member"}
        beta = http.post("/admin/keys", json=body, headers={"Authorization": f"Bearer {ADMIN}"}).json()["key"]
    member.get_by_label("API key").fill(beta)
    member.get_by_role("button", name="Sign in").click()
    expect(member.locator("#keys-error")).to_have_text(
        "Only an admin key (TPUTUNE_ADMIN_KEY, or one created as admin) may manage API keys."
    )
    expect(member.locator("#keys tbody tr")).to_have_count(0)


def test_the_teams_page_sets_limits_and_a_team_sees_its_own(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(
        dispatcher_enabled=False,
        admin_key=ADMIN,
        tenant_max_active_chips=8,
        tenant_budget_pauses_running=True,
    )
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with api.client() as http:
        member = http.post("/admin/keys", json={"tenant": "alpha", "name": "b"}, headers=admin).json()["key"]
    api.headers = {"Authorization": f"Bearer {member}"}
    job_id = create(api, dataset, "alpha job")
    engine = create_engine(api.settings.resolved_database_url)  # (as if it had run for 90 minutes)
    with engine.begin() as connection:
        started = datetime.now(UTC) - timedelta(minutes=90)
        connection.execute(
            update(Job).where(col(Job.id) == job_id).values(started_at=started, admitted_at=started)
        )
        seq = connection.execute(select(Job.seq).where(col(Job.id) == job_id)).scalar_one()
        moved = {"status": "running", "from": "starting"}
        connection.execute(
            insert(JobEvent).values(job_seq=seq, created_at=started, type="status", data=moved)
        )
    engine.dispose()

    tab = open_tab(api, "/ui/")
    page = sign_in(tab.page, ADMIN)
    page.get_by_role("link", name="Teams").click()
    expect(page).to_have_url(f"{api.url}/ui/tenants")
    tab.errors.clear()  # (the jobs page's 401 before signing in)
    alpha = page.locator('tr[data-tenant="alpha"]')
    expect(alpha.locator(".jobs")).to_have_text("0")  # (no limit on jobs)
    expect(alpha.locator(".chips")).to_have_text("0 of 8 (server)")
    expect(alpha.locator(".queued")).to_have_text("1")
    expect(alpha.locator(".spent")).to_have_text("1.5")  # (chip-hours in 30 days: 1 process, 90 min)

    page.get_by_label("Tenant", exact=True).fill("alpha")
    page.get_by_label("Jobs active at once").fill("1")
    page.get_by_role("button", name="Save limits").click()
    expect(alpha.locator(".jobs")).to_have_text("0 of 1")
    expect(alpha.locator("td").nth(7)).to_contain_text("the admin")
    expect(alpha.locator(".data")).to_have_text("anywhere")
    expect(page.get_by_label("Tenant", exact=True)).to_have_value("")  # (the form is cleared)
    page.get_by_role("button", name="Edit alpha").click()  # (the form holds its own limits)
    expect(page.get_by_label("Tenant", exact=True)).to_have_value("alpha")
    expect(page.get_by_label("Jobs active at once")).to_have_value("1")
    expect(page.get_by_label("TPU chips its jobs may hold")).to_have_value("")
    page.get_by_label("TPU chips its jobs may hold").fill("2")
    page.get_by_label("Jobs queued at once").fill("1")
    page.get_by_label("Chip-hours its jobs may hold in a calendar month").fill("100")
    page.get_by_role("button", name="Save limits").click()
    expect(alpha.locator(".chips")).to_have_text("0 of 2")
    expect(alpha.locator(".queued")).to_have_text("1 of 1")
    expect(alpha.locator(".month")).to_have_text(re.compile(r"^[0-9.]+ of 100$"))  # (this month's, of it)
    with api.client() as http:
        own = http.get("/admin/tenants/alpha", headers=admin).json()["own_limits"]
    assert own == {
        "max_active_jobs": 1,
        "max_active_chips": 2,
        "max_queued_jobs": 1,
        "max_chip_hours_per_month": 100,
    }
    # `unlimited`: none for the team, whatever the server's; the form shows it as it is set.
    page.get_by_role("button", name="Edit alpha").click()
    page.get_by_label("TPU chips its jobs may hold").fill("unlimited")
    page.get_by_role("button", name="Save limits").click()
    expect(alpha.locator(".chips")).to_have_text("0 (unlimited)")
    page.get_by_role("button", name="Edit alpha").click()
    expect(page.get_by_label("TPU chips its jobs may hold")).to_have_value("unlimited")
    page.get_by_label("TPU chips its jobs may hold").fill("2")
    page.get_by_role("button", name="Save limits").click()
    expect(alpha.locator(".chips")).to_have_text("0 of 2")
    # Where its jobs may read and write: prefixes one a line, `any`, or empty for the server's.
    where = page.get_by_label("Where its jobs may read and write")
    page.get_by_role("button", name="Edit alpha").click()
    where.fill(f"gs://ml-data/teams/{{tenant}}/\n{dataset.parent}")
    page.get_by_role("button", name="Save limits").click()
    expect(alpha.locator(".data")).to_have_text(f"gs://ml-data/teams/alpha, {dataset.parent}")
    expect(alpha.locator(".chips")).to_have_text("0 of 2")  # (the limits stay)
    page.get_by_role("button", name="Edit alpha").click()
    expect(where).to_have_value(f"gs://ml-data/teams/{{tenant}}\n{dataset.parent}")
    where.fill("gs://b/x")  # (not a bucket name: the API's sentence)
    page.get_by_role("button", name="Save limits").click()
    expect(page.locator("#tenants-error")).to_contain_text("is not a Cloud Storage bucket name")
    tab.errors.clear()  # (the 422)
    where.fill("any")
    page.get_by_role("button", name="Save limits").click()
    expect(alpha.locator(".data")).to_have_text("anywhere")
    page.get_by_role("button", name="Edit alpha").click()
    expect(where).to_have_value("any")
    where.fill("")
    page.get_by_role("button", name="Save limits").click()
    expect(alpha.locator(".data")).to_have_text("anywhere")  # (the server's: none)
    with api.client() as http:
        assert http.get("/admin/tenants/alpha", headers=admin).json()["own_data_prefixes"] is None
    page.get_by_label("Tenant", exact=True).fill("beta")
    page.get_by_label("Jobs active at once").fill("-1")  # (the browser's own check: min 0)
    page.get_by_role("button", name="Save limits").click()
    expect(page.locator('tr[data-tenant="beta"]')).to_have_count(0)
    tab.assert_clean()

    # The team sees its limits over its jobs; a member key gets the API's sentence on the teams page.
    team = sign_in(open_tab(api, "/ui/").page, member)
    expect(team.locator("#quota")).to_have_text(
        re.compile(
            r"^Your team \(alpha\): 0 of 1 jobs active · 0 of 2 processes held · 1 of 1 queued · "
            r"[0-9] of 100 chip-hours this month \(running jobs pause at it\)\. Over a limit, jobs wait "
            r"queued\. The queue is full: new jobs are refused until some start\.$"
        )
    )
    team.goto(f"{api.url}/ui/tenants")
    expect(team.locator("#tenants-error")).to_have_text(
        "Only an admin key (TPUTUNE_ADMIN_KEY, or one created as admin) may set tenants' limits."
    )


def test_the_teams_page_asks_for_the_usage_report_once_a_minute(
    live_api: Callable[..., LiveApi], open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    """The teams' limits every 5 s; what they ran in 30 days (which reads every job of the window) once a
    minute. The page's clock is the test's."""
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN)
    with api.client() as http:
        changed = http.patch(
            "/admin/tenants/alpha", json={"max_active_jobs": 2}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert changed.status_code == 200
    tab = open_tab(api, "/ui/")
    page = sign_in(tab.page, ADMIN)
    expect(page.locator("#jobs")).to_be_visible()
    tab.errors.clear()  # (the jobs page's 401 before signing in)
    asked: list[str] = []
    page.on("request", lambda request: asked.append(urlsplit(request.url).path))
    page.clock.install()
    page.goto(f"{api.url}/ui/tenants")
    expect(page.locator('tr[data-tenant="alpha"] .jobs')).to_have_text("0 of 2")
    page.clock.pause_at(page.evaluate("Date.now()") / 1000 + 1)  # (s; from now on time moves when told)
    ticks = 0
    for ticks in range(1, 14):  # 5 s each
        with page.expect_response(lambda response: urlsplit(response.url).path == "/admin/tenants"):
            page.clock.run_for(5_000)
        if ticks == 11:  # 55 s: the limits read 12 times, the report once
            assert (asked.count("/admin/tenants"), asked.count("/usage")) == (12, 1)
        if asked.count("/usage") == 2:
            break
    assert ticks in (12, 13), ticks  # (the first tick a minute or more after the first report)
    tab.assert_clean()


def test_a_refused_stream_is_followed_again(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    """The browser gives up on a stream answered 429 (or 503, or a restarting server): the page follows
    again from the last event it saw, and shows what it waits for meanwhile."""
    api = live_api(dispatcher_enabled=False, max_event_followers=1)
    job_id, token = started(api, dataset, "resumes")
    report(api, job_id, token, [{"kind": "checkpoint", "step": 1, "uri": "/out/ckpt/1"}])
    with httpx.stream(  # the server's only place, taken
        "GET", f"{api.url}/jobs/{job_id}/events", params={"follow": "true"}, timeout=10
    ) as held:
        assert held.status_code == 200
        page = open_tab(api, f"/ui/jobs/{job_id}").page
        expect(page.locator("#live")).to_have_text(re.compile(r"^Disconnected; following again in \d+ s\.$"))
        expect(page.locator("#checkpoints tbody tr")).to_have_count(1)  # (read from the paged routes)
    expect(page.locator("#live")).to_have_text("● Live", timeout=20_000)
    report(api, job_id, token, [{"kind": "checkpoint", "step": 2, "uri": "/out/ckpt/2"}])
    expect(page.locator("#checkpoints tbody tr")).to_have_count(2)
    expect(page.locator('#events li[data-type="checkpoint"]')).to_have_count(2)  # (the first not twice)


def test_a_revoked_keys_stream_stops_and_asks_to_sign_in(
    live_api: Callable[..., LiveApi], dataset: Path, open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN)
    api.headers = {"Authorization": f"Bearer {ADMIN}"}
    job_id = create(api, dataset, "revoked")
    with api.client() as http:
        created = http.post("/admin/keys", json={"tenant": DEFAULT_TENANT, "name": "browser"}).json()
    page = open_tab(api, f"/ui/jobs/{job_id}").page
    page.get_by_label("API key").fill(created["key"])
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#live")).to_have_text("● Live")
    with api.client() as http:
        assert http.delete(f"/admin/keys/{created['id']}").status_code == 200
    expect(page.locator("#live")).to_have_text(
        "Live updates stopped: The API key of this stream was revoked or has expired; sign in with a new one."
    )
    expect(page.locator("#signin")).to_be_visible()


def test_a_pages_form_is_sent_only_once_its_script_is_ready(
    live_api: Callable[..., LiveApi], browser: Browser
) -> None:
    """The keys, teams, webhooks and audit pages' forms are sent by their scripts. Until a page's script has
    run (a slow machine) its submit button is disabled: clicked before, the browser sent the form itself, as
    a GET of the page with the fields in its URL, and nothing said so (CI once clicked "Add endpoint" first,
    and waited for an error that never showed)."""
    api = live_api(dispatcher_enabled=False)
    scriptless, scripted = browser.new_context(java_script_enabled=False), browser.new_context()
    try:
        for path, name in (
            ("/ui/keys", "Create key"),
            ("/ui/tenants", "Save limits"),
            ("/ui/webhooks", "Add endpoint"),
            ("/ui/audit", "Show"),
        ):
            page = scriptless.new_page()
            page.goto(api.url + path)
            expect(page.get_by_role("button", name=name)).to_be_disabled()
            page = scripted.new_page()
            page.goto(api.url + path)
            expect(page.get_by_role("button", name=name)).to_be_enabled()
    finally:
        scriptless.close()
        scripted.close()


def test_the_webhooks_page_adds_tests_disables_resends_and_deletes_an_endpoint(
    live_api: Callable[..., LiveApi], open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    from tests.test_webhooks import OPEN, Receiver, verify

    receiver = Receiver()
    try:
        api = live_api(dispatcher_process=False, **OPEN)
        tab = open_tab(api, "/ui/")
        page = tab.page
        page.get_by_role("link", name="Webhooks").click()
        expect(page).to_have_url(f"{api.url}/ui/webhooks")
        rows = page.locator("#webhooks tbody tr")
        expect(rows).to_have_count(0)

        page.get_by_label("URL").fill("ftp://ci.example.com/hook")
        page.get_by_role("button", name="Add endpoint").click()
        expect(page.locator("#webhooks-error")).to_have_text(
            "The webhook URL must be an https:// URL with a host, e.g. https://example.com/hook."
        )
        tab.errors.clear()  # (the browser's line for that 422)
        page.get_by_label("URL").fill(receiver.url)
        page.get_by_label("job.running").check()
        page.get_by_label("job.cancelled").uncheck()
        page.get_by_label("Description").fill("CI")
        page.get_by_role("button", name="Add endpoint").click()
        secret = page.locator("#secret-key")
        expect(secret).to_have_text(re.compile(r"^whsec_"))
        expect(page.locator("#webhooks-error")).to_be_hidden()
        expect(rows).to_have_count(1)
        hook_id = rows.first.get_attribute("data-webhook-id")
        expect(rows.first.locator("td").nth(2)).to_have_text("job.running, job.succeeded, job.failed")
        expect(rows.first.locator("td").nth(3)).to_have_text("enabled")
        expect(page.get_by_label("URL")).to_have_value("")  # (the form is cleared)

        page.get_by_role("button", name=f"Send a test event to {hook_id}").click()
        delivered = page.locator("#deliveries tbody tr")
        expect(delivered).to_have_count(1)
        expect(delivered.first.locator("td").nth(3)).to_have_text("delivered", timeout=15_000)  # (re-read)
        expect(delivered.first.locator("td").nth(5)).to_have_text("HTTP 200")
        screenshot(page, "webhooks")
        [ping] = receiver.wait(1)
        assert ping["type"] == "webhook.test" and verify(secret.inner_text(), receiver.requests[0])

        # Disabled and enabled again; the delivered test sent again (the same message).
        page.get_by_role("button", name=f"Disable {hook_id}").click()
        expect(rows.first.locator("td").nth(3)).to_have_text(
            f"disabled Disabled; enable it with PATCH /webhooks/{hook_id}.", use_inner_text=True
        )
        page.get_by_role("button", name=f"Enable {hook_id}").click()
        expect(rows.first.locator("td").nth(3)).to_have_text("enabled")
        delivery_id = delivered.first.get_attribute("data-delivery-id")
        page.get_by_role("button", name=f"Send delivery {delivery_id} again").click()
        assert receiver.wait(2)[1] == ping
        expect(delivered.first.locator("td").nth(3)).to_have_text("delivered", timeout=15_000)
        first_secret = secret.inner_text()
        page.once("dialog", lambda dialog: dialog.accept())
        page.get_by_role("button", name=f"New signing secret for {hook_id}").click()
        expect(page.locator("#secret-what")).to_contain_text(f"Endpoint {hook_id} has a new secret")
        expect(secret).not_to_have_text(first_secret)
        expect(secret).to_have_text(re.compile(r"^whsec_"))

        page.once("dialog", lambda dialog: dialog.accept())
        page.get_by_role("button", name=f"Delete {hook_id}").click()
        expect(rows).to_have_count(0)
        expect(page.locator("#deliveries-card")).to_be_hidden()
        tab.assert_clean()
    finally:
        receiver.close()


def test_the_audit_page_shows_who_changed_what_filters_and_pages(
    live_api: Callable[..., LiveApi], open_tab: Callable[[LiveApi, str], Tab]
) -> None:
    api = live_api(dispatcher_enabled=False, admin_key=ADMIN)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with api.client() as http:
        research = http.post("/admin/keys", json={"tenant": "research", "name": "ci"}, headers=admin).json()
        for value in range(1, 56):  # more than a page (50)
            answer = http.patch("/admin/tenants/vision", json={"max_queued_jobs": value}, headers=admin)
            assert answer.status_code == 200
        http.patch("/admin/tenants/research", json={"max_active_jobs": "unlimited"}, headers=admin)
    tab = open_tab(api, "/ui/")
    page = sign_in(tab.page, ADMIN)
    page.get_by_role("link", name="Audit log").click()
    expect(page).to_have_url(f"{api.url}/ui/audit")
    tab.errors.clear()  # (the jobs page's 401 before signing in)
    rows = page.locator("#audit tbody tr")
    expect(rows).to_have_count(50)
    newest = rows.first.locator("td")
    expect(newest.nth(1)).to_have_text("tenant.updated")
    expect(newest.nth(2)).to_have_text("research")
    expect(newest.nth(4)).to_have_text("the admin (default)")
    expect(newest.nth(5)).to_have_text('max_active_jobs: null → "unlimited"')
    page.get_by_role("button", name="Older").click()
    expect(rows).to_have_count(57)
    expect(page.get_by_role("button", name="Older")).to_be_hidden()
    oldest = rows.last.locator("td")
    expect(oldest.nth(1)).to_have_text("key.created")
    expect(oldest.nth(3)).to_have_text(research["id"])
    expect(oldest.nth(5)).to_contain_text('prefix: "tpt_')

    page.get_by_label("Team").fill("research")
    page.get_by_role("button", name="Show").click()
    expect(rows).to_have_count(2)
    page.get_by_label("Action").select_option("key.created")
    page.get_by_role("button", name="Show").click()
    expect(rows).to_have_count(1)
    screenshot(page, "audit")
    tab.assert_clean()

    # A team's key sees its own team's, and the API's sentence for another's.
    member = sign_in(open_tab(api, "/ui/audit").page, research["key"])
    expect(member.locator("#audit tbody tr")).to_have_count(2)
    member.get_by_label("Team").fill("vision")
    member.get_by_role("button", name="Show").click()
    expect(member.locator("#audit-error")).to_contain_text(
        "Only an admin key sees another tenant's audit events"
    )
