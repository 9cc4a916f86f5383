/* Tessera dashboard: renders the snapshots of /ws/stats (dashboard/access.py gives their shape)
 * into the headline numbers, the overview's tables and the live page's uPlot charts.
 *
 * The WebSocket reconnects by itself after a close (a server restart, a network blip), waiting
 * 0.5 s and doubling up to 10 s between tries; a close with code 4401 (not logged in, e.g. the
 * session expired) sends the browser to the login page instead. */
"use strict";
(function () {
  const root = document.getElementById("dashboard");
  const HISTORY = 120; // points per chart series: one minute at two snapshots a second
  const RETRY_FIRST_MS = 500, RETRY_MAX_MS = 10000, UNAUTHENTICATED = 4401;

  const dash = "–";
  const num = (x, digits = 0) => (x === null || x === undefined ? dash : Number(x).toFixed(digits));
  const pct = (x) => (x === null || x === undefined ? dash : (100 * x).toFixed(1) + " %");
  const secs = (x) => (x === null || x === undefined ? dash : x < 1 ? (1000 * x).toFixed(0) + " ms" : x.toFixed(2) + " s");
  const uptime = (s) => {
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = Math.floor(s % 60);
    return h ? `${h}h ${String(m).padStart(2, "0")}m` : `${m}m ${String(r).padStart(2, "0")}s`;
  };
  const FORMATS = {
    output_tokens_per_s: (x) => num(x, 1), num_requests_running: num, num_requests_waiting: num,
    kv_cache_usage: pct, prefix_cache_hit_rate: pct, ttft_p50_s: secs, ttft_p99_s: secs,
    tpot_p50_s: secs, tpot_p99_s: secs, num_preemptions_total: num,
  };

  function renderHeadline(totals) {
    for (const [name, format] of Object.entries(FORMATS)) {
      for (const el of root.querySelectorAll(`[data-stat="${name}"]`)) el.textContent = format(totals[name]);
    }
  }

  function fillTable(id, rows, cells, empty) {
    const body = document.querySelector(`#${id} tbody`);
    if (!body) return;
    const width = document.querySelectorAll(`#${id} thead th`).length;
    body.replaceChildren(...(rows.length ? rows : [null]).map((row) => {
      const tr = document.createElement("tr");
      for (const text of row ? cells(row) : [empty]) {
        const td = document.createElement("td");
        td.textContent = text;
        if (!row) td.colSpan = width;
        tr.appendChild(td);
      }
      if (row) tr.dataset.key = row.id || row.slug || row.name;
      return tr;
    }));
  }

  function renderTables(snapshot) {
    fillTable("models", snapshot.models, (m) => [
      m.name, m.num_workers, m.num_requests_running, m.num_requests_waiting, num(m.output_tokens_per_s, 1),
      pct(m.kv_cache_usage), pct(m.prefix_cache_hit_rate), `${secs(m.ttft_p50_s)} / ${secs(m.ttft_p99_s)}`,
      `${secs(m.tpot_p50_s)} / ${secs(m.tpot_p99_s)}`, num(m.num_preemptions_total),
    ], "No model is being served (no live worker).");
    const workers = [...snapshot.models.flatMap((m) => m.workers || []), ...(snapshot.idle_workers || [])];
    fillTable("workers", workers, (w) => [
      w.model || dash, w.id, w.host, w.device || dash, w.state, uptime(w.uptime_s), w.num_running, w.num_waiting,
      num(w.output_tokens_per_s, 1), pct(w.kv_cache_usage),
    ], "No live worker.");
    fillTable("tenants", snapshot.tenants, (t) => [
      `${t.name} (${t.slug})${t.active ? "" : " · inactive"}`, t.requests, t.tokens, pct(t.share),
      `${t.gpu_share} %`, t.daily_token_budget ? `${pct(t.budget_used)} of ${t.daily_token_budget}` : "no budget",
    ], "No tenant to show.");
  }

  // ---- charts (live page) -------------------------------------------------------------
  const CHARTS = {
    throughput: [["tokens/s", "output_tokens_per_s", 1]],
    requests: [["running", "num_requests_running", 1], ["waiting", "num_requests_waiting", 1]],
    cache: [["KV cache", "kv_cache_usage", 100], ["prefix hits", "prefix_cache_hit_rate", 100]],
    latency: [["TTFT p50", "ttft_p50_s", 1], ["TTFT p99", "ttft_p99_s", 1],
              ["TPOT p50", "tpot_p50_s", 1], ["TPOT p99", "tpot_p99_s", 1]],
  };
  const COLORS = ["#4a7bd0", "#d0764a", "#3a9a5b", "#9a3a8a"];
  const charts = [];

  function makeCharts() {
    if (typeof uPlot === "undefined") return;
    for (const el of root.querySelectorAll("[data-chart]")) {
      const series = CHARTS[el.dataset.chart];
      const data = [[], ...series.map(() => [])];
      const plot = new uPlot({
        width: Math.max(300, el.clientWidth), height: 200,
        series: [{}, ...series.map(([label], i) => ({label, stroke: COLORS[i], width: 2, spanGaps: true}))],
        axes: [{}, {size: 60}],
      }, data, el);
      charts.push({plot, series, data});
    }
  }

  // The share chart: each tenant's share of the tokens served over the last seconds (solid)
  // against its GPU share (dashed), in %. Its series follow the tenants in the snapshot (one
  // tenant with data-tenant), so the plot is made anew when they change.
  let shares = null;

  function pushShares(snapshot) {
    const el = root.querySelector("[data-share-chart]");
    if (!el || typeof uPlot === "undefined") return;
    const only = el.dataset.tenant;
    const tenants = (snapshot.tenants || []).filter((t) => t.active && (!only || t.slug === only));
    const key = tenants.map((t) => t.slug).join(" ");
    if (!shares || shares.key !== key) {
      if (shares) shares.plot.destroy();
      const series = [{}];
      tenants.forEach((t, i) => {
        const stroke = COLORS[i % COLORS.length];
        series.push({label: `${t.slug} served`, stroke, width: 2, spanGaps: true});
        series.push({label: `${t.slug} share`, stroke, width: 1, dash: [6, 4]});
      });
      const data = [[], ...tenants.flatMap(() => [[], []])];
      shares = {key, data, plot: new uPlot({width: Math.max(300, el.clientWidth), height: 200, series,
                                            scales: {y: {range: [0, 100]}}, axes: [{}, {size: 60}]}, data, el)};
    }
    shares.data[0].push(snapshot.time);
    const latest = {};
    tenants.forEach((t, i) => {
      const served = t.recent_share === null || t.recent_share === undefined ? null : 100 * t.recent_share;
      shares.data[2 * i + 1].push(served);
      shares.data[2 * i + 2].push(t.gpu_share);
      latest[t.slug] = {served, share: t.gpu_share};
    });
    if (shares.data[0].length > HISTORY) shares.data.forEach((column) => column.shift());
    shares.plot.setData(shares.data);
    el.dataset.latest = JSON.stringify(latest);
  }

  function pushCharts(snapshot) {
    pushShares(snapshot);
    for (const chart of charts) {
      chart.data[0].push(snapshot.time);
      chart.series.forEach(([, field, scale], i) => {
        const value = snapshot.totals[field];
        chart.data[i + 1].push(value === null || value === undefined ? null : value * scale);
      });
      if (chart.data[0].length > HISTORY) chart.data.forEach((column) => column.shift());
      chart.plot.setData(chart.data);
    }
  }

  function render(snapshot) {
    renderHeadline(snapshot.totals);
    renderTables(snapshot);
    pushCharts(snapshot);
    root.dataset.updated = String(snapshot.time);
  }

  // ---- the WebSocket ------------------------------------------------------------------
  const status = document.getElementById("connection");
  let retryMs = RETRY_FIRST_MS;

  function setStatus(text, state) {
    status.textContent = text;
    status.dataset.state = state;
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const socket = new WebSocket(scheme + location.host + root.dataset.wsPath);
    socket.onopen = () => { retryMs = RETRY_FIRST_MS; setStatus("live", "open"); };
    socket.onmessage = (event) => render(JSON.parse(event.data));
    socket.onclose = (event) => {
      if (event.code === UNAUTHENTICATED) {
        location.assign(`${root.dataset.loginUrl}?next=${encodeURIComponent(location.pathname)}`);
        return;
      }
      setStatus(`reconnecting in ${(retryMs / 1000).toFixed(1)} s…`, "closed");
      setTimeout(connect, retryMs);
      retryMs = Math.min(2 * retryMs, RETRY_MAX_MS);
    };
  }

  makeCharts();
  render(JSON.parse(document.getElementById("initial-snapshot").textContent));
  connect();
})();
