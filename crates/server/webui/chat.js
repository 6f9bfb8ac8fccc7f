// The chat page: conversations kept in this browser (localStorage), answers streamed from
// /v1/chat/completions and rendered as Markdown, reasoning in a collapsible block, tool calls shown,
// images and short videos attached (videos become frames sampled here), stop / regenerate / edit.
"use strict";

const STORE = "osprey.conversations";
const SETTINGS = "osprey.settings";
const $ = (id) => document.getElementById(id);

let conversations = load(STORE, []);
let current = conversations[0] ? conversations[0].id : null;
let attachments = []; // [{kind: "image"|"video", urls: [data URLs], name}]
let running = null; // AbortController of the answer being streamed
let editing = null; // {cid, i}: the user message being edited (replaced when the edit is sent)
let capabilities = []; // from /v1/models: what the empty chat says the model can do

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) || fallback;
  } catch (_) {
    return fallback;
  }
}

// Saves the conversations; if the browser's quota is exceeded, the media of older messages are dropped
// from what is kept (the text stays).
function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
  } catch (_) {
    const slim = conversations.map((c) => ({
      ...c,
      messages: c.messages.map((m) => ({ ...m, media: (m.media || []).map((a) => ({ kind: a.kind, name: a.name, urls: [] })) })),
    }));
    try {
      localStorage.setItem(STORE, JSON.stringify(slim));
    } catch (_) {}
  }
}

function conv() {
  return conversations.find((c) => c.id === current);
}

function newConversation() {
  const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
  conversations.unshift(c);
  current = c.id;
  save();
  render();
}

// ---- settings ----
const settingIds = ["system", "temperature", "top_p", "max_tokens", "thinking", "extra"];
function loadSettings() {
  const s = load(SETTINGS, {});
  for (const id of settingIds) {
    if (typeof s[id] === "string") $(id).value = s[id];
  }
}
function saveSettings() {
  const s = {};
  for (const id of settingIds) s[id] = $(id).value;
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}

// "More request fields": the JSON object the request is merged with, or an error (nothing is sent then,
// and the typed message and its attachments stay).
function extraFields() {
  const text = $("extra").value.trim();
  if (!text) return { fields: {} };
  try {
    const v = JSON.parse(text);
    if (v === null || typeof v !== "object" || Array.isArray(v)) return { error: "More request fields: not a JSON object" };
    return { fields: v };
  } catch (e) {
    return { error: `More request fields: ${e.message}` };
  }
}

function notice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

// ---- rendering ----
function render() {
  const list = $("conversations");
  list.textContent = "";
  for (const c of conversations) {
    const li = el("li", { class: c.id === current ? "current" : "" });
    const open = el("a", { href: "#", text: c.title });
    open.onclick = (e) => {
      e.preventDefault();
      current = c.id;
      toggleSide(false);
      render();
    };
    const del = el("button", { class: "del", title: "Delete", text: "×" });
    del.onclick = () => {
      conversations = conversations.filter((x) => x.id !== c.id);
      if (current === c.id) current = conversations[0] ? conversations[0].id : null;
      save();
      render();
    };
    li.append(open, del);
    list.append(li);
  }
  const box = $("messages");
  box.textContent = "";
  const c = conv();
  if (!c || !c.messages.length) {
    box.append(el("div", { class: "empty", text: emptyText() }));
    return;
  }
  c.messages.forEach((m, i) => box.append(messageView(m, i, c)));
  box.scrollTop = box.scrollHeight;
}

// What an empty chat says: what this model takes, and how to give it.
function emptyText() {
  const media = [["vision", "images"], ["video", "videos"]].filter(([k]) => capabilities.includes(k)).map(([, v]) => v);
  const takes = media.length ? `text, ${media.join(" and ")}` : "text";
  const how = media.length ? " Attach, paste or drop a picture and ask what it shows." : "";
  return `${$("model").textContent || "The model"} reads ${takes}.${how} Settings (☰ on a phone) set the system prompt and sampling; answers stream here and stay in this browser.`;
}

