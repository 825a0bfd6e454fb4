// rollout-svc's dashboard: polls dashboard/data every second and draws the fleet (rollout_svc/api/dashboard.py).
// Every value from the server goes into the page as text, never as markup.
"use strict";
(function () {
  const POLL_MS = 1000;
  const COLOURS = ["#0969da", "#1a7f37", "#9a6700", "#cf222e", "#8250df", "#bf3989", "#1b7c83", "#57606a"];
  const state = { charts: {}, last: null, timelineWorkers: "" };
  window.rolloutDashboard = state;

  function cell(row, text, cls) {
    const td = row.insertCell();
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }

  function fill(tableId, rows) {
    const body = document.querySelector(`#${tableId} tbody`);
    body.replaceChildren();
    for (const values of rows) {
      const row = body.insertRow();
      for (const [text, cls] of values) cell(row, text, cls);
    }
  }

  function fmt(n, digits) {
    return n === null || n === undefined ? "-" : Number(n).toLocaleString(undefined, { maximumFractionDigits: digits || 0 });
  }

  // how long a holder's pause lasts: its lease, or until it resumes
  function leaseText(report, holder, now) {
    const lease = report.pause_leases[holder];
    return lease ? `lease lapses in ${Math.max(0, lease - now).toFixed(0)} s` : "held until resumed";
  }

  function fleetLine(report, now) {
    if (report.paused) {
      const holders = Object.entries(report.pause_holders).map(
        ([holder, mode]) => `${holder} (${mode}, ${leaseText(report, holder, now)})`);
      return [`paused (${report.pause_mode}) by ${holders.join(", ")}`, "paused"];
    }
    return [report.sleep_level ? "asleep" : "serving", ""];
  }

  function drawFleet(data) {
    const report = data.report, now = data.now;
    const [line, cls] = fleetLine(report, now);
    const fleet = document.getElementById("fleet");
    fleet.textContent = `fleet: ${line}; control epoch ${report.epoch}; weight version ${report.weight_version}` +
      (report.weight_checkpoint ? ` (from ${report.weight_checkpoint})` : "");
    fleet.className = `fleet ${cls}`;
    document.getElementById("updated").textContent =
      `${report.workers.length} workers; updated ${new Date(now * 1000).toLocaleTimeString()}`;
    fill("workers", report.workers.map((w) => {
      const load = report.loads[w.worker_id] || 0;
      const kv = w.kv_cache_tokens ? `${(100 * load / w.kv_cache_tokens).toFixed(1)} %` : "-";
      return [
        [w.worker_id, "worker-id"], [w.state, `state-${w.state}`], [w.engine], [String(w.weight_version), "num"],
        [`${w.in_flight} / ${w.capacity}`, "num"], [fmt(load), "num"], [kv, "num"], [w.adapters || "-"],
        [fmt(w.served), "num"], [`${Math.max(0, now - w.heartbeat_at).toFixed(1)} s`, "num"],
      ];
    }));
    fill("queues", Object.entries(report.streams).map(([name, d]) => [
      [name], [fmt(d.length), "num"], [fmt(d.queued), "num"], [fmt(d.pending), "num"],
    ]));
    document.getElementById("dead-letters").textContent =
      `dead letters: ${report.dead_letters}; named steps: ${report.steps.live} live, ${report.steps.expired} expired`;
  }

  function drawControl(data) {
    const report = data.report, control = document.getElementById("control");
    control.replaceChildren();
    const add = (text, cls) => {
      const p = document.createElement("p");
      p.textContent = text;
      if (cls) p.className = cls;
      control.appendChild(p);
    };
    const holders = Object.entries(report.pause_holders);
    if (!holders.length) add("no pause held");
    for (const [holder, mode] of holders) {
      add(`pause held by ${holder}: ${mode}, ${leaseText(report, holder, data.now)}`, "holder");
    }
    for (const [holder, when] of Object.entries(report.lapsed_pauses)) {
      add(`the pause of ${holder} lapsed at ${new Date(when * 1000).toLocaleTimeString()}: ` +
        "its holder stopped renewing its lease", "error");
    }
    const sync = document.getElementById("sync");
    sync.replaceChildren();
    const s = data.sync;
    const p = document.createElement("p");
    if (!s) {
      p.textContent = "no weight sync yet";
    } else {
      const done = report.weight_version >= s.version;
      const phases = Object.entries(s.phases).filter(([, reached]) => Object.keys(reached).length || !done)
        .map(([phase, reached]) => {
          const failed = Object.entries(reached).filter(([, v]) => v !== "ok").map(([w, v]) => `${w}: ${v}`);
          return `${phase} ${Object.keys(reached).length - failed.length}/${s.members.length}` +
            (failed.length ? ` (failed: ${failed.join("; ")})` : "");
        });
      p.textContent = `${done ? "last" : "current"} sync ${s.sync_id}: version ${s.version} by ${s.transport}` +
        `${s.staged ? " (staged)" : ""}, ${s.members.length} members, issued ` +
        `${new Date(s.issued_at * 1000).toLocaleTimeString()}; ${done ? "committed" : "in progress"}` +
        (phases.length ? `; ${phases.join(", ")}` : "");
    }
    sync.appendChild(p);
  }

  function chart(id, series, data) {
    const el = document.getElementById(id);
    const width = Math.max(300, el.clientWidth - 2);
    const opts = {
      width, height: 220, legend: { live: false },
      scales: { x: { time: true } },
      series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: COLOURS[i % COLOURS.length], width: 1.5,
        scale: s.scale || "y", spanGaps: false }))],
      axes: [{}, { scale: "y" }].concat(series.some((s) => s.scale === "y2") ? [{ scale: "y2", side: 1 }] : []),
    };
    el.replaceChildren();
    return new uPlot(opts, data, el);
  }

  function update(name, id, series, data) {
    const existing = state.charts[name];
    if (existing && existing.series.length === series.length + 1) existing.setData(data);
    else state.charts[name] = chart(id, series, data);
  }

  function drawCharts(history) {
    const t = history.t;
    update("throughput", "chart-throughput",
      [{ label: "requests/s" }, { label: "tokens/s", scale: "y2" }],
      [t, history.requests_per_s, history.tokens_per_s]);
    update("latency", "chart-latency",
      [{ label: "time to first token (ms, streamed)" }, { label: "time per output token (ms)", scale: "y2" }],
      [t, history.ttft_ms, history.tpot_ms]);
    update("queue", "chart-queue", [{ label: "queued" }, { label: "pending" }], [t, history.queued, history.pending]);
    const workers = Object.keys(history.in_flight).sort();
    if (workers.join(",") !== state.timelineWorkers) {
      delete state.charts.timeline;  // the workers changed: drawn again with theirs
      state.timelineWorkers = workers.join(",");
    }
    update("timeline", "chart-timeline", workers.map((w) => ({ label: w })),
      [t, ...workers.map((w) => history.in_flight[w])]);
  }

  async function poll() {
    try {
      const response = await fetch("dashboard/data", { credentials: "same-origin", cache: "no-store" });
      if (response.status === 401 || response.status === 403) {
        window.location.reload();  // signed out (a new admin token): the sign-in page
        return;
      }
      const data = await response.json();
      if (!response.ok) throw new Error(data.error ? data.error.message : response.statusText);
      state.last = data;
      drawFleet(data);
      drawControl(data);
      drawCharts(data.history);
    } catch (error) {
      const fleet = document.getElementById("fleet");
      fleet.textContent = `cannot read the fleet: ${error.message}; retrying`;
      fleet.className = "fleet error";
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  poll();
})();
