// The job page: status, loss curve, samples, checkpoints and events, kept live by Server-Sent Events.
import { LineChart } from "./chart.js";
import {
  api,
  el,
  FINAL_STATUSES,
  formatAccuracy,
  formatDate,
  formatDuration,
  formatInteger,
  formatNumber,
  percent,
  setProgress,
} from "./common.js";

const $ = (id) => document.getElementById(id);
const jobId = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop());
const base = `/jobs/${encodeURIComponent(jobId)}`;
// Everything but per-step metrics, which would bury the rest; those go to the chart.
const TIMELINE_TYPES = [
  "status", "launch", "data", "eval", "checkpoint", "sample", "result", "restart", "warning", "error",
];
const REFRESH_MS = 1000;
// A queued job's place changes as the jobs ahead of it start, which adds no event of its own: read it again.
const QUEUE_REFRESH_MS = 5000;
// Pause stops a job that may still run; resume queues a paused or failed one again (it goes on from its
// last checkpoint). (Cancel: any unfinished job.)
const PAUSABLE = new Set(["queued", "starting", "running"]);
const RESUMABLE = new Set(["paused", "failed"]);
const PAUSED_OR_PAUSING = new Set(["pausing", "paused"]);

const chart = new LineChart(
  $("loss-chart"),
  [
    { name: "loss", title: "Training loss", markers: false },
    { name: "eval_loss", title: "Eval loss", markers: true },
  ],
  { xTitle: "Step", yTitle: "Loss", readout: $("chart-readout") },
);
// Shown once the job has a token accuracy (a worker from before it was reported sends none).
const accuracyChart = new LineChart(
  $("accuracy-chart"),
  [
    { name: "accuracy", title: "Training token accuracy", markers: false },
    { name: "eval_accuracy", title: "Eval token accuracy", markers: true },
  ],
  { xTitle: "Step", yTitle: "Token accuracy", readout: $("accuracy-readout") },
);

function addAccuracy(name, step, value) {
  if (value === null || value === undefined) return;
  accuracyChart.add(name, step, value);
  $("accuracy-card").hidden = false;
}
// A dpo job's rewards, chosen and rejected: shown once its worker reports them.
const REWARDS = ["chosen_reward", "rejected_reward", "eval_chosen_reward", "eval_rejected_reward"];
const rewardsChart = new LineChart(
  $("rewards-chart"),
  [
    { name: "chosen_reward", title: "Chosen reward", markers: false },
    { name: "rejected_reward", title: "Rejected reward", markers: false },
    { name: "eval_chosen_reward", title: "Eval chosen reward", markers: true },
    { name: "eval_rejected_reward", title: "Eval rejected reward", markers: true },
  ],
  { xTitle: "Step", yTitle: "Reward", readout: $("rewards-readout") },
);

function addRewards(step, data, names) {
  for (const name of names) {
    const value = data?.[name];
    if (value === null || value === undefined) continue;
    rewardsChart.add(name, step, value);
    $("rewards-card").hidden = false;
  }
}
const sampleRows = new Map();
const checkpointRows = new Map();
let job = null;

function setStatus(status) {
  $("status").textContent = status;
  $("status").dataset.status = status;
  $("cancel").disabled = FINAL_STATUSES.has(status) || status === "cancelling";
  $("pause").disabled = !PAUSABLE.has(status);
  $("resume").disabled = !RESUMABLE.has(status);
  $("delete").disabled = !FINAL_STATUSES.has(status);
}

let queueTimer = null;

// 1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st
function ordinal(n) {
  const teen = n % 100 >= 10 && n % 100 <= 20;
  return `${n}${teen ? "th" : { 1: "st", 2: "nd", 3: "rd" }[n % 10] ?? "th"}`;
}

// A dpo job's rewards: "chosen +0.25, rejected -0.5 (margin +0.75)" (as its events and `tputune status`
// say them); "—" before its worker reports them.
function formatRewards(chosen, rejected) {
  if (chosen === null || rejected === null) return "—";
  const signed = (value) => (value > 0 ? "+" : "") + formatNumber(value);
  return `chosen ${signed(chosen)}, rejected ${signed(rejected)} (margin ${signed(chosen - rejected)})`;
}