function toggleSide(open) {
  $("side").classList.toggle("open", open);
  $("menu").setAttribute("aria-expanded", String(open));
}

function messageView(m, i, c) {
  const div = el("div", { class: "msg " + m.role });
  if (m.role === "user") {
    const media = el("div", { class: "media" });
    for (const a of m.media || []) {
      if (a.urls[0]) media.append(el("img", { src: a.urls[0], alt: a.name, title: a.kind === "video" ? `video, ${a.urls.length} frames` : a.name }));
      else media.append(el("span", { class: "dropped", text: `[${a.kind} ${a.name}]` }));
    }
    div.append(media, el("div", { class: "content", text: m.content }));
    if (editing && editing.cid === c.id && editing.i === i) div.classList.add("editing");
    const edit = el("button", { class: "small edit", text: "Edit" });
    // The message and what follows it are replaced only when the edit is sent; Cancel edit keeps them.
    edit.onclick = () => {
      if (running) return;
      editing = { cid: c.id, i };
      $("input").value = m.content;
      attachments = (m.media || []).filter((a) => a.urls.length);
      $("cancel-edit").hidden = false;
      render();
      showAttachments();
      $("input").focus();
    };
    div.append(edit);
    return div;
  }
  if (m.reasoning) {
    const d = el("details", { class: "reasoning" }, el("summary", { text: "Reasoning" }), el("div", { text: m.reasoning }));
    div.append(d);
  }
  const content = el("div", { class: "content" });
  renderMarkdown(m.content || "", content);
  div.append(content);
  for (const t of m.tool_calls || []) {
    div.append(el("pre", { class: "tool-call", text: `tool call: ${t.function.name}(${t.function.arguments})` }));
  }
  if (m.error) div.append(el("div", { class: "error", text: m.error }));
  if (m.stats) div.append(el("div", { class: "stats", text: m.stats }));
  if (i === c.messages.length - 1 && !running) {
    const again = el("button", { class: "small regenerate", text: "Regenerate" });
    again.onclick = () => {
      const extra = extraFields();
      if (extra.error) return notice(extra.error);
      c.messages.pop();
      save();
      send(null, extra.fields);
    };
    div.append(again);
  }
  return div;
}

function showAttachments() {
  const box = $("attachments");
  box.textContent = "";
  attachments.forEach((a, i) => {
    const chip = el("span", { class: "chip", title: a.name });
    chip.append(el("img", { src: a.urls[0], alt: a.name }), `${a.kind === "video" ? "video " + a.urls.length + " frames" : a.name}`);
    const x = el("button", { class: "del", text: "×" });
    x.onclick = () => {
      attachments.splice(i, 1);
      showAttachments();
    };
    chip.append(x);
    box.append(chip);
  });
}

// ---- attachments ----
function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

// Frames of a video file sampled at 2 per second (at most 16, at most 448 px on a side), as PNG data URLs.
async function videoFrames(file) {
  const url = URL.createObjectURL(file);
  const v = document.createElement("video");
  v.muted = true;
  v.src = url;
  await new Promise((ok, fail) => {
    v.onloadedmetadata = ok;
    v.onerror = () => fail(new Error("cannot read this video in the browser"));
  });
  const scale = Math.min(1, 448 / Math.max(v.videoWidth, v.videoHeight));
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(v.videoWidth * scale));
  canvas.height = Math.max(1, Math.round(v.videoHeight * scale));
  const ctx = canvas.getContext("2d");
  const frames = [];
  for (let t = 0; t < v.duration && frames.length < 16; t += 0.5) {
    v.currentTime = t;
    await new Promise((ok) => (v.onseeked = ok));
    ctx.drawImage(v, 0, 0, canvas.width, canvas.height);
    frames.push(canvas.toDataURL("image/png"));
  }
  URL.revokeObjectURL(url);
  return frames;
}

