// The mpsd status page: polls status.json (beside this file) and draws it. No framework, no build step:
// every element is made with the DOM API, so text from the daemon (model names, event messages) is never
// read as HTML.
"use strict";

const POLL_MS = 1000;        // while the page is visible
const HIDDEN_POLL_MS = 10000; // while it is in a background tab
const MAX_RETRY_MS = 5000;
const TOKEN_KEY = "mpsd-status-token"; // kept for this tab only (sessionStorage)

let retryMs = POLL_MS;
let timer = null;

// One poll at a time: the next is scheduled when the last has been answered.
function schedule(delayMs) {
  clearTimeout(timer);
  timer = setTimeout(poll, delayMs);
}

// ---- small helpers ----------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("data-")) node.setAttribute(key, String(value));
    else if (key === "title") node.title = value;
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === "") continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n >= 100 || i === 0 ? n.toFixed(0) : n.toFixed(1)} ${units[i]}`;
}

function duration(s) {
  if (s === null || s === undefined) return "";
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

function ms(value) {
  if (value === null || value === undefined) return "–";
  if (value < 1) return `${(value * 1000).toFixed(0)} µs`;
  if (value < 100) return `${value.toFixed(1)} ms`;
  if (value < 10000) return `${value.toFixed(0)} ms`;
  return `${(value / 1000).toFixed(1)} s`;
}

function rate(value) {
  if (value === null || value === undefined) return "–";
  if (value === 0) return "0";
  return value < 10 ? value.toFixed(2) : value.toFixed(0);
}

function stateClass(state) {
  return { READY: "ok", LOADING: "busy", UNLOADING: "busy" }[state] || "off";
}

// A horizontal bar: `parts` are [label, fraction, class] drawn side by side out of the whole width.
function bar(parts, caption) {
  const track = el("div", { class: "bar" });
  for (const [label, fraction, cls] of parts) {
    const segment = el("div", { class: `segment ${cls || ""}`, title: label });
    segment.style.width = `${Math.max(0, Math.min(1, fraction)) * 100}%`;
    track.append(segment);
  }
  return el("div", { class: "bar-box" }, track, caption ? el("div", { class: "bar-caption" }, caption) : null);
}

// Requests per second in each step of the window, as a line.
function sparkline(series, title) {
  const svgNs = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNs, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 60 16");
  svg.setAttribute("preserveAspectRatio", "none");
  const label = document.createElementNS(svgNs, "title");
  label.textContent = title;
  svg.append(label);
  if (series && series.length > 1) {
    const top = Math.max(...series) || 1;
    const points = series.map((v, i) => `${(i / (series.length - 1)) * 60},${15 - (v / top) * 14}`);
    const line = document.createElementNS(svgNs, "polyline");
    line.setAttribute("points", points.join(" "));
    svg.append(line);
  }
  return svg;
}

// ---- drawing ----------------------------------------------------------------------------------------

const SEGMENT_CLASSES = ["c0", "c1", "c2", "c3", "c4", "c5"];

function colourOf(name, names) {
  return SEGMENT_CLASSES[names.indexOf(name) % SEGMENT_CLASSES.length];
}

function drawServer(server) {
  document.getElementById("server-name").textContent = server.name;
  document.getElementById("server-version").textContent = `v${server.version}`;
  const ready = document.getElementById("server-ready");
  ready.textContent = server.ready ? "ready" : "not ready";
  ready.className = `badge ${server.ready ? "ok" : "off"}`;
  document.getElementById("server-uptime").textContent = `up ${duration(server.uptime_s)}`;
  document.title = `${server.name} status`;
}

function drawDevices(devices, names) {
  const box = document.getElementById("devices");
  box.replaceChildren(...devices.map((d) => {
    const budget = d.budget_bytes;
    const entries = Object.entries(d.models);
    const parts = budget ? entries.map(([name, n]) => [`${name}: ${bytes(n)}`, n / budget, colourOf(name, names)]) : [];
    const named = entries.reduce((sum, [, n]) => sum + n, 0);
    if (budget && d.resident_bytes > named) {
      parts.push([`loading: ${bytes(d.resident_bytes - named)}`, (d.resident_bytes - named) / budget, "loading"]);
    }
    const caption = budget
      ? `${bytes(d.resident_bytes)} of ${bytes(budget)} held (${((d.resident_bytes / budget) * 100).toFixed(0)}%)`
      : `${bytes(d.resident_bytes)} held; no budget until the device's size is known`;
    const legend = el("ul", { class: "legend" }, entries.map(([name, n]) =>
      el("li", {}, el("span", { class: `swatch ${colourOf(name, names)}` }), `${name} ${bytes(n)}`)));
    return el("div", { class: "device", "data-device": d.device },
      el("div", { class: "device-name" }, d.device), bar(parts, caption), legend);
  }));
}

function instancesCell(model) {
  if (!model.instances.length) return el("td", { class: "muted" }, "none running");
  const ready = model.instances.filter((i) => i.state === "ready").length;
  const restarts = model.instances.reduce((sum, i) => sum + i.restarts, 0);
  const devices = [...new Set(model.instances.map((i) => i.device).filter(Boolean))];
  const details = el("ul", { class: "workers" }, model.instances.map((i) => el("li", {
    title: [i.last_exit && `last exit: ${i.last_exit}`, i.last_error && `last error: ${i.last_error}`]
      .filter(Boolean).join("\n") || null,
  }, `v${i.version}#${i.instance} ${i.device || i.kind} ${i.state}`,
  i.pid ? ` pid ${i.pid}` : "", i.uptime_s !== null ? `, up ${duration(i.uptime_s)}` : "",
  i.restarts ? el("span", { class: "warn" }, `, ${i.restarts} restarts`) : "")));
  return el("td", {},
    el("div", {}, `${ready}/${model.instances.length} ready on ${devices.join(", ") || "?"}`,
      restarts ? el("span", { class: "warn" }, ` · ${restarts} restarts`) : ""),
    details);
}

