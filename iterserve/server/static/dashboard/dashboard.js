// The iterserve dashboard: reads /dashboard/events (server-sent events over fetch, so a 401 can be
// told apart and answered with the login form) and draws each frame. Plain JS and canvas, no libraries.
"use strict";

// KV block states, as iterserve.engine.messages numbers them.
const KV_FREE = 0, KV_CACHED = 1, KV_SHARED = 2, KV_HELD = 3, KV_FIRST_ROW = 4;
const KV_STATE_COLORS = {
  [KV_FREE]: "#e9edf0", [KV_CACHED]: "#b9d7ea", [KV_SHARED]: "#7b3fa0", [KV_HELD]: "#59636d",
};
// Row colours (Tableau 20): row i of the batch and the KV blocks it holds alone.
const ROW_COLORS = [
  "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
  "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#17becf", "#bcbd22", "#8c564b", "#e377c2", "#aec7e8", "#98df8a",
];
const SERIES_SPAN_S = 300;
const CHART_WIDTH = 250;
const MAX_LATENCIES = 500;
// Bucket fields, in the order the server sends them (iterserve.server.dashboard.Bucket).
const B = {start: 0, steps: 1, tokens: 2, decode: 3, running: 4, waiting: 5, kv: 6, preemptions: 7};

const state = {facts: null, stats: null, step: null, kv: null, series: [], latencies: [], now: 0, viewers: 0};
const $ = (id) => document.getElementById(id);

function rowColor(row) { return ROW_COLORS[row % ROW_COLORS.length]; }

function kvColor(code) {
  if (code < KV_FIRST_ROW) return KV_STATE_COLORS[code];
  return code === 255 ? KV_STATE_COLORS[KV_HELD] : rowColor(code - KV_FIRST_ROW);
}

function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = cls || "";
}

// -- the feed ------------------------------------------------------------------------------------

async function connect() {
  setStatus("connecting…");
  let response;
  try {
    response = await fetch("/dashboard/events", {credentials: "same-origin", cache: "no-store"});
  } catch (e) {
    return retry();
  }
  if (response.status === 401) return showLogin("");
  if (!response.ok || !response.body) return retry();
  $("login").hidden = true;
  $("panels").hidden = false;
  setStatus("live", "live");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) apply(JSON.parse(line.slice(6)));
        }
      }
    }
  } catch (e) {
    // the connection broke: fall through and reconnect
  }
  retry();
}

function retry() {
  setStatus("disconnected; retrying", "down");
  setTimeout(connect, 2000);
}

function showLogin(message) {
  setStatus("locked", "down");
  $("panels").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message;
  $("key").focus();
}

async function login(event) {
  event.preventDefault();
  const key = $("key").value;
  const response = await fetch("/dashboard/session", {
    method: "POST", credentials: "same-origin", body: "{}",
    headers: {"Authorization": `Bearer ${key}`, "Content-Type": "application/json"},
  });
  if (response.ok) {
    $("key").value = "";
    connect();
  } else {
    showLogin(response.status === 401 ? "That key is not this server's." : `The server answered ${response.status}.`);
  }
}

// -- state ---------------------------------------------------------------------------------------

function apply(frame) {
  state.now = frame.now;
  state.viewers = frame.viewers;
  if (frame.facts) {
    state.facts = frame.facts;
    state.series = [];
    state.latencies = [];
    renderFacts();
  }
  if (frame.stats) state.stats = frame.stats;
  if (frame.step) state.step = frame.step;
  if (frame.kv) state.kv = {step: frame.kv[0], blocks: Uint8Array.from(atob(frame.kv[1]), (c) => c.charCodeAt(0))};
  for (const bucket of frame.series || []) {
    const last = state.series[state.series.length - 1];
    if (last && last[B.start] === bucket[B.start]) state.series[state.series.length - 1] = bucket;
    else state.series.push(bucket);
  }
  while (state.series.length && state.series[0][B.start] < state.now - SERIES_SPAN_S) state.series.shift();
  if (frame.latencies) state.latencies = state.latencies.concat(frame.latencies).slice(-MAX_LATENCIES);
  render();
}

// -- drawing -------------------------------------------------------------------------------------

