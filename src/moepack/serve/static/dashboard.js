// moepack serve's dashboard: polls metrics.json (the figures of /metrics, and the routing of
// the last tokens) once a second; tiles show the figures as they are, charts their last two
// minutes, the heat map how often each layer chose each expert lately. Nothing is fetched
// from anywhere else.
"use strict";

const POLL_MS = 1000;
const KEEP = 120; // samples a chart holds
const M = {
  tps: (phase, w) => `moepack_tokens_per_second{phase="${phase}",window="${w}"}`,
  tokens: (phase) => `moepack_tokens_total{phase="${phase}"}`,
  seconds: (phase) => `moepack_compute_seconds_total{phase="${phase}"}`,
  read: (phase) => `moepack_read_bytes_total{phase="${phase}"}`,
  faults: (phase) => `moepack_major_faults_total{phase="${phase}"}`,
};

const TILES = [
  ["decode", M.tps("decode", "all"), "tok/s"],
  ["prefill", M.tps("prefill", "all"), "tok/s"],
  ["time to first token, last", 'moepack_time_to_first_token_seconds{window="last"}', "s"],
  ["time to first token, mean", 'moepack_time_to_first_token_seconds{window="all"}', "s"],
  ["expert hit rate", 'moepack_expert_hit_ratio{window="all"}', "%", 100],
  ["read per decode token", 'moepack_read_bytes_per_token{phase="decode",window="all"}', "MB", 1e-6],
  ["major faults per decode token", 'moepack_major_faults_per_token{phase="decode",window="all"}', ""],
  ["experts resident", "moepack_expert_bytes_resident", "MB", 1e-6],
  ["expert cache budget", "moepack_expert_cache_budget_bytes", "MB", 1e-6, "kernel's"],
  ["expert bytes", "moepack_expert_bytes", "MB", 1e-6],
  ["lookahead precision", 'moepack_lookahead_precision{window="all"}', "%", 100],
  ["lookahead recall", 'moepack_lookahead_recall{window="all"}', "%", 100],
  ["requests in flight", "moepack_requests_in_flight", ""],
  ["requests queued", "moepack_requests_queued", ""],
  ["generations", "moepack_generations_total", ""],
];

function rate(cur, prev, num, den) {
  if (!prev) return null;
  const dn = sum(cur, num) - sum(prev, num);
  const dd = sum(cur, den) - sum(prev, den);
  return dd > 0 ? dn / dd : null;
}
function sum(m, keys) { return keys.reduce((s, k) => s + (m[k] || 0), 0); }
function gauge(key, scale = 1) { return (cur) => (key in cur ? cur[key] * scale : null); }

const BOTH = ["prefill", "decode"];
const CHARTS = [
  ["tokens per second", "tok/s", [
    ["decode", (c, p) => rate(c, p, [M.tokens("decode")], [M.seconds("decode")])],
    ["prefill", (c, p) => rate(c, p, [M.tokens("prefill")], [M.seconds("prefill")])],
  ]],
  ["time to first token", "s", [
    ["last request", gauge('moepack_time_to_first_token_seconds{window="last"}')],
  ]],
  ["expert hit rate", "%", [
    ["last request", gauge('moepack_expert_hit_ratio{window="last"}', 100)],
  ]],
  ["MB read per token", "MB", [
    ["all passes", (c, p) => scaled(rate(c, p, BOTH.map(M.read), BOTH.map(M.tokens)), 1e-6)],
  ]],
  ["major faults per token", "", [
    ["all passes", (c, p) => rate(c, p, BOTH.map(M.faults), BOTH.map(M.tokens))],
  ]],
  ["expert residency", "MB", [
    ["resident", gauge("moepack_expert_bytes_resident", 1e-6)],
    ["budget (else all experts)", (c) => scaled(c.moepack_expert_cache_budget_bytes ?? c.moepack_expert_bytes, 1e-6)],
  ]],
  ["lookahead", "%", [
    ["precision", gauge('moepack_lookahead_precision{window="last"}', 100)],
    ["recall", gauge('moepack_lookahead_recall{window="last"}', 100)],
  ]],
  ["requests", "", [
    ["in flight", gauge("moepack_requests_in_flight")],
    ["queued", gauge("moepack_requests_queued")],
  ]],
];
function scaled(v, s) { return v === null || v === undefined ? null : v * s; }

function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (Number.isInteger(v) && a < 1e6) return String(v);
  if (a >= 100) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1);
  if (a >= 1) return v.toFixed(2);
  return v.toPrecision(2);
}

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
const SVG = "http://www.w3.org/2000/svg";
function sv(tag, attrs = {}) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

// -- tiles ------------------------------------------------------------------------------------
const tiles = TILES.map(([label, key, unit, scale = 1, absent = "–"]) => {
  const t = el("div", { class: "tile", "data-metric": key });
  const v = el("span", { class: "v" }, "–");
  const u = el("span", { class: "u" }, unit);
  t.append(el("div", {}), el("div", { class: "l" }, label));
  t.firstChild.append(v, u);
  document.getElementById("tiles").append(t);
  return { t, v, u, key, unit, scale, absent };
});
function showTiles(m) {
  for (const { t, v, u, key, unit, scale, absent } of tiles) {
    if (key in m) {
      t.dataset.value = String(m[key]);
      t.dataset.scale = String(scale);
      v.textContent = fmt(m[key] * scale);
      u.textContent = unit;
    } else {
      delete t.dataset.value;
      v.textContent = absent;
      u.textContent = "";
    }
  }
}

