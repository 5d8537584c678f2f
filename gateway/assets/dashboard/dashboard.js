// The dashboard: polls dashboard/state once a second and draws it with uPlot (vendored, served by the gateway).
// Text goes in with textContent, never as HTML. Every chart's container carries `data-points` (how many seconds,
// versions or buckets it drew) and #errors collects the page's own errors: the headless-browser test reads both.
"use strict";

const $ = (id) => document.getElementById(id);
const errors = [];

function reportError(message) {
  errors.push(String(message));
  const box = $("errors");
  box.dataset.count = String(errors.length);
  box.textContent = "page errors: " + errors.join(" | ");
}
window.addEventListener("error", (event) => reportError(event.message));
window.addEventListener("unhandledrejection", (event) => reportError(event.reason));

const show = (id, value) => { $(id).textContent = value === null || value === undefined ? "\u2013" : value; };
const COLORS = ["#4c7bd9", "#d08700", "#1f9d55", "#d64545", "#8a55d6", "#2aa3b8"];
const charts = {};

function width(el) { return Math.max(300, el.clientWidth || 500); }

function lineSeries(names) {
  return [{}, ...names.map((name, i) => ({ label: name, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false }))];
}

function chart(id, opts, data) {
  const el = $(id);
  if (!charts[id]) {
    charts[id] = new uPlot({ width: width(el), height: 200, ...opts }, data, el);
  } else {
    charts[id].setData(data);
  }
  // Points drawn: x values with at least one y value.
  let points = 0;
  for (let i = 0; i < data[0].length; i++) {
    if (data.slice(1).some((column) => column[i] !== null && column[i] !== undefined)) points++;
  }
  el.dataset.points = String(points);
  return charts[id];
}

window.addEventListener("resize", () => {
  for (const [id, plot] of Object.entries(charts)) plot.setSize({ width: width($(id)), height: plot.height });
});

// -- the weight-version timeline: bands drawn under a stepped version line and the preemptions as bars -----------

let timeline = [];
const PHASES = [["started_at", "paused_at", "rgba(208,135,0,.30)"], ["paused_at", "loaded_at", "rgba(76,123,217,.30)"],
  ["loaded_at", "finished_at", "rgba(31,157,85,.30)"]];

function drawBands(u) {
  const ctx = u.ctx;
  const { top, height } = u.bbox;
  ctx.save();
  for (const ev of timeline) {
    for (const [from, to, color] of PHASES) {
      if (!ev[from] || !ev[to]) continue;
      const x0 = u.valToPos(ev[from], "x", true);
      const x1 = Math.max(x0 + 2, u.valToPos(ev[to], "x", true));
      ctx.fillStyle = ev.status === "failed" ? "rgba(214,69,69,.45)" : color;
      ctx.fillRect(x0, top, x1 - x0, height);
    }
    if (ev.status !== "updated") {
      const x = u.valToPos(ev.started_at, "x", true);
      ctx.fillStyle = "#d64545";
      ctx.font = "bold " + Math.round(11 * devicePixelRatio) + "px system-ui";
      ctx.fillText(ev.status + " v" + ev.version, x + 3, top + 14 * devicePixelRatio);
    }
  }
  ctx.restore();
}

function seconds(value) { return value ? value.toFixed(2) + " s" : "\u2013"; }

function renderUpdates(events) {
  const body = document.createElement("tbody");
  body.id = "updates";
  for (const ev of [...events].reverse().slice(0, 12)) {  // the newest dozen; the chart shows them all
    const row = body.insertRow();
    row.dataset.version = ev.version;
    row.dataset.status = ev.status;
    const cells = [ev.version, ev.mode, ev.status,
      seconds(ev.paused_at && ev.paused_at - ev.started_at), seconds(ev.loaded_at && ev.paused_at && ev.loaded_at - ev.paused_at),
      seconds(ev.finished_at && ev.loaded_at && ev.finished_at - ev.loaded_at), seconds(ev.duration_s), ev.preemptions];
    for (const text of cells) row.insertCell().textContent = text;
  }
  $("updates").replaceWith(body);
}

// -- replicas: a row each, with sparklines ----------------------------------------------------------------------

const replicaRows = {};

