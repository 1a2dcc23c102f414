// Helpers shared by the dashboard pages: API calls, formatting, small DOM builders.

export const FINAL_STATUSES = new Set(["succeeded", "failed", "cancelled"]);

// Calls the JSON API; a failure throws the API's own error sentence (or says the API is unreachable).
export async function api(path, options = {}) {
  let response;
  try {
    response = await fetch(path, { headers: { Accept: "application/json" }, ...options });
  } catch {
    throw new Error("Could not reach the API; check that the server is running.");
  }
  const body = await response.json().catch(() => null);
  if (response.status === 401) askToSignIn();
  warnIfKeyExpiresSoon(response.headers.get("x-tputune-key-expires"));
  if (!response.ok) {
    throw new Error(body?.error?.message ?? `The API answered ${response.status}.`);
  }
  return body;
}

// A key that expires within a week: a line in the page header says when, so that it is rotated in time.
const EXPIRY_WARNING_MS = 7 * 24 * 3600 * 1000;

function warnIfKeyExpiresSoon(said) {
  const header = document.querySelector("header.top");
  if (!said || !header || document.getElementById("key-expiry")) return;
  const expires = Date.parse(said.replace(" UTC", "Z").replace(" ", "T"));
  const left = expires - Date.now();
  if (Number.isNaN(expires) || left >= EXPIRY_WARNING_MS) return;
  const hours = Math.max(0, Math.floor(left / 3600000));
  const when = hours >= 48 ? `${Math.floor(hours / 24)} days` : `${hours} hours`;
  header.append(el("p", {
    className: "key-expiry",
    attrs: { id: "key-expiry", role: "status" },
    text: `This API key expires at ${said} (in ${when}): ask your admin to rotate it.`,
  }));
}

// With keys turned on, the browser signs in once: POST /auth/session stores the key in an HttpOnly cookie.
// The form is the same on every page: made here, at the top of the page's main, when a call is refused.
function askToSignIn() {
  if (document.getElementById("signin")) return;
  const input = el("input", {
    attrs: { id: "api-key", name: "key", type: "password", autocomplete: "current-password", required: "" },
  });
  const form = el("form", { className: "card signin", attrs: { id: "signin" } }, [
    el("h2", { text: "Sign in" }),
    el("p", { className: "muted", text: "This server needs an API key; this browser keeps it in a cookie." }),
    el("label", { text: "API key", attrs: { for: "api-key" } }),
    input,
    el("button", { text: "Sign in", attrs: { type: "submit" } }),
    el("p", { className: "error", attrs: { id: "signin-error", role: "alert", hidden: "" } }),
  ]);
  document.querySelector("main").prepend(form);
  input.focus();
  onSubmit(form, async () => {
    const error = document.getElementById("signin-error");
    try {
      await api("/auth/session", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ key: new FormData(form).get("key") }),
      });
      location.reload();
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
    }
  });
}

// Whether this browser is signed in, and with which key: GET /auth/session (null if it failed).
export const session = api("/auth/session").catch(() => null);

// A browser signed in with a key gets a "Sign out" button in the page header.
async function showSession() {
  const state = await session;
  const header = document.querySelector("header.top");
  if (!state?.signed_in || !header) return;
  const button = el("button", { text: "Sign out", attrs: { type: "button", id: "signout" } });
  button.addEventListener("click", async () => {
    await api("/auth/session", { method: "DELETE" }).catch(() => null);
    location.reload();
  });
  if (state.read_only) document.body.classList.add("read-only");
  const who = (state.admin
    ? "Signed in as the admin: every tenant's jobs"
    : `Signed in to tenant ${state.tenant}`) + (state.read_only ? ", read-only. " : ". ");
  const links = state.admin
    ? [
        el("a", { text: "API keys", attrs: { href: "/ui/keys", id: "keys-link" } }),
        " ",
        el("a", { text: "Teams", attrs: { href: "/ui/tenants", id: "tenants-link" } }),
        " ",
      ]
    : [];
  header.append(el("p", { className: "session muted", attrs: { id: "session" } }, [who, ...links, button]));
}

showSession();

