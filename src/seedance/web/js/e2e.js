// End-to-end encryption of /v2/infer frames (docs/protocol.md, section 9) with WebCrypto: an
// X25519 agreement signed by the server's pinned Ed25519 identity, HKDF-SHA256, sealed frames
// in AES-256-GCM, and the key ratchet. The reference is seedance.protocol.e2e (Python); tests
// check that both make and open the same bytes (tests/test_browser_e2e.py).
//
// A sealed frame (all integers big-endian):
//   0   1  0x05            13  8  seq (signed; -1: none)
//   1   4  key epoch       21  2  L, the request id's length
//   5   8  counter         23  L  the request id, then AES-256-GCM(JSON text), its tag last
// The nonce is epoch + counter; the additional data is the label, the session id (2-byte
// length) and the header.
//
// Keys live in non-extractable CryptoKeys: the raw bytes a derivation returns are imported and
// zeroed at once, and a key left behind by a rotation is dropped (nothing refers to it).

import { EncryptionFailed, InvalidRequest } from "./seedance.js"; // a cycle: used at run time only
import { TENSOR, tensorMeta } from "./tensors.js";

export const E2E_VERSION = 1;
export const E2E_SUITE = "x25519-ed25519-hkdf-sha256-aes-256-gcm";
export const SEALED = 0x05;
const LABEL = "seedance-e2e/1";
const HEADER_BYTES = 23; // !BIQqH: type, epoch, counter, seq, request id length
const TAG_BYTES = 16;
// Python's HKDF(salt=None) is RFC 5869's default, a salt of HashLen zero bytes; WebCrypto wants
// the salt spelled out. (HMAC pads its key with zeros, so an empty salt would do the same; the
// tests check the ratchet against Python's.)
const NO_SALT = new Uint8Array(32);
// The DER of an Ed25519 SubjectPublicKeyInfo up to its 32 key bytes (RFC 8410).
const ED25519_SPKI = [0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00];

const encoder = new TextEncoder();
const decoder = new TextDecoder("utf-8", { fatal: true });

function failed(reason, message) {
  return new EncryptionFailed(message, { reason });
}

function subtle() {
  const api = globalThis.crypto?.subtle;
  if (!api) {
    throw failed("handshake", "WebCrypto is not available: end-to-end encryption needs a secure " +
      "context (a page served over https, or from localhost)");
  }
  return api;
}

// ------------------------------------------------------------------------------ encodings

/** Bytes as base64url without padding (the `e2e` parameter, the offer's fields). */
export function b64url(bytes) {
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** The bytes of base64url (padded or not; base64's + and / are taken too). */
export function unb64url(text) {
  const b64 = text.replace(/-/g, "+").replace(/_/g, "/");
  const binary = atob(b64 + "=".repeat((4 - (b64.length % 4)) % 4));
  return Uint8Array.from(binary, (c) => c.charCodeAt(0));
}

export function toHex(bytes) {
  return Array.from(new Uint8Array(bytes), (b) => b.toString(16).padStart(2, "0")).join("");
}

function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const part of parts) {
    out.set(part, at);
    at += part.length;
  }
  return out;
}

function u16(n) {
  return new Uint8Array([(n >> 8) & 0xff, n & 0xff]);
}

function equalBytes(a, b) {
  return a.length === b.length && a.every((byte, i) => byte === b[i]);
}

/** A pinned server identity as its 32 raw Ed25519 bytes: base64url (as the offer's `identity`
 * field), a PEM public key (SPKI, as `seedance models keygen` writes KEY.pub), or the bytes. */
export function identityBytes(identity) {
  let raw;
  try {
    if (identity instanceof Uint8Array || identity instanceof ArrayBuffer) {
      raw = new Uint8Array(identity);
    } else if (typeof identity === "string" && identity.includes("-----BEGIN")) {
      const pem = /-----BEGIN PUBLIC KEY-----([\s\S]*?)-----END PUBLIC KEY-----/.exec(identity);
      if (!pem) throw new Error("not a PEM public key (the server's private key stays on the server)");
      const der = unb64url(pem[1].replace(/\s+/g, ""));
      if (der.length !== 44 || !ED25519_SPKI.every((byte, i) => der[i] === byte)) {
        throw new Error("not an Ed25519 public key");
      }
      raw = der.slice(ED25519_SPKI.length);
    } else if (typeof identity === "string") {
      raw = unb64url(identity.trim());
    } else {
      throw new Error(`expected a string or bytes, got ${typeof identity}`);
    }
  } catch (error) {
    throw new InvalidRequest(`e2e.identity: ${error.message}`);
  }
  if (raw.length !== 32) throw new InvalidRequest(`e2e.identity: ${raw.length} bytes, not an Ed25519 key's 32`);
  return raw;
}

