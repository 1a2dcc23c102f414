// The API keys page: GET /admin/keys, and create, rotate and revoke (admin keys only).
import { api, el, minute as when, onSubmit, showError, showingErrors, showSecret, writeButton } from "./common.js";

const tbody = document.querySelector("#keys tbody");
const error = document.getElementById("keys-error");

function state(key) {
  if (key.revoked_at) return `revoked ${when(key.revoked_at)}`;
  if (key.expires_at && Date.parse(key.expires_at) <= Date.now()) return `expired ${when(key.expires_at)}`;
  if (key.expires_at) return `expires ${when(key.expires_at)}`;
  return "active";
}

async function act(action) {
  await showingErrors(error, action);
  await refresh();
}

function actions(key) {
  if (key.revoked_at) return [];
  const rotate = writeButton("Rotate", `Rotate ${key.id}`, () => {
    const hours = prompt(`Rotate ${key.id} (${key.name}): hours the old key goes on working?`, "0");
    if (hours === null) return;
    act(async () => {
      const body = JSON.stringify({ grace_seconds: Math.round(Number(hours) * 3600) });
      const created = await api(`/admin/keys/${encodeURIComponent(key.id)}/rotate`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body,
      });
      showSecret(`New key ${created.id} for ${created.tenant}, replacing ${key.id}.`, created.key);
    });
  });
  const revoke = writeButton("Revoke", `Revoke ${key.id}`, () => {
    if (!confirm(`Revoke ${key.id} (${key.name})? It stops working at once.`)) return;
    act(() => api(`/admin/keys/${encodeURIComponent(key.id)}`, { method: "DELETE" }));
  });
  return [rotate, " ", revoke];
}

function row(key) {
  return el("tr", { attrs: { "data-key-id": key.id } }, [
    el("td", {}, [el("span", { text: key.name }), el("br"), el("small", { text: key.prefix, className: "muted mono" })]),
    el("td", { text: key.tenant }),
    el("td", { text: key.role }),
    el("td", { text: state(key), className: "state" }),
    el("td", { text: key.last_used_at ? when(key.last_used_at) : "never", className: "used" }),
    el("td", {}, actions(key)),
  ]);
}

async function refresh() {
  try {
    const page = await api("/admin/keys");
    tbody.replaceChildren(...page.data.map(row));
  } catch (err) {
    showError(error, err);
  }
}

onSubmit(document.getElementById("create"), (event) => {
  const form = new FormData(event.target);
  const body = {
    tenant: form.get("tenant"),
    name: form.get("name"),
    admin: form.get("admin") === "on",
    read_only: form.get("read_only") === "on",
  };
  if (form.get("days")) body.expires_in_days = Number(form.get("days"));
  act(async () => {
    const created = await api("/admin/keys", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    const kind = { admin: "admin ", auditor: "auditor ", reader: "read-only " }[created.role] ?? "";
    showSecret(`New ${kind}key ${created.id} for ${created.tenant}.`, created.key);
    event.target.reset();
  });
});

refresh();
