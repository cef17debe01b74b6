// radixserve's chat page. It streams answers from the server's own /v1/chat/completions with
// fetch and a ReadableStream (EventSource cannot POST or send an Authorization header), and
// stops one with an AbortController: the closed connection makes the server abort the request
// and free its KV pages.
"use strict";

const $ = (id) => document.getElementById(id);

/** How long to wait before asking /v1/models again while the model loads (503). */
const RETRY_MS = 2000;
/** sessionStorage key of the API key: kept for this tab only, never in localStorage. */
const KEY_STORE = "radixserve.apiKey";

const state = {
  /** The served model's name, from /v1/models; null until known. */
  model: null,
  /** Its context length, when the server says (bounds the max tokens field). */
  maxModelLen: null,
  /** The conversation so far, as the API's messages (the system prompt is added per call). */
  messages: [],
  /** The running answer's AbortController; null when none runs. */
  controller: null,
  retryTimer: null,
};

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function setStatus(text, bad = false) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("bad", bad);
}

/** The message of an OpenAI error body, or the HTTP status when the body is not one. */
async function errorMessage(resp) {
  const text = await resp.text();
  try {
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
    if (body && body.detail) return typeof body.detail === "string" ? body.detail
      : JSON.stringify(body.detail);
  } catch (_) { /* not JSON: fall through to the status line */ }
  return `HTTP ${resp.status}${text ? ": " + text.slice(0, 300) : ""}`;
}

/** Ask /v1/models for the model's name; retry while it loads, say what a 401 needs. */
async function loadModel() {
  clearTimeout(state.retryTimer);
  state.model = null;
  updateButtons();
  setStatus("connecting…");
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: authHeaders() });
    // how many answers from /v1/models the page has seen (lets a test wait for one)
    document.body.dataset.modelChecks = String(Number(document.body.dataset.modelChecks || 0) + 1);
  } catch (e) {
    setStatus(`server unreachable (${e.message}); retrying`, true);
    state.retryTimer = setTimeout(loadModel, RETRY_MS);
    return;
  }
  if (resp.status === 401) {
    $("model").textContent = "—";
    setStatus("this server needs an API key: enter it in the API key field", true);
    $("api-key").classList.add("invalid");
    return;
  }
  $("api-key").classList.remove("invalid");
  if (resp.status === 503) {
    setStatus(`${await errorMessage(resp)}; retrying`);
    state.retryTimer = setTimeout(loadModel, RETRY_MS);
    return;
  }
  if (!resp.ok) {
    setStatus(`/v1/models failed: ${await errorMessage(resp)}`, true);
    return;
  }
  const card = (await resp.json()).data[0];
  state.model = card.id;
  state.maxModelLen = card.max_model_len || null;
  $("model").textContent = card.id;
  if (state.maxModelLen) $("max-tokens").max = String(state.maxModelLen);
  setStatus("ready");
  updateButtons();
}

function updateButtons() {
  const busy = state.controller !== null;
  $("send").disabled = busy || state.model === null;
  $("stop").disabled = !busy;
}

/**
 * The sampling fields, checked: {temperature, max_tokens}, or null after showing what is wrong
 * (the server would answer 400 too, but here the field itself is marked).
 */
function readSettings() {
  const err = $("settings-error");
  const t = $("temperature"), m = $("max-tokens");
  t.classList.remove("invalid");
  m.classList.remove("invalid");
  err.textContent = "";
  const temperature = Number(t.value);
  if (t.value.trim() === "" || !Number.isFinite(temperature) || temperature < 0 || temperature > 2) {
    t.classList.add("invalid");
    err.textContent = `Temperature must be a number from 0 to 2 (got "${t.value}").`;
    return null;
  }
  const maxTokens = Number(m.value);
  const cap = state.maxModelLen || Infinity;
  if (!Number.isInteger(maxTokens) || maxTokens < 1 || maxTokens > cap) {
    m.classList.add("invalid");
    err.textContent = `Max tokens must be a whole number from 1 to ${
      Number.isFinite(cap) ? cap : "the model's context length"} (got "${m.value}").`;
    return null;
  }
  return { temperature, max_tokens: maxTokens };
}

