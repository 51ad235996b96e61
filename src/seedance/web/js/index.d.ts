// Type declarations of @seedance/client (the module itself is plain JavaScript).

export declare const SUBPROTOCOL: "seedance.v2";
export declare const RECONNECT_CODES: ReadonlySet<number>;

// ------------------------------------------------------------------------ errors

export type ErrorCode =
  | "invalid_json" | "invalid_request" | "unsupported_frame" | "session_busy"
  | "context_overflow" | "model_not_found" | "unauthorized" | "forbidden" | "quota_exceeded"
  | "overloaded" | "payload_too_large" | "engine_error" | "internal_error" | "history_lost"
  | "encryption_failed" | "connection_closed" | "no_reply";

export interface ErrorBody {
  code: string;
  message: string;
  retryable: boolean;
  retry_after?: number;
  reason?: string;
}

export declare class SeedanceError extends Error {
  static readonly code: ErrorCode;
  static readonly retryable: boolean;
  readonly code: ErrorCode | string;
  readonly retryable: boolean;
  /** Seconds after which a retry can pass, where the server said. */
  readonly retryAfter: number | null;
  readonly requestId: string | null;
  /** history_lost: expired, trimmed, epoch_changed or cursor_ahead; encryption_failed: an
   * EncryptionFailedReason. */
  readonly reason: string | null;
}
export declare class InvalidJSON extends SeedanceError {}
export declare class InvalidRequest extends SeedanceError {}
export declare class UnsupportedFrame extends SeedanceError {}
export declare class SessionBusy extends SeedanceError {}
export declare class ContextOverflow extends SeedanceError {}
export declare class ModelNotFound extends SeedanceError {}
export declare class Unauthorized extends SeedanceError {}
export declare class Forbidden extends SeedanceError {}
export declare class QuotaExceeded extends SeedanceError {}
export declare class Overloaded extends SeedanceError {}
export declare class PayloadTooLarge extends SeedanceError {}
export declare class EngineError extends SeedanceError {}
export declare class InternalError extends SeedanceError {}
export declare class HistoryLost extends SeedanceError {}
export type EncryptionFailedReason =
  | "handshake" | "plaintext" | "malformed" | "unknown_key" | "replayed" | "reordered"
  | "bad_tag" | "mismatch";
/** End-to-end encryption failed (the connection closes with 4400; nothing of the frame is
 * delivered). "handshake": the server is not the pinned one, or its agreement did not verify. */
export declare class EncryptionFailed extends SeedanceError {
  readonly reason: EncryptionFailedReason | string;
}
export declare class ConnectionClosed extends SeedanceError {
  constructor(closeCode: number, closeReason?: string);
  readonly closeCode: number;
  readonly closeReason: string;
}
export declare class NoReply extends SeedanceError {}
export declare function errorFromWire(body: ErrorBody, requestId?: string | null): SeedanceError;

// ------------------------------------------------------------------------ quality of service

export type QoSClass = "critical" | "high" | "normal" | "low" | "background";
export interface QoS {
  class?: QoSClass;
  /** 1-64 letters, digits and `_.:-`: the service level the request is measured against. */
  slatag?: string;
  /** 0 to 1: the client's own view of the service. */
  healthScore?: number;
}
/** `high; slatag=checkout; health_score=0.92`, the qos field's syntax. */
export declare function formatQoS(qos: QoS | string | null | undefined): string | undefined;

// ------------------------------------------------------------------------ frames

