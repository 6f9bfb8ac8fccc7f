// The engine view: polls /v1/engine/stats every 1.5 s and draws what it says (docs/webui.md explains
// each chart). Rates are differences between two polls of the server's own counters; a counter that went
// down means the server restarted, and that interval has no rate (never a negative one).
"use strict";

const $ = (id) => document.getElementById(id);
const HISTORY = 120; // points kept per chart (3 minutes)
const series = { tps: [], ttft: [], running: [], queued: [], kv: [], kvcache: [], hit: [], disk: [] };
let last = null;

function push(name, v) {
  series[name].push(v);
  if (series[name].length > HISTORY) series[name].shift();
}

function fmtBytes(n) {
  const u = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) {
    n /= 1000;
    i++;
  }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

// A line chart of one or two series in an SVG of 300 × 90, its scale labelled in `unit`.
function chart(svg, lines, unit) {
  svg.textContent = "";
  const all = lines.flatMap((l) => l.data).filter((v) => v !== null && isFinite(v));
  const top = Math.max(0, ...all);
  const max = (top || 1) * 1.1;
  const ns = "http://www.w3.org/2000/svg";
  for (const [i, l] of lines.entries()) {
    const pts = l.data
      .map((v, j) => (v === null || !isFinite(v) ? null : `${(j / (HISTORY - 1)) * 300},${86 - (v / max) * 80}`))
      .filter(Boolean)
      .join(" ");
    const p = document.createElementNS(ns, "polyline");
    p.setAttribute("points", pts);
    p.setAttribute("class", "line l" + i);
    svg.append(p);
  }
  const t = document.createElementNS(ns, "text");
  t.setAttribute("x", "2");
  t.setAttribute("y", "10");
  t.setAttribute("class", "axis");
  const shown = unit === "B" ? fmtBytes(top) : `${top >= 100 ? top.toFixed(0) : +top.toPrecision(3)} ${unit}`;
  t.textContent = `max ${shown}`;
  svg.append(t);
}

function tile(name, value, id) {
  return el("div", { class: "tile" }, el("div", { class: "v", id, text: value }), el("div", { class: "k", text: name }));
}

function heatmap(experts) {
  const box = $("heatmap");
  box.textContent = "";
  // Without an expert budget every expert is mapped from the checkpoint: nothing to show.
  $("experts-section").hidden = !experts;
  $("disk-figure").hidden = !experts;
  if (!experts) return;
  $("experts-note").textContent =
    `${experts.resident_experts} experts in RAM (${fmtBytes(experts.resident_bytes)}), ${experts.evictions} evictions, ` +
    `${experts.stall_secs.toFixed(2)} s stalled, reader ${experts.reader}`;
  const table = el("table", { class: "heat" });
  experts.layers.forEach((l, li) => {
    if (!l.experts) return;
    const name = li < experts.decoder_layers ? `layer ${li}` : `draft head (MTP)${li > experts.decoder_layers ? " " + (li - experts.decoder_layers) : ""}`;
    const tr = el("tr", {}, el("th", { text: name }));
    const resident = new Set(l.resident);
    for (let e = 0; e < l.experts; e++) {
      const hits = l.expert_hits[e] || 0;
      const misses = l.expert_misses[e] || 0;
      const td = el("td", { class: resident.has(e) ? "res" : "out", title: `${name} expert ${e}: ${hits} hits, ${misses} misses` });
      tr.append(td);
    }
    tr.append(el("td", { class: "sum", text: `${l.hits} hits · ${l.misses} misses` }));
    table.append(tr);
  });
  box.append(table);
}