/** What the identity signs and the key derivation is salted with: the label, then both
 * ephemeral keys, the identity, the session id and the measurement, each after its 2-byte
 * length. */
export function transcript(clientKey, serverKey, identity, sessionId, measurement) {
  const parts = [clientKey, serverKey, identity, encoder.encode(sessionId), encoder.encode(measurement)];
  return concat(encoder.encode(LABEL), ...parts.flatMap((part) => [u16(part.length), part]));
}

// ------------------------------------------------------------------------------ derivations

async function expand(base, salt, info) {
  const bits = await subtle().deriveBits(
    { name: "HKDF", hash: "SHA-256", salt, info: encoder.encode(LABEL + info) }, base, 256);
  return new Uint8Array(bits);
}

async function hkdf(secret, salt, info) {
  const base = await subtle().importKey("raw", secret, "HKDF", false, ["deriveBits"]);
  return expand(base, salt, info);
}

/** The key after `key` (raw bytes): HKDF-SHA256 of it, no salt, info "seedance-e2e/1 ratchet".
 * One-way: a later key does not give an earlier one. */
export function ratchet(key) {
  return hkdf(key, NO_SALT, " ratchet");
}

/** SHA-256 of a key, hex: its name in the server's audit log (it does not reveal the key). */
export async function keyHash(key) {
  return toHex(await subtle().digest("SHA-256", key));
}

/** One direction's key in use: its AES-GCM key, its ratchet base, its epoch, what it sealed. */
class DirectionKey {
  /** Imports `raw` and zeroes it: from here the key is only in non-extractable CryptoKeys. */
  static async from(raw, epoch, since) {
    const api = subtle();
    const [aead, base, hash] = await Promise.all([
      api.importKey("raw", raw, "AES-GCM", false, ["encrypt", "decrypt"]),
      api.importKey("raw", raw, "HKDF", false, ["deriveBits"]),
      keyHash(raw),
    ]);
    raw.fill(0);
    return new DirectionKey(aead, base, hash, epoch, since);
  }

  constructor(aead, base, hash, epoch, since) {
    this.aead = aead;
    this.base = base;
    this.hash = hash;
    this.epoch = epoch;
    this.since = since;
    this.used = 0; // bytes of text sealed or opened under it
  }

  async next(since) {
    return DirectionKey.from(await expand(this.base, NO_SALT, " ratchet"), this.epoch + 1, since);
  }
}

// ------------------------------------------------------------------------------ sealed frames

/** The request id and seq a frame's JSON names (null: not there, or not JSON of that shape),
 * as Python's frame_meta reads them. */
function frameMeta(text) {
  let frame;
  try {
    frame = JSON.parse(text);
  } catch {
    return [null, null];
  }
  if (frame === null || typeof frame !== "object" || Array.isArray(frame)) return [null, null];
  const requestId = frame.request_id ?? null;
  const seq = frame.seq ?? null;
  if ((requestId !== null && typeof requestId !== "string") || (seq !== null && !Number.isInteger(seq))) {
    return [null, null];
  }
  return [requestId, seq];
}

function nonce(epoch, counter) {
  const bytes = new Uint8Array(12);
  const view = new DataView(bytes.buffer);
  view.setUint32(0, epoch);
  view.setBigUint64(4, BigInt(counter));
  return bytes;
}

const monotonic = () => performance.now() / 1000;

/**
 * One connection's encryption, both directions: `seal(text)` what goes out, `open(bytes)` what
 * comes in. Each is serialised on its own (a second call waits for the first), so frames are
 * sealed in the order `seal` is called and opened in the order `open` is. After a refusal every
 * frame is refused: the connection is over.
 */
export class Channel {
  /** A channel from both direction keys (raw bytes; the channel keeps copies in CryptoKeys).
   * `onKey(direction, epoch, oldHash, newHash)` is told of every key it starts using. */
  static async create(sessionId, options) {
    const {
      sendKey, receiveKey, sending = "client_to_server", rotateBytes = 50 * 1024 * 1024,
      rotateS = 1800, onKey = null, clock = monotonic, identity = null, measurement = null,
    } = options;
    const now = clock();
    const [send, receive] = await Promise.all([
      DirectionKey.from(Uint8Array.from(sendKey), 0, now),
      DirectionKey.from(Uint8Array.from(receiveKey), 0, now),
    ]);
    const channel = new Channel(sessionId, send, receive, { sending, rotateBytes, rotateS, onKey, clock });
    channel.identity = identity;
    channel.measurement = measurement;
    onKey?.(channel.sending, 0, null, send.hash);
    onKey?.(channel.receiving, 0, null, receive.hash);
    return channel;
  }