export interface SessionFrame {
  type: "session";
  session_id: string;
  model: string;
  created: boolean;
  context_turns: number;
  expires_in: number;
  heartbeat_interval: number;
  idle_timeout: number;
  server: string;
  epoch: string;
  active?: { request_id: string; next_seq: number; state: "running" | "done" };
  /** The server's half of end-to-end encryption, when the client asked for it. */
  e2e?: E2EOffer;
}
export interface E2EOffer {
  version: 1;
  suite: "x25519-ed25519-hkdf-sha256-aes-256-gcm";
  /** The server's ephemeral X25519 key, base64url. */
  server_key: string;
  /** The server's Ed25519 identity, base64url: what a client pins. */
  identity: string;
  /** The identity's signature of the transcript, base64url. */
  signature: string;
  /** SHA-256 (hex) of what serves the stream: build, configuration, models. */
  measurement: string;
  rotate_bytes: number;
  rotate_s: number;
}
export interface StartFrame {
  type: "start";
  request_id: string;
  trace_id: string;
  model: string;
  prompt_tokens: number;
}
export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
}
export interface DoneFrame {
  type: "done";
  done: true;
  request_id: string;
  trace_id: string;
  finish_reason: "stop" | "length" | "cancelled";
  usage: Usage;
  timing: { queue_ms: number; ttft_ms: number | null; total_ms: number };
  text?: string;
  model_version?: string;
  /** stream: false with logprobs: one per token of `text`. */
  logprobs?: TokenLogprob[];
  /** The calls the reply made, when the request offered `tools`. */
  tool_calls?: ToolCallTurn[];
}
/** A call of a tool a reply made (`arguments`: its JSON text). */
export interface ToolCallTurn {
  id: string;
  name: string;
  arguments: string;
}
export interface Message {
  role: "system" | "user" | "assistant" | "tool";
  content: string;
  /** An assistant's calls, sent back with the history. */
  tool_calls?: ToolCallTurn[];
  /** A tool's result: the call it answers. */
  tool_call_id?: string;
}
/** The fields of a generate frame (docs/protocol.md, section 2). */
export interface GenerateFields {
  messages?: Message[];
  stream?: boolean;
  max_tokens?: number;
  temperature?: number;
  top_p?: number;
  stop?: string | string[];
  seed?: number;
  request_id?: string;
  reset?: boolean;
  priority?: number;
  qos?: QoS | string;
  resumable?: boolean;
  traceparent?: string;
  /** A JSON Schema the reply is bound to: the reply is a JSON document valid for it. */
  schema?: Record<string, unknown>;
  /** 0 to 20: each token comes with its log probability and this many alternatives. */
  logprobs?: number;
  /** Functions the reply may call, as OpenAI's Chat Completions takes them. */
  tools?: { type: "function"; function: { name: string; description?: string; parameters?: Record<string, unknown>; strict?: boolean } }[];
  tool_choice?: "auto" | "none" | "required" | { type: "function"; function: { name: string } };
  parallel_tool_calls?: boolean;
  /** Outputs sent as tensor frames beside the token frames (docs/protocol.md, section 10). */
  tensors?: ("token_ids" | "logprobs" | "top_logprobs")[];
  /** The prompt as the model's token ids (an Int32Array goes up as a tensor frame). */
  prompt_ids?: number[] | Int32Array;
}

/** A token's log probability, and the likeliest tokens at its position (OpenAI's shape). */
export interface TokenLogprob {
  token: string;
  logprob: number;
  bytes: number[];
  top_logprobs: { token: string; logprob: number; bytes: number[] }[];
}

/** The fields of an embed frame besides its input (docs/protocol.md). */
export interface EmbedFields {
  model?: string;
  encoding_format?: "float" | "base64" | "tensor";
  dimensions?: number;
  request_id?: string;
  /** With token ids given as a TypedArray: their shape ([inputs, tokens]; default one input). */
  shape?: number[];
}

/** A tensor read from a tensor frame: `data` is a TypedArray over the frame, row-major. */
export interface TensorData {
  dtype: "BOOL" | "UINT8" | "UINT16" | "UINT32" | "UINT64" | "INT8" | "INT16" | "INT32" | "INT64" | "FP16" | "FP32" | "FP64";
  shape: number[];
  data: Uint8Array | Uint16Array | Uint32Array | BigUint64Array | Int8Array | Int16Array | Int32Array | BigInt64Array | Float32Array | Float64Array;
}

/** The answer to an embed: a vector per input, in order (base64: little-endian float32; tensor:
 * no `data`, the vectors in `arrays.embedding`). */
export interface EmbeddingsFrame {
  type: "embeddings";
  request_id: string;
  model: string;
  data?: (number[] | string)[];
  tensors?: string[];
  arrays?: { [name: string]: TensorData };
  usage: { prompt_tokens: number; total_tokens: number };
}

/** A tensor frame's contents (tensors.js). */
export interface Tensor extends TensorData {
  requestId: string | null;
  name: string;
  seq: number | null;
}
export const TENSOR: 0x10;
export function decodeTensor(frame: ArrayBuffer | Uint8Array): Tensor;
export function encodeTensor(tensor: { requestId?: string | null; name: string; data: ArrayBufferView; shape?: number[]; seq?: number; dtype?: TensorData["dtype"] }): Uint8Array;
export function tensorMeta(frame: Uint8Array): [string | null, number | null];

/** Tokens `seq` .. `seq + n - 1` of a reply. */
export interface TokenChunk {
  text: string;
  seq: number;
  n: number;
  /** One per token, when the request asked for `logprobs`. */
  logprobs?: TokenLogprob[];
  /** The tensor frames sent with it, when the request asked for `tensors` (`token_ids`: an
   * Int32Array of `n`). */
  tensors?: { [name: string]: TensorData };
}

