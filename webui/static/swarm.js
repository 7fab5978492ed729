// The live view of the swarm: Call wall, topology, throughput chart, usage and event log.
// Fed by /api/events (SSE over fetch); /api/status gives the first picture and stands in
// whenever the feed is quiet (no tracker PUB reachable, or the stream is reconnecting).
import {$, clock, coalesce, el, fill, int, layers, num, seconds, shortId, svg} from "./ui.js";
import {apiFetch, apiKey, errorMessage, keyId, readEvents} from "./net.js";

const POLL_MS = 3000; // status poll period while the feed is quiet
const QUIET_MS = 6000; // the feed counts as quiet after this long without a stats message
const CHART_WINDOW_S = 300;
const MAX_LOG = 40;
const SERIES = 6; // --series-1 .. --series-6 in dashboard.css

const state = {
  tracker: {}, nodes: [], plans: {}, gaps: {}, stats: {}, usage: {}, accounting: null, speculation: {},
  active: new Map(), recent: [], throughput: [], events: new Map(),
  routable: null, mine: new Set(), myKeyId: null, lastStats: 0, feedOpen: false, statusError: null,
  onPlans: () => {},
};

const dirty = new Set();
const render = coalesce(renderDirty);

function mark(...parts) {
  for (const part of parts) dirty.add(part);
  render();
}

export function initSwarm({onPlans} = {}) {
  state.onPlans = onPlans || state.onPlans;
  keyId(apiKey()).then((id) => { state.myKeyId = id; mark("usage"); });
  window.addEventListener("resize", () => mark("chart"));
  loadStatus();
  connectFeed();
  setInterval(() => { if (Date.now() - state.lastStats > QUIET_MS) loadStatus(); }, POLL_MS);
  setInterval(() => mark("feed"), 1000);
}

/** A request this page sent: its Call wall row is marked "you". */
export function markMine(requestId) {
  state.mine.add(requestId);
  mark("calls");
}

// ------------------------------------------------------------------ data in

async function loadStatus() {
  try {
    const response = await apiFetch("/api/status");
    if (!response.ok) throw new Error(await errorMessage(response));
    applyStatus(await response.json());
    state.statusError = null;
  } catch (error) {
    state.statusError = error.message;
  }
  mark("feed");
}

function applyStatus(body) {
  Object.assign(state, {tracker: body.tracker || state.tracker, accounting: body.webui?.accounting});
  applyPlans(body);
  applyStats({nodes: body.nodes, stats: body.stats, usage: body.usage, fetches: body.fetches,
              speculation: body.speculation});
  applyCalls(body.calls);
  state.throughput = body.throughput || state.throughput;
  for (const event of body.events || []) addEvent(event);
  mark("chart", "log");
}

function applyPlans(body) {
  state.plans = body.plans || {};
  state.gaps = body.gaps || {};
  state.differ = body.weights_differ || {};
  const routable = Object.keys(state.plans).filter((m) => state.plans[m].length).sort().join("\n");
  if (routable !== state.routable) {
    state.routable = routable;
    state.onPlans(); // the set of models that can serve changed: the chat's picker follows
  }
  mark("topology");
}

function applyStats(body) {
  if (body.nodes) state.nodes = body.nodes;
  if (body.fetches) state.fetches = body.fetches;
  if (body.stats) state.stats = body.stats;
  if (body.usage) state.usage = body.usage;
  if (body.speculation) state.speculation = body.speculation;
  mark("topology", "usage");
}

function applyCalls(calls) {
  if (!calls) return;
  state.active = new Map(calls.active.map((row) => [row.key, row]));
  state.recent = calls.recent;
  mark("calls");
}

function applyCall(row) {
  if (row.state === "running") {
    state.active.set(row.key, row);
  } else {
    state.active.delete(row.key);
    state.recent = [row, ...state.recent.filter((r) => r.key !== row.key)].slice(0, 30);
  }
  mark("calls");
}

