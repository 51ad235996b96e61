// The main thread's side of rendering: tokens go to the render worker, windows of fragments
// come back and are appended to a container. Nothing here parses the model's text.

const WORKER_URL = new URL("./render-worker.js", import.meta.url);

/**
 * A reply rendered into `container` (an element). push(text, tokens, rttMs) for each token
 * frame, end() when the reply is over (resolves when the last window is appended).
 *
 * `stats` holds, for every appended window, its tokens, its window size and the main thread's
 * milliseconds to append it and lay the page out again (`appendMs`).
 */
export class TokenView {
  constructor(container, { maxWaitMs = 100, workerUrl = WORKER_URL, onWindow = null } = {}) {
    this.container = container;
    this.onWindow = onWindow;
    this.stats = [];
    this._text = null; // the text block fragments of kind "text" go into
    this._code = null; // the open code block, if any
    this._ended = new Map();
    this._nextEnd = 0;
    this.worker = new Worker(workerUrl, { type: "module" });
    this.worker.onmessage = ({ data }) => this._onMessage(data);
    this.worker.postMessage({ type: "config", maxWaitMs });
  }

  push(text, tokens = 1, rttMs = undefined) {
    this.worker.postMessage({ type: "push", text, tokens, rttMs });
  }

  end() {
    const id = this._nextEnd++;
    return new Promise((resolve) => {
      this._ended.set(id, resolve);
      this.worker.postMessage({ type: "end", id });
    });
  }

  /** Forget the reply being rendered (its held tokens too); the next push starts a new one. */
  reset() {
    this.worker.postMessage({ type: "reset" });
    this._text = this._code = null;
  }

  terminate() {
    this.worker.terminate();
  }

  _onMessage(data) {
    if (data.type === "ended") {
      this._ended.get(data.id)?.();
      this._ended.delete(data.id);
      return;
    }
    const started = performance.now();
    this.append(data.fragments);
    void this.container.offsetHeight; // style and layout now, so that their cost counts here
    const appendMs = performance.now() - started;
    const record = { tokens: data.tokens, window: data.window, appendMs };
    this.stats.push(record);
    this.onWindow?.(record);
  }

  /** Append fragments made by MarkdownStream (render.js). */
  append(fragments) {
    for (const fragment of fragments) {
      switch (fragment.kind) {
        case "open": {
          const pre = document.createElement("pre");
          const code = document.createElement("code");
          if (fragment.lang) code.dataset.lang = fragment.lang;
          pre.append(code);
          this.container.append(pre);
          this._code = code;
          this._text = null;
          break;
        }
        case "close":
          this._code = null;
          break;
        case "code":
          if (!this._code) this.append([{ kind: "open", lang: "" }]);
          this._code.insertAdjacentHTML("beforeend", fragment.html);
          break;
        case "text":
          if (!this._text) {
            this._text = document.createElement("div");
            this._text.className = "sd-text";
            this.container.append(this._text);
          }
          this._text.insertAdjacentHTML("beforeend", fragment.html);
          break;
      }
    }
  }
}
