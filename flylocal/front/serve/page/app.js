// flylocal's chat page (docs/serving.md, "The chat page, inside"). Plain JavaScript, no build step and
// nothing from the network but this server. It speaks the server's OpenAI API, streamed, and
// colours each token by how it came from the stream's `flylocal` extension on every chunk:
// {"kinds": "AALT", "chars": [..]}, one letter per token (A accepted draft token, L loose, T
// from the target) and the characters of the answer each token ends.
//
// Text is text: everything the model or the user wrote is put in the page with textContent or
// text nodes, never parsed as HTML. The little formatting shown (paragraphs, lists, inline code,
// fenced code blocks) is recognised here, line by line.
"use strict";

const STORE = "flylocal.conversations";      // localStorage: the conversations
const CURRENT = "flylocal.current";          // localStorage: the open one's id
const SETTINGS = "flylocal.settings";        // localStorage: the controls' values
const KEY = "flylocal.key";                  // sessionStorage: the API key, for this tab only
const KIND_TITLES = { A: "accepted draft token", L: "loose: a draft token the target would not have chosen",
                      T: "from the target" };

// ms between updates of a streaming answer. Every update is a frame the browser lays out, paints
// and composites, a cost per frame whatever changed, taken from the cores the model decodes on
// when the server runs on this machine: 4 a second keep the text moving for a reader at a
// fraction of the cost of 10 (docs/serving.md, "The chat page, inside").
const REDRAW = 250;

const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
};

let conversations = readStore();            // [{id, title, messages: [...]}], newest first
let current = null;                          // the open conversation
let running = null;                          // the AbortController of the request in flight
let answering = null;                        // the conversation that request answers
let pinned = true;                           // the reader follows the conversation's end (watchScrolling)
let changed = new Set();                     // ids of conversations this tab changed since it last wrote
let deleted = new Set();                     // ids of conversations this tab deleted since it last wrote

// ----- storage -----
// What is stored may be hand-edited, from an older page or half-written, so it is read
// defensively: an entry that cannot be repaired is skipped, never trusted. Other tabs write the
// same store, so a save re-reads it and merges by conversation id instead of overwriting it.
function readStore() {
  let value;
  try {
    value = JSON.parse(localStorage.getItem(STORE) || "[]");
  } catch (e) {
    return [];
  }
  if (!Array.isArray(value)) return [];
  const seen = new Set();
  const out = [];
  for (const c of value.map(readConversation)) {
    if (c && !seen.has(c.id)) {
      seen.add(c.id);
      out.push(c);
    }
  }
  return out;
}

function readConversation(c) {
  if (!c || typeof c !== "object" || !Array.isArray(c.messages)) return null;
  const id = typeof c.id === "number" ? String(c.id) : c.id;
  if (typeof id !== "string" || !id) return null;
  const messages = c.messages.map(readMessage).filter(Boolean);
  const first = messages.find((m) => m.role === "user");
  if (!first) return null;
  return { id, title: typeof c.title === "string" ? c.title : first.content.trim().slice(0, 60), messages };
}

function readMessage(m) {
  if (!m || typeof m !== "object") return null;
  if (m.role === "user") return typeof m.content === "string" ? { role: "user", content: m.content } : null;
  if (m.role !== "assistant") return null;
  const runs = Array.isArray(m.compare) && m.compare.length === 2 ? m.compare.map(readAnswer) : null;
  if (runs && runs.every(Boolean)) return { role: "assistant", answer: runs[1], compare: runs };
  const answer = readAnswer(m.answer);
  return answer ? { role: "assistant", answer } : null;
}

function readAnswer(a) {
  if (!a || typeof a !== "object") return null;
  // tokens: [[kind, chars, alternative?, p?], ...]; one bad token and the colours would not line
  // up with the text, so the answer is then kept as plain text
  const token = (t) => Array.isArray(t) && typeof t[0] === "string" && Number.isInteger(t[1]) && t[1] >= 0;
  const tokens = Array.isArray(a.tokens) && a.tokens.every(token) ? a.tokens : [];
  return { text: typeof a.text === "string" ? a.text : "", tokens,
           usage: a.usage && typeof a.usage === "object" ? a.usage : null,
           seconds: Number.isFinite(a.seconds) && a.seconds > 0 ? a.seconds : 0, stopped: a.stopped === true,
           error: typeof a.error === "string" ? a.error : null,
           verifier: typeof a.verifier === "string" ? a.verifier : null };
}

