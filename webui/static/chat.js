// The chat panel: conversations kept in localStorage, a model picker, sampling settings,
// and replies streamed from /v1/chat/completions (SSE over fetch), stoppable mid-reply.
// Until a route serves a model the picker says the model is still loading, Send is off,
// and /v1/models is asked again every few seconds (the swarm's feed also asks on each change).
import {$, el, fill, int, num} from "./ui.js";
import {apiFetch, errorMessage, readEvents} from "./net.js";

const STORE = "meshnet.conversations";
const CURRENT = "meshnet.conversation";
const SETTINGS = "meshnet.settings";
const DEFAULTS = {model: "", temperature: 0.7, top_p: 1, max_tokens: 256, seed: "", system: ""};
const FIELDS = {temperature: "set-temperature", top_p: "set-top-p", max_tokens: "set-max-tokens",
                seed: "set-seed", system: "set-system"};
const MODEL_POLL_MS = 2000; // how often /v1/models is asked again while no model is served

const state = {
  conversations: [],
  currentId: null,
  settings: {...DEFAULTS},
  controller: null, // the AbortController of the reply being generated
  onRequest: () => {}, // told each request id, so the Call wall can mark it
  modelReady: false, // a model a route serves is picked: Send is on
  notice: "", // why Send is off, while it is
  lead: "Ask the swarm something.", // the first line of an empty conversation
  modelAsk: 0, // number of the latest /v1/models request: older answers are dropped
  modelPoll: null, // timer of the next /v1/models request while no model is served
};

export function initChat({onRequest} = {}) {
  state.onRequest = onRequest || state.onRequest;
  loadSettings();
  loadConversations();
  bindControls();
  renderConversationList();
  renderMessages();
  syncSend();
  refreshModels();
}

// ------------------------------------------------------------------ persistence

function loadConversations() {
  try {
    state.conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
  } catch {
    state.conversations = [];
  }
  for (const conversation of state.conversations) {
    for (const message of conversation.messages) {
      if (message.streaming) message.stopped = true; // interrupted by a reload: no stuck cursor
      delete message.streaming;
    }
  }
  state.currentId = localStorage.getItem(CURRENT);
  if (!current()) newConversation();
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state.conversations));
  localStorage.setItem(CURRENT, state.currentId || "");
}

function current() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

