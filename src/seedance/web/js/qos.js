// Quality of service in the browser SDK, as in the Python SDK (seedance.client.qos): a health
// score, a circuit breaker per endpoint, a retry budget, and fallbacks tried only before a
// reply's first token.
//
//   const client = new ResilientClient(["wss://primary", "wss://secondary"], {
//     qos: { class: "high", slatag: "chat" }, slaTtftMs: 800,
//     cache: new ResponseCache(), degradedReply: "Busy; try again in a minute.",
//     degrade: { below: 0.7, max_tokens: 64 },
//   });
//   const reply = client.generate("hello", { max_tokens: 128 });
//   for await (const chunk of reply) show(chunk.text);
//   reply.source, reply.reason   // "endpoint" | "cache" | "degraded", why not the first endpoint
//
// Health score: each of the last 10 calls scores 1 when its first token came within the SLA
// (slaTtftMs), sla / ttft when later, 0 when it failed; the health is their mean weighted by
// recency (newest 10, oldest 1), 1 before any call. It goes with every request (health_score of
// the qos field); below `degrade.below` (0.7) the client degrades as configured.
//
// Circuit breaker (one per endpoint): closed, it counts the outcomes of the last 5 s; with at
// least 20 and half or more failed it opens and calls skip the endpoint. After a 5 s cool-down
// it is half-open: up to 3 probes go through; as many successes close it, one failure opens it
// again. Every change is logged (console.warn) and passed to onBreaker(name, from, to, why).

import { connect, SeedanceError } from "./seedance.js";

export class HealthScore {
  constructor(slaTtftMs, calls = 10) {
    this.slaTtftMs = slaTtftMs;
    this.calls = calls;
    this.scores = [];
  }

  /** One call: the ms to its first token, or null when it failed. */
  record(ttftMs) {
    const score = ttftMs == null ? 0 : ttftMs <= this.slaTtftMs ? 1 : this.slaTtftMs / ttftMs;
    this.scores.push(score);
    if (this.scores.length > this.calls) this.scores.shift();
  }

  get value() {
    if (this.scores.length === 0) return 1;
    let sum = 0;
    let weights = 0;
    this.scores.forEach((score, i) => {
      sum += (i + 1) * score;
      weights += i + 1;
    });
    return sum / weights;
  }
}

export const DEFAULT_BREAKER = { windowMs: 5000, minSamples: 20, failureRate: 0.5, cooldownMs: 5000, probes: 3 };

export class CircuitBreaker {
  constructor(name, policy = {}, onChange = null, clock = () => performance.now()) {
    this.name = name;
    this.policy = { ...DEFAULT_BREAKER, ...policy };
    this.state = "closed";
    this.onChange = onChange;
    this.clock = clock;
    this._outcomes = []; // [time, ok]
    this._openedAt = 0;
    this._probesOut = 0;
    this._probesOk = 0;
  }

  /** May a call go to the endpoint now? (A half-open breaker counts it as a probe.) */
  allow() {
    if (this.state === "open") {
      if (this.clock() - this._openedAt < this.policy.cooldownMs) return false;
      this._move("half_open", `${this.policy.cooldownMs / 1000} s cool-down over`);
    }
    if (this.state === "half_open") {
      if (this._probesOut >= this.policy.probes) return false;
      this._probesOut += 1;
    }
    return true;
  }

  record(ok) {
    const now = this.clock();
    const policy = this.policy;
    if (this.state === "half_open") {
      if (!ok) return this._open(now, "a probe failed");
      this._probesOk += 1;
      if (this._probesOk >= policy.probes) {
        this._outcomes = [];
        this._move("closed", `${policy.probes} probes succeeded`);
      }
      return;
    }
    if (this.state === "open") return; // a call that started before it opened
    this._outcomes.push([now, ok]);
    while (this._outcomes.length && this._outcomes[0][0] < now - policy.windowMs) this._outcomes.shift();
    const total = this._outcomes.length;
    if (total >= policy.minSamples) {
      const failed = this._outcomes.filter(([, good]) => !good).length;
      if (failed / total >= policy.failureRate) {
        this._open(now, `${failed} of the last ${total} calls in ${policy.windowMs / 1000} s failed`);
      }
    }
  }

