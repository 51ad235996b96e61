// Seedance's browser client for the /v2/infer protocol (docs/protocol.md), over a WebSocket or
// WebTransport (webtransport.js): sessions, replies as async iterators, cancel, binary
// heartbeats with a rolling round trip, reconnect with resume of resumable replies, typed errors
// with the protocol's codes, and end-to-end encryption of every frame (e2e.js).

import { Handshake, SEALED, toHex } from "./e2e.js";
import { TENSOR, decodeTensor, encodeTensor } from "./tensors.js";
import { WebTransportSocket, hasWebTransport, webTransportOffer } from "./webtransport.js";

export const SUBPROTOCOL = "seedance.v2";

const HEARTBEAT_PING = 0x01;
const HEARTBEAT_PONG = 0x02;

/** Close codes after which a session reconnects: no close frame, the server going away or
 * restarting, a fault of the server, try again later. */
export const RECONNECT_CODES = new Set([1001, 1006, 1011, 1012, 1013]);

// ------------------------------------------------------------------------------- errors

export class SeedanceError extends Error {
  static code = "internal_error";
  static retryable = false;

  constructor(message, { code, retryable, retryAfter = null, requestId = null, reason = null } = {}) {
    super(message);
    this.name = new.target.name;
    this.code = code ?? new.target.code;
    this.retryable = retryable ?? new.target.retryable;
    this.retryAfter = retryAfter; // seconds, where the server said
    this.requestId = requestId;
    this.reason = reason; // history_lost, encryption_failed: why
  }
}

export class InvalidJSON extends SeedanceError { static code = "invalid_json"; }
export class InvalidRequest extends SeedanceError { static code = "invalid_request"; }
export class UnsupportedFrame extends SeedanceError { static code = "unsupported_frame"; }
export class SessionBusy extends SeedanceError { static code = "session_busy"; static retryable = true; }
export class ContextOverflow extends SeedanceError { static code = "context_overflow"; }
export class ModelNotFound extends SeedanceError { static code = "model_not_found"; }
export class Unauthorized extends SeedanceError { static code = "unauthorized"; }
export class Forbidden extends SeedanceError { static code = "forbidden"; }
export class QuotaExceeded extends SeedanceError { static code = "quota_exceeded"; static retryable = true; }
export class Overloaded extends SeedanceError { static code = "overloaded"; static retryable = true; }
export class PayloadTooLarge extends SeedanceError { static code = "payload_too_large"; }
export class EngineError extends SeedanceError { static code = "engine_error"; static retryable = true; }
export class InternalError extends SeedanceError { static code = "internal_error"; }
export class HistoryLost extends SeedanceError { static code = "history_lost"; }
/** End-to-end encryption failed; `reason`: handshake (the server is not the pinned one, or its
 * agreement does not verify), bad_tag, replayed, reordered, unknown_key, mismatch, malformed,
 * plaintext. The connection closes with 4400 and nothing of the frame is delivered. */
export class EncryptionFailed extends SeedanceError { static code = "encryption_failed"; }

/** The socket closed (client side only); `closeCode` is the WebSocket close code. */
export class ConnectionClosed extends SeedanceError {
  static code = "connection_closed";
  static retryable = true;

  constructor(closeCode, closeReason = "") {
    super(`connection closed (${closeCode}${closeReason ? `: ${closeReason}` : ""})`);
    this.closeCode = closeCode;
    this.closeReason = closeReason;
  }
}

const ERRORS = Object.fromEntries(
  [
    InvalidJSON, InvalidRequest, UnsupportedFrame, SessionBusy, ContextOverflow, ModelNotFound,
    Unauthorized, Forbidden, QuotaExceeded, Overloaded, PayloadTooLarge, EngineError,
    InternalError, HistoryLost, EncryptionFailed,
  ].map((cls) => [cls.code, cls]),
);

/** The error of an `error` frame's body, as its class (SeedanceError for a code it does not know). */
export function errorFromWire(body, requestId = null) {
  const cls = ERRORS[body.code] ?? SeedanceError;
  return new cls(body.message, {
    code: body.code,
    retryable: body.retryable,
    retryAfter: body.retry_after ?? null,
    requestId,
    reason: body.reason ?? null,
  });
}

