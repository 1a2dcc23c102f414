"""The loop that starts queued jobs and follows running ones (level-triggered: every pass reads the
world and makes one idempotent move per job, so a missed event or an API restart heals itself)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import select as sa_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from api import housekeeping, tenants
from api import jobs as service
from api.datasets import DatasetUnavailable, StorageUnreachable, check_dataset
from api.db import session_scope
from api.errors import ApiError
from api.executors import Discards, Executor, ExecutorUnavailable, KeepsCrashLogs, Observation
from api.models import Job, Tenant, as_utc, utcnow
from api.observability import DispatcherStats, job_id_var
from api.settings import Settings
from api.states import ACTIVE, JobStatus
from api.validation import check_data_scope, chip_unit, held_chips, job_uris
from api.webhooks import WebhookSender
from worker.config import EXIT_BAD_INPUT, EXIT_OK, EXIT_PREEMPTED

log = logging.getLogger(__name__)

_table = Job.__table__  # type: ignore[attr-defined]

# Jobs of each kind (queued; starting, running or cancelling) one pass takes at most.
PAGE = 200
# Jobs whose data is unusable fail this many to a transaction (_fail_unusable).
FAIL_GROUP = 32
MAX_YIELD_SECONDS = 0.1
PASS_SPACING_SECONDS = 0.05
# Exit statuses of a run the dispatcher stopped: with a checkpoint (EXIT_PREEMPTED), or by its signal
# (128 + SIGTERM or SIGKILL: a paused job then resumes from the checkpoint before).
STOPPED = frozenset({EXIT_PREEMPTED, 128 + signal.SIGTERM, 128 + signal.SIGKILL})
# The launch handle's record of the job's restarts before its run (a resumed job's: see _launch).
RESTARTS_BEFORE = "restarts_before"
TEAM_WAIT = service.TEAM_WAIT  # how the status message of a job held back by its team's limits begins
BUDGET = service.BUDGET  # (a job the server paused for its team's budget: once stopped it waits queued)
STALLED = service.STALLED  # (one it stopped as its workers reported nothing: once stopped, queued again)
# A pass this long after the last one's start (the dispatcher was away: stopped, not the leader, the
# database down) times stalls afresh: the workers' reports meanwhile may still be on their way.
STALL_WATCH_GAP = timedelta(seconds=60)


def _over_budget(over: tuple[float, int]) -> str:
    """How a team's jobs are past its monthly budget, (chip-hours held, budget), as its jobs say it."""
    held, budget = over
    if budget == 0:
        return "your team may use no chip-hours now (budget 0)"
    return f"your team's jobs held {held:,.0f} of its {budget:,} chip-hours this month"


def _tail(lines: list[str]) -> str:
    """A log's last lines in a message: the last 5 that say something, on one line (1,500 characters at
    most)."""
    said = [line.strip() for line in lines if line.strip()]
    return " | ".join(said[-5:])[-1500:]


def _own_stall_minutes(job: Job) -> float | None:
    """The job's own `stall_minutes`, if its spec sets one (checked when it was submitted)."""
    return (job.spec or {}).get("stall_minutes")


class Leader(Protocol):
    """api.leader.LeaderElector (not imported here: it needs the Kubernetes client)."""

    on_change: Callable[[bool], None] | None

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def is_leader(self) -> bool: ...


