// Render windows sized by the round trip, and model text turned into HTML fragments that are
// safe to append: every character of the model's text is escaped, and the only markup is the
// renderer's own (a fixed set of tags and class names, no attribute from the text).
//
// Runs in the render worker (render-worker.js) and anywhere else: it has no DOM.

/** Tokens per render window at or below RTT_LOW_MS, and at or above RTT_HIGH_MS. */
export const WINDOW_MAX = 128;
export const WINDOW_MIN = 32;
export const RTT_LOW_MS = 80;
export const RTT_HIGH_MS = 200;

/**
 * The design document's table: 128 tokens at a round trip of 80 ms or less, 32 at 200 ms or
 * more, linear between. Before the first measurement (undefined or NaN) the round trip counts
 * as short.
 */
export function windowFor(rttMs) {
  if (!(rttMs > RTT_LOW_MS)) return WINDOW_MAX;
  if (rttMs >= RTT_HIGH_MS) return WINDOW_MIN;
  const share = (rttMs - RTT_LOW_MS) / (RTT_HIGH_MS - RTT_LOW_MS);
  return Math.round(WINDOW_MAX - share * (WINDOW_MAX - WINDOW_MIN));
}

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// Words highlighted as keywords in code blocks, whatever the language (a reader's aid, not a
// parser: the languages models write most).
const KEYWORDS = new Set(
  `as async await break case catch class const continue def default del do elif else enum
   export extends false False fn for from func function if impl import in interface is lambda
   let loop match mod mut new nil None not null or package pass pub raise return self static
   struct super switch this throw true True try type typeof use var void while with yield`.split(/\s+/),
);

const FENCE = "```";

// CSS classes of the spans in code blocks.
const CODE_CLASS = { kw: "sd-kw", str: "sd-str", com: "sd-com", num: "sd-num" };

/**
 * Markdown as a model streams it, rendered piece by piece: fenced code blocks (highlighted),
 * inline `code` and **bold** in text; everything else is text, newlines are kept.
 *
 * push(text) returns the fragments the text completes; end() those that were held back.
 * A fragment is one of
 *   {kind: "text", html}   append to the current text block
 *   {kind: "code", html}   append to the current code block
 *   {kind: "open", lang}   a code block starts (lang: letters, digits, "+", "-", "#", or "")
 *   {kind: "close"}        the code block ends
 * Each html is balanced on its own (every tag it opens it closes), so fragments can be
 * appended one by one with insertAdjacentHTML. A few characters whose meaning depends on
 * what follows (a fence's backticks, "**", a keyword cut in two) wait for the next push.
 * Markdown left open (a "**" without its pair) ends at the end of its line; an unclosed code
 * block at the end of the reply.
 */
export class MarkdownStream {
  constructor() {
    this.buffer = "";
    this.inCode = false;
    this.atLineStart = true;
    this.blockStart = true; // text: nothing written since the reply or a code block began
    this.bold = false; // text: inside **...**
    this.inlineCode = false; // text: inside `...`
    this.codeState = null; // code: null, "line" or "block" comment, or the open string's quote
    this.fragments = [];
    this.run = ""; // text of one style, not yet escaped
    this.style = "";
  }

  push(text) {
    this.buffer += text;
    return this._drain(false);
  }

  end() {
    const fragments = this._drain(true);
    if (this.inCode) {
      this.inCode = false;
      fragments.push({ kind: "close" });
    }
    return fragments;
  }

  _drain(final) {
    const buf = this.buffer;
    let i = 0;
    while (i < buf.length) {
      const next = this.inCode ? this._code(buf, i, final) : this._text(buf, i, final);
      if (next < 0) break; // the rest waits for more text
      i = next;
    }
    this.buffer = buf.slice(i);
    this._endRun();
    const out = this.fragments;
    this.fragments = [];
    return out;
  }