// ------------------------------------------------------------------------------ quality of service

const QOS_CLASSES = ["critical", "high", "normal", "low", "background"];

/** `{class: "high", slatag: "checkout", healthScore: 0.92}` (or the header's text) as the
 * `qos` field / X-QoS-Priority value: `high; slatag=checkout; health_score=0.92`. */
export function formatQoS(qos) {
  if (qos == null || typeof qos === "string") return qos ?? undefined;
  const cls = qos.class ?? "normal";
  if (!QOS_CLASSES.includes(cls)) throw new InvalidRequest(`unknown QoS class '${cls}'`);
  let text = cls;
  if (qos.slatag) text += `; slatag=${qos.slatag}`;
  if (qos.healthScore != null) text += `; health_score=${Math.round(qos.healthScore * 100) / 100}`;
  return text;
}

// ------------------------------------------------------------------------------ connecting

/** ws(s)://host:port/v2/infer?... from a ws, wss, http or https URL (path optional), or from
 * the page's own origin when `url` is empty. */
export function inferUrl(url, params = {}) {
  const base = url || globalThis.location?.origin;
  const target = new URL(base, globalThis.location?.href);
  if (target.protocol === "http:") target.protocol = "ws:";
  else if (target.protocol === "https:") target.protocol = "wss:";
  if (target.protocol !== "ws:" && target.protocol !== "wss:") {
    throw new InvalidRequest(`url must start with ws://, wss://, http:// or https://, got ${url}`);
  }
  if (target.pathname === "" || target.pathname === "/") target.pathname = "/v2/infer";
  return withParams(target, params);
}

/** `url` (a URL) with the query parameters of `params` that are set, as a string. */
function withParams(url, params) {
  for (const [key, value] of Object.entries(params)) {
    if (value != null) url.searchParams.set(key, value);
  }
  return url.toString();
}

/** The http(s) URL of the server that `url` (as inferUrl takes it) names. */
function httpUrl(url) {
  const target = new URL(inferUrl(url));
  target.protocol = target.protocol === "wss:" ? "https:" : "http:";
  return target.toString();
}

/** Reconnect tries: up to `attempts`, each after a wait drawn uniformly below `firstDelayMs`
 * doubled per try (at most `maxDelayMs`): full jitter, so that the clients of one server do not
 * all come back at once. */
export const DEFAULT_RECONNECT = { attempts: 6, firstDelayMs: 100, maxDelayMs: 5000 };

/**
 * Open a session. Options: apiKey (sent as the `bearer.<key>` subprotocol), sessionId, model,
 * qos (every request's default), reconnect (DEFAULT_RECONNECT; false: never), heartbeatMs
 * (how often the round trip is measured, default 2000), rttSmoothing (default 1/8), e2e
 * ({identity}: encrypt every frame end to end with the server whose Ed25519 identity this is,
 * or one of these; docs/browser.md), transport ("auto": WebTransport where the browser has it
 * and the page's own server offers it (`GET /v2/webtransport`), else, or when it does not get
 * through, a WebSocket; "websocket"; "webtransport": that or nothing).
 * Rejects with the server's error (Unauthorized, ModelNotFound...), EncryptionFailed (reason
 * "handshake": the server did not prove the pinned identity) or ConnectionClosed.
 */
export async function connect(url = "", options = {}) {
  const session = new Session(url, options);
  await session._open();
  return session;
}

/**
 * A session on one WebSocket. Events (it is an EventTarget; `event.detail` holds):
 *   rtt           {rtt, sample}        a heartbeat came back
 *   reconnecting  {code, attempt}      the connection dropped; a try to reconnect starts
 *   reconnected   {resumed, epochChanged}  open again; `resumed`: the request ids resumed
 *   close         {code, reason, error}    closed for good
 *   error         {error}              an error no running reply claims
 *   key           {direction, epoch, oldHash, newHash}  an end-to-end key agreed or rotated
 */
