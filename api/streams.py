"""The long-lived responses of an API process: followed events (Server-Sent Events) and followed logs.

A follower holds a socket for as long as its client follows (hours, for a dashboard page left open) and
costs the process all along: an events follower a socket and a read each time its job changes (the
process looks for all of them at once, `EventWatch`), a logs follower a thread and a connection to the
Kubernetes API. A request's key is checked once, when it starts. So:

- one API key follows at most `max_streams_per_key` at once (the bootstrap admin key and the keyless
  single-user mode only the totals): one client that opens streams in a loop cannot take them all. Counted
  over all of `tputune serve --workers N`'s processes (`SharedKeyStreams`), and the other replicas' as
  of their last pass (api.usage: `set_remote`);
- at most `max_event_followers` and `max_log_followers` in all, per API process (what each process can
  carry): more are refused with 429 and `Retry-After`, not left waiting;
- a stream whose key is revoked meanwhile ends within `stream_recheck_seconds` (`Streams.watch`): one
  query for all the keys that follow, not one per stream. Revoked through one of the server's processes,
  its streams in the others end within a second (`Streams.revoke`); through another replica, within a
  pass of api.usage after (`Streams.revoked`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import threading
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.auth import Principal
from api.errors import ApiError, DatabaseUnavailable
from api.mapped import MappedFile, alive, digest
from api.settings import Settings

log = logging.getLogger("api.streams")

EVENTS = "events"
LOGS = "logs"
RETRY_AFTER_SECONDS = 10
REVOKED_POLL_SECONDS = 0.5  # (how soon a process sees that another revoked a key: a read of the shared map)
# Keys whose streams are capped and rechecked: not the admin key from the environment (revoked by changing
# it, which restarts the server) nor the keyless single-user mode.
_UNCHECKED_KEYS = ("admin", "anonymous")


REVOKED = "revoked"
SHUTDOWN = "shutdown"


@dataclass(eq=False)
class Stream:
    """One follower. `ended` (with the reason) once its key was revoked or the server is shutting down:
    the stream then stops (`on_end` interrupts a read that blocks until its next line)."""

    kind: str
    principal: Principal
    ended: str | None = None
    shared: bool = False  # (counted in SharedKeyStreams)
    on_end: Callable[[], None] | None = field(default=None, repr=False)

    def end(self, reason: str) -> None:
        if self.ended:
            return
        self.ended = reason
        if self.on_end is not None:
            self.on_end()

    def on_ending(self, interrupt: Callable[[], None]) -> None:
        """Call `interrupt` when the stream ends, or now if it has (ended while it was being opened)."""
        self.on_end = interrupt
        if self.ended:
            interrupt()


class Streams:
    """This process's followers: admitted under the caps, let go when their response ends, ended when their
    key is revoked. Admitted on route threads, released and watched on the event loop (hence the lock)."""

    def __init__(
        self, settings: Settings, gauges: dict[str, Any] | None = None, shared: SharedKeyStreams | None = None
    ) -> None:
        self.per_key = settings.max_streams_per_key
        self.shared = shared  # (a key's streams in the server's other processes too)
        self.caps = {EVENTS: settings.max_event_followers, LOGS: settings.max_log_followers}
        self.recheck_seconds = settings.stream_recheck_seconds
        self.gauges = gauges or {}
        self.log_threads = anyio.CapacityLimiter(max(1, self.caps[LOGS]))  # (a followed log's reads)
        self._lock = threading.Lock()
        self._open: set[Stream] = set()
        self._kinds: Counter[str] = Counter()
        self._keys: Counter[str] = Counter()
        self._remote: dict[int, int] = {}  # (without `shared`: each key's streams in other replicas)
        self._revocations = 0  # (without `shared`: how many times `revoked` was called)
        self.closing = False  # (shutting down: no new streams)
        _ALL.add(self)

    def admit(self, kind: str, principal: Principal) -> Stream:
        """A new follower, counted until `release`; ApiError 429 over a cap, 503 while shutting down."""
        key = principal.key_id
        with self._lock:
            if self.closing:
                raise _refused(
                    503,
                    "shutting_down",
                    "This API server is shutting down; follow again in a moment (another one answers).",
                    retry_after=1,
                )
            active = self._kinds[kind]
            if active >= self.caps[kind]:
                if kind == LOGS:
                    raise _refused(
                        429,
                        "too_many_log_followers",
                        f"This server follows {active} job logs now, the most it allows "
                        "(TPUTUNE_MAX_LOG_FOLLOWERS); poll GET /jobs/{id}/logs instead, or follow again "
                        "later.",
                    )
                raise _refused(
                    429,
                    "too_many_event_followers",
                    f"This server follows {active} job event streams now, the most it allows "
                    "(TPUTUNE_MAX_EVENT_FOLLOWERS); page GET /jobs/{id}/events with `after` instead, or "
                    "follow again later.",
                )
            counted = False
            if key not in _UNCHECKED_KEYS:
                held = self._keys[key] + (self._remote.get(digest(key), 0) if self._remote else 0)
                if self.shared is not None and held < self.per_key:
                    across, counted = self.shared.take(key, self.per_key)  # (counted: fewer than per_key)
                    held = max(held, across)  # (more here if some were not counted: the table was full)
                if held >= self.per_key:
                    raise _refused(
                        429,
                        "too_many_streams",
                        f"This API key follows {held} streams (job events or logs) now, the most one key may "
                        "(TPUTUNE_MAX_STREAMS_PER_KEY); close one, or poll instead of following.",
                    )
            stream = Stream(kind, principal, shared=counted)
            self._open.add(stream)
            self._kinds[kind] += 1
            self._keys[key] += 1
        self._gauge(kind, 1)
        return stream

    def release(self, stream: Stream) -> None:
        with self._lock:
            if stream not in self._open:
                return
            self._open.remove(stream)
            self._kinds[stream.kind] -= 1
            self._keys[stream.principal.key_id] -= 1
            if not self._keys[stream.principal.key_id]:
                del self._keys[stream.principal.key_id]
            if stream.shared and self.shared is not None:
                self.shared.give(stream.principal.key_id)
        self._gauge(stream.kind, -1)

    async def watch(
        self,
        valid_keys: Callable[[set[str]], Awaitable[set[str]]],
        on_revoked: Callable[[], None] | None = None,
    ) -> None:
        """Until cancelled: every `recheck_seconds`, end the streams of keys no longer valid; and at once
        (within REVOKED_POLL_SECONDS) when another of the server's processes revoked a key (`revoke`),
        calling `on_revoked` first (the key cache is forgotten). A failed check (the database away) ends
        nothing; the next one tries again."""
        loop = asyncio.get_running_loop()
        seen = self.revocations()
        checked = loop.time()
        while True:
            await asyncio.sleep(min(REVOKED_POLL_SECONDS, self.recheck_seconds))
            revocations = self.revocations()
            if revocations == seen and loop.time() - checked < self.recheck_seconds:
                continue
            if revocations != seen and on_revoked is not None:
                on_revoked()
            seen, checked = revocations, loop.time()
            try:
                await self.recheck(valid_keys)
            except Exception as error:  # (logged; the watch goes on)
                log.warning("could not recheck the keys of followed streams: %s", error)

    def revoke(self, key_ids: set[str]) -> int:
        """These keys were revoked (and committed): end their streams here, and have the server's other
        processes look at once; how many ended here."""
        self.revoked()
        return self.end_keys(key_ids)

    def revoked(self) -> None:
        """Some key was revoked (here, or in another replica: api.usage): every process of the server
        forgets its key cache and rechecks its streams' keys within REVOKED_POLL_SECONDS (`watch`)."""
        if self.shared is not None:
            self.shared.revoked()
        else:
            with self._lock:
                self._revocations += 1

    def revocations(self) -> int:
        return self.shared.revocations() if self.shared is not None else self._revocations

    def local_counts(self) -> dict[int, int]:
        """The streams each key (api.mapped.digest) follows in this server (for api.usage)."""
        if self.shared is not None:
            return self.shared.local_counts()
        with self._lock:
            return {digest(key): count for key, count in self._keys.items() if key not in _UNCHECKED_KEYS}

    def set_remote(self, counts: dict[int, int]) -> None:
        """The streams each key follows in the other replicas now (api.usage): they count to its share."""
        if self.shared is not None:
            self.shared.set_remote(counts)
            return
        with self._lock:
            self._remote = dict(counts)

    async def recheck(self, valid_keys: Callable[[set[str]], Awaitable[set[str]]]) -> int:
        """End the streams whose key was revoked; how many."""
        with self._lock:
            keys = {key for key in self._keys if key not in _UNCHECKED_KEYS}
        if not keys:
            return 0
        return self.end_keys(keys - await valid_keys(keys))

    def end_keys(self, key_ids: set[str]) -> int:
        """End the streams of these keys (revoked); how many."""
        if not key_ids:
            return 0
        with self._lock:
            ending = [s for s in self._open if s.principal.key_id in key_ids and not s.ended]
        for stream in ending:
            stream.end(REVOKED)
        if ending:
            log.info("ended %d followed streams of revoked keys %s", len(ending), sorted(key_ids))
        return len(ending)

    def end_all(self, reason: str) -> int:
        """End every stream, and admit no more (the server is shutting down); how many."""
        with self._lock:
            self.closing = True
            ending = list(self._open)
        for stream in ending:
            stream.end(reason)
        return len(ending)

    def _gauge(self, kind: str, change: int) -> None:
        gauge = self.gauges.get(kind)
        if gauge is not None:
            gauge.inc(change)


