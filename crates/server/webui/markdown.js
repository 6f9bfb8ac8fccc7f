// A small Markdown renderer for answers: fenced code blocks, inline code, bold, italics, links (http(s)
// only), headings, lists and paragraphs. It builds DOM nodes (text is never parsed as HTML), so a model
// cannot inject markup into the page.
"use strict";

function renderMarkdown(src, into) {
  into.textContent = "";
  const lines = src.replace(/\r\n/g, "\n").split("\n");
  let i = 0;
  let para = [];
  let list = null;
  const flushPara = () => {
    if (para.length) {
      const p = document.createElement("p");
      inline(para.join("\n"), p);
      into.append(p);
      para = [];
    }
  };
  const flushList = () => {
    if (list) {
      into.append(list);
      list = null;
    }
  };
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
    if (fence) {
      flushPara();
      flushList();
      const code = [];
      i++;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i++]);
      i++; // the closing fence (or the end of a streaming answer)
      const pre = document.createElement("pre");
      const c = document.createElement("code");
      if (fence[1]) c.dataset.lang = fence[1];
      c.textContent = code.join("\n");
      pre.append(c);
      into.append(pre);
      continue;
    }
    const h = line.match(/^(#{1,4})\s+(.*)$/);
    const li = line.match(/^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/);
    if (h) {
      flushPara();
      flushList();
      const e = document.createElement("h" + Math.min(6, h[1].length + 2));
      inline(h[2], e);
      into.append(e);
    } else if (li) {
      flushPara();
      const ordered = li[1] !== undefined;
      if (!list || (list.tagName === "OL") !== ordered) {
        flushList();
        list = document.createElement(ordered ? "ol" : "ul");
      }
      const item = document.createElement("li");
      inline(li[2], item);
      list.append(item);
    } else if (line.trim() === "") {
      flushPara();
      flushList();
    } else {
      flushList();
      para.push(line);
    }
    i++;
  }
  flushPara();
  flushList();
}

// Inline spans: `code`, **bold**, *italic*, [text](http...), line breaks.
function inline(text, into) {
  const re = /(`[^`]+`)|(\*\*[^*]+\*\*)|(\*[^*\s][^*]*\*)|(\[[^\]]+\]\((https?:\/\/[^)\s]+)\))|(\n)/g;
  let at = 0;
  let m;
  while ((m = re.exec(text))) {
    if (m.index > at) into.append(text.slice(at, m.index));
    if (m[1]) into.append(Object.assign(document.createElement("code"), { textContent: m[1].slice(1, -1) }));
    else if (m[2]) into.append(Object.assign(document.createElement("strong"), { textContent: m[2].slice(2, -2) }));
    else if (m[3]) into.append(Object.assign(document.createElement("em"), { textContent: m[3].slice(1, -1) }));
    else if (m[4]) {
      const a = document.createElement("a");
      a.textContent = m[4].slice(1, m[4].indexOf("]"));
      a.href = m[5];
      a.rel = "noopener noreferrer";
      a.target = "_blank";
      into.append(a);
    } else into.append(document.createElement("br"));
    at = re.lastIndex;
  }
  if (at < text.length) into.append(text.slice(at));
}