function residencyCell(model) {
  const r = model.residency;
  const lines = [];
  if (r.resident) {
    lines.push(el("span", { class: "badge ok small" }, "loaded"));
    if (r.loaded_s !== null) lines.push(` for ${duration(r.loaded_s)}`);
    if (r.idle_s !== null) lines.push(el("div", { class: "idle" }, `idle for ${duration(r.idle_s)}`));
  } else {
    lines.push(el("span", { class: "badge off small" }, "not loaded"));
  }
  const policy = [`load ${r.load}`, `keep-alive ${r.keep_alive}`];
  if (r.pinned) policy.unshift("pinned");
  lines.push(el("div", { class: "muted" }, policy.join(" · ")));
  return el("td", { class: "residency" }, lines);
}

function footprintCell(model, budgets, names) {
  const devices = Object.entries(model.footprint);
  if (!devices.length) return el("td", { class: "muted" }, "–");
  const basis = model.footprint_basis ? ` (${model.footprint_basis})` : "";
  return el("td", {}, devices.map(([device, n]) => {
    const budget = budgets[device];
    const caption = budget ? `${device}: ${bytes(n)} of ${bytes(budget)}${basis}` : `${device}: ${bytes(n)}${basis}`;
    const cls = model.residency.resident ? colourOf(model.name, names) : "would-hold";
    return bar(budget ? [[caption, n / budget, cls]] : [], caption);
  }));
}

function drawModels(models, budgets, names, window) {
  const body = document.querySelector("#models tbody");
  document.getElementById("model-count").textContent = `(${models.length})`;
  let window_s = null;
  body.replaceChildren(...models.map((m) => {
    const req = m.requests || null;
    if (req) window_s = Math.max(window_s || 0, req.window_s);
    const state = el("td", {},
      el("span", { class: `badge ${stateClass(m.state)}` }, m.state.toLowerCase()),
      m.reason ? el("div", { class: "reason" }, m.reason) : null,
      m.pending ? el("div", { class: "muted" }, `${m.pending} in flight or queued`) : null);
    return el("tr", {
      "data-model": m.name,
      "data-state": m.state,
      "data-resident": String(m.residency.resident),
    },
    el("td", { class: "name" }, m.name,
      el("div", { class: "muted" }, m.versions.map((v) => v.version && `v${v.version}`).filter(Boolean).join(" "))),
    state,
    instancesCell(m),
    residencyCell(m),
    footprintCell(m, budgets, names),
    el("td", { class: "num" }, req ? rate(req.per_s) : "–",
      req && req.failures_per_s ? el("div", { class: "warn" }, `${rate(req.failures_per_s)} failed`) : null,
      req ? sparkline(req.series, `requests/s every ${req.step_s} s`) : null),
    el("td", { class: "num", "data-p50": req ? req.p50_ms : null }, ms(req && req.p50_ms)),
    el("td", { class: "num", "data-p99": req ? req.p99_ms : null }, ms(req && req.p99_ms)));
  }));
  // The span the figures cover, or the window's length before a whole second of it is kept.
  document.getElementById("window").textContent = duration(window_s >= 1 ? window_s : window);
}

function drawEvents(events) {
  const list = document.getElementById("events");
  list.replaceChildren(...events.slice().reverse().map((e) => {
    const time = new Date(e.time);
    const when = Number.isNaN(time.getTime()) ? e.time : time.toLocaleTimeString();
    const fields = Object.entries(e.fields)
      .filter(([key]) => !["logger", "event_kind"].includes(key))
      .map(([key, value]) => `${key}=${value}`).join(" ");
    return el("li", { class: `event level-${e.level}`, "data-seq": e.seq },
      el("time", { datetime: e.time }, when),
      el("span", { class: "kind" }, e.kind),
      e.model ? el("span", { class: "model" }, e.worker || e.model) : null,
      el("span", { class: "message" }, e.message),
      fields ? el("span", { class: "fields" }, fields) : null);
  }));
}

function draw(doc) {
  const names = doc.models.map((m) => m.name);
  const budgets = Object.fromEntries(doc.devices.map((d) => [d.device, d.budget_bytes]));
  drawServer(doc.server);
  drawDevices(doc.devices, names);
  drawModels(doc.models, budgets, names, doc.window_s);
  drawEvents(doc.events);
}

// ---- polling and the token ----------------------------------------------------------------------------

function connection(state, text) {
  const node = document.getElementById("connection");
  node.dataset.state = state;
  node.textContent = text;
}

function askForToken(message) {
  const form = document.getElementById("token-form");
  form.hidden = false;
  document.getElementById("token-error").textContent = message || "";
  document.getElementById("token").focus();
}

async function poll() {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  try {
    const response = await fetch("status.json", { headers, cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      const body = await response.json().catch(() => ({}));
      connection("refused", "needs a token");
      askForToken(token ? body.error : "");
      return; // until a token is given
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    draw(await response.json());
    connection("live", `updated ${new Date().toLocaleTimeString()}`);
    retryMs = POLL_MS;
  } catch (err) {
    connection("down", `not reachable (${err.message}); retrying`);
    retryMs = Math.min(retryMs * 2, MAX_RETRY_MS);
    schedule(retryMs);
    return;
  }
  schedule(document.hidden ? HIDDEN_POLL_MS : POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, document.getElementById("token").value.trim());
    document.getElementById("token-form").hidden = true;
    schedule(0);
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) schedule(0);
  });
  schedule(0);
});