function showJob(next) {
  job = next;
  document.title = `${job.name} · tputune`;
  $("job-name").textContent = job.name;
  $("job-id").textContent = job.id;
  setStatus(job.status);
  $("status-message").textContent = job.status_message ?? "";
  const place = job.queue_position;
  $("queue-place").textContent = place ? `${ordinal(place)} in the queue` : "";
  clearTimeout(queueTimer);
  if (place) queueTimer = setTimeout(() => loadJob().catch(showLoadError), QUEUE_REFRESH_MS);
  $("job-error").hidden = !job.error;
  $("job-error-code").textContent = job.error?.code ?? "";
  $("job-error-message").textContent = job.error?.message ?? "";

  const { step, total_steps: total, fraction, eta_seconds: eta } = job.progress;
  setProgress($("progress"), job);
  let progress = total ? `Step ${step} of ${total} (${percent(fraction)})` : `Step ${step}`;
  // (no time left to show once it ended, or while it is paused: it stands still)
  const moving = !FINAL_STATUSES.has(job.status) && !PAUSED_OR_PAUSING.has(job.status);
  if (eta > 0 && moving) progress += ` · about ${formatDuration(eta)} left`;
  $("progress-text").textContent = progress;

  const spec = JSON.stringify(job.spec, null, 2);
  if ($("f-spec").textContent !== spec) $("f-spec").textContent = spec; // (unchanged: its scroll stays)
  $("f-model").textContent = job.model;
  const dpo = job.spec.method.objective === "dpo";
  const simpo = dpo && Boolean(job.spec.method.simpo_gamma);
  $("f-method").textContent = dpo ? `${job.method}, ${simpo ? "simpo" : "dpo"}` : job.method;
  // (a dpo job's accuracy: the share of preference pairs whose chosen reply it favours, against its reference)
  for (const label of ["accuracy-label", "accuracy-heading"]) {
    $(label).textContent = dpo ? "Pair accuracy" : "Token accuracy";
  }
  $("f-executor").textContent = job.executor;
  $("f-tenant").textContent = job.tenant;
  $("f-loss").textContent = formatNumber(job.metrics.loss);
  $("f-eval-loss").textContent = formatNumber(job.metrics.eval_loss);
  $("f-accuracy").textContent = formatAccuracy(job.metrics.accuracy);
  $("f-eval-accuracy").textContent = formatAccuracy(job.metrics.eval_accuracy);
  for (const [fact, prefix] of [["rewards", ""], ["eval-rewards", "eval_"]]) {
    const chosen = job.metrics[`${prefix}chosen_reward`] ?? null;
    const rejected = job.metrics[`${prefix}rejected_reward`] ?? null;
    $(`${fact}-fact`).hidden = !dpo;
    $(`f-${fact}`).textContent = formatRewards(chosen, rejected);
  }
  $("f-lr").textContent = formatNumber(job.metrics.learning_rate);
  $("f-tps").textContent = formatInteger(job.metrics.tokens_per_second);
  $("f-tokens").textContent = formatInteger(job.trained_tokens);
  $("f-data").textContent = formatData(job.data_stats);
  $("f-restarts").textContent = String(job.restarts);
  $("f-preemptions").textContent = String(job.preemptions);
  $("f-pauses").textContent = String(job.pauses ?? 0);
  $("f-retries").textContent = String(job.retries ?? 0);
  $("f-chip-hours").textContent = formatUsage(job.usage);
  $("f-created").textContent = formatDate(job.created_at);
  $("f-started").textContent = formatDate(job.started_at);
  $("f-finished").textContent = formatDate(job.finished_at);
  $("f-output").textContent = job.output_uri;
  $("f-exported").textContent = formatExported(job);
  $("f-hf").textContent = formatHf(job.exports);
  $("f-gguf").textContent = (job.exports && job.exports.gguf) || "—";
}

// The Hugging Face model's path, and a LoRA job's PEFT adapter; "—" without one (or before it succeeded).
function formatHf(exports) {
  if (!exports || !exports.hf) return "—";
  return exports.hf_adapter ? `${exports.hf} (adapter for PEFT: ${exports.hf_adapter})` : exports.hf;
}

// "step 12 (the last)", or with export_best "step 4 (the lowest eval loss)"; "—" before it succeeded.
function formatExported(job) {
  const exported = job.exported_step;
  if (exported === null || exported === undefined) return "—";
  const which = exported === job.progress.step ? "the last" : "the lowest eval loss";
  return `step ${formatInteger(exported)} (${which})`;
}

