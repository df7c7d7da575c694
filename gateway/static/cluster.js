// Heron's live cluster page: fills the tables of cluster.html from the JSON snapshots the
// gateway pushes on /ws/cluster-status (about one a second; format in docs/gateway.md).
// Every value is written with textContent: worker ids and model names come from the
// cluster, and must never become markup.
"use strict";

const RECONNECT_MAX_MS = 5000;
const STALE_AFTER_MS = 5000; // no snapshot for this long: say so instead of showing old data
const SPARK_POINTS = 60; // one a second: the pools' "last minute" sparkline

const throughputHistory = new Map(); // pool name -> recent items/s, oldest first
let lastSnapshotAt = 0;
let socketOpen = false;
let reconnectMs = 500;

function feedUrl() {
  // Relative to the page, so a gateway behind a path prefix works too.
  const url = new URL("ws/cluster-status", window.location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  return url.href;
}

function setBadge(id, text, kind) {
  const el = document.getElementById(id);
  el.textContent = text;
  el.className = "badge badge-" + kind;
}

function formatBytes(bytes) {
  if (!bytes) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return value.toFixed(unit >= 2 ? 1 : 0) + " " + units[unit];
}

function formatRate(perSecond) {
  if (!perSecond) return "0";
  return perSecond >= 100 ? perSecond.toFixed(0) : perSecond.toFixed(1);
}

function shortHash(hash) {
  return hash ? hash.slice(0, 12) : "-";
}

function chip(text, kind, title) {
  const span = document.createElement("span");
  span.className = "chip chip-" + kind;
  span.textContent = text;
  if (title) span.title = title;
  return span;
}

function sparkline(values) {
  const ns = "http://www.w3.org/2000/svg";
  const width = 120;
  const height = 24;
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("width", String(width));
  svg.setAttribute("height", String(height));
  svg.setAttribute("class", "spark");
  const peak = Math.max(1, ...values);
  const step = width / (SPARK_POINTS - 1);
  const offset = SPARK_POINTS - values.length;
  const points = values.map((v, i) =>
    `${((offset + i) * step).toFixed(1)},${(height - 1 - (v / peak) * (height - 2)).toFixed(1)}`);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.join(" "));
  svg.appendChild(line);
  return svg;
}

// Update a table body in place, one row per item keyed by keyOf(item): rows keep their
// identity from one snapshot to the next (no flicker, selections survive).
// cellsOf(item) -> [{text, cls, title, node}]; rowClass(item) -> the row's class.
function renderRows(tbody, items, keyOf, cellsOf, rowClass) {
  const existing = new Map();
  for (const row of tbody.rows) existing.set(row.dataset.key, row);
  const wanted = new Set();
  for (const item of items) {
    const key = keyOf(item);
    wanted.add(key);
    let row = existing.get(key);
    const cells = cellsOf(item);
    if (!row) {
      row = document.createElement("tr");
      row.dataset.key = key;
      for (let i = 0; i < cells.length; i += 1) row.appendChild(document.createElement("td"));
    }
    row.className = rowClass ? rowClass(item) : "";
    cells.forEach((cell, i) => {
      const td = row.cells[i];
      td.className = cell.cls || "";
      td.title = cell.title || "";
      if (cell.node) {
        td.replaceChildren(cell.node);
      } else if (td.textContent !== String(cell.text)) {
        td.textContent = String(cell.text);
      }
    });
    tbody.appendChild(row); // (re)placed in snapshot order
  }
  for (const [key, row] of existing) {
    if (!wanted.has(key)) row.remove();
  }
}

function modelChips(worker) {
  const box = document.createElement("span");
  const ids = Object.keys(worker.models).sort();
  for (const id of ids) {
    const state = worker.models[id];
    const memory = worker.model_memory[id];
    const rate = worker.model_throughput_items_per_s[id];
    let text = `${id} ${state}`;
    if (memory) text += ` · ${formatBytes(memory)}`;
    if (rate) text += ` · ${formatRate(rate)}/s`;
    box.appendChild(chip(text, state));
  }
  if (!ids.length) box.textContent = "-";
  return box;
}

const WORKER_STATE_TEXT = { ready: "ready", not_ready: "not ready", gone: "gone" };

function renderWorkers(workers) {
  renderRows(document.querySelector("#workers tbody"), workers, (w) => w.worker_id, (w) => [
    { text: w.worker_id, cls: "id" },
    { text: w.pool },
    { node: chip(WORKER_STATE_TEXT[w.state] || w.state, w.state) },
    { text: w.bundle || "-" },
    {
      text: shortHash(w.bundle_hash) + (w.bundle_hash_matches === false ? " ≠ gateway" : ""),
      cls: w.bundle_hash_matches === false ? "bad" : "",
      title: w.bundle_hash,
    },
    { node: modelChips(w) },
    { text: w.queue_depth, cls: "num" },
    { text: w.in_flight, cls: "num" },
    { text: formatBytes(w.memory_rss), cls: "num" },
    { text: formatRate(w.throughput_items_per_s), cls: "num" },
    { text: w.last_beat_s.toFixed(1) + " s", cls: "num" },
    { text: w.address || "-" },
  ], (w) => "worker worker-" + w.state);
  document.getElementById("no-workers").hidden = workers.length > 0;
}

