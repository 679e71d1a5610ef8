// Parrot live view: polls /v1/session/{id}/graph and draws the DAG as SVG, columns by topological depth.
// Credentials come from the URL fragment (#session=ID&token=TOKEN, or #key=API_KEY), never sent as part of a URL.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const POLL_MS = 500, IDLE_POLL_MS = 2000;
const LINE_CHARS = 34;  // characters of 11px text that fit in a call box
const CALL_W = 220, CALL_H = 78, VAR_W = 150, VAR_H = 30, COL_GAP = 56, ROW_GAP = 14, PAD = 20;

// the server's path prefix behind a proxy (parrot serve --root-path): where this script was loaded from, less /ui/ui.js
const ROOT = new URL(document.currentScript.src).pathname.replace(/\/ui\/ui\.js$/, "");
const $ = (id) => document.getElementById(id);
const state = { session: null, token: null, key: null, lastText: null, graph: null, selected: null, timer: null,
  run: 0 };  // run: bumped when the fragment changes, so answers for an older view are dropped

function params() {
  const p = new URLSearchParams(location.hash.replace(/^#/, ""));
  return { session: p.get("session"), token: p.get("token"), key: p.get("key") };
}

function el(tag, attrs = {}, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function html(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function secs(x) {
  if (x === null || x === undefined) return "–";
  if (x < 1) return `${(x * 1000).toFixed(x < 0.01 ? 1 : 0)} ms`;
  return `${x.toFixed(2)} s`;
}

function clip(s, n) { return s && s.length > n ? s.slice(0, n - 1) + "…" : (s || ""); }

function wrap(s, n, lines) {
  // at most `lines` lines of at most `n` characters, broken at spaces; the last one clipped
  const out = [];
  let rest = (s || "").trim();
  while (rest && out.length < lines - 1) {
    let cut = rest.length <= n ? rest.length : rest.lastIndexOf(" ", n);
    if (cut <= 0) cut = n;
    out.push(rest.slice(0, cut));
    rest = rest.slice(cut).trim();
  }
  if (rest) out.push(clip(rest, n));
  return out;
}

function showError(msg) {
  const e = $("error");
  e.textContent = msg || "";
  e.hidden = !msg;
}

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = "status " + (cls || "");
}

function authHeaders() {
  // with the server's API key: the key as bearer (it opens every session), the session token beside it
  if (state.key) {
    return { Authorization: `Bearer ${state.key}`, ...(state.token ? { "X-Session-Token": state.token } : {}) };
  }
  return { Authorization: `Bearer ${state.token}` };
}

async function getJSON(path) {
  const r = await fetch(ROOT + path, { headers: authHeaders(), cache: "no-store" });
  const text = await r.text();
  let body = null;
  try { body = JSON.parse(text); } catch (_) { /* not JSON */ }
  return { status: r.status, text, body };
}

// ---- one session ---------------------------------------------------------------------------------
async function poll() {
  const run = state.run;
  let res;
  try {
    res = await getJSON(`/v1/session/${encodeURIComponent(state.session)}/graph`);
  } catch (e) {
    if (run !== state.run) return;
    setStatus("server unreachable", "ended");
    schedule(IDLE_POLL_MS);
    return;
  }
  if (run !== state.run) return;
  if (res.status === 404) {
    setStatus("session ended", "ended");
    showError(state.graph ? "" : (res.body && res.body.detail) || "no such session");
    return; // keep the last picture
  }
  if (res.status !== 200) {
    setStatus("no access", "ended");
    showError((res.body && res.body.detail) || `HTTP ${res.status}`);
    if (res.status === 401 && !state.key) {  // a server with an API key: ask for it, keep the session
      $("login").hidden = false;
      $("session-form").hidden = true;
    }
    return;
  }
  showError("");
  const g = res.body;
  const busy = g.counts.waiting + g.counts.running > 0;
  setStatus(busy ? "live" : "live · idle", "live");
  if (res.text !== state.lastText) {
    state.lastText = res.text;
    state.graph = g;
    render();
  }
  schedule(busy ? POLL_MS : IDLE_POLL_MS);
}

function schedule(ms) {
  clearTimeout(state.timer);
  state.timer = setTimeout(poll, ms);
}

function visibleGraph(g) {
  const showConst = $("show-constants").checked;
  const nodes = g.nodes.filter((n) => showConst || !n.constant);
  const ids = new Set(nodes.map((n) => n.id));
  const edges = g.edges.filter((e) => ids.has(e.from) && ids.has(e.to));
  return { nodes, edges };
}

function layout(nodes, edges) {
  // columns: the layers in use, in order; rows: barycenter of predecessors (then of successors for column 0)
  const layers = [...new Set(nodes.map((n) => n.layer))].sort((a, b) => a - b);
  const colOf = new Map(layers.map((l, i) => [l, i]));
  const cols = layers.map(() => []);
  for (const n of nodes) cols[colOf.get(n.layer)].push(n);
  const preds = new Map(), succs = new Map();
  for (const e of edges) {
    (preds.get(e.to) || preds.set(e.to, []).get(e.to)).push(e.from);
    (succs.get(e.from) || succs.set(e.from, []).get(e.from)).push(e.to);
  }
  const row = new Map();
  const bary = (n, rel, fallback) => {
    const rs = (rel.get(n.id) || []).filter((id) => row.has(id)).map((id) => row.get(id));
    return rs.length ? rs.reduce((a, b) => a + b, 0) / rs.length : fallback;
  };
  cols.forEach((col, c) => {
    if (c > 0) col.sort((a, b) => bary(a, preds, 1e9) - bary(b, preds, 1e9));
    col.forEach((n, i) => row.set(n.id, i));
  });
  if (cols.length > 1) {
    cols[0].sort((a, b) => bary(a, succs, 1e9) - bary(b, succs, 1e9));
    cols[0].forEach((n, i) => row.set(n.id, i));
  }
  const size = (n) => (n.kind === "call" ? [CALL_W, CALL_H] : [VAR_W, VAR_H]);
  const colW = cols.map((col) => Math.max(...col.map((n) => size(n)[0])));
  const colH = cols.map((col) => col.reduce((h, n) => h + size(n)[1] + ROW_GAP, -ROW_GAP));
  const height = Math.max(0, ...colH);
  const pos = new Map();
  let x = PAD;
  cols.forEach((col, c) => {
    let y = PAD + (height - colH[c]) / 2;
    for (const n of col) {
      const [w, h] = size(n);
      pos.set(n.id, { x: x + (colW[c] - w) / 2, y, w, h });
      y += h + ROW_GAP;
    }
    x += colW[c] + COL_GAP;
  });
  return { pos, width: x - COL_GAP + PAD, height: height + 2 * PAD };
}

function callLines(n) {
  const t = n.timings, k = n.tokens;
  const lines = [];
  lines.push([`${n.state}${n.detail && n.detail !== n.state ? " · " + n.detail : ""}`
    + (n.engine ? ` · ${n.engine}` : ""), "muted"]);
  if (n.state === "failed") {
    for (const l of wrap(n.error, LINE_CHARS, 3)) lines.push([l, "err"]);
  } else if (n.call_type === "native") {
    lines.push(["native transform, on the server", "muted"]);
  } else {
    lines.push([`queue ${secs(t.queue_s)} · ttft ${secs(t.ttft_s)}`, ""]);
    lines.push([`tpot ${secs(t.tpot_s)} · total ${secs(t.total_s)}`, ""]);
    if (k && k.prompt !== null) lines.push([`prompt ${k.prompt} tok: ${k.cached} cached`, "muted"]);
  }
  return lines;
}

function render() {
  const g = state.graph;
  if (!g) return;
  $("title").textContent = g.session_id;
  const c = g.counts;
  $("counts").textContent = `${c.calls} calls: ${c.done} done, ${c.running} running, ${c.waiting} waiting, `
    + `${c.failed} failed`;
  const { nodes, edges } = visibleGraph(g);
  const { pos, width, height } = layout(nodes, edges);
  const svg = $("graph");
  svg.replaceChildren();
  // fit the width of the view when that keeps text readable; scroll beyond
  const scale = Math.max(0.6, Math.min(1, ($("graph-wrap").clientWidth - 4) / width));
  svg.setAttribute("width", Math.round(width * scale));
  svg.setAttribute("height", Math.round(height * scale));
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const byId = new Map(nodes.map((n) => [n.id, n]));
  const gEdges = el("g", { class: "edges" });
  for (const e of edges) {
    const a = pos.get(e.from), b = pos.get(e.to);
    const x1 = a.x + a.w, y1 = a.y + a.h / 2, x2 = b.x, y2 = b.y + b.h / 2, mx = (x1 + x2) / 2;
    const active = byId.get(e.to).state === "running" || byId.get(e.from).state === "running";
    gEdges.append(el("path", { class: "edge" + (active ? " active" : ""), "data-from": e.from, "data-to": e.to,
      d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}` }));
  }
  svg.append(gEdges);
  for (const n of nodes) {
    const p = pos.get(n.id);
    const cls = ["node", n.kind, n.state];
    if (n.constant) cls.push("constant");
    if (state.selected === n.id) cls.push("selected");
    const grp = el("g", { class: cls.join(" "), "data-id": n.id, "data-kind": n.kind, "data-state": n.state,
      transform: `translate(${p.x},${p.y})` });
    grp.append(el("rect", { width: p.w, height: p.h, rx: n.kind === "call" ? 6 : p.h / 2 }));
    grp.append(el("title", {}, n.error ? `${n.label}: ${n.error}` : n.label));
    if (n.kind === "call") {
      const title = n.call_type === "native" ? `native: ${n.label}` : `call → ${n.label}`;
      grp.append(el("text", { x: 8, y: 15, class: "title" }, clip(title, 30)));
      callLines(n).slice(0, 4).forEach(([text, c2], i) => {
        grp.append(el("text", { x: 8, y: 30 + 14 * i, class: c2 || "" }, clip(text, LINE_CHARS)));
      });
    } else {
      const tag = n.constant ? (n.global ? "shared text" : "text") : n.label;
      grp.append(el("text", { x: p.w / 2, y: 19, "text-anchor": "middle" }, clip(tag, 22)));
    }
    grp.addEventListener("click", () => { state.selected = n.id; render(); });
    svg.append(grp);
  }
  renderEngines(g.engines);
  renderContexts(g.contexts || [], g.prefix_hit_rate);
  renderDetails(g.nodes.find((n) => n.id === state.selected));
}

function renderEngines(engines) {
  const box = $("engines");
  box.replaceChildren();
  if (!engines.length) box.append(html("p", "no engine registered", "hint"));
  for (const e of engines) {
    const d = html("div", null, "engine" + (e.live ? "" : " dead"));
    d.dataset.engine = e.name;
    d.append(html("div", `${e.name} ${e.live ? "" : "(dead: " + (e.reason || "?") + ")"}`, "name"));
    d.append(html("div", `${e.tasks} task(s) placed here; the engine runs ${e.running ?? "–"}, `
      + `queues ${e.waiting ?? "–"}`));
    if (e.process) {  // an engine process this server started (--engines N)
      const p = e.process;
      const state = p.state === "restarting" ? `restarting in ${p.restart_in_s} s` : p.state.replace("_", " ");
      const exit = p.last_exit_code === null ? "" : `, last exit code ${p.last_exit_code}`;
      d.append(html("div", `process ${p.pid ?? "–"} on port ${p.port}: ${state}, ${p.restarts} restart(s)${exit}`,
        "hint"));
    }
    if (e.kv_usage !== null) {
      const bar = html("div", null, "bar");
      const fill = html("div");
      fill.style.width = `${Math.round(e.kv_usage * 100)}%`;
      bar.append(fill);
      d.append(bar);
      d.append(html("div", `KV ${e.kv_pages_used}/${e.kv_pages_total} pages (${(e.kv_usage * 100).toFixed(1)}%), `
        + `${e.contexts} contexts, ${e.cached_tokens} tokens cached`, "hint"));
    }
    box.append(d);
  }
}

function renderContexts(contexts, hitRate) {
  const box = $("contexts");
  box.replaceChildren();
  box.append(html("p", `${contexts.length} KV context(s) of this session and the shared prefixes it forked; `
    + `server-wide, ${(100 * (hitRate || 0)).toFixed(1)}% of prompt tokens were cached`, "hint"));
  const MAX = 40;
  for (const c of contexts.slice(0, MAX)) {
    const d = html("div", null, "ctx");
    const forks = c.forked_by.length ? ` · forked by ${c.forked_by.length} call(s)` : "";
    d.append(html("span", c.context_id, "mono"));
    d.append(html("span", ` ${c.tokens} tok · ${c.owner} · ${c.engine}${c.in_use ? " · in use" : ""}${forks}`));
    d.title = c.parent ? `forked from ${c.parent}` : "a root context";
    box.append(d);
  }
  if (contexts.length > MAX) box.append(html("p", `… and ${contexts.length - MAX} more`, "hint"));
}

function renderDetails(n) {
  const box = $("details");
  box.replaceChildren();
  if (!n) { box.append(html("p", "Click a node.", "hint")); return; }
  const dl = html("dl");
  const row = (k, v) => {
    if (v === null || v === undefined || v === "") return;
    dl.append(html("dt", k));
    dl.append(html("dd", String(v)));
  };
  row("node", n.id);
  row("state", n.detail && n.detail !== n.state ? `${n.state} (${n.detail})` : n.state);
  if (n.kind === "call") {
    row("request", n.request_id);
    row("engine", n.engine);
    row("criterion", n.criterion);
    row("queue", secs(n.timings.queue_s));
    row("TTFT", secs(n.timings.ttft_s));
    row("TPOT", secs(n.timings.tpot_s));
    row("total", secs(n.timings.total_s));
    const k = n.tokens;
    if (k && k.prompt !== null) {
      row("prompt tokens", `${k.prompt}: ${k.cached} cached, ${k.computed} computed`);
      row("output tokens", k.output);
      row("forked from", k.forked_from ? `${k.forked_from} (${k.forked_tokens} tokens)` : "nothing cached");
      if (k.cached_prefix && k.cached_prefix.length) row("cached prefix", k.cached_prefix.join(" + "));
    }
  } else {
    row("variable", n.var_id);
    row("kind", n.constant ? (n.global ? "constant text, shared across sessions" : "constant text") : "semantic variable");
    row("characters", n.chars);
  }
  box.append(dl);
  if (n.error) { box.append(html("h2", "error")); box.append(html("pre", n.error)); }
  if (n.template) { box.append(html("h2", "template")); box.append(html("pre", n.template)); }
  if (n.preview) { box.append(html("h2", "content")); box.append(html("pre", n.preview)); }
}

// ---- every session (API key) ---------------------------------------------------------------------
async function listSessions() {
  const run = state.run;
  let res;
  try { res = await getJSON("/v1/sessions"); } catch (e) { res = { status: 0, body: null }; }
  if (run !== state.run) return;
  if (res.status !== 200) {
    showError((res.body && res.body.detail) || "cannot list sessions");
    return;
  }
  showError("");
  const rows = $("session-rows");
  rows.replaceChildren();
  for (const s of res.body.sessions) {
    const tr = document.createElement("tr");
    const a = html("a", s.session_id);
    a.href = `#session=${encodeURIComponent(s.session_id)}&key=${encodeURIComponent(state.key)}`;
    const td = document.createElement("td");
    td.append(a);
    tr.append(td);
    for (const v of [secs(s.idle_s), s.calls, s.waiting, s.running, s.done, s.failed]) tr.append(html("td", String(v)));
    rows.append(tr);
  }
  if (!res.body.sessions.length) rows.append(html("tr", "no sessions"));
  clearTimeout(state.timer);
  state.timer = setTimeout(listSessions, IDLE_POLL_MS);
}

// ---- start ---------------------------------------------------------------------------------------
function start() {
  clearTimeout(state.timer);
  Object.assign(state, { lastText: null, graph: null, selected: null, run: state.run + 1 });
  $("graph").replaceChildren();
  const p = params();
  for (const id of ["login", "sessions", "graph-view"]) $(id).hidden = true;
  $("constants-toggle").hidden = true;
  $("session-form").hidden = false;
  showError("");
  Object.assign(state, { session: p.session, token: p.token, key: p.key });
  if (p.session && (p.token || p.key)) {
    $("graph-view").hidden = false;
    $("constants-toggle").hidden = false;
    setStatus("connecting");
    poll();
  } else if (p.key) {
    $("sessions").hidden = false;
    $("title").textContent = "all sessions";
    setStatus("live", "live");
    listSessions();
  } else {
    $("login").hidden = false;
    setStatus("");
  }
}

$("session-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const f = new FormData(ev.target);
  location.hash = `session=${encodeURIComponent(f.get("session"))}&token=${encodeURIComponent(f.get("token"))}`;
});
$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const p = params(), key = `key=${encodeURIComponent(new FormData(ev.target).get("key"))}`;
  location.hash = p.session && p.token
    ? `session=${encodeURIComponent(p.session)}&token=${encodeURIComponent(p.token)}&${key}` : key;
});
$("show-constants").addEventListener("change", render);
window.addEventListener("resize", render);
window.addEventListener("hashchange", start);
start();
