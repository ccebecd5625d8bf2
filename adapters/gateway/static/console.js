// The relayline console: one snapshot (console/state), then one server-sent event stream
// (console/events) that pushes a part only when it changed. Everything is drawn from the
// gateway's own data with DOM calls (textContent, never HTML from data).
"use strict";

const state = { routes: [], health: null, lifecycles: [], turns: [], cost: null, limits: [], filter: "all", window: "1h",
                limit: 200, drawn: {} };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v; else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const svgNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs, text) {
  const node = document.createElementNS(svgNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

const seconds = (s) => (s > 0 ? (s >= 90 ? `${Math.floor(s / 60)}m ${Math.round(s % 60)}s` : `${s.toFixed(1)} s`) : "–");
const ms = (v) => (v === null || v === undefined ? "–" : v >= 1000 ? `${(v / 1000).toFixed(2)} s` : `${Math.round(v)} ms`);
const pct = (v) => (v === null || v === undefined ? "–" : `${(v * 100).toFixed(1)}%`);
const usd = (v) => `$${v < 0.01 && v > 0 ? v.toPrecision(3) : v.toFixed(4)}`;

// -- health -------------------------------------------------------------------------------------

function drawHealth() {
  const h = state.health;
  if (!h) return;
  document.getElementById("health-window").textContent =
    `success and latency over the breaker window (${h.window_s} s); health store: ` +
    (h.store.shared ? `shared at ${h.store.where}, ${h.store.state}` : h.store.state);
  const body = document.querySelector("#health tbody");
  body.replaceChildren(...h.profiles.map((p) => el("tr", { "data-profile": p.profile, "data-breaker": p.breaker },
    el("td", {}, el("code", {}, p.profile)),
    el("td", { class: "breaker" }, el("span", { class: `badge ${p.breaker}` }, p.breaker)),
    el("td", { class: "breaker-left" }, seconds(p.breaker_left_s)),
    el("td", {}, `${p.failures}/${p.threshold}`),
    el("td", { class: "cooldown" }, p.cooldown_left_s > 0 ? el("span", { class: "badge cooldown" }, seconds(p.cooldown_left_s)) : "–"),
    el("td", { class: "success" }, pct(p.success_rate)),
    el("td", {}, ms(p.latency_p50_ms)),
    el("td", {}, ms(p.latency_p95_ms)),
    el("td", {}, p.attempts),
    el("td", {}, p.key_pool > 1 ? `key #${p.key_cursor} of ${p.key_pool}` : p.key_pool === 1 ? "single key" : "no key"),
  )));
  if (!h.profiles.length) body.replaceChildren(el("tr", {}, el("td", { colspan: 10, class: "empty" }, "no profiles")));
}

// -- routes -------------------------------------------------------------------------------------

function drawRoutes() {
  const root = document.getElementById("routes");
  root.replaceChildren(...state.routes.map((r) => el("div", { class: "route", "data-route": `${r.kind}:${r.name}` },
    el("h3", {}, r.kind === "default" ? "default domain " : `${r.kind} `, el("code", {}, r.kind === "default" ? r.domain : r.name),
      el("small", {}, `  requested ${r.requested}`)),
    r.allowlist ? el("div", { class: "muted" }, `allowlist: ${r.allowlist.join(", ") || "(none)"}`) : null,
    el("ol", {}, r.entries.map((e) => el("li", { class: e.skip ? "skipped" : "", "data-profile": e.profile, "data-skip": e.skip || "" },
      el("span", { class: "entry" }, el("code", {}, `${e.profile}/${e.model}`)),
      e.pinned ? el("span", { class: "pin" }, " pinned") : null,
      e.price.input_per_mtok || e.price.output_per_mtok
        ? el("span", { class: "pin" }, ` $${e.price.input_per_mtok}/$${e.price.output_per_mtok} per Mtok`) : null,
      e.skip ? [" ", el("span", { class: `badge ${e.skip}` }, `skipped: ${e.skip}`)] : null,
    ))),
    r.warnings.length ? el("div", { class: "muted" }, r.warnings.join("; ")) : null,
  )));
  if (!state.routes.length) root.replaceChildren(el("p", { class: "empty" }, "no routes"));
}

// -- turns --------------------------------------------------------------------------------------

function drawFilter() {
  const outcomes = ["all", "ok", "error", "interrupted", "cancelled", "fallback"];
  const root = document.getElementById("turn-filter");
  root.replaceChildren(...outcomes.map((o) => {
    const button = el("button", { type: "button", "data-outcome": o, "aria-pressed": String(state.filter === o) }, o);
    button.addEventListener("click", () => { state.filter = o; drawFilter(); drawTurns(); });
    return button;
  }));
}

function turnNode(t) {
  const total = Math.max(1, t.attempts.reduce((s, a) => s + (a.latency_ms || 0), 0));
  const segs = t.attempts.map((a) => el("div", {
    class: `seg ${a.outcome === "ok" ? "ok" : "fail"}`, style: `flex-grow: ${Math.max(0.04, (a.latency_ms || 0) / total)}`,
    title: `${a.profile}/${a.model} ${a.mode} ${a.outcome} ${ms(a.latency_ms)}` }));
  const skipped = t.skipped.map(([p, m, reason]) => el("div", { class: "seg skip", style: "flex-grow: 0.04", title: `${p}/${m} skipped: ${reason}` }));
  return el("div", { class: "turn", "data-outcome": t.outcome, "data-seq": t.seq },
    el("div", { class: "head" },
      el("span", { class: `badge ${t.outcome}` }, t.error ? `${t.outcome}: ${t.error}` : t.outcome),
      el("span", { class: "muted" }, new Date(t.at * 1000).toLocaleTimeString()),
      el("span", {}, "requested ", el("code", {}, t.requested)),
      el("span", {}, "served ", el("code", {}, t.served || "none")),
      t.fallback ? el("span", { class: "badge cooldown" }, "fallback") : null,
      el("span", { class: "muted" }, `${ms(t.latency_ms)} · ${usd(t.cost_usd)}`)),
    el("div", { class: "timeline" }, skipped, segs),
    el("ol", { class: "attempts" },
      t.skipped.map(([p, m, reason]) => el("li", { class: "skip" }, `${p}/${m} skipped: ${reason}`)),
      t.attempts.map((a) => el("li", { class: "attempt", "data-outcome": a.outcome },
        `${a.profile}/${a.model} · ${a.mode} · ${a.outcome}${a.reason && a.reason !== a.outcome ? ` (${a.reason})` : ""}` +
        ` · ${ms(a.latency_ms)}` + (a.billed ? ` · ${a.input_tokens} in / ${a.output_tokens} out · ${usd(a.cost_usd)}` : " · not billed") +
        (a.key !== null && a.key !== undefined ? ` · key #${a.key}` : "")))));
}

function drawTurns() {
  const shown = state.turns.filter((t) => state.filter === "all" || (state.filter === "fallback" ? t.fallback : t.outcome === state.filter));
  document.getElementById("turns-count").textContent = `${shown.length} of the last ${state.turns.length} (kept: ${state.limit})`;
  const root = document.getElementById("turns");
  root.replaceChildren(...shown.slice().reverse().map(turnNode));
  if (!shown.length) root.replaceChildren(el("p", { class: "empty" }, state.turns.length ? "no turn with this outcome" : "no turns since the gateway started"));
}

// -- cost ---------------------------------------------------------------------------------------

function drawCost() {
  const root = document.getElementById("cost");
  const windows = document.getElementById("cost-windows");
  const c = state.cost;
  if (!c || !c.ledger) {
    windows.replaceChildren();
    root.replaceChildren(el("p", { class: "empty", "data-cost": "no-ledger" }, "No ledger is configured for this gateway, so there is no cost to show."));
    return;
  }
  windows.replaceChildren(...Object.keys(c.windows).map((w) => {
    const button = el("button", { type: "button", "data-window": w, "aria-pressed": String(state.window === w) }, w);
    button.addEventListener("click", () => { state.window = w; drawCost(); });
    return button;
  }));
  const rows = c.windows[state.window] || [];
  if (!rows.length) {
    root.replaceChildren(el("p", { class: "empty", "data-cost": "empty" }, `No billable attempts in the last ${state.window}.`));
    return;
  }
  const total = (r) => r.accepted_cost_usd + r.rejected_cost_usd;
  const max = Math.max(...rows.map(total), 1e-12);
  const width = 640, left = 250, barH = 18, gap = 8, height = rows.length * (barH + gap) + 10;
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `cost by profile and model, last ${state.window}` });
  rows.forEach((r, i) => {
    const y = 5 + i * (barH + gap), span = width - left - 110;
    const a = (r.accepted_cost_usd / max) * span, j = (r.rejected_cost_usd / max) * span;
    chart.append(svg("text", { x: 0, y: y + 13, "font-size": 12 }, `${r.provider}/${r.model}`));
    chart.append(svg("rect", { x: left, y, width: Math.max(a, 0), height: barH, fill: "#1f8a4c" }));
    chart.append(svg("rect", { x: left + a, y, width: Math.max(j, 0), height: barH, fill: "#c0392b" }));
    chart.append(svg("text", { x: left + a + j + 6, y: y + 13, "font-size": 12 }, usd(total(r))));
  });
  const sum = (k) => rows.reduce((s, r) => s + r[k], 0);
  root.replaceChildren(
    el("div", { class: "legend" }, el("span", {}, el("i", { style: "background:#1f8a4c" }), "accepted"),
      el("span", {}, el("i", { style: "background:#c0392b" }), "rejected (failed, empty, interrupted, cancelled with usage)")),
    el("div", { class: "cost-chart" }, chart),
    el("table", { id: "cost-table", "data-window": state.window },
      el("thead", {}, el("tr", {}, ["profile / model", "accepted", "rejected", "accepted $", "rejected $", "tokens in", "tokens out"].map((h) => el("th", {}, h)))),
      el("tbody", {}, rows.map((r) => el("tr", { "data-profile": r.provider },
        el("td", {}, el("code", {}, `${r.provider}/${r.model}`)), el("td", {}, r.accepted), el("td", {}, r.rejected),
        el("td", {}, usd(r.accepted_cost_usd)), el("td", {}, usd(r.rejected_cost_usd)), el("td", {}, r.input_tokens), el("td", {}, r.output_tokens)))),
      el("tfoot", {}, el("tr", {}, el("th", {}, "total"), el("th", {}, sum("accepted")), el("th", {}, sum("rejected")),
        el("th", {}, usd(sum("accepted_cost_usd"))), el("th", {}, usd(sum("rejected_cost_usd"))), el("th", {}, sum("input_tokens")), el("th", {}, sum("output_tokens"))))));
}