function addEvent(event) {
  state.events.set(event.id, event);
  if (state.events.size > MAX_LOG * 2) {
    const oldest = [...state.events.values()].sort((a, b) => a.seq - b.seq).slice(0, state.events.size - MAX_LOG);
    for (const old of oldest) state.events.delete(old.id);
  }
  mark("log");
}

const HANDLERS = {
  hello(data) {
    if (data.feed?.live) state.lastStats = Date.now();
    if (data.plans) applyPlans(data.plans);
    if (data.stats) applyStats(data.stats);
    applyCalls(data.calls);
    state.throughput = data.throughput;
    for (const event of data.events) addEvent(event);
    mark("chart");
  },
  plans: applyPlans,
  stats(data) {
    state.lastStats = Date.now();
    applyStats(data);
  },
  event: addEvent,
  call: applyCall,
  accounting(data) {
    state.accounting = data;
    mark("usage");
  },
  throughput(point) {
    state.throughput.push(point);
    state.throughput = state.throughput.filter((p) => p.ts > point.ts - CHART_WINDOW_S);
    mark("chart");
  },
};

/** Keep /api/events open, reconnecting with backoff; the status poll covers the gaps. */
async function connectFeed() {
  let backoff = 1000;
  for (;;) {
    try {
      const response = await apiFetch("/api/events", {headers: {Accept: "text/event-stream"}});
      if (!response.ok) throw new Error(await errorMessage(response));
      state.feedOpen = true;
      backoff = 1000;
      mark("feed");
      for await (const {event, data} of readEvents(response)) HANDLERS[event]?.(JSON.parse(data));
    } catch (error) {
      console.debug("live feed:", error.message);
    }
    state.feedOpen = false;
    mark("feed");
    await new Promise((resolve) => setTimeout(resolve, backoff));
    backoff = Math.min(backoff * 2, 15000);
  }
}

// ------------------------------------------------------------------ rendering

const RENDERERS = {
  feed: renderFeedState, calls: renderCalls, topology: renderTopology, chart: renderChart,
  usage: renderUsage, log: renderLog,
};

function renderDirty() {
  const parts = [...dirty];
  dirty.clear();
  for (const part of parts) RENDERERS[part]();
}

function renderFeedState() {
  const live = Date.now() - state.lastStats < QUIET_MS;
  const [kind, text] = state.statusError ? ["bad", "tracker unreachable"]
    : live ? ["ok", "live"] : ["warn", "polling"];
  $("feed-state").title = state.statusError || (live ? "live feed from the tracker"
    : state.feedOpen ? "connected, but the tracker's feed is quiet: polling /api/status" : "no live feed: polling /api/status");
  $("feed-dot").className = `dot ${kind}`;
  $("feed-text").textContent = text;
  const banner = $("banner");
  banner.classList.toggle("hidden", !state.statusError);
  banner.textContent = state.statusError ? `The tracker did not answer: ${state.statusError}` : "";
}

function nodeColor(id) {
  const ids = [...new Set([...state.nodes.map((n) => n.id), ...state.throughput.flatMap((p) => Object.keys(p.tps))])].sort();
  return `var(--series-${(Math.max(0, ids.indexOf(id)) % SERIES) + 1})`;
}

function routeView(hops) {
  if (!hops?.length) return el("span", {class: "muted"}, "route pending");
  const parts = hops.flatMap((hop, i) => [
    i ? el("span", {class: "arrow"}, "→") : null,
    el("span", {class: "hop", title: `layers ${hop.start_layer} to ${hop.end_layer}`},
       `${hop.node} ${layers(hop.start_layer, hop.end_layer)}`)]);
  return el("span", {class: "route"}, parts);
}

