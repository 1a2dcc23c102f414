// The jobs list: GET /jobs with the chosen status filter, refreshed every few seconds.
import { api, el, formatAge, formatNumber, percent, session, setProgress, statusBadge } from "./common.js";

const REFRESH_MS = 5000;
const PAGE_SIZE = 50;

const params = new URLSearchParams(location.search);
const filter = document.getElementById("status-filter");
const tbody = document.querySelector("#jobs tbody");
const rows = new Map();
let showTenants = false; // the admin sees every tenant's jobs: each says whose it is
filter.value = params.get("status") ?? "";

function pageUrl(after) {
  const query = new URLSearchParams();
  if (filter.value) query.set("status", filter.value);
  if (after) query.set("after", after);
  const text = query.toString();
  return `/ui/${text ? `?${text}` : ""}`;
}

function cells(job) {
  const progress = el("progress", { attrs: { max: "1", "aria-label": `Progress of ${job.name}` } });
  setProgress(progress, job);
  const total = job.progress.total_steps;
  const steps = total ? `${job.progress.step}/${total}` : `step ${job.progress.step}`;
  const age = el("time", { text: formatAge(job.created_at), attrs: { datetime: job.created_at } });
  age.title = new Date(job.created_at).toLocaleString();
  const link = el("a", { text: job.name, attrs: { href: `/ui/jobs/${encodeURIComponent(job.id)}` } });
  const fraction = percent(job.progress.fraction);
  return [
    el("td", {}, [
      link,
      el("br"),
      el("small", { text: showTenants ? `${job.id} · ${job.tenant}` : job.id, className: "muted mono" }),
    ]),
    el("td", {}, [statusBadge(job.status)]),
    el("td", { text: job.model }),
    el("td", { text: job.method }),
    el("td", { className: "progress-cell" }, [progress, el("span", { text: fraction || steps })]),
    el("td", { text: formatNumber(job.metrics.loss), className: "num" }),
    el("td", {}, [age]),
  ];
}

// Updates rows in place and moves only those out of order, so keyboard focus on a link survives a refresh.
function render(jobs) {
  const ids = new Set(jobs.map((job) => job.id));
  for (const [id, row] of rows) {
    if (!ids.has(id)) {
      row.remove();
      rows.delete(id);
    }
  }
  jobs.forEach((job, i) => {
    let row = rows.get(job.id);
    if (!row) {
      row = el("tr", { attrs: { "data-job-id": job.id } });
      rows.set(job.id, row);
    }
    const focused = row.contains(document.activeElement);
    row.setAttribute("data-status", job.status);
    if (!focused) row.replaceChildren(...cells(job));
    if (tbody.children[i] !== row) tbody.insertBefore(row, tbody.children[i] ?? null);
  });
  document.getElementById("empty").hidden = jobs.length > 0;
}

// A team with limits sees them and what its jobs hold: why a job of its waits queued.
async function showQuota() {
  const quota = document.getElementById("quota");
  const tenant = await api("/tenant").catch(() => null);
  const limits = tenant?.limits;
  if (!tenant || Object.values(limits).every((limit) => limit === null)) {
    quota.hidden = true;
    return;
  }
  const of = (used, limit) => (limit === null ? `${used}` : `${used} of ${limit}`);
  const parts = [
    `${of(tenant.usage.active_jobs, limits.max_active_jobs)} jobs active`,
    `${of(tenant.usage.chips, limits.max_active_chips)} ${tenant.chip_unit} held`,
    `${of(tenant.usage.queued_jobs, limits.max_queued_jobs)} queued`,
  ];
  if (limits.max_chip_hours_per_month !== null) {
    const hours = Math.round(tenant.usage.chip_hours_this_month).toLocaleString("en-US");
    const stops = tenant.budget_pauses_running ? " (running jobs pause at it)" : "";
    parts.push(`${hours} of ${limits.max_chip_hours_per_month.toLocaleString("en-US")} chip-hours this month${stops}`);
  }
  const full = limits.max_queued_jobs !== null && tenant.usage.queued_jobs >= limits.max_queued_jobs;
  const over = full ? " The queue is full: new jobs are refused until some start." : "";
  quota.textContent = `Your team (${tenant.name}): ${parts.join(" · ")}. Over a limit, jobs wait queued.${over}`;
  quota.hidden = false;
}

async function refresh() {
  showTenants = Boolean((await session)?.admin);
  if (!showTenants) showQuota();
  const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
  if (filter.value) query.set("status", filter.value);
  if (params.get("after")) query.set("after", params.get("after"));
  const error = document.getElementById("list-error");
  try {
    const page = await api(`/jobs?${query}`);
    render(page.data);
    const older = document.getElementById("older");
    older.hidden = !page.has_more;
    older.href = pageUrl(page.next_after);
    const newest = document.getElementById("newest");
    newest.hidden = !params.get("after");
    newest.href = pageUrl(null);
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
    error.hidden = true;
  } catch (err) {
    error.textContent = err.message;
    error.hidden = false;
  }
}

filter.addEventListener("change", () => {
  params.delete("after");
  history.replaceState(null, "", pageUrl(null));
  refresh();
});

refresh();
setInterval(() => {
  if (!document.hidden) refresh();
}, REFRESH_MS);
