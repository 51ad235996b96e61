// The playground: a chat with the served model on the browser SDK, with the session's live
// figures (round trip, time to first token, tokens/s, render window) and a visible resume
// when the connection drops.

import { connect, TokenView, Unauthorized, windowFor } from "../sdk/index.js";

const $ = (id) => document.getElementById(id);
const KEY = "seedance.apiKey";
const SESSION = "seedance.sessionId";

let session = null;
let running = null; // the generation being read

function setState(text, tone) {
  const el = $("state");
  el.textContent = text;
  el.className = tone;
}

function banner(text, tone = "") {
  const el = $("banner");
  el.textContent = text;
  el.className = tone;
  el.hidden = !text;
}

function note(text) {
  const el = document.createElement("div");
  el.className = "event";
  el.textContent = text;
  $("messages").append(el);
}

async function open({ fresh = false } = {}) {
  session?.close();
  setState("connecting", "warn");
  const sessionId = fresh ? undefined : sessionStorage.getItem(SESSION) ?? undefined;
  try {
    session = await connect("", { apiKey: sessionStorage.getItem(KEY) ?? undefined, sessionId });
  } catch (error) {
    if (error instanceof Unauthorized) {
      $("key-dialog").showModal();
      setState("needs an API key", "bad");
    } else {
      setState(`refused: ${error.message}`, "bad");
    }
    return;
  }
  sessionStorage.setItem(SESSION, session.sessionId);
  $("session-id").textContent = session.sessionId;
  $("model").textContent = session.model;
  setState("connected", "ok");
  banner("");
  session.addEventListener("rtt", ({ detail }) => {
    $("rtt").textContent = `${detail.rtt.toFixed(1)} ms`;
    $("window").textContent = `${windowFor(detail.rtt)} tokens`;
  });
  session.addEventListener("reconnecting", ({ detail }) => {
    setState("reconnecting", "warn");
    const at = running?.resumable ? `; the reply resumes after token ${running.lastSeq}` : "";
    banner(`Connection lost (${detail.code}). Reconnecting, try ${detail.attempt}${at}.`);
  });
  session.addEventListener("reconnected", ({ detail }) => {
    setState("connected", "ok");
    if (detail.resumed.length && running) {
      const text = `Reconnected: resumed ${running.requestId} after token ${running.lastSeq}`;
      banner(text, "resumed");
      note(`⟳ ${text}`);
    } else {
      banner("Reconnected.", "resumed");
    }
  });
  session.addEventListener("close", ({ detail }) => {
    setState(`closed (${detail.code})`, "bad");
  });
}

async function send(prompt) {
  if (!session || session.closed) await open();
  const user = document.createElement("div");
  user.className = "msg user";
  user.textContent = prompt;
  const reply = document.createElement("div");
  reply.className = "msg assistant";
  $("messages").append(user, reply);
  const view = new TokenView(reply);
  const generation = session.generate(prompt, {
    max_tokens: Number($("max-tokens").value) || 256,
    temperature: Number($("temperature").value),
    resumable: $("resumable").checked,
  });
  running = generation;
  $("cancel").disabled = false;
  $("send").disabled = true;
  const sent = performance.now();
  let first = null;
  let tokens = 0;
  try {
    for await (const chunk of generation) {
      const now = performance.now();
      if (first === null) {
        first = now;
        $("ttft").textContent = `${(first - sent).toFixed(0)} ms`;
      }
      tokens += chunk.n;
      if (now > first) $("tps").textContent = ((tokens - 1) / ((now - first) / 1000)).toFixed(1);
      view.push(chunk.text, chunk.n, session.rtt);
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    await view.end();
    reply.dataset.finish = generation.done.finish_reason;
    reply.dataset.tokens = generation.done.usage.completion_tokens;
  } catch (error) {
    await view.end();
    reply.classList.add("error");
    reply.dataset.error = error.code;
    const why = document.createElement("div");
    why.textContent = `${error.code}: ${error.message}`;
    reply.append(why);
  } finally {
    reply.dataset.received = tokens;
    reply.dataset.resumes = generation.resumes;
    reply.dataset.state = "done";
    view.terminate();
    running = null;
    $("cancel").disabled = true;
    $("send").disabled = false;
  }
}

$("chat").addEventListener("submit", (event) => {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || running) return;
  $("prompt").value = "";
  send(prompt);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat").requestSubmit();
  }
});
$("cancel").addEventListener("click", () => running?.cancel());
$("drop").addEventListener("click", () => session?.drop());
$("new-session").addEventListener("click", () => {
  sessionStorage.removeItem(SESSION);
  $("messages").replaceChildren();
  open({ fresh: true });
});
$("key-dialog").addEventListener("close", () => {
  sessionStorage.setItem(KEY, $("api-key").value);
  open();
});

open();