function callCard(row) {
  const mine = state.mine.has(row.key);
  return el("div", {class: `call${mine ? " mine" : ""}`, dataset: {key: row.key, state: row.state}},
    el("div", {class: "call-head"},
       el("span", {class: `badge ${row.state}`}, row.state),
       el("b", {}, row.model), mine ? el("span", {class: "badge mine"}, "you") : null,
       el("span", {class: "call-id", title: row.key}, shortId(row.key))),
    el("div", {class: "call-figures"},
       prefillFigure(row),
       el("span", {}, el("b", {class: "tokens"}, int(row.tokens)), " tokens"),
       el("span", {}, el("b", {class: "tps"}, num(row.tps)), " tok/s"),
       el("span", {}, "queue ", el("b", {}, int(row.queue))),
       draftsFigure(row),
       el("span", {class: "muted"}, seconds(row.elapsed))),
    routeView(row.hops));
}

/** A request that drafted: the share of its drafts the tail kept, and tokens per trip through the route. */
function draftsFigure(row) {
  if (!(row.drafted > 0)) return null;
  return el("span", {class: "drafts", title: `speculation: ${int(row.kept)} of ${int(row.drafted)} drafts kept over ${int(row.trips)} trips`},
            el("b", {class: "acceptance"}, `${Math.round(100 * row.acceptance)}%`), " kept · ",
            el("b", {class: "per-trip"}, num(row.tokens_per_trip)), " tok/trip");
}

/** The cells of a finished request's speculation: share kept, tokens per trip ("–": it drafted nothing). */
function draftsCells(row) {
  const drafted = row.drafted > 0;
  return [el("td", {class: "num acceptance"}, drafted ? `${Math.round(100 * row.acceptance)}%` : "–"),
          el("td", {class: "num per-trip"}, drafted ? num(row.tokens_per_trip) : "–")];
}

/** While a prompt prefills: tokens done / total, and a bar (none once tokens come). */
function prefillFigure(row) {
  if (!(row.prefill_tokens > 0) || row.prefilled >= row.prefill_tokens) return null;
  return el("span", {class: "prefill", title: "prompt tokens the route has prefilled"}, "prefill ",
            el("b", {}, `${int(row.prefilled)} / ${int(row.prefill_tokens)}`), " ",
            el("progress", {max: row.prefill_tokens, value: row.prefilled}));
}

function recentRow(row) {
  const tps = row.duration > 0 && row.tokens ? row.tokens / row.duration : null;
  return el("tr", {dataset: {key: row.key}},
    el("td", {}, clock(row.updated)), el("td", {}, row.model),
    el("td", {class: "num"}, `${int(row.prompt_tokens)} / ${int(row.tokens)}`),
    el("td", {class: "num"}, seconds(row.duration)), el("td", {class: "num"}, num(tps)),
    ...draftsCells(row),
    el("td", {}, el("span", {class: `badge ${row.state}`}, row.finish_reason || row.state)),
    el("td", {}, row.billing ? el("span", {class: `badge ${row.billing}`, title: row.billing_reason || ""}, row.billing) : "–"),
    el("td", {}, routeView(row.hops)));
}

function renderCalls() {
  const rows = [...state.active.values()].sort((a, b) => b.started - a.started);
  fill($("calls-active"), rows.length ? rows.map(callCard)
    : el("div", {class: "empty"}, "No requests in flight. Send one from the chat, or through the API."));
  $("calls-count").textContent = `${rows.length} in flight`;
  const head = el("tr", {}, ["time", "model", "in / out", "duration", "tok/s", "drafts kept", "tok/trip", "finish",
                             "billing", "route"]
    .map((h, i) => el("th", {class: i >= 2 && i <= 6 ? "num" : ""}, h)));
  const recent = state.recent.slice(0, 12);
  fill($("calls-recent"), el("thead", {}, head),
       el("tbody", {}, recent.length ? recent.map(recentRow)
         : el("tr", {}, el("td", {colspan: 10, class: "empty"}, "Nothing finished yet."))));
}

// ------------------------------------------------------------------ topology