/** Append a message bubble; returns its parts for the streaming code to fill. */
function addBubble(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;  // never innerHTML: model output is shown as text
  const stats = document.createElement("div");
  stats.className = "stats";
  el.append(content, stats);
  $("messages").append(el);
  scrollDown();
  return { el, content, stats };
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

/** "TTFT 120 ms · 35.2 tok/s · 64 tokens · length" for one answer. */
function formatStats(s) {
  const parts = [];
  if (s.ttftMs !== null) parts.push(`TTFT ${Math.round(s.ttftMs)} ms`);
  // decode speed: the tokens after the first over the time after the first (TTFT is apart)
  if (s.tokens > 1 && s.lastMs > s.firstMs) {
    parts.push(`${((s.tokens - 1) / ((s.lastMs - s.firstMs) / 1000)).toFixed(1)} tok/s`);
  }
  parts.push(`${s.tokens} token${s.tokens === 1 ? "" : "s"}`);
  if (s.finish) parts.push(s.finish);
  return parts.join(" · ");
}

/**
 * Yield the parsed `data:` payloads of a server-sent event stream ("[DONE]" as the string).
 * Events end with a blank line; a chunk of the body may hold part of one, or several.
 */
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      yield data === "[DONE]" ? data : JSON.parse(data);
    }
  }
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.controller || !state.model) return;
  const settings = readSettings();
  if (!settings) return;
  $("prompt").value = "";
  const userMsg = { role: "user", content: text };
  state.messages.push(userMsg);
  addBubble("user", text);
  const bubble = addBubble("assistant", "");
  bubble.el.dataset.state = "streaming";

  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.messages]
    : [...state.messages];
  const controller = new AbortController();
  state.controller = controller;
  updateButtons();

  const stats = { ttftMs: null, firstMs: 0, lastMs: 0, tokens: 0, finish: null };
  const t0 = performance.now();
  let answer = "";
  let outcome = "done";
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({
        model: state.model, messages, stream: true, ...settings,
        // usage on every chunk: an exact token count even for an answer stopped mid-way
        stream_options: { include_usage: true, continuous_usage_stats: true },
      }),
      signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await errorMessage(resp));
    for await (const ev of sseEvents(resp.body)) {
      if (ev === "[DONE]") break;
      if (ev.error) throw new Error(ev.error.message || JSON.stringify(ev.error));
      const now = performance.now();
      if (ev.usage) stats.tokens = ev.usage.completion_tokens;
      const choice = ev.choices && ev.choices[0];
      if (!choice) continue;
      const piece = (choice.delta && choice.delta.content) || "";
      if (piece) {
        if (stats.ttftMs === null) {
          stats.ttftMs = now - t0;
          stats.firstMs = now;
        }
        stats.lastMs = now;
        answer += piece;
        bubble.content.textContent = answer;
        bubble.stats.textContent = formatStats(stats);
        scrollDown();
      }
      if (choice.finish_reason) stats.finish = choice.finish_reason;
    }
  } catch (e) {
    if (e.name === "AbortError") {
      outcome = "stopped";
      stats.finish = "stopped";
    } else {
      outcome = "error";
      bubble.el.classList.add("error");
      bubble.content.textContent = answer ? `${answer}\n\n[error: ${e.message}]`
        : `Error: ${e.message}`;
    }
  } finally {
    state.controller = null;
    bubble.el.dataset.state = outcome;
    bubble.stats.textContent = formatStats(stats);
    if (answer) {
      // a stopped answer stays in the conversation as far as it got, as in llama.cpp's page
      state.messages.push({ role: "assistant", content: answer });
    } else {
      // nothing came back: drop the question too, so that sending it again is a clean retry
      state.messages.splice(state.messages.indexOf(userMsg), 1);
    }
    updateButtons();
    $("prompt").focus();
  }
}

function stop() {
  if (state.controller) state.controller.abort();
}

function newChat() {
  stop();
  state.messages = [];
  $("messages").replaceChildren();
  $("prompt").focus();
}

function init() {
  const saved = sessionStorage.getItem(KEY_STORE);
  if (saved) $("api-key").value = saved;
  $("api-key").addEventListener("change", () => {
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORE, key);
    else sessionStorage.removeItem(KEY_STORE);
    loadModel();
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  loadModel();
}

init();
