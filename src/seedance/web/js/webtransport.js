// /v2/infer over WebTransport (docs/protocol.md, section 11): a WebSocket-like object over a
// WebTransport session, so that the session code drives either transport the same way.
//
// Each message is written on one bidirectional stream as a byte of kind (0 text, 1 binary),
// its length as a QUIC variable-length integer, and its bytes. The server's keepalive pings
// are QUIC PINGs, answered by the browser's QUIC stack; a close is the session's close with
// the WebSocket close code and reason.

const TEXT = 0;
const BINARY = 1;
const CLOSE = 2; // the server's close, after its last frame: a u32 code, then the reason
const HEARTBEAT_PING = new Uint8Array([0x01, 0]);

const encoder = new TextEncoder();
const decoder = new TextDecoder("utf-8", { fatal: true });

/** Whether this browser has WebTransport at all. */
export const hasWebTransport = () => typeof globalThis.WebTransport === "function";

/** Where the server at `httpUrl` (its http(s) origin) serves /v2/infer over WebTransport:
 * `{url, certificateHashes}`, or null when it does not (or cannot be asked). */
export async function webTransportOffer(httpUrl) {
  const origin = new URL(httpUrl);
  let offer;
  try {
    const answer = await fetch(new URL("/v2/webtransport", origin), { cache: "no-store" });
    if (!answer.ok) return null;
    offer = await answer.json();
  } catch {
    return null; // another origin without CORS, a network error: the WebSocket it is
  }
  if (!offer?.offered) return null;
  const url = new URL(offer.path ?? "/v2/infer", origin);
  url.protocol = "https:";
  url.port = String(offer.port ?? origin.port);
  const hash = offer.certificate_sha256;
  const certificateHashes = hash ? [{ algorithm: "sha-256", value: hexBytes(hash) }] : null;
  return { url: url.toString(), certificateHashes };
}

function isPong(data) {
  if (typeof data === "string" || data.byteLength !== 2) return false;
  const bytes = new Uint8Array(data);
  return bytes[0] === 0x02 && bytes[1] === 0;
}

function hexBytes(hex) {
  return Uint8Array.from(hex.match(/../g) ?? [], (pair) => parseInt(pair, 16));
}

function varint(n) {
  if (n < 0x40) return Uint8Array.of(n);
  if (n < 0x4000) return Uint8Array.of(0x40 | (n >> 8), n & 0xff);
  if (n < 0x40000000) {
    return Uint8Array.of(0x80 | (n >>> 24), (n >> 16) & 0xff, (n >> 8) & 0xff, n & 0xff);
  }
  const out = new Uint8Array(8);
  new DataView(out.buffer).setBigUint64(0, BigInt(n) | (0xc0n << 56n));
  return out;
}

/** A message as the stream carries it. */
export function encodeMessage(data) {
  const text = typeof data === "string";
  const payload = text ? encoder.encode(data) : ArrayBuffer.isView(data)
    ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength) : new Uint8Array(data);
  const length = varint(payload.length);
  const out = new Uint8Array(1 + length.length + payload.length);
  out[0] = text ? TEXT : BINARY;
  out.set(length, 1);
  out.set(payload, 1 + length.length);
  return out;
}

/** The server's close, read on the stream. */
export class Closing {
  constructor(code, reason) {
    this.code = code;
    this.reason = reason;
  }
}

/** Reads messages out of the stream's chunks, however they are cut. */
export class MessageReader {
  constructor() {
    this._buffer = new Uint8Array(0);
  }