// An API time to the minute, as `2026-12-05 06:32` (UTC).
export function minute(stamp) {
  return stamp ? stamp.slice(0, 16).replace("T", " ") : "";
}

// Shows a failed call's sentence (the API's) in `errorNode`.
export function showError(errorNode, err) {
  errorNode.textContent = err.message;
  errorNode.hidden = false;
}

// Runs what a button or form does: a failure shows the API's sentence in `errorNode`, a success hides it.
export async function showingErrors(errorNode, action) {
  try {
    await action();
    errorNode.hidden = true;
  } catch (err) {
    showError(errorNode, err);
  }
}

// A button that says what it does to a screen reader (`label`), e.g. "Revoke key_1".
export function button(text, label, onClick) {
  const node = el("button", { text, attrs: { type: "button", "aria-label": label } });
  node.addEventListener("click", onClick);
  return node;
}

// A button that changes something: not shown to a read-only key (the `writes` class, dashboard.css).
export function writeButton(text, label, onClick) {
  const node = button(text, label, onClick);
  node.classList.add("writes");
  return node;
}

// A form handled by the page's script, never sent by the browser itself: its submit button is disabled in
// the page's HTML until the handler is in place. (Clicked before the script had run, on a slow machine, the
// browser sent the form as a GET of the page, its fields in the URL, and nothing said what happened.)
export function onSubmit(form, handler) {
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    return handler(event);
  });
  for (const submit of form.querySelectorAll('button[type="submit"]')) submit.disabled = false;
}

// Shows a secret (an API key, a webhook's signing secret) in the page's #secret card, the one time it is given.
export function showSecret(what, secret) {
  document.getElementById("secret-what").textContent = what;
  document.getElementById("secret-key").textContent = secret;
  document.getElementById("secret").hidden = false;
}

// Creates an element with text content (never HTML, so job names and samples cannot inject markup).
export function el(tag, { text, className, attrs } = {}, children = []) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  for (const [name, value] of Object.entries(attrs ?? {})) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

export function formatNumber(value, digits = 4) {
  if (value === null || value === undefined) return "—";
  if (value !== 0 && (Math.abs(value) < 1e-3 || Math.abs(value) >= 1e6)) return value.toExponential(2);
  return Number(value.toPrecision(digits)).toString();
}

export function formatInteger(value) {
  return value === null || value === undefined ? "—" : Math.round(value).toLocaleString("en-US");
}

export function formatDuration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.max(0, Math.round(seconds));
  const parts = [
    [Math.floor(s / 86400), "d"],
    [Math.floor((s % 86400) / 3600), "h"],
    [Math.floor((s % 3600) / 60), "m"],
    [s % 60, "s"],
  ];
  const first = parts.findIndex(([n]) => n > 0);
  if (first === -1) return "0s";
  return parts
    .slice(first, first + 2)
    .filter(([n], i) => i === 0 || n > 0)
    .map(([n, unit]) => `${n}${unit}`)
    .join(" ");
}

export function formatDate(iso) {
  return iso ? new Date(iso).toLocaleString() : "—";
}

export function formatAge(iso) {
  return `${formatDuration((Date.now() - new Date(iso).getTime()) / 1000).split(" ")[0]} ago`;
}

// A token accuracy (0..1) as a percentage with one decimal: "42.5%"; "—" when missing.
export function formatAccuracy(value) {
  return value === null || value === undefined ? "—" : `${(value * 100).toFixed(1)}%`;
}

export function percent(fraction) {
  return fraction === null || fraction === undefined ? "" : `${Math.floor(fraction * 100)}%`;
}

// A <progress> shows the fraction, or no value (indeterminate) while a run has no step total yet.
export function setProgress(progress, job) {
  const fraction = job.progress.fraction;
  if (fraction !== null) {
    progress.value = fraction;
  } else if (job.status === "running") {
    progress.removeAttribute("value");
  } else {
    progress.value = 0;
  }
  progress.setAttribute("aria-valuetext", percent(fraction) || "unknown");
}

export function statusBadge(status) {
  return el("span", { text: status, className: "badge", attrs: { "data-status": status } });
}