// What is stored now, with this tab's changes over it: the conversations it changed replace
// theirs (new ones first), those it deleted are left out, and the rest are as stored, so another
// tab's new conversations stay and one it deleted is not brought back.
function merged() {
  const mine = new Map(conversations.filter((c) => changed.has(c.id)).map((c) => [c.id, c]));
  const stored = readStore().filter((c) => !deleted.has(c.id));
  const there = new Set(stored.map((c) => c.id));
  return [...mine.values()].filter((c) => !there.has(c.id)).concat(stored.map((c) => mine.get(c.id) || c));
}

function merge() {
  conversations = merged();
  if (current) current = conversations.find((c) => c.id === current.id) || null;
}

function touch(conversation) {
  changed.add(conversation.id);
  if (!conversations.includes(conversation)) {
    conversations = [conversation].concat(conversations.filter((c) => c.id !== conversation.id));
  }
}

function forget(conversation) {
  conversations = conversations.filter((c) => c.id !== conversation.id);
  changed.delete(conversation.id);
  deleted.add(conversation.id);
  if (current && current.id === conversation.id) current = null;
}

function save() {
  merge();
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
    localStorage.setItem(CURRENT, current ? current.id : "");
  } catch (e) {
    say("the conversation could not be kept in this browser: " + e.message);
    return;                                  // still changed: the next save tries again
  }
  changed = new Set(answering ? [answering.id] : []);    // its answer is still to come
  deleted = new Set();
}

// Another tab saved: show its conversations too. The open one is drawn again only if it changed
// there, and not while an answer streams into it.
function storedElsewhere(e) {
  if (e.storageArea !== localStorage || (e.key !== STORE && e.key !== null)) return;
  const before = current ? JSON.stringify(current) : null;
  merge();
  listConversations();
  if (!running && (current ? JSON.stringify(current) : null) !== before) showConversation();
}

const CONTROLS = ["verifier", "drafter", "k", "temperature", "max-tokens", "system", "compare"];
// The request fields the settings set, by the name the server gives a field it refuses.
const FIELDS = { verifier: "verifier", drafter: "drafter", k: "k", temperature: "temperature",
                 max_tokens: "max-tokens" };
let refused = new Set();                     // controls whose value the server refused: not kept

function saveSettings() {
  const values = {};
  for (const id of CONTROLS) {
    if (refused.has(id)) continue;           // a reload brings its default back
    values[id] = $(id).type === "checkbox" ? $(id).checked : $(id).value;
  }
  try { localStorage.setItem(SETTINGS, JSON.stringify(values)); } catch (e) { /* kept for this page only */ }
}

function loadSettings() {
  let values = null;
  try { values = JSON.parse(localStorage.getItem(SETTINGS) || "{}"); } catch (e) { values = null; }
  if (!values || typeof values !== "object") return;
  for (const id of CONTROLS) {
    const control = $(id);
    const value = values[id];
    if (control.type === "checkbox") {
      if (typeof value === "boolean") control.checked = value;
    } else if (typeof value === "string" || typeof value === "number") {
      const text = String(value);
      if (control.tagName !== "SELECT" || Array.from(control.options).some((o) => o.value === text)) control.value = text;
    }
  }
}

function labelOf(id) { return $(id).closest("label").firstChild.textContent.trim(); }

function defaultOf(control) {
  if (control.tagName === "SELECT") {
    const option = Array.from(control.options).find((o) => o.defaultSelected) || control.options[0];
    return { value: option.value, text: option.textContent };
  }
  return { value: control.defaultValue, text: control.defaultValue || control.placeholder || "empty" };
}

// The server refused a request for a setting's value (a 400 naming the field): the value is not
// kept, the control is marked, and the default is offered.
function refuse(field, message) {
  const id = FIELDS[field];
  if (!id) return;
  const control = $(id);
  refused.add(id);
  saveSettings();
  control.classList.add("refused");
  control.setAttribute("aria-invalid", "true");
  control.title = message;
  $("refused-text").textContent = "The server refused " + labelOf(id) + " " + control.value +
    ", so the page does not keep it.";
  $("use-default").textContent = "Use the default (" + defaultOf(control).text + ")";
  $("use-default").dataset.control = id;
  $("refused").hidden = false;
  if ($("settings").hidden) toggleSettings();
}