class Dispatcher:
    def __init__(
        self,
        engine: Engine,
        executor: Executor,
        settings: Settings,
        metrics: DispatcherStats | None = None,
        leader: Leader | None = None,
        api_busy: Callable[[], bool] | None = None,
    ) -> None:
        self.engine = engine
        # Whether the API is serving requests now: the dispatcher then yields the GIL (see _guard).
        self.api_busy = api_busy
        share = settings.dispatcher_busy_share
        self._yield_factor = (1 - share) / share
        # With several API replicas only the Lease holder may move jobs (None: this process is alone).
        self.leader = leader
        if leader is not None:
            leader.on_change = lambda _leading: self.wake()  # a new leader takes over at once
        # The pending reason each job's status message shows, to put back a normal one once it runs.
        self._pending_notes: dict[str, str] = {}
        self.metrics = metrics
        self.executor = executor
        self.settings = settings
        # Where the next pass starts, per kind of job (see _page), and the tenants' active jobs this pass.
        self._cursor: dict[str, int] = {}
        self._tenant_jobs: dict[str, list[Any]] = {}
        self._limits: dict[str, Tenant] | None = None  # the tenants' own limits, read once a pass
        self._month_spent = tenants.MonthSpent(settings)  # (what monthly chip-hour budgets count)
        # Jobs of this pass whose data is unusable, with why: they fail together (_fail_unusable).
        self._unusable: list[tuple[int, str, str]] = []  # (seq, error code, message)
        # Queued jobs of this pass whose local data _queued_page found usable: _claim does not check again.
        self._data_checked: set[int] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # Since when it has watched running jobs for stalls, and its last pass's start (_watch); and when
        # a running job's run last started again (its workers pending, or restarted by the platform), until
        # it reports after that: its silence counts from then.
        self._watching: tuple[datetime, datetime] | None = None
        self._run_started: dict[str, datetime] = {}
        self._housekept = 0.0  # when it last deleted what is past its time (api.housekeeping; monotonic)
        # Webhooks are sent beside the dispatcher, in a thread of its own, by the leader only.
        self.webhooks: WebhookSender | None = None
        if settings.webhooks_enabled:
            self.webhooks = WebhookSender(engine, settings, leader.is_leader if leader is not None else None)

    # --- the loop ---

    def start(self) -> None:
        """Run in a thread of this process."""
        if self.leader is not None:
            self.leader.start()
        self._thread = threading.Thread(target=self.run, name="tputune-dispatcher", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """End the loop after the step it is in."""
        self._stop.set()
        self._wake.set()

    def stop(self) -> None:
        """End the loop after the step it is in, and the thread and leader election start() began."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.webhooks is not None:
            self.webhooks.stop()
        if self.leader is not None:
            self.leader.stop()

    def wake(self) -> None:
        """Run a pass now (a job was just created or cancelled)."""
        self._wake.set()

    def run(self) -> None:
        """The loop, until stop()."""
        if self.webhooks is not None:
            self.webhooks.start()
        while not self._stop.is_set():
            started = time.monotonic()
            self._wake.clear()  # before the pass: a wake-up during it asks for another
            more = False
            try:
                more = self.tick()
            except Exception:
                log.exception("dispatcher pass failed; retrying")
            if not more:  # a pass that took a full page of jobs goes on at once (a burst of submissions)
                self._wake.wait(self.settings.dispatch_interval_seconds)
            # Passes start PASS_SPACING_SECONDS apart at least: under a stream of submissions every commit
            # of the job writer wakes the dispatcher, and a pass for each few jobs spent most of its time on
            # what every pass costs (a session, two queries).
            self._stop.wait(started + PASS_SPACING_SECONDS - time.monotonic())

    def tick(self) -> bool:
        """One pass; True if it left jobs for the next one (it takes `PAGE` jobs of each kind at most)."""
        if self.leader is not None and not self.leader.is_leader():
            return False
        self._watch(utcnow())
        more = False
        self._tenant_jobs.clear()
        self._limits = None
        self._data_checked.clear()
        with session_scope(self.engine) as session:
            try:
                queued, more_queued = self._queued_page(session)
                try:
                    for job in queued:
                        self._guard(session, job, self._claim)
                        if len(self._unusable) >= FAIL_GROUP:
                            self._fail_unusable(session)
                finally:
                    self._fail_unusable(session)
                active, more_active = self._page(session, "active", list(ACTIVE))
                for job in active:
                    self._guard(session, job, self._follow)
                more = more_queued or more_active
            except ExecutorUnavailable as exc:
                # Every other job would wait on it too: end this pass, the next one retries.
                log.warning("%s; retrying on the next pass", exc)
        self._housekeep()
        if self.metrics is not None:
            self.metrics.passed()
        return more

    def _housekeep(self) -> None:
        """Once an hour (at the leader's first pass, then every housekeeping.EVERY_SECONDS): idempotency
        keys and audit events past their time deleted."""
        if self._housekept and time.monotonic() - self._housekept < housekeeping.EVERY_SECONDS:
            return
        self._housekept = time.monotonic()
        try:
            pruned = housekeeping.prune(self.engine, self.settings, forget=self.executor.forget)
        except Exception:
            log.warning("could not delete the rows past their time; again in an hour", exc_info=True)
            return
        if any(pruned.values()):
            log.info("deleted what is past its time: %s", pruned)

    def _watch(self, now: datetime) -> None:
        """At a pass's start: running jobs are watched for stalls from the first pass, or the first after a
        gap (STALL_WATCH_GAP)."""
        start = (
            now if self._watching is None or now - self._watching[1] > STALL_WATCH_GAP else self._watching[0]
        )
        self._watching = (start, now)

    def _queued_page(self, session: Session) -> tuple[list[Job], bool]:
        """The next page of queued jobs (as `_page`), less those whose data is a local file found unusable
        now: they fail in groups (FAIL_GROUP a transaction) without being loaded (a burst of them is the
        costliest thing a pass does: loading the job objects was half of it). The others, loaded."""
        columns = (_table.c.seq, _table.c.launched_at, _table.c.tenant, _table.c.spec)
        page = self._page_query("queued", [JobStatus.queued], *columns).subquery()
        # The paths out of the JSON are taken after the LIMIT: else PostgreSQL may take them for every
        # queued job before it sorts (25 ms, not 4.5, with 4,000 queued).
        uris = [page.c.spec[key].as_string() for key in ("dataset_uri", "validation_uri")]
        query = sa_select(page.c.seq, page.c.launched_at, page.c.tenant, *uris).order_by(page.c.seq)
        rows = session.connection().execute(query).all()
        more = self._turn_page("queued", [row.seq for row in rows])
        if rows and self._limits is None:  # (the tenants' prefixes, read before the CPU of the checks is)
            self._limits = tenants.load(session)
        load: list[int] = []
        used = time.thread_time()
        for seq, launched_at, tenant, dataset, validation in rows:
            files = self._files(dataset, validation)
            if launched_at is not None or any(uri.startswith("gs://") for uri, _ in files):
                load.append(seq)
                continue
            try:
                # Its team's data prefixes first (narrowed since it was queued): a file of another team's
                # is not looked at for it. (Its other paths: _claim.)
                paths = {"dataset_uri": dataset, "validation_uri": validation}
                check_data_scope(job_uris(paths), self.settings, self._prefixes(session, tenant))
                for uri, what in files:
                    check_dataset(uri, self.settings, what=what)
            except (DatasetUnavailable, ApiError) as exc:
                self._unusable.append((seq, exc.code, exc.message))
                if len(self._unusable) >= FAIL_GROUP:
                    self._yield(time.thread_time() - used)
                    self._fail_unusable(session)  # (yields for its own CPU)
                    used = time.thread_time()
                continue
            except Exception:  # (_claim checks it again, and says what went wrong)
                pass
            else:
                self._data_checked.add(seq)
            load.append(seq)
        self._yield(time.thread_time() - used)
        if not load:
            return [], more
        jobs = session.exec(select(Job).where(col(Job.seq).in_(load)).order_by(col(Job.seq))).all()
        return list(jobs), more

    def _page(self, session: Session, kind: str, statuses: list[JobStatus]) -> tuple[list[Job], bool]:
        """The next `PAGE` jobs in `statuses`, oldest first, after where the last pass of this kind stopped
        (so jobs past the first page, behind ones held by a tenant cap say, get their turn); and whether
        it stopped short of the end."""
        jobs = list(session.scalars(self._page_query(kind, statuses, Job)).all())
        return jobs, self._turn_page(kind, [job.seq or 0 for job in jobs])

    def _page_query(self, kind: str, statuses: list[JobStatus], *columns: Any) -> Any:
        """`columns` of the next page of jobs in `statuses` (see _page)."""
        after = self._cursor.get(kind, 0)
        return (
            sa_select(*columns)
            .where(
                _table.c.status.in_([status.value for status in statuses]),
                _table.c.executor == self.executor.name,
                _table.c.seq > after,
            )
            .order_by(_table.c.seq)
            .limit(PAGE)
        )

    def _turn_page(self, kind: str, seqs: list[int]) -> bool:
        """Where the next page of this kind starts, after one with `seqs`; whether there may be more."""
        more = len(seqs) == PAGE
        self._cursor[kind] = seqs[-1] if more else 0
        return more

    def _guard(self, session: Session, job: Job, step: Any) -> None:
        token = job_id_var.set(job.id)
        used = time.thread_time()
        try:
            step(session, job)
        except ExecutorUnavailable as exc:
            session.rollback()
            if job.launched_at is None:  # the launch waits on it: say so
                self._note(session, job, f"{exc}; retrying.")
            raise
        except Exception:
            session.rollback()
            log.exception("job %s: dispatcher step failed; it will be retried", job.id)
        finally:
            job_id_var.reset(token)
            self._yield(time.thread_time() - used)

    def _yield(self, used: float) -> None:
        """After a step that used `used` s of CPU, wait so that the dispatcher takes at most
        `dispatcher_busy_share` of the GIL while the API serves requests. It shares the interpreter with the
        event loop, and a thread with work gets the GIL about half the time: after a burst of submissions
        its backlog took half the requests' CPU, and POST /jobs's p99 doubled."""
        if self._yield_factor > 0 and self.api_busy is not None and used > 0 and self.api_busy():
            self._stop.wait(min(used * self._yield_factor, MAX_YIELD_SECONDS))

    # --- one move per job ---

    def _claim(self, session: Session, job: Job) -> None:
        if job.launched_at is not None:
            # Its run exists but the platform holds it for quota: quota decides, not the tenant's limits
            # on what runs at once. But past its team's budget it waits here: its run, which the platform
            # would let start, is stopped (a preempted run's checkpoint kept).
            if (over := self._budget_held(session, job.tenant)) is not None:
                self._stop_for_budget(session, job, over)
            else:
                self._follow_held(session, job)
            return
        # A local file is checked now, before the claim: it takes microseconds, and a job whose data is
        # unusable then fails in one move (queued → failed), one transaction where `starting` first made
        # two (a burst of such jobs kept the dispatcher busy for a minute after it ended, bench/README.md),
        # even over its tenant's cap (it would never run). A Cloud Storage check may take seconds: the job
        # is `starting` ("Checking the dataset.") while it runs (_launch).
        if not self._in_scope(session, job):
            return
        local = not any(uri.startswith("gs://") for uri, _ in self._data(job))
        if local and job.seq not in self._data_checked and not self._data_usable(session, job):
            return
        waiting = self._over_tenant_cap(session, job)
        if waiting is not None:
            # Over the cap a job waits its turn; it is never rejected. It says why in its status message,
            # and once in its events: once it runs, they still tell why it started late.
            if job.status_message != waiting:
                if not (job.status_message or "").startswith(TEAM_WAIT):
                    data = {"waiting": "team_limit"}
                    service.add_event(session, job, "status", waiting, data=data)
                self._note(session, job, waiting)
            return
        if job.launch is not None and not self._remove_last_run(session, job):
            return
        if service.transition(session, job, JobStatus.starting, "Checking the dataset."):
            if job.tenant in self._tenant_jobs:
                self._tenant_jobs[job.tenant].append(job)
            self._launch(session, job, data_checked=local)

    def _tenant(self, session: Session, tenant: str) -> Tenant | None:
        """`tenant`'s own limits, read once a pass for every tenant: a limit changed holds from the next."""
        if self._limits is None:
            self._limits = tenants.load(session)
        return self._limits.get(tenant)

    def _prefixes(self, session: Session, tenant: str) -> tuple[str, ...] | None:
        """Where `tenant`'s jobs may read and write (None: anywhere), as the tenants were read this pass."""
        return tenants.data_prefixes(self._tenant(session, tenant), self.settings, tenant)

    def _in_scope(self, session: Session, job: Job) -> bool:
        """A job queued before an admin narrowed its team's data prefixes, with data or an output outside
        them now, fails as it would be refused now (path_not_allowed), with the others of the pass."""
        try:
            check_data_scope(job_uris(job.spec), self.settings, self._prefixes(session, job.tenant))
        except ApiError as exc:
            assert job.seq is not None
            self._unusable.append((job.seq, exc.code, exc.message))
            return False
        return True

    @classmethod
    def _data(cls, job: Job) -> list[tuple[str, str]]:
        """The files a job reads: (URI, what), the dataset and the validation file if it names one."""
        return cls._files(job.spec["dataset_uri"], job.spec.get("validation_uri"))

    @staticmethod
    def _files(dataset_uri: str, validation_uri: str | None) -> list[tuple[str, str]]:
        return [(dataset_uri, "dataset")] + ([(validation_uri, "validation")] if validation_uri else [])

    def _data_usable(self, session: Session, job: Job) -> bool:
        """Check the job's data; if it is unusable the job fails, if storage did not answer it waits."""
        try:
            for uri, what in self._data(job):
                check_dataset(uri, self.settings, what=what)
        except DatasetUnavailable as exc:
            if job.status == JobStatus.queued:  # (a local file, checked before the claim)
                assert job.seq is not None
                self._unusable.append((job.seq, exc.code, exc.message))  # failed with others (tick)
            else:
                service.transition(
                    session,
                    job,
                    JobStatus.failed,
                    exc.message,
                    error_code=exc.code,
                    error_message=exc.message,
                )
            return False
        except StorageUnreachable as exc:
            self._note(session, job, f"{exc}; retrying.")
            return False
        return True

    def _fail_unusable(self, session: Session) -> None:
        """Fail the jobs found with unusable data, together: two statements and a commit
        (`service.fail_queued`). A transition and commit per job (through the ORM) cost 0.93 ms of CPU a
        job, 0.096 so (2,000 jobs with a missing dataset, SQLite, in-process): in a burst of such jobs
        (POST /jobs in bench/api_load.py) the dispatcher fell a minute behind, and on SQLite every commit
        took the write lock the API's job writer waits for. Their writes follow the checks: the lock is
        held for the writes only. If the commit fails they stay queued, and the next pass tries again."""
        unusable, self._unusable = self._unusable, []
        if not unusable:
            return
        used = time.thread_time()
        try:
            service.fail_queued(session.connection(), unusable)
            session.commit()
        except Exception:
            session.rollback()
            log.exception(
                "could not fail %d jobs whose data is unusable; the next pass retries", len(unusable)
            )
        finally:
            self._yield(time.thread_time() - used)

    def _over_tenant_cap(self, session: Session, job: Job) -> str | None:
        """Why `job` must wait for its tenant's running jobs (its limits: api.tenants), or None."""
        limits = tenants.Limits.of(self._tenant(session, job.tenant), self.settings, job.tenant)
        if not limits.any:
            return None
        max_jobs, max_chips = limits.max_active_jobs, limits.max_active_chips
        if max_jobs == 0:
            return f"{TEAM_WAIT}your team may run no jobs now (limit 0); ask your admin to raise it."
        if max_jobs is not None and len(active := self._active(session, job.tenant)) >= max_jobs:
            running = "1 job of your team is" if len(active) == 1 else f"{len(active)} jobs of your team are"
            return f"{TEAM_WAIT}{running} running (limit {max_jobs})."
        if max_chips is not None:
            what = chip_unit(self.settings)
            used = sum(held_chips(row, self.settings) for row in self._active(session, job.tenant))
            needed = held_chips(job, self.settings)
            if needed > max_chips:  # (the limit was lowered after the job was accepted)
                return (
                    f"{TEAM_WAIT}this job needs {needed} {what}, more than your team may hold at once "
                    f"({max_chips}); it starts if an admin raises the limit, or cancel it."
                )
            if used + needed > max_chips:
                return (
                    f"{TEAM_WAIT}your team's running jobs hold {used} of its {max_chips} {what}; "
                    f"this job needs {needed}."
                )
        return self._budget_wait(session, job.tenant, limits)

    def _budget_held(
        self, session: Session, tenant: str, limits: tenants.Limits | None = None
    ) -> tuple[float, int] | None:
        """(chip-hours held this month, budget) if `tenant`'s jobs held its monthly budget, else None."""
        if limits is None:
            limits = tenants.Limits.of(self._tenant(session, tenant), self.settings, tenant)
        budget = limits.max_chip_hours_per_month
        if budget is None:
            return None
        held = self._month_spent.hours(session).get(tenant, 0.0) if budget > 0 else 0.0
        return (held, budget) if held >= budget else None

    def _budget_wait(self, session: Session, tenant: str, limits: tenants.Limits | None = None) -> str | None:
        """Why `tenant`'s queued jobs wait for its monthly budget, or None."""
        over = self._budget_held(session, tenant, limits)
        if over is None:
            return None
        if over[1] == 0:
            return f"{TEAM_WAIT}{_over_budget(over)}; ask your admin to raise it."
        until = tenants.next_month(utcnow())
        return (
            f"{TEAM_WAIT}{_over_budget(over)}; it starts on {until:%Y-%m-%d} (UTC), or once an admin raises "
            "the budget."
        )

    def _stop_for_budget(self, session: Session, job: Job, over: tuple[float, int]) -> None:
        """Stop the run of a job whose team's jobs held the team's monthly budget, as a pause does (its
        workers save a checkpoint): once stopped it waits in the queue (_pause), and goes on from the
        checkpoint when the budget allows. A run the platform holds (Kueue) is stopped in any case: queued
        jobs wait for the budget; a running one only with TPUTUNE_TENANT_BUDGET_PAUSES_RUNNING."""
        message = (
            f"Pausing: {_over_budget(over)}; the workers save a checkpoint and stop, and the job waits in "
            "the queue to go on from it."
        )
        if service.transition(session, job, JobStatus.pausing, message, event_data={"for": BUDGET}):
            self._pause(session, job)

    def _active(self, session: Session, tenant: str) -> list[Any]:
        """`tenant`'s active jobs (id, spec): read once per tenant and pass, where a job or chip limit needs
        them (not for a budget alone); the jobs it starts are added (_claim)."""
        active = self._tenant_jobs.get(tenant)
        if active is None:
            statement = select(Job.id, Job.spec).where(
                Job.tenant == tenant, col(Job.status).in_(list(ACTIVE))
            )
            active = self._tenant_jobs[tenant] = list(session.exec(statement).all())
        return active

    def _follow(self, session: Session, job: Job) -> None:
        if job.status == JobStatus.cancelling:
            self._cancel(session, job)
        elif job.status == JobStatus.pausing:
            self._pause(session, job)
        elif job.launched_at is None:
            self._launch(session, job)
        elif self.settings.tenant_budget_pauses_running and (over := self._budget_held(session, job.tenant)):
            self._stop_for_budget(session, job, over)
        else:
            seen = self.executor.observe(job)
            if job.status == JobStatus.running and (
                seen.state != "running" or self._restarts(job, seen) > job.restarts
            ):  # (a run that starts anew: its first report comes later; a starting job is not watched)
                self._run_started[job.id] = utcnow()
            elif (silent := self._silent_minutes(job, utcnow())) is not None:
                self._stop_stalled(session, job, silent)
                return
            self._reconcile(session, job, seen)

    def _silent_minutes(self, job: Job, now: datetime) -> float | None:
        """How long a running job's workers have reported nothing, if past TPUTUNE_STALL_MINUTES (timed from
        the dispatcher's watch at the latest: reports may have waited for it, or for the database)."""
        limit = _own_stall_minutes(job) or self.settings.stall_minutes
        if not limit or job.status != JobStatus.running or self._watching is None:
            return None
        reported = as_utc(job.reported_at) or as_utc(job.updated_at)
        started = self._run_started.get(job.id)
        if started is not None and reported is not None and reported > started:
            del self._run_started[job.id]  # (its new run reported)
            started = None
        last = max(time for time in (reported, started, self._watching[0]) if time is not None)
        silent = (now - last).total_seconds() / 60
        return silent if silent >= limit else None

    def _stop_stalled(self, session: Session, job: Job, silent: float) -> None:
        """Stop the run of a job whose workers stopped reporting, as a pause does: once stopped it is queued
        again to go on from its last checkpoint (_pause), TPUTUNE_STALL_MAX_RESTARTS times; then it fails."""
        message = (
            f"Restarting: the workers reported nothing for {silent:,.0f} minutes (a host lost in a "
            "collective, a read that never returns?); they are stopped, and the job goes on from its last "
            "checkpoint."
        )
        if service.transition(session, job, JobStatus.pausing, message, event_data={"for": STALLED}):
            log.warning("job %s stalled: no report for %.0f minutes; stopping its run", job.id, silent)
            self._run_started.pop(job.id, None)
            if self.metrics is not None:
                self.metrics.stalled()
            self._pause(session, job)

    def _follow_held(self, session: Session, job: Job) -> None:
        """A queued job whose run the platform holds (Kueue): say why it waits, move on once admitted."""
        seen = self.executor.observe(job)
        if seen.state == "pending" and seen.held:
            self._pending(session, job, seen.reason or "Waiting for quota.")
            return
        self._pending_notes.pop(job.id, None)
        admitted = "Workers started: the platform admitted the job; waiting for the first report."
        if service.transition(session, job, JobStatus.starting, admitted):
            self._reconcile(session, job, seen)

    def _launch(self, session: Session, job: Job, data_checked: bool = False) -> None:
        if not data_checked and not self._data_usable(session, job):
            return
        handle = self.executor.find(job)
        if handle is None:
            token, token_hash = service.new_job_token()
            job.token_hash = token_hash
            session.add(job)
            session.commit()  # the hash is stored before any worker can hold the token
            try:
                handle = self.executor.launch(job, token)
            except OSError as exc:
                message = f"The worker could not be started: {exc}"
                if service.transition(
                    session, job, JobStatus.failed, message, error_code="launch_failed", error_message=message
                ):
                    self._discard(job)
                return
            event = "Workers started."
        else:
            event = "Found the job's workers already running; adopted them."
        if self.metrics is not None and event == "Workers started.":
            self.metrics.launched()
        # A resumed job's new run (a new JobSet) counts its restarts from 0: the job's go on from its own.
        job.launch = {**handle, RESTARTS_BEFORE: job.restarts} if job.restarts else handle
        job.launched_at = job.admitted_at = utcnow()
        job.status_message = "Workers started; waiting for the first report."
        session.add(job)
        service.add_event(
            session, job, "launch", event, data={"executor": self.executor.name}, at=job.admitted_at
        )
        session.commit()
        log.info("job %s launched: %s", job.id, handle)

    def _note(self, session: Session, job: Job, message: str) -> None:
        if job.status_message != message:
            job.status_message = message
            session.add(job)
            session.commit()

    @staticmethod
    def _restarts_before(job: Job) -> int:
        """The job's restarts in its runs before this one (a resumed job's)."""
        return int((job.launch or {}).get(RESTARTS_BEFORE, 0))

    def _restarts(self, job: Job, seen: Observation) -> int:
        """The job's restarts by the platform, with those of its runs before this one."""
        return self._restarts_before(job) + seen.restarts

    def _reconcile(self, session: Session, job: Job, seen: Observation) -> None:
        restarts = self._restarts(job, seen)
        if restarts > job.restarts:
            self._restarted(session, job, seen, restarts)
        waited = self._pending_notes.pop(job.id, None) if seen.state != "pending" else None
        if seen.state == "pending" and seen.held:
            # Not admitted yet, or preempted by a higher-priority workload: the job waits its turn again.
            reason = seen.reason or "Waiting for quota."
            self._pending_notes[job.id] = reason
            service.transition(session, job, JobStatus.queued, reason)
        elif seen.state == "pending":
            self._pending(session, job, seen.reason or "Waiting for resources.")
        elif seen.state == "running":
            if waited is not None and job.status_message == waited:
                running = job.status == JobStatus.running
                self._note(
                    session,
                    job,
                    "The worker is running." if running else "Workers started; waiting for the first report.",
                )
        elif seen.state == "gone":
            message = seen.reason or "The workers disappeared."
            service.transition(
                session, job, JobStatus.failed, message, error_code="worker_lost", error_message=message
            )
        elif seen.exit_code == EXIT_OK and not job.error_code:
            self._keep_log(session, job)
            finished = "Training finished."
            if job.total_steps and job.step < job.total_steps:  # (its worker stopped it: early stopping)
                finished = f"Training finished early, at step {job.step} of {job.total_steps}."
            service.transition(session, job, JobStatus.succeeded, finished)
        elif seen.exit_code == EXIT_PREEMPTED:
            self._restart(session, job)
        else:
            self._fail(session, job, seen.exit_code, seen.reason)

    def _pending(self, session: Session, job: Job, reason: str) -> None:
        """Show why the run waits, in the status message and (once per reason) as an event."""
        self._pending_notes[job.id] = reason
        if job.status_message == reason:
            return
        job.status_message = reason
        session.add(job)
        service.add_event(session, job, "warning", reason, level="warn", data={"waiting": True})
        session.commit()

    def _restarted(self, session: Session, job: Job, seen: Observation, restarts: int) -> None:
        """The platform restarted the workers itself (a JobSet after a failure or a preemption): `restarts`
        in all, with those of the job's runs before this one."""
        seen_before = job.restarts - self._restarts_before(job)  # (the platform's, of this run)
        job.restarts = restarts
        cause = f": {seen.restart_reason}" if seen.restart_reason else ""
        job.status_message = (
            f"The workers restarted (restart {job.restarts}){cause}; they resume from the last checkpoint."
        )
        session.add(job)
        message = job.status_message
        data: dict[str, Any] = {"restarts": job.restarts}
        crashes = self.executor if isinstance(self.executor, KeepsCrashLogs) else None
        crash = crashes.crash_log(job, seen_before) if crashes is not None else None
        if crash is not None:  # (a worker that crashed: the end of its log, gone with its pod)
            pod, lines = crash
            message += f" Last log lines of pod {pod}: {_tail(lines)}"
            data.update(pod=pod, log_tail=lines)
        service.add_event(session, job, "restart", message, data=data)
        session.commit()

    def _fail(self, session: Session, job: Job, exit_code: int | None, reason: str | None = None) -> None:
        self._keep_log(session, job)
        if job.error_code:
            code, message = job.error_code, job.error_message or ""
        elif exit_code == EXIT_BAD_INPUT:
            code, message = "invalid_input", "The worker rejected the job's input; see the job's logs."
        else:
            code = "worker_failed"
            lines, _ = self.executor.logs(job, 5)
            tail = _tail(lines)
            message = (reason or f"The worker exited with status {exit_code}.") + (
                f" Last log lines: {tail}" if tail else ""
            )
        service.transition(session, job, JobStatus.failed, message, error_code=code, error_message=message)

    def _restart(self, session: Session, job: Job) -> None:
        """Start a preempted local run again, TPUTUNE_LOCAL_MAX_RESTARTS times a run (a resumed job's new
        run has its own, as a new JobSet does)."""
        before = self._restarts_before(job)
        if job.restarts - before >= self.settings.local_max_restarts:
            message = (
                f"The workers were preempted {job.restarts - before + 1} times; "
                "giving up (TPUTUNE_LOCAL_MAX_RESTARTS)."
            )
            service.transition(
                session, job, JobStatus.failed, message, error_code="too_many_restarts", error_message=message
            )
            return
        token, token_hash = service.new_job_token()
        job.token_hash = token_hash
        job.restarts += 1
        session.add(job)
        session.commit()
        handle = self.executor.restart(job, token)
        job.launch = {**handle, RESTARTS_BEFORE: before} if before else handle
        self._run_started[job.id] = utcnow()
        if self.metrics is not None:
            self.metrics.launched()
        job.status_message = (
            f"Restarted after a preemption (restart {job.restarts}); resuming from the last checkpoint."
        )
        session.add(job)
        service.add_event(session, job, "restart", job.status_message, data={"restarts": job.restarts})
        session.commit()

    def _keep_log(self, session: Session, job: Job) -> None:
        """As a run ends, where its log goes with it (a pod's): save the end of it (the last
        TPUTUNE_K8S_SAVED_LOG_LINES lines), for `GET /jobs/{id}/logs` once the run is gone (its JobSet
        deleted: the job paused, cancelled or resumed, or past its TTL). Again on each pass while the run
        stops: the later lines replace the earlier. Best effort: a log the platform does not give now does
        not hold the job's end up."""
        most = self.settings.k8s_saved_log_lines
        if self.executor.logs_outlive_runs or most == 0 or job.launched_at is None:
            return
        try:
            lines, truncated = self.executor.logs(job, most)
        except Exception:
            log.warning("job %s: could not read its log to save it", job.id, exc_info=True)
            return
        if lines:
            service.save_log(session, job, lines, truncated)
            session.commit()

    def _remove_last_run(self, session: Session, job: Job) -> bool:
        """A resumed job's run before (its `launch`, kept): removed before the job is launched anew, else
        its launch would find and adopt that run (a failed one's JobSet, its exit record). A paused job's
        was removed as it paused: this only makes sure. True once it is gone."""
        if not self.executor.cancel(job):
            return False  # (being deleted; the next pass looks again)
        self._discard(job, best_effort=False)
        job.launch = None
        session.add(job)
        session.commit()
        return True

    def _adopt_unrecorded(self, session: Session, job: Job) -> None:
        """Record the run of a job claimed but whose launch was not recorded (a crash in between), if one
        exists: a cancel or pause stops it too."""
        handle = self.executor.find(job)
        if handle is not None:
            job.launch = handle
            job.launched_at = job.admitted_at = utcnow()
            session.add(job)
            session.commit()

    def _cancel(self, session: Session, job: Job) -> None:
        if job.launched_at is None:
            self._adopt_unrecorded(session, job)
            if job.launched_at is None:
                self._discard(job, best_effort=False)  # retried on the next pass if the platform is away
        if job.launched_at is not None:
            self._keep_log(session, job)
        if job.launched_at is None or self.executor.cancel(job):
            service.transition(session, job, JobStatus.cancelled, "Cancelled; the workers are stopped.")

    def _pause(self, session: Session, job: Job) -> None:
        """Stop a pausing job's run as a cancel does (SIGTERM, or the JobSet deleted: its workers save a
        checkpoint first; forcefully past TPUTUNE_CANCEL_GRACE_SECONDS), then call it paused: its chips are
        let go, and once resumed it is launched anew and continues from the checkpoint. A run that ended
        on its own first ends the job as it would have without the pause."""
        if job.launched_at is None:
            self._adopt_unrecorded(session, job)
        if job.launched_at is not None:
            seen = self.executor.observe(job)
            if seen.state == "exited" and seen.exit_code not in STOPPED:
                self._reconcile(session, job, seen)  # (it finished, or failed, before the pause stopped it)
                return
            if seen.state != "gone":
                self._keep_log(session, job)
                if not self.executor.cancel(job):
                    return  # stopping; the next pass looks again
        self._discard(job, best_effort=False)  # (the run's leftovers: resumed, it starts afresh)
        paused_for = service.paused_for(session, job)
        if paused_for == STALLED:
            self._requeue_stalled(session, job)
        elif paused_for == BUDGET:  # (it waits for the budget with the others)
            paused = "Paused for your team's monthly chip-hour budget; it waits in the queue to go on."
            why = self._budget_wait(session, job.tenant)
            if why is None:  # (the budget was raised meanwhile)
                self._requeue(session, job, paused, "Queued again to go on.")
            else:
                self._requeue(session, job, paused, why, {"waiting": "team_limit"})
        else:
            message = (
                "Paused: the workers stopped (saving a checkpoint on the way out); resume the job to go on."
            )
            service.transition(session, job, JobStatus.paused, message)

    @staticmethod
    def _requeue(
        session: Session, job: Job, paused: str, queued: str, data: dict[str, Any] | None = None
    ) -> None:
        """A job whose run the server stopped (pausing) goes on: paused (its chips let go, its pause
        counted, job.paused told), then queued again at once, to go on from its last checkpoint when its
        turn comes; `paused` and `queued` say why. Unless it moved on meanwhile (a cancel). Both moves are
        one transaction: a dispatcher that dies between them would leave the job paused, for its owner to
        resume, when nobody paused it. (A step that fails between them is rolled back by `_guard`: neither
        move, and the next pass stops it again.)"""
        if service.transition(session, job, JobStatus.paused, paused, commit=False):
            service.transition(session, job, JobStatus.queued, queued, event_data=data)

    def _requeue_stalled(self, session: Session, job: Job) -> None:
        """A stalled job's run is stopped: it is queued again, or fails once it stalled more than
        TPUTUNE_STALL_MAX_RESTARTS times."""
        stalls, most = service.stalls(session, job), self.settings.stall_max_restarts
        if stalls > most:
            limit = "its stall_minutes" if _own_stall_minutes(job) else "TPUTUNE_STALL_MINUTES"
            message = (
                f"The workers stalled (reported nothing for {limit}) {stalls} times; giving up "
                f"(TPUTUNE_STALL_MAX_RESTARTS {most}). Its checkpoints are kept."
            )
            service.transition(
                session, job, JobStatus.failed, message, error_code="worker_stalled", error_message=message
            )
            return
        paused = f"Stopped as stalled (restart {stalls} of {most}); queued again."
        queued = (
            f"Queued again after its workers stalled (restart {stalls} of {most}); it goes on from its last "
            "checkpoint."
        )
        self._requeue(session, job, paused, queued)

    def _discard(self, job: Job, best_effort: bool = True) -> None:
        if not isinstance(self.executor, Discards):
            return
        try:
            self.executor.discard(job)
        except Exception:
            if not best_effort:
                raise
            log.warning("job %s: could not clean up after its launch", job.id, exc_info=True)


def make_dispatcher(
    engine: Engine,
    executor: Executor,
    settings: Settings,
    metrics: DispatcherStats | None = None,
    api_busy: Callable[[], bool] | None = None,
) -> Dispatcher:
    """The dispatcher of a deployment: on kubernetes, with the Lease election of its API replicas."""
    leader = None
    if settings.executor == "kubernetes":
        from api.leader import make_leader  # imports the Kubernetes client, which local use never needs

        leader = make_leader(settings)
    return Dispatcher(engine, executor, settings, metrics, leader=leader, api_busy=api_busy)