export class Session extends EventTarget {
  constructor(url, options = {}) {
    super();
    this.url = url;
    this.options = options;
    this.qos = options.qos;
    this.sessionId = options.sessionId ?? null;
    this.model = options.model ?? null;
    this.info = null; // the last `session` frame
    /** The smoothed round trip of binary heartbeats in ms (undefined before the first). */
    this.rtt = undefined;
    this.lastRtt = undefined;
    this.reconnects = 0;
    this.closed = false;
    this._ws = null;
    /** The transport of the connection: "websocket" or "webtransport" (null before one). */
    this.transport = null;
    this._offer = undefined; // where the server serves WebTransport (null: nowhere; not asked yet)
    this._generations = new Map();
    this._embeds = new Map(); // request id -> {resolve, reject, arrays} of an embed() waiting
    this._pings = []; // send times of heartbeats not answered yet
    this._heartbeat = null;
    this._closing = false;
    this._dropping = false;
    /** End-to-end encryption of the connection (a Channel: `sendEpoch`, `receiveEpoch`,
     * `identity`, `measurement`), new at every reconnect; null when not asked for. */
    this.e2e = null;
    this._pinned = options.e2e ? (options.e2e.identity ?? []) : null;
    this._inbound = Promise.resolve(); // sealed frames: opened and delivered one at a time
    this._outbound = Promise.resolve(); // frames sealed and sent in the order given
    this._refused = null; // an EncryptionFailed: the session closed for it, for good
    const reconnect = options.reconnect ?? true;
    this._reconnect = reconnect === false ? null : { ...DEFAULT_RECONNECT, ...(reconnect === true ? {} : reconnect) };
  }

  get epoch() {
    return this.info?.epoch;
  }

  /** A reply is running on the session (a session runs one at a time). */
  get busy() {
    return this._generations.size > 0;
  }

  /** Ask for a reply: `generate("hello", {max_tokens: 64, resumable: true})`, or
   * `generate({messages: [...]})`. Fields are those of the protocol's generate frame;
   * `prompt_ids` may be an Int32Array (the prompt as token ids), sent as a tensor frame. */
  generate(prompt, fields = {}) {
    const frame = typeof prompt === "string" ? { prompt, ...fields } : { ...prompt, ...fields };
    frame.request_id ??= `js-${randomId()}`;
    const qos = formatQoS(frame.qos ?? this.qos);
    if (qos) frame.qos = qos;
    else delete frame.qos;
    const generation = new Generation(this, frame);
    this._generations.set(frame.request_id, generation);
    if (ArrayBuffer.isView(frame.prompt_ids)) {
      const data = frame.prompt_ids;
      delete frame.prompt_ids;
      frame.prompt_tensor = "prompt_ids";
      this._send(encodeTensor({ requestId: frame.request_id, name: "prompt_ids", data }));
    }
    this._send(JSON.stringify(frame));
    return generation;
  }

  /** Vectors for `input` (a string, strings, token ids, or lists of them) from an embedding
   * model: `embed(["a", "b"], {model, encoding_format})` resolves to the `embeddings` frame
   * (`data`: a vector per input, in order); an error frame about it rejects. Not resumed: a
   * drop of the connection before the answer rejects, and it may be sent again.
   *
   * With `encoding_format: "tensor"` the vectors come as a tensor frame: the answer's
   * `arrays.embedding` is `{dtype: "FP32", shape: [inputs, size], data}` with `data` a
   * Float32Array over the frame. Token ids may go up as a tensor too: `input` an Int32Array
   * (one input; `shape: [inputs, tokens]` in `fields` for several of one length). */
  embed(input, fields = {}) {
    const { shape, ...rest } = fields;
    const frame = { type: "embed", input, ...rest };
    frame.request_id ??= `js-e-${randomId()}`;
    if (ArrayBuffer.isView(input)) {
      delete frame.input;
      frame.input_tensor = "input_ids";
      this._send(encodeTensor({ requestId: frame.request_id, name: "input_ids", data: input, shape }));
    }
    return new Promise((resolve, reject) => {
      this._embeds.set(frame.request_id, { resolve, reject, arrays: {} });
      this._send(JSON.stringify(frame));
    });
  }