// "2.003 · 1 process for 2h": its chip-hours, and what it held for how long; "—" before it took its chips.
function formatUsage(usage) {
  if (!usage || !usage.held_seconds) return "—";
  const singular = { processes: "process", "TPU chips": "TPU chip" };
  const unit = usage.chips === 1 ? singular[usage.chip_unit] || usage.chip_unit : usage.chip_unit;
  const hours = formatNumber(usage.chip_hours);
  return `${hours} · ${usage.chips} ${unit} for ${formatDuration(usage.held_seconds)}`;
}

async function loadJob() {
  showJob(await api(base));
}

// Many events can arrive together; re-read the job at most once a second for its progress and figures.
let refreshTimer = null;
function refreshSoon() {
  refreshTimer ??= setTimeout(() => {
    refreshTimer = null;
    loadJob().catch(showLoadError);
  }, REFRESH_MS);
}

function addSample(event) {
  const { phase, prompt, text } = event.data ?? {};
  let row = sampleRows.get(prompt);
  if (!row) {
    const cell = (phaseName) => el("td", {}, [el("div", { className: `sample-text ${phaseName}` })]);
    row = el("tr", {}, [el("th", { text: prompt, attrs: { scope: "row" } }), cell("before"), cell("after")]);
    sampleRows.set(prompt, row);
    $("samples").tBodies[0].append(row);
  }
  row.querySelector(phase === "after" ? ".after" : ".before").textContent = text;
  $("samples").hidden = false;
  $("samples-empty").hidden = true;
}

function addCheckpoint(event) {
  const data = event.data ?? {};
  const saved = el("time", { text: formatDate(event.created_at), attrs: { datetime: event.created_at } });
  const row = el("tr", { attrs: { "data-step": event.step } }, [
    el("td", { text: event.step, className: "num" }),
    el("td", { text: data.uri, className: "mono" }),
    el("td", { text: formatNumber(data.loss ?? null), className: "num" }),
    el("td", { text: formatNumber(data.eval_loss ?? null), className: "num" }),
    el("td", { text: formatAccuracy(data.accuracy), className: "num" }),
    el("td", { text: formatAccuracy(data.eval_accuracy), className: "num" }),
    el("td", {}, [saved]),
  ]);
  const existing = checkpointRows.get(event.step);
  if (existing) {
    existing.replaceWith(row);
  } else {
    const later = [...checkpointRows.keys()].filter((step) => step > event.step).sort((a, b) => a - b)[0];
    $("checkpoints").tBodies[0].insertBefore(row, checkpointRows.get(later) ?? null);
  }
  checkpointRows.set(event.step, row);
  // Which are still there, as the worker said with this one (the others removed: its last keep_checkpoints).
  if (Array.isArray(data.kept)) {
    const kept = new Set(data.kept);
    for (const [step, each] of checkpointRows) {
      const gone = !kept.has(step);
      each.classList.toggle("removed", gone);
      each.title = gone ? "Removed: the job keeps its latest checkpoints (keep_checkpoints)" : "";
    }
  }
  $("checkpoints").hidden = false;
  $("checkpoints-empty").hidden = true;
}

function addToTimeline(event) {
  const when = el("time", { text: formatDate(event.created_at), attrs: { datetime: event.created_at } });
  const item = el("li", { className: `event level-${event.level}`, attrs: { "data-type": event.type } }, [
    when,
    el("span", { text: event.type, className: "type" }),
    el("span", { text: event.message, className: "message" }),
  ]);
  $("events").prepend(item);
}

function handleEvent(event) {
  switch (event.type) {
    case "metrics":
      chart.add("loss", event.step, event.data?.loss);
      addAccuracy("accuracy", event.step, event.data?.accuracy);
      addRewards(event.step, event.data, REWARDS.slice(0, 2));
      return;
    case "eval":
      chart.add("eval_loss", event.step, event.data?.eval_loss);
      addAccuracy("eval_accuracy", event.step, event.data?.eval_accuracy);
      addRewards(event.step, event.data, REWARDS.slice(2));
      break;
    case "sample":
      addSample(event);
      break;
    case "checkpoint":
      addCheckpoint(event);
      break;
  }
  addToTimeline(event);
}