// -- keys and limits ----------------------------------------------------------------------------

function drawLimits() {
  const root = document.getElementById("limits");
  const rows = state.limits || [];
  if (!rows.length) {
    root.replaceChildren(el("p", { class: "empty", "data-limits": "none" }, "No named key or team has a limit."));
    return;
  }
  const left = (v, of) => (of === null ? "–" : v === null ? `${of} (not used yet)` : `${v} of ${of}`);
  root.replaceChildren(el("table", { id: "limits-table" },
    el("thead", {}, el("tr", {}, ["scope", "name", "requests left / min", "tokens left / min", "spent", "budget", "state"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((r) => el("tr", { "data-scope": `${r.scope}:${r.name}`, "data-budget": r.budget_state },
      el("td", {}, r.scope), el("td", {}, el("code", {}, r.name)), el("td", {}, left(r.requests_left, r.rpm)),
      el("td", {}, left(r.tokens_left, r.tpm)), el("td", {}, r.spend_usd === null ? "–" : usd(r.spend_usd)),
      el("td", {}, r.budget_usd === null ? "–" : `${usd(r.budget_usd)} / ${r.budget_period}`), el("td", {}, r.budget_usd === null ? "–" : r.budget_state))))));
}

// -- lifecycles ---------------------------------------------------------------------------------

function drawLifecycleShells() {
  const root = document.getElementById("lifecycles");
  root.replaceChildren(...state.lifecycles.map((life) => el("div", { class: "lifecycle", id: `life-${life.name}`, "data-lifecycle": life.name },
    el("h3", {}, life.name, el("small", { class: "fired" }, "")),
    life.doc ? el("div", { class: "muted" }, life.doc) : null,
    el("div", { class: "diagram" }, el("p", { class: "empty" }, "drawing…")),
    el("details", {}, el("summary", {}, "transition counts"),
      el("table", {}, el("thead", {}, el("tr", {}, ["from", "trigger", "to", "fired"].map((h) => el("th", {}, h)))),
        el("tbody", {}, life.edges.map((e, i) => el("tr", { "data-edge": `${e.source}:${e.trigger}:${e.dest}`, "data-index": i },
          el("td", {}, e.source), el("td", {}, e.trigger + (e.guards.length ? ` [${e.guards.join(" & ")}]` : "")), el("td", {}, e.dest),
          el("td", { class: "count" }, e.count)))))))));
  state.lifecycles.forEach(drawCounts);
}

function drawCounts(life) {
  const node = document.getElementById(`life-${life.name}`);
  if (!node) return;
  const total = life.edges.reduce((s, e) => s + e.count, 0);
  node.querySelector(".fired").textContent = `  ${total} transitions fired`;
  node.setAttribute("data-fired", total);
  life.edges.forEach((e, i) => {
    const row = node.querySelector(`tr[data-index="${i}"]`);
    row.className = e.count ? "fired" : "idle";
    row.querySelector(".count").textContent = e.count;
  });
  relabel(life);
}

function edgeLabel(e) {
  return `${e.trigger}${e.guards.length ? ` [${e.guards.join(" & ")}]` : ""} ×${e.count}`;
}

function relabel(life) {
  // drawn once; afterwards only the labels change, in place (a redraw would block the page
  // for as long as the layout takes, and the health table must stay live)
  const node = document.querySelector(`#life-${life.name} .diagram`);
  const drawn = node && node.querySelector("svg");
  if (!drawn) return;
  life.edges.forEach((e, i) => {
    const label = drawn.querySelector(`[data-id="edge${i}"] p`) || drawn.querySelector(`[data-id="edge${i}"]`);
    if (!label) return;
    label.textContent = edgeLabel(e);
    label.classList.toggle("hot", e.count > 0);
  });
  node.setAttribute("data-drawn", life.edges.reduce((s, e) => s + e.count, 0));
}

let diagramSeq = 0;
async function drawDiagram(life) {
  const node = document.querySelector(`#life-${life.name} .diagram`);
  // the server's text carries the counts it had when the page loaded: draw with today's
  let i = 0;
  const text = life.mermaid.replace(/ ×\d+$/gm, () => ` ×${life.edges[i++].count}`);
  try {
    const { svg: drawn } = await window.mermaid.render(`diagram-${life.name}-${++diagramSeq}`, text);
    const doc = new DOMParser().parseFromString(drawn, "image/svg+xml");
    node.replaceChildren(document.importNode(doc.documentElement, true));
    relabel(life);
  } catch (err) {
    node.replaceChildren(el("pre", {}, text));
  }
}

function loadDiagrams() {
  // Mermaid is 3.5 MB of script: fetched and compiled after the data is on screen
  const script = document.createElement("script");
  script.src = document.body.dataset.mermaid;
  script.onload = async () => {
    window.mermaid.initialize({ startOnLoad: false, securityLevel: "strict", theme: "neutral" });
    for (const life of state.lifecycles) await drawDiagram(life);
    document.body.dataset.diagrams = "yes";
  };
  script.onerror = () => document.querySelectorAll(".diagram").forEach((n) => n.replaceChildren(el("p", { class: "empty" }, "the diagram renderer did not load")));
  document.head.append(script);
}

// -- live updates -------------------------------------------------------------------------------

function onCounts(counts) {
  for (const life of state.lifecycles) {
    const numbers = counts[life.name];
    if (!numbers || numbers.every((n, i) => life.edges[i].count === n)) continue;
    numbers.forEach((n, i) => { life.edges[i].count = n; });
    drawCounts(life);
  }
}

let events = null;
function connect() {
  const live = document.getElementById("live");
  events = new EventSource("console/events");
  events.onopen = () => { live.dataset.state = "live"; live.textContent = "live"; };
  events.onerror = () => { live.dataset.state = "lost"; live.textContent = "reconnecting"; };
  const on = (name, handler) => events.addEventListener(name, (ev) => {
    handler(JSON.parse(ev.data));
    live.title = `last update ${new Date().toLocaleTimeString()}`;
  });
  on("health", (h) => { state.health = h; drawHealth(); });
  on("routes", (r) => { state.routes = r; drawRoutes(); });
  on("counts", onCounts);
  on("cost", (c) => { state.cost = c; drawCost(); });
  on("limits", (l) => { state.limits = l; drawLimits(); });
  on("turn", (t) => {
    if (state.turns.some((x) => x.seq === t.seq)) return;
    state.turns.push(t);
    if (state.turns.length > state.limit) state.turns.splice(0, state.turns.length - state.limit);
    drawTurns();
  });
}

// a page kept in the back/forward cache must not hold a stream open on the gateway
window.addEventListener("pagehide", () => { if (events) events.close(); });
window.addEventListener("pageshow", (ev) => { if (ev.persisted) location.reload(); });

async function start() {
  const response = await fetch("console/state", { cache: "no-store" });
  if (!response.ok) {
    document.querySelector("main").replaceChildren(el("p", { class: "empty" }, `the console state did not load: HTTP ${response.status}`));
    return;
  }
  const snap = await response.json();
  Object.assign(state, { routes: snap.routes, health: snap.health, lifecycles: snap.lifecycles, turns: snap.turns,
                         cost: snap.cost, limits: snap.limits, limit: snap.recent_limit });
  drawHealth(); drawRoutes(); drawFilter(); drawTurns(); drawLimits(); drawCost(); drawLifecycleShells();
  document.body.dataset.ready = "yes";
  document.body.dataset.readyMs = Math.round(performance.now());
  connect();
  loadDiagrams();
}

start();
