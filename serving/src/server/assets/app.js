// The chat page of `gguftool serve`: streams answers from this server's OpenAI endpoint
// (/v1/chat/completions), shows thinking, tool calls and every token's log-probability, and a
// model page from /props. Plain DOM, no dependencies; everything the model writes is inserted
// as text, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], controller: null };

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n : n.toFixed(2)) + " " + u[i];
}

function fmtCount(n) {
  if (n >= 1e9) return (n / 1e9).toFixed(2) + " B";
  if (n >= 1e6) return (n / 1e6).toFixed(2) + " M";
  if (n >= 1e3) return (n / 1e3).toFixed(1) + " k";
  return String(n);
}

// Probability classes of the token view.
function probClass(logprob) {
  const p = Math.exp(logprob);
  if (p >= 0.9) return "p90";
  if (p >= 0.5) return "p50";
  if (p >= 0.2) return "p20";
  return "p0";
}

function tokenSpan(entry) {
  const s = el("span", "token " + probClass(entry.logprob), entry.token);
  const alts = (entry.top_logprobs || [])
    .map((t) => JSON.stringify(t.token) + " " + (100 * Math.exp(t.logprob)).toFixed(1) + "%")
    .join("\n");
  s.title = "p = " + (100 * Math.exp(entry.logprob)).toFixed(2) + "% (logprob " +
    entry.logprob.toFixed(3) + ")" + (alts ? "\nalternatives:\n" + alts : "");
  return s;
}

// One assistant answer being streamed.
class Answer {
  constructor() {
    this.box = el("div", "msg assistant");
    this.box.appendChild(el("div", "role", "assistant"));
    this.reasoningBox = el("details", "reasoning hidden");
    this.reasoningBox.appendChild(el("summary", null, "Thinking"));
    this.reasoningText = el("div");
    this.reasoningBox.appendChild(this.reasoningText);
    this.box.appendChild(this.reasoningBox);
    this.contentEl = el("div", "content");
    this.box.appendChild(this.contentEl);
    this.toolsEl = el("div");
    this.box.appendChild(this.toolsEl);
    this.tokensEl = el("div", "tokens hidden");
    this.box.appendChild(this.tokensEl);
    this.metaEl = el("div", "meta");
    this.box.appendChild(this.metaEl);
    this.content = "";
    this.reasoning = "";
    this.calls = [];
    this.nTokens = 0;
  }
  addContent(t) {
    this.content += t;
    this.contentEl.textContent = this.content;
    // How many streamed pieces made the answer (read by the browser test).
    this.box.dataset.deltas = String(Number(this.box.dataset.deltas || 0) + 1);
  }
  addReasoning(t) {
    this.reasoning += t;
    this.reasoningText.textContent = this.reasoning;
    this.reasoningBox.classList.remove("hidden");
    this.reasoningBox.open = true;
  }
  addTokens(entries) {
    this.tokensEl.classList.remove("hidden");
    for (const e of entries) { this.tokensEl.appendChild(tokenSpan(e)); this.nTokens++; }
  }
  addCallDelta(d) {
    const i = d.index || 0;
    if (!this.calls[i]) this.calls[i] = { id: d.id || "", type: "function", function: { name: "", arguments: "" } };
    const c = this.calls[i];
    if (d.id) c.id = d.id;
    if (d.function && d.function.name) c.function.name += d.function.name;
    if (d.function && d.function.arguments) c.function.arguments += d.function.arguments;
    this.toolsEl.replaceChildren(...this.calls.map((c) => {
      let args = c.function.arguments;
      try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (_) { /* still streaming */ }
      return el("div", "tool-call", "tool call " + c.function.name + "(" + args + ")");
    }));
  }
  error(msg) { this.box.appendChild(el("div", "error", msg)); }
  message() {
    const m = { role: "assistant", content: this.content };
    if (this.calls.length) m.tool_calls = this.calls;
    return m;
  }
}