function accepted(id) {
  refused.delete(id);
  $(id).classList.remove("refused");
  $(id).removeAttribute("aria-invalid");
  $(id).removeAttribute("title");
  if ($("use-default").dataset.control === id) $("refused").hidden = true;
}

function useDefault() {
  const id = $("use-default").dataset.control;
  if (!id) return;
  $(id).value = defaultOf($(id)).value;
  accepted(id);
  saveSettings();
  $("input").focus();
}

function say(text) { $("status").textContent = text; }

// ----- the API key -----
function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

let keyWaiters = [];

function askKey(problem) {
  const dialog = $("key-dialog");
  $("key-error").hidden = !problem;
  $("key-error").textContent = problem || "";
  if (!dialog.open) dialog.showModal();
  $("key").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

async function useKey() {
  const key = $("key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY, key);
  const ok = await fetchModels();
  if (!ok) return;                       // fetchModels asked again, saying why
  $("key-dialog").close();
  $("key").value = "";
  const waiters = keyWaiters;
  keyWaiters = [];
  waiters.forEach((resolve) => resolve());
}

async function fetchModels() {
  let res;
  try {
    res = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    say("the server does not answer: " + e.message);
    return false;
  }
  if (res.status === 401) {
    const had = sessionStorage.getItem(KEY);
    sessionStorage.removeItem(KEY);
    askKey(had ? "That key was refused." : "");
    return false;
  }
  if (!res.ok) {
    say("the server answered " + res.status);
    return false;
  }
  const body = await res.json();
  // Every model that generates; the first is the one loaded at start. One not loaded yet loads
  // when a request names it.
  const menu = $("model");
  const chosen = menu.value;
  menu.replaceChildren(...(body.data || []).filter((m) => !(m.flylocal && m.flylocal.role !== "target"))
    .map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.id + (m.status && m.status.value !== "loaded" ? " (loads when asked)" : "");
      return option;
    }));
  if (chosen && [...menu.options].some((o) => o.value === chosen)) menu.value = chosen;
  return true;
}

// ----- conversations in the sidebar -----
function newConversation() {
  if (running) return;
  current = null;
  save();
  showConversation();
  listConversations();
  showSidebar(false);
  $("input").focus();
}

// On a narrow screen the sidebar slides over the page; its toggle stays above it (style.css).
function showSidebar(open) {
  $("sidebar").classList.toggle("open", open);
  $("toggle-sidebar").setAttribute("aria-expanded", String(open));
}

function listConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of conversations) {
    const item = el("li", c === current ? "current" : "");
    const open = el("button", "open", c.title || "(untitled)");
    open.type = "button";
    open.title = c.title || "";
    open.addEventListener("click", () => {
      if (running) return;
      current = c;
      save();
      showConversation();
      listConversations();
      showSidebar(false);
    });
    const remove = el("button", "delete", "\u00d7");
    remove.type = "button";
    remove.setAttribute("aria-label", "Delete the conversation " + (c.title || ""));
    remove.title = "Delete";
    remove.addEventListener("click", () => {
      if (running && c === current) return;
      forget(c);
      save();
      showConversation();
      listConversations();
    });
    item.append(open, remove);
    list.append(item);
  }
}

function showConversation() {
  const box = $("messages");
  box.replaceChildren();
  if (!current) return;
  for (const m of current.messages) {
    if (m.role === "user") box.append(userNode(m.content));
    else if (m.compare) box.append(compareNode(m.compare).node);
    else box.append(answerNode(m.answer).node);
  }
  toEnd();
}

function userNode(text) {
  const node = el("div", "msg user");
  node.append(el("div", "body", text));
  return node;
}

// ----- answers: an answer is {text, tokens: [[kind, chars, alternative, p], ...], usage,
// seconds, stopped, error, verifier}, the tokens aligned with the text by their chars -----
function answerNode(answer, heading) {
  const node = el("div", "msg answer");
  const head = el("div", "head");
  if (heading) head.textContent = heading;
  const body = el("div", "body");
  const stats = el("div", "stats");
  const tools = el("div", "tools");
  const copy = el("button", "copy-answer", "Copy");
  copy.type = "button";
  copy.addEventListener("click", () => copyText(answer.text));
  tools.append(copy);
  node.append(head, body, stats, tools);
  const view = { node, head, body, stats, answer, mark: -1 };
  draw(view);
  return view;
}