function health(node) {
  const beat = state.tracker.heartbeat_interval || 1;
  const expiry = state.tracker.expiry_s || beat * 3;
  if (node.excluded) return ["bad", "excluded: an audit caught it returning wrong results"];
  if (node.bad_bytes) return ["bad", `sent bad bytes to ${node.bad_bytes} fetch${node.bad_bytes === 1 ? "" : "es"} of weights from peers`];
  if (node.last_seen_s === undefined) return ["warn", "unknown"];
  if (node.last_seen_s <= beat * 2) return ["ok", "healthy"];
  return node.last_seen_s < expiry ? ["warn", "late heartbeat"] : ["bad", "missing"];
}

function measuredTps(node) {
  const row = (state.stats.decode_tps || []).find((r) => r.node === node.id && r.model === node.model);
  return row ? row.tokens_per_s : null;
}

function models() {
  const names = new Set([...state.nodes.map((n) => n.model), ...Object.keys(state.plans)]);
  return [...names].sort().map((model) => {
    const nodes = state.nodes.filter((n) => n.model === model);
    const total = nodes[0]?.num_layers || Math.max(0, ...nodes.map((n) => n.layers[1] + 1));
    return {model, nodes, total, route: state.plans[model]?.[0] || null, gaps: state.gaps[model] || [],
            differ: state.differ?.[model] || []};
  });
}

function position(start, end, total) {
  return `left:${(start / total) * 100}%;width:${((end - start + 1) / total) * 100}%`;
}

function axis(total, gaps) {
  const step = Math.max(1, Math.ceil(total / 8));
  const ticks = [];
  for (let layer = 0; layer < total; layer += step) ticks.push(layer);
  if (ticks.at(-1) !== total - 1) ticks.push(total - 1);
  const track = el("div", {class: "axis"}, ticks.map((t) => el("span", {style: `left:${((t + 0.5) / total) * 100}%`}, t)));
  for (const [start, end] of gaps) {
    track.append(el("div", {class: "gap-mark", title: `no node holds layers ${start}-${end}`, style: position(start, end, total)}));
  }
  return [el("div", {class: "lane-label muted"}, "layer"), track];
}

function lane(node, total, route) {
  const [kind, text] = health(node);
  const hopIndex = route ? route.hops.findIndex((h) => h.node === node.id) : -1;
  const hop = hopIndex >= 0 ? route.hops[hopIndex] : null;
  const track = el("div", {class: "track", dataset: {node: node.id}},
    el("div", {class: "shard", title: `${node.id} holds layers ${node.layers[0]}-${node.layers[1]}`,
               style: position(node.layers[0], node.layers[1], total)}, layers(...node.layers)));
  if (hop) {
    track.append(el("div", {class: "shard used", title: `plan hop ${hopIndex + 1}: layers ${hop.start_layer}-${hop.end_layer}`,
                            style: position(hop.start_layer, hop.end_layer, total)}, `#${hopIndex + 1} ${layers(hop.start_layer, hop.end_layer)}`));
  }
  const tps = measuredTps(node);
  const meta = [`${text}`, `sessions ${node.sessions}/${node.max_sessions ?? "?"}`, `queue ${node.queued ?? 0}`,
                tps === null ? `~${num(node.layer_steps_per_s)} layer-steps/s (benchmark)` : `${num(tps)} tok/s measured`,
                node.hardware?.device].filter(Boolean).join(" · ");
  return [el("div", {class: "lane-label", title: `${node.id} at ${node.endpoint}`},
             el("span", {class: `dot ${kind}`, title: text}), el("span", {}, node.id)),
          track, el("div", {class: "lane-meta"}, meta)];
}

/** Nodes that claim one model with different weights never chain: name them, group by group. */
function differLine(differ) {
  if (differ.length < 2) return null;
  const groups = differ.map((g) => `${g.nodes.map((n) => `${n.id} [${layers(...n.layers)}]`).join(", ")}` +
                                   ` (fingerprint ${g.label})`);
  return el("div", {class: "plan-line differ"}, `weights differ: ${groups.join(" vs ")}. ` +
            "These nodes never chain: load the same model file on every node, with the same --quant.");
}

