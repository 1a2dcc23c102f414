// The webhooks page: GET /webhooks, and add, test, enable or disable and delete endpoints; an endpoint's
// deliveries, a missed one sent again.
import { api, button, el, minute as when, onSubmit, showError, showingErrors, showSecret, writeButton } from "./common.js";

const tbody = document.querySelector("#webhooks tbody");
const deliveries = document.querySelector("#deliveries tbody");
const error = document.getElementById("webhooks-error");
const REFRESH_MS = 5000;
let shown = null; // the endpoint whose deliveries are shown

async function act(action) {
  await showingErrors(error, action);
  await refresh();
}

function actions(hook) {
  const path = `/webhooks/${encodeURIComponent(hook.id)}`;
  const test = writeButton("Send test", `Send a test event to ${hook.id}`, () =>
    act(async () => {
      await api(`${path}/test`, { method: "POST" });
      shown = hook;
    }),
  );
  const toggle = writeButton(hook.enabled ? "Disable" : "Enable", `${hook.enabled ? "Disable" : "Enable"} ${hook.id}`, () =>
    act(() =>
      api(path, {
        method: "PATCH",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ enabled: !hook.enabled }),
      }),
    ),
  );
  const rotate = writeButton("New secret", `New signing secret for ${hook.id}`, () => {
    if (!confirm(`Give ${hook.id} a new signing secret? The old one signs too for 24 hours.`)) return;
    act(async () => {
      const rotated = await api(`${path}/rotate-secret`, { method: "POST" });
      showSecret(`Endpoint ${rotated.id} has a new secret (the old one signs too until ${when(rotated.old_secret_until)}).`, rotated.secret);
    });
  });
  const show = button("Deliveries", `Deliveries of ${hook.id}`, () => {
    shown = hook;
    refresh();
  });
  const remove = writeButton("Delete", `Delete ${hook.id}`, () => {
    if (!confirm(`Delete ${hook.id} (${hook.url})? Nothing more is sent to it.`)) return;
    act(async () => {
      await api(path, { method: "DELETE" });
      if (shown?.id === hook.id) shown = null;
    });
  });
  return [test, " ", toggle, " ", show, " ", rotate, " ", remove];
}

function state(hook) {
  if (!hook.enabled) {
    return [el("span", { text: "disabled", className: "webhook-disabled" }), el("br"), el("small", { text: hook.disabled_reason ?? "" })];
  }
  if (hook.failing_since) return [el("span", { text: `failing since ${when(hook.failing_since)}`, className: "webhook-failing" })];
  return [el("span", { text: "enabled" })];
}

function row(hook) {
  const what = [el("span", { text: hook.url, className: "mono" }), el("br"), el("small", { text: hook.id, className: "muted mono" })];
  if (hook.description) what.push(el("br"), el("small", { text: hook.description }));
  return el("tr", { attrs: { "data-webhook-id": hook.id } }, [
    el("td", {}, what),
    el("td", { text: hook.tenant === "*" ? "every team" : hook.tenant }),
    el("td", { text: hook.events.join(", ") }),
    el("td", {}, state(hook)),
    el("td", { text: when(hook.created_at) }),
    el("td", {}, actions(hook)),
  ]);
}

function lastAnswer(delivery) {
  const answer = delivery.last_error ?? (delivery.response_status ? `HTTP ${delivery.response_status}` : "");
  if (delivery.status === "pending" && delivery.next_attempt_at) {
    return `${answer}${answer ? "; " : ""}next try ${when(delivery.next_attempt_at)}`;
  }
  return answer;
}

function resend(delivery) {
  const path = `/webhooks/${encodeURIComponent(delivery.webhook_id)}/deliveries/${delivery.id}/retry`;
  return writeButton("Send again", `Send delivery ${delivery.id} again`, () => act(() => api(path, { method: "POST" })));
}

function deliveryRow(delivery) {
  return el("tr", { attrs: { "data-delivery-id": String(delivery.id) } }, [
    el("td", { text: when(delivery.created_at) }),
    el("td", { text: delivery.type }),
    el("td", { text: delivery.job_id ?? "—", className: "mono" }),
    el("td", { text: delivery.status, className: `delivery-${delivery.status}` }),
    el("td", { text: String(delivery.attempts) }),
    el("td", { text: lastAnswer(delivery) }),
    el("td", {}, delivery.status === "pending" ? [] : [resend(delivery)]),
  ]);
}

async function refresh() {
  try {
    const page = await api("/webhooks");
    tbody.replaceChildren(...page.data.map(row));
    const card = document.getElementById("deliveries-card");
    if (shown && page.data.some((hook) => hook.id === shown.id)) {
      const listed = await api(`/webhooks/${encodeURIComponent(shown.id)}/deliveries?limit=20`);
      document.getElementById("deliveries-title").textContent = `Deliveries to ${shown.url}`;
      deliveries.replaceChildren(...listed.data.map(deliveryRow));
      card.hidden = false;
    } else {
      card.hidden = true;
    }
  } catch (err) {
    showError(error, err);
  }
}

onSubmit(document.getElementById("create"), (event) => {
  const form = new FormData(event.target);
  const body = { url: form.get("url"), events: form.getAll("events") };
  if (form.get("description")) body.description = form.get("description");
  act(async () => {
    const created = await api("/webhooks", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    showSecret(`Endpoint ${created.id} added for ${created.tenant}.`, created.secret);
    event.target.reset();
  });
});

refresh();
setInterval(refresh, REFRESH_MS);
