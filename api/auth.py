"""Who is calling: API keys (hashed, per tenant), the bootstrap admin key, and per-key rate limits.

Without TPUTUNE_ADMIN_KEY (or TPUTUNE_REQUIRE_API_KEYS: keys without the bootstrap key, admin API keys
manage them) the server is single-user: every caller is the `default` tenant (and it refuses non-loopback
addresses, see Settings.check_exposure).
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from sqlalchemy import ColumnElement, and_, bindparam, or_, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from api.errors import ApiError
from api.mapped import MappedFile, digest
from api.models import ApiKey, as_utc
from api.settings import Settings

KEY_PREFIX = "tpt_"
DEFAULT_TENANT = "default"
TENANT_NAME = r"^[a-z0-9][a-z0-9-_.]*$"  # a tenant's name (a key's tenant, PATCH /admin/tenants/{name})
COOKIE_NAME = "tputune_key"
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_CACHE_SECONDS = 5.0
USE_FLUSH_SECONDS = 60.0  # how often a process writes when its keys were last used (api_keys.last_used_at)
BUCKETS_FILE = "ratelimit.buckets"


@dataclass(frozen=True)
class Principal:
    tenant: str  # the tenant its jobs are created in
    key_id: str  # "admin", "anonymous", "server" (api.audit.SERVER) or the API key's id
    is_admin: bool = False
    expires: str | None = None  # an API key's expiry, as the X-Tputune-Key-Expires header says it
    read_only: bool = False  # it may only read (GET, HEAD): api.deps.caller refuses anything else

    @property
    def scope(self) -> str | None:
        """The tenant whose jobs it may see and act on; None: every tenant's (the admin key, and the
        keyless single-user server)."""
        return None if self.is_admin else self.tenant

    @property
    def who(self) -> str | None:
        """Who this is, as a job's events name the caller; None for the keyless single user."""
        return {"anonymous": None, "admin": "the admin", "server": "the server"}.get(
            self.key_id, f"key {self.key_id}"
        )


ANONYMOUS = Principal(tenant=DEFAULT_TENANT, key_id="anonymous", is_admin=True)
ADMIN = Principal(tenant=DEFAULT_TENANT, key_id="admin", is_admin=True)
UNKNOWN_KEY = "This API key is unknown or revoked; ask your admin for a new one."
READS = frozenset({"GET", "HEAD"})  # what a read-only key may send


def read_only_refused() -> ApiError:
    return ApiError(
        403,
        "read_only_key",
        "This API key is read-only: it reads (GET) and cannot create, change or cancel anything; use a key "
        "made without read_only (ask your admin).",
    )


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> tuple[str, str, str, str]:
    """(id, prefix, plaintext, hash); the plaintext is shown once and never stored."""
    key_id = "".join(secrets.choice(_ALPHABET) for _ in range(10))
    prefix = f"{KEY_PREFIX}{key_id}"
    plaintext = f"{prefix}_{secrets.token_urlsafe(32)}"
    return f"key_{key_id}", prefix, plaintext, hash_key(plaintext)


def unauthorized(message: str, code: str = "invalid_api_key") -> ApiError:
    return ApiError(401, code, message, headers={"WWW-Authenticate": "Bearer"})


def expired(expires: float) -> ApiError:
    return unauthorized(
        f"This API key expired at {_when(expires)}; ask your admin for a new one.", "api_key_expired"
    )