  /** Stop the running reply (its `done` says "cancelled"). */
  cancel(requestId = undefined) {
    this._send(JSON.stringify(requestId ? { type: "cancel", request_id: requestId } : { type: "cancel" }));
  }

  /** Measure the round trip of one binary heartbeat now, in ms. */
  ping() {
    return new Promise((resolve, reject) => {
      const onRtt = (event) => {
        this.removeEventListener("rtt", onRtt);
        this.removeEventListener("close", onClose);
        resolve(event.detail.sample);
      };
      const onClose = () => {
        this.removeEventListener("rtt", onRtt);
        reject(new ConnectionClosed(1006));
      };
      this.addEventListener("rtt", onRtt);
      this.addEventListener("close", onClose, { once: true });
      this._sendPing();
    });
  }

  /** Delete the session on the server, then close. */
  end() {
    this._closing = true;
    this._send(JSON.stringify({ type: "end_session" }));
  }

  close() {
    this._closing = true;
    this._ws?.close(1000);
  }

  /** Drop the connection as a network failure would (for demos and tests): the session
   * reconnects and resumes what is resumable. */
  drop() {
    this._dropping = true;
    this._ws?.close(4000, "dropped by the client");
  }

  // ---------------------------------------------------------------------------- the socket

  async _open() {
    const mode = this.options.transport ?? "auto";
    try {
      return await this._openOnce(mode);
    } catch (error) {
      if (mode !== "auto" || this.transport !== "webtransport" || !(error instanceof ConnectionClosed)
          || error.closeCode !== 1006) throw error;
      this._offer = null; // WebTransport does not get through (UDP blocked?): WebSockets from now on
      return await this._openOnce(mode);
    }
  }

  // One connection, by the transport `mode` asks for.
  async _openOnce(mode) {
    // A fresh key pair for every connection: keys belong to a connection, not to the session.
    const handshake = this._pinned ? await Handshake.create(this._pinned) : null;
    const params = { session_id: this.sessionId, model: this.model, e2e: handshake?.param };
    if (mode !== "websocket" && this._offer === undefined) {
      // Asked of the page's own server only, unless WebTransport is asked for: the server
      // answers no CORS, and a refused fetch is an error in the console.
      const server = httpUrl(this.url);
      const own = new URL(server).origin === globalThis.location?.origin;
      this._offer = hasWebTransport() && (own || mode === "webtransport")
        ? await webTransportOffer(server) : null;
    }
    if (mode === "webtransport" && !this._offer) {
      throw new ConnectionClosed(1006, "the server offers no WebTransport (or the browser has none)");
    }
    const ws = mode !== "websocket" && this._offer ? this._webTransport(params) : this._webSocket(params);
    return new Promise((resolve, reject) => {
      let refusal = null;
      ws.onmessage = (event) => {
        if (typeof event.data !== "string") return;
        const frame = JSON.parse(event.data);
        if (frame.type === "error") {
          refusal = errorFromWire(frame.error);
        } else if (frame.type === "session" && !handshake) {
          this._attach(ws, frame, null);
          resolve(frame);
        } else if (frame.type === "session") {
          // Everything after the session frame is sealed: held until the keys are agreed (and
          // the last connection's frames are delivered, so that a resume starts after them).
          const held = [];
          ws.onmessage = (next) => held.push(next.data);
          const onKey = (direction, epoch, oldHash, newHash) => this.dispatchEvent(
            new CustomEvent("key", { detail: { direction, epoch, oldHash, newHash } }));
          Promise.all([handshake.finish(frame.e2e, frame.session_id, { onKey }), this._inbound]).then(
            ([channel]) => {
              if (ws.readyState !== WebSocket.OPEN) return; // closed meanwhile: onclose rejected
              this._attach(ws, frame, channel);
              for (const data of held) this._onMessage(ws, channel, data);
              resolve(frame);
            },
            (error) => {
              refusal = error;
              ws.close(4400, "encryption_failed");
            },
          );
        }
      };
      ws.onclose = (event) => reject(refusal ?? new ConnectionClosed(event.code, event.reason));
    });
  }