function health(r) {
  if (!r.healthy) return ["down", "bad"];
  if (r.stale) return ["stale", "warn"];
  if (r.draining) return ["draining", "warn"];
  return ["healthy", "ok"];
}

function spark(cell, color, stepped) {
  const box = document.createElement("div");
  box.className = "spark";
  cell.appendChild(box);
  const line = { stroke: color, fill: color + "33", width: 1 };
  if (stepped) line.paths = uPlot.paths.stepped({ align: 1 });
  return new uPlot({
    width: 130, height: 30, legend: { show: false }, cursor: { show: false }, select: { show: false },
    axes: [{ show: false }, { show: false }], scales: { x: { time: true } },
    series: [{}, line],
  }, [[], []], box);
}

function renderReplicas(replicas, series) {
  const seen = new Set();
  for (const r of replicas) {
    seen.add(r.id);
    let entry = replicaRows[r.id];
    if (!entry) {
      const row = $("replicas").insertRow();
      row.dataset.replica = r.id;
      const cells = [];
      for (let i = 0; i < 10; i++) cells.push(row.insertCell());
      cells[0].textContent = r.id;
      cells[3].className = cells[4].className = "num";
      entry = replicaRows[r.id] = { row, cells, serving: spark(cells[5], "#1f9d55", true), version: spark(cells[6], "#1c2430", true),
        inFlight: spark(cells[7], "#4c7bd9"), tokens: spark(cells[8], "#2aa3b8"), cache: spark(cells[9], "#8a55d6") };
    }
    const [label, tone] = health(r);
    const pill = document.createElement("span");
    pill.className = "pill " + tone;
    pill.textContent = label;
    entry.cells[1].replaceChildren(pill);
    const columns = series[r.id] || { t: [], in_flight: [], tokens: [], open: [], cache_hit_rate: [], serving: [], version: [] };
    const open = columns.open.length && columns.open[columns.open.length - 1];
    entry.cells[2].textContent = open ? "open" : "closed";
    entry.cells[3].textContent = r.version === null ? "?" : r.version;
    entry.cells[4].textContent = r.in_flight;
    // Serving: healthy, not stale, not draining, circuit closed (1) or not (0), as every process saw it.
    entry.serving.setData([columns.t, columns.serving]);
    entry.version.setData([columns.t, columns.version]);
    entry.inFlight.setData([columns.t, columns.in_flight]);
    entry.tokens.setData([columns.t, columns.tokens]);
    // Read every 5 s: the seconds between readings are gaps, bridged.
    const cacheT = [], cacheRate = [];
    columns.cache_hit_rate.forEach((rate, i) => { if (rate !== null) { cacheT.push(columns.t[i]); cacheRate.push(100 * rate); } });
    entry.cache.setData([cacheT, cacheRate]);
    entry.cells[9].title = cacheRate.length ? cacheRate[cacheRate.length - 1].toFixed(0) + "% of prompt tokens" : "not read yet";
    entry.row.dataset.points = String(columns.t.length);
  }
  for (const id of Object.keys(replicaRows)) {
    if (!seen.has(id)) { replicaRows[id].row.remove(); delete replicaRows[id]; }
  }
}

// -- sessions: the busiest, and one session's detail (from GET v1/sessions/{id}, behind the agents' auth) ----------

function renderTopSessions(top) {
  const body = document.createElement("tbody");
  body.id = "top_sessions";
  for (const entry of top) {
    const row = body.insertRow();
    row.dataset.session = entry.session_id;
    const link = document.createElement("a");
    link.href = "#" + fragment({ session: entry.session_id });
    link.textContent = entry.session_id;
    row.insertCell().appendChild(link);
    row.insertCell().textContent = entry.turns;
  }
  $("top_sessions").replaceWith(body);
}

const VERSION_COLORS = ["#4c7bd9", "#d08700", "#1f9d55", "#8a55d6", "#d64545", "#2aa3b8", "#6b7583"];

// One pixel column per token or more: each segment (model tokens of one weight version) in its version's color,
// the tokens between segments (tool results, user turns: loss mask 0) left light grey.
function strip(sample) {
  const canvas = document.createElement("canvas");
  canvas.className = "strip";
  canvas.width = 800;
  canvas.height = 18;
  const ctx = canvas.getContext("2d");
  const total = Math.max(1, sample.response_tokens);
  ctx.fillStyle = "#e3e6ea";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  for (const seg of sample.segments) {
    ctx.fillStyle = VERSION_COLORS[seg.version % VERSION_COLORS.length];
    const x0 = (seg.start / total) * canvas.width;
    ctx.fillRect(x0, 0, Math.max(1, ((seg.end - seg.start) / total) * canvas.width), canvas.height);
  }
  canvas.dataset.segments = String(sample.segments.length);
  return canvas;
}