async function addFiles(files) {
  const images = [];
  for (const f of files) {
    try {
      if (f.type.startsWith("video/")) attachments.push({ kind: "video", name: f.name, urls: await videoFrames(f) });
      else if (f.type.startsWith("image/")) images.push({ kind: "image", name: f.name, urls: [await readDataUrl(f)] });
    } catch (e) {
      notice(`${f.name}: ${e.message}`);
    }
  }
  if ($("as-video").checked && images.length > 1) {
    attachments.push({ kind: "video", name: `${images.length} frames`, urls: images.map((a) => a.urls[0]) });
  } else attachments.push(...images);
  showAttachments();
}

// ---- the request ----
function apiMessages(c) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of c.messages) {
    if (m.role === "user") {
      const parts = [];
      for (const a of m.media || []) {
        if (!a.urls.length) continue;
        if (a.kind === "video") parts.push({ type: "video", video: a.urls, fps: 2 });
        else parts.push({ type: "image_url", image_url: { url: a.urls[0] } });
      }
      out.push({ role: "user", content: parts.length ? [...parts, { type: "text", text: m.content }] : m.content });
    } else if (!m.error || m.content) {
      const a = { role: "assistant", content: m.content || "" };
      if (m.tool_calls && m.tool_calls.length) a.tool_calls = m.tool_calls;
      out.push(a);
    }
  }
  return out;
}

function cancelEdit() {
  editing = null;
  $("cancel-edit").hidden = true;
  $("input").value = "";
  attachments = [];
  showAttachments();
  render();
}

async function send(text, extra) {
  if (running) return;
  notice("");
  if (!conv()) newConversation();
  const c = conv();
  if (text !== null) {
    if (editing && editing.cid === c.id) c.messages = c.messages.slice(0, editing.i);
    editing = null;
    $("cancel-edit").hidden = true;
    c.messages.push({ role: "user", content: text, media: attachments });
    if (c.title === "New chat") c.title = text.slice(0, 40) || "Media";
    attachments = [];
    showAttachments();
  }
  const answer = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
  // A setting left empty is not sent: the API's own default applies (temperature 1, top-p 1, as many
  // tokens as the context and the KV pool leave, the template's thinking default).
  const body = { messages: apiMessages(c), stream: true, stream_options: { include_usage: true } };
  for (const k of ["temperature", "top_p", "max_tokens"]) if ($(k).value !== "") body[k] = Number($(k).value);
  if ($("thinking").value) body.chat_template_kwargs = { enable_thinking: $("thinking").value === "on" };
  // Fields the settings do not have (top_k, seed, ignore_eos, ...), as the API takes them.
  Object.assign(body, extra || {});
  c.messages.push(answer);
  save();
  running = new AbortController();
  $("stop").hidden = false;
  $("send").disabled = true;
  render();
  // The answer is painted only while its conversation is shown; switching away and back shows where
  // it stands (the message object is the one being filled).
  const view = () => (current === c.id ? $("messages").lastElementChild : null);
  const t0 = performance.now();
  let first = null;
  let usage = null;
  let finish = null;
  let chunks = 0;
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: running.signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, nl).trim();
        buf = buf.slice(nl + 1);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const ev = JSON.parse(line.slice(6));
        if (ev.error) throw new Error(`${ev.error.code || ev.error.type}: ${ev.error.message}`);
        if (ev.usage) usage = ev.usage;
        const ch = ev.choices && ev.choices[0];
        if (!ch) continue;
        const d = ch.delta || {};
        if (d.content || d.reasoning_content || d.tool_calls) {
          if (first === null) first = performance.now();
          chunks++;
        }
        if (d.content) answer.content += d.content;
        if (d.reasoning_content) answer.reasoning += d.reasoning_content;
        for (const tc of d.tool_calls || []) {
          const t = (answer.tool_calls[tc.index] ||= { id: "", type: "function", function: { name: "", arguments: "" } });
          if (tc.id) t.id = tc.id;
          if (tc.function && tc.function.name) t.function.name += tc.function.name;
          if (tc.function && tc.function.arguments) t.function.arguments += tc.function.arguments;
        }
        if (ch.finish_reason) finish = ch.finish_reason;
        updateAnswer(view(), answer);
      }
    }
  } catch (e) {
    answer.error = e.name === "AbortError" ? "stopped" : e.message;
  }
  answer.stats = stats(usage, t0, first, performance.now(), chunks, finish, answer.error);
  running = null;
  $("stop").hidden = true;
  $("send").disabled = false;
  save();
  render();
}

