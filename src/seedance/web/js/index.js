// @seedance/client: the browser SDK of Seedance. No build step: an ES module as it is.
export * from "./seedance.js";
export * from "./qos.js";
export { TokenView } from "./view.js";
export { MarkdownStream, escapeHtml, windowFor, WINDOW_MAX, WINDOW_MIN, RTT_LOW_MS, RTT_HIGH_MS } from "./render.js";
