// The render worker: tokens and the current round trip in, safe HTML fragments out, one
// message per render window, so that the page's main thread only appends.
//
//   in   {type: "push", text, tokens, rttMs}   text of `tokens` tokens (a frame may carry several)
//        {type: "end", id}                     the reply is over: flush, then {type: "ended", id}
//        {type: "reset"}                       drop what is held, start a new reply
//        {type: "config", maxWaitMs}
//   out  {type: "window", fragments, tokens, window}
//
// A window closes when the tokens held reach the window size for the round trip (windowFor:
// 128 at 80 ms or less, 32 at 200 ms or more), or when the oldest has waited maxWaitMs, so a
// slow stream is never held back for long.

import { MarkdownStream, windowFor } from "./render.js";

let markdown = new MarkdownStream();
let pending = []; // texts of the tokens not rendered yet
let pendingTokens = 0;
let rttMs;
let maxWaitMs = 100;
let timer = null;

self.onmessage = ({ data }) => {
  switch (data.type) {
    case "push":
      if (data.rttMs !== undefined) rttMs = data.rttMs;
      pending.push(data.text);
      pendingTokens += data.tokens ?? 1;
      drain();
      break;
    case "end":
      emit(true);
      markdown = new MarkdownStream();
      self.postMessage({ type: "ended", id: data.id });
      break;
    case "reset":
      stopTimer();
      pending = [];
      pendingTokens = 0;
      markdown = new MarkdownStream();
      break;
    case "config":
      maxWaitMs = data.maxWaitMs ?? maxWaitMs;
      break;
  }
};

function drain() {
  const size = windowFor(rttMs);
  if (pendingTokens >= size) emit(false);
  else if (timer === null) timer = setTimeout(() => emit(false), maxWaitMs);
}

function emit(final) {
  stopTimer();
  const fragments = markdown.push(pending.join(""));
  if (final) fragments.push(...markdown.end());
  if (fragments.length || pendingTokens) {
    self.postMessage({ type: "window", fragments, tokens: pendingTokens, window: windowFor(rttMs) });
  }
  pending = [];
  pendingTokens = 0;
}

function stopTimer() {
  if (timer !== null) clearTimeout(timer);
  timer = null;
}