STREAMS_FILE = "streams.shared"
_ROW = struct.Struct("QQQ")  # key hash (0: free), the pid of the process that holds them, how many
REMOTE = (1 << 64) - 1  # the "pid" of rows that count a key's streams in the other replicas (api.usage)
_COUNT = struct.Struct("Q")


class SharedKeyStreams:
    """How many streams each key holds in all of `tputune serve --workers N`'s processes, so that a key's
    share holds whichever worker its connections reach (the kernel spreads them): rows of (key, process,
    count) in a file they all map, under flock(2). A process's rows count while it lives: those of a worker
    killed holding streams (uvicorn starts another) are freed by the next look that finds its pid gone.

    An open-addressed table, sized for every stream the processes may hold at once (`for_settings`); a
    stream that finds no free row among the `PROBES` after its key's place is counted in its own process
    only (`take` says so). After the rows, how many keys the processes have revoked (`revoked`): each
    process's watch reads it, and rechecks its streams' keys when it moves."""

    PROBES = 64

    def __init__(self, path: Path, rows: int, reset: bool = False) -> None:
        self.rows = rows
        self.pid = os.getpid()
        # The rows, then how many revocations the processes have made (`revoked`).
        self._file = MappedFile(path, rows * _ROW.size + _COUNT.size, reset)
        with self._file.locked() as table:  # (rows a dead process with this pid left are not this one's)
            for index, (_, pid, _) in enumerate(_ROW.iter_unpack(table[: rows * _ROW.size])):
                if pid == self.pid:
                    _ROW.pack_into(table, index * _ROW.size, 0, 0, 0)

    @classmethod
    def for_settings(cls, settings: Settings, reset: bool = False) -> SharedKeyStreams:
        """The server's table (the supervisor's, `reset` at start, and every worker's)."""
        most = settings.resolved_workers * (settings.max_event_followers + settings.max_log_followers)
        return cls(settings.data_dir / STREAMS_FILE, min(max(4096, 2 * most), 1 << 20), reset)

    def take(self, key: str, limit: int) -> tuple[int, bool]:
        """Count one more stream of `key` if all the processes hold fewer than `limit`: how many they held
        before, and whether it was counted (False: at the limit, or no free row)."""
        key_digest = digest(key)
        with self._file.locked() as table:
            held, mine, free = 0, None, None
            for offset in self._window(key_digest):
                stored, pid, count = _ROW.unpack_from(table, offset)
                if count and pid not in (self.pid, REMOTE) and not alive(pid):
                    _ROW.pack_into(table, offset, 0, 0, 0)  # (its process died holding them)
                    count = 0
                if not count:
                    free = offset if free is None else free
                elif stored == key_digest:
                    held += count
                    if pid == self.pid:
                        mine = offset
            if held >= limit:
                return held, False
            if mine is not None:
                _ROW.pack_into(table, mine, key_digest, self.pid, _ROW.unpack_from(table, mine)[2] + 1)
            elif free is not None:
                _ROW.pack_into(table, free, key_digest, self.pid, 1)
            else:
                return held, False
        return held, True

    def give(self, key: str) -> None:
        """One counted stream of `key` fewer (this process's)."""
        key_digest = digest(key)
        with self._file.locked() as table:
            for offset in self._window(key_digest):
                stored, pid, count = _ROW.unpack_from(table, offset)
                if stored == key_digest and pid == self.pid and count:
                    _ROW.pack_into(table, offset, *((key_digest, pid, count - 1) if count > 1 else (0, 0, 0)))
                    return

    def local_counts(self) -> dict[int, int]:
        """The streams each key follows in this server's live processes (not the other replicas')."""
        counts: Counter[int] = Counter()
        with self._file.locked() as table:
            rows = list(_ROW.iter_unpack(table[: self.rows * _ROW.size]))
        for stored, pid, count in rows:
            if count and pid != REMOTE and (pid == self.pid or alive(pid)):
                counts[stored] += count
        return dict(counts)

    def set_remote(self, counts: dict[int, int]) -> None:
        """The streams each key follows in the other replicas now: a row each (pid REMOTE), which `take`
        counts. A key that finds no free row for it is not counted (as in `take`)."""
        pending = {key_digest: count for key_digest, count in counts.items() if count > 0}
        with self._file.locked() as table:
            for index, (stored, pid, _) in enumerate(_ROW.iter_unpack(table[: self.rows * _ROW.size])):
                if pid == REMOTE:
                    count = pending.pop(stored, 0)
                    row = (stored, REMOTE, count) if count else (0, 0, 0)
                    _ROW.pack_into(table, index * _ROW.size, *row)
            for key_digest, count in pending.items():
                for offset in self._window(key_digest):
                    if not _ROW.unpack_from(table, offset)[2]:
                        _ROW.pack_into(table, offset, key_digest, REMOTE, count)
                        break

    def revoked(self) -> None:
        """A key was revoked: the processes' watches look (`Streams.watch`)."""
        with self._file.locked() as table:
            _COUNT.pack_into(table, self.rows * _ROW.size, self.revocations() + 1)

    def revocations(self) -> int:
        """How many keys were revoked since the server started (a read of the map: no lock)."""
        return int(_COUNT.unpack_from(self._file.map, self.rows * _ROW.size)[0])

    def _window(self, key_digest: int) -> list[int]:
        """The offsets of the rows `key_digest`'s streams may have."""
        return [((key_digest + probe) % self.rows) * _ROW.size for probe in range(self.PROBES)]


