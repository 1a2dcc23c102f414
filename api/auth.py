"""Who is calling: API keys (hashed, per tenant), the bootstrap admin key, and per-key rate limits.

Without TPUTUNE_ADMIN_KEY the server is single-user: every caller is the `default` tenant (and it
refuses non-loopback addresses, see Settings.check_exposure).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from api.errors import ApiError
from api.models import ApiKey
from api.settings import Settings

KEY_PREFIX = "tpt_"
DEFAULT_TENANT = "default"
COOKIE_NAME = "tputune_key"
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_CACHE_SECONDS = 5.0


@dataclass(frozen=True)
class Principal:
    tenant: str
    key_id: str  # "admin", "anonymous" or the API key's id
    is_admin: bool = False


ANONYMOUS = Principal(tenant=DEFAULT_TENANT, key_id="anonymous", is_admin=True)
ADMIN = Principal(tenant=DEFAULT_TENANT, key_id="admin", is_admin=True)
UNKNOWN_KEY = "This API key is unknown or revoked; ask your admin for a new one."


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> tuple[str, str, str, str]:
    """(id, prefix, plaintext, hash); the plaintext is shown once and never stored."""
    key_id = "".join(secrets.choice(_ALPHABET) for _ in range(10))
    prefix = f"{KEY_PREFIX}{key_id}"
    plaintext = f"{prefix}_{secrets.token_urlsafe(32)}"
    return f"key_{key_id}", prefix, plaintext, hash_key(plaintext)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, "invalid_api_key", message, headers={"WWW-Authenticate": "Bearer"})


class Authenticator:
    """Resolves a bearer key to a Principal; caches lookups for a few seconds (revocation in this
    process takes effect at once; other replicas see it within the cache time)."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}

    def authenticate(self, key: str | None) -> Principal:
        principal = self.authenticate_cached(key)
        if principal is not None:
            return principal
        assert key is not None  # authenticate_cached answered every other case
        digest = hash_key(key)
        now = time.monotonic()
        with Session(self.engine) as session:
            row = session.exec(select(ApiKey).where(ApiKey.key_hash == digest)).first()
        principal = Principal(tenant=row.tenant, key_id=row.id) if row and row.revoked_at is None else None
        with self._lock:
            self._cache[digest] = (now, principal)
        if principal is None:
            raise unauthorized(UNKNOWN_KEY)
        return principal

    def authenticate_cached(self, key: str | None) -> Principal | None:
        """`authenticate` without the database: the Principal, an ApiError, or None when only a lookup
        can tell (the caller then runs `authenticate` off the event loop)."""
        if not self.settings.auth_enabled:
            return ANONYMOUS
        if not key:
            raise unauthorized("This API needs a key: send 'Authorization: Bearer <your tputune API key>'.")
        admin = self.settings.admin_key
        if admin is not None and hmac.compare_digest(key.encode(), admin.get_secret_value().encode()):
            return ADMIN
        with self._lock:
            cached = self._cache.get(hash_key(key))
        if cached is None or time.monotonic() - cached[0] >= _CACHE_SECONDS:
            return None
        if cached[1] is None:
            raise unauthorized(UNKNOWN_KEY)
        return cached[1]

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()

    def check_rate(self, principal: Principal) -> None:
        """Token bucket per key: `rate_limit_per_second` sustained, `rate_limit_burst` at once."""
        rate = self.settings.rate_limit_per_second
        if rate <= 0 or principal.key_id in ("anonymous", "admin"):
            return
        burst = float(self.settings.rate_limit_burst)
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(principal.key_id, (burst, now))
            tokens = min(burst, tokens + (now - last) * rate)
            if tokens < 1.0:
                self._buckets[principal.key_id] = (tokens, now)
                retry = max(1, int((1.0 - tokens) / rate + 0.999))
                raise ApiError(
                    429,
                    "rate_limited",
                    f"Too many requests for this key; retry in {retry} s.",
                    headers={"Retry-After": str(retry)},
                )
            self._buckets[principal.key_id] = (tokens - 1.0, now)
