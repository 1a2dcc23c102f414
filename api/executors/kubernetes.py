"""The kubernetes executor: each job runs as a JobSet on GKE TPU slices (rendered by api/jobset.py).

Three layers: `KubeClient` is every call tputune makes to the API server (one method per RBAC verb, with
retries on 5xx and dropped connections); `Informer` keeps a watched cache of JobSets and pods (list, then
watch from its resourceVersion; a 410 Gone or a resync relists); `KubernetesExecutor` implements the
Executor protocol and reads a job's state off the cache (`observation_of`, a pure function).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch import Watch

from api import jobset as render
from api import tpu
from api.executors import ExecutorUnavailable, LaunchRefused, Observation
from api.models import Job, job_spec
from api.settings import Settings
from worker.config import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED

log = logging.getLogger(__name__)

SELECTOR = f"{render.LABEL_MANAGED_BY}={render.MANAGED_BY}"
RETRIES = 4
RETRY_DELAY_SECONDS = 0.2
WATCH_SECONDS = 60.0  # one watch request's length; the next resumes from its resourceVersion
CRASH_LOG_LINES = 20  # of a crashed worker's log, read before its JobSet's restart deletes it
FOLLOW_READ_SECONDS = 3600.0  # a followed log silent this long ends its stream
_RETRIED_STATUSES = frozenset({0, 429, 500, 502, 503, 504})
_IMAGE_PULL = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
_CANNOT_START = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})


class KubernetesUnavailable(ExecutorUnavailable):
    """The API server did not answer after the retries."""


def api_message(exc: ApiException) -> str:
    """The sentence in a Kubernetes `Status` error body, else the HTTP reason."""
    try:
        return str(json.loads(exc.body or "")["message"])
    except (ValueError, KeyError, TypeError):
        return str(exc.reason)


def _configuration(settings: Settings) -> client.Configuration:
    """The API server to talk to: TPUTUNE_K8S_API_SERVER as is, else in-cluster, else the kubeconfig."""
    if settings.k8s_api_server:
        configuration = client.Configuration(host=settings.k8s_api_server.rstrip("/"))
    else:
        configuration = client.Configuration()
        try:
            if settings.k8s_kubeconfig is None and _in_cluster(configuration):
                pass
            else:
                path = str(settings.k8s_kubeconfig) if settings.k8s_kubeconfig else None
                config.load_kube_config(config_file=path, client_configuration=configuration)
        except (config.ConfigException, OSError) as exc:
            raise RuntimeError(
                "The kubernetes executor found no cluster: not running in one, and no usable kubeconfig "
                f"({exc}). Set TPUTUNE_K8S_KUBECONFIG or TPUTUNE_K8S_API_SERVER."
            ) from exc
    configuration.retries = False  # retried here, with backoff, for every call alike
    return configuration


def _in_cluster(configuration: client.Configuration) -> bool:
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        return False
    return True


def _describe(error: Exception) -> str:
    if isinstance(error, ApiException):
        return f"{error.status} {api_message(error)}"
    return str(error)


class KubeClient:
    """The API server calls tputune makes, in one namespace, on plain dicts. Each method is one RBAC verb
    on one resource (manifests/base/rbac.yaml grants exactly these)."""

    def __init__(self, settings: Settings) -> None:
        self.namespace = settings.k8s_namespace
        self.timeout = settings.k8s_request_timeout_seconds
        self.api = client.ApiClient(_configuration(settings))
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.coordination = client.CoordinationV1Api(self.api)

    def close(self) -> None:
        self.api.close()

    def _call(self, fn: Callable[..., Any], *args: Any, parse: bool = True, **kwargs: Any) -> Any:
        """The JSON answer (or with `parse=False`, the raw response) of one call, retried with backoff on
        5xx, 429 and connection errors."""
        kwargs.setdefault("_request_timeout", (self.timeout, self.timeout))
        for attempt in range(RETRIES):
            try:
                response = fn(*args, _preload_content=False, **kwargs)
                return json.loads(response.data) if parse else response
            except ApiException as exc:
                if exc.status not in _RETRIED_STATUSES:
                    raise
                error: Exception = exc
            except (urllib3.exceptions.HTTPError, ConnectionError) as exc:
                error = exc
            if attempt < RETRIES - 1:
                time.sleep(RETRY_DELAY_SECONDS * 2**attempt)
        raise KubernetesUnavailable(
            f"The Kubernetes API server did not answer: {_describe(error)}"
        ) from error

    def _get(self, fn: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
        try:
            return self._call(fn, *args)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _list(self, fn: Callable[..., Any], *args: Any, selector: str) -> tuple[list[dict[str, Any]], str]:
        answer = self._call(fn, *args, label_selector=selector)
        return answer.get("items") or [], answer["metadata"]["resourceVersion"]

    def _watch(
        self, watch: Watch, fn: Callable[..., Any], *args: Any, selector: str, version: str, seconds: float
    ) -> Iterator[dict[str, Any]]:
        """Events after `version`; ends after `seconds`; a 410 Gone raises ApiException(410)."""
        return watch.stream(
            fn,
            *args,
            label_selector=selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=max(1, int(seconds)),
            _request_timeout=(self.timeout, seconds + self.timeout),
        )

    def _jobsets(self) -> tuple[str, str, str, str]:
        return render.GROUP, render.VERSION, self.namespace, "jobsets"

    # --- jobsets: create, get, list, watch, delete ---

    def create_jobset(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(self.custom.create_namespaced_custom_object, *self._jobsets(), body)

    def get_jobset(self, name: str) -> dict[str, Any] | None:
        return self._get(self.custom.get_namespaced_custom_object, *self._jobsets(), name)

    def list_jobsets(self, selector: str) -> tuple[list[dict[str, Any]], str]:
        return self._list(self.custom.list_namespaced_custom_object, *self._jobsets(), selector=selector)

    def watch_jobsets(
        self, watch: Watch, selector: str, version: str, seconds: float
    ) -> Iterator[dict[str, Any]]:
        fn = self.custom.list_namespaced_custom_object
        return self._watch(watch, fn, *self._jobsets(), selector=selector, version=version, seconds=seconds)

    def delete_jobset(self, name: str) -> bool:
        """Delete with foreground propagation: the JobSet stays (deleting) until its pods are gone."""
        fn = self.custom.delete_namespaced_custom_object
        return self._delete(fn, *self._jobsets(), name, propagation_policy="Foreground")

    # --- pods: list, watch; pods/log: get ---

    def list_pods(self, selector: str) -> tuple[list[dict[str, Any]], str]:
        return self._list(self.core.list_namespaced_pod, self.namespace, selector=selector)

    def watch_pods(
        self, watch: Watch, selector: str, version: str, seconds: float
    ) -> Iterator[dict[str, Any]]:
        fn = self.core.list_namespaced_pod
        return self._watch(watch, fn, self.namespace, selector=selector, version=version, seconds=seconds)

    def read_pod_log(self, name: str, container: str, tail: int) -> str:
        response = self._call(
            self.core.read_namespaced_pod_log,
            name,
            self.namespace,
            container=container,
            tail_lines=tail,
            parse=False,
        )
        return bytes(response.data).decode("utf-8", "replace")

    def stream_pod_log(self, name: str, container: str, tail: int) -> Any:
        """The open log stream (an urllib3 response) of a pod's container, following new lines."""
        return self._call(
            self.core.read_namespaced_pod_log,
            name,
            self.namespace,
            container=container,
            tail_lines=tail,
            follow=True,
            parse=False,
            _request_timeout=(self.timeout, FOLLOW_READ_SECONDS),
        )

    # --- secrets and configmaps: create, patch, delete ---

    def create_secret(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(self.core.create_namespaced_secret, self.namespace, body)

    def patch_secret(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._call(
            self.core.patch_namespaced_secret,
            name,
            self.namespace,
            patch,
            _content_type="application/merge-patch+json",
        )

    def create_config_map(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(self.core.create_namespaced_config_map, self.namespace, body)

    def patch_config_map(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self._call(
            self.core.patch_namespaced_config_map,
            name,
            self.namespace,
            patch,
            _content_type="application/merge-patch+json",
        )

    def delete_secret(self, name: str) -> bool:
        return self._delete(self.core.delete_namespaced_secret, name, self.namespace)

    def delete_config_map(self, name: str) -> bool:
        return self._delete(self.core.delete_namespaced_config_map, name, self.namespace)

    def _delete(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """False when it was not there."""
        try:
            self._call(fn, *args, **kwargs)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    # --- leases: get, create, update ---

    def get_lease(self, name: str) -> dict[str, Any] | None:
        return self._get(self.coordination.read_namespaced_lease, name, self.namespace)

    def create_lease(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(self.coordination.create_namespaced_lease, self.namespace, body)

    def replace_lease(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Update with the body's resourceVersion: a 409 means someone else wrote it first."""
        return self._call(self.coordination.replace_namespaced_lease, name, self.namespace, body)


class Informer:
    """A cache of one kind of object, kept current by list + watch (resourceVersion), relisted on a 410 Gone,
    on errors (after a backoff) and every `resync_seconds`, which heals anything a watch missed."""

    def __init__(
        self,
        kind: str,
        list_objects: Callable[[], tuple[list[dict[str, Any]], str]],
        watch_objects: Callable[[Watch, str, float], Iterator[dict[str, Any]]],
        resync_seconds: float,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.kind = kind
        self._list = list_objects
        self._watch = watch_objects
        self._resync = resync_seconds
        self._on_event = on_event
        self._objects: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: Watch | None = None
        self._thread: threading.Thread | None = None
        self.synced = threading.Event()  # listed once, and watching since: the cache can be trusted

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"tputune-watch-{self.kind}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get(name)

    def select(self, predicate: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        with self._lock:
            return [obj for obj in self._objects.values() if predicate(obj)]

    def _run(self) -> None:
        delay = RETRY_DELAY_SECONDS
        while not self._stop.is_set():
            try:
                self._list_and_watch()
                delay = RETRY_DELAY_SECONDS
                continue
            except ApiException as exc:
                if exc.status == 410:
                    log.info("%s watch expired (410 Gone); relisting", self.kind)
                    continue
                error: object = exc.status
            except Exception as exc:
                error = exc
            self.synced.clear()
            if not self._stop.is_set():
                log.warning("%s watch failed (%s); relisting in %.1fs", self.kind, error, delay)
            self._stop.wait(delay)
            delay = min(delay * 2, 10.0)

    def _list_and_watch(self) -> None:
        """List, then watch from the list's resourceVersion, watch after watch, until the next resync."""
        items, version = self._list()
        with self._lock:
            self._objects = {obj["metadata"]["name"]: obj for obj in items}
        for obj in items:
            self._notify("ADDED", obj)
        self.synced.set()
        resync_at = time.monotonic() + self._resync
        while not self._stop.is_set() and (left := resync_at - time.monotonic()) > 0:
            self._watcher = Watch(return_type=object)
            for event in self._watch(self._watcher, version, min(WATCH_SECONDS, left)):
                if self._stop.is_set():
                    return
                self._apply(event["type"], event["raw_object"])
            # The Watch tracks the last resourceVersion it saw, bookmarks included.
            version = self._watcher.resource_version or version

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return  # BOOKMARK: only moves the resourceVersion on
        with self._lock:
            if kind == "DELETED":
                self._objects.pop(obj["metadata"]["name"], None)
            else:
                self._objects[obj["metadata"]["name"]] = obj
        self._notify(kind, obj)

    def _notify(self, kind: str, obj: dict[str, Any]) -> None:
        if self._on_event is not None:
            self._on_event(kind, obj)


# --- reading a JobSet and its pods ----------------------------------------------------------------------


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    status = obj.get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}


def _name(obj: dict[str, Any]) -> str:
    return str(obj["metadata"]["name"])


def _worker_exit_code(pod: dict[str, Any]) -> int | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == render.WORKER_CONTAINER:
            terminated = (status.get("state") or {}).get("terminated")
            if terminated is not None:
                return int(terminated.get("exitCode", 0))
    return None


def pod_failure(pod: dict[str, Any]) -> str | None:
    """Why a failed pod failed, in a sentence; None for a pod that has not failed."""
    if (pod.get("status") or {}).get("phase") != "Failed":
        return None
    name = _name(pod)
    disruption = _conditions(pod).get(render.DISRUPTION_TARGET)
    if disruption is not None:
        why = disruption.get("message") or disruption.get("reason") or "preemption or node maintenance"
        return f"pod {name} was stopped by the cluster ({why})"
    code = _worker_exit_code(pod)
    if code == EXIT_PREEMPTED:
        return f"the worker in pod {name} was stopped and saved a checkpoint (exit status {code})"
    if code == EXIT_BAD_INPUT:
        return f"the worker in pod {name} rejected the job's input (exit status {code})"
    if code is not None:
        return f"the worker in pod {name} exited with status {code}"
    reason = (pod.get("status") or {}).get("reason") or "unknown reason"
    return f"pod {name} failed ({reason})"


def crashed(pod: dict[str, Any]) -> bool:
    """Whether the pod's worker failed on its own: not stopped (preempted, drained), nor done with the
    job's input (bad input fails the JobSet: the job's end saves its log)."""
    if pod_failure(pod) is None or _conditions(pod).get(render.DISRUPTION_TARGET) is not None:
        return False
    return _worker_exit_code(pod) not in (None, EXIT_OK, EXIT_PREEMPTED, EXIT_BAD_INPUT)


def stuck_reason(pods: list[dict[str, Any]], shape: str) -> str | None:
    """Why pods cannot start (unschedulable, image pull, bad config, crash loop), or None."""
    for pod in sorted(pods, key=_name):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        name = _name(pod)
        status = pod.get("status") or {}
        for condition in status.get("conditions") or []:
            if (
                condition.get("type") == "PodScheduled"
                and condition.get("status") == "False"
                and condition.get("reason") == "Unschedulable"
            ):
                why = (condition.get("message") or "no node fits").rstrip(".")
                return (
                    f"Pod {name} cannot be scheduled: {why}. A node pool with {shape} TPUs must exist "
                    "and have room (or be able to scale up)."
                )
        statuses = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
        for container in statuses:
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason, message = waiting.get("reason"), (waiting.get("message") or "").rstrip(".")
            detail = f": {message}." if message else "."
            what = f"its {container['name']} container"
            if reason in _IMAGE_PULL:
                image = container.get("image", "")
                return f"Pod {name} cannot pull the image {image} of {what} ({reason}){detail}"
            if reason in _CANNOT_START:
                return f"Pod {name} cannot start {what} ({reason}){detail}"
            if reason == "CrashLoopBackOff":
                return f"Pod {name}: {what} keeps crashing ({reason}){detail} See the job's logs."
    return None


def observation_of(
    jobset: dict[str, Any],
    pods: list[dict[str, Any]],
    last_failure: str | None,
    shape: str,
    queue: str | None,
) -> Observation:
    """What a JobSet (and its pods) says about the run. `last_failure` is why the latest pod failed."""
    status = jobset.get("status") or {}
    restarts = int(status.get("restarts") or 0)

    def seen(state: Literal["pending", "running", "exited"], **fields: Any) -> Observation:
        return Observation(
            state, restarts=restarts, restart_reason=last_failure if restarts else None, **fields
        )

    conditions = _conditions(jobset)
    if "Completed" in conditions:
        return seen("exited", exit_code=EXIT_OK)
    if "Failed" in conditions:
        failed = conditions["Failed"]
        codes = [code for pod in pods if (code := _worker_exit_code(pod))]
        failures = [f for pod in sorted(pods, key=_name) if (f := pod_failure(pod))]
        why = failures[0] if failures else last_failure
        if len(failures) > 1:
            why = f"{why} (and {len(failures) - 1} more pods failed)"
        reason = f"The JobSet failed ({failed.get('reason', 'Failed')}: {failed.get('message', '')})"
        # A preempted worker whose JobSet is out of restarts failed; the JobSet does the restarting.
        code = next((c for c in codes if c not in (EXIT_OK, EXIT_PREEMPTED)), EXIT_FAILED)
        return seen(
            "exited",
            exit_code=code,
            reason=f"{reason}; {why}." if why else f"{reason}.",
        )
    if jobset["metadata"].get("deletionTimestamp"):
        return seen("pending", reason="The JobSet is being deleted.")
    if (jobset.get("spec") or {}).get("suspend") or "Suspended" in conditions:
        reason = (
            f"Waiting for quota: Kueue has not admitted the job yet (LocalQueue {queue})."
            if queue
            else "The JobSet is suspended; it starts when it is resumed."
        )
        return seen("pending", reason=reason, held=True)
    stuck = stuck_reason(pods, shape)
    if stuck is not None:
        return seen("pending", reason=stuck)
    return seen("running")


def _is_process_zero(pod: dict[str, Any]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return labels.get(render.LABEL_JOB_INDEX) == "0" and labels.get(render.LABEL_COMPLETION_INDEX) == "0"


def _attempt(pod: dict[str, Any]) -> tuple[int, str]:
    """Orders a job's pods by restart attempt, then age."""
    meta = pod["metadata"]
    return int((meta.get("labels") or {}).get(render.LABEL_RESTART_ATTEMPT) or 0), meta.get(
        "creationTimestamp"
    ) or ""


class KubernetesExecutor:
    name = "kubernetes"
    logs_outlive_runs = False

    def __init__(self, settings: Settings, kube: KubeClient | None = None) -> None:
        missing = [
            env
            for env, value in (
                ("TPUTUNE_K8S_WORKER_IMAGE", settings.k8s_worker_image),
                ("TPUTUNE_K8S_GKE_CLUSTER", settings.k8s_gke_cluster),
            )
            if not value
        ]
        if missing:
            raise RuntimeError(
                f"The kubernetes executor needs {' and '.join(missing)}; see README (Deploying to GKE)."
            )
        self.settings = settings
        self.kube = kube or KubeClient(settings)
        self._failures: dict[str, str] = {}
        # The end of the log of each job's worker that crashed last, read as it crashed: a JobSet restarts
        # by making all its pods anew, and their logs go with the old ones. (restart attempt, pod, lines),
        # until the restart event takes it (crash_log); and the pods read, by uid (each is read once,
        # however often it is seen again as it goes).
        self._crash_logs: dict[str, tuple[int, str, list[str]]] = {}
        self._crashes_read: dict[str, None] = {}
        self._jobsets = Informer(
            "jobsets",
            lambda: self.kube.list_jobsets(SELECTOR),
            lambda watch, version, seconds: self.kube.watch_jobsets(watch, SELECTOR, version, seconds),
            settings.k8s_resync_seconds,
            on_event=self._on_jobset_event,
        )
        self._pods = Informer(
            "pods",
            lambda: self.kube.list_pods(SELECTOR),
            lambda watch, version, seconds: self.kube.watch_pods(watch, SELECTOR, version, seconds),
            settings.k8s_resync_seconds,
            on_event=self._on_pod_event,
        )
        self._started = False
        self._start_lock = threading.Lock()

    def _watching(self) -> None:
        """Start the watches on first use: only the leader reconciles, so only it needs them."""
        with self._start_lock:
            if not self._started:
                self._jobsets.start()
                self._pods.start()
                self._started = True

    def close(self) -> None:
        self._jobsets.stop()
        self._pods.stop()
        self.kube.close()

    def _on_jobset_event(self, kind: str, jobset: dict[str, Any]) -> None:
        if kind == "DELETED":
            job_id = (jobset["metadata"].get("labels") or {}).get(render.LABEL_JOB_ID, "")
            self._failures.pop(job_id, None)
            self._crash_logs.pop(job_id, None)

    def _on_pod_event(self, kind: str, pod: dict[str, Any]) -> None:
        failure = pod_failure(pod)
        job_id = (pod["metadata"].get("labels") or {}).get(render.LABEL_JOB_ID)
        if failure is not None and job_id:
            self._failures[job_id] = failure
            # (seen to crash now, not listed crashed long ago: an API server restart reads no old pods)
            if kind == "MODIFIED" and crashed(pod):
                self._read_crash_log(job_id, pod)

    def _read_crash_log(self, job_id: str, pod: dict[str, Any]) -> None:
        """The end of a crashed worker's log, read now, on the watch's thread: its JobSet is about to
        delete it. Once a pod; best effort (it may be gone already)."""
        uid = pod["metadata"].get("uid") or _name(pod)
        if uid in self._crashes_read:
            return
        if len(self._crashes_read) >= 1024:
            del self._crashes_read[next(iter(self._crashes_read))]  # the oldest
        self._crashes_read[uid] = None
        try:
            text = self.kube.read_pod_log(_name(pod), render.WORKER_CONTAINER, CRASH_LOG_LINES)
        except Exception as exc:
            log.info("job %s: the log of crashed pod %s could not be read (%s)", job_id, _name(pod), exc)
            return
        if lines := text.splitlines()[-CRASH_LOG_LINES:]:
            self._crash_logs[job_id] = (_attempt(pod)[0], _name(pod), lines)

    def crash_log(self, job: Job, since_attempt: int) -> tuple[str, list[str]] | None:
        """(api.executors.KeepsCrashLogs)"""
        crash = self._crash_logs.pop(job.id, None)
        if crash is None or crash[0] < since_attempt:
            return None
        return crash[1], crash[2]

    def _handle(self, jobset: dict[str, Any]) -> dict[str, Any]:
        meta = jobset["metadata"]
        return {"jobset": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}

    def _own(self, job: Job, jobset: dict[str, Any]) -> None:
        """Hang the job's ConfigMap and Secret on the JobSet, so they go when it goes."""
        patch = {"metadata": {"ownerReferences": [render.owner_reference(jobset)]}}
        for update, name in (
            (self.kube.patch_config_map, render.config_map_name(job.id)),
            (self.kube.patch_secret, render.secret_name(job.id)),
        ):
            try:
                update(name, patch)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                log.warning("job %s: %s is missing; its pods cannot start", job.id, name)

    # --- the Executor protocol ---

    def find(self, job: Job) -> dict[str, Any] | None:
        jobset = self.kube.get_jobset(render.jobset_name(job.id))
        if jobset is None:
            return None
        self._own(job, jobset)  # a launch that stopped between creating the JobSet and this
        return self._handle(jobset)

    def launch(self, job: Job, token: str) -> dict[str, Any]:
        existing = self.find(job)
        if existing is not None:
            return existing
        try:
            config_map = render.render_config_map(job, self.settings)
            secret = render.render_secret(job, self.settings, token)
            jobset = render.render_jobset(job, self.settings)
        except tpu.TpuShapeError as exc:  # the settings changed since the job was accepted
            raise LaunchRefused(exc.message) from exc
        what = "the job's ConfigMap"
        try:
            try:
                self.kube.create_config_map(config_map)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.kube.patch_config_map(render.config_map_name(job.id), {"data": config_map["data"]})
            what = "the job's Secret"
            try:
                self.kube.create_secret(secret)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                # Left by a launch that stopped before its JobSet: it holds that launch's token.
                self.kube.patch_secret(render.secret_name(job.id), {"stringData": secret["stringData"]})
            what = "the JobSet"
            try:
                created = self.kube.create_jobset(jobset)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                adopted = self.kube.get_jobset(render.jobset_name(job.id))
                if adopted is None:
                    raise
                created = adopted
            self._own(job, created)
        except ApiException as exc:
            if exc.status in _RETRIED_STATUSES or exc.status == 409:
                raise
            hint = (
                " Is JobSet installed in the cluster?" if exc.status == 404 and what == "the JobSet" else ""
            )
            raise LaunchRefused(
                f"the Kubernetes API refused {what} ({exc.status}): {api_message(exc)}.{hint}"
            ) from exc
        return self._handle(created)

    def discard(self, job: Job) -> None:
        """Delete the Secret and ConfigMap of a launch that never made its JobSet (cancelled or refused
        in between); a JobSet's own are garbage-collected with it."""
        if self.kube.get_jobset(render.jobset_name(job.id)) is not None:
            return
        self.kube.delete_secret(render.secret_name(job.id))
        self.kube.delete_config_map(render.config_map_name(job.id))

    def forget(self, job: Job) -> None:
        """Delete the JobSet of an ended job deleted (kept until TPUTUNE_K8S_TTL_SECONDS_AFTER_FINISHED, or a
        failed one's until it is resumed, for its pods' logs), its Secret and ConfigMap (not waited for)."""
        self.kube.delete_jobset(render.jobset_name(job.id))
        self.kube.delete_secret(render.secret_name(job.id))
        self.kube.delete_config_map(render.config_map_name(job.id))

    def restart(self, job: Job, token: str) -> dict[str, Any]:
        raise RuntimeError(
            "JobSets restart their own workers (failurePolicy); the kubernetes executor never reports a "
            "preemption exit, so it is never asked to restart one."
        )

    def _pods_of(self, job_id: str) -> list[dict[str, Any]]:
        if not self._pods.synced.is_set():
            return self.kube.list_pods(f"{render.LABEL_JOB_ID}={job_id}")[0]
        return self._pods.select(
            lambda pod: (pod["metadata"].get("labels") or {}).get(render.LABEL_JOB_ID) == job_id
        )

    def observe(self, job: Job) -> Observation:
        self._watching()
        name = render.jobset_name(job.id)
        jobset = self._jobsets.get(name) if self._jobsets.synced.is_set() else None
        if jobset is None:
            # Not watching right now, or the watch has not seen a JobSet created just now.
            jobset = self.kube.get_jobset(name)
        if jobset is None:
            return Observation(
                "gone",
                reason=f"The JobSet {name} was deleted outside tputune (or expired after "
                "TPUTUNE_K8S_TTL_SECONDS_AFTER_FINISHED while tputune was down).",
            )
        res = job_spec(job).resources
        shape = f"{res.accelerator} {res.topology}"
        return observation_of(
            jobset, self._pods_of(job.id), self._failures.get(job.id), shape, self.settings.k8s_kueue_queue
        )

    def cancel(self, job: Job) -> bool:
        name = render.jobset_name(job.id)
        jobset = self.kube.get_jobset(name)
        if jobset is None:
            return True
        if not jobset["metadata"].get("deletionTimestamp"):
            self.kube.delete_jobset(name)
        return self.kube.get_jobset(name) is None

    def _process_zero(self, job: Job) -> dict[str, Any] | None:
        """JAX process 0's pod (slice 0, host 0) of the latest restart: the one that logs the reports."""
        pods, _ = self.kube.list_pods(f"{render.LABEL_JOB_ID}={job.id}")
        candidates = [pod for pod in pods if _is_process_zero(pod)]
        if not candidates:
            return None
        return max(candidates, key=_attempt)

    def logs(self, job: Job, tail: int) -> tuple[list[str], bool]:
        pod = self._process_zero(job)
        if pod is None:
            return [], False
        try:
            text = self.kube.read_pod_log(_name(pod), render.WORKER_CONTAINER, tail + 1)
        except ApiException as exc:
            if exc.status in (400, 404):  # the container has not started, or the pod just went
                return [], False
            raise
        lines = text.splitlines()
        return lines[-tail:], len(lines) > tail

    def follow_logs(self, job: Job, tail: int) -> _PodLog:
        pod = self._process_zero(job)
        if pod is None:
            raise LookupError(f"Job {job.id} has no worker pod yet; retry once it is starting.")
        try:
            response = self.kube.stream_pod_log(_name(pod), render.WORKER_CONTAINER, tail)
        except ApiException as exc:
            if exc.status in (400, 404):
                raise LookupError(
                    f"The worker of job {job.id} has not started yet ({api_message(exc)})."
                ) from exc
            raise
        return _PodLog(response)


class _PodLog:
    """A pod's followed log (api.executors.LogStream) over its open urllib3 response."""

    def __init__(self, response: Any) -> None:
        self.response = response

    def __iter__(self) -> Iterator[str]:
        return _lines(self.response)

    def interrupt(self) -> None:
        # Shuts the socket down: a read blocked in it on another thread returns (closing it would not).
        with contextlib.suppress(Exception):
            self.response.shutdown()


def _lines(response: Any) -> Iterator[str]:
    """The lines of a streamed response, as they arrive; closes it when the reader stops."""
    buffer = b""
    try:
        for chunk in response.stream(amt=None, decode_content=False):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", "replace")
        if buffer:
            yield buffer.decode("utf-8", "replace")
    finally:
        response.close()
        response.release_conn()
