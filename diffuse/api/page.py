"""The status page at GET /: the swarm at a glance, redrawn every 2 s from /status.json.

One self-contained HTML document (no external scripts, fonts or styles: operators' machines
may have no internet). Everything a peer announces is untrusted, so it is rendered with
textContent only, never as HTML. Elements carry data-model / data-block / data-peer attributes
so tests (and scrapers) can read the page without depending on its looks.
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Diffuse swarm status</title>
<style>
  :root { --bad: #d64545; --thin: #e0a526; --ok: #4caf50; --rich: #2e7d32; --ink: #1d2330; --muted: #6b7385; }
  body { font: 14px/1.4 system-ui, sans-serif; color: var(--ink); margin: 0; background: #f5f6f8; }
  header { display: flex; align-items: baseline; gap: 1em; padding: .8em 1.2em; background: #1d2330; color: #fff; }
  header h1 { font-size: 1.2em; margin: 0; }
  header .muted { color: #aab; }
  main { padding: 1em 1.2em; }
  .card { background: #fff; border-radius: 6px; box-shadow: 0 1px 3px #0002; padding: .8em 1em; margin-bottom: 1em; }
  .badge { display: inline-block; padding: 0 .5em; border-radius: 3px; color: #fff; font-size: .85em; }
  .badge.ok { background: var(--ok); } .badge.bad { background: var(--bad); }
  .muted { color: var(--muted); }
  .map { display: grid; gap: 2px; margin: .6em 0; align-items: center; }
  .block { text-align: center; font-size: 11px; color: #fff; border-radius: 2px; padding: 3px 0; }
  .r0 { background: var(--bad); } .r1 { background: var(--thin); }
  .r2 { background: var(--ok); } .r3 { background: var(--rich); }
  .span { background: #dfe6f3; border: 1px solid #9fb0d0; border-radius: 3px; font: 11px ui-monospace, monospace;
          white-space: nowrap; overflow: hidden; text-overflow: ellipsis; padding: 1px 4px; }
  .span.late { background: #f6e3c4; border-color: var(--thin); }
  .span.banned { background: #f3d0d0; border-color: var(--bad); }
  .label { font-size: 11px; color: var(--muted); white-space: nowrap; padding-right: 6px; }
  table { border-collapse: collapse; width: 100%; font-size: 13px; }
  th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #eee; }
  td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
  td.mono { font-family: ui-monospace, monospace; }
  .legend span { display: inline-block; width: 1em; height: 1em; vertical-align: middle; border-radius: 2px;
                 margin: 0 .2em 0 .8em; }
  #error { display: none; background: var(--bad); color: #fff; padding: .5em 1.2em; }
</style>
</head>
<body>
<header><h1>Diffuse swarm</h1><span id="api" class="muted">loading...</span>
  <span id="updated" class="muted"></span></header>
<div id="error"></div>
<main id="models"><noscript>This page needs JavaScript; the same data is at /status.json.</noscript></main>
<script>
"use strict";
const REFRESH_MS = 2000;
let previous = null;  // the last poll, to turn token counters into tokens/s

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
const short = (id) => id.length > 14 ? id.slice(0, 6) + ".." + id.slice(-4) : id;
const dur = (s) => s < 120 ? s.toFixed(0) + "s" : s < 7200 ? (s / 60).toFixed(0) + "m" : (s / 3600).toFixed(1) + "h";

function runs(blocks) {  // [3,4,5,9] -> "3-5, 9"
  const out = [];
  for (const b of blocks) {
    const last = out[out.length - 1];
    if (last && last[1] === b - 1) last[1] = b; else out.push([b, b]);
  }
  return out.map(([a, b]) => a === b ? String(a) : a + "-" + b).join(", ");
}

function health(p) {
  // A record lives three heartbeats (protocols/); more than 1.5 heartbeats of silence is late.
  // A peer this API's client banned after it failed a session is "banned" whatever it announces.
  if (p.banned) return "banned";
  if (p.expires_in_s === undefined) return "ok";
  const beat = (p.last_heartbeat_s + p.expires_in_s) / 3;
  return p.last_heartbeat_s > 1.5 * beat ? "late" : "ok";
}

function renderModel(m) {
  const covered = m.num_blocks - m.missing.length;
  const badge = m.servable ? el("span", {class: "badge ok"}, "servable")
                           : el("span", {class: "badge bad"}, "NOT servable: blocks " + runs(m.missing) + " uncovered");
  const card = el("section", {class: "card model", "data-model": m.model},
    el("h2", {}, m.model + " ", badge),
    el("div", {class: "muted"}, `${covered}/${m.num_blocks} blocks covered, min replicas ${m.min_replicas ?? 0}, ` +
       `${m.peers.length} peers`),
    el("div", {class: "legend muted"}, "replicas:",
       el("span", {class: "r0"}), "0", el("span", {class: "r1"}), "1", el("span", {class: "r2"}), "2",
       el("span", {class: "r3"}), "3+"));
  const map = el("div", {class: "map",
                         style: `grid-template-columns: max-content repeat(${m.num_blocks}, minmax(16px, 1fr))`});
  map.append(el("div", {class: "label"}, "block"));
  for (const b of m.blocks) {
    const n = b.peers.length;
    map.append(el("div", {class: "block r" + Math.min(n, 3), "data-block": b.block, "data-replicas": n,
                          title: `block ${b.block}: ${n} replica(s)` +
                                 (n ? "\\n" + b.peers.join("\\n") : "")}, b.block));
  }
  m.peers.forEach((p, row) => {
    map.append(el("div", {class: "label", style: `grid-row: ${row + 2}`}, short(p.peer_id)));
    map.append(el("div", {class: "span " + health(p), "data-peer": p.peer_id, title: p.peer_id,
                          style: `grid-row: ${row + 2}; grid-column: ${p.start + 2} / ${p.end + 2}`},
                  `${short(p.peer_id)} [${p.start}, ${p.end})`));
  });
  card.append(map);
  const table = el("table", {}, el("tr", {}, el("th", {}, "peer"), el("th", {}, "blocks"),
    el("th", {class: "num"}, "tokens/s"), el("th", {class: "num"}, "sessions"), el("th", {class: "num"}, "rtt ms"),
    el("th", {class: "num"}, "cache tokens"), el("th", {}, "dtype"),
    el("th", {class: "num"}, "up"), el("th", {class: "num"}, "heartbeat"), el("th", {}, "health")));
  for (const p of m.peers) {
    table.append(el("tr", {"data-peer-row": p.peer_id}, el("td", {class: "mono", title: p.peer_id}, p.peer_id),
      el("td", {}, `${p.start}-${p.end - 1}`), el("td", {class: "num"}, Number(p.throughput).toFixed(1)),
      el("td", {class: "num"}, (p.extra || {}).sessions ?? ""), el("td", {class: "num"}, p.rtt_ms ?? ""),
      el("td", {class: "num"}, p.cache_tokens), el("td", {}, p.dtype || ""), el("td", {class: "num"}, dur(p.age_s)),
      el("td", {class: "num"}, dur(p.last_heartbeat_s) + " ago"), el("td", {}, health(p))));
  }
  for (const [id, why] of Object.entries(m.excluded || {})) {
    table.append(el("tr", {"data-excluded": id}, el("td", {class: "mono"}, id),
                    el("td", {colspan: 8}, "excluded: " + why),
                    el("td", {}, "excluded")));
  }
  card.append(table);
  return card;
}

function renderApi(s) {
  const total = Object.values(s.api.tokens_generated).reduce((a, b) => a + b, 0);
  let rate = "";
  if (previous) {
    const dt = s.time - previous.time;
    if (dt > 0) rate = `, ${((total - previous.total) / dt).toFixed(1)} tokens/s`;
  }
  previous = {time: s.time, total};
  document.getElementById("api").textContent =
    `this API: ${s.api.sessions_open}/${s.api.max_sessions} sessions open, ${total} tokens generated${rate}`;
}

async function refresh() {
  const error = document.getElementById("error");
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    if (!r.ok) throw new Error("status.json: HTTP " + r.status);
    const s = await r.json();
    renderApi(s);
    const models = document.getElementById("models");
    models.replaceChildren(...s.models.map(renderModel));
    if (!s.models.length) models.append(el("p", {class: "muted"}, "no models known yet"));
    document.getElementById("updated").textContent = "updated " + new Date(s.time * 1000).toLocaleTimeString();
    document.body.dataset.ready = "1";
    error.style.display = "none";
  } catch (e) {
    error.textContent = "cannot reach the API: " + e.message;
    error.style.display = "block";
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body>
</html>
"""