/** Per route of ``model`` whose requests drafted: the share of drafts kept and tokens per trip. */
function speculationLines(model) {
  return (state.speculation[model] || []).map((r) => el("div", {class: "plan-line speculation", dataset: {route: r.route.join(">")}},
    `speculation ${r.route.join(" → ")}: `, el("b", {class: "acceptance"}, `${Math.round(100 * (r.acceptance ?? 0))}%`),
    " of drafts kept · ", el("b", {class: "per-trip"}, num(r.tokens_per_trip)), ` tok/trip over ${int(r.requests)} requests`));
}

function modelBlock({model, nodes, total, route, gaps, differ}) {
  const lanes = el("div", {class: "lanes"}, axis(total, gaps),
                   nodes.sort((a, b) => a.layers[0] - b.layers[0] || a.id.localeCompare(b.id)).map((n) => lane(n, total, route)));
  const plan = route ? el("div", {class: "plan-line"}, "plan: ", routeView(route.hops), ` · ~${num(route.estimated_tps)} tok/s estimated`)
    : el("div", {class: "plan-line"}, differ.length > 1 ? "no route: these nodes hold different weights"
                                      : gaps.length ? "no route: some layers are not covered" : "no route yet");
  return el("div", {class: "model-block", dataset: {model}},
    el("div", {class: "model-head"}, el("b", {}, model), el("span", {class: "muted"}, `${total} layers · ${nodes.length} node${nodes.length === 1 ? "" : "s"}`)),
    lanes, plan, differLine(differ), speculationLines(model),
    (state.fetches || []).filter((f) => f.model === model).map(fetchLine));
}

/** A node (or a `meshnet pull`, which names none) fetching layers from peers (FETCH_REPORT): bytes done of total, rate, and the peers it caught. */
function fetchLine(f) {
  const mib = (n) => (n / 1048576).toFixed(1);
  const pct = f.total ? Math.floor((100 * f.done) / f.total) : 0;
  const who = `${f.node || "meshnet pull"} `;
  const doing = f.state === "fetching" ? `fetching ${mib(f.done)} of ${mib(f.total)} MiB (${pct}%) · ${mib(f.rate)} MiB/s`
    : f.state === "done" ? `fetched ${mib(f.total)} MiB` : `fetch failed: ${f.error}`;
  const bad = f.bad_peers.length ? ` · bad bytes from ${f.bad_peers.join(", ")} (left out)` : "";
  return el("div", {class: `plan-line fetch${f.bad_peers.length ? " differ" : ""}`, dataset: {fetch: f.fetch}},
            `${who}layers ${layers(...f.layers)} from peers: ${doing}${bad}`);
}

function renderTopology() {
  const blocks = models().filter((m) => m.total > 0);
  fill($("topology-body"), blocks.length ? blocks.map(modelBlock)
    : el("div", {class: "empty"}, "No nodes registered. Start one with: meshnet node --model REF"));
  $("topology-summary").textContent = `${state.nodes.length} node${state.nodes.length === 1 ? "" : "s"}`;
}

// ------------------------------------------------------------------ throughput chart

function chartScale(points) {
  const peak = Math.max(1, ...points.flatMap((p) => Object.values(p.tps)));
  const magnitude = 10 ** Math.floor(Math.log10(peak));
  return Math.ceil(peak / magnitude) * magnitude;
}