async function poll() {
  let r;
  try {
    r = await api("/v1/engine/stats");
  } catch (e) {
    $("status").textContent = "unreachable";
    return;
  }
  if (!r.ok) {
    $("status").textContent = await errorText(r);
    return;
  }
  const s = await r.json();
  $("status").textContent = s.healthy ? "" : "engine stopped";
  $("model").textContent = s.model;
  const kvUsed = s.kv.pages_total - s.kv.pages_free;
  const kvRunning = Math.min(kvUsed, s.kv.pages_running);
  const pc = s.prefix_cache;
  const hitRate = pc.lookups ? pc.hits / pc.lookups : 0;
  // A counter that went down: the server restarted between the polls.
  const restarted = last && (s.tokens.generated_total < last.tokens.generated_total || pc.lookups < last.prefix_cache.lookups
    || (s.experts && last.experts && s.experts.bytes_read < last.experts.bytes_read));
  if (last && !restarted) {
    const dt = Math.max(1e-3, s.time - last.time);
    const gen = s.tokens.generated_total - last.tokens.generated_total;
    push("tps", gen / dt);
    const lookups = pc.lookups - last.prefix_cache.lookups;
    push("hit", lookups ? (100 * (pc.hits - last.prefix_cache.hits)) / lookups : null);
    const read = s.experts && last.experts ? s.experts.bytes_read - last.experts.bytes_read : 0;
    push("disk", gen ? read / gen : null);
  } else if (restarted) {
    for (const k of ["tps", "hit", "disk"]) push(k, null);
  }
  push("running", s.requests.running);
  push("queued", s.requests.waiting);
  push("kv", kvRunning);
  push("kvcache", kvUsed - kvRunning);
  series.ttft = s.ttft_recent.map((x) => x[1]).slice(-HISTORY);
  last = s;

  const tiles = $("tiles");
  tiles.textContent = "";
  tiles.append(
    tile("running", s.requests.running, "t-running"),
    tile("queued", s.requests.waiting, "t-queued"),
    tile("decode tok/s", series.tps.length && series.tps[series.tps.length - 1] !== null ? series.tps[series.tps.length - 1].toFixed(1) : "–", "t-tps"),
    tile("KV pages: running · prefix cache · free", `${kvRunning} · ${kvUsed - kvRunning} · ${s.kv.pages_free} of ${s.kv.pages_total}`, "t-kv"),
    tile("prefix cache hits (new requests)", `${pc.hits} of ${pc.lookups} (${(hitRate * 100).toFixed(0)} %)`, "t-prefix-hits"),
    tile("cached tokens served", pc.cached_tokens, "t-cached"),
    tile("prefix cache size", `${fmtBytes(pc.bytes)} / ${fmtBytes(pc.budget)}`, "t-prefix-size"),
    tile("preemptions (resumed)", `${s.requests.preemptions} (${pc.resumed || 0})`, "t-preemptions"),
    tile("requests", `${s.requests.total} (${s.requests.failed} failed, ${s.requests.cancelled} cancelled)`, "t-requests"),
  );
  if (s.experts) tiles.append(tile("expert residency", `${(s.experts.residency * 100).toFixed(0)} %`, "t-residency"));
  chart($("c-tps"), [{ data: series.tps }], "tok/s");
  chart($("c-ttft"), [{ data: series.ttft }], "s");
  chart($("c-load"), [{ data: series.running }, { data: series.queued }], "requests");
  chart($("c-kv"), [{ data: series.kv }, { data: series.kvcache }], "pages");
  chart($("c-hit"), [{ data: series.hit }], "%");
  chart($("c-disk"), [{ data: series.disk }], "B");
  heatmap(s.experts);
  const f = s.family || {};
  if ("osprey_ple_hits_total" in f) {
    $("ple-section").hidden = false;
    $("ple").textContent = `${f.osprey_ple_hits_total} hits, ${f.osprey_ple_misses_total} misses ` +
      `(${(f.osprey_ple_residency * 100).toFixed(0)} %), ${fmtBytes(f.osprey_ple_resident_bytes)} in RAM of ` +
      `${fmtBytes(f.osprey_ple_table_bytes)}, ${fmtBytes(f.osprey_ple_bytes_read_total)} read`;
  }
}

poll();
setInterval(poll, 1500);