  constructor(sessionId, send, receive, { sending, rotateBytes, rotateS, onKey, clock }) {
    this.sessionId = sessionId;
    const session = encoder.encode(sessionId);
    this._adPrefix = concat(encoder.encode(LABEL), u16(session.length), session);
    this.sending = sending;
    this.receiving = sending === "client_to_server" ? "server_to_client" : "client_to_server";
    this.rotateBytes = rotateBytes;
    this.rotateS = rotateS;
    /** The server's identity (base64url) and measurement, for a channel from a handshake. */
    this.identity = null;
    this.measurement = null;
    /** The first refusal (an EncryptionFailed): nothing opens after it. */
    this.failed = null;
    this._onKey = onKey;
    this._clock = clock;
    this._send = send;
    this._receive = receive;
    this._sent = 0; // frames sealed: the next counter
    this._received = 0; // frames opened: the next counter expected
    this._sealing = Promise.resolve();
    this._opening = Promise.resolve();
  }

  get sendEpoch() {
    return this._send.epoch;
  }

  get receiveEpoch() {
    return this._receive.epoch;
  }

  get sendKeyHash() {
    return this._send.hash;
  }

  get receiveKeyHash() {
    return this._receive.hash;
  }

  /** The sealed frame of a frame's JSON text, or of a tensor frame (a Uint8Array): its request
   * id and seq go in the header. */
  seal(text) {
    const sealed = this._sealing.then(() => this._seal(text));
    this._sealing = sealed.catch(() => {});
    return sealed;
  }

  /** The JSON text of a sealed frame, or the tensor frame it carries (a Uint8Array); rejects
   * with EncryptionFailed (its `reason`) unless it is exactly the next frame of this
   * connection, sealed by the other side. */
  open(data) {
    const opened = this._opening.then(() => this._openChecked(new Uint8Array(data)));
    this._opening = opened.catch(() => {});
    return opened;
  }

  async _seal(text) {
    let key = this._send;
    if (key.used >= this.rotateBytes || this._clock() - key.since >= this.rotateS) {
      const old = key;
      this._send = key = await old.next(this._clock());
      this._onKey?.(this.sending, key.epoch, old.hash, key.hash);
    }
    const tensor = text instanceof Uint8Array;
    const [requestId, seq] = tensor ? tensorMeta(text) : frameMeta(text);
    const rid = encoder.encode(requestId ?? "");
    const header = new Uint8Array(HEADER_BYTES + rid.length);
    const view = new DataView(header.buffer);
    const counter = this._sent;
    view.setUint8(0, SEALED);
    view.setUint32(1, key.epoch);
    view.setBigUint64(5, BigInt(counter));
    view.setBigInt64(13, BigInt(seq ?? -1));
    view.setUint16(21, rid.length);
    header.set(rid, HEADER_BYTES);
    const plaintext = tensor ? text : encoder.encode(text);
    const sealed = await subtle().encrypt(
      { name: "AES-GCM", iv: nonce(key.epoch, counter), additionalData: concat(this._adPrefix, header) },
      key.aead, plaintext);
    this._sent = counter + 1;
    key.used += plaintext.length;
    return concat(header, new Uint8Array(sealed));
  }

  async _openChecked(data) {
    if (this.failed) throw failed(this.failed.reason, `refused earlier: ${this.failed.message}`);
    try {
      return await this._open(data);
    } catch (error) {
      this.failed = error instanceof EncryptionFailed ? error : failed("malformed", String(error));
      throw this.failed;
    }
  }

  async _open(data) {
    if (data.length < HEADER_BYTES + TAG_BYTES || data[0] !== SEALED) {
      throw failed("malformed", "not a sealed frame");
    }
    const view = new DataView(data.buffer, data.byteOffset, data.byteLength);
    const epoch = view.getUint32(1);
    const counter = Number(view.getBigUint64(5));
    const seq = view.getBigInt64(13);
    const body = HEADER_BYTES + view.getUint16(21);
    if (data.length < body + TAG_BYTES) throw failed("malformed", "a sealed frame cut short");
    let key = this._receive;
    if (epoch === key.epoch + 1) {
      key = await key.next(this._clock()); // kept only if the frame opens
    } else if (epoch !== key.epoch) {
      throw failed("unknown_key", `frame ${counter}: key ${epoch} is not in use (expected ${key.epoch})`);
    }
    if (counter !== this._received) {
      const reason = counter < this._received ? "replayed" : "reordered";
      throw failed(reason, `frame ${counter} ${reason}: expected frame ${this._received}`);
    }
    const header = data.subarray(0, body);
    let plaintext;
    try {
      plaintext = new Uint8Array(await subtle().decrypt(
        { name: "AES-GCM", iv: nonce(epoch, counter), additionalData: concat(this._adPrefix, header) },
        key.aead, data.subarray(body)));
    } catch {
      throw failed("bad_tag", `frame ${counter} failed authentication (altered or not ours)`);
    }
    const tensor = plaintext[0] === TENSOR;
    let text = plaintext;
    try {
      if (!tensor) text = decoder.decode(plaintext);
    } catch {
      throw failed("malformed", `frame ${counter}: its text is not UTF-8`);
    }
    let requestId, innerSeq;
    try {
      [requestId, innerSeq] = tensor ? tensorMeta(plaintext) : frameMeta(text);
    } catch {
      throw failed("mismatch", `frame ${counter}: its tensor header cannot be read`);
    }
    if (!equalBytes(encoder.encode(requestId ?? ""), data.subarray(HEADER_BYTES, body)) ||
        BigInt(innerSeq ?? -1) !== seq) {
      throw failed("mismatch", `frame ${counter}: its header names another request or seq`);
    }
    this._received = counter + 1;
    if (key !== this._receive) { // the first frame of the next key: the old one goes
      const old = this._receive;
      this._receive = key;
      this._onKey?.(this.receiving, key.epoch, old.hash, key.hash);
    }
    key.used += plaintext.length;
    return text;
  }
}