function draw(view) {
  view.raw = null;
  view.body.classList.remove("raw");
  renderText(view.body, view.answer, view.mark);
  view.stats.textContent = statsLine(view.answer);
}

function statsLine(a) {
  if (a.error) return "error: " + a.error;
  const parts = [];
  const u = a.usage;
  if (u) {
    const f = u.flylocal || {};
    parts.push(u.completion_tokens + " tokens");
    if (f.tokens_per_s !== undefined) parts.push(Number(f.tokens_per_s).toFixed(1) + " tok/s");
    if (f.mean_accepted_length !== undefined) parts.push("mean accepted length " + Number(f.mean_accepted_length).toFixed(2));
    parts.push("loose " + (f.loose || 0));
    const cached = u.prompt_tokens_details ? u.prompt_tokens_details.cached_tokens : undefined;
    if (cached !== undefined) parts.push("cached prompt tokens " + cached);
    if (f.budget_left !== undefined && f.budget_left !== null && f.verifier === "asd") {
      parts.push("ASD budget left " + Number(f.budget_left).toFixed(2));
    }
    if (f.verifier) parts.push(f.verifier + (f.drafter ? " + " + f.drafter : ""));
  } else if (a.tokens.length) {
    parts.push(a.tokens.length + " tokens");
    if (a.live) parts.push(a.live.toFixed(1) + " tok/s");
  }
  if (a.seconds) parts.push(a.seconds.toFixed(2) + " s");
  if (a.stopped) parts.push("stopped");
  return parts.join(" \u00b7 ");
}

function tokenSpan(t, text, marked) {
  const span = el("span", "tok tok-" + t[0], text);
  span.title = t[0] === "L" && t[2] !== undefined && t[2] !== null
    ? "loose: the target's own choice here was \u201c" + t[2] + "\u201d (p = " + Number(t[3]).toFixed(3) + ")"
    : KIND_TITLES[t[0]] || "";
  if (marked) span.classList.add("diverge");
  return span;
}

// While an answer streams, its new tokens are appended as they come, as plain lines: the work
// per update is the new text's, not the whole answer's (the browser shares the machine's cores
// with the model). The formatting comes once, when the answer ends (draw).
function drawStreaming(view) {
  const answer = view.answer;
  if (!view.raw) {
    view.raw = { at: 0, tokens: 0, tail: document.createTextNode("") };   // at: UTF-16 index drawn
    view.body.replaceChildren(view.raw.tail);
    view.body.classList.add("raw");
  }
  const raw = view.raw;
  const rest = Array.from(answer.text.slice(raw.at));
  const added = document.createDocumentFragment();
  let used = 0;
  for (; raw.tokens < answer.tokens.length; raw.tokens++) {
    const t = answer.tokens[raw.tokens];
    if (used + t[1] > rest.length) break;
    const text = rest.slice(used, used + t[1]).join("");
    used += t[1];
    raw.at += text.length;
    if (text) added.append(tokenSpan(t, text, false));
  }
  raw.tail.before(added);
  raw.tail.data = rest.slice(used).join("");
  view.stats.textContent = statsLine(answer);
}

