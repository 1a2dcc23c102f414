// The audit log page: GET /audit, newest first, filtered by team and action, older pages on demand.
import { api, el, onSubmit, showingErrors } from "./common.js";

const PAGE = 50;
const tbody = document.querySelector("#audit tbody");
const error = document.getElementById("audit-error");
const form = document.getElementById("audit-filter");
const older = document.getElementById("audit-older");
const empty = document.getElementById("audit-empty");
let next = null; // the `after` of the next (older) page
let shown = null; // the filters of the rows shown: "Older" keeps to them, whatever the form says since

// What changed, one line a field: "max_active_jobs: 4 → unlimited", "url: https://hooks.example.com/…".
function changes(details) {
  return Object.entries(details).map(([field, value]) => {
    const isChange = value !== null && typeof value === "object" && !Array.isArray(value) && "from" in value;
    const text = isChange
      ? `${field}: ${JSON.stringify(value.from)} → ${JSON.stringify(value.to)}`
      : `${field}: ${JSON.stringify(value)}`;
    return el("div", { text });
  });
}

function row(event) {
  const team = event.actor.tenant ? ` (${event.actor.tenant})` : "";
  const by = event.actor.who ? `${event.actor.who}${team}` : "the single user";
  return el("tr", { attrs: { "data-id": String(event.id), "data-action": event.action } }, [
    el("td", { text: event.at.slice(0, 19).replace("T", " "), className: "mono" }),
    el("td", { text: event.action }),
    el("td", { text: event.tenant }),
    el("td", { text: event.target, className: "mono" }),
    el("td", { text: by }),
    el("td", { className: "muted changes" }, changes(event.details)),
  ]);
}

async function load(more) {
  const params = new URLSearchParams({ limit: String(PAGE) });
  const data = new FormData(form);
  for (const name of ["tenant", "action"]) {
    const value = more ? shown?.get(name) : data.get(name).trim();
    if (value) params.set(name, value);
  }
  if (!more) shown = new URLSearchParams(params);
  if (more && next !== null) params.set("after", String(next));
  await showingErrors(error, async () => {
    const page = await api(`/audit?${params}`);
    const rows = page.data.map(row);
    if (more) tbody.append(...rows);
    else tbody.replaceChildren(...rows);
    next = page.next_after;
    older.hidden = !page.has_more;
    empty.hidden = tbody.children.length > 0;
  });
}

onSubmit(form, () => load(false));
older.addEventListener("click", () => load(true));
load(false);
