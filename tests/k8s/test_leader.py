"""Leader election on the Lease: one replica dispatches; a graceful stop hands over at once, a dead leader
is replaced once its lease runs out, and two candidates never both win."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from api.executors.kubernetes import KubeClient
from api.leader import LeaderElector
from api.settings import Settings
from tests.conftest import LiveApi
from tests.k8s.cluster import NAMESPACE, Cluster
from tests.k8s.fake_apiserver import FakeKubernetes
from tests.k8s.test_reconciler import FINAL, running, submit


def wait(predicate: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def elector(settings: dict[str, Any], identity: str) -> LeaderElector:
    config = Settings(**settings)
    return LeaderElector(KubeClient(config), config, identity=identity)


def leading(api: LiveApi) -> bool:
    assert api.server is not None
    app: Any = api.server.config.app
    return bool(app.state.leader.is_leader())


def test_one_replica_dispatches_and_hands_over_on_shutdown(
    k8s_api: Callable[..., LiveApi], cluster: Cluster, fake_k8s: FakeKubernetes, dataset_uri: str
) -> None:
    # Dispatcher threads: this test watches each replica's elector (app.state.leader). Each replica's
    # dispatcher process runs the same elector (test_reconciler's jobs are dispatched that way).
    first = k8s_api(dispatcher_process=False)
    wait(lambda: leading(first))
    second = k8s_api(dispatcher_process=False)
    job_id = submit(second, dataset_uri)  # taken in by the follower, dispatched by the leader
    running(second, cluster, job_id)
    # With a 1 s lease, a renewal late by 0.67 s on a busy machine leaves the leader not leading for a
    # moment, and one late past the lease hands it to the other replica: whichever holds it now hands over.
    wait(lambda: leading(first) or leading(second))
    leader, follower = (first, second) if leading(first) else (second, first)
    assert not leading(follower)
    lease = fake_k8s.get("leases", "tputune-dispatcher", NAMESPACE)
    assert lease is not None
    transitions = lease["spec"]["leaseTransitions"]
    leader.stop()  # releases the Lease: the follower takes over without waiting it out
    started = time.monotonic()
    wait(lambda: leading(follower))
    assert time.monotonic() - started < 1.0
    cluster.complete(job_id)
    assert follower.wait_for(job_id, lambda j: j["status"] in FINAL)["status"] == "succeeded"
    lease = fake_k8s.get("leases", "tputune-dispatcher", NAMESPACE)
    assert lease is not None and lease["spec"]["leaseTransitions"] == transitions + 1
    assert fake_k8s.count("create", "jobsets") == 1


def test_a_silent_leader_is_replaced_after_its_lease(k8s_settings: dict[str, Any]) -> None:
    settings = {**k8s_settings, "k8s_lease_seconds": 3.0}  # margins for a busy test machine
    a, b = elector(settings, "a"), elector(settings, "b")
    assert a.try_acquire_or_renew() and a.is_leader()
    assert not b.try_acquire_or_renew() and not b.is_leader()
    # a stops renewing (its process hangs, or its node goes away)
    time.sleep(a.renew_deadline + 0.05)
    assert not a.is_leader()  # it stops leading before anyone may take over
    assert not b.try_acquire_or_renew()  # the lease runs out on b's clock, from when b first saw it
    time.sleep(b.duration - a.renew_deadline)
    assert b.try_acquire_or_renew() and b.is_leader()
    assert not a.try_acquire_or_renew()


def test_two_candidates_never_both_win(k8s_settings: dict[str, Any], fake_k8s: FakeKubernetes) -> None:
    a, b, c = (elector(k8s_settings, name) for name in "abc")
    assert a.try_acquire_or_renew()
    a.stop()  # released: free for the taking
    stale = b.kube.get_lease(b.name)
    assert c.try_acquire_or_renew()  # c writes first
    b.kube.get_lease = lambda name: stale  # type: ignore[method-assign]  # b decides on what it read before
    assert not b.try_acquire_or_renew() and not b.is_leader()
    lease = fake_k8s.get("leases", "tputune-dispatcher", NAMESPACE)
    assert lease is not None and lease["spec"]["holderIdentity"] == "c"
    assert lease["spec"]["leaseTransitions"] == 1