// The answer's line of numbers. A rate needs enough tokens over enough time to mean something (five
// tokens that arrive in one read once showed "5000 tok/s"); a stopped answer has no usage, so it shows
// what the page saw.
function stats(usage, t0, first, end, chunks, finish, error) {
  const ttft = first === null ? "" : ` · TTFT ${((first - t0) / 1000).toFixed(2)} s`;
  if (!usage) return chunks ? `stopped after ${((end - t0) / 1000).toFixed(1)} s · ${chunks} chunks received${ttft}` : "";
  const gen = usage.completion_tokens;
  const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
  const span = first === null ? 0 : (end - first) / 1000;
  const rate = gen >= 8 && span >= 0.25 ? ` · ${((gen - 1) / span).toFixed(1)} tok/s` : "";
  return `prompt ${usage.prompt_tokens} · cached ${cached} · generated ${gen}${ttft}${rate}` + (finish ? ` · ${finish}` : "");
}

function updateAnswer(div, m) {
  if (!div) return;
  let r = div.querySelector(".reasoning");
  if (m.reasoning && !r) {
    r = el("details", { class: "reasoning" }, el("summary", { text: "Reasoning" }), el("div"));
    div.prepend(r);
  }
  if (r) r.lastElementChild.textContent = m.reasoning;
  renderMarkdown(m.content, div.querySelector(".content"));
  div.querySelectorAll(".tool-call").forEach((t) => t.remove());
  for (const t of m.tool_calls) {
    div.append(el("pre", { class: "tool-call", text: `tool call: ${t.function.name}(${t.function.arguments})` }));
  }
  $("messages").scrollTop = $("messages").scrollHeight;
}

// ---- wiring ----
$("composer").onsubmit = (e) => {
  e.preventDefault();
  if (running) return;
  // Line breaks inside the message are kept; only its ends are trimmed.
  const text = $("input").value.replace(/^\s*\n|\s+$/g, "");
  if (!text.trim() && !attachments.length) return;
  const extra = extraFields();
  if (extra.error) return notice(extra.error); // the text and the attachments stay
  $("input").value = "";
  send(text, extra.fields);
};
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").onclick = () => running && running.abort();
$("cancel-edit").onclick = cancelEdit;
$("attach").onclick = () => $("file").click();
$("menu").onclick = () => toggleSide(!$("side").classList.contains("open"));
$("extra").addEventListener("input", () => notice(""));
$("new-chat").onclick = newConversation;
$("file").onchange = (e) => addFiles([...e.target.files]).then(() => (e.target.value = ""));
document.addEventListener("paste", (e) => {
  const files = [...(e.clipboardData || {}).files || []];
  if (files.length) addFiles(files);
});
document.addEventListener("dragover", (e) => e.preventDefault());
document.addEventListener("drop", (e) => {
  e.preventDefault();
  addFiles([...e.dataTransfer.files]);
});
for (const id of settingIds) $(id).addEventListener("change", saveSettings);
$("forget-key").onclick = () => localStorage.removeItem(KEY);

loadSettings();
render();
$("input").focus();
api("/v1/models").then(async (r) => {
  if (r.ok) {
    const m = (await r.json()).data[0];
    capabilities = m.capabilities || [];
    $("model").textContent = m.id;
  } else $("model").textContent = await errorText(r);
  render();
});