function renderChart() {
  const chart = $("throughput-chart");
  const {width, height} = chart.getBoundingClientRect();
  if (!width) return;
  chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const points = state.throughput;
  const top = chartScale(points);
  const end = points.at(-1)?.ts ?? Date.now() / 1000;
  const span = Math.min(CHART_WINDOW_S, Math.max(60, end - (points[0]?.ts ?? end)));
  const x = (ts) => 34 + ((ts - (end - span)) / span) * (width - 40);
  const y = (v) => height - 16 - (v / top) * (height - 24);
  chart.replaceChildren(...[0, top / 2, top].flatMap((v) => [
    svg("line", {class: "gridline", x1: 34, x2: width, y1: y(v), y2: y(v)}),
    Object.assign(svg("text", {class: "tick", x: 0, y: y(v) + 3}), {textContent: num(v, v < 10 ? 1 : 0)})]));
  const label = (text, at, anchor) => Object.assign(
    svg("text", {class: "tick", x: at, y: height - 2, "text-anchor": anchor}), {textContent: text});
  chart.append(label(`−${Math.round(span)} s`, 34, "start"), label("now", width - 6, "end"));
  const ids = [...new Set(points.flatMap((p) => Object.keys(p.tps)))].sort();
  for (const id of ids) {
    const coords = points.filter((p) => id in p.tps).map((p) => `${x(p.ts).toFixed(1)},${y(p.tps[id]).toFixed(1)}`);
    chart.append(svg("polyline", {points: coords.join(" "), style: `stroke:${nodeColor(id)}`, "data-node": id}));
  }
  const latest = points.at(-1)?.tps || {};
  fill($("throughput-legend"), ids.length ? ids.map((id) => el("span", {},
    el("span", {class: "swatch", style: `background:${nodeColor(id)}`}), `${id} ${num(latest[id])} tok/s`))
    : el("span", {class: "muted"}, "No samples yet: they come with the tracker's stats."));
}

// ------------------------------------------------------------------ usage and log

function total(label, value, detail) {
  return el("div", {class: "total", dataset: {total: label}}, el("div", {class: "label"}, label),
            el("div", {class: "value"}, value), el("div", {class: "detail"}, detail));
}

function renderUsage() {
  const totals = state.usage.totals || {};
  const own = state.accounting?.total;
  fill($("usage-totals"), ["billed", "held", "void"].map((status) => {
    const t = totals[status] || {};
    return total(status, int(t.requests ?? 0), `${int(t.prompt_tokens ?? 0)} in · ${int(t.completion_tokens ?? 0)} out`);
  }), own ? total("this web UI", int(own.requests),
                  `${int(own.completed)} done · ${int(own.cancelled)} stopped · ${int(own.failed)} failed`) : null);
  const keys = Object.entries(state.usage.by_key || {});
  const head = el("tr", {}, ["API key", "requests", "tokens in", "tokens out"].map((h, i) => el("th", {class: i ? "num" : ""}, h)));
  const rows = keys.map(([key, u]) => el("tr", {},
    el("td", {class: "mono"}, key, key === state.myKeyId ? el("span", {class: "badge mine"}, " you") : null),
    el("td", {class: "num"}, int(u.requests)), el("td", {class: "num"}, int(u.prompt_tokens)),
    el("td", {class: "num"}, int(u.completion_tokens))));
  fill($("usage-keys"), el("thead", {}, head), el("tbody", {}, rows.length ? rows
    : el("tr", {}, el("td", {colspan: 4, class: "empty"}, "No billed usage yet."))));
}

function renderLog() {
  const events = [...state.events.values()].sort((a, b) => b.ts - a.ts || b.seq - a.seq).slice(0, MAX_LOG);
  const kindClass = {complete: "complete", error: "error", audit: "error", fetch: "running", progress: "running", connected: "running",
                     handover: "handover"};
  fill($("event-log"), events.length ? events.map((e) => el("li", {dataset: {kind: e.kind}},
    el("span", {class: "muted mono"}, clock(e.updated || e.ts)),
    el("span", {class: "kind"}, el("span", {class: `badge ${kindClass[e.kind] || ""}`}, e.kind)),
    el("span", {class: "msg-text"}, e.message)))
    : el("li", {class: "empty"}, "No events yet."));
}
