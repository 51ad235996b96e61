// @seedance/client: the browser SDK of Seedance. No build step: an ES module as it is.
export * from "./seedance.js";
export * from "./qos.js";
export { TokenView } from "./view.js";
export { MarkdownStream, escapeHtml, windowFor, WINDOW_MAX, WINDOW_MIN, RTT_LOW_MS, RTT_HIGH_MS } from "./render.js";
export { Channel, Handshake, E2E_SUITE, E2E_VERSION, b64url, unb64url, identityBytes, keyHash, ratchet, transcript } from "./e2e.js";
export { TENSOR, decodeTensor, encodeTensor, tensorMeta } from "./tensors.js";
export { WebTransportSocket, MessageReader, encodeMessage, hasWebTransport, webTransportOffer } from "./webtransport.js";