function renderPools(pools) {
  for (const pool of pools) {
    const history = throughputHistory.get(pool.name) || [];
    history.push(pool.throughput_items_per_s);
    if (history.length > SPARK_POINTS) history.shift();
    throughputHistory.set(pool.name, history);
  }
  renderRows(document.querySelector("#pools tbody"), pools, (p) => p.name, (p) => [
    { text: p.name, cls: "id" },
    { text: p.kind },
    { text: p.bundle },
    { text: shortHash(p.bundle_hash), title: p.bundle_hash },
    { text: p.workers, cls: "num" },
    { text: p.healthy_workers, cls: "num " + (p.healthy_workers ? "good" : "bad") },
    { text: p.outstanding_items, cls: "num" },
    { text: p.pending_demand, cls: "num" + (p.pending_demand ? " warn" : "") },
    { text: formatRate(p.throughput_items_per_s), cls: "num" },
    { node: sparkline(throughputHistory.get(p.name)) },
  ]);
}

function renderModels(models) {
  renderRows(document.querySelector("#models tbody"), models, (m) => m.id, (m) => [
    { text: m.id, cls: "id" },
    { text: m.aliases.join(", ") || "-" },
    { text: m.adapter },
    { text: m.pool },
    { node: chip(m.state.replace("_", " "), m.state) },
    { text: m.ready_workers, cls: "num" },
    { text: formatRate(m.throughput_items_per_s), cls: "num" },
  ]);
}

function formatDuration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 60) return seconds.toFixed(0) + " s";
  if (seconds < 3600) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

// A bar filled to the job's percentage and its figure; the width is set through the DOM
// (CSSOM), which the page's Content-Security-Policy allows where a style attribute is not.
function progressBar(job) {
  const box = document.createElement("span");
  box.className = "progress";
  const bar = document.createElement("span");
  bar.className = "progress-bar progress-" + job.state;
  bar.style.width = (job.percent === null ? 0 : job.percent) + "%";
  const figure = document.createElement("span");
  figure.className = "progress-text";
  figure.textContent = job.percent === null ? "-" : job.percent.toFixed(1) + "%";
  box.append(bar);
  const cell = document.createElement("span");
  cell.className = "progress-cell";
  cell.append(box, figure);
  return cell;
}

function jobState(job) {
  const text = job.error_code ? `${job.state} · ${job.error_code}` : job.state;
  return chip(text, job.state);
}

function renderJobs(jobs, counts) {
  renderRows(document.querySelector("#jobs tbody"), jobs, (j) => j.id, (j) => [
    { text: j.id, cls: "id" },
    { text: j.model || "-" },
    { node: jobState(j) },
    { node: progressBar(j) },
    { text: `${j.rows_done} / ${j.rows_total === null ? "?" : j.rows_total}`, cls: "num" },
    { text: j.rows_failed, cls: "num" + (j.rows_failed ? " warn" : "") },
    { text: j.state === "running" ? formatRate(j.rows_per_s) : "-", cls: "num" },
    { text: j.state === "running" ? formatDuration(j.eta_s) : "-", cls: "num" },
    { text: j.owner || "-", cls: "id" },
    { text: j.output_uri || "-", cls: "uri", title: j.output_uri },
  ], (j) => "job job-" + j.state);
  document.getElementById("no-jobs").hidden = jobs.length > 0;
  const shown = Object.entries(counts || {}).filter(([, n]) => n > 0);
  document.getElementById("job-counts").textContent =
    shown.length ? "In all: " + shown.map(([state, n]) => `${n} ${state}`).join(", ") + "." : "";
}

function eventText(e) {
  if (e.event !== "exited") return e.event;
  return e.restart_in_s === null ? "exited" : `exited, restart in ${e.restart_in_s.toFixed(1)} s`;
}

function renderEvents(events) {
  renderRows(document.querySelector("#events tbody"), events,
    (e) => `${e.child} ${e.event} ${e.at} ${e.restarts}`, (e) => [
      { text: new Date(e.at * 1000).toLocaleTimeString() },
      { text: e.child, cls: "id" },
      { node: chip(eventText(e), e.event === "exited" ? "failed" : "ready") },
      { text: e.status === null ? "-" : e.status, cls: "num" },
      { text: e.restarts, cls: "num" },
      { text: e.cause ? e.cause.split("\n").pop() : "-", title: e.cause },
    ]);
  document.getElementById("no-events").hidden = events.length > 0;
}

function render(snapshot) {
  document.getElementById("gateway-id").textContent = snapshot.gateway_id;
  document.getElementById("window").textContent = String(snapshot.throughput_window_s);
  setBadge("nats", snapshot.nats_connected ? "connected" : "disconnected",
    snapshot.nats_connected ? "good" : "bad");
  document.getElementById("updated").textContent =
    new Date(snapshot.ts * 1000).toLocaleTimeString();
  renderPools(snapshot.pools);
  renderWorkers(snapshot.workers);
  renderModels(snapshot.models);
  renderJobs(snapshot.jobs || [], snapshot.job_counts); // absent from gateways before them
  renderEvents(snapshot.supervisor_events || []); // absent from gateways before it
}

function connect() {
  const socket = new WebSocket(feedUrl());
  socket.onopen = () => {
    socketOpen = true;
    reconnectMs = 500;
    setBadge("connection", "live", "good");
  };
  socket.onmessage = (event) => {
    let snapshot;
    try {
      snapshot = JSON.parse(event.data);
    } catch (err) {
      console.warn("cluster page: a message that is not JSON", err);
      return;
    }
    if (!snapshot || snapshot.type !== "cluster_status") return;
    lastSnapshotAt = Date.now();
    render(snapshot);
  };
  socket.onclose = () => {
    // The gateway restarted or the network dropped: keep trying, backing off to 5 s.
    socketOpen = false;
    setBadge("connection", "reconnecting", "bad");
    setTimeout(connect, reconnectMs);
    reconnectMs = Math.min(RECONNECT_MAX_MS, reconnectMs * 2);
  };
}

setInterval(() => {
  if (socketOpen && lastSnapshotAt && Date.now() - lastSnapshotAt > STALE_AFTER_MS) {
    setBadge("connection", "stale", "warn");
  }
}, 1000);

connect();
