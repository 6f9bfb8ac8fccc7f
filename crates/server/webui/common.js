// Shared by the chat and the dashboard: the API key (asked once, kept in this browser) and fetch with it.
"use strict";

const KEY = "osprey.apiKey";

function apiKey() {
  return localStorage.getItem(KEY) || "";
}

function askKey() {
  return new Promise((resolve) => {
    const dlg = document.getElementById("key-dialog");
    const input = document.getElementById("key-input");
    input.value = "";
    dlg.addEventListener("close", function done() {
      dlg.removeEventListener("close", done);
      const k = input.value.trim();
      if (k) localStorage.setItem(KEY, k);
      resolve(k);
    });
    dlg.showModal();
    input.focus();
  });
}

// fetch with the key; on 401 ask for it once and retry.
async function api(path, init = {}) {
  const send = () => {
    const headers = Object.assign({}, init.headers || {});
    const k = apiKey();
    if (k) headers["Authorization"] = "Bearer " + k;
    return fetch(path, Object.assign({}, init, { headers }));
  };
  let r = await send();
  if (r.status === 401) {
    localStorage.removeItem(KEY);
    if (await askKey()) r = await send();
  }
  return r;
}

// The OpenAI error envelope (or Anthropic's) as one line.
async function errorText(r) {
  let body = "";
  try {
    body = await r.text();
    const v = JSON.parse(body);
    const e = v.error || {};
    return `${r.status} ${e.code || e.type || ""}: ${e.message || body}`;
  } catch (_) {
    return `${r.status}: ${body}`;
  }
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}