// ------------------------------------------------------------------------ sessions

export interface ReconnectPolicy {
  attempts: number;
  firstDelayMs: number;
  maxDelayMs: number;
}
export declare const DEFAULT_RECONNECT: ReconnectPolicy;

export interface ConnectOptions {
  /** Sent as the `bearer.<key>` subprotocol (browsers cannot set headers). */
  apiKey?: string;
  sessionId?: string;
  model?: string;
  /** Every request's default quality of service. */
  qos?: QoS | string;
  /** false: never reconnect. */
  reconnect?: boolean | Partial<ReconnectPolicy>;
  /** How often a binary heartbeat measures the round trip (default 2000). */
  heartbeatMs?: number;
  /** Weight of a new sample in the smoothed round trip (default 1/8). */
  rttSmoothing?: number;
  /** Encrypt every frame end to end with the server that proves this identity. */
  e2e?: E2EOptions;
  /** "auto" (default): WebTransport where the browser has it and the page's own server offers
   * it (`GET /v2/webtransport`), else (or when it does not get through) a WebSocket;
   * "websocket"; "webtransport": that or nothing. */
  transport?: "auto" | "websocket" | "webtransport";
}

/** Where a server serves /v2/infer over WebTransport (null: it does not). */
export interface WebTransportOffer {
  url: string;
  certificateHashes: { algorithm: "sha-256"; value: Uint8Array }[] | null;
}
export declare function hasWebTransport(): boolean;
export declare function webTransportOffer(httpUrl: string): Promise<WebTransportOffer | null>;
/** A message as the WebTransport stream carries it: kind byte, QUIC varint length, bytes. */
export declare function encodeMessage(data: string | ArrayBuffer | ArrayBufferView): Uint8Array;
export declare class MessageReader {
  feed(chunk: Uint8Array): (string | ArrayBuffer)[];
}
/** The part of a WebSocket a session uses, over a WebTransport session. */
export declare class WebTransportSocket {
  constructor(url: string, options?: { certificateHashes?: WebTransportOffer["certificateHashes"] });
  readonly url: string;
  readonly readyState: number;
  onmessage: ((event: { data: string | ArrayBuffer }) => void) | null;
  onclose: ((event: { code: number; reason: string }) => void) | null;
  send(data: string | ArrayBuffer | ArrayBufferView): void;
  close(code?: number, reason?: string): void;
}

/** A pinned server identity: its Ed25519 public key as base64url (the offer's `identity`),
 * as a PEM public key (SPKI), or its 32 raw bytes. */
export type PinnedIdentity = string | Uint8Array | ArrayBuffer;
export interface E2EOptions {
  /** The key the server must prove, or several (a rotation of the server's key). */
  identity: PinnedIdentity | PinnedIdentity[];
}

export type KeyDirection = "client_to_server" | "server_to_client";
export interface KeyEvent {
  direction: KeyDirection;
  /** 0 for the agreed key, +1 per rotation. */
  epoch: number;
  /** SHA-256 (hex) of the key before it; null for an agreed key. */
  oldHash: string | null;
  /** SHA-256 (hex) of the key: what the server's audit log names it by. */
  newHash: string;
}

export interface SessionEvents {
  rtt: CustomEvent<{ rtt: number; sample: number }>;
  reconnecting: CustomEvent<{ code: number; attempt: number }>;
  reconnected: CustomEvent<{ resumed: string[]; epochChanged: boolean }>;
  close: CustomEvent<{ code: number; reason: string; error: ConnectionClosed }>;
  error: CustomEvent<{ error: SeedanceError }>;
  /** An end-to-end key agreed (at a reconnect) or rotated to. */
  key: CustomEvent<KeyEvent>;
}

export declare function inferUrl(url: string, params?: Record<string, string | null | undefined>): string;
export declare function connect(url?: string, options?: ConnectOptions): Promise<Session>;

