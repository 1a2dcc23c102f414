"""`tputune serve`: the API under uvicorn, in one process or in `--workers N` processes sharing the port.

One process is the default (TPUTUNE_WORKERS=1; 0: one per CPU core, up to 4). More serve more requests
on more cores, since one process is bound to one core by the GIL, but on 2 cores they do not meet more of
bench/api_load.py's targets (bench/README.md, "The busiest routes served directly"): POST /jobs, whose
p99 misses with one process or two, is CPU-bound, and with two the machine is full.

One worker: this process serves requests and starts the dispatcher process (api.dispatch_process).

N workers: this process is uvicorn's supervisor. It starts the dispatcher process and N worker processes
(uvicorn's, spawned: each imports the app through `worker_app`), restarts those that die, and stops them
all on SIGTERM/SIGINT. Between the workers:
- on Linux each listens on a socket of its own on the port (SO_REUSEPORT), and the kernel spreads new
  connections over them; this process holds the port bound, and refuses to start if anything else holds
  it (elsewhere they share this process's socket, as with uvicorn's own supervisor);
- the settings travel in the environment (the command line's overrides as TPUTUNE_* variables);
- any worker wakes the dispatcher (a FIFO in the data dir, api.dispatch_process.Waker);
- /metrics sums every worker's counts (prometheus_client's multiprocess mode, in a temporary directory);
- a key's rate limit holds across them (api.auth.SharedBuckets), and so does its share of followed streams
  (api.streams.SharedKeyStreams);
- a worker whose supervisor dies (SIGKILL included) is killed with it, like the one-process server's
  threads: nothing goes on answering on the port, and a restarted server can bind it at once.
The API-key cache (5 s) is per process; a key revoked through one worker is forgotten by the others
within a second, and its followed streams there end (api.streams.Streams.revoke).

With one worker or N, a thread of this process shares each API key's use of its limits with the server's
other replicas, and learns of keys revoked through them (api.usage, TPUTUNE_USAGE_SYNC_SECONDS).

Either way uvicorn's httptools protocol writes through `_CoalescedWrites`: a response's headers and body in
one write(2) and one TCP segment, where uvicorn made two.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess, multiprocess

from api.mapped import alive

SWITCH_INTERVAL_SECONDS = 0.001
# A request's header fields at most (names, values and their separators; the request line apart, which
# httptools caps itself): an API key, a cookie and the usual headers take a few KB. Envoy (GKE's Gateway)
# takes 60 KiB by default.
MAX_HEADER_BYTES = 64 * 1024
REUSE_PORT = sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")  # (elsewhere it does not balance)
SUPERVISOR_ENV = "TPUTUNE_SUPERVISOR_PID"  # set by run() for the workers; not a setting
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
METRICS_DIR_PREFIX = "tputune-metrics-"  # then the server's pid: one left by a killed server is removed


def run(overrides: dict[str, Any]) -> int:
    from api.migrate import upgrade
    from api.observability import configure_logging
    from api.settings import Settings

    settings = Settings(**overrides)
    settings.check_exposure()
    settings.ensure_dirs()
    workers = settings.resolved_workers
    if workers > 1 and settings.dispatcher_enabled and not settings.dispatcher_process:
        raise SystemExit(
            "tputune: TPUTUNE_WORKERS > 1 needs the dispatcher in a process of its own; "
            "unset TPUTUNE_DISPATCHER_PROCESS=false, or set TPUTUNE_WORKERS=1."
        )
    configure_logging(settings.log_level, settings.log_format == "json")
    upgrade(settings.resolved_database_url)
    options: dict[str, Any] = {
        "http": CoalescingHttpToolsProtocol if CoalescingHttpToolsProtocol is not None else "auto",
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level.lower(),
        "log_config": None,
        "access_log": False,  # RequestContext writes the access log (with the request id)
        "timeout_keep_alive": settings.keep_alive_seconds,
    }
    print(
        f"tputune: serving on http://{settings.host}:{settings.port} (docs at /docs)"
        + (f" with {workers} workers" if workers > 1 else ""),
        flush=True,
    )
    if workers == 1:
        from api.main import create_app
        from api.usage import start_usage_sync

        app = create_app(settings)
        _tune_interpreter()
        server = EndingStreamsServer(uvicorn.Config(app, **options))
        sync = start_usage_sync(settings, app.state.engine, app.state.auth.buckets, app.state.streams)
        try:
            with contextlib.suppress(KeyboardInterrupt):
                server.run()
        finally:
            if sync is not None:
                sync.stop()
        if not server.started:
            sys.exit(STARTUP_FAILURE)
        return 0

    from api.auth import BUCKETS_FILE, SharedBuckets
    from api.db import make_engine
    from api.dispatch_process import DispatcherProcess
    from api.streams import SharedKeyStreams
    from api.usage import start_usage_sync

    for name, value in overrides.items():  # the command line's, for the workers' Settings()
        os.environ[f"TPUTUNE_{name.upper()}"] = str(value)
    os.environ["TPUTUNE_WORKERS"] = str(workers)
    os.environ[SUPERVISOR_ENV] = str(os.getpid())
    _remove_dead_metrics_dirs()
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
    os.environ[METRICS_DIR_ENV] = metrics_dir
    buckets = SharedBuckets(settings.data_dir / BUCKETS_FILE, reset=True)
    streams = SharedKeyStreams.for_settings(settings, reset=True)
    # (the workers' shared buckets and streams, with the other replicas': a thread of this process)
    sync = start_usage_sync(settings, make_engine(settings.resolved_database_url, 2), buckets, streams)
    dispatcher = DispatcherProcess(settings) if settings.dispatcher_enabled else None
    if dispatcher is not None:
        dispatcher.start()
    try:
        _run_workers(uvicorn.Config("api.server:worker_app", factory=True, workers=workers, **options))
    finally:
        if sync is not None:
            sync.stop()
        if dispatcher is not None:
            dispatcher.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _run_workers(config: uvicorn.Config) -> None:
    """uvicorn's supervisor (what `uvicorn.run(..., workers=N)` runs), but on Linux each worker listens on
    a socket of its own (SO_REUSEPORT), so that the kernel spreads new connections evenly over them.

    On the one socket uvicorn shares, whichever worker woke first accepted every connection waiting: 64
    clients connecting at once mostly went to one worker, and POST /jobs ran at one worker's rate (two runs
    in a row, 2 cores, SQLite: 1,682 req/s p99 66 ms, then 2,597 req/s p99 48 ms). This process keeps the
    port bound (never listening) while workers come and go, after checking that nothing else holds it. A
    worker that dies takes the connections waiting on its socket with it (reset, as its open ones are);
    new ones go to the others until uvicorn's replacement listens."""
    started = multiprocess.Process
    try:
        if not REUSE_PORT:
            multiprocess.Process = EndingStreamsProcess  # type: ignore[misc]  # what Multiprocess starts
            Multiprocess(config, sockets=[config.bind_socket()]).run()
            return
        reserved = _reserve_port(config.host, config.port)
        config.port = reserved.getsockname()[1]  # port 0: the one the kernel chose
        multiprocess.Process = OwnSocketProcess  # type: ignore[misc]  # what Multiprocess starts and restarts
        try:
            Multiprocess(config, sockets=[]).run()
        finally:
            reserved.close()
    finally:
        multiprocess.Process = started  # type: ignore[misc]