def _when(expires: float) -> str | None:
    """A Unix time as `2026-12-05 06:32:00 UTC` (None for inf: never)."""
    if expires == float("inf"):
        return None
    return datetime.fromtimestamp(expires, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def usable_key(now: float) -> ColumnElement[bool]:
    """SQL: the API key is neither revoked nor past its expiry at `now` (a Unix time). Never NULL, so its
    negation counts the unusable ones (api.usage)."""
    expires_at = col(ApiKey.expires_at)
    return and_(
        col(ApiKey.revoked_at).is_(None),
        or_(expires_at.is_(None), expires_at > datetime.fromtimestamp(now, UTC)),
    )


NO_ADMIN_KEY = (
    "TPUTUNE_REQUIRE_API_KEYS is on without TPUTUNE_ADMIN_KEY, and no admin API key works: nobody can manage "
    "keys. Set TPUTUNE_ADMIN_KEY again (a restart), and create an admin key with it: tputune keys create "
    "--admin."
)


def admin_keys_working(session: Session) -> set[str]:
    """The admin API keys that work now (neither revoked nor expired) and may manage keys (not read-only),
    by id: a few."""
    usable = usable_key(time.time())
    return set(session.exec(select(ApiKey.id).where(col(ApiKey.admin), ~col(ApiKey.read_only), usable)))


def _expiry(expires_at: datetime | None) -> float:
    """A key's expiry as a Unix time (inf: never)."""
    moment = as_utc(expires_at)
    return moment.timestamp() if moment is not None else float("inf")


class Authenticator:
    """Resolves a bearer key to a Principal; caches lookups for a few seconds (revocation in this
    process takes effect at once; the server's other processes and replicas forget the cache when they
    learn of it: api.streams.Streams.watch, api.usage). A key past its expiry is refused at once, cached
    or not. When each key was last used is kept in memory and written by `flush_uses`."""

    def __init__(self, engine: Engine, settings: Settings, buckets: Buckets | None = None) -> None:
        self.engine = engine
        self.settings = settings
        # key hash: when looked up (monotonic), the Principal (None: unknown or revoked), expiry (Unix time)
        self._cache: dict[str, tuple[float, Principal | None, float]] = {}
        self._lock = threading.Lock()
        self._used: dict[str, float] = {}  # key id: when last used (Unix time), not yet written
        self.use_flush_seconds = USE_FLUSH_SECONDS
        self.buckets = buckets or LocalBuckets()

    def authenticate(self, key: str | None) -> Principal:
        principal = self.authenticate_cached(key)
        if principal is not None:
            return principal
        assert key is not None  # authenticate_cached answered every other case
        digest = hash_key(key)
        now = time.monotonic()
        with Session(self.engine) as session:
            row = session.exec(select(ApiKey).where(ApiKey.key_hash == digest)).first()
        expires = _expiry(row.expires_at) if row is not None else float("inf")
        principal = None
        if row is not None and row.revoked_at is None:
            principal = Principal(
                tenant=row.tenant,
                key_id=row.id,
                is_admin=row.admin,
                expires=_when(expires),
                read_only=row.read_only,
            )
        admitted = self._admit(digest, (now, principal, expires))
        assert admitted is not None  # (looked up: a Principal or an ApiError)
        return admitted

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
        return self._admit(hash_key(key))

    def _admit(
        self, key_hash: str, looked_up: tuple[float, Principal | None, float] | None = None
    ) -> Principal | None:
        """The key's Principal, from `looked_up` (then cached) or the cache (None if it is not there, or
        too old); noting its use. An ApiError for a key unknown, revoked or expired."""
        wall = time.time()
        with self._lock:
            if looked_up is not None:
                self._cache[key_hash] = looked_up
                entry = looked_up
            else:
                cached = self._cache.get(key_hash)
                if cached is None or time.monotonic() - cached[0] >= _CACHE_SECONDS:
                    return None
                entry = cached
            _, principal, expires = entry
            if principal is not None and wall < expires:
                self._used[principal.key_id] = wall
                return principal
        raise unauthorized(UNKNOWN_KEY) if principal is None else expired(expires)

    def valid_key_ids(self, key_ids: set[str]) -> set[str]:
        """Which of these API keys are neither revoked nor expired (from the database, not the cache)."""
        with Session(self.engine) as session:
            return set(
                session.exec(select(ApiKey.id).where(col(ApiKey.id).in_(key_ids), usable_key(time.time())))
            )

    def flush_uses(self) -> int:
        """Write when this process's keys were last used, if later than what is stored (another process
        may have written a later one); how many keys. A write that fails is tried again by the next."""
        with self._lock:
            used, self._used = self._used, {}
        if not used:
            return 0
        rows = [{"key": key_id, "when": datetime.fromtimestamp(when, UTC)} for key_id, when in used.items()]
        last = col(ApiKey.last_used_at)
        statement = (
            update(ApiKey)
            .where(col(ApiKey.id) == bindparam("key"), or_(last.is_(None), last < bindparam("when")))
            .values(last_used_at=bindparam("when"))
        )
        try:
            with self.engine.begin() as connection:
                connection.execute(statement, rows)
        except Exception:
            with self._lock:
                for key_id, when in used.items():  # (uses since the swap are later)
                    self._used.setdefault(key_id, when)
            raise
        return len(rows)

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()

    def check_rate(self, principal: Principal) -> None:
        """Token bucket per key: `rate_limit_per_second` sustained, `rate_limit_burst` at once."""
        rate = self.settings.rate_limit_per_second
        if rate <= 0 or principal.key_id in ("anonymous", "admin"):
            return
        retry = self.buckets.take(principal.key_id, rate, float(self.settings.rate_limit_burst))
        if retry is not None:
            raise ApiError(
                429,
                "rate_limited",
                f"Too many requests for this key; retry in {retry} s.",
                headers={"Retry-After": str(retry)},
            )


class Buckets(Protocol):
    def take(self, key: str, rate: float, burst: float) -> int | None:
        """Spend a token of `key`'s bucket; None if there was one, else the seconds until there is."""

    def spent(self) -> dict[int, float]:
        """The tokens spent here by each key (api.mapped.digest) this server's buckets know, since they
        first saw it: it only grows, unless a key's bucket was forgotten (then it starts again from 0)."""

    def charge(self, charges: dict[int, float], rate: float, burst: float) -> None:
        """Take tokens from keys' buckets that the server's other replicas spent (api.usage)."""


def _refill(tokens: float, last: float, now: float, rate: float, burst: float) -> float:
    return min(burst, tokens + (now - last) * rate)


def _spend(tokens: float, last: float, now: float, rate: float, burst: float) -> tuple[float, int | None]:
    tokens = _refill(tokens, last, now, rate, burst)
    if tokens < 1.0:
        return tokens, max(1, int((1.0 - tokens) / rate + 0.999))
    return tokens - 1.0, None


def _charged(tokens: float, last: float, now: float, rate: float, burst: float, charge: float) -> float:
    """A bucket less what other replicas spent: at most one burst in debt (their own buckets cap what they
    could spend before they learned of ours)."""
    return max(-burst, _refill(tokens, last, now, rate, burst) - charge)


class LocalBuckets:
    """The buckets of one API process."""

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[float, float, float]] = {}  # digest: tokens, when, spent
        self._lock = threading.Lock()

    def take(self, key: str, rate: float, burst: float) -> int | None:
        key_digest = digest(key)
        now = time.monotonic()
        with self._lock:
            tokens, last, spent = self._buckets.get(key_digest, (burst, now, 0.0))
            tokens, retry = _spend(tokens, last, now, rate, burst)
            self._buckets[key_digest] = (tokens, now, spent if retry is not None else spent + 1.0)
        return retry

    def spent(self) -> dict[int, float]:
        with self._lock:
            return {key_digest: spent for key_digest, (_, _, spent) in self._buckets.items() if spent}

    def charge(self, charges: dict[int, float], rate: float, burst: float) -> None:
        now = time.monotonic()
        with self._lock:
            for key_digest, charge in charges.items():
                tokens, last, spent = self._buckets.get(key_digest, (burst, now, 0.0))
                self._buckets[key_digest] = (_charged(tokens, last, now, rate, burst, charge), now, spent)