function render() {
  renderBatch();
  renderKV();
  renderSeries();
  renderLatencies();
  renderSpec();
  renderLoras();
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function renderBatch() {
  const body = $("batch");
  const step = state.step;
  const rows = step ? step.seqs : [];
  const fresh = [];
  rows.forEach(([request, phase, tokens, computed, output], i) => {
    const tr = document.createElement("tr");
    tr.dataset.request = request;
    const swatch = document.createElement("td");
    swatch.className = "swatch";
    const box = document.createElement("span");
    box.style.background = rowColor(i);
    swatch.appendChild(box);
    tr.append(swatch, cell(String(i), "num"), cell(request, "request"), cell(phase, `phase-${phase}`),
              cell(String(tokens), "num"), cell(String(computed), "num"), cell(String(output), "num"));
    fresh.push(tr);
  });
  body.replaceChildren(...fresh);
  const s = state.stats;
  const idle = s && !s.running && !s.waiting;
  $("batch-summary").textContent = step
    ? `${idle ? "idle; the last step was " : ""}step ${step.step}: ` +
      `${step.num_prefill_seqs} prefilling, ${step.num_decode_seqs} decoding, ` +
      `${step.num_prefill_tokens + step.num_decode_tokens} tokens in ${(step.duration * 1000).toFixed(1)} ms` +
      (s ? `; ${s.waiting} waiting` : "")
    : "no step yet";
}

function fitCanvas(canvas, cssWidth, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  canvas.style.width = `${cssWidth}px`;
  canvas.style.height = `${cssHeight}px`;
  canvas.width = Math.round(cssWidth * ratio);
  canvas.height = Math.round(cssHeight * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return ctx;
}

function renderKV() {
  const canvas = $("kv");
  const kv = state.kv;
  const total = kv ? kv.blocks.length : (state.facts ? state.facts.capacity.num_blocks : 0);
  if (!total) return;
  const width = Math.min(560, canvas.parentElement.clientWidth || 480);
  const size = Math.max(1, Math.min(18, Math.floor(Math.sqrt((width * 260) / total))));
  const columns = Math.max(1, Math.floor(width / size));
  const ctx = fitCanvas(canvas, columns * size, Math.ceil(total / columns) * size);
  const gap = size >= 5 ? 1 : 0;
  const counts = [0, 0, 0, 0, 0];
  for (let i = 0; i < total; i++) {
    const code = kv ? kv.blocks[i] : KV_FREE;
    counts[Math.min(code, KV_FIRST_ROW)]++;
    ctx.fillStyle = kvColor(code);
    ctx.fillRect((i % columns) * size, Math.floor(i / columns) * size, size - gap, size - gap);
  }
  const inUse = counts[KV_SHARED] + counts[KV_HELD] + counts[KV_FIRST_ROW];
  canvas.dataset.used = String(inUse);
  canvas.dataset.total = String(total);
  $("kv-summary").textContent = kv
    ? `${inUse} of ${total} in use (${counts[KV_SHARED]} shared), ${counts[KV_CACHED]} cached, after step ${kv.step}`
    : `${total} blocks`;
  const legend = $("kv-legend");
  if (!legend.childElementCount) {
    const entries = [["free", KV_STATE_COLORS[KV_FREE]], ["cached, evictable", KV_STATE_COLORS[KV_CACHED]],
                     ["shared", KV_STATE_COLORS[KV_SHARED]], ["held, not in this step", KV_STATE_COLORS[KV_HELD]],
                     ["held by a batch row (its colour)", ROW_COLORS[0]]];
    for (const [label, color] of entries) {
      const item = document.createElement("span");
      const key = document.createElement("span");
      key.className = "key";
      key.style.background = color;
      item.append(key, label);
      legend.appendChild(item);
    }
  }
}

// A small chart: lines (or bars) against seconds before now, the y axis from 0 to the largest value.
function drawChart(canvas, series, {bars = false, yMax = null} = {}) {
  const W = CHART_WIDTH, H = 120, left = 34, bottom = 16, top = 6, right = 6;
  const ctx = fitCanvas(canvas, W, H);
  ctx.clearRect(0, 0, W, H);
  let max = yMax || 0;
  for (const s of series) for (const [, y] of s.points) max = Math.max(max, y);
  max = max || 1;
  const x = (t) => left + ((t + SERIES_SPAN_S) / SERIES_SPAN_S) * (W - left - right);
  const y = (v) => H - bottom - (v / max) * (H - bottom - top);
  ctx.strokeStyle = "#d8dde2";
  ctx.fillStyle = "#66707a";
  ctx.font = "10px system-ui, sans-serif";
  ctx.beginPath();
  ctx.moveTo(left, top);
  ctx.lineTo(left, H - bottom);
  ctx.lineTo(W - right, H - bottom);
  ctx.stroke();
  ctx.textAlign = "right";
  ctx.fillText(formatNumber(max), left - 3, top + 8);
  ctx.fillText("0", left - 3, H - bottom);
  // centred under its tick, but "now" ends at the axis' end: centred there it would run off the canvas
  for (const t of [-300, -240, -180, -120, -60, 0]) {
    ctx.textAlign = t ? "center" : "right";
    ctx.fillText(t ? `${t / 60}m` : "now", t ? x(t) : W, H - 3);
  }
  for (const s of series) {
    ctx.strokeStyle = ctx.fillStyle = s.color;
    if (bars) {
      const w = Math.max(1, x(0.5) - x(0));
      for (const [t, v] of s.points) if (v) ctx.fillRect(x(t), y(v), w, H - bottom - y(v));
      continue;
    }
    ctx.beginPath();
    let previous = null;
    for (const [t, v] of s.points) {
      // five seconds without a step (an idle engine) breaks the line
      if (previous === null || t - previous > 5) ctx.moveTo(x(t), y(v));
      else ctx.lineTo(x(t), y(v));
      previous = t;
    }
    ctx.stroke();
    for (const [t, v] of s.points) ctx.fillRect(x(t) - 1, y(v) - 1, 2, 2);  // a lone bucket shows too
  }
}

function formatNumber(v) {
  if (v >= 1000) return `${(v / 1000).toFixed(v >= 10000 ? 0 : 1)}k`;
  return Number.isInteger(v) ? String(v) : v.toFixed(v < 10 ? 2 : 1);
}

function renderSeries() {
  const points = (f) => state.series.map((b) => [b[B.start] - state.now, f(b)]);
  const blocks = state.facts ? state.facts.capacity.num_blocks : 1;
  drawChart($("chart-tokens"), [{color: "#4e79a7", points: points((b) => b[B.tokens] / Math.max(1, b[B.steps]))}]);
  drawChart($("chart-queue"), [{color: "#4e79a7", points: points((b) => b[B.running])},
                               {color: "#f28e2b", points: points((b) => b[B.waiting])}]);
  drawChart($("chart-kv"), [{color: "#e15759", points: points((b) => (100 * b[B.kv]) / blocks)}], {yMax: 100});
  drawChart($("chart-preemptions"), [{color: "#b07aa1", points: points((b) => b[B.preemptions])}], {bars: true});
  const s = state.stats;
  $("series-summary").textContent = s
    ? `${s.steps} steps, ${s.generation_tokens} tokens generated, ${s.preemptions} preemptions since start`
    : "";
}

function quantile(sorted, q) {
  if (!sorted.length) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}

function drawHistogram(canvas, caption, label, values) {
  const W = CHART_WIDTH, H = 120, bottom = 16, top = 6, nbins = 24;
  const ctx = fitCanvas(canvas, W, H);
  ctx.clearRect(0, 0, W, H);
  const sorted = values.filter((v) => v !== null).map((v) => v * 1000).sort((a, b) => a - b);
  if (!sorted.length) {
    caption.textContent = `${label}: no request yet`;
    return;
  }
  const p50 = quantile(sorted, 0.5), p90 = quantile(sorted, 0.9), p99 = quantile(sorted, 0.99);
  caption.textContent = `${label} (ms): p50 ${formatNumber(p50)}, p90 ${formatNumber(p90)}, p99 ${formatNumber(p99)}`;
  const hi = Math.max(p99 * 1.1, sorted[0] * 1.01, 1e-3);
  const bins = new Array(nbins).fill(0);
  for (const v of sorted) bins[Math.min(nbins - 1, Math.floor((v / hi) * nbins))]++;
  const most = Math.max(...bins);
  const w = W / nbins;
  ctx.fillStyle = "#4e79a7";
  bins.forEach((n, i) => {
    const h = (n / most) * (H - bottom - top);
    ctx.fillRect(i * w + 1, H - bottom - h, w - 2, h);
  });
  ctx.fillStyle = "#66707a";
  ctx.font = "10px system-ui, sans-serif";
  ctx.textAlign = "left";
  ctx.fillText("0", 1, H - 3);
  ctx.textAlign = "right";
  ctx.fillText(`${formatNumber(hi)} ms`, W - 1, H - 3);
}

function renderLatencies() {
  const l = state.latencies;
  drawHistogram($("hist-ttft"), $("caption-ttft"), "TTFT", l.map((r) => r[0]));
  drawHistogram($("hist-tpot"), $("caption-tpot"), "TPOT", l.map((r) => r[1]));
  drawHistogram($("hist-e2e"), $("caption-e2e"), "end to end", l.map((r) => r[2]));
  $("latency-summary").textContent = `the last ${l.length} finished`;
}

// How the engine forms its batches, in the words of docs/concepts.md (sections 1 and 2).
function schedulingText(e) {
  const policies = {
    continuous: "continuous batching: requests join and leave the batch at every step",
    static: `static batching: a batch of up to ${e.max_num_seqs} runs until its last request finishes`,
    dynamic: `dynamic batching: a batch starts at ${e.max_num_seqs} requests or once its first has waited ` +
             `${Math.round(e.max_batch_wait * 1000)} ms, then runs until its last request finishes`,
  };
  return policies[e.batching] || `${e.batching} batching`;
}

// Speculative decoding since start (the spec_decode counters /metrics exports); the panel shows only when it is on.
function renderSpec() {
  const spec = state.stats ? state.stats.spec : undefined;
  $("spec-panel").hidden = !spec;
  if (!spec) return;
  const rate = spec.acceptance_rate, length = spec.mean_accepted_length;
  const rows = [
    ["drafts verified", String(spec.drafts)],
    ["draft tokens", String(spec.draft_tokens)],
    ["accepted tokens", String(spec.accepted_tokens)],
    ["acceptance rate", rate === null ? "-" : `${(100 * rate).toFixed(1)}%`],
    ["mean accepted length", length === null ? "-" : `${length.toFixed(2)} tokens per pass`],
  ];
  $("spec").replaceChildren(...rows.map(([k, v]) => {
    const tr = document.createElement("tr");
    tr.append(cell(k), cell(v, "num"));
    return tr;
  }));
}

// The LoRA adapters the running and waiting requests name (with --enable-lora); the panel shows while there are any.
function renderLoras() {
  const loras = state.stats ? state.stats.loras : undefined;
  $("lora-panel").hidden = !loras;
  if (!loras) return;
  const names = [...new Set([...loras.running, ...loras.waiting])].sort();
  $("loras").replaceChildren(...names.map((name) => {
    const tr = document.createElement("tr");
    const where = [loras.running.includes(name) ? "running" : "", loras.waiting.includes(name) ? "waiting" : ""];
    tr.append(cell(name), cell(where.filter(Boolean).join(", ")));
    return tr;
  }));
}

function weightsText(weights, quantization) {
  const total = weights.reduce((sum, w) => sum + w.bytes, 0);
  const parts = weights.map(w => `${w.format}: ${w.tensors} tensor${w.tensors === 1 ? "" : "s"}, ` +
                                 `${(w.bytes / 1e6).toFixed(1)} MB`);
  return `${(total / 1e6).toFixed(1)} MB (quantization ${quantization || "none"}): ${parts.join("; ")}`;
}

function renderFacts() {
  const f = state.facts;
  const c = f.capacity, e = f.engine, m = f.model;
  $("model").textContent = `${f.served_model_name} · iterserve ${f.version}`;
  const rows = [
    ["model", `${e.model} (${m.architecture}, ${m.num_layers} layers, hidden ${m.hidden_size}, ` +
              `${m.num_heads} heads / ${m.num_kv_heads} KV heads of ${m.head_dim})`],
    ["precision, device", `${e.dtype}, ${e.device || "auto"}`],
    ["weights", weightsText(f.weights || [], e.quantization)],
    ["KV bytes per token", String(c.kv_bytes_per_token)],
    ["KV pool", `${c.num_blocks} blocks × ${c.block_size} tokens = ${c.total_tokens} tokens ` +
                `(${(c.total_tokens * c.kv_bytes_per_token / 2 ** 20).toFixed(1)} MiB)`],
    ["max_model_len", `${c.max_model_len}: ${c.max_full_length_seqs} sequences of that length fit`],
    ["batch limits", `${e.max_num_seqs} sequences, ${e.max_num_batched_tokens} tokens per step`],
    ["scheduling", `${schedulingText(e)}; ${e.kv_allocation} KV allocation, prefix caching ` +
                   `${e.enable_prefix_caching ? "on" : "off"}`],
  ];
  const table = $("facts");
  table.replaceChildren(...rows.map(([k, v]) => {
    const tr = document.createElement("tr");
    tr.append(cell(k), cell(v));
    return tr;
  }));
}

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", login);
  connect();
});