def _tcp_socket(host: str) -> socket.socket:
    """A TCP socket for `host`, with SO_REUSEADDR as uvicorn's."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def _listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT."""
    sock = _tcp_socket(host)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _reserve_port(host: str, port: int) -> socket.socket:
    """The port, bound for the workers to join. A plain bind first: it fails if any socket holds the port,
    another server's SO_REUSEPORT ones included (which the workers could otherwise join)."""
    try:
        with _tcp_socket(host) as probe:
            probe.bind((host, port))
            port = probe.getsockname()[1]
        return _listener(host, port)
    except OSError as exc:
        raise SystemExit(f"tputune: cannot serve on {host}:{port}: {exc}") from exc


class EndingStreamsServer(uvicorn.Server):
    """uvicorn's server, which ends this process's followed streams when it shuts down (SIGTERM).

    It waits for every open response to end before it stops, and a followed stream ends when its job does,
    hours away maybe: one dashboard page left open kept `tputune serve` from stopping, until a SIGKILL (on
    GKE, at the end of the pod's grace period) skipped the app's shutdown (the job writer's last batch,
    the dispatcher, the leader's Lease). Event streams end plainly, and their clients follow again from
    their last event; streams asked for while it shuts down get 503."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        from api.streams import end_all_streams

        end_all_streams()
        await super().shutdown(sockets)


class EndingStreamsProcess(multiprocess.Process):
    """A uvicorn worker process whose server is an EndingStreamsServer."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = EndingStreamsServer(config=self.config)
        return self._server