function renderText(body, answer, mark) {
  const chars = Array.from(answer.text);
  const owner = new Int32Array(chars.length).fill(-1);      // the token each character belongs to
  let pos = 0;
  answer.tokens.forEach((t, i) => {
    const end = Math.min(pos + t[1], chars.length);
    owner.fill(i, pos, end);
    pos = end;
  });

  const spans = (parent, a, b) => {
    for (let j = a; j < b;) {
      const o = owner[j];
      let e = j + 1;
      while (e < b && owner[e] === o) e++;
      const text = chars.slice(j, e).join("");
      parent.append(o < 0 ? document.createTextNode(text) : tokenSpan(answer.tokens[o], text, o === mark));
      j = e;
    }
  };
  const inline = (parent, a, b) => {          // `code` spans within a line
    let j = a;
    while (j < b) {
      let open = j;
      while (open < b && chars[open] !== "`") open++;
      let close = open + 1;
      while (close < b && chars[close] !== "`") close++;
      if (open >= b || close >= b) {
        spans(parent, j, b);
        return;
      }
      spans(parent, j, open);
      const code = el("code");
      spans(code, open + 1, close);
      parent.append(code);
      j = close + 1;
    }
  };

  const lines = [];
  for (let s = 0, i = 0; i <= chars.length; i++) {
    if (i === chars.length || chars[i] === "\n") {
      lines.push([s, i]);
      s = i + 1;
    }
  }
  const text = (i) => chars.slice(lines[i][0], lines[i][1]).join("");
  const out = document.createDocumentFragment();
  let para = null;
  let list = null;
  for (let i = 0; i < lines.length;) {
    const [a, b] = lines[i];
    const line = text(i);
    const fence = line.match(/^\s*(```|~~~)/);
    if (fence) {
      para = list = null;
      let j = i + 1;
      while (j < lines.length && !text(j).trim().startsWith(fence[1])) j++;
      const start = i + 1 < lines.length ? lines[i + 1][0] : b;
      const end = j > i + 1 ? lines[j - 1][1] : start;
      const box = el("div", "code");
      const pre = el("pre");
      const code = el("code");
      spans(code, start, end);
      pre.append(code);
      const copy = el("button", "copy", "Copy");
      copy.type = "button";
      copy.addEventListener("click", () => copyText(chars.slice(start, end).join("")));
      box.append(pre, copy);
      out.append(box);
      i = j + 1;
      continue;
    }
    if (line.trim() === "") {
      para = list = null;
      i++;
      continue;
    }
    const item = line.match(/^(\s*)([-*+]|\d{1,9}[.)])\s+/);
    if (item) {
      const ordered = /\d/.test(item[2]);
      if (!list || list.ordered !== ordered) {
        list = { node: el(ordered ? "ol" : "ul"), ordered };
        if (ordered) list.node.start = parseInt(item[2], 10);
        out.append(list.node);
      }
      para = null;
      const li = el("li");
      inline(li, a + Array.from(item[0]).length, b);
      list.node.append(li);
      i++;
      continue;
    }
    list = null;
    if (!para) {
      para = el("p");
      out.append(para);
    } else {
      para.append(el("br"));
    }
    inline(para, a, b);
    i++;
  }
  body.replaceChildren(out);
}

function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(() => say("copied"), () => copyByHand(text));
  } else {
    copyByHand(text);
  }
}

function copyByHand(text) {
  const area = el("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  try {
    document.execCommand("copy");
    say("copied");
  } catch (e) {
    say("this browser did not let the page copy");
  }
  area.remove();
}

// ----- a request, streamed -----
function requestBody(history, verifier) {
  const body = { messages: history, stream: true, stream_options: { include_usage: true }, logprobs: true,
                 top_logprobs: 1 };
  const number = (id, parse) => {
    const raw = $(id).value.trim();
    if (raw === "") return undefined;
    const value = parse(raw);
    if (!Number.isFinite(value)) throw new Error(labelOf(id) + ": not a number");
    return value;
  };
  const maxTokens = number("max-tokens", (v) => parseInt(v, 10));
  const temperature = number("temperature", parseFloat);
  const k = number("k", (v) => parseInt(v, 10));
  if (maxTokens !== undefined) body.max_tokens = maxTokens;
  if (temperature !== undefined) body.temperature = temperature;
  if (k !== undefined) body.k = k;
  if (verifier) body.verifier = verifier;
  if ($("drafter").value) body.drafter = $("drafter").value;
  if ($("model").value) body.model = $("model").value;
  return body;
}

// Runs one request into `view` (its answer grows as chunks come); resolves when it ends.
async function stream(view, history, verifier, controller) {
  const answer = view.answer;
  let body;
  try {
    body = requestBody(history, verifier);
  } catch (e) {
    answer.error = e.message;
    following(() => draw(view));
    return;
  }
  const started = performance.now();
  let first = null;
  let pending = false;
  const redraw = () => {                      // the first tokens at once, then at most every REDRAW ms
    if (pending) return;
    pending = true;
    setTimeout(() => {
      pending = false;
      if (!view.node.classList.contains("streaming")) return;
      if (first !== null && answer.tokens.length > 1) {
        answer.live = (answer.tokens.length - 1) / ((performance.now() - first) / 1000);
      }
      following(() => drawStreaming(view));
    }, view.raw && view.raw.tokens ? REDRAW : 0);
  };
  view.node.classList.add("streaming");
  try {
    for (let attempt = 0; ; attempt++) {
      const res = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                         signal: controller.signal });
      if (res.status === 401 && attempt === 0) {
        sessionStorage.removeItem(KEY);
        await askKey("This server asks for a key.");
        continue;
      }
      if (!res.ok) {
        let message = res.status + " " + res.statusText;
        let field = null;
        try {
          const error = (await res.json()).error;
          message = error.message || message;
          field = error.param;
        } catch (e) { /* not JSON */ }
        if (res.status === 400 && field) refuse(field, message);
        throw new Error(message);
      }
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message || "the server failed");
            const choice = chunk.choices && chunk.choices[0];
            if (choice && choice.delta && choice.delta.content) answer.text += choice.delta.content;
            if (chunk.flylocal) {
              if (first === null) first = performance.now();
              const entries = choice && choice.logprobs ? choice.logprobs.content || [] : [];
              Array.from(chunk.flylocal.kinds).forEach((kind, i) => {
                const token = [kind, chunk.flylocal.chars[i]];
                const top = entries[i] && entries[i].top_logprobs && entries[i].top_logprobs[0];
                if (kind === "L" && top) token.push(top.token, Math.exp(top.logprob));
                answer.tokens.push(token);
              });
            }
            if (chunk.usage) answer.usage = chunk.usage;
          }
          redraw();
        }
      }
      break;
    }
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else answer.error = e.message;
  } finally {
    answer.seconds = (performance.now() - started) / 1000;
    delete answer.live;
    view.node.classList.remove("streaming");
    following(() => draw(view));
  }
}

// Runs `change` on the conversation and keeps its end in sight while the reader follows it
// (`pinned`): one who scrolled up to read stays where they are while the answer grows.
function following(change) {
  change();
  if (pinned) toEnd();
}

function toEnd() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
  pinned = true;
}

// The reader follows the end until they scroll up, and again once they are back within 48 px
// of it. Upward is read from the wheel at once and from the scroll position's direction, so a
// redraw during a smooth scroll's first pixels does not pull them back; a list made shorter
// (the settings opened) moves nothing, so it does not stop the following.
function watchScrolling() {
  const box = $("messages");
  let lastTop = box.scrollTop;
  box.addEventListener("wheel", (e) => { if (e.deltaY < 0) pinned = false; }, { passive: true });
  box.addEventListener("scroll", () => {
    const gap = box.scrollHeight - box.scrollTop - box.clientHeight;
    if (box.scrollTop < lastTop && gap > 1) pinned = false;
    else if (gap < 48) pinned = true;
    lastTop = box.scrollTop;
  }, { passive: true });
}

function emptyAnswer(verifier) {
  return { text: "", tokens: [], usage: null, seconds: 0, stopped: false, error: null, verifier: verifier || null };
}

function historyOf(conversation) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of conversation.messages) {
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (m.answer && m.answer.text) messages.push({ role: "assistant", content: m.answer.text });
  }
  return messages;
}

async function send() {
  if (running) return;
  const text = $("input").value;
  if (!text.trim()) return;
  if (!current) {
    current = { id: String(Date.now()) + Math.random().toString(16).slice(2, 8), title: text.trim().slice(0, 60),
                messages: [] };
  }
  const conversation = current;
  const history = historyOf(conversation).concat([{ role: "user", content: text }]);
  const turn = { role: "user", content: text };
  conversation.messages.push(turn);
  touch(conversation);
  answering = conversation;
  $("input").value = "";
  const box = $("messages");
  box.append(userNode(text));
  listConversations();
  const controller = new AbortController();
  running = controller;
  $("stop").disabled = false;
  $("send").disabled = true;
  let reply;
  try {
    if ($("compare").checked) {
      const loose = $("verifier").value === "asd" ? "asd" : "fly";
      const runs = [emptyAnswer("strict"), emptyAnswer(loose)];
      const pair = compareNode(runs);
      box.append(pair.node);
      toEnd();                                    // a new message brings the reader to the end
      for (const view of pair.views) {
        if (controller.signal.aborted) { view.answer.stopped = true; following(() => draw(view)); continue; }
        await stream(view, history, view.answer.verifier, controller);
        following(() => pair.update());
      }
      reply = { role: "assistant", answer: runs[1], compare: runs };
    } else {
      const answer = emptyAnswer($("verifier").value);
      const view = answerNode(answer);
      box.append(view.node);
      toEnd();
      await stream(view, history, answer.verifier, controller);
      reply = { role: "assistant", answer };
    }
  } finally {
    running = null;
    answering = null;
    $("stop").disabled = true;
    $("send").disabled = false;
  }
  const answers = reply.compare || [reply.answer];
  if (answers.every((a) => !a.text)) {
    // Nothing came (stopped at once, or refused): the turn leaves no trace, and the message
    // goes back to the box so that nothing typed is lost.
    conversation.messages.pop();
    if (!$("input").value) $("input").value = text;
    if (conversation.messages.length) touch(conversation);
    else forget(conversation);
    const error = answers.find((a) => a.error);
    if (error) say("not sent: " + error.error);
  } else {
    conversation.messages.push(reply);
    touch(conversation);
    say("");
  }
  save();
  listConversations();
  if (current !== conversation || answers.every((a) => !a.text)) showConversation();
}

function stop() {
  if (running) running.abort();
}

// ----- compare: the same message with strict and with a loose verifier, side by side -----
function firstDifference(a, b) {
  const pieces = (answer) => {
    const chars = Array.from(answer.text);
    const out = [];
    let pos = 0;
    for (const t of answer.tokens) {
      out.push(chars.slice(pos, pos + t[1]).join(""));
      pos += t[1];
    }
    return out;
  };
  const x = pieces(a);
  const y = pieces(b);
  const n = Math.min(x.length, y.length);
  for (let i = 0; i < n; i++) if (x[i] !== y[i]) return i;
  return x.length === y.length ? -1 : n;
}

function compareNode(runs) {
  const node = el("div", "msg compare-turn");
  const grid = el("div", "compare");
  const views = runs.map((answer) => answerNode(answer));
  const note = el("p", "note");
  grid.append(...views.map((v) => v.node));
  node.append(grid, note);
  const update = () => {
    views.forEach((v) => {
      const a = v.answer;
      v.head.textContent = (a.verifier || "") + (a.seconds ? " \u00b7 " + a.seconds.toFixed(2) + " s" : "");
    });
    const [a, b] = runs;
    const done = runs.every((r) => r.seconds > 0);
    if (!done) {
      note.textContent = "";
    } else {
      const at = firstDifference(a, b);
      views.forEach((v) => { v.mark = at; draw(v); });
      if (at < 0) {
        note.textContent = "The two answers are the same, token for token.";
        note.className = "note";
      } else {
        note.textContent = "The answers first differ at token " + (at + 1) + " (outlined).";
        note.className = "note diverge-note";
      }
      const took = (r) => (r.verifier || "") + " " + r.seconds.toFixed(2) + " s" +
        (r.usage && r.usage.flylocal ? " (" + Number(r.usage.flylocal.tokens_per_s).toFixed(1) + " tok/s)" : "");
      note.textContent += " " + took(a) + ", " + took(b) + ".";
    }
  };
  update();
  return { node, views, update };
}

// ----- wiring -----
function toggleSettings() {
  const panel = $("settings");
  panel.hidden = !panel.hidden;
  $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
}

function init() {
  // The controls are wired first: whatever the stored conversations hold, the page still works.
  for (const id of CONTROLS) $(id).addEventListener("change", () => { accepted(id); saveSettings(); });
  $("use-default").addEventListener("click", useDefault);
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newConversation);
  $("key-use").addEventListener("click", useKey);
  $("key").addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); useKey(); } });
  $("key-dialog").addEventListener("cancel", (e) => e.preventDefault());     // a key is needed to go on
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
  $("toggle-settings").addEventListener("click", toggleSettings);
  $("toggle-sidebar").addEventListener("click", () => showSidebar(!$("sidebar").classList.contains("open")));
  window.addEventListener("storage", storedElsewhere);
  loadSettings();
  watchScrolling();
  const id = localStorage.getItem(CURRENT);
  current = conversations.find((c) => c.id === id) || null;
  listConversations();
  showConversation();
  fetchModels();
  $("input").focus();
}

init();