function newConversation() {
  const conversation = {id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`,
                        title: "New conversation", messages: [], updated: Date.now()};
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  save();
  return conversation;
}

function loadSettings() {
  try {
    state.settings = {...DEFAULTS, ...JSON.parse(localStorage.getItem(SETTINGS) || "{}")};
  } catch {
    state.settings = {...DEFAULTS};
  }
  for (const [name, id] of Object.entries(FIELDS)) $(id).value = state.settings[name];
}

function readSettings() {
  for (const [name, id] of Object.entries(FIELDS)) state.settings[name] = $(id).value;
  state.settings.model = $("model").value || state.settings.model;
  localStorage.setItem(SETTINGS, JSON.stringify(state.settings));
}

// ------------------------------------------------------------------ controls

function bindControls() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (state.controller) state.controller.abort();
    else send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (!state.controller) $("composer").requestSubmit(); // only the ■ button stops a reply
    }
  });
  for (const id of [...Object.values(FIELDS), "model"]) $(id).addEventListener("change", readSettings);
  $("new-chat").addEventListener("click", () => switchTo(newConversation().id));
  $("delete-chat").addEventListener("click", deleteConversation);
  $("conversation").addEventListener("change", (event) => switchTo(event.target.value));
}

function switchTo(id) {
  if (state.controller) state.controller.abort();
  state.currentId = id;
  save();
  renderConversationList();
  renderMessages();
}

function deleteConversation() {
  if (state.controller) state.controller.abort();
  state.conversations = state.conversations.filter((c) => c.id !== state.currentId);
  state.currentId = state.conversations[0]?.id || null;
  if (!current()) newConversation();
  switchTo(state.currentId);
}

/** Fill the model picker from /v1/models with the models a route serves, keeping the
 * chosen one when it is still there; until one is served, ask again every few seconds. */
export async function refreshModels() {
  const ask = ++state.modelAsk;
  clearTimeout(state.modelPoll);
  let listing;
  try {
    listing = await listModels();
  } catch (error) {
    listing = {served: [], loading: [], error: error.message};
  }
  if (ask !== state.modelAsk) return; // a later request's answer decides
  showModels(listing);
  if (!state.modelReady) state.modelPoll = setTimeout(refreshModels, MODEL_POLL_MS);
}

/** {served, loading}: ids a route serves, and ids some node holds but no route covers yet. */
async function listModels() {
  const response = await apiFetch("/v1/models");
  if (!response.ok) throw new Error(await errorMessage(response));
  const models = (await response.json()).data || [];
  const routable = (m) => m.meshnet?.routable !== false;
  return {served: models.filter(routable).map((m) => m.id),
          loading: models.filter((m) => !routable(m)).map((m) => m.id)};
}

function showModels({served, loading, error}) {
  const select = $("model");
  const wanted = served.includes(state.settings.model) ? state.settings.model : served[0] || "";
  fill(select, served.length ? served.map((id) => el("option", {value: id}, id))
                             : el("option", {value: ""}, error ? "models unavailable" : "model still loading…"));
  select.value = wanted;
  state.settings.model = wanted || state.settings.model; // a remembered choice waits for its model
  if (wanted) setReady(wanted);
  else setWaiting(error ? `Models unavailable: ${error}. Asking again…` : loadingNotice(loading), error);
}

function loadingNotice(loading) {
  const why = loading.length ? `${loading.join(", ")} has nodes, but not all of its layers are served yet. ` +
                               "Send turns on once they are."
                             : "no node serves one yet. Send turns on once one does.";
  return `The model is still loading: ${why}`;
}

function setWaiting(notice, error) {
  state.modelReady = false;
  state.notice = notice;
  state.lead = error ? "Models are unavailable." : "The model is still loading.";
  syncSend();
  if (!state.controller) setStatus(notice, error ? "error" : "loading");
  if (!current().messages.length) renderMessages();
}

function setReady(model) {
  const waited = Boolean(state.notice); // the page said it was loading: say it is over
  state.modelReady = true;
  state.notice = "";
  state.lead = "Ask the swarm something.";
  syncSend();
  if (waited && !state.controller) setStatus(`${model} is served: send a message.`);
  if (waited && !current().messages.length) renderMessages();
}

// ------------------------------------------------------------------ rendering

function renderConversationList() {
  fill($("conversation"), state.conversations.map((c) =>
    el("option", {value: c.id, selected: c.id === state.currentId}, c.title)));
  $("conversation").value = state.currentId;
}

function renderMessages() {
  const conversation = current();
  const box = $("messages");
  if (!conversation.messages.length) {
    fill(box, el("div", {class: "empty-chat"}, el("p", {class: "lead"}, state.lead),
                 el("p", {}, "Replies stream token by token from the nodes that hold the model's layers; " +
                             "watch them on the Call wall.")));
    return;
  }
  fill(box, conversation.messages.map(messageView).map((view) => view.node));
  box.scrollTop = box.scrollHeight;
}

/** {node, text, meta} for one message; text is the Text node tokens are appended to. */
function messageView(message) {
  const kind = message.role === "error" ? "error" : message.role;
  const classes = ["msg", kind, message.streaming && "streaming", message.stopped && "stopped"];
  const text = document.createTextNode(message.content || "");
  const meta = el("div", {class: "meta"}, message.meta || "");
  const node = el("div", {class: classes.filter(Boolean).join(" "), dataset: {role: message.role}},
                  el("div", {class: "content"}, text), message.meta || message.streaming ? meta : null);
  return {node, text, meta};
}

function setStatus(text, kind = "") {
  const status = $("chat-status");
  status.textContent = text;
  status.className = `chat-status ${kind}`;
}

function setBusy(controller) {
  state.controller = controller;
  syncSend();
  const button = $("send");
  button.textContent = controller ? "■" : "Send";
  button.title = controller ? "Stop generating" : "Send";
  button.className = controller ? "stop" : "primary";
  button.setAttribute("aria-label", button.title);
}

/** Send is off while no model is served; the stop button always works. */
function syncSend() {
  const button = $("send");
  button.disabled = !state.controller && !state.modelReady;
}

// ------------------------------------------------------------------ sending

function send() {
  if (!state.modelReady) {
    setStatus(state.notice || "The model is still loading.", "loading"); // the prompt stays in the box
    return;
  }
  const prompt = $("prompt").value.trim();
  readSettings();
  if (!prompt) return;
  const conversation = current();
  if (!conversation.messages.length) conversation.title = prompt.slice(0, 48);
  conversation.messages.push({role: "user", content: prompt});
  const reply = {role: "assistant", content: "", streaming: true};
  conversation.messages.push(reply);
  conversation.updated = Date.now();
  $("prompt").value = "";
  save();
  renderConversationList();
  renderMessages();
  const view = messageView(reply);
  $("messages").lastElementChild.replaceWith(view.node);
  generate(conversation, reply, view);
}

function requestBody(conversation) {
  const s = state.settings;
  const history = conversation.messages
    .filter((m) => (m.role === "user" || m.role === "assistant") && m.content && !m.streaming)
    .map((m) => ({role: m.role, content: m.content}));
  const messages = s.system.trim() ? [{role: "system", content: s.system.trim()}, ...history] : history;
  const body = {model: s.model, messages, stream: true, stream_options: {include_usage: true}};
  if (s.temperature !== "") body.temperature = Number(s.temperature);
  if (s.top_p !== "") body.top_p = Number(s.top_p);
  if (s.max_tokens !== "") body.max_tokens = Number(s.max_tokens);
  if (s.seed !== "") body.seed = Number(s.seed);
  return body;
}

async function generate(conversation, reply, view) {
  const controller = new AbortController();
  const meter = new Meter();
  setBusy(controller);
  setStatus("waiting for the swarm…", "busy");
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify(requestBody(conversation)), signal: controller.signal});
    if (response.headers.get("X-Request-Id")) state.onRequest(response.headers.get("X-Request-Id"));
    const isStream = (response.headers.get("Content-Type") || "").includes("text/event-stream");
    if (isStream) await streamReply(response, reply, view, meter, conversation);
    else await jsonReply(response, reply, view, meter);
    finish(conversation, reply, meter, controller.signal.aborted ? "stopped" : "done");
  } catch (error) {
    const stopped = controller.signal.aborted || error.name === "AbortError";
    if (!stopped) conversation.messages.push({role: "error", content: error.message});
    finish(conversation, reply, meter, stopped ? "stopped" : "error", error.message);
  }
}

/** Read the SSE body: append each delta to the bubble; an error event ends with an error.
 * While a long prompt prefills, its progress comments show in the bubble. */
async function streamReply(response, reply, view, meter, conversation) {
  let lastSave = Date.now();
  for await (const {event, data} of readEvents(response, {comments: true})) {
    if (event === "comment") {
      showPrefill(view, data);
      continue;
    }
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message || "the swarm reported an error");
    if (chunk.usage) meter.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (choice?.finish_reason) meter.finish = choice.finish_reason;
    const text = choice?.delta?.content;
    if (!text) continue;
    if (view.node.dataset.prefill) view.meta.textContent = ""; // the prompt is read: tokens come
    appendText(reply, view, text);
    meter.token();
    setStatus(`generating… ${meter.describe()}`, "busy");
    if (Date.now() - lastSave > 1000) {
      lastSave = Date.now();
      save(); // a reload mid-reply keeps what has arrived
    }
  }
}

/** A prefill's progress comment, `progress {"prefilled": n, "prefill_tokens": total}`: tokens
 * done / total in the bubble and the status line. Other comments, and progress while no prefill
 * runs (total 0: the reply waits its turn while decoding), are keep-alives. */
function showPrefill(view, note) {
  if (!note.startsWith("progress ")) return;
  const {prefilled, prefill_tokens: total} = JSON.parse(note.slice("progress ".length));
  if (!total) return;
  const text = prefilled ? `reading the prompt… ${int(prefilled)} / ${int(total)} tokens`
    : `waiting for a turn on the swarm… a prompt of ${int(total)} tokens`;
  view.node.dataset.prefill = `${prefilled}/${total}`;
  view.meta.textContent = text;
  setStatus(text, "busy");
}

/** A non-streamed answer (or an error object) instead of SSE. */
async function jsonReply(response, reply, view, meter) {
  if (!response.ok) throw new Error(await errorMessage(response));
  const body = await response.json();
  if (body.error) throw new Error(body.error.message || "the swarm reported an error");
  const choice = body.choices?.[0] || {};
  appendText(reply, view, choice.message?.content ?? choice.text ?? "");
  meter.usage = body.usage;
  meter.finish = choice.finish_reason;
}

function appendText(reply, view, text) {
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  reply.content += text;
  view.text.appendData(text);
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function finish(conversation, reply, meter, outcome, message = "") {
  delete reply.streaming;
  reply.stopped = outcome === "stopped";
  const prefix = {stopped: "stopped · ", error: "failed · "}[outcome] || "";
  reply.meta = prefix ? prefix + meter.describe() : meter.summary();
  if (outcome === "error" && !reply.content) conversation.messages.splice(conversation.messages.indexOf(reply), 1);
  setBusy(null);
  save();
  renderMessages();
  if (outcome === "error") setStatus(`error: ${message}`, "error");
  else setStatus(reply.meta);
}

/** Tokens and tokens per second of one reply. */
class Meter {
  constructor() {
    this.tokens = 0;
    this.started = performance.now();
    this.first = null;
    this.last = null;
    this.usage = null;
    this.finish = null;
  }

  token() {
    this.tokens += 1;
    this.last = performance.now();
    this.first ??= this.last;
  }

  count() {
    return this.usage?.completion_tokens ?? this.tokens;
  }

  /** Tokens per second between the first and the last token; from the start if fewer. */
  rate() {
    if (this.tokens > 1 && this.last > this.first) return (this.tokens - 1) / ((this.last - this.first) / 1000);
    const span = ((this.last ?? performance.now()) - this.started) / 1000;
    return span > 0 ? this.count() / span : 0;
  }

  describe() {
    const n = this.count();
    return `${n} token${n === 1 ? "" : "s"} · ${num(this.rate())} tok/s`;
  }

  summary() {
    return [this.describe(), this.finish].filter(Boolean).join(" · ");
  }
}