  _webSocket(params) {
    const protocols = [SUBPROTOCOL];
    if (this.options.apiKey) protocols.push(`bearer.${this.options.apiKey}`);
    const ws = new WebSocket(inferUrl(this.url, params), protocols);
    ws.binaryType = "arraybuffer";
    this.transport = "websocket";
    return ws;
  }

  // WebTransport sends no subprotocols everywhere: the key goes in the query, as api_key.
  _webTransport(params) {
    const url = withParams(new URL(this._offer.url), { ...params, api_key: this.options.apiKey });
    this.transport = "webtransport";
    return new WebTransportSocket(url, { certificateHashes: this._offer.certificateHashes });
  }

  _attach(ws, frame, channel) {
    this._ws = ws;
    this.e2e = channel;
    this.info = frame;
    this.sessionId = frame.session_id;
    this.model = frame.model;
    this._pings = [];
    ws.onmessage = (event) => this._onMessage(ws, channel, event.data);
    ws.onclose = (event) => this._onClose(event);
    const every = this.options.heartbeatMs ?? 2000;
    this._sendPing();
    this._heartbeat = setInterval(() => this._sendPing(), every);
  }

  _send(text) {
    if (this.closed) throw new ConnectionClosed(this._closeCode ?? 1006);
    if (this._ws?.readyState === WebSocket.OPEN) this._transmit(this._ws, this.e2e, text);
    else this._hold(text); // reconnecting: sent once open again
  }

  // A frame for the next connection: this one is down, or dropped while the frame was sealed.
  _hold(text) {
    if (!this.closed) (this._queued ??= []).push(text);
  }

  // A text frame onto `ws`; sealed first on an encrypted connection, in the order given (sealing
  // is asynchronous). A frame whose connection dropped while it was sealed waits for the next.
  _transmit(ws, channel, text) {
    if (!channel) {
      ws.send(text);
      return;
    }
    this._outbound = this._outbound.then(async () => {
      if (ws.readyState !== WebSocket.OPEN) {
        this._hold(text);
        return;
      }
      const sealed = await channel.seal(text);
      if (ws.readyState === WebSocket.OPEN) ws.send(sealed);
      else this._hold(text);
    }).catch((error) => this._encryptionFailed(ws, error));
  }

  _sendPing() {
    if (this._ws?.readyState !== WebSocket.OPEN) return;
    this._pings.push(performance.now());
    this._ws.send(new Uint8Array([HEARTBEAT_PING, 0]));
  }

  _onMessage(ws, channel, data) {
    if (typeof data !== "string") {
      const bytes = new Uint8Array(data);
      if (bytes[0] === SEALED && channel) this._openSealed(ws, channel, bytes);
      else if (bytes[0] === TENSOR && !channel) this._onTensor(bytes);
      else if (bytes[0] === HEARTBEAT_PING) ws.send(new Uint8Array([HEARTBEAT_PONG, 0]));
      else if (bytes[0] === HEARTBEAT_PONG && this._pings.length) this._onPong(this._pings.shift());
      return;
    }
    if (channel) {
      const error = new EncryptionFailed("the server sent a text frame on an encrypted connection",
        { reason: "plaintext" });
      this._encryptionFailed(ws, error);
      return;
    }
    this._onText(data);
  }

  // Sealed frames open one at a time, each delivered before the next is looked at: in order,
  // and nothing after a refusal.
  _openSealed(ws, channel, bytes) {
    this._inbound = this._inbound.then(async () => {
      if (channel.failed) return;
      let text;
      try {
        text = await channel.open(bytes);
      } catch (error) {
        this._encryptionFailed(ws, error);
        return;
      }
      if (text instanceof Uint8Array) this._onTensor(text);
      else this._onText(text);
    }).catch((error) => globalThis.reportError?.(error)); // reported as from onmessage; goes on
  }