  _open(now, why) {
    this._openedAt = now;
    this._move("open", why);
  }

  _move(state, why) {
    const old = this.state;
    this.state = state;
    this._probesOut = this._probesOk = 0;
    console.warn(`circuit breaker ${this.name}: ${old} -> ${state} (${why})`);
    this.onChange?.(this.name, old, state, why);
  }
}

/** Retries allowed: `ratio` of the calls made (each call adds `ratio`, a retry spends 1),
 * saved up to `burst` retries, so that a burst of failures after a calm spell can retry that
 * many in a row. Over any run, retries <= ratio x calls. */
export class RetryBudget {
  constructor(ratio = 0.1, burst = 10) {
    this.ratio = ratio;
    this.burst = burst;
    this.balance = 0;
    this.calls = 0;
    this.retries = 0;
  }

  called() {
    this.calls += 1;
    this.balance = Math.min(this.balance + this.ratio, this.burst);
  }

  get available() {
    return this.balance >= 1 - 1e-9; // ten calls of 0.1 add up to 0.999...
  }

  spend() {
    this.balance -= 1;
    this.retries += 1;
  }
}

/** Replies to earlier requests, by the request (least recently used out, `maxEntries`). */
export class ResponseCache {
  constructor(maxEntries = 256) {
    this.maxEntries = maxEntries;
    this._replies = new Map();
  }

  static key(prompt, fields) {
    const sorted = Object.fromEntries(Object.entries(fields).sort(([a], [b]) => (a < b ? -1 : 1)));
    return JSON.stringify([prompt, sorted]);
  }

  get(key) {
    const text = this._replies.get(key);
    if (text !== undefined) {
      this._replies.delete(key);
      this._replies.set(key, text);
    }
    return text;
  }

  put(key, text) {
    this._replies.delete(key);
    this._replies.set(key, text);
    while (this._replies.size > this.maxEntries) this._replies.delete(this._replies.keys().next().value);
  }
}

/** No endpoint answered and no fallback was declared; the message says why, for each. */
export class NoReply extends SeedanceError {
  static code = "no_reply";
  static retryable = true;
}

/** One call's reply: an async iterator of {text, seq, n} from an endpoint or a fallback. */
export class Reply {
  constructor(client, prompt, fields) {
    this.client = client;
    this.prompt = prompt;
    this.fields = fields;
    this.source = null; // "endpoint", "cache" or "degraded"
    this.endpoint = null;
    this.reason = null; // why not the first endpoint
    this.done = null;
    this._generation = null;
    this._breaker = null;
    this._parts = [];
  }

  get text() {
    return this._parts.join("");
  }

  async collect() {
    for await (const _ of this); // eslint-disable-line no-unused-vars
    return this.text;
  }

  async *[Symbol.asyncIterator]() {
    const first = await this.client._start(this);
    this._parts.push(first.text);
    yield first;
    const generation = this._generation;
    if (!generation) return;
    let failed = false;
    try {
      for await (const chunk of generation) {
        this._parts.push(chunk.text);
        yield chunk;
      }
    } catch (error) {
      failed = true; // after the first token: thrown as it is, never replayed
      throw error;
    } finally {
      this._finish(!failed);
    }
  }

  _finish(ok) {
    const generation = this._generation;
    this.done = generation.done;
    if (!ok) this._breaker.record(false); // its first token counted as a success already
    const cache = this.client.cache;
    if (ok && generation.done && cache && ["stop", "length"].includes(generation.done?.finish_reason)) {
      cache.put(ResponseCache.key(this.prompt, this.fields), this.text);
    }
  }
}

export class ResilientClient {
  constructor(endpoints, options = {}) {
    if (!endpoints.length) throw new TypeError("at least one endpoint");
    this.endpoints = [...endpoints];
    this.qos = options.qos ?? { class: "normal" };
    this.firstTokenTimeoutMs = options.firstTokenTimeoutMs ?? 10000;
    this.health = new HealthScore(options.slaTtftMs ?? 1000);
    this.breakers = new Map(endpoints.map((url) => [url, new CircuitBreaker(url, options.breaker, options.onBreaker)]));
    this.budget = new RetryBudget(options.retryRatio ?? 0.1);
    this.cache = options.cache ?? null;
    this.degradedReply = options.degradedReply ?? null;
    this.degrade = options.degrade ?? null;
    this.connectOptions = { reconnect: false, ...options.connectOptions };
    this._sessions = new Map(); // "url model" -> sessions (each runs one reply at a time)
  }

