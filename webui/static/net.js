// Talking to the web UI: the API key (asked for on 401, kept in localStorage, sent as a
// Bearer token) and a reader for server-sent events over fetch's ReadableStream.
import {$} from "./ui.js";

const KEY_STORAGE = "meshnet.apiKey";
let pendingKey = null; // one open key dialog, shared by every request that got a 401
let declined = false; // the user cancelled the dialog: stop asking until they open it again

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

/** The ledger's identity of a key: "sha256:" + 16 hex digits (null without WebCrypto). */
export async function keyId(key) {
  if (!key || !crypto.subtle) return null;
  const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(key));
  const hex = [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, "0")).join("");
  return `sha256:${hex.slice(0, 16)}`;
}

/** Open the key dialog; resolves to the saved key, or null if the user cancels
 * (after which 401s no longer open it by themselves). */
export function askForKey(reason = "This web UI asks for an API key.") {
  if (pendingKey) return pendingKey;
  const dialog = $("key-dialog");
  $("key-reason").textContent = reason;
  $("key-input").value = apiKey();
  pendingKey = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      pendingKey = null;
      const key = dialog.returnValue === "save" ? $("key-input").value.trim() : "";
      if (key) setApiKey(key);
      declined = !key;
      resolve(key || null);
    }, {once: true});
  });
  dialog.showModal();
  $("key-input").focus();
  return pendingKey;
}

function withAuth(options) {
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  return {...options, headers};
}

/** fetch() with the stored key; on 401 ask for a key once and retry with it. */
export async function apiFetch(url, options = {}) {
  const response = await fetch(url, withAuth(options));
  if (response.status !== 401 || options.signal?.aborted || declined) return response;
  const reason = apiKey() ? "The stored API key was refused. Enter another one." : "This web UI needs an API key.";
  const key = await askForKey(reason);
  return key ? fetch(url, withAuth(options)) : response;
}

/** The message of an OpenAI-style error body, or a fallback. */
export async function errorMessage(response) {
  try {
    const body = await response.json();
    return body?.error?.message || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status} ${response.statusText}`;
  }
}

/** Server-sent events from a fetch response: yields {event, data} (data as text); with
 * comments, a block of comment lines only as {event: "comment", data: their text}. */
export async function* readEvents(response, {comments = false} = {}) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer = (buffer + value).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const parsed = parseBlock(buffer.slice(0, end), comments);
        buffer = buffer.slice(end + 2);
        if (parsed) yield parsed;
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // the consumer stopped early, or the stream ended: let go
  }
}

function parseBlock(block, comments) {
  let event = "message";
  const data = [];
  const notes = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) notes.push(line.slice(1).replace(/^ /, "")); // keep-alives, progress
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  if (data.length) return {event, data: data.join("\n")};
  return comments && notes.length ? {event: "comment", data: notes.join("\n")} : null;
}