  // A frame that does not open (or a seal that failed): every running reply fails with the
  // error, and the connection closes with 4400 for good (4400 is not a code to reconnect after).
  _encryptionFailed(ws, error) {
    if (!(error instanceof EncryptionFailed)) {
      error = new EncryptionFailed(String(error?.message ?? error), { reason: "malformed" });
    }
    if (this._refused) return;
    this._refused = error;
    if (this._generations.size > 0) this._failAll(error);
    else this.dispatchEvent(new CustomEvent("error", { detail: { error } }));
    ws.close(4400, "encryption_failed");
  }

  // A tensor frame: kept for the request waiting for it (the JSON frame that ends it follows).
  _onTensor(bytes) {
    const tensor = decodeTensor(bytes);
    const { requestId, name, dtype, shape, data } = tensor;
    const embed = this._embeds.get(requestId);
    if (embed) embed.arrays[name] = { dtype, shape, data };
    else this._generations.get(requestId)?._tensor(tensor);
  }

  _onText(data) {
    const frame = JSON.parse(data);
    if (frame.type === "session") {
      this.info = frame;
      return;
    }
    if (frame.type === "pong") return;
    const embed = this._embeds.get(frame.request_id);
    if (embed && (frame.type === "embeddings" || frame.type === "error")) {
      this._embeds.delete(frame.request_id);
      if (frame.type === "embeddings") embed.resolve(frame.tensors ? { ...frame, arrays: embed.arrays } : frame);
      else embed.reject(errorFromWire(frame.error, frame.request_id));
      return;
    }
    let generation = this._generations.get(frame.request_id);
    if (frame.type === "error") {
      const error = errorFromWire(frame.error, frame.request_id ?? null);
      if (!generation && this._generations.size === 1) [generation] = this._generations.values();
      if (generation) {
        this._generations.delete(generation.requestId);
        generation._fail(error);
      } else {
        this.dispatchEvent(new CustomEvent("error", { detail: { error } }));
      }
      return;
    }
    if (!generation) return;
    if (frame.type === "done") this._generations.delete(generation.requestId);
    generation._frame(frame);
  }

  _onPong(sentAt) {
    const sample = performance.now() - sentAt;
    const alpha = this.options.rttSmoothing ?? 1 / 8;
    this.rtt = this.rtt === undefined ? sample : this.rtt + alpha * (sample - this.rtt);
    this.lastRtt = sample;
    this.dispatchEvent(new CustomEvent("rtt", { detail: { rtt: this.rtt, sample } }));
  }

  async _onClose(event) {
    clearInterval(this._heartbeat);
    const code = this._refused ? 4400 : this._dropping ? 1006 : event.code;
    this._dropping = false;
    if (!this._closing && !this._refused && this._reconnect && RECONNECT_CODES.has(code)) {
      if (await this._reopen(code)) return;
    }
    this._finish(code, event.reason);
  }

  // A dropped connection: open the same session again and resume the resumable replies; the
  // others fail at once (their text cannot be read again).
  async _reopen(code) {
    const dropped = new ConnectionClosed(code);
    this._failEmbeds(dropped);
    for (const generation of [...this._generations.values()]) {
      if (!generation.resumable) {
        this._generations.delete(generation.requestId);
        generation._fail(dropped);
      }
    }
    const epoch = this.epoch;
    const policy = this._reconnect;
    for (let attempt = 1; attempt <= policy.attempts; attempt++) {
      this.dispatchEvent(new CustomEvent("reconnecting", { detail: { code, attempt } }));
      const cap = Math.min(policy.maxDelayMs, policy.firstDelayMs * 2 ** (attempt - 1));
      await sleep(Math.random() * cap);
      if (this._closing) return false;
      let frame;
      try {
        frame = await this._open();
      } catch (error) {
        if (!(error instanceof ConnectionClosed) && !error.retryable) {
          this._failAll(error);
          return false;
        }
        continue;
      }
      this.reconnects += 1;
      const resumed = [];
      for (const generation of this._generations.values()) {
        const resume = { type: "resume", request_id: generation.requestId, after_seq: generation.lastSeq };
        if (epoch) resume.epoch = epoch;
        this._transmit(this._ws, this.e2e, JSON.stringify(resume));
        generation.resumes += 1;
        resumed.push(generation.requestId);
      }
      const queued = this._queued ?? [];
      this._queued = [];
      for (const text of queued) this._transmit(this._ws, this.e2e, text);
      const epochChanged = Boolean(epoch && frame.epoch !== epoch);
      this.dispatchEvent(new CustomEvent("reconnected", { detail: { resumed, epochChanged } }));
      return true;
    }
    return false;
  }

