// A small SVG line chart of values against step. Each series keeps every point; drawing is downsampled
// to about one point per pixel column, and the full data is on the series' <path data-points="[[x,y]…]">.

const SVG_NS = "http://www.w3.org/2000/svg";
const WIDTH = 800;
const HEIGHT = 320;
const MARGIN = { top: 16, right: 20, bottom: 44, left: 64 };
const PLOT_W = WIDTH - MARGIN.left - MARGIN.right;
const PLOT_H = HEIGHT - MARGIN.top - MARGIN.bottom;
const MAX_MARKERS = 200;

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

// About `count` round tick values (1, 2 or 5 times a power of ten) covering [lo, hi].
function ticks(lo, hi, count) {
  const raw = (hi - lo) / count;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * magnitude).find((s) => s >= raw);
  const result = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    result.push(Number(t.toPrecision(12)));
  }
  return result;
}

// [lo, hi] of the values widened by `pad` of the span (a loop: spreading 100k values overflows the stack).
function extent(values, pad) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  if (lo === hi) {
    const spread = Math.abs(lo) * 0.1 || 1;
    return [lo - spread, hi + spread];
  }
  const margin = (hi - lo) * pad;
  return [lo - margin, hi + margin];
}

function label(value) {
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(1);
  return Number(value.toPrecision(4)).toString();
}

class Series {
  constructor(name, title, { markers }) {
    this.name = name;
    this.title = title;
    this.markers = markers;
    this.xs = [];
    this.ys = [];
  }

  // Index of the first x >= step (binary search; the points stay sorted by step).
  indexOf(step) {
    let lo = 0;
    let hi = this.xs.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (this.xs[mid] < step) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  // Adds a point, or replaces the one at the same step (a replayed event draws nothing twice).
  put(step, value) {
    const i = this.indexOf(step);
    if (this.xs[i] === step) {
      this.ys[i] = value;
    } else {
      this.xs.splice(i, 0, step);
      this.ys.splice(i, 0, value);
    }
  }

  // Keeps the first, lowest, highest and last point of each pixel column, so spikes survive.
  downsample(xToPx) {
    if (this.xs.length <= PLOT_W) return this.xs.map((x, i) => [x, this.ys[i]]);
    const out = [];
    let column = null;
    let bucket = [];
    const flush = () => {
      if (!bucket.length) return;
      const lowest = bucket.reduce((a, b) => (b[1] < a[1] ? b : a));
      const highest = bucket.reduce((a, b) => (b[1] > a[1] ? b : a));
      const kept = new Set([bucket[0], lowest, highest, bucket[bucket.length - 1]]);
      out.push(...bucket.filter((p) => kept.has(p)));
      bucket = [];
    };
    for (let i = 0; i < this.xs.length; i++) {
      const c = Math.floor(xToPx(this.xs[i]));
      if (c !== column) {
        flush();
        column = c;
      }
      bucket.push([this.xs[i], this.ys[i]]);
    }
    flush();
    return out;
  }
}

export class LineChart {
  // `svgElement` is an empty <svg>; `series` is [{name, title, markers}], drawn in that order.
  constructor(svgElement, series, { xTitle, yTitle, readout }) {
    this.root = svgElement;
    this.series = new Map(series.map((s) => [s.name, new Series(s.name, s.title, s)]));
    this.xTitle = xTitle;
    this.yTitle = yTitle;
    this.readout = readout;
    this.pending = false;
    this.root.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
    this.root.setAttribute("role", "img");
    this.root.addEventListener("pointermove", (event) => this.showNearest(event));
    this.root.addEventListener("pointerleave", () => this.hideGuide());
    this.draw();
  }

  // Replaces a series' points: [{step, value}] with null values skipped.
  set(name, points) {
    const series = this.series.get(name);
    series.xs = [];
    series.ys = [];
    for (const { step, value } of points) if (value !== null && value !== undefined) series.put(step, value);
    this.scheduleDraw();
  }

  add(name, step, value) {
    if (value === null || value === undefined) return;
    this.series.get(name).put(step, value);
    this.scheduleDraw();
  }

  // Drops every series' points past `step` (a run that went on from its checkpoint there trains them again).
  truncate(step) {
    for (const series of this.series.values()) {
      const keep = series.indexOf(step + 1);
      series.xs.length = keep;
      series.ys.length = keep;
    }
    this.scheduleDraw();
  }

