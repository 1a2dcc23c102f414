"""An in-process Google Cloud Storage emulator for tests.

:class:`GcsEmulator` runs the ``gcp-storage-emulator`` package's HTTP server in a background
thread on 127.0.0.1 and a free port, with in-memory storage, and hands out real
``google.cloud.storage.Client`` objects pointed at it with anonymous credentials (no Google
credentials, no network).

Notes on the emulator (checked with gcp-storage-emulator 2026.7.19 and google-cloud-storage 3.x):

* What works with the real client as is: ``create_bucket``, ``upload_from_string`` /
  ``upload_from_filename`` (multipart, and resumable above 8 MiB), ``blob.open("wb"/"rb")``,
  ``download_as_bytes`` (also ranges), ``download_to_filename``, ``blob.exists()``,
  ``blob.reload()`` / ``bucket.get_blob()`` (``size`` as an int, ``md5_hash``, ``crc32c``),
  ``list_blobs`` with ``prefix`` / ``delimiter`` (``iterator.prefixes``) / ``match_glob``,
  ``copy_blob``, ``rename_blob``, ``delete``, ``bucket.delete(force=True)``, object names with
  spaces, ``#``, ``?``, non-ASCII characters or a trailing ``/``.  Missing blobs and buckets raise
  ``google.api_core.exceptions.NotFound`` (download, reload, delete, upload into a missing
  bucket); ``bucket.get_blob()`` returns ``None``.
* A ``Blob`` made with ``bucket.blob(name)`` has ``size is None`` until ``reload()`` (this is the
  real client's behaviour too); use ``bucket.get_blob(name)`` or ``blob.reload()`` for the size.
* QUIRK: generation preconditions are ignored.  ``if_generation_match=0`` ("create only if
  absent") overwrites an existing object instead of raising ``PreconditionFailed`` (412), and a
  wrong ``if_generation_match`` on upload or delete still succeeds.  Do not test
  create-if-absent / compare-and-swap logic against the emulator; check ``blob.exists()`` or
  compare ``generation`` yourself if a test needs that behaviour.
* The server is a plain single-threaded ``http.server.HTTPServer``: requests are served one at
  a time (several threads/clients at once work, they are just serialised).  A client that keeps
  one request open while making another (e.g. streaming a download into an upload through the
  emulator) would deadlock.
* ``wipe()`` uses the emulator's own ``GET /wipe`` endpoint (not part of the real GCS API).
* Stopping the server takes up to 0.5 s (``serve_forever`` poll interval).

``GcsEmulator.env()`` gives the environment variables (``STORAGE_EMULATOR_HOST``,
``GOOGLE_CLOUD_PROJECT``) that make code calling a bare ``storage.Client()`` talk to the
emulator; the ``gcs`` fixture sets them for the duration of each test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import urllib.request
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Self

from gcp_storage_emulator.server import create_server
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

__all__ = ["GcsEmulator", "no_proxy_env"]

HOST = "127.0.0.1"
PROJECT = "test"


def no_proxy_env(host: str) -> dict[str, str]:
    """``NO_PROXY`` and ``no_proxy`` with ``host`` added to their current value."""
    env: dict[str, str] = {}
    for key in ("NO_PROXY", "no_proxy"):
        entries = [e for e in os.environ.get(key, "").split(",") if e.strip()]
        if host not in entries:
            entries.append(host)
        env[key] = ",".join(entries)
    return env


class GcsEmulator:
    """The ``gcp-storage-emulator`` server, in-process, with in-memory storage."""

    def __init__(self, host: str = HOST, port: int = 0, project: str = PROJECT) -> None:
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        self.project = project
        self._server: Any = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> Self:
        if self._server is not None:
            return self
        # The emulator logs every request at INFO and warns on each plain-text response.
        logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
        server = create_server(self.host, self._requested_port, in_memory=True)
        server.start()
        httpd = server._api._httpd
        if httpd is None:  # pragma: no cover - start() waits for the socket to be bound
            server.stop()
            raise RuntimeError("the GCS emulator did not start")
        self.port = int(httpd.server_address[1])
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- access -----------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """Base URL of the emulator, e.g. ``http://127.0.0.1:40123``."""
        if self.port is None:
            raise RuntimeError("the GCS emulator is not running (call start())")
        return f"http://{self.host}:{self.port}"

    def client(self) -> storage.Client:
        """A real ``google.cloud.storage.Client`` talking to the emulator anonymously."""
        return storage.Client(
            project=self.project,
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.endpoint},
        )

    def env(self) -> dict[str, str]:
        """Environment variables that point a bare ``storage.Client()`` at the emulator.

        Also adds the emulator's host to ``NO_PROXY`` / ``no_proxy`` so that an HTTP proxy set in
        the environment (as on some CI runners) is not used for it.
        """
        env = {"STORAGE_EMULATOR_HOST": self.endpoint, "GOOGLE_CLOUD_PROJECT": self.project}
        env.update(no_proxy_env(self.host))
        return env

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """Set :meth:`env` for the duration of the block, restoring the old values after."""
        env = self.env()
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def make_bucket(self, name: str, client: storage.Client | None = None) -> storage.Bucket:
        """Create a bucket (or return the existing one) and return it."""
        client = client or self.client()
        bucket = client.bucket(name)
        if not bucket.exists():
            bucket = client.create_bucket(name)
        return bucket

    def wipe(self, keep_buckets: bool = False) -> None:
        """Delete all objects, and all buckets unless ``keep_buckets``.

        Goes through the emulator's ``GET /wipe`` endpoint, so it is serialised with the requests
        the server thread is handling.
        """
        url = self.endpoint + "/wipe" + ("?keep-buckets=1" if keep_buckets else "")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=30) as response:
            body = response.read()
        if response.status != 200 or body != b"OK":
            raise RuntimeError(f"wiping the GCS emulator failed: {response.status} {body!r}")

    def gs_uri(self, bucket: str, name: str = "") -> str:
        return f"gs://{bucket}/{name}"