  _failAll(error) {
    for (const generation of this._generations.values()) generation._fail(error);
    this._generations.clear();
    this._failEmbeds(error);
  }

  _failEmbeds(error) {
    for (const embed of this._embeds.values()) embed.reject(error);
    this._embeds.clear();
  }

  _finish(code, reason) {
    this.closed = true;
    this._closeCode = code;
    const error = new ConnectionClosed(code, reason);
    this._failAll(error);
    this.dispatchEvent(new CustomEvent("close", { detail: { code, reason, error } }));
  }
}

/**
 * One reply: `for await (const {text, seq, n} of generation)`. After the loop, `done` holds
 * the done frame (usage, timing, finish_reason) and `text` the whole reply. An error frame for
 * the request is thrown by the loop (and by `result()`).
 */
export class Generation {
  constructor(session, frame) {
    this.session = session;
    this.requestId = frame.request_id;
    this.resumable = Boolean(frame.resumable);
    this.start = null;
    this.done = null;
    this.error = null;
    /** The index of the last token received (-1: none): where a resume starts from. */
    this.lastSeq = -1;
    this.resumes = 0;
    /** Each token's log probability, in order, when the request asked for `logprobs`. */
    this.logprobs = [];
    /** The tensor frames that came with the tokens (the request's `tensors`), by name: each
     * chunk's `{dtype, shape, data}` in order. */
    this.tensors = {};
    this._pending = []; // tensor frames waiting for their token frame
    this._parts = [];
    this._queue = [];
    this._wake = null;
  }

  get text() {
    return this._parts.join("");
  }

  cancel() {
    this.session.cancel(this.requestId);
  }

  /** Wait for the end: the done frame (or the error thrown). */
  async result() {
    for await (const _ of this); // eslint-disable-line no-unused-vars
    return this.done;
  }

  [Symbol.asyncIterator]() {
    return {
      next: async () => {
        while (this._queue.length === 0) {
          if (this.error) throw this.error;
          if (this.done) return { done: true, value: undefined };
          await new Promise((resolve) => (this._wake = resolve));
        }
        return { done: false, value: this._queue.shift() };
      },
      return: async () => {
        if (!this.done && !this.error) this.cancel();
        return { done: true, value: undefined };
      },
    };
  }

  _tensor(tensor) {
    this._pending.push(tensor); // its token frame comes next
  }

  _frame(frame) {
    if (frame.type === "start") {
      this.start ??= frame;
    } else if (frame.type === "token") {
      const n = frame.n ?? 1;
      const last = frame.seq + n - 1;
      if (last <= this.lastSeq) return; // held already (never sent twice by the server)
      this.lastSeq = last;
      this._parts.push(frame.token);
      if (frame.logprobs) this.logprobs.push(...frame.logprobs);
      const chunk = { text: frame.token, seq: frame.seq, n, logprobs: frame.logprobs };
      const pending = this._pending.filter((t) => t.seq === frame.seq);
      this._pending = [];
      if (pending.length) {
        chunk.tensors = {};
        for (const { name, dtype, shape, data } of pending) {
          chunk.tensors[name] = { dtype, shape, data };
          (this.tensors[name] ??= []).push(chunk.tensors[name]);
        }
      }
      this._queue.push(chunk);
    } else if (frame.type === "done") {
      this.done = frame;
      if (frame.text != null && this._parts.length === 0) this._parts.push(frame.text);
      if (frame.logprobs && this.logprobs.length === 0) this.logprobs.push(...frame.logprobs);
    }
    this._wakeUp();
  }

  _fail(error) {
    this.error = error;
    this._wakeUp();
  }

  _wakeUp() {
    const wake = this._wake;
    this._wake = null;
    wake?.();
  }
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function randomId() {
  return toHex(crypto.getRandomValues(new Uint8Array(6)));
}
