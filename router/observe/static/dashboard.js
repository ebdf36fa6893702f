// kvroute's dashboard: polls the router's /dashboard/api/* endpoints (same origin, nothing else)
// and renders them. Every value from the router goes into the page as text, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const KEY_STORE = "kvroute-api-key";
const REASONS = ["load_tradeoff", "stale_index", "cold"];
const COLORS = { load_tradeoff: "var(--load)", stale_index: "var(--stale)", cold: "var(--cold)" };
const $ = (id) => document.getElementById(id);

function pct(x) {
  return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
}

function num(x, digits = 0) {
  return x === null || x === undefined ? "–" : Number(x).toLocaleString("en", { maximumFractionDigits: digits });
}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

class NeedsKey extends Error {}

async function api(name) {
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers.Authorization = "Bearer " + key;
  const response = await fetch("/dashboard/api/" + name, { headers, cache: "no-store" });
  if (response.status === 401) throw new NeedsKey();
  if (!response.ok) throw new Error(name + ": HTTP " + response.status);
  return response.json();
}

function renderFleet(fleet) {
  $("replica").textContent = "replica " + fleet.replica + " · policy " + fleet.policy;
  const mode = $("mode");
  const degraded = fleet.degraded || !fleet.redis;
  mode.textContent = fleet.degraded ? "degraded: routing without the index" : fleet.redis ? "index ok" : "Redis unreachable";
  mode.className = "badge " + (degraded ? "degraded" : "ok");
  $("decisions-per-s").textContent = num(fleet.decisions_per_s, 1);
  $("degraded-count").textContent = "last minute; degraded decisions: " + num(fleet.degraded_decisions_last_minute);
  const box = $("workers");
  box.replaceChildren();
  if (!fleet.models.length) box.append(el("p", "No alive worker.", "muted"));
  for (const model of fleet.models) {
    const scope = model.inflight_scope === "fleet" ? "all replicas" : "this replica only (Redis slow)";
    const title = "model " + model.model + (model.retained ? " (retained: Redis lists none)" : "");
    box.append(el("h3", title + " · in flight: " + scope, "muted"));
    const table = el("table");
    const head = el("tr");
    for (const name of ["worker", "role", "KV usage", "running", "queued", "in flight", "uncached in flight", "indexed blocks"]) {
      head.append(el("th", name));
    }
    table.append(head);
    for (const w of model.workers) {
      const row = el("tr");
      row.append(el("td", w.id, "worker"), el("td", w.role || "both", "role"));
      const usage = el("td");
      const bar = el("span", undefined, "bar" + (w.kv_usage >= 0.9 ? " high" : ""));
      const fill = el("span");
      fill.style.width = Math.round(100 * (w.kv_usage || 0)) + "%";
      bar.append(fill);
      usage.append(bar, document.createTextNode(pct(w.kv_usage)));
      row.append(usage);
      row.append(el("td", num(w.running), "num"), el("td", num(w.waiting), "num"));
      row.append(el("td", num(w.inflight_requests), "num"), el("td", num(w.inflight_uncached_tokens), "num"));
      const capacity = w.capacity_blocks ? " / " + num(w.capacity_blocks) : "";
      row.append(el("td", num(w.indexed_blocks) + capacity, "num"));
      table.append(row);
    }
    box.append(table);
  }
}

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function renderChart(series) {
  const chart = $("chart");
  chart.replaceChildren();
  const width = 900, height = 220, pad = 6, left = 38;  // left: room for the y axis's labels
  const step = (width - left - pad) / Math.max(series.length, 1);
  const y = (share) => height - pad - share * (height - 2 * pad);
  for (const frac of [0, 0.25, 0.5, 0.75, 1]) {
    chart.append(svg("line", { x1: left, x2: width, y1: y(frac), y2: y(frac), stroke: "#eee" }));
    const label = svg("text", { x: left - 4, y: y(frac) + 4, "text-anchor": "end", "font-size": 11, fill: "#889", class: "y-label" });
    label.textContent = Math.round(frac * 100) + "%";
    chart.append(label);
  }
  series.forEach((bucket, i) => {
    let base = 0;
    for (const reason of REASONS) {
      const share = bucket.lost_share[reason] || 0;
      if (share > 0) {
        const top = y(base + share);
        chart.append(svg("rect", { x: left + i * step + 1, y: top, width: Math.max(step - 2, 1), height: y(base) - top, fill: COLORS[reason] }));
      }
      base += share;
    }
  });
  // The engines' hit rate is drawn wide and solid, the prediction thin, dashed and hollow on top:
  // where they are equal (the index is exact) both stay visible, the hit rate around the prediction.
  const lines = [
    ["hit_rate", "var(--hit)", "", 4, 4.5, true],
    ["predicted_hit_rate", "var(--pred)", "5 3", 1.5, 2.5, false],
    ["regret_share", "var(--regret)", "2 2", 1.5, 2.5, true],
  ];
  for (const [field, color, dash, widthPx, radius, filled] of lines) {
    const points = series
      .map((bucket, i) => (bucket[field] === null ? null : (left + (i + 0.5) * step).toFixed(1) + "," + y(bucket[field]).toFixed(1)))
      .filter((p) => p !== null);
    if (points.length) {
      chart.append(svg("polyline", { points: points.join(" "), fill: "none", stroke: color, "stroke-width": widthPx, "stroke-dasharray": dash, class: "line-" + field }));
    }
    for (const point of points) {  // a bucket alone draws no line: its point shows
      const [cx, cy] = point.split(",");
      chart.append(svg("circle", { cx, cy, r: radius, fill: filled ? color : "#fff", stroke: color, "stroke-width": 1.5 }));
    }
  }
  const minutes = series.length ? Math.round(series[0].started_s_ago / 60) : 0;
  for (const [x, anchor, text] of [[left + 2, "start", "-" + minutes + " min"], [width - pad, "end", "now"]]) {
    const label = svg("text", { x, y: 14, "text-anchor": anchor, "font-size": 11, fill: "#889" });
    label.textContent = text;
    chart.append(label);
  }
}

