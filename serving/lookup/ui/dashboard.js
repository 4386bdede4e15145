// kvledger's dashboard: draws GET /v1/dashboard every few seconds. Every name from the
// index is set as text (textContent, chart labels), never as markup.
"use strict";

const REFRESH_MS = 5000;
const TIERS = ["GPU", "CPU", "STORAGE"];
const OUTCOMES = ["captured", "evicted_before_arrival", "lower_tier_only", "chosen_elsewhere",
  "holder_silent", "no_holder", "unreported"];
const charts = {};
const state = { last: null, errors: [] };
window.kvledgerDashboard = { charts, state };

function token() { return sessionStorage.getItem("kvledger-token") || ""; }

function minuteLabel(iso) { return iso ? iso.slice(11, 16) : ""; }

function chart(id, type, options) {
  if (!charts[id]) {
    charts[id] = new Chart(document.getElementById(id), {
      type, data: { labels: [], datasets: [] },
      options: Object.assign({ animation: false, responsive: true,
        plugins: { legend: { position: "bottom" } } }, options || {}),
    });
  }
  return charts[id];
}

function setData(c, labels, datasets) {
  c.data.labels = labels;
  c.data.datasets = datasets;
  c.update();
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (cls) td.className = cls;
  row.appendChild(td);
}

function fillTable(id, rows, make) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren();
  for (const r of rows) {
    const tr = document.createElement("tr");
    make(tr, r);
    body.appendChild(tr);
  }
}

function draw(d) {
  fillTable("fleet", d.fleet, (tr, s) => {
    cell(tr, s.source); cell(tr, s.model); cell(tr, s.state, s.state); cell(tr, s.epoch, "n");
    cell(tr, s.last_seen ? s.last_seen.replace("T", " ").slice(0, 19) : "");
    cell(tr, s.restarts, "n"); cell(tr, s.gaps, "n");
    cell(tr, (s.lost_gaps || 0) + (s.lost_batches || 0), "n");
    for (const t of TIERS) cell(tr, s.held[t] || 0, "n");
  });
  const names = d.fleet.map((s) => `${s.source} (${s.model})`);
  setData(chart("chart-blocks", "bar", { scales: { x: { stacked: true }, y: { stacked: true } } }),
    names, TIERS.map((t) => ({ label: t, data: d.fleet.map((s) => s.held[t] || 0) })));

  const minutes = [...new Set(d.occupancy.map((o) => o.t))].sort();
  const series = {};
  for (const o of d.occupancy) {
    const key = `${o.instance} ${o.medium}`;
    (series[key] = series[key] || {})[o.t] = o.blocks;
  }
  setData(chart("chart-occupancy", "line"), minutes.map(minuteLabel),
    Object.keys(series).sort().map((k) => ({ label: k, data: minutes.map((m) => series[k][m] || 0) })));

  const f = d.funnel;
  setData(chart("chart-funnel", "line"), f.map((r) => minuteLabel(r.t)), [
    { label: "available", data: f.map((r) => r.available_blocks) },
    { label: "captured", data: f.map((r) => r.captured_blocks) },
    { label: "delivered", data: f.map((r) => r.delivered_blocks) },
  ]);
  setData(chart("chart-outcomes", "bar", { scales: { x: { stacked: true }, y: { stacked: true } } }),
    f.map((r) => minuteLabel(r.t)),
    OUTCOMES.map((o) => ({ label: o, data: f.map((r) => r.outcomes[o] || 0) })));

  const now = Date.parse(d.now);
  const kinds = [...new Set(d.timeline.map((e) => e.kind))].sort();
  setData(chart("chart-timeline", "scatter", {
    scales: { x: { title: { display: true, text: "minutes ago" }, reverse: true, min: 0 },
              y: { display: false, min: 0, max: kinds.length + 1 } },
  }), [], kinds.map((k, i) => ({
    label: k,
    data: d.timeline.filter((e) => e.kind === k).map((e) => ({
      x: Math.max(0, (now - Date.parse(e.t)) / 60000), y: i + 1, what: e.what })),
  })));

  fillTable("prefixes", d.prefixes, (tr, p) => {
    cell(tr, p.model); cell(tr, p.group_idx, "n"); cell(tr, p.block_hash.slice(0, 16));
    cell(tr, p.token_end === null ? "" : `${p.token_start}–${p.token_end}`, "n");
    cell(tr, p.instances, "n"); cell(tr, p.residencies, "n");
  });
}

async function refresh() {
  const status = document.getElementById("status");
  const headers = token() ? { Authorization: `Bearer ${token()}` } : {};
  try {
    const res = await fetch("/v1/dashboard?minutes=60", { headers });
    if (res.status === 401) {
      document.getElementById("token-form").classList.add("shown");
      status.textContent = "a bearer token is needed";
      return;
    }
    const body = await res.json();
    if (!res.ok) throw new Error(body.error || res.statusText);
    state.last = body;
    draw(body);
    status.className = "status";
    status.textContent = `${body.mode} · ${body.fleet.length} sources · updated ` +
      new Date().toLocaleTimeString();
  } catch (err) {
    state.errors.push(String(err));
    status.className = "status error";
    status.textContent = `not updated: ${err}`;
  }
}

document.getElementById("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem("kvledger-token", document.getElementById("token").value);
  document.getElementById("token-form").classList.remove("shown");
  refresh();
});
refresh();
setInterval(refresh, REFRESH_MS);