export declare class Session extends EventTarget {
  readonly url: string;
  readonly sessionId: string | null;
  readonly model: string | null;
  readonly info: SessionFrame | null;
  readonly epoch: string | undefined;
  /** The smoothed round trip of binary heartbeats, ms (undefined before the first). */
  readonly rtt: number | undefined;
  readonly lastRtt: number | undefined;
  readonly reconnects: number;
  readonly closed: boolean;
  /** The transport of the connection now (null before the first). */
  readonly transport: "websocket" | "webtransport" | null;
  /** End-to-end encryption of the connection now (a new Channel at every reconnect); null when
   * not asked for. */
  readonly e2e: Channel | null;
  /** A reply is running on the session (a session runs one at a time). */
  readonly busy: boolean;
  qos: QoS | string | undefined;
  generate(prompt: string | GenerateFields, fields?: GenerateFields): Generation;
  embed(input: string | string[] | number[] | number[][] | Int32Array | BigInt64Array, fields?: EmbedFields): Promise<EmbeddingsFrame>;
  cancel(requestId?: string): void;
  ping(): Promise<number>;
  end(): void;
  close(): void;
  /** Drop the connection as a network failure would (demos, tests). */
  drop(): void;
  addEventListener<K extends keyof SessionEvents>(
    type: K,
    listener: (event: SessionEvents[K]) => void,
    options?: boolean | AddEventListenerOptions,
  ): void;
  addEventListener(type: string, listener: EventListenerOrEventListenerObject | null, options?: boolean | AddEventListenerOptions): void;
}

export declare class Generation implements AsyncIterable<TokenChunk> {
  readonly session: Session;
  readonly requestId: string;
  readonly resumable: boolean;
  readonly start: StartFrame | null;
  readonly done: DoneFrame | null;
  readonly error: SeedanceError | null;
  readonly lastSeq: number;
  readonly resumes: number;
  readonly text: string;
  /** Each token's log probability, in order, when the request asked for `logprobs`. */
  readonly logprobs: TokenLogprob[];
  /** The tensor frames that came with the tokens, by name, each chunk's in order. */
  readonly tensors: { [name: string]: TensorData[] };
  cancel(): void;
  result(): Promise<DoneFrame>;
  [Symbol.asyncIterator](): AsyncIterator<TokenChunk>;
}

// ------------------------------------------------------------------------ end-to-end encryption

export declare const E2E_VERSION: 1;
export declare const E2E_SUITE: "x25519-ed25519-hkdf-sha256-aes-256-gcm";

export interface ChannelOptions {
  sendKey: Uint8Array;
  receiveKey: Uint8Array;
  /** Default "client_to_server". */
  sending?: KeyDirection;
  /** Rotate the sending key after this many bytes of text (default 50 MiB). */
  rotateBytes?: number;
  /** ... or after this many seconds in use (default 1800). */
  rotateS?: number;
  onKey?: ((direction: KeyDirection, epoch: number, oldHash: string | null, newHash: string) => void) | null;
  /** Seconds, monotonic (default performance.now() / 1000). */
  clock?: () => number;
  identity?: string | null;
  measurement?: string | null;
}

/** One connection's encryption, both directions (docs/protocol.md, section 9). Sealing and
 * opening are each serialised: frames are sealed and opened in the order of the calls. */
export declare class Channel {
  static create(sessionId: string, options: ChannelOptions): Promise<Channel>;
  readonly sessionId: string;
  readonly sending: KeyDirection;
  readonly receiving: KeyDirection;
  readonly rotateBytes: number;
  readonly rotateS: number;
  /** The server's identity (base64url) and measurement, for a channel from a handshake. */
  readonly identity: string | null;
  readonly measurement: string | null;
  readonly sendEpoch: number;
  readonly receiveEpoch: number;
  /** SHA-256 (hex) of the keys in use. */
  readonly sendKeyHash: string;
  readonly receiveKeyHash: string;
  /** The first refusal: every frame after it is refused. */
  readonly failed: EncryptionFailed | null;
  seal(text: string): Promise<Uint8Array>;
  /** Rejects with EncryptionFailed unless `data` is exactly the next frame, intact. */
  open(data: Uint8Array | ArrayBuffer): Promise<string>;
}

/** The client's side of the agreement: a fresh X25519 key pair, then the server's offer. */
export declare class Handshake {
  static create(pinned: PinnedIdentity | PinnedIdentity[]): Promise<Handshake>;
  readonly pinned: Uint8Array[];
  readonly publicKey: Uint8Array;
  /** The URL's `e2e` parameter: the public key, base64url. */
  readonly param: string;
  finish(
    offer: E2EOffer | null | undefined,
    sessionId: string,
    options?: { onKey?: ChannelOptions["onKey"]; clock?: () => number },
  ): Promise<Channel>;
}