function addUserMessage(text) {
  const box = el("div", "msg user");
  box.appendChild(el("div", "role", "user"));
  box.appendChild(document.createTextNode(text));
  $("messages").appendChild(box);
}

function requestBody() {
  const msgs = [];
  const system = $("system").value.trim();
  if (system) msgs.push({ role: "system", content: system });
  msgs.push(...state.history);
  const body = {
    model: state.model || "default",
    messages: msgs,
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value) || 128,
  };
  const stops = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stops.length) body.stop = stops;
  if ($("show-logprobs").checked) { body.logprobs = true; body.top_logprobs = 5; }
  const tools = $("tools").value.trim();
  if (tools) body.tools = JSON.parse(tools);
  return body;
}

// Server-sent events from a fetch body: calls `onData` with each `data:` payload.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) onData(line.slice(6));
      }
    }
  }
}

async function send(text) {
  let body;
  try {
    state.history.push({ role: "user", content: text });
    body = requestBody();
  } catch (e) {
    state.history.pop();
    $("status").textContent = "Tools are not valid JSON: " + e.message;
    return;
  }
  addUserMessage(text);
  const answer = new Answer();
  $("messages").appendChild(answer.box);
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop-generation").disabled = false;
  $("status").textContent = "generating…";
  const t0 = performance.now();
  let finish = null, usage = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || ("HTTP " + r.status));
    }
    await readEvents(r, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) { answer.error(chunk.error.message); return; }
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const d = choice.delta || {};
      if (d.reasoning_content) answer.addReasoning(d.reasoning_content);
      if (d.content) answer.addContent(d.content);
      if (d.tool_calls) d.tool_calls.forEach((c) => answer.addCallDelta(c));
      if (choice.logprobs && choice.logprobs.content) answer.addTokens(choice.logprobs.content);
      if (choice.finish_reason) finish = choice.finish_reason;
    });
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped by you";
    else answer.error(e.message);
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop-generation").disabled = true;
  }
  state.history.push(answer.message());
  const secs = (performance.now() - t0) / 1000;
  const n = usage ? usage.completion_tokens : answer.nTokens;
  const meta = [finish ? "finish: " + finish : null, n + " tokens", secs.toFixed(2) + " s",
    secs > 0 ? (n / secs).toFixed(1) + " tokens/s" : null].filter(Boolean).join(" · ");
  answer.metaEl.textContent = meta;
  $("status").textContent = "";
}

function table(headersRow, rows) {
  const t = el("table");
  const head = el("tr");
  headersRow.forEach((h) => head.appendChild(el("th", null, h)));
  t.appendChild(head);
  for (const r of rows) {
    const tr = el("tr");
    r.forEach((c, i) => {
      const td = el("td", i > 0 ? "num" : null);
      if (c instanceof Node) td.appendChild(c); else td.textContent = c;
      tr.appendChild(td);
    });
    t.appendChild(tr);
  }
  return t;
}

function verifySummary(v) {
  const box = el("div");
  if (!v) { box.appendChild(el("p", "muted", "Not run yet.")); return box; }
  box.appendChild(table(["", ""], [
    ["tensors checked", String(v.tensors)],
    ["bytes read", fmtBytes(v.bytes)],
    ["seconds", v.seconds.toFixed(2)],
    ["NaN values", String(v.n_nan)],
    ["infinite values", String(v.n_inf)],
    ["findings", String(v.findings.length)],
  ]));
  box.appendChild(el("p", "muted", "Layout: " + v.layout));
  if (v.findings.length) {
    box.appendChild(table(["tensor", "kind", "message"], v.findings.map((f) => [f.tensor, f.kind, f.message])));
  }
  return box;
}