  /** Ask for a reply (fields as Session.generate's; replies stream). Calls are independent:
   * each resets its session's context (any endpoint may answer it; send a conversation as
   * `messages`), unless `reset: false` is given. */
  generate(prompt, fields = {}) {
    return new Reply(this, prompt, { reset: true, ...fields });
  }

  close() {
    for (const pool of this._sessions.values()) for (const session of pool) session.close();
    this._sessions.clear();
  }

  // Find the reply's first token: an endpoint's, or a fallback's.
  async _start(reply) {
    this.budget.called();
    const health = this.health.value;
    const fields = { ...reply.fields };
    let model = null;
    let endpoints = this.endpoints;
    const reasons = [];
    const degrade = this.degrade ? { below: 0.7, ...this.degrade } : null;
    if (degrade && health < degrade.below) {
      if (degrade.max_tokens != null) fields.max_tokens = Math.min(fields.max_tokens ?? 256, degrade.max_tokens);
      model = degrade.model ?? null;
      if (degrade.fallback) {
        endpoints = [];
        reasons.push(`health ${health.toFixed(2)} below ${degrade.below}`);
      }
    }
    const qos = { ...this.qos, healthScore: health };
    let tried = false;
    for (const url of endpoints) {
      const breaker = this.breakers.get(url);
      if (tried && !this.budget.available) {
        reasons.push(`${url}: not tried (retry budget spent)`);
        continue;
      }
      if (!breaker.allow()) {
        reasons.push(`${url}: circuit open`); // (an endpoint it skips costs no retry)
        continue;
      }
      if (tried) this.budget.spend();
      tried = true;
      const started = performance.now();
      let generation = null;
      let first;
      try {
        // The timeout covers connecting too; an attempt it gave up on asks for nothing.
        let abandoned = false;
        const attempt = async () => {
          // An idle session, else a new one; the generate claims it in the same tick (no await
          // between), so that concurrent calls never share a session (one reply at a time).
          let session = this._idle(url, model);
          if (!session) {
            session = await connect(url, { ...this.connectOptions, model: model ?? undefined, qos: this.qos });
            this._pool(url, model).push(session);
          }
          if (abandoned) return { done: true };
          generation = session.generate(reply.prompt, { ...fields, qos });
          return generation[Symbol.asyncIterator]().next();
        };
        const next = await withTimeout(attempt(), this.firstTokenTimeoutMs).finally(() => (abandoned = true));
        first = next.done ? { text: "", seq: 0, n: 0 } : next.value;
      } catch (error) {
        breaker.record(false);
        this.health.record(null);
        reasons.push(`${url}: ${error instanceof TimeoutError ? "no first token in time" : `${error.name}: ${error.message}`}`);
        if (generation && error instanceof TimeoutError) generation.cancel(); // nobody would read it
        continue;
      }
      this.health.record(performance.now() - started);
      breaker.record(true);
      Object.assign(reply, { source: "endpoint", endpoint: url, _generation: generation, _breaker: breaker });
      reply.reason = reasons.join("; ") || null;
      return first;
    }
    reply.reason = reasons.join("; ") || "no endpoint";
    const cached = this.cache?.get(ResponseCache.key(reply.prompt, reply.fields));
    if (cached !== undefined && cached !== null) {
      reply.source = "cache";
      return { text: cached, seq: 0, n: 1 };
    }
    if (this.degradedReply !== null) {
      reply.source = "degraded";
      return { text: this.degradedReply, seq: 0, n: 1 };
    }
    throw new NoReply(reply.reason);
  }

  _pool(url, model) {
    const key = `${url} ${model}`;
    const pool = (this._sessions.get(key) ?? []).filter((session) => !session.closed);
    this._sessions.set(key, pool);
    return pool;
  }

  _idle(url, model) {
    return this._pool(url, model).find((session) => !session.busy);
  }
}

class TimeoutError extends Error {}

function withTimeout(promise, ms) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new TimeoutError(`no answer in ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}