async function showSession() {
  const id = hashParams().get("session");
  $("session").hidden = !id;
  if (!id) return;
  $("session_id").textContent = id;
  const response = await fetch("v1/sessions/" + encodeURIComponent(id), { cache: "no-store" });
  if (!response.ok) {
    $("session_meta").textContent = "cannot read it: HTTP " + response.status + (response.status === 401 ? " (needs an API key)" : "");
    return;
  }
  const s = await response.json();
  $("session_meta").textContent = "status " + s.status + " \u00b7 reward " + (s.reward === null ? "\u2013" : s.reward) +
    " \u00b7 samples " + s.sample_count + " \u00b7 metadata " + JSON.stringify(s.metadata);
  const box = document.createElement("div");
  box.id = "session_samples";
  for (const sample of s.samples) {
    const item = document.createElement("div");
    item.className = "sample";
    item.dataset.sample = sample.index;
    const versions = sample.segments.map((seg) => seg.version);
    const resumes = sample.segments.length - 1;
    item.textContent = "sample " + sample.index + ": " + sample.response_tokens + " tokens, " + sample.num_turns +
      " turns, versions " + sample.min_version + "\u2013" + sample.max_version + ", " + sample.num_resumes +
      " resumes (" + Math.max(0, resumes) + " segment breaks: " + versions.join(" \u2192 ") + ")";
    item.appendChild(strip(sample));
    box.appendChild(item);
  }
  $("session_samples").replaceWith(box);
}
window.addEventListener("hashchange", () => showSession().catch(reportError));
showSession().catch(reportError);

// -- the page -----------------------------------------------------------------------------------------------------

function render(s) {
  const d = s.series;
  show("version", s.version);
  show("state", s.state);
  show("serving", s.serving_replicas + " / " + s.replicas.length);
  show("in_flight", s.in_flight);
  show("queue_depth", s.queue_depth);
  show("resumes", s.resumes_total);
  show("affinity", (100 * s.affinity_ratio).toFixed(1) + "%");
  show("open_sessions", d.active_sessions.length ? d.active_sessions[d.active_sessions.length - 1] : null);

  chart("chart-throughput", {
    series: lineSeries(["turns/s", "tokens/s", "trajectories delivered/s", "consumed by trainers/s"])
      .map((x, i) => (i === 2 ? { ...x, scale: "tok" } : x)),
    axes: [{}, {}, { scale: "tok", side: 1, grid: { show: false } }],
  }, [d.t, d.turns, d.tokens, d.delivered, d.consumed]);
  chart("chart-latency", { series: lineSeries(["turn p50", "turn p99", "TTFT p50", "TTFT p99"]) },
    [d.t, d.latency_p50, d.latency_p99, d.ttft_p50, d.ttft_p99]);

  timeline = s.timeline;
  chart("chart-versions", {
    height: 180,
    series: [{}, { label: "version", stroke: "#1c2430", width: 2, paths: uPlot.paths.stepped({ align: 1 }) },
      { label: "resumes", stroke: "#d64545", fill: "rgba(214,69,69,.5)", scale: "n", paths: uPlot.paths.bars({ size: [1, 6] }) }],
    axes: [{}, { label: "version" }, { scale: "n", side: 1, grid: { show: false } }],
    hooks: { drawClear: [drawBands] },
  }, [d.t, d.version, d.preemptions]);
  $("chart-versions").dataset.updates = String(s.timeline.length);
  renderUpdates(s.timeline);

  chart("chart-backlog", { series: lineSeries(["pending", "unacked", "reclaimed (total)"]) },
    [d.t, d.pending, d.unacked, d.reclaimed_total]);
  const reward = s.reward;
  chart("chart-reward", {
    scales: { x: { time: false, range: (u, lo, hi) => (hi === null ? [0, 1] : [Math.min(lo, hi - 1) - 0.5, hi + 0.5]) } },
    series: [{ label: "version" }, { label: "mean reward", stroke: "#8a55d6", width: 2, points: { show: true, size: 6 } }],
  }, [reward.map((r) => r.version), reward.map((r) => r.mean)]);
  // Every bucket from 0 to 8 (the last holds 8 and more), so the bars keep their places as counts come in.
  const behind = [0, 1, 2, 3, 4, 5, 6, 7, 8];
  chart("chart-staleness", {
    scales: { x: { time: false, range: [-0.5, 8.5] } },
    series: [{ label: "versions behind" }, { label: "samples", stroke: "#2aa3b8", fill: "rgba(42,163,184,.5)",
      paths: uPlot.paths.bars({ size: [0.6, 60] }) }],
  }, [behind, behind.map((k) => s.staleness[k] ?? null)]);
  const byVersion = s.staleness_by_version;
  chart("chart-staleness-version", {
    scales: { x: { time: false, range: (u, lo, hi) => (hi === null ? [0, 1] : [Math.min(lo, hi - 1) - 0.5, hi + 0.5]) } },
    series: [{ label: "version" }, { label: "mean versions behind", stroke: "#2aa3b8", width: 2, points: { show: true, size: 6 } }],
  }, [byVersion.map((r) => r.version), byVersion.map((r) => r.mean_behind)]);
  chart("chart-budget", { series: lineSeries(["admitted/s", "held/s", "refused/s", "cut for staleness/s"]) },
    [d.t, d.budget_admitted, d.budget_held, d.budget_refused, d.budget_cut]);
  chart("chart-sessions", {
    series: lineSeries(["open", "finished/s", "abandoned (total)"]).map((x, i) => (i === 2 ? { ...x, scale: "n" } : x)),
    axes: [{}, {}, { scale: "n", side: 1, grid: { show: false } }],
  }, [d.t, d.active_sessions, d.delivered, d.abandoned_total]);
  renderReplicas(s.replicas, s.replica_series);
  renderTopSessions(s.top_sessions);
}