// -- charts -----------------------------------------------------------------------------------
const W = 300, H = 100;
const charts = CHARTS.map(([title, unit, series]) => {
  const box = el("div", { class: "chart", "data-chart": title });
  box.append(el("h2", {}, title + (unit ? ` (${unit})` : "")));
  const svg = sv("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  for (const y of [0, 0.5, 1]) svg.append(sv("line", { class: "grid", x1: 0, x2: W, y1: y * (H - 1) + 0.5, y2: y * (H - 1) + 0.5 }));
  const top = sv("text", { x: 2, y: 10 });
  svg.append(top);
  const paths = series.map((_, i) => { const p = sv("path", { class: `line s${i}` }); svg.append(p); return p; });
  const legend = el("div", { class: "legend" });
  const now = series.map(([name], i) => {
    const s = el("span"); const b = el("b", {}, "–");
    s.append(el("i", { class: `k${i}` }), document.createTextNode(name + " "), b);
    legend.append(s); return b;
  });
  box.append(svg, legend);
  document.getElementById("charts").append(box);
  return { box, series, paths, top, now, data: series.map(() => []) };
});
function pushCharts(cur, prev) {
  for (const c of charts) {
    c.series.forEach(([, f], i) => {
      const v = f(cur, prev);
      c.data[i].push(v === undefined ? null : v);
      if (c.data[i].length > KEEP) c.data[i].shift();
    });
    drawChart(c);
  }
}
function drawChart(c) {
  let max = 0, points = 0;
  for (const d of c.data) for (const v of d) if (v !== null) { max = Math.max(max, v); points++; }
  const top = max > 0 ? max * 1.1 : 1;
  c.top.textContent = fmt(top);
  c.data.forEach((d, i) => {
    let path = "", pen = false;
    d.forEach((v, j) => {
      if (v === null) { pen = false; return; }
      const x = (j + KEEP - d.length) * (W / (KEEP - 1));
      const y = H - 1 - (v / top) * (H - 12);
      path += `${pen ? "L" : "M"}${x.toFixed(1)} ${y.toFixed(1)} `;
      pen = true;
    });
    c.paths[i].setAttribute("d", path.trim());
    const last = [...d].reverse().find((v) => v !== null);
    c.now[i].textContent = fmt(last ?? null);
  });
  c.box.dataset.points = String(points);
}

// -- heat map ---------------------------------------------------------------------------------
const heat = document.getElementById("heat");
function drawHeat(r) {
  const note = document.getElementById("heat-note");
  if (!r) {
    note.textContent = "— routing is not captured: start serve with --watch-routing (or --trace-out)";
    heat.dataset.total = "0";
    return;
  }
  note.textContent = `— ${r.layers.length} layers × ${r.n_expert} experts, each layer's last ${r.window} tokens`;
  const css = getComputedStyle(document.documentElement);
  const c0 = rgb(css.getPropertyValue("--heat0")), c1 = rgb(css.getPropertyValue("--heat1"));
  const rows = r.counts.length, cols = r.n_expert;
  const cell = Math.max(1, Math.floor((heat.clientWidth || 600) / cols));
  const rh = Math.max(4, Math.min(14, Math.floor(360 / Math.max(rows, 1))));
  heat.width = cols * cell; heat.height = rows * rh;
  const g = heat.getContext("2d");
  let max = 0, total = 0;
  for (const row of r.counts) for (const v of row) { max = Math.max(max, v); total += v; }
  r.counts.forEach((row, y) => row.forEach((v, x) => {
    const t = max ? Math.sqrt(v / max) : 0;
    g.fillStyle = `rgb(${c0.map((a, i) => Math.round(a + (c1[i] - a) * t)).join(",")})`;
    g.fillRect(x * cell, y * rh, cell, rh);
  }));
  heat.dataset.total = String(total);
  heat.dataset.max = String(max);
  heat.dataset.layers = String(rows);
  document.getElementById("heat-max").textContent = max ? `faint to strong: 0 to ${max} choices` : "no routing yet";
}
function rgb(s) {
  s = s.trim();
  const h = s.startsWith("#") ? s.slice(1) : "808080";
  return [0, 2, 4].map((i) => parseInt(h.slice(i, i + 2), 16));
}

// -- theme, polling ---------------------------------------------------------------------------
const root = document.documentElement;
const saved = localStorage.getItem("moepack-theme");
root.dataset.theme = saved || (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light");
document.getElementById("theme").addEventListener("click", () => {
  root.dataset.theme = root.dataset.theme === "dark" ? "light" : "dark";
  localStorage.setItem("moepack-theme", root.dataset.theme);
  if (lastRouting !== undefined) drawHeat(lastRouting);
});

let prev = null, lastRouting;
async function poll() {
  const status = document.getElementById("status");
  try {
    const r = await fetch("metrics.json", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const d = await r.json();
    document.getElementById("alias").textContent = d.server.alias;
    document.getElementById("mode").textContent = d.server.prefetch ? `${d.server.prefetch} prefetch` : "llama.cpp's own reads";
    showTiles(d.metrics);
    pushCharts(d.metrics, prev);
    prev = d.metrics;
    lastRouting = d.routing;
    drawHeat(d.routing);
    status.textContent = `live · ${new Date(d.time * 1000).toLocaleTimeString()}`;
    status.classList.remove("bad");
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (e) {
    status.textContent = `no answer from the server (${e.message})`;
    status.classList.add("bad");
  }
  setTimeout(poll, POLL_MS);
}
poll();