function renderAccounting(acc) {
  const total = acc.total;
  for (const node of document.querySelectorAll(".window")) node.textContent = Math.round(acc.window_s / 60) + " min";
  $("hit-rate").textContent = pct(total.hit_rate);
  $("predicted-hit-rate").textContent = pct(total.predicted_hit_rate);
  $("regret").textContent = pct(total.regret_share);
  for (const reason of REASONS) $("lost-" + reason).textContent = pct(total.lost_share[reason]);
  $("tokens").textContent =
    " · window: " + num(total.accounted) + " requests, " + num(total.cacheable) + " cacheable tokens, predicted " +
    num(total.reported_predicted) + " vs reported " + num(total.reported_cached) + " cached tokens";
  renderChart(acc.series);
  renderRoles(acc.by_role);
}

// Shown for a prefill/decode fleet only: an aggregated fleet's requests are all charged to "both".
function renderRoles(byRole) {
  const roles = Object.keys(byRole);
  $("by-role").hidden = roles.length === 0 || (roles.length === 1 && roles[0] === "both");
  const body = $("by-role").querySelector("tbody");
  body.replaceChildren();
  for (const role of roles) {
    const r = byRole[role];
    const row = el("tr");
    row.dataset.role = role;
    row.append(el("td", role), el("td", num(r.accounted), "num"), el("td", pct(r.hit_rate), "num hit"));
    row.append(el("td", pct(r.predicted_hit_rate), "num"));
    for (const reason of REASONS) row.append(el("td", pct(r.lost_share[reason]), "num"));
    body.append(row);
  }
}

function renderPrefixes(data) {
  const body = $("prefixes").querySelector("tbody");
  body.replaceChildren();
  if (!data.prefixes.length) {
    const row = el("tr");
    const cell = el("td", "No prefix hit yet.", "muted");
    cell.colSpan = 6;
    row.append(cell);
    body.append(row);
  }
  for (const p of data.prefixes) {
    const row = el("tr");
    row.append(el("td", p.model), el("td", p.hash), el("td", num(p.tokens), "num"), el("td", num(p.holders), "num"));
    row.append(el("td", num(p.hits), "num"), el("td", num(p.last_seen_s_ago, 1) + " s ago", "num"));
    body.append(row);
  }
}

async function refresh() {
  try {
    const [fleet, acc, prefixes] = await Promise.all([api("fleet"), api("accounting"), api("prefixes")]);
    renderFleet(fleet);
    renderAccounting(acc);
    renderPrefixes(prefixes);
    $("error").hidden = true;
    $("key-form").hidden = true;
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.rendered = "yes";
  } catch (error) {
    if (error instanceof NeedsKey) {
      $("key-form").hidden = false;
      return;
    }
    $("error").textContent = "The router did not answer: " + error.message;
    $("error").hidden = false;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("key").value.trim());
  $("key-form").hidden = true;
});

refresh();