// Pages through the non-metrics events oldest first; returns the last id, where the live stream resumes.
async function loadEvents() {
  let after = 0;
  for (;;) {
    const query = new URLSearchParams({ after: String(after), limit: "1000" });
    for (const type of TIMELINE_TYPES) query.append("type", type);
    const page = await api(`${base}/events?${query}`);
    page.data.forEach(handleEvent);
    if (page.data.length) after = page.data[page.data.length - 1].id;
    if (!page.has_more) return after;
  }
}

async function loadMetrics() {
  const points = [];
  let minStep = 0;
  for (;;) {
    const page = await api(`${base}/metrics?limit=10000&min_step=${minStep}`);
    for (const point of page.data) points.push(point);
    if (!page.has_more || !page.data.length) break;
    minStep = page.data[page.data.length - 1].step + 1;
  }
  chart.set("loss", points.map((p) => ({ step: p.step, value: p.loss })));
  chart.set("eval_loss", points.map((p) => ({ step: p.step, value: p.eval_loss })));
  for (const name of ["accuracy", "eval_accuracy"]) {
    accuracyChart.set(name, points.map((p) => ({ step: p.step, value: p[name] ?? null })));
  }
  if (points.some((p) => (p.accuracy ?? p.eval_accuracy ?? null) !== null)) $("accuracy-card").hidden = false;
  for (const name of REWARDS) {
    rewardsChart.set(name, points.map((p) => ({ step: p.step, value: p[name] ?? null })));
  }
  if (points.some((p) => REWARDS.some((name) => (p[name] ?? null) !== null))) $("rewards-card").hidden = false;
}

// Metrics events after `after` may repeat points loaded from /metrics; the chart keeps one per step.
// A stream the browser gives up on (the server restarted, or answered 429 or 503) is followed again from
// the last event seen, after 2 s, then twice as long each time, up to a minute.
const RESUME_FIRST_MS = 2000;
const RESUME_MAX_MS = 60000;
let lastEventId = 0;
let resumeMs = RESUME_FIRST_MS;
// The stream ended with the job; a failed job its owner resumes is followed again.
let ended = false;

function follow(after) {
  lastEventId = after;
  const live = $("live");
  const source = new EventSource(`${base}/events?follow=true&after=${after}`);
  source.addEventListener("open", () => {
    live.textContent = "● Live";
    resumeMs = RESUME_FIRST_MS;
  });
  for (const type of [...TIMELINE_TYPES, "metrics"]) {
    source.addEventListener(type, (message) => {
      // The connection's own failures are also "error" events, but not MessageEvents.
      if (!(message instanceof MessageEvent)) return;
      const event = JSON.parse(message.data);
      lastEventId = event.id;
      // A run went on from its checkpoint: the steps after it are trained again, their reports replaced (the
      // API dropped the earlier run's; a page loaded later never had them).
      if (event.type === "status" && Number.isInteger(event.data?.resumed_from)) {
        chart.truncate(event.data.resumed_from);
        accuracyChart.truncate(event.data.resumed_from);
        rewardsChart.truncate(event.data.resumed_from);
      }
      handleEvent(event);
      if (event.type === "status" && event.data?.status) setStatus(event.data.status);
      refreshSoon();
    });
  }
  source.addEventListener("end", () => {
    source.close();
    ended = true;
    live.textContent = "Job finished; no more updates.";
    loadJob()
      .then(() => {
        // Resumed just now (a failed job): the stream ended on a read from before; follow it again.
        if (ended && !FINAL_STATUSES.has(job.status)) {
          ended = false;
          resumeLater((seconds) => `Resumed; following again in ${seconds} s.`);
        }
      })
      .catch(showLoadError);
  });
  // The server stopped the stream (the key was revoked): following again would be refused too.
  source.addEventListener("closed", (message) => {
    source.close();
    live.textContent = `Live updates stopped: ${JSON.parse(message.data).message}`;
    loadJob().catch(showLoadError);
  });
  source.addEventListener("error", (event) => {
    if (event instanceof MessageEvent) return;
    if (source.readyState !== EventSource.CLOSED) {
      live.textContent = "Reconnecting…";
      return;
    }
    resumeLater((seconds) => `Disconnected; following again in ${seconds} s.`);
  });
}