# key hash (0: free), tokens, when (time.monotonic: the same in every process), tokens spent here
_SLOT = struct.Struct("Qddd")


class SharedBuckets:
    """The buckets in a file all of `tputune serve --workers N`'s processes map, so that a key's limit holds
    whichever worker its requests reach. An open-addressed table under flock(2); with more than `slots`
    keys active, the one seen least recently is forgotten (its bucket starts full again)."""

    PROBES = 32

    def __init__(self, path: Path, reset: bool = False, slots: int = 4096) -> None:
        self.slots = slots
        self._file = MappedFile(path, slots * _SLOT.size, reset)  # reset: a new server, every bucket full

    def take(self, key: str, rate: float, burst: float) -> int | None:
        key_digest = digest(key)
        now = time.monotonic()
        with self._file.locked() as table:
            offset = self._slot(table, key_digest)
            stored, tokens, last, spent = _SLOT.unpack_from(table, offset)
            if stored != key_digest:
                tokens, last, spent = burst, now, 0.0
            tokens, retry = _spend(tokens, last, now, rate, burst)
            spent += 1.0 if retry is None else 0.0
            _SLOT.pack_into(table, offset, key_digest, tokens, now, spent)
        return retry

    def spent(self) -> dict[int, float]:
        with self._file.locked() as table:
            rows = list(_SLOT.iter_unpack(table))
        return {key_digest: spent for key_digest, _, _, spent in rows if key_digest and spent}

    def charge(self, charges: dict[int, float], rate: float, burst: float) -> None:
        now = time.monotonic()
        with self._file.locked() as table:
            for key_digest, charge in charges.items():
                offset = self._slot(table, key_digest)
                stored, tokens, last, spent = _SLOT.unpack_from(table, offset)
                if stored != key_digest:
                    tokens, last, spent = burst, now, 0.0
                tokens = _charged(tokens, last, now, rate, burst, charge)
                _SLOT.pack_into(table, offset, key_digest, tokens, now, spent)

    def _slot(self, table: mmap.mmap, key_digest: int) -> int:
        """The offset of the key's slot: its own, else a free one, else the least recently used probed."""
        oldest, oldest_when = 0, float("inf")
        for probe in range(self.PROBES):
            offset = ((key_digest + probe) % self.slots) * _SLOT.size
            stored, _, when, _ = _SLOT.unpack_from(table, offset)
            if stored in (key_digest, 0):
                return offset
            if when < oldest_when:
                oldest, oldest_when = offset, when
        return oldest