  // A line starting with a fence opens or closes a code block. Returns the index after the
  // fence's line, -1 to wait, or null when the line is not a fence.
  _fence(buf, i, final) {
    const newline = buf.indexOf("\n", i);
    const line = newline < 0 ? buf.slice(i) : buf.slice(i, newline);
    if (!line.startsWith(FENCE)) {
      return !final && newline < 0 && FENCE.startsWith(line) ? -1 : null;
    }
    if (newline < 0 && !final) return -1;
    const info = line.slice(FENCE.length).trim();
    if (this.inCode && info) return null; // "```js" inside a block is code
    this._endRun();
    if (this.inCode) {
      this.fragments.push({ kind: "close" });
    } else {
      const lang = (info.match(/^[\w+#-]{1,24}/) || [""])[0];
      this.fragments.push({ kind: "open", lang });
    }
    this.inCode = !this.inCode;
    this.blockStart = true;
    this.bold = this.inlineCode = false;
    this.codeState = null;
    this.atLineStart = true;
    return newline < 0 ? buf.length : newline + 1;
  }

  _text(buf, i, final) {
    if (this.atLineStart && buf[i] === "`") {
      const next = this._fence(buf, i, final);
      if (next !== null) return next;
    }
    const ch = buf[i];
    this.atLineStart = ch === "\n";
    if (ch === "\n") {
      this.bold = this.inlineCode = false;
      if (!this.blockStart) this._emit("br", ""); // no blank lines atop a text block
      return i + 1;
    }
    this.blockStart = false;
    if (ch === "`") {
      this.inlineCode = !this.inlineCode;
      return i + 1;
    }
    if (ch === "*" && !this.inlineCode) {
      if (i + 1 === buf.length && !final) return -1;
      if (buf[i + 1] === "*") {
        this.bold = !this.bold;
        return i + 2;
      }
    }
    this._emit((this.bold ? "b" : "") + (this.inlineCode ? "c" : ""), ch);
    return i + 1;
  }

  _code(buf, i, final) {
    if (this.atLineStart && buf[i] === "`") {
      const next = this._fence(buf, i, final);
      if (next !== null) return next;
    }
    const ch = buf[i];
    const state = this.codeState;
    this.atLineStart = ch === "\n";
    if (state === "line") {
      if (ch === "\n") this.codeState = null;
      this._emit(ch === "\n" ? "" : "com", ch);
      return i + 1;
    }
    if (state === "block") {
      if (ch === "*" && i + 1 === buf.length && !final) return -1;
      if (ch === "*" && buf[i + 1] === "/") {
        this.codeState = null;
        this._emit("com", "*/");
        return i + 2;
      }
      this._emit("com", ch);
      return i + 1;
    }
    if (state !== null) {
      // a string: ends at its quote, or (' and ") at the end of the line
      if (ch === "\\") {
        if (i + 1 === buf.length && !final) return -1;
        this._emit("str", buf.slice(i, i + 2));
        return i + 2;
      }
      if (ch === state || (ch === "\n" && state !== "`")) this.codeState = null;
      this._emit(ch === "\n" ? "" : "str", ch);
      return i + 1;
    }
    if (ch === "/" || ch === "#") {
      if (ch === "/" && i + 1 === buf.length && !final) return -1;
      const second = buf[i + 1];
      if (ch === "#" || second === "/" || second === "*") {
        this.codeState = ch === "/" && second === "*" ? "block" : "line";
        const opener = ch === "#" ? "#" : ch + second;
        this._emit("com", opener);
        return i + opener.length;
      }
    }
    if (ch === '"' || ch === "'" || ch === "`") {
      this.codeState = ch;
      this._emit("str", ch);
      return i + 1;
    }
    const word = /^(?:[A-Za-z_$][\w$]*|\d[\w.]*)/.exec(buf.slice(i, i + 256));
    if (word) {
      const end = i + word[0].length;
      if (end === buf.length && !final) return -1; // the word may go on in the next push
      const w = word[0];
      this._emit(/^\d/.test(w) ? "num" : KEYWORDS.has(w) ? "kw" : "", w);
      return end;
    }
    this._emit("", ch);
    return i + 1;
  }

  // Text joins the current run while its style stays the same.
  _emit(style, text) {
    if (style !== this.style) {
      this._endRun();
      this.style = style;
    }
    if (style === "br") {
      this._push(this.inCode ? "code" : "text", "<br>");
      this.style = "";
      return;
    }
    this.run += text;
  }

  _endRun() {
    if (!this.run) return;
    let html = escapeHtml(this.run);
    const style = this.style;
    if (this.inCode) {
      if (style) html = `<span class="${CODE_CLASS[style]}">${html}</span>`;
      this._push("code", html);
    } else {
      if (style.includes("c")) html = `<code>${html}</code>`;
      if (style.includes("b")) html = `<strong>${html}</strong>`;
      this._push("text", html);
    }
    this.run = "";
  }

  _push(kind, html) {
    const last = this.fragments[this.fragments.length - 1];
    if (last && last.kind === kind) last.html += html;
    else this.fragments.push({ kind, html });
  }
}