function renderModel(props) {
  const m = props.model;
  const box = $("model-info");
  box.replaceChildren();
  box.appendChild(el("h2", null, props.model_alias));
  if (!m) { box.appendChild(el("p", "muted", "No GGUF details for this backend.")); return; }
  box.appendChild(table(["", ""], [
    ["architecture", m.architecture || "–"],
    ["name", m.name || "–"],
    ["parameters", fmtCount(m.parameters)],
    ["tensors", String(m.n_tensors)],
    ["blocks", String(m.blocks)],
    ["shards", String(m.shards)],
    ["file size", fmtBytes(m.file_bytes)],
    ["context length", String(m.context_length)],
    ["vocabulary", String(m.vocab_size)],
    ["tool format", props.chat_template_caps.tool_format],
    ["thinking tokens", props.chat_template_caps.thinking_tokens ? "yes" : "no"],
  ]));
  box.appendChild(el("h3", null, "Quantization mix"));
  const types = Object.entries(m.tensor_types).sort((a, b) => b[1].bytes - a[1].bytes);
  const total = types.reduce((s, [, t]) => s + t.bytes, 0) || 1;
  box.appendChild(table(["type", "tensors", "bytes", "share"], types.map(([name, t]) => {
    const share = t.bytes / total;
    const bar = el("span", "bar w" + Math.round(share * 10));
    const cell = el("span");
    cell.appendChild(bar);
    cell.appendChild(document.createTextNode(" " + (100 * share).toFixed(1) + "%"));
    return [name, String(t.count), fmtBytes(t.bytes), cell];
  })));
  box.appendChild(el("h3", null, "Tensor counts by role"));
  box.appendChild(table(["role", "tensors"], Object.entries(m.tensor_roles).map(([r, n]) => [r, String(n)])));
  box.appendChild(el("h3", null, "Memory plan"));
  const mem = m.memory;
  box.appendChild(table(["", ""], [
    ["weights", fmtBytes(mem.weight_bytes)],
    ["KV cache slots x context", mem.kv_slots + " x " + m.context_length + " = " + mem.kv_capacity_tokens + " tokens"],
    ["KV bytes per token (measured)", mem.kv_bytes_per_token === null ? "– (no sequence ran yet)" : fmtBytes(mem.kv_bytes_per_token)],
    ["KV cache at capacity", fmtBytes(mem.kv_bytes_at_capacity)],
  ]));
  $("verify-result").replaceChildren(verifySummary(m.verify));
}

async function loadProps() {
  try {
    const r = await fetch("/props", { headers: headers() });
    const props = await r.json();
    if (!r.ok) throw new Error((props.error && props.error.message) || ("HTTP " + r.status));
    state.model = props.model_alias;
    $("model-name").textContent = props.model_alias;
    renderModel(props);
  } catch (e) {
    $("model-name").textContent = "(" + e.message + ")";
  }
}

function showTab(name) {
  for (const t of ["chat", "model"]) {
    $("view-" + t).classList.toggle("hidden", t !== name);
    $("tab-" + t).classList.toggle("active", t === name);
  }
  if (name === "model") loadProps();
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = localStorage.getItem("gguftool-api-key") || "";
  $("api-key").addEventListener("change", () => { localStorage.setItem("gguftool-api-key", $("api-key").value); loadProps(); });
  $("temperature").addEventListener("input", () => { $("temperature-value").textContent = $("temperature").value; });
  $("tab-chat").addEventListener("click", () => showTab("chat"));
  $("tab-model").addEventListener("click", () => showTab("model"));
  $("clear").addEventListener("click", () => { state.history = []; $("messages").replaceChildren(); });
  $("stop-generation").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("run-verify").addEventListener("click", async () => {
    $("run-verify").disabled = true;
    $("verify-result").replaceChildren(el("p", "muted", "verifying…"));
    try {
      const r = await fetch("/verify", { method: "POST", headers: headers(), body: "{}" });
      const v = await r.json();
      if (!r.ok) throw new Error((v.error && v.error.message) || ("HTTP " + r.status));
      $("verify-result").replaceChildren(verifySummary(v));
    } catch (e) {
      $("verify-result").replaceChildren(el("p", "error", e.message));
    } finally {
      $("run-verify").disabled = false;
    }
  });
  loadProps();
});