// ------------------------------------------------------------------------------ the agreement

/**
 * The client's side of the agreement: `await Handshake.create(pinned)` makes a fresh X25519 key
 * pair (its public half is `param`, for the URL's `e2e`), then `finish(offer, sessionId)` checks
 * the server's offer and derives the channel. `pinned`: one identity or an array of them (see
 * identityBytes).
 */
export class Handshake {
  static async create(pinned) {
    const identities = (Array.isArray(pinned) ? pinned : [pinned]).map(identityBytes);
    if (identities.length === 0) throw new InvalidRequest("e2e.identity: pin at least one server identity");
    const api = subtle();
    let pair;
    try {
      pair = await api.generateKey({ name: "X25519" }, false, ["deriveBits"]);
    } catch (error) {
      throw failed("handshake", `this browser's WebCrypto has no X25519: ${error.message}`);
    }
    const publicKey = new Uint8Array(await api.exportKey("raw", pair.publicKey));
    return new Handshake(identities, pair.privateKey, publicKey);
  }

  constructor(pinned, privateKey, publicKey) {
    this.pinned = pinned;
    this.publicKey = publicKey;
    this._private = privateKey;
  }

  /** The `e2e` query parameter: the ephemeral public key, base64url. */
  get param() {
    return b64url(this.publicKey);
  }

  /** The channel the server's offer (the session frame's `e2e`) agrees, or EncryptionFailed
   * with reason `handshake`: no offer, another version or suite, an identity not pinned, a
   * signature that does not verify. */
  async finish(offer, sessionId, { onKey = null, clock = monotonic } = {}) {
    if (offer == null) throw failed("handshake", "the server did not agree to encrypt the stream");
    if (offer.version !== E2E_VERSION || offer.suite !== E2E_SUITE) {
      throw failed("handshake", `unsupported encryption: version ${offer.version}, ${offer.suite}`);
    }
    let identity, serverKey, signature;
    try {
      [identity, serverKey, signature] = [offer.identity, offer.server_key, offer.signature].map(unb64url);
    } catch {
      throw failed("handshake", "the server's offer is malformed");
    }
    if (serverKey.length !== 32 || typeof offer.measurement !== "string") {
      throw failed("handshake", "the server's offer is malformed");
    }
    if (!this.pinned.some((pinned) => equalBytes(pinned, identity))) {
      throw failed("handshake",
        `the server's identity ${String(offer.identity).slice(0, 16)}... is not one of the pinned keys`);
    }
    const salt = transcript(this.publicKey, serverKey, identity, sessionId, offer.measurement);
    const api = subtle();
    let verified = false;
    try {
      const verifier = await api.importKey("raw", identity, { name: "Ed25519" }, false, ["verify"]);
      verified = await api.verify({ name: "Ed25519" }, verifier, signature, salt);
    } catch {
      verified = false;
    }
    if (!verified) throw failed("handshake", "the server's key agreement is not signed by its identity");
    let shared;
    try {
      const serverPublic = await api.importKey("raw", serverKey, { name: "X25519" }, false, []);
      shared = new Uint8Array(await api.deriveBits({ name: "X25519", public: serverPublic }, this._private, 256));
    } catch {
      throw failed("handshake", "the server's key is not a usable X25519 key");
    }
    this._private = null; // one agreement per key pair
    const [c2s, s2c] = await Promise.all([
      hkdf(shared, salt, " client_to_server"),
      hkdf(shared, salt, " server_to_client"),
    ]);
    shared.fill(0);
    try {
      return await Channel.create(sessionId, {
        sendKey: c2s, receiveKey: s2c, sending: "client_to_server",
        rotateBytes: offer.rotate_bytes, rotateS: offer.rotate_s, onKey, clock,
        identity: offer.identity, measurement: offer.measurement,
      });
    } finally {
      c2s.fill(0);
      s2c.fill(0);
    }
  }
}