  // Many points can arrive at once (a replayed stream); draw once per frame at most.
  scheduleDraw() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.draw();
    });
  }

  draw() {
    const all = [...this.series.values()];
    const xs = all.flatMap((s) => (s.xs.length ? [s.xs[0], s.xs[s.xs.length - 1]] : []));
    const ys = all.flatMap((s) => s.ys);
    this.root.replaceChildren();
    this.root.setAttribute("aria-label", this.describe());
    if (!xs.length) {
      this.scale = null;
      const centre = { x: WIDTH / 2, y: HEIGHT / 2, "text-anchor": "middle", class: "empty" };
      this.root.append(svg("text", centre, "No metrics yet"));
      for (const s of all) this.root.append(this.pathFor(s, []));
      return;
    }
    const [x0, x1] = extent(xs, 0);
    const [y0, y1] = extent(ys, 0.05);
    const xToPx = (x) => MARGIN.left + ((x - x0) / (x1 - x0)) * PLOT_W;
    const yToPx = (y) => MARGIN.top + (1 - (y - y0) / (y1 - y0)) * PLOT_H;
    this.scale = { x0, x1, xToPx, yToPx };
    this.drawAxes(x0, x1, y0, y1, xToPx, yToPx);
    for (const s of all) {
      const drawn = s.downsample(xToPx);
      const d = drawn.map(([x, y], i) => `${i ? "L" : "M"}${xToPx(x).toFixed(1)},${yToPx(y).toFixed(1)}`);
      this.root.append(this.pathFor(s, d));
      if (s.markers && s.xs.length <= MAX_MARKERS) this.drawMarkers(s, xToPx, yToPx);
    }
    const guide = { class: "guide", y1: MARGIN.top, y2: MARGIN.top + PLOT_H, visibility: "hidden" };
    this.guide = svg("line", guide);
    this.root.append(this.guide);
  }

  pathFor(series, d) {
    const path = svg("path", {
      class: `series series-${series.name}`,
      d: d.join(" ") || "M0,0",
      "data-series": series.name,
      "data-count": series.xs.length,
      "data-points": JSON.stringify(series.xs.map((x, i) => [x, series.ys[i]])),
    });
    path.append(svg("title", {}, series.title));
    return path;
  }

  drawMarkers(series, xToPx, yToPx) {
    series.xs.forEach((x, i) => {
      const dot = svg("circle", {
        class: `marker series-${series.name}`,
        cx: xToPx(x).toFixed(1),
        cy: yToPx(series.ys[i]).toFixed(1),
        r: 4,
      });
      dot.append(svg("title", {}, `step ${x}: ${series.title.toLowerCase()} ${label(series.ys[i])}`));
      this.root.append(dot);
    });
  }

  drawAxes(x0, x1, y0, y1, xToPx, yToPx) {
    const axes = svg("g", { class: "axes", "aria-hidden": "true" });
    const left = MARGIN.left;
    const right = MARGIN.left + PLOT_W;
    const bottom = MARGIN.top + PLOT_H;
    for (const y of ticks(y0, y1, 5)) {
      const py = yToPx(y).toFixed(1);
      axes.append(svg("line", { class: "grid", x1: left, x2: right, y1: py, y2: py }));
      const at = { x: left - 8, y: py, "text-anchor": "end", "dominant-baseline": "middle" };
      axes.append(svg("text", at, label(y)));
    }
    for (const x of ticks(x0, x1, 6).filter(Number.isInteger)) {
      const px = xToPx(x).toFixed(1);
      axes.append(svg("line", { class: "tick", x1: px, x2: px, y1: bottom, y2: bottom + 5 }));
      axes.append(svg("text", { x: px, y: bottom + 18, "text-anchor": "middle" }, String(x)));
    }
    axes.append(svg("line", { class: "axis", x1: left, x2: right, y1: bottom, y2: bottom }));
    axes.append(svg("line", { class: "axis", x1: left, x2: left, y1: MARGIN.top, y2: bottom }));
    axes.append(svg("text", { x: left + PLOT_W / 2, y: HEIGHT - 6, "text-anchor": "middle" }, this.xTitle));
    const middle = MARGIN.top + PLOT_H / 2;
    const vertical = { x: 14, y: middle, transform: `rotate(-90 14 ${middle})`, "text-anchor": "middle" };
    axes.append(svg("text", vertical, this.yTitle));
    this.root.append(axes);
  }

  describe() {
    const parts = [...this.series.values()].map((s) => {
      if (!s.xs.length) return `${s.title}: no points`;
      const last = s.xs.length - 1;
      return `${s.title}: ${s.xs.length} points, latest ${label(s.ys[last])} at step ${s.xs[last]}`;
    });
    return `${this.yTitle} by ${this.xTitle.toLowerCase()}. ${parts.join("; ")}.`;
  }

  // Shows the values at the step nearest the pointer, in the readout and as a vertical guide.
  showNearest(event) {
    if (!this.scale) return;
    const box = this.root.getBoundingClientRect();
    const px = ((event.clientX - box.left) / box.width) * WIDTH;
    const { x0, x1, xToPx } = this.scale;
    const step = x0 + ((px - MARGIN.left) / PLOT_W) * (x1 - x0);
    const values = [];
    let shown = null;
    for (const s of this.series.values()) {
      const i = s.indexOf(step);
      const near = [i - 1, i].filter((j) => j >= 0 && j < s.xs.length);
      if (!near.length) continue;
      const nearest = near.reduce((a, b) => (Math.abs(s.xs[b] - step) < Math.abs(s.xs[a] - step) ? b : a));
      shown ??= s.xs[nearest];
      if (s.xs[nearest] === shown) values.push(`${s.title.toLowerCase()} ${label(s.ys[nearest])}`);
    }
    if (shown === null) return;
    this.guide.setAttribute("x1", xToPx(shown));
    this.guide.setAttribute("x2", xToPx(shown));
    this.guide.setAttribute("visibility", "visible");
    this.readout.textContent = `Step ${shown}: ${values.join(", ")}`;
  }

  hideGuide() {
    this.guide?.setAttribute("visibility", "hidden");
  }
}
