// The teams page: GET /admin/tenants (and what each ran in 30 days, GET /usage), and each team's limits
// and data prefixes set with PATCH /admin/tenants/{name}.
import { api, el, formatNumber, minute, onSubmit, writeButton } from "./common.js";

const REFRESH_MS = 5000;
// What each team ran in 30 days changes slowly, and its report reads every job of the window (0.3 s with
// 50,000 jobs in it on SQLite, bench/usage_report.py): once a minute, not every 5 s.
const USAGE_REFRESH_MS = 60000;
let spent = new Map();
let spentAt = -Infinity;
const tbody = document.querySelector("#tenants tbody");
const error = document.getElementById("tenants-error");
const form = document.getElementById("limits");

// "2 of 4", "2 of 8 (server)" where the limit is the server's, "2 (unlimited)" where the team has none
// whatever the server's, or "2" without one.
function ofLimit(used, tenant, field) {
  const limit = tenant.limits[field];
  if (tenant.own_limits[field] === "unlimited") return `${used} (unlimited)`;
  if (limit === null) return String(used);
  return `${used} of ${limit}${tenant.own_limits[field] === null ? " (server)" : ""}`;
}

// Where its jobs may read and write: its prefixes ("(server)" where they are the server's), or "anywhere".
function where(tenant) {
  if (tenant.data_prefixes === null) return "anywhere";
  return tenant.data_prefixes.join(", ") + (tenant.own_data_prefixes === null ? " (server)" : "");
}

function row(tenant, spent) {
  const edit = writeButton("Edit", `Edit ${tenant.name}`, () => {
    form.elements.tenant.value = tenant.name;
    form.elements.jobs.value = tenant.own_limits.max_active_jobs ?? "";
    form.elements.chips.value = tenant.own_limits.max_active_chips ?? "";
    form.elements.queued.value = tenant.own_limits.max_queued_jobs ?? "";
    form.elements.budget.value = tenant.own_limits.max_chip_hours_per_month ?? "";
    const own = tenant.own_data_prefixes;
    form.elements.data.value = own === null ? "" : own === "any" ? "any" : own.join("\n");
    form.elements.jobs.focus();
  });
  const set = tenant.updated_at ? `${tenant.updated_by ?? ""} ${minute(tenant.updated_at)}` : "";
  return el("tr", { attrs: { "data-tenant": tenant.name } }, [
    el("td", { text: tenant.name }),
    el("td", { text: ofLimit(tenant.usage.active_jobs, tenant, "max_active_jobs"), className: "num jobs" }),
    el("td", { text: ofLimit(tenant.usage.chips, tenant, "max_active_chips"), className: "num chips" }),
    el("td", { text: ofLimit(tenant.usage.queued_jobs, tenant, "max_queued_jobs"), className: "num queued" }),
    el("td", { text: formatNumber(spent?.chip_hours ?? 0, 3), className: "num spent" }),
    el("td", {
      text: ofLimit(formatNumber(tenant.usage.chip_hours_this_month, 3), tenant, "max_chip_hours_per_month"),
      className: "num month",
    }),
    el("td", { text: where(tenant), className: "data" }),
    el("td", { text: set.trim(), className: "muted" }),
    el("td", {}, [edit]),
  ]);
}

async function refresh() {
  try {
    const due = performance.now() - spentAt >= USAGE_REFRESH_MS;
    const [page, usage] = await Promise.all([api("/admin/tenants"), due ? api("/usage") : null]);
    if (usage) {
      spent = new Map(usage.data.map((entry) => [entry.tenant, entry]));
      spentAt = performance.now();
    }
    tbody.replaceChildren(...page.data.map((tenant) => row(tenant, spent.get(tenant.name))));
  } catch (err) {
    error.textContent = err.message;
    error.hidden = false;
  }
}

// The form's prefixes: one a line (or comma-separated); none: the server's (null); `any`: anywhere.
function prefixes(text) {
  const given = text.split(/[\n,]/).map((line) => line.trim()).filter((line) => line !== "");
  if (given.length === 0) return null;
  return given.length === 1 && given[0] === "any" ? "any" : given;
}

onSubmit(form, async (event) => {
  const data = new FormData(form);
  const limit = (name) => {
    const value = data.get(name).trim();
    return value === "" ? null : value === "unlimited" ? value : Number(value);
  };
  try {
    await api(`/admin/tenants/${encodeURIComponent(data.get("tenant"))}`, {
      method: "PATCH",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        max_active_jobs: limit("jobs"),
        max_active_chips: limit("chips"),
        max_queued_jobs: limit("queued"),
        max_chip_hours_per_month: limit("budget"),
        data_prefixes: prefixes(data.get("data")),
      }),
    });
    error.hidden = true;
    form.reset();
  } catch (err) {
    error.textContent = err.message;
    error.hidden = false;
  }
  await refresh();
});

refresh();
setInterval(() => {
  if (!document.hidden) refresh();
}, REFRESH_MS);
