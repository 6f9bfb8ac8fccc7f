// A small Markdown renderer for answers: fenced code blocks (with a copy button), inline code, bold,
// italics, links (http(s) only, written or bare), headings, nested and numbered lists, blockquotes,
// tables and paragraphs. It builds DOM nodes (text is never parsed as HTML), so a model cannot inject
// markup into the page.
"use strict";

function renderMarkdown(src, into) {
  into.textContent = "";
  blocks(src.replace(/\r\n/g, "\n").split("\n"), into);
}

// Renders `lines` into `into`, block by block.
function blocks(lines, into) {
  let i = 0;
  let para = [];
  let lists = []; // open lists, outermost first: {indent, el}
  const flushPara = () => {
    if (para.length) {
      const p = document.createElement("p");
      inline(para.join("\n"), p);
      into.append(p);
      para = [];
    }
  };
  const flushLists = () => (lists = []);
  const cells = (row) => row.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
    if (fence) {
      flushPara();
      flushLists();
      const code = [];
      i++;
      while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i++]);
      i++; // the closing fence (or the end of a streaming answer)
      into.append(codeBlock(code.join("\n"), fence[1]));
      continue;
    }
    // A table: a header row, a |---|---| row, then rows.
    if (line.includes("|") && i + 1 < lines.length && /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/.test(lines[i + 1])) {
      flushPara();
      flushLists();
      const table = document.createElement("table");
      const head = table.createTHead().insertRow();
      for (const c of cells(line)) inline(c, head.appendChild(document.createElement("th")));
      const body = table.createTBody();
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim() !== "") {
        const row = body.insertRow();
        for (const c of cells(lines[i++])) inline(c, row.insertCell());
      }
      into.append(table);
      continue;
    }
    if (/^\s*>/.test(line)) {
      flushPara();
      flushLists();
      const quoted = [];
      while (i < lines.length && /^\s*>/.test(lines[i])) quoted.push(lines[i++].replace(/^\s*>\s?/, ""));
      const q = document.createElement("blockquote");
      blocks(quoted, q);
      into.append(q);
      continue;
    }
    const h = line.match(/^(#{1,4})\s+(.*)$/);
    const li = line.match(/^(\s*)(?:[-*+]|(\d+)[.)])\s+(.*)$/);
    if (h) {
      flushPara();
      flushLists();
      const e = document.createElement("h" + Math.min(6, h[1].length + 2));
      inline(h[2], e);
      into.append(e);
    } else if (li) {
      flushPara();
      const indent = li[1].length;
      const ordered = li[2] !== undefined;
      while (lists.length && lists[lists.length - 1].indent > indent) lists.pop();
      let top = lists[lists.length - 1];
      if (top && top.indent === indent && (top.el.tagName === "OL") !== ordered) {
        lists.pop();
        top = lists[lists.length - 1];
      }
      if (!top || top.indent < indent) {
        const list = document.createElement(ordered ? "ol" : "ul");
        if (ordered && li[2] !== "1") list.start = Number(li[2]);
        const parent = top && top.el.lastElementChild;
        (parent || into).append(list);
        lists.push({ indent, el: list });
        top = lists[lists.length - 1];
      }
      const item = document.createElement("li");
      inline(li[3], item);
      top.el.append(item);
    } else if (line.trim() === "") {
      flushPara();
      flushLists();
    } else {
      flushLists();
      para.push(line);
    }
    i++;
  }
  flushPara();
}

// A code block with a button that copies its text (the clipboard API where the page is a secure
// context, else a selection and the copy command).
function codeBlock(text, lang) {
  const pre = document.createElement("pre");
  const c = document.createElement("code");
  if (lang) c.dataset.lang = lang;
  c.textContent = text;
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  copy.onclick = async () => {
    try {
      await navigator.clipboard.writeText(text);
    } catch (_) {
      const r = document.createRange();
      r.selectNodeContents(c);
      getSelection().removeAllRanges();
      getSelection().addRange(r);
      document.execCommand("copy");
    }
    copy.textContent = "Copied";
  };
  pre.append(copy, c);
  return pre;
}

// Inline spans: `code`, **bold**, *italic*, [text](http...), bare http(s) URLs, line breaks.
function inline(text, into) {
  const re = /(`[^`]+`)|(\*\*[^*]+\*\*)|(\*[^*\s][^*]*\*)|(\[[^\]]+\]\((https?:\/\/[^)\s]+)\))|(https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"])|(\n)/g;
  let at = 0;
  let m;
  const link = (label, href) => {
    const a = document.createElement("a");
    a.textContent = label;
    a.href = href;
    a.rel = "noopener noreferrer";
    a.target = "_blank";
    into.append(a);
  };
  while ((m = re.exec(text))) {
    if (m.index > at) into.append(text.slice(at, m.index));
    if (m[1]) into.append(Object.assign(document.createElement("code"), { textContent: m[1].slice(1, -1) }));
    else if (m[2]) into.append(Object.assign(document.createElement("strong"), { textContent: m[2].slice(2, -2) }));
    else if (m[3]) into.append(Object.assign(document.createElement("em"), { textContent: m[3].slice(1, -1) }));
    else if (m[4]) link(m[4].slice(1, m[4].indexOf("]")), m[5]);
    else if (m[6]) link(m[6], m[6]);
    else into.append(document.createElement("br"));
    at = re.lastIndex;
  }
  if (at < text.length) into.append(text.slice(at));
}
