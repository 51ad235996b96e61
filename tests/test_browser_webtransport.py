"""WebTransport in a real headless Chromium: the browser SDK takes it where the server offers
it (``--http3``, a certificate the server made and the page pins by hash), streams replies and
reconnects over it, and falls back to a WebSocket where it is not offered; and a plain page
with the browser's own ``WebTransport`` speaks the framing of docs/protocol.md, section 11."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from playwright.async_api import Browser

from tests.support.browser import chromium, tab
from tests.support.servers import RunningServer
from tests.test_browser_e2e import Identity

pytestmark = pytest.mark.subprocess  # Chromium runs as a process of its own
pytest.importorskip("aioquic", reason="--http3 needs aioquic, which needs Python 3.11")


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as running:
        yield running


def page_of(server: RunningServer) -> str:
    return f"http://127.0.0.1:{server.port}/sdk/package.json"


async def test_the_sdk_streams_over_webtransport_where_the_server_offers_it(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    server = make_server(http3=True, tokens_per_s=200)
    async with tab(browser, page_of(server)) as page:
        result = await page.sdk(
            """const session = await sd.connect("", {sessionId: "wt-browser"});
            const reply = session.generate("hello over QUIC", {max_tokens: 160, resumable: true});
            let tokens = 0, dropped = false;
            for await (const chunk of reply) {
              tokens += chunk.n;
              if (tokens >= 10 && !dropped) { dropped = true; session.drop(); }
            }
            const rtt = await session.ping();
            const again = await session.generate("and again", {max_tokens: 5}).result();
            session.close();
            return {transport: session.transport, tokens, usage: reply.done.usage.completion_tokens,
                    resumes: reply.resumes, reconnects: session.reconnects, rtt: rtt >= 0,
                    again: again.finish_reason, session: session.sessionId};""",
        )
        page.check()
    assert result["transport"] == "webtransport"
    assert result["tokens"] == 160 == result["usage"]
    assert result["resumes"] == 1 and result["reconnects"] == 1  # resumed over WebTransport
    assert result["rtt"] and result["again"] == "length" and result["session"] == "wt-browser"


async def test_the_sdk_uses_a_websocket_where_webtransport_is_not_offered(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    server = make_server()
    async with tab(browser, page_of(server)) as page:
        result = await page.sdk(
            """const session = await sd.connect("");
            const reply = session.generate("hi", {max_tokens: 4});
            await reply.result();
            const refused = await sd.connect("", {transport: "webtransport", reconnect: false})
              .then(() => "connected", (e) => e.constructor.name);
            session.close();
            return {transport: session.transport, text: reply.text.length > 0, refused};""",
        )
        page.check()
    assert result == {"transport": "websocket", "text": True, "refused": "ConnectionClosed"}


async def test_a_plain_page_speaks_the_framing_with_the_browsers_own_webtransport(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    """No SDK: the browser's WebTransport, the framing written by hand, a refusal's close code."""
    server = make_server(http3=True)
    async with tab(browser, page_of(server)) as page:
        result = await page.page.evaluate(
            """async () => {
              const offer = await (await fetch("/v2/webtransport")).json();
              const hash = Uint8Array.from(offer.certificate_sha256.match(/../g),
                                           (h) => parseInt(h, 16));
              const options = {serverCertificateHashes: [{algorithm: "sha-256", value: hash}]};
              const open = async (query) => {
                const wt = new WebTransport(
                  `https://127.0.0.1:${offer.port}${offer.path}?${query}`, options);
                await wt.ready;
                const stream = await wt.createBidirectionalStream();
                return {wt, writer: stream.writable.getWriter(),
                        reader: stream.readable.getReader()};
              };
              const frame = (text) => {
                const bytes = new TextEncoder().encode(text);  // under 16 KiB: a 2-byte length
                return Uint8Array.of(0, 0x40 | (bytes.length >> 8), bytes.length & 0xff, ...bytes);
              };
              const readFrames = async (reader, until) => {
                let buffer = new Uint8Array(0); const frames = [];
                while (!frames.some(until)) {
                  const {value, done} = await reader.read();
                  if (done) break;
                  const joined = new Uint8Array(buffer.length + value.length);
                  joined.set(buffer); joined.set(value, buffer.length); buffer = joined;
                  for (;;) {
                    if (buffer.length < 2) break;
                    const size = 1 << (buffer[1] >> 6);
                    let length = buffer[1] & 0x3f;
                    for (let i = 1; i < size; i++) length = length * 256 + buffer[1 + i];
                    if (buffer.length < 1 + size + length) break;
                    const payload = buffer.subarray(1 + size, 1 + size + length);
                    if (buffer[0] === 0) frames.push(JSON.parse(new TextDecoder().decode(payload)));
                    buffer = buffer.slice(1 + size + length);
                  }
                }
                return frames;
              };
              const good = await open("session_id=plain");
              await good.writer.write(frame(JSON.stringify(
                {type: "generate", request_id: "p1", prompt: "plain page", max_tokens: 8})));
              const frames = await readFrames(good.reader, (f) => f.type === "done");
              good.wt.close();
              const bad = await open("model=nope");
              await bad.writer.write(Uint8Array.of(1, 2, 1, 0));  // a heartbeat opens the stream
              const refused = await readFrames(bad.reader, (f) => f.type === "error");
              const closed = await bad.wt.closed;
              return {types: [...new Set(frames.map((f) => f.type))],
                      tokens: frames.filter((f) => f.type === "token")
                                    .reduce((a, f) => a + (f.n ?? 1), 0),
                      error: refused.at(-1).error.code, code: closed.closeCode,
                      reason: closed.reason};
            }"""
        )
        page.check()
    assert result["types"] == ["session", "start", "token", "done"]
    assert result["tokens"] == 8
    assert result["error"] == "model_not_found"
    assert (result["code"], result["reason"]) == (4404, "model_not_found")


async def test_an_encrypted_session_over_webtransport_is_the_plain_reply(
    browser: Browser, make_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    """End-to-end encryption (docs/protocol.md, section 9) over WebTransport as over a
    WebSocket: the frames sealed on the stream, the reply the plain one."""
    identity = Identity(tmp_path)
    server = make_server(http3=True, e2e_key=str(identity.path))
    async with tab(browser, page_of(server)) as page:
        result = await page.sdk(
            """const fields = {max_tokens: 60, seed: 3, temperature: 0.8};
            const plain = await sd.connect("", {transport: "websocket"});
            const reference = plain.generate("a secret", fields);
            await reference.result();
            plain.close();
            const session = await sd.connect("", {e2e: {identity: arg}});
            const reply = session.generate("a secret", fields);
            await reply.result();
            const out = {transport: session.transport, text: reply.text,
                         plain: reference.text, identity: session.e2e.identity};
            session.close();
            return out;""",
            identity.public,
        )
        page.check()
    assert result["transport"] == "webtransport" and result["identity"] == identity.public
    assert result["text"] == result["plain"] and result["text"]
