// tokenflowd's chat page: streams /v1/chat/completions, shows the answer at the reader's pace
// and tells the server how far the reader has got (POST /v1/requests/{id}/read), so that the
// engine's model of this reader's buffer follows what was read, not what was sent.
//
// Text that has arrived waits in `pending` and is shown at the reading rate set in the page while
// the newest text is in view (the log scrolled to its end); scrolled back, the reader is reading
// something else, and nothing more is shown or reported read until they return. What is shown and
// in view is read: the cursor is posted when that grows, at most every CURSOR_EVERY ms.
"use strict";

const CURSOR_EVERY = 300; // ms between read-cursor posts
const REVEAL_EVERY = 50; // ms between reveal ticks
const INFO_EVERY = 1000; // ms between polls of /v1/requests/{id}

const $ = (id) => document.getElementById(id);

// What the page knows, for whoever inspects it (the tests read it).
const page = {
  model: null,
  requestId: null,
  delivered: 0, // tokens the server has sent (the events' usage)
  lastTokens: 0, // the usage count of the last event with text
  shown: 0, // tokens shown
  read: 0, // tokens posted as read and accepted
  cursorsPosted: 0,
  info: null, // the last /v1/requests/{id}
  streaming: false,
  error: "",
};
window.tokenflowd = page;

const history = [];
let pending = []; // [{text, from, tokens, shownChars}]: arrived, not all shown; its tokens are (from, tokens]
let progress = 0; // tokens shown, fractional
let answer = null; // the element the answer is shown in
let controller = null;
let lastPost = 0;
let posting = false;

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function showError(text) {
  page.error = text;
  $("error").textContent = text;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error && body.error.message ? body.error.message : JSON.stringify(body)}`;
  } catch (_) {
    return `${response.status} ${response.statusText}`;
  }
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers(false) });
    if (!r.ok) return showError(await errorText(r));
    const body = await r.json();
    page.model = body.data[0].id;
    $("model").textContent = page.model;
    showError("");
  } catch (e) {
    showError(String(e));
  }
}

function atEnd() {
  const log = $("log");
  return log.scrollHeight - log.scrollTop - log.clientHeight < 8;
}

function addTurn(role, text) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  div.textContent = text;
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

// Show what the reading rate allows, while the newest text is in view. An event may carry many
// tokens (the server coalesces them while this reader's buffer is full): its text is shown in
// proportion, and a token counts as shown once its whole share is.
function reveal() {
  if (!pending.length || !answer) return;
  if (!atEnd()) return; // the reader is elsewhere: nothing more is read
  const rate = Math.max(1, Number($("rate").value) || 20);
  progress = Math.min(progress + (rate * REVEAL_EVERY) / 1000, pending[pending.length - 1].tokens);
  while (pending.length) {
    const chunk = pending[0];
    const share = (progress - chunk.from) / (chunk.tokens - chunk.from || 1);
    const chars = share >= 1 ? chunk.text.length : Math.floor(chunk.text.length * Math.max(0, share));
    if (chars > chunk.shownChars) {
      answer.textContent += chunk.text.slice(chunk.shownChars, chars);
      chunk.shownChars = chars;
    }
    if (share < 1) break;
    pending.shift();
  }
  page.shown = Math.floor(progress);
  $("log").scrollTop = $("log").scrollHeight;
  postCursor();
}

// What is shown and in view has been read: say so, while the server still streams it.
async function postCursor() {
  const now = Date.now();
  if (!page.streaming || posting || page.shown <= page.read || !page.requestId || !atEnd()) return;
  if (now - lastPost < CURSOR_EVERY) return;
  posting = true;
  lastPost = now;
  const tokens = page.shown;
  try {
    const r = await fetch(`/v1/requests/${encodeURIComponent(page.requestId)}/read`, {
      method: "POST", headers: headers(true), body: JSON.stringify({ tokens }),
    });
    page.cursorsPosted += 1;
    if (r.ok) page.read = Math.max(page.read, tokens);
    // 404: the request ended meanwhile; nothing more to tell
  } catch (_) {
    // the next tick tries again
  } finally {
    posting = false;
  }
}

async function pollInfo() {
  if (!page.streaming || !page.requestId) return;
  try {
    const r = await fetch(`/v1/requests/${encodeURIComponent(page.requestId)}`, { headers: headers(false) });
    if (!r.ok) return;
    const info = await r.json();
    page.info = info;
    $("state").textContent = info.state;
    $("delivered").textContent = info.delivered_tokens ?? page.delivered;
    $("read").textContent = info.read_tokens ?? page.read;
    $("buffer").textContent = Number(info.buffer_tokens).toFixed(1);
    $("rate-used").textContent = Number(info.reading_rate).toFixed(1);
    $("rate-source").textContent = info.reading_rate_source ?? "–";
  } catch (_) {
    // shown again at the next poll
  }
}

// One SSE event's data: its text goes to `pending` with the usage count it brings.
function onEvent(data) {
  if (data === "[DONE]") return;
  const event = JSON.parse(data);
  if (event.error) throw new Error(event.error.message || JSON.stringify(event.error));
  if (event.usage) page.delivered = event.usage.completion_tokens;
  const choice = event.choices && event.choices[0];
  const text = choice && choice.delta && choice.delta.content;
  if (text) {
    const from = pending.length ? pending[pending.length - 1].tokens : page.lastTokens;
    pending.push({ text, from, tokens: Math.max(page.delivered, from), shownChars: 0 });
    page.lastTokens = Math.max(page.delivered, from);
  }
}

async function send(prompt) {
  const rate = Math.max(1, Number($("rate").value) || 20);
  const maxTokens = Number(new URLSearchParams(location.search).get("max_tokens")) || undefined;
  history.push({ role: "user", content: prompt });
  addTurn("user", prompt);
  answer = addTurn("assistant", "");
  Object.assign(page, { requestId: null, delivered: 0, lastTokens: 0, shown: 0, read: 0, info: null, error: "" });
  pending = [];
  progress = 0;
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let received = "";
  const poll = setInterval(pollInfo, INFO_EVERY);
  try {
    const body = {
      model: page.model, messages: history, stream: true, reading_rate: rate, max_tokens: maxTokens,
      stream_options: { include_usage: true, continuous_usage_stats: true },
    };
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    page.requestId = r.headers.get("X-Request-Id");
    $("rid").textContent = page.requestId;
    page.streaming = true;
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffered.indexOf("\n\n")) >= 0) {
        const block = buffered.slice(0, end);
        buffered = buffered.slice(end + 2);
        for (const line of block.split("\n")) {
          if (line.startsWith("data: ")) onEvent(line.slice(6));
        }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") showError(String(e.message || e));
  } finally {
    page.streaming = false;
    clearInterval(poll);
    received = pending.reduce((s, c) => s + c.text.slice(c.shownChars), answer.textContent);
    history.push({ role: "assistant", content: received });
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("key").value = sessionStorage.getItem("tokenflowd-key") || "";
$("key").addEventListener("change", () => {
  sessionStorage.setItem("tokenflowd-key", $("key").value.trim()); // this tab only; never sent but as a header
  loadModel();
});
$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || page.streaming) return;
  $("prompt").value = "";
  send(prompt);
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("log").addEventListener("scroll", () => postCursor());
setInterval(reveal, REVEAL_EVERY);
loadModel();
