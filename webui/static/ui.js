// Small DOM and formatting helpers shared by the dashboard's modules.

/** Build an element: el("div", {class: "x", dataset: {key: "k"}}, "text", child). */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "dataset") Object.assign(node.dataset, value);
    else if (name === "style") node.style.cssText = value;
    else if (name in node && typeof value !== "string") node[name] = value;
    else node.setAttribute(name, value === true ? "" : value);
  }
  append(node, children);
  return node;
}

/** An SVG element with attributes. */
export function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
}

/** Replace a node's children. */
export function fill(node, ...children) {
  node.replaceChildren();
  append(node, children);
}

export function $(id) {
  return document.getElementById(id);
}

export function num(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toFixed(digits);
}

export function int(value) {
  return value === null || value === undefined ? "–" : Math.round(value).toLocaleString("en");
}

export function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 60 ? `${num(value, value < 10 ? 2 : 1)} s` : `${Math.floor(value / 60)} m ${Math.round(value % 60)} s`;
}

/** Wall-clock time of a UNIX timestamp (seconds), as HH:MM:SS. */
export function clock(ts) {
  if (!ts) return "–";
  return new Date(ts * 1000).toLocaleTimeString("en-GB", {hour12: false});
}

export function shortId(id) {
  const text = String(id ?? "");
  return text.length > 18 ? `${text.slice(0, 14)}…${text.slice(-4)}` : text;
}

export function layers(start, end) {
  return `${start}–${end}`;
}

/** Call fn at most once per animation frame, however often it is requested. */
export function coalesce(fn) {
  let pending = false;
  return () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      fn();
    });
  };
}