@dataclass(eq=False)
class _Waiter:
    stream: Stream
    job_id: str
    status: str
    seen: int
    woken: asyncio.Future[int]


class EventWatch:
    """Whether anything happened to the jobs this process's event streams follow, for all of them at once:
    every `interval`, one statement (api.reader.event_heads: each job's status and newest event id) while
    any follower waits. A follower then reads its new events only when its job has some, or a new status.

    Each follower used to look for itself, two statements twice a second: 1,000 idle followers of 1,000
    jobs took 72% of the API process's core and 57% of PostgreSQL's, now 2.9% and 0.8%; on SQLite 17.6%,
    now 2.5% (bench/api_followers.py --followers 1000 --jobs 1000).

    The followers of one job, woken together, read its new events together too (`read`): the same read
    (job, cursor, types) asked for again after the same look is answered by the first, its events
    rendered once."""

    def __init__(self, reader: Any, interval: float = 0.5) -> None:
        self.reader = reader
        self.interval = interval
        self._waiters: set[_Waiter] = set()
        self._task: asyncio.Task[None] | None = None
        # (tenant, job id, after, types) -> (when, the read); emptied by each look
        self._reads: dict[tuple[Any, ...], tuple[float, asyncio.Task[Any]]] = {}

    async def read(
        self, tenant: str | None, poll: Any, render: Callable[[Any], str]
    ) -> tuple[str | None, list[tuple[int, str]]]:
        """`reader.poll_events(tenant, poll)`, each event as (id, `render(row)`); shared with the followers
        that ask for the same after the same look. A read made before the last look (it empties `_reads`),
        or `interval` ago, is not shared: it may predate what the look saw, which woke the follower."""
        loop = asyncio.get_running_loop()
        key = (tenant, poll.job_id, poll.after, tuple(poll.types))
        entry = self._reads.get(key)
        if entry is None or loop.time() - entry[0] >= self.interval or entry[1].get_loop() is not loop:
            if len(self._reads) > _MAX_READS:
                self._reads.clear()
            task = loop.create_task(self._read(tenant, poll, render))
            task.add_done_callback(_retrieve)
            entry = (loop.time(), task)
            self._reads[key] = entry
        # shield: a follower that goes away does not cancel the read the others wait for.
        return await asyncio.shield(entry[1])

    async def _read(
        self, tenant: str | None, poll: Any, render: Callable[[Any], str]
    ) -> tuple[str | None, list[tuple[int, str]]]:
        status, rows = await self.reader.poll_events(tenant, poll)
        return status, [(row.id, render(row)) for row in rows]

    async def wait(self, stream: Stream, job_id: str, status: str, seen: int, timeout: float) -> int | None:
        """Until the job has an event newer than `seen` or a status other than `status` (or is not the
        follower's any more), or the stream ended: the job's newest event id then. None after `timeout`."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(stream, job_id, status, seen, loop.create_future())
        self._waiters.add(waiter)
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._run())
        try:
            async with asyncio.timeout(timeout):
                return await waiter.woken
        except TimeoutError:
            return None
        finally:
            self._waiters.discard(waiter)

    async def _run(self) -> None:
        while self._waiters:
            await asyncio.sleep(self.interval)
            waiters = []
            for waiter in self._waiters:
                if waiter.woken.done():
                    continue
                if waiter.stream.ended:
                    waiter.woken.set_result(waiter.seen)
                else:
                    waiters.append(waiter)
            if not waiters:
                continue
            try:
                heads = await self.reader.event_heads(sorted({w.job_id for w in waiters}))
            except DatabaseUnavailable:
                continue  # (the followers wait for the database as for new events)
            except Exception:
                log.exception("could not look for new events of followed jobs")
                continue
            self._reads.clear()  # (reads from before the look are not shared with the followers it wakes)
            for waiter in waiters:
                if waiter.woken.done():  # (timed out during the look)
                    continue
                head = heads.get(waiter.job_id)
                if head is None or waiter.stream.principal.scope not in (None, head.tenant):
                    waiter.woken.set_result(waiter.seen)  # (its next read finds the job gone)
                elif head.status != waiter.status or head.last_event > waiter.seen:
                    waiter.woken.set_result(head.last_event)


_ALL: weakref.WeakSet[Streams] = weakref.WeakSet()  # (every app's in this process)


def end_all_streams() -> int:
    """End every followed stream of this process: the server is shutting down, and waits for its open
    responses to end, which a stream does when its job ends, hours from now maybe (api.server). Event
    streams end plainly (a client follows again, on another replica or the restarted server, from its last
    event), logs at once. How many."""
    ended = sum(streams.end_all(SHUTDOWN) for streams in list(_ALL))
    if ended:
        log.info("shutting down: ended %d followed streams", ended)
    return ended


_MAX_READS = 10_000  # shared reads remembered at most (between two looks)


def _retrieve(task: asyncio.Task[Any]) -> None:
    """(A shared read's error is its followers'; retrieved here too, so that one no follower waited for
    any more is not logged as never retrieved.)"""
    if not task.cancelled():
        task.exception()


def _refused(status: int, code: str, message: str, retry_after: int = RETRY_AFTER_SECONDS) -> ApiError:
    """A follower not admitted: `status` (429, 503) with `Retry-After`."""
    return ApiError(status, code, message, param="follow", headers={"Retry-After": str(retry_after)})


class Followed(StreamingResponse):
    """A follower's response: its Stream is released when the response ends, however it ends (the client
    left, the stream ended, an error)."""

    def __init__(self, content: Any, streams: Streams, stream: Stream, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.streams = streams
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.streams.release(self.stream)
