"""The web dashboard: static pages under /ui/ that read the JSON API from the browser (no CDN, no build)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse
from starlette.exceptions import HTTPException

# Inside the `api` package, so the wheel ships it with the code.
STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

# Everything the pages load comes from this origin; the policy makes a stray CDN link fail loudly.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
_ASSETS = {path.name: path for path in STATIC_DIR.iterdir() if path.suffix in {".js", ".css"}}

router = APIRouter(include_in_schema=False)


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/ui/")


@router.get("/ui/")
def jobs_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers=_HEADERS)


@router.get("/ui/keys")
def keys_page() -> FileResponse:
    """API keys: listed, created, rotated and revoked with an admin key (the API says no to others)."""
    return FileResponse(STATIC_DIR / "keys.html", headers=_HEADERS)


@router.get("/ui/tenants")
def tenants_page() -> FileResponse:
    """Teams: every tenant's limits and use, and its limits set, with an admin key."""
    return FileResponse(STATIC_DIR / "tenants.html", headers=_HEADERS)


@router.get("/ui/webhooks")
def webhooks_page() -> FileResponse:
    """Webhooks: the team's endpoints (every team's with an admin key), added, tested and deleted."""
    return FileResponse(STATIC_DIR / "webhooks.html", headers=_HEADERS)


@router.get("/ui/audit")
def audit_page() -> FileResponse:
    """The audit log: who changed keys, teams' limits and webhooks (a team's key: its own team's)."""
    return FileResponse(STATIC_DIR / "audit.html", headers=_HEADERS)


@router.get("/ui/jobs/{job_id}")
def job_page(job_id: str) -> FileResponse:
    """One page for every id: the script reads the id from the URL and shows the API's 404 sentence."""
    return FileResponse(STATIC_DIR / "job.html", headers=_HEADERS)


@router.get("/ui/static/{name}")
def asset(name: str) -> FileResponse:
    path = _ASSETS.get(name)
    if path is None:
        raise HTTPException(404)
    return FileResponse(path, headers=_HEADERS)