  /** The whole messages that `chunk` completes: strings, ArrayBuffers, and a Closing. */
  feed(chunk) {
    const joined = new Uint8Array(this._buffer.length + chunk.length);
    joined.set(this._buffer);
    joined.set(chunk, this._buffer.length);
    const messages = [];
    let at = 0;
    for (;;) {
      if (joined.length - at < 2) break;
      const kind = joined[at];
      const size = 1 << (joined[at + 1] >> 6);
      if (joined.length - at < 1 + size) break;
      let length = joined[at + 1] & 0x3f;
      for (let i = 1; i < size; i++) length = length * 256 + joined[at + 1 + i];
      const start = at + 1 + size;
      if (joined.length < start + length) break;
      const payload = joined.subarray(start, start + length);
      if (kind === TEXT) messages.push(decoder.decode(payload));
      else if (kind === BINARY) messages.push(payload.slice().buffer);
      else if (kind === CLOSE) {
        const code = new DataView(payload.buffer, payload.byteOffset).getUint32(0);
        messages.push(new Closing(code, decoder.decode(payload.subarray(4))));
      }
      else throw new Error(`unknown message kind ${kind}`);
      at = start + length;
    }
    this._buffer = joined.slice(at);
    return messages;
  }
}

/** The part of a WebSocket the session uses (send, close, readyState, onmessage, onclose),
 * over a WebTransport session to `url` (https://host:port/v2/infer?...). */
export class WebTransportSocket {
  static CONNECTING = 0;
  static OPEN = 1;
  static CLOSING = 2;
  static CLOSED = 3;

  constructor(url, { certificateHashes = null } = {}) {
    this.url = url;
    this.readyState = WebTransportSocket.CONNECTING;
    this.binaryType = "arraybuffer";
    this.onmessage = null;
    this.onclose = null;
    this._writer = null;
    this._written = Promise.resolve();
    this._openerPong = true; // the pong of the heartbeat that opened the stream: not passed on
    const options = certificateHashes ? { serverCertificateHashes: certificateHashes } : {};
    try {
      this._transport = new WebTransport(url, options);
    } catch (error) {
      this._transport = null;
      queueMicrotask(() => this._closed(1006, String(error?.message ?? error)));
      return;
    }
    this._transport.closed.then(
      (info) => this._closed(info?.closeCode ?? 1005, info?.reason ?? ""),
      (error) => this._closed(1006, String(error?.message ?? error)),
    );
    this._open();
  }

  async _open() {
    try {
      await this._transport.ready;
      const stream = await this._transport.createBidirectionalStream();
      this._writer = stream.writable.getWriter();
      // A stream is announced to the server by its first bytes, and the server writes nothing
      // before: a heartbeat opens it (its pong is one the session does not count).
      await this._writer.write(encodeMessage(HEARTBEAT_PING));
      this.readyState = WebTransportSocket.OPEN;
      await this._read(stream.readable.getReader());
    } catch (error) {
      this._closed(1006, String(error?.message ?? error));
    }
  }

  async _read(reader) {
    const messages = new MessageReader();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      let decoded;
      try {
        decoded = messages.feed(value);
      } catch (error) {
        this.close(1002, "malformed message");
        return;
      }
      for (const data of decoded) {
        if (data instanceof Closing) { // in order after the last frame, as a WebSocket closes
          this._closed(data.code, data.reason);
          try {
            this._transport.close({ closeCode: data.code, reason: data.reason });
          } catch {
            // closed already
          }
          return;
        }
        if (this._openerPong && isPong(data)) {
          this._openerPong = false;
          continue;
        }
        this.onmessage?.({ data });
      }
    }
  }

  send(data) {
    if (this.readyState !== WebTransportSocket.OPEN) return;
    const bytes = encodeMessage(data);
    this._written = this._written.then(() => this._writer.write(bytes)).catch(() => {});
  }

  close(code = 1000, reason = "") {
    if (this.readyState >= WebTransportSocket.CLOSING) return;
    this.readyState = WebTransportSocket.CLOSING;
    try {
      this._transport?.close({ closeCode: code, reason });
    } catch {
      this._closed(code, reason);
    }
  }

  _closed(code, reason) {
    if (this.readyState === WebTransportSocket.CLOSED) return;
    this.readyState = WebTransportSocket.CLOSED;
    this.onclose?.({ code, reason });
  }
}