// The page keeps the series it has and asks only for the newest seconds (from 2 s before its last one: another
// process's point of a recent second may have arrived since), replacing those it had.
const WINDOW_S = 900;
let series = null;
const replicaSeries = {};

function splice(local, incoming) {
  if (!local) return incoming;
  const newest = incoming.t.length ? incoming.t[incoming.t.length - 1] : local.t[local.t.length - 1];
  let keep = local.t.findIndex((t) => t >= incoming.t[0]);
  if (keep < 0) keep = local.t.length;
  let drop = 0;
  while (drop < keep && local.t[drop] <= newest - WINDOW_S) drop++;
  const out = {};
  for (const name of Object.keys(incoming)) out[name] = (local[name] || []).slice(drop, keep).concat(incoming[name]);
  return out;
}

function absorb(s) {
  series = splice(series, s.series);
  for (const [id, columns] of Object.entries(s.replica_series)) replicaSeries[id] = splice(replicaSeries[id], columns);
  s.series = series;
  s.replica_series = replicaSeries;
  return s;
}

// The page's fragment carries what no server should see: the metrics token (#token=...), if the gateway needs one,
// and the session shown (#session=...); both together as URL parameters (#token=...&session=...).
function hashParams() {
  return new URLSearchParams(location.hash.slice(1));
}

function fragment(changes) {
  const params = hashParams();
  for (const [name, value] of Object.entries(changes)) params.set(name, value);
  return params.toString();
}

function stateHeaders() {
  const token = hashParams().get("token");
  return token ? { authorization: "Bearer " + token } : {};
}

async function poll() {
  try {
    const last = series && series.t.length ? series.t[series.t.length - 1] : null;
    const url = last === null ? "dashboard/state" : "dashboard/state?since=" + (last - 2);
    const response = await fetch(url, { cache: "no-store", headers: stateHeaders() });
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(absorb(await response.json()));
    $("status").className = "";
    $("status").textContent = "live \u00b7 updated " + new Date().toLocaleTimeString();
  } catch (err) {
    $("status").className = "error";
    $("status").textContent = "disconnected: " + err.message;
    if (!(err instanceof TypeError) && !String(err.message).startsWith("HTTP")) reportError(err.stack || err);
  } finally {
    setTimeout(poll, 1000);
  }
}
poll();