class OwnSocketProcess(EndingStreamsProcess):
    """A uvicorn worker that listens on a socket it binds itself (SO_REUSEPORT, the port the supervisor
    holds) instead of on one it inherits. Spawned: the worker unpickles this class from this module."""

    def target(self, sockets: list[socket.socket] | None = None) -> None:  # pragma: no cover (a worker)
        try:
            sock = _listener(self.config.host, self.config.port)
        except OSError as exc:
            print(f"tputune: a worker cannot bind {self.config.host}:{self.config.port}: {exc}", flush=True)
            sys.exit(STARTUP_FAILURE)
        super().target([sock])


class _CoalescedWrites:
    """A transport whose writes of one step of the event loop go out together, in one write(2).

    uvicorn writes a response's headers as soon as the app sends them and its body next, in the same step:
    two system calls and two TCP segments for every small response. Here they are joined and written when
    the loop next runs its callbacks: before it waits for I/O again, so nothing waits longer for it (a
    stream's headers included). Everything but write and close is the transport's own."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: Any, loop: Any) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self._flush)
        else:
            self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # (no httptools: uvicorn's default protocol, unchanged)
    CoalescingHttpToolsProtocol: type | None = None
else:

    class CoalescingHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[no-redef]
        """uvicorn's httptools protocol, writing through _CoalescedWrites: one write(2) per response; and
        refusing a request whose header fields add up to more than MAX_HEADER_BYTES with 431. httptools
        takes any: a 2 MB header or 200,000 of them were parsed, held and handed to the app."""

        _header_bytes = 0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(_CoalescedWrites(transport, self.loop))  # type: ignore[arg-type]

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_bytes += len(name) + len(value) + 4  # (": " and CRLF)
            if self._header_bytes > MAX_HEADER_BYTES:
                raise HeaderFieldsTooLarge  # (the parser stops; uvicorn answers with send_400_response)
            super().on_header(name, value)

        def send_400_response(self, msg: str) -> None:
            if self._header_bytes <= MAX_HEADER_BYTES:
                super().send_400_response(msg)
                return
            from api.errors import error_json

            message = f"The request's header fields are larger than {MAX_HEADER_BYTES} bytes; send less."
            body = error_json("headers_too_large", message)
            head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            self.transport.write(head + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
            self.transport.close()


class HeaderFieldsTooLarge(Exception):
    """(Raised in the HTTP parser's callback: the request is answered with 431.)"""


def _remove_dead_metrics_dirs() -> None:
    """The metrics folders of servers that died without removing theirs (SIGKILL)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{METRICS_DIR_PREFIX}*-*"):
        pid = folder.name.removeprefix(METRICS_DIR_PREFIX).partition("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def worker_app() -> Any:
    """The app of one worker process (uvicorn imports it by name, in a new interpreter)."""
    from api.main import create_app
    from api.observability import configure_logging
    from api.settings import Settings

    _die_with(int(os.environ[SUPERVISOR_ENV]))
    settings = Settings()
    configure_logging(settings.log_level, settings.log_format == "json")
    app = create_app(settings, worker=True)
    _tune_interpreter()
    return app


def _die_with(supervisor: int) -> None:
    """Be killed when the supervisor dies: at once where Linux tells us (PR_SET_PDEATHSIG), else when we
    notice our parent changed."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != supervisor:  # it died before that took effect
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == supervisor:
            threading.Event().wait(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    if sys.platform != "linux":
        threading.Thread(target=watch, name="tputune-supervisor-watch", daemon=True).start()


def _tune_interpreter() -> None:
    """For a process about to serve requests.

    - Move everything allocated so far (the imported modules, the app) out of the garbage collector's
      sight. A full collection walked all of it, pausing every request for tens of ms: with 64 clients,
      p99 of GET /jobs/{id} was ~150 ms with the collector as is, ~70 ms without it.
    - The event loop shares the interpreter with the job writer thread (and the dispatcher's, when it is
      not a process of its own; these figures were measured so, before most jobs were written on the loop
      itself: the thread now writes those with an Idempotency-Key). A thread that got an answer from the
      database waits for the loop to let go of the GIL: up to the switch interval, 5 ms by default, per
      round trip. At 1 ms, POST /jobs at 64 clients (2 cores, 2 runs each): SQLite 1,910-2,490 req/s, p99
      42-52 ms (5 ms: 1,650-1,940, p99 57-63); PostgreSQL 2,089-2,200, p99 54-56 ms (5 ms: 1,484-1,900,
      p99 65-74).
    """
    import gc

    import uvicorn.loops.auto
    import uvicorn.protocols.http.auto  # noqa: F401  (uvloop and httptools, when installed)

    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