export declare function b64url(bytes: Uint8Array): string;
export declare function unb64url(text: string): Uint8Array;
/** A pinned identity's 32 raw bytes (InvalidRequest if it is not an Ed25519 public key). */
export declare function identityBytes(identity: PinnedIdentity): Uint8Array;
/** SHA-256 of a key, hex. */
export declare function keyHash(key: Uint8Array): Promise<string>;
/** The key after `key`: HKDF-SHA256, info "seedance-e2e/1 ratchet". */
export declare function ratchet(key: Uint8Array): Promise<Uint8Array>;
export declare function transcript(
  clientKey: Uint8Array, serverKey: Uint8Array, identity: Uint8Array, sessionId: string, measurement: string,
): Uint8Array;

// ------------------------------------------------------------------------ resilience

export declare class HealthScore {
  constructor(slaTtftMs: number, calls?: number);
  record(ttftMs: number | null): void;
  readonly value: number;
}

export type BreakerState = "closed" | "open" | "half_open";
export interface BreakerPolicy {
  windowMs: number;
  minSamples: number;
  failureRate: number;
  cooldownMs: number;
  probes: number;
}
export declare const DEFAULT_BREAKER: BreakerPolicy;
export type BreakerListener = (name: string, from: BreakerState, to: BreakerState, why: string) => void;

export declare class CircuitBreaker {
  constructor(name: string, policy?: Partial<BreakerPolicy>, onChange?: BreakerListener | null, clock?: () => number);
  readonly state: BreakerState;
  allow(): boolean;
  record(ok: boolean): void;
}

export declare class RetryBudget {
  /** `ratio` of the calls (default 0.1), saved up to `burst` retries (default 10). */
  constructor(ratio?: number, burst?: number);
  readonly calls: number;
  readonly retries: number;
  readonly available: boolean;
  called(): void;
  spend(): void;
}

export declare class ResponseCache {
  constructor(maxEntries?: number);
  static key(prompt: string, fields: GenerateFields): string;
  get(key: string): string | undefined;
  put(key: string, text: string): void;
}

export interface Degrade {
  /** Health below which the client degrades (default 0.7). */
  below?: number;
  max_tokens?: number;
  model?: string;
  /** Go straight to the fallbacks. */
  fallback?: boolean;
}

export interface ResilientOptions {
  qos?: QoS;
  slaTtftMs?: number;
  firstTokenTimeoutMs?: number;
  breaker?: Partial<BreakerPolicy>;
  retryRatio?: number;
  cache?: ResponseCache;
  degradedReply?: string;
  degrade?: Degrade;
  onBreaker?: BreakerListener;
  connectOptions?: ConnectOptions;
}

export declare class Reply implements AsyncIterable<TokenChunk> {
  readonly source: "endpoint" | "cache" | "degraded" | null;
  readonly endpoint: string | null;
  /** Why not the first endpoint. */
  readonly reason: string | null;
  readonly done: DoneFrame | null;
  readonly text: string;
  collect(): Promise<string>;
  [Symbol.asyncIterator](): AsyncIterator<TokenChunk>;
}

/** Calls are independent: each resets its session's context unless `reset: false` is given;
 * concurrent calls use sessions of their own. */
export declare class ResilientClient {
  constructor(endpoints: string[], options?: ResilientOptions);
  readonly health: HealthScore;
  readonly breakers: Map<string, CircuitBreaker>;
  readonly budget: RetryBudget;
  generate(prompt: string, fields?: GenerateFields): Reply;
  close(): void;
}

// ------------------------------------------------------------------------ rendering

export declare const WINDOW_MAX: 128;
export declare const WINDOW_MIN: 32;
export declare const RTT_LOW_MS: 80;
export declare const RTT_HIGH_MS: 200;
/** Tokens per render window for a round trip: 128 at <= 80 ms, 32 at >= 200 ms, linear between. */
export declare function windowFor(rttMs: number | undefined): number;
export declare function escapeHtml(text: string): string;

export type Fragment =
  | { kind: "text"; html: string }
  | { kind: "code"; html: string }
  | { kind: "open"; lang: string }
  | { kind: "close" };

export declare class MarkdownStream {
  push(text: string): Fragment[];
  end(): Fragment[];
}

export interface WindowRecord {
  tokens: number;
  window: number;
  /** The main thread's ms to append the window and lay the page out. */
  appendMs: number;
}

export declare class TokenView {
  constructor(
    container: HTMLElement,
    options?: { maxWaitMs?: number; workerUrl?: string | URL; onWindow?: (record: WindowRecord) => void },
  );
  readonly container: HTMLElement;
  readonly worker: Worker;
  readonly stats: WindowRecord[];
  push(text: string, tokens?: number, rttMs?: number): void;
  end(): Promise<void>;
  reset(): void;
  append(fragments: Fragment[]): void;
  terminate(): void;
}
