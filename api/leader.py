"""Leader election on a coordination.k8s.io Lease: of several API replicas, only the holder dispatches.

The rules are client-go's. The holder renews the Lease every `retry` seconds and counts itself leader only
while its last renewal is younger than `renew_deadline`, shorter than the lease, so it stops before anyone
may take over. The others take the Lease once its record has not changed for `leaseDurationSeconds` of their
own clock (no trust in anyone's wall clock), or at once when the holder released it on shutdown. Writes carry
the resourceVersion read, so two candidates never both win.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from api.executors.kubernetes import KubeClient
from api.settings import Settings

log = logging.getLogger(__name__)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        kube: KubeClient,
        settings: Settings,
        identity: str | None = None,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.kube = kube
        self.name = settings.k8s_lease_name
        self.namespace = settings.k8s_namespace
        self.duration = max(1, math.ceil(settings.k8s_lease_seconds))
        self.renew_deadline = self.duration * 2 / 3
        self.retry = self.duration / 5
        self.identity = identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.on_change = on_change
        self._observed: tuple[str, str] | None = None
        self._observed_at = 0.0
        self._renewed_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def is_leader(self) -> bool:
        renewed = self._renewed_at
        return renewed is not None and time.monotonic() - renewed < self.renew_deadline

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tputune-leader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and hand the Lease over (the next candidate takes it without waiting it out)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.is_leader():
            try:
                self._release()
            except Exception as exc:  # the Lease expires on its own
                log.warning("could not release the leader Lease: %s", exc)
        self._set(None)
        self.kube.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.try_acquire_or_renew()
            except Exception as exc:
                log.warning("leader election: %s", exc)
            if self._renewed_at is not None and not self.is_leader():
                log.warning("%s could not renew the Lease in time; no longer the leader", self.identity)
                self._set(None)
            self._stop.wait(self.retry)

    def _set(self, renewed_at: float | None) -> None:
        was = self._renewed_at is not None
        self._renewed_at = renewed_at
        if was != (renewed_at is not None):
            log.info(
                "%s %s the leader", self.identity, "is now" if renewed_at is not None else "is no longer"
            )
            if self.on_change is not None:
                self.on_change(renewed_at is not None)

    def _body(self, spec: dict[str, Any], version: str | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if version is not None:
            metadata["resourceVersion"] = version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}

    def try_acquire_or_renew(self) -> bool:
        """One round: take or renew the Lease if it is ours, free or expired. True while leader."""
        now = _now()
        lease = self.kube.get_lease(self.name)
        if lease is None:
            fresh: dict[str, Any] = {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.duration,
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": 0,
            }
            try:
                self.kube.create_lease(self._body(fresh, None))
            except ApiException as exc:
                if exc.status != 409:
                    raise
                return False  # another replica created it first
            self._set(time.monotonic())
            return True
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        record = (holder, str(spec.get("renewTime")))
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        duration = spec.get("leaseDurationSeconds") or self.duration
        if holder and holder != self.identity and time.monotonic() < self._observed_at + duration:
            self._set(None)
            return False
        ours = holder == self.identity
        renewed = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.duration,
            "acquireTime": spec.get("acquireTime") if ours else now,
            "renewTime": now,
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (0 if ours else 1),
        }
        try:
            self.kube.replace_lease(self.name, self._body(renewed, lease["metadata"]["resourceVersion"]))
        except ApiException as exc:
            if exc.status != 409:
                raise
            self._set(None)
            return False  # someone wrote the Lease since we read it
        self._set(time.monotonic())
        return True

    def _release(self) -> None:
        lease = self.kube.get_lease(self.name)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": _now()}
        self.kube.replace_lease(self.name, self._body(spec, lease["metadata"]["resourceVersion"]))


def make_leader(settings: Settings) -> LeaderElector | None:
    """The Lease election of a kubernetes deployment, where several API replicas may run."""
    if not settings.k8s_leader_election:
        return None
    return LeaderElector(KubeClient(settings), settings)
