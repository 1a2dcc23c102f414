"""A fake Kubernetes API server: real HTTP on 127.0.0.1, speaking enough of the REST protocol for the official
client to run tputune's kubernetes executor and leader election against it.

It keeps JobSets, pods (with their logs), Secrets, ConfigMaps and Leases in memory, and serves: get, list
(with `labelSelector`), watch (newline-delimited events from a `resourceVersion`; a version older than the
last `compact()` gets an ERROR event with a 410 Status), create (409 AlreadyExists), update (409 Conflict on
a stale `resourceVersion`), merge patch, the status subresource, delete (Background, Foreground, Orphan;
owned objects are garbage-collected with their owner) and the pod log (`tailLines`, `follow`).

Tests play the controllers through `put`, `mutate` and `remove`, and inject faults: `fail_next(n)` answers the
next n requests with a 5xx, `stop()` closes the listener and every open connection (clients get refused
connections) until `start()` listens again on the same port. `audit` records every (api group, resource,
verb) the clients used, for checking the RBAC Role.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    status_subresource: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


KINDS = {
    k.plural: k
    for k in (
        Kind("", "v1", "pods", "Pod", status_subresource=True),
        Kind("", "v1", "secrets", "Secret"),
        Kind("", "v1", "configmaps", "ConfigMap"),
        Kind("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet", status_subresource=True),
        Kind("coordination.k8s.io", "v1", "leases", "Lease"),
    )
}


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def matches(labels: dict[str, str], selector: str | None) -> bool:
    """Equality-based label selectors: `k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-separated."""
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.body = status_body(code, reason, message)
        self.code = code


@dataclass
class Event:
    version: int
    plural: str
    namespace: str
    type: str
    obj: dict[str, Any]


class FakeKubernetes:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history: list[Event] = []
        self.version = 0
        self.compacted = 0
        self.logs: dict[tuple[str, str], list[str]] = {}
        self.audit: list[tuple[str, str, str]] = []
        self.hold_foreground = False
        self.deletions: list[tuple[str, str, str]] = []  # (resource, name, propagationPolicy) asked for
        self.expired = 0  # watches answered 410 Gone
        self.refuse_create: dict[str, ApiError] = {}  # resource -> the error its creation gets
        self._failures: list[int] = []
        self._changed = threading.Condition()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._generation = 0  # bumped by stop() and drop_watches(): open streams end
        self.port = 0

    # --- the listener ---

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeKubernetes:
        handler = type("Handler", (_Handler,), {"fake": self})
        server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Refuse connections: close the listener and every open connection."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        with self._changed:
            self._generation += 1
            self._changed.notify_all()
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._connections.clear()

    def close(self) -> None:
        self.stop()

    def drop_watches(self) -> None:
        """End every open watch and log stream (as a load balancer dropping idle connections would)."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    # --- faults and audit ---

    def fail_next(self, count: int, code: int = 500) -> None:
        with self._changed:
            self._failures.extend([code] * count)

    def used(self) -> set[tuple[str, str, str]]:
        return set(self.audit)

    def count(self, verb: str, resource: str) -> int:
        return sum(1 for _group, res, v in self.audit if v == verb and res == resource)

    # --- the store, for tests playing the controllers ---

    def get(self, plural: str, name: str, namespace: str) -> dict[str, Any] | None:
        with self._changed:
            obj = self.objects.get((plural, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def select(self, plural: str, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        with self._changed:
            return [
                copy.deepcopy(obj)
                for (p, ns, _), obj in sorted(self.objects.items())
                if p == plural and ns == namespace and matches(obj["metadata"].get("labels") or {}, selector)
            ]

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object as a controller would (status included)."""
        with self._changed:
            meta = obj["metadata"]
            key = (plural, meta["namespace"], meta["name"])
            if key in self.objects:
                return self._store(plural, meta["namespace"], obj, "MODIFIED")
            return self._create(plural, meta["namespace"], obj, keep_status=True)

    def mutate(
        self, plural: str, name: str, namespace: str, change: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        with self._changed:
            obj = copy.deepcopy(self.objects[(plural, namespace, name)])
            change(obj)
            return self._store(plural, namespace, obj, "MODIFIED")

    def remove(self, plural: str, name: str, namespace: str) -> None:
        with self._changed:
            self._delete(plural, namespace, name, "Background")

    def compact(self) -> None:
        """Forget the event history: a watch from an older resourceVersion now gets 410 Gone."""
        with self._changed:
            self.history.clear()
            self.compacted = self.version

    def append_log(self, pod: str, namespace: str, *lines: str) -> None:
        with self._changed:
            self.logs.setdefault((namespace, pod), []).extend(lines)
            self._changed.notify_all()

    # --- store internals (callers hold self._changed) ---

    def _bump(self) -> int:
        self.version += 1
        return self.version

    def _record(self, plural: str, namespace: str, type_: str, obj: dict[str, Any]) -> None:
        self.history.append(Event(self.version, plural, namespace, type_, copy.deepcopy(obj)))
        self._changed.notify_all()

    def _create(self, plural: str, namespace: str, obj: dict[str, Any], keep_status: bool) -> dict[str, Any]:
        kind = KINDS[plural]
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", f"{kind.kind}.metadata.name: Required value")
        if (plural, namespace, name) in self.objects:
            qualified = f"{plural}.{kind.group}" if kind.group else plural
            raise ApiError(409, "AlreadyExists", f'{qualified} "{name}" already exists')
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        meta.update(
            namespace=namespace,
            uid=str(uuid.uuid4()),
            creationTimestamp=meta.get("creationTimestamp") or now(),
            generation=1,
        )
        if kind.status_subresource and not keep_status:
            obj.pop("status", None)
        if plural == "secrets":
            self._encode_secret(obj)
        meta["resourceVersion"] = str(self._bump())
        self.objects[(plural, namespace, name)] = obj
        self._record(plural, namespace, "ADDED", obj)
        return copy.deepcopy(obj)

    def _store(self, plural: str, namespace: str, obj: dict[str, Any], type_: str) -> dict[str, Any]:
        if plural == "secrets":
            self._encode_secret(obj)
        obj["metadata"]["resourceVersion"] = str(self._bump())
        self.objects[(plural, namespace, obj["metadata"]["name"])] = obj
        self._record(plural, namespace, type_, obj)
        return copy.deepcopy(obj)

    @staticmethod
    def _encode_secret(obj: dict[str, Any]) -> None:
        for key, value in (obj.pop("stringData", None) or {}).items():
            obj.setdefault("data", {})[key] = base64.b64encode(value.encode()).decode()

    def _existing(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.objects.get((plural, namespace, name))
        if obj is None:
            kind = KINDS[plural]
            raise ApiError(
                404, "NotFound", f'{plural}{"." + kind.group if kind.group else ""} "{name}" not found'
            )
        return obj

    def _delete(self, plural: str, namespace: str, name: str, propagation: str) -> dict[str, Any]:
        obj = self._existing(plural, namespace, name)
        uid = obj["metadata"]["uid"]
        dependents = [
            key
            for key, other in self.objects.items()
            if any(ref.get("uid") == uid for ref in other["metadata"].get("ownerReferences") or [])
        ]
        if propagation == "Orphan":
            for key in dependents:
                dependent = copy.deepcopy(self.objects[key])
                refs = dependent["metadata"]["ownerReferences"]
                dependent["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                self._store(key[0], key[1], dependent, "MODIFIED")
            dependents = []
        if propagation == "Foreground":
            if not obj["metadata"].get("deletionTimestamp"):
                marked = copy.deepcopy(obj)
                marked["metadata"]["deletionTimestamp"] = now()
                marked["metadata"]["finalizers"] = ["foregroundDeletion"]
                obj = self._store(plural, namespace, marked, "MODIFIED")
            for key in dependents:
                if key in self.objects:
                    self._delete(*key, "Background")
            if self.hold_foreground:
                return copy.deepcopy(obj)
        else:
            for key in dependents:
                if key in self.objects:
                    self._delete(*key, "Background")
        gone = self.objects.pop((plural, namespace, name))
        if plural == "pods":
            self.logs.pop((namespace, name), None)  # (a new pod of the same name starts a log of its own)
        self._bump()
        self._record(plural, namespace, "DELETED", gone)
        return gone

    def finish_deletions(self) -> None:
        """Let foreground deletions held by `hold_foreground` complete."""
        with self._changed:
            self.hold_foreground = False
            for key, obj in list(self.objects.items()):
                if obj["metadata"].get("deletionTimestamp"):
                    self._delete(*key, "Foreground")

    # --- the REST protocol ---

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        """One request that is not a stream: (status, JSON body)."""
        plural, namespace, name, sub = self._route(path)
        kind = KINDS[plural]
        verb = {
            "GET": "get" if name else "list",
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete",
        }[method]
        self._audit(kind, plural, sub, verb)
        self._fault()
        with self._changed:
            if method == "GET" and name is None:
                items = self.select(plural, namespace, query.get("labelSelector"))
                return 200, {
                    "kind": f"{kind.kind}List",
                    "apiVersion": kind.api_version,
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                }
            if method == "POST":
                if name is not None:
                    raise ApiError(405, "MethodNotAllowed", "create on a named object")
                if plural in self.refuse_create:
                    raise self.refuse_create[plural]
                return 201, self._create(plural, namespace, body, keep_status=False)
            assert name is not None
            current = self._existing(plural, namespace, name)
            if method == "GET":
                return 200, copy.deepcopy(current)
            if method == "DELETE":
                propagation = (
                    query.get("propagationPolicy") or (body or {}).get("propagationPolicy") or "Background"
                )
                self.deletions.append((plural, name, propagation))
                return 200, self._delete(plural, namespace, name, propagation)
            if method == "PATCH":
                body = merge_patch(current, body)
            return 200, self._update(kind, plural, namespace, current, body, sub)

    def _update(
        self,
        kind: Kind,
        plural: str,
        namespace: str,
        current: dict[str, Any],
        body: dict[str, Any],
        sub: str | None,
    ) -> dict[str, Any]:
        wanted = body.get("metadata", {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {plural} "{current["metadata"]["name"]}": the object has '
                "been modified; please apply your changes to the latest version and try again",
            )
        updated = copy.deepcopy(current)
        if sub == "status":
            updated["status"] = copy.deepcopy(body.get("status"))
        else:
            for key, value in body.items():
                if key != "status" or not kind.status_subresource:
                    updated[key] = copy.deepcopy(value)
            for key in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
                if key in current["metadata"]:
                    updated["metadata"][key] = current["metadata"][key]
        return self._store(plural, namespace, updated, "MODIFIED")

    def _route(self, path: str) -> tuple[str, str, str | None, str | None]:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            rest = parts[2:]
        elif parts[:1] == ["apis"] and len(parts) > 3:
            rest = parts[3:]
        else:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        if len(rest) < 3 or rest[0] != "namespaces" or rest[2] not in KINDS:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        kind = KINDS[rest[2]]
        group = parts[1] if parts[0] == "apis" else ""
        if group != kind.group:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        return rest[2], rest[1], rest[3] if len(rest) > 3 else None, rest[4] if len(rest) > 4 else None

    def _audit(self, kind: Kind, plural: str, sub: str | None, verb: str) -> None:
        with self._changed:
            self.audit.append((kind.group, f"{plural}/{sub}" if sub else plural, verb))

    def _fault(self) -> None:
        with self._changed:
            code = self._failures.pop(0) if self._failures else None
        if code is not None:
            raise ApiError(code, "InternalError", "an injected failure")

    def open_watch(self, path: str, query: dict[str, str]) -> tuple[str, str, int]:
        """Check a watch request: (plural, namespace, resourceVersion to start after)."""
        plural, namespace, _name, _sub = self._route(path)
        self._audit(KINDS[plural], plural, None, "watch")
        self._fault()
        return plural, namespace, int(query.get("resourceVersion") or 0)

    def events_after(
        self, plural: str, namespace: str, version: int, selector: str | None
    ) -> tuple[list[Event], int] | None:
        """The events to send after `version` and the version they bring the watch to; None when `version`
        was compacted away (410). Version 0 (none given) starts with the current objects, as ADDED events."""
        with self._changed:

            def wanted(p: str, ns: str, obj: dict[str, Any]) -> bool:
                return (
                    p == plural and ns == namespace and matches(obj["metadata"].get("labels") or {}, selector)
                )

            if version == 0:
                current = [
                    Event(self.version, p, ns, "ADDED", copy.deepcopy(obj))
                    for (p, ns, _), obj in sorted(self.objects.items())
                    if wanted(p, ns, obj)
                ]
                return current, self.version
            if version < self.compacted:
                return None
            events = [e for e in self.history if e.version > version and wanted(e.plural, e.namespace, e.obj)]
            return events, self.version

    def wait(self, generation: int, timeout: float) -> bool:
        """Wait for a change; False once the stream must end (stop or drop_watches)."""
        with self._changed:
            if self._generation != generation:
                return False
            self._changed.wait(timeout)
            return self._generation == generation


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKubernetes
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.fake._changed:
            self.fake._connections.add(self.connection)

    def finish(self) -> None:
        with self.fake._changed:
            self.fake._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw else None

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _start_stream(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        try:
            body = self._body()
            if self.command == "GET" and query.get("watch") in ("true", "1"):
                self._watch(url.path, query)
            elif self.command == "GET" and url.path.endswith("/log"):
                self._log(url.path, query)
            else:
                code, answer = self.fake.handle(self.command, url.path, query, body)
                self._send(code, answer)
        except ApiError as exc:
            self._send(exc.code, exc.body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch

    def _watch(self, path: str, query: dict[str, str]) -> None:
        fake = self.fake
        plural, namespace, version = fake.open_watch(path, query)
        selector = query.get("labelSelector")
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 3600)
        generation = fake._generation
        self._start_stream("application/json")
        while time.monotonic() < deadline:
            found = fake.events_after(plural, namespace, version, selector)
            if found is None:
                fake.expired += 1
                gone = status_body(410, "Expired", f"too old resource version: {version} ({fake.compacted})")
                self._chunk(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
                break
            events, version = found
            for event in events:
                self._chunk(json.dumps({"type": event.type, "object": event.obj}).encode() + b"\n")
            if not fake.wait(generation, min(0.2, max(0.0, deadline - time.monotonic()))):
                break
        self._end_stream()

    def _log(self, path: str, query: dict[str, str]) -> None:
        fake = self.fake
        parts = [p for p in path.split("/") if p]  # api v1 namespaces <ns> pods <name> log
        namespace, pod = parts[3], parts[5]
        fake._audit(KINDS["pods"], "pods", "log", "get")
        fake._fault()
        if fake.get("pods", pod, namespace) is None:
            raise ApiError(404, "NotFound", f'pods "{pod}" not found')
        with fake._changed:
            lines = list(fake.logs.get((namespace, pod), []))
        tail = int(query["tailLines"]) if "tailLines" in query else None
        shown = lines[-tail:] if tail is not None else lines
        if query.get("follow") not in ("true", "1"):
            self._send(200, "".join(f"{line}\n" for line in shown).encode(), "text/plain")
            return
        generation = fake._generation
        self._start_stream("text/plain")
        for line in shown:
            self._chunk(f"{line}\n".encode())
        sent = len(lines)
        while fake.get("pods", pod, namespace) is not None:
            with fake._changed:
                fresh = fake.logs.get((namespace, pod), [])[sent:]
            for line in fresh:
                self._chunk(f"{line}\n".encode())
            sent += len(fresh)
            if not fake.wait(generation, 0.2):
                break
        self._end_stream()