// Re-read the job first: a key no longer valid shows the sign-in form, and a failure waits longer.
async function resume() {
  try {
    await loadJob();
  } catch (error) {
    resumeLater((seconds) => `${error.message} Trying again in ${seconds} s.`);
    return;
  }
  follow(lastEventId);
}

// Calls resume() after the current wait, which doubles for the next time; says so with `says(seconds)`.
function resumeLater(says) {
  const wait = resumeMs;
  resumeMs = Math.min(resumeMs * 2, RESUME_MAX_MS);
  $("live").textContent = says(Math.round(wait / 1000));
  setTimeout(resume, wait);
}

function showLoadError(error) {
  $("load-error").textContent = error.message;
  $("load-error").hidden = false;
}

$("cancel").addEventListener("click", async () => {
  if (!confirm(`Cancel job ${job.name}? A running job stops its workers.`)) return;
  $("cancel").disabled = true;
  $("cancel-error").hidden = true;
  $("action-error").hidden = true;
  try {
    showJob(await api(`${base}/cancel`, { method: "POST" }));
  } catch (error) {
    $("cancel-error").textContent = error.message;
    $("cancel-error").hidden = false;
    loadJob().catch(showLoadError);
  }
});

// Delete an ended job: asked first (it cannot be undone); done, back to the jobs list.
$("delete").addEventListener("click", async () => {
  const where = job.output_uri ? ` Its outputs stay at ${job.output_uri}.` : "";
  if (!confirm(`Delete job ${job.name} with its events and logs? This cannot be undone.${where}`)) return;
  $("delete").disabled = true;
  $("action-error").hidden = true;
  $("cancel-error").hidden = true;
  try {
    await api(base, { method: "DELETE" });
    window.location.assign("/ui/");
  } catch (error) {
    $("action-error").textContent = error.message;
    $("action-error").hidden = false;
    loadJob().catch(showLoadError);
  }
});

// Pause and resume: no confirmation (each undoes the other); a refusal shows the API's sentence.
for (const action of ["pause", "resume"]) {
  $(action).addEventListener("click", async () => {
    $(action).disabled = true;
    $("action-error").hidden = true;
    $("cancel-error").hidden = true;
    try {
      showJob(await api(`${base}/${action}`, { method: "POST" }));
      if (ended && !FINAL_STATUSES.has(job.status)) {
        ended = false;
        follow(lastEventId);
      }
    } catch (error) {
      $("action-error").textContent = error.message;
      $("action-error").hidden = false;
      loadJob().catch(showLoadError);
    }
  });
}

// What the data came to: "380 documents, 51,234 tokens in 790 rows of 64 (0.2% padding); 98 steps an
// epoch; validation 20 documents" (a dpo job's: preference pairs; — until the worker has packed it).
function formatData(data) {
  if (!data) return "—";
  const padding = `${(data.pad_fraction * 100).toFixed(1)}% padding`;
  const documents = data.preference_pairs ? "preference pairs" : "documents";
  let text = `${formatInteger(data.documents)} ${documents}, ${formatInteger(data.tokens)} tokens in `
    + `${formatInteger(data.rows)} rows of ${data.row_tokens} (${padding}); `
    + `${formatInteger(data.steps_per_epoch)} steps an epoch`;
  if (data.validation_documents != null) {
    text += `; validation ${formatInteger(data.validation_documents)} ${documents}`;
  }
  return text;
}

$("logs").addEventListener("toggle", async () => {
  if (!$("logs").open) return;
  try {
    const logs = await api(`${base}/logs?tail=200`);
    $("log-lines").textContent = logs.lines.join("\n") || "No log lines yet.";
    // (GKE: the run's pods are gone, and their logs with them; these lines were saved as it ended)
    $("log-saved").textContent = logs.saved_at
      ? `Saved as the last run ended (${formatDate(logs.saved_at)}): its workers are gone.`
      : "";
    $("log-saved").hidden = !logs.saved_at;
  } catch (error) {
    $("log-lines").textContent = error.message;
  }
});

async function start() {
  try {
    await loadJob();
    const after = await loadEvents();
    await loadMetrics();
    follow(after);
  } catch (error) {
    showLoadError(error);
  }
}

start();
