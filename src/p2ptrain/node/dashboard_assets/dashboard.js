// The node's live dashboard: fetches /api/snapshot once, then follows the server-sent
// `snapshot` events on /api/events and re-renders every panel from each snapshot.
// Text from the node is only ever set with textContent (never innerHTML), since peer ids,
// reasons and messages can come from untrusted peers.
"use strict";

(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const ROLES = ["seed", "reducer", "validator", "trainer", "viewer", "evaluator"];
  const PHASES = ["wait", "train", "publish", "fetch", "reduce", "attest", "certify"];
  const CHAIN_HEADS = 20;
  const TIMELINE_WINDOWS = 30;
  const BYTES_WINDOWS = 40;

  // ---------------------------------------------------------------- small helpers

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    setAttributes(node, attrs);
    appendAll(node, children);
    return node;
  }

  function svg(tag, attrs, children) {
    const node = document.createElementNS(SVG_NS, tag);
    setAttributes(node, attrs);
    appendAll(node, children);
    return node;
  }

  function setAttributes(node, attrs) {
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "text") node.textContent = String(value);
      else if (key === "class") node.setAttribute("class", value);
      else node.setAttribute(key, String(value));
    }
  }

  function appendAll(node, children) {
    for (const child of children || []) {
      if (child === null || child === undefined || child === false) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
  }

  const list = (x) => (Array.isArray(x) ? x : []);
  const isNum = (x) => typeof x === "number" && Number.isFinite(x);
  const int = (x) => (isNum(x) ? x : 0);
  const shortId = (id) => (typeof id === "string" && id ? id.slice(0, 12) : "–");

  function primaryRole(roles) {
    const first = list(roles)[0];
    return ROLES.includes(first) ? first : "other";
  }

  function formatBytes(n) {
    if (!isNum(n)) return "–";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let value = n;
    let unit = 0;
    while (Math.abs(value) >= 1000 && unit < units.length - 1) {
      value /= 1000;
      unit += 1;
    }
    return (unit === 0 ? String(Math.round(value)) : value.toPrecision(3)) + " " + units[unit];
  }

  function formatSeconds(s) {
    if (!isNum(s)) return "–";
    return s >= 100 ? s.toFixed(0) + " s" : s.toPrecision(2) + " s";
  }

  function formatLoss(x) {
    return isNum(x) ? x.toPrecision(4) : "–";
  }

  function formatTime(unixSeconds) {
    if (!isNum(unixSeconds)) return "–";
    return new Date(unixSeconds * 1000).toLocaleTimeString();
  }

  function mean(values) {
    const finite = values.filter(isNum);
    return finite.length ? finite.reduce((a, b) => a + b, 0) / finite.length : null;
  }

  // Round tick values covering [lo, hi], about `count` of them.
  function niceTicks(lo, hi, count) {
    const span = hi - lo;
    if (!(span > 0)) return [lo];
    const raw = span / count;
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || 10 * power;
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
      ticks.push(Math.abs(t) < step * 1e-9 ? 0 : t);
    }
    return ticks;
  }

  // A linear map from [d0, d1] onto [r0, r1]; a degenerate domain maps to the middle.
  function scale(d0, d1, r0, r1) {
    if (d1 === d0) return () => (r0 + r1) / 2;
    return (v) => r0 + ((v - d0) / (d1 - d0)) * (r1 - r0);
  }

  function paddedRange(values) {
    let lo = Math.min(...values);
    let hi = Math.max(...values);
    if (lo === hi) {
      const pad = Math.abs(lo) * 0.1 || 1;
      return [lo - pad, hi + pad];
    }
    const pad = (hi - lo) * 0.08;
    return [lo - pad, hi + pad];
  }

  function emptyChart(root, width, height, text) {
    root.append(svg("text", { x: width / 2, y: height / 2, class: "empty", "text-anchor": "middle", text }));
  }

  // ---------------------------------------------------------------- header

  function renderHeader(status) {
    const nodeId = document.getElementById("node-id");
    nodeId.textContent = shortId(status.peer_id);
    nodeId.title = status.peer_id || "";
    const roles = document.getElementById("node-roles");
    roles.replaceChildren(
      ...list(status.roles).map((r) => el("span", { class: "role-tag role-" + primaryRole([r]), text: r }))
    );
    const experiment = document.getElementById("experiment");
    experiment.textContent = shortId(status.experiment_id);
    experiment.title = status.experiment_id || "";
    document.getElementById("height").textContent = String(int(status.height));
    const head = document.getElementById("head");
    const fetching = status.adopted_head_id && status.head_id && status.adopted_head_id !== status.head_id;
    head.textContent = "head " + shortId(status.head_id) + (fetching ? " (building on " + shortId(status.adopted_head_id) + ", fetching weights)" : "");
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    renderErrors(status);
  }

  function renderErrors(status) {
    const box = document.getElementById("node-errors");
    const lines = [];
    if (status.failed) lines.push(el("p", { class: "failed", text: "failed: " + status.failed }));
    if (status.storage && status.storage.message) {
      lines.push(el("p", { class: "storage", text: "storage: " + status.storage.message + " (" + (status.storage.path || "") + ")" }));
    }
    for (const e of list(status.errors).slice(-5).reverse()) {
      const text = (e.role || "?") + ", window " + e.window + ", " + (e.step || "?") + ": " + (e.error || "") + ": " + (e.message || "");
      lines.push(el("p", { class: "role-error", text: text + " (" + formatTime(e.at) + ")" }));
    }
    box.replaceChildren(...lines);
    box.hidden = lines.length === 0;
  }

  function setLive(state) {
    const badge = document.getElementById("live");
    const text = { live: "live", reconnecting: "reconnecting…", connecting: "connecting…" }[state];
    badge.className = "badge " + state;
    badge.textContent = text;
  }

  // ---------------------------------------------------------------- peer graph

  function renderPeerGraph(status, peers) {
    const root = document.getElementById("peer-graph");
    const width = 480, height = 340, cx = width / 2, cy = height / 2;
    const sorted = list(peers).filter((p) => p && p.peer_id !== status.peer_id).sort((a, b) => String(a.peer_id).localeCompare(String(b.peer_id)));
    // Few peers: labels beside the dots (a 12-character label fits at either side of radius
    // 115). Many: a smaller circle with labels pointing outwards, so that they never overlap.
    const dense = sorted.length > 12;
    const radius = dense ? 84 : 115;
    const dot = Math.max(4, Math.min(10, 240 / Math.max(1, sorted.length)));
    root.classList.toggle("dense", dense);
    const edges = svg("g", { class: "edges" });
    const nodes = svg("g", { class: "nodes" });
    sorted.forEach((peer, i) => {
      const angle = -Math.PI / 2 + (2 * Math.PI * i) / sorted.length;
      const x = cx + radius * Math.cos(angle);
      const y = cy + radius * Math.sin(angle);
      if (peer.connected) edges.append(svg("line", { class: "edge", x1: cx, y1: cy, x2: x, y2: y, "data-peer-id": peer.peer_id }));
      nodes.append(peerNode(peer, x, y, angle, dot, dense));
    });
    const self = svg("g", { class: "node self role-" + primaryRole(status.roles), "data-peer-id": status.peer_id || "" }, [
      svg("title", { text: (status.peer_id || "") + " (this node): " + list(status.roles).join(", ") }),
      svg("circle", { cx, cy, r: 18 }),
      svg("text", { x: cx, y: cy + 34, "text-anchor": "middle", class: "label self-label", text: dense ? "this node" : shortId(status.peer_id) + " (this node)" }),
    ]);
    nodes.append(self);
    root.replaceChildren(edges, nodes);
    if (!sorted.length) emptyChart(root, width, 40, "no peers known yet");
  }

  function peerNode(peer, x, y, angle, dot, dense) {
    const classes = ["node", "peer", "role-" + primaryRole(peer.roles)];
    if (peer.connected) classes.push("connected");
    if (peer.banned) classes.push("banned");
    if (peer.revoked) classes.push("revoked");
    const describe = [peer.peer_id, list(peer.roles).join(", ") || "roles unknown", peer.connected ? "connected" : "not connected"];
    if (peer.revoked) describe.push("admission revoked by an issuer");
    else if (peer.banned) describe.push("banned");
    if (peer.subject) describe.push("certified: " + peer.subject);
    if (peer.address) describe.push(peer.address);
    const parts = [svg("title", { text: describe.join(" · ") }), svg("circle", { cx: x, cy: y, r: dot })];
    if (peer.banned) {
      const d = dot - 1;
      parts.push(svg("line", { class: "ban-cross", x1: x - d, y1: y - d, x2: x + d, y2: y + d }));
      parts.push(svg("line", { class: "ban-cross", x1: x - d, y1: y + d, x2: x + d, y2: y - d }));
    }
    const label = shortId(peer.peer_id) + (peer.revoked ? " (revoked)" : "");
    parts.push(peerLabel(label, x, y, angle, dot, dense));
    return svg("g", { class: classes.join(" "), "data-peer-id": peer.peer_id }, parts);
  }

  function peerLabel(text, x, y, angle, dot, dense) {
    const cos = Math.cos(angle);
    const lx = x + (dot + 4) * cos;
    const ly = y + (dot + 4) * Math.sin(angle);
    if (dense) {
      const degrees = (angle * 180) / Math.PI + (cos < 0 ? 180 : 0);
      return svg("text", {
        x: lx, y: ly + 3, class: "label", text,
        "text-anchor": cos < 0 ? "end" : "start",
        transform: "rotate(" + degrees.toFixed(2) + " " + lx.toFixed(2) + " " + ly.toFixed(2) + ")",
      });
    }
    const anchor = Math.abs(cos) < 0.3 ? "middle" : cos > 0 ? "start" : "end";
    const below = Math.sin(angle) > 0.9 ? 8 : 0;
    return svg("text", { x: lx, y: ly + 4 + below, "text-anchor": anchor, class: "label", text });
  }

  function renderLegends() {
    const roles = document.getElementById("role-legend");
    roles.replaceChildren(
      ...ROLES.map((r) => el("li", {}, [el("span", { class: "swatch dot role-" + r }), r])),
      el("li", {}, [el("span", { class: "swatch dot role-other" }), "other"]),
      el("li", {}, [el("span", { class: "swatch dot banned-swatch" }), "banned"]),
      el("li", {}, [el("span", { class: "swatch dot revoked-swatch" }), "revoked"]),
      el("li", {}, [el("span", { class: "swatch line edge-swatch" }), "connected"])
    );
    const phases = document.getElementById("phase-legend");
    phases.replaceChildren(...PHASES.map((p) => el("li", {}, [el("span", { class: "swatch phase-" + p }), p])));
  }

  // ---------------------------------------------------------------- certified chain

  function renderChain(windows) {
    const body = document.getElementById("chain-body");
    const rows = windows.slice(-CHAIN_HEADS).reverse().map((w) => {
      const accepted = list(w.updates).filter((u) => u.outcome === "accepted").length;
      const signers = list(w.signers).map((id) => el("span", { class: "signer", title: id, text: shortId(id) }));
      return el("tr", { class: "head", "data-height": w.height, "data-head-id": w.head_id }, [
        el("td", { text: String(w.height) }),
        el("td", { class: "mono", title: w.head_id || "", text: shortId(w.head_id) }),
        el("td", { class: "accepted-count", text: String(accepted) }),
        el("td", { class: "mono signers" }, signers.length ? signers : ["–"]),
        el("td", { text: formatSeconds(w.seconds) }),
        el("td", { class: "col-time", text: formatTime(w.certified_at) }),
      ]);
    });
    if (!rows.length) rows.push(el("tr", {}, [el("td", { colspan: 6, class: "empty", text: "no certified heads yet" })]));
    body.replaceChildren(...rows);
  }

  // ---------------------------------------------------------------- window timeline

  function renderTimeline(windows) {
    const root = document.getElementById("timeline");
    const shown = windows.slice(-TIMELINE_WINDOWS).reverse();
    const longest = Math.max(0, ...shown.map(phaseTotal));
    const items = shown.map((w) => windowEntry(w, longest));
    if (!items.length) items.push(el("p", { class: "empty", text: "no windows yet" }));
    root.replaceChildren(...items);
  }

  function phaseTotal(w) {
    return PHASES.reduce((sum, p) => sum + (isNum((w.phases || {})[p]) ? w.phases[p] : 0), 0);
  }

  function windowEntry(w, longest) {
    const updates = list(w.updates);
    const count = (o) => updates.filter((u) => u.outcome === o).length;
    const heading = el("h3", {}, [
      "window " + w.height + " ",
      el("span", { class: "mono muted", title: w.head_id || "", text: "head " + shortId(w.head_id) }),
      " · " + formatSeconds(w.seconds) + " · " + count("accepted") + " accepted, " + count("rejected") + " rejected, " + Math.max(count("left out"), int(w.left_out)) + " left out",
    ]);
    const trainers = updates.map((u) => shortId(u.trainer) + " (" + formatLoss(u.loss_after) + ")");
    const parts = [
      heading,
      w.reason ? el("p", { class: "reason", text: "adopted: " + w.reason }) : null,
      el("p", { class: "trained-by", text: "trained by: " + (trainers.join(", ") || "nobody") }),
      phaseBar(w, longest),
      updates.length ? el("ul", { class: "updates" }, updates.map(updateItem)) : null,
      list(w.quarantine).length ? el("ul", { class: "quarantine-list" }, list(w.quarantine).map((q) => quarantineItem(q, w.height))) : null,
      isNum(w.validation_loss) ? el("p", { class: "validation", text: "validation loss " + formatLoss(w.validation_loss) + " (" + int(w.validation_reports) + " reports)" }) : null,
    ];
    return el("article", { class: "window", "data-height": w.height }, parts);
  }

  function updateItem(u) {
    const outcome = ["accepted", "rejected", "left out"].includes(u.outcome) ? u.outcome : "other";
    const cls = "update " + outcome.replace(" ", "-");
    const loss = "loss " + formatLoss(u.loss_before) + " → " + formatLoss(u.loss_after);
    const verdict = outcome + (u.reason ? ": " + u.reason : "");
    return el("li", { class: cls, "data-update-id": u.update_id, "data-trainer": u.trainer }, [
      el("span", { class: "mono", title: u.trainer || "", text: shortId(u.trainer) }),
      " " + loss + " — ",
      el("span", { class: "verdict", text: verdict }),
    ]);
  }

  // An entry that keeps the peer out of later windows is a quarantine; one that does not
  // only counts strikes against it.
  function quarantineItem(q, height) {
    const excluded = int(q.until_window) > int(height);
    const strikes = int(q.strikes);
    return el("li", { class: "quarantine" + (excluded ? " excluded" : " strike"), "data-peer": q.peer }, [
      excluded ? "quarantined " : "strike " + strikes + " against ",
      el("span", { class: "mono", title: q.peer || "", text: shortId(q.peer) }),
      (excluded ? " until window " + q.until_window : "") + ": " + (q.reason || ""),
    ]);
  }

  function phaseBar(w, longest) {
    const phases = w.phases || {};
    const seen = PHASES.filter((p) => isNum(phases[p]) && phases[p] >= 0);
    if (!seen.length) return null;
    const bar = svg("svg", { class: "phase-bar", viewBox: "0 0 100 6", preserveAspectRatio: "none" });
    let x = 0;
    for (const p of seen) {
      const width = longest > 0 ? (phases[p] / longest) * 100 : 0;
      bar.append(svg("rect", { class: "phase phase-" + p, x, y: 0, width, height: 6, "data-phase": p, "data-seconds": String(phases[p]) }, [
        svg("title", { text: p + " " + formatSeconds(phases[p]) }),
      ]));
      x += width;
    }
    const numbers = seen.map((p) => p + " " + formatSeconds(phases[p])).join(" · ");
    return el("div", { class: "phases" }, [bar, el("p", { class: "phase-numbers", text: numbers })]);
  }

  // ---------------------------------------------------------------- loss chart

  function lossSeries(windows) {
    const val = [];
    const train = [];
    for (const w of windows) {
      if (isNum(w.validation_loss)) val.push({ height: w.height, loss: w.validation_loss });
      const accepted = list(w.updates).filter((u) => u.outcome === "accepted").map((u) => u.loss_after);
      const m = mean(accepted);
      if (m !== null) train.push({ height: w.height, loss: m });
    }
    return { val, train };
  }

  function renderLossChart(windows) {
    const root = document.getElementById("loss-chart");
    const W = 600, H = 260, m = { left: 52, right: 12, top: 12, bottom: 40 };
    root.replaceChildren();
    const { val, train } = lossSeries(windows);
    const all = val.concat(train);
    if (!all.length) return emptyChart(root, W, H, "no reports yet");
    const [x0, x1] = paddedRange(all.map((p) => p.height));
    const [y0, y1] = paddedRange(all.map((p) => p.loss));
    const x = scale(x0, x1, m.left, W - m.right);
    const y = scale(y0, y1, H - m.bottom, m.top);
    drawAxes(root, { W, H, m, x, y, xTicks: niceTicks(x0, x1, 6).filter(Number.isInteger), yTicks: niceTicks(y0, y1, 5), yFormat: (v) => String(Number(v.toPrecision(4))) });
    for (const [name, points] of [["train", train], ["val", val]]) {
      if (points.length > 1) {
        root.append(svg("polyline", { class: "series " + name, points: points.map((p) => x(p.height) + "," + y(p.loss)).join(" ") }));
      }
      for (const p of points) {
        root.append(svg("circle", { class: "point " + name, cx: x(p.height), cy: y(p.loss), r: 3, "data-height": String(p.height), "data-loss": String(p.loss) }, [
          svg("title", { text: (name === "val" ? "validation" : "train") + " loss at height " + p.height + ": " + p.loss }),
        ]));
      }
    }
  }

  function drawAxes(root, { W, H, m, x, y, xTicks, yTicks, yFormat }) {
    const axes = svg("g", { class: "axes" });
    axes.append(svg("line", { class: "axis", x1: m.left, y1: H - m.bottom, x2: W - m.right, y2: H - m.bottom }));
    axes.append(svg("line", { class: "axis", x1: m.left, y1: m.top, x2: m.left, y2: H - m.bottom }));
    for (const t of yTicks) {
      axes.append(svg("line", { class: "gridline", x1: m.left, y1: y(t), x2: W - m.right, y2: y(t) }));
      axes.append(svg("text", { class: "tick", x: m.left - 6, y: y(t) + 4, "text-anchor": "end", text: yFormat(t) }));
    }
    for (const t of xTicks) {
      axes.append(svg("text", { class: "tick", x: x(t), y: H - m.bottom + 16, "text-anchor": "middle", text: String(t) }));
    }
    axes.append(svg("text", { class: "axis-label", x: W - m.right, y: H - 2, "text-anchor": "end", text: "height" }));
    root.append(axes);
  }

  // ---------------------------------------------------------------- bytes chart

  function renderBytesChart(windows) {
    const root = document.getElementById("bytes-chart");
    const W = 600, H = 260, m = { left: 74, right: 12, top: 12, bottom: 40 };
    root.replaceChildren();
    const shown = windows.slice(-BYTES_WINDOWS);
    if (!shown.length) return emptyChart(root, W, H, "no windows yet");
    const most = Math.max(1, ...shown.map((w) => Math.max(int(w.bytes_sent), int(w.bytes_received))));
    const y = scale(0, most * 1.05, H - m.bottom, m.top);
    const slot = (W - m.left - m.right) / shown.length;
    const bar = Math.max(1, slot * 0.4);
    const xOf = (i) => m.left + i * slot + slot / 2;
    const labelEvery = Math.ceil(shown.length / 8);
    const xTicks = shown.map((w, i) => i).filter((i) => i % labelEvery === 0);
    const yTicks = niceTicks(0, most * 1.05, 4).filter(Number.isInteger);
    drawAxes(root, {
      W, H, m, y,
      x: (i) => xOf(i),
      xTicks: [],
      yTicks,
      yFormat: formatBytes,
    });
    const labels = svg("g", { class: "axes" });
    for (const i of xTicks) {
      labels.append(svg("text", { class: "tick", x: xOf(i), y: H - m.bottom + 16, "text-anchor": "middle", text: String(shown[i].height) }));
    }
    root.append(labels);
    shown.forEach((w, i) => {
      for (const [name, value, dx] of [["sent", int(w.bytes_sent), -bar], ["received", int(w.bytes_received), 0]]) {
        const top = y(value);
        root.append(svg("rect", { class: "bar " + name, x: xOf(i) + dx, y: top, width: bar, height: H - m.bottom - top, "data-height": String(w.height), "data-bytes": String(value) }, [
          svg("title", { text: "window " + w.height + ": " + name + " " + formatBytes(value) }),
        ]));
      }
    });
  }

  // ---------------------------------------------------------------- facts panel

  function renderFacts(status, windows) {
    const conn = status.connections || {};
    const trainer = status.trainer;
    const lastVal = lastValidation(status, windows);
    const rows = [
      ["peers", int(status.peers) + " known · " + int(status.banned) + " banned" +
        (list(status.revoked).length ? " · " + list(status.revoked).length + " revoked" : "")],
      ["connections", int(conn.outbound) + " outbound · " + int(conn.inbound) + " inbound"],
      ["traffic", formatBytes(int(status.bytes_sent)) + " sent · " + formatBytes(int(status.bytes_received)) + " received"],
      ["store", int(status.store_blobs) + " blobs · " + formatBytes(int(status.store_bytes))],
      ["compute utilisation", trainer && isNum(trainer.compute_utilisation) ? (trainer.compute_utilisation * 100).toFixed(0) + " %" : "–"],
      ["last trained", trainer ? "window " + trainer.window + ": loss " + formatLoss(trainer.loss_before) + " → " + formatLoss(trainer.loss_after) + " in " + formatSeconds(trainer.seconds) + ", " + formatBytes(trainer.blob_bytes) : "–"],
      ["validation loss", lastVal],
      ["open window", status.open_window ? "window " + status.open_window.window + (status.open_window.reason ? ": " + status.open_window.reason : "") : "–"],
      ["last window", status.last_window ? "height " + status.last_window.height + ": " + status.last_window.reason : "–"],
    ];
    for (const r of list(status.role_states)) {
      const failures = int(r.failures_in_a_row) > 0 ? " (" + r.failures_in_a_row + " failures in a row)" : "";
      rows.push(["role " + r.role, (r.last_reason || "–") + failures]);
    }
    const dl = document.getElementById("facts");
    dl.replaceChildren(...rows.flatMap(([name, value]) => [
      el("dt", { text: name }),
      el("dd", { "data-fact": name, text: value }),
    ]));
    const reports = list(status.reports).slice(-10).reverse().map((r) =>
      el("li", { class: "report", "data-peer": r.peer }, [
        el("span", { class: "mono", title: r.peer || "", text: shortId(r.peer) }),
        ": " + (r.reason || ""),
      ]));
    if (!reports.length) reports.push(el("li", { class: "empty", text: "none" }));
    document.getElementById("reports").replaceChildren(...reports);
  }

  function lastValidation(status, windows) {
    const v = status.validation;
    if (v && isNum(v.median_loss)) return formatLoss(v.median_loss) + " at height " + v.height + " (" + int(v.reports) + " reports)";
    const last = windows.slice().reverse().find((w) => isNum(w.validation_loss));
    return last ? formatLoss(last.validation_loss) + " at height " + last.height : "no reports yet";
  }

  // ---------------------------------------------------------------- entry points

  function render(snapshot) {
    const status = (snapshot && snapshot.status) || {};
    const peers = list(snapshot && snapshot.peers);
    const windows = list(snapshot && snapshot.windows).filter((w) => w && isNum(w.height));
    const panels = [
      () => renderHeader(status),
      () => renderPeerGraph(status, peers),
      () => renderFacts(status, windows),
      () => renderChain(windows),
      () => renderTimeline(windows),
      () => renderLossChart(windows),
      () => renderBytesChart(windows),
    ];
    for (const panel of panels) {
      try {
        panel();
      } catch (err) {
        console.error("dashboard panel failed", err);
      }
    }
  }

  function follow() {
    const events = new EventSource("/api/events");
    events.addEventListener("open", () => setLive("live"));
    events.addEventListener("error", () => setLive("reconnecting"));
    events.addEventListener("snapshot", (event) => {
      setLive("live");
      try {
        render(JSON.parse(event.data));
      } catch (err) {
        console.error("bad snapshot event", err);
      }
    });
  }

  async function start() {
    renderLegends();
    try {
      const response = await fetch("/api/snapshot", { cache: "no-store" });
      if (!response.ok) throw new Error("HTTP " + response.status);
      render(await response.json());
    } catch (err) {
      setLive("reconnecting");
      console.warn("first snapshot failed; waiting for events", err);
    }
    follow();
  }

  window.p2ptrainDashboard = { render };
  start();
})();
