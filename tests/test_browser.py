"""The browser SDK (``clients/js``), its render worker and the playground, in a real headless
Chromium against real servers (``tests/support/browser.py``)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
from playwright.async_api import Browser

from seedance.client import connect
from seedance.config_loader import load_access
from seedance.engines.synthetic import SyntheticEngine
from seedance.protocol.tensors import DTYPES, Tensor, encode_tensor
from seedance.tenants.keys import add_key
from seedance.testing.faults import FaultProxy
from tests.support.browser import chromium, tab
from tests.support.servers import RunningServer, server_config, slow_engine
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.subprocess  # Chromium runs as a process of its own

CONNECTED = "document.getElementById('state').textContent === 'connected'"


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as running:
        yield running


def blank(server: RunningServer | FaultProxy) -> str:
    """A page of the server's origin (its CSP allows the SDK and sockets to that origin)."""
    port = server.port
    return f"http://127.0.0.1:{port}/sdk/package.json"


# --------------------------------------------------------------------------- the SDK


async def test_the_design_documents_client_streams_from_seedance(
    browser: Browser, server: RunningServer
) -> None:
    """The JavaScript of the design document (section 1), unchanged but for the address."""
    async with tab(browser, blank(server)) as page:
        result = await page.page.evaluate(
            """(port) => new Promise((resolve) => {
                const tokens = [];
                const socket = new WebSocket(
                    `ws://127.0.0.1:${port}/v2/infer?session_id=abc123&model=synthetic`);
                socket.onopen = () => { socket.send(JSON.stringify({
                    prompt: "解释量子纠缠的基本原理", stream: true, max_tokens: 512,
                    temperature: 0.7 })); };
                socket.onmessage = (event) => {
                    const chunk = JSON.parse(event.data);
                    if (chunk.token) tokens.push(chunk.n ?? 1);
                    if (chunk.done) resolve({tokens: tokens.reduce((a, b) => a + b, 0),
                                             usage: chunk.usage.completion_tokens});
                };
            })""",
            server.port,
        )
        page.check()
    assert result == {"tokens": 512, "usage": 512}


@pytest.mark.slow
async def test_the_design_documents_client_gets_a_60_s_reply_whole(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    """The same client, unchanged but for the address (and the model it names, served here),
    through a reply of 64 s with the default heartbeat and idle timeout (25 s, 30 s): a
    browser's WebSocket answers the server's ping frames by itself and its onmessage never
    sees a frame it cannot parse (a page error would fail the test)."""
    server = make_server([slow_engine(tokens_per_s=8, name="llama3-70b")])
    assert server.config.idle_timeout_s == 30.0 and server.config.heartbeat_interval_s == 25.0
    async with tab(browser, blank(server)) as page:
        started = asyncio.get_running_loop().time()
        result = await asyncio.wait_for(
            page.page.evaluate(
                """(port) => new Promise((resolve) => {
                    const tokens = [];
                    const socket = new WebSocket(
                        `ws://127.0.0.1:${port}/v2/infer?session_id=abc123&model=llama3-70b`);
                    socket.onopen = () => { socket.send(JSON.stringify({
                        prompt: "解释量子纠缠的基本原理", stream: true, max_tokens: 512,
                        temperature: 0.7 })); };
                    socket.onmessage = (event) => {
                        const chunk = JSON.parse(event.data);
                        if (chunk.token) tokens.push(chunk.token);
                        if (chunk.done) resolve({text: tokens.join(""),
                                                 usage: chunk.usage.completion_tokens,
                                                 finish: chunk.finish_reason});
                    };
                    socket.onclose = (event) => resolve({closed: event.code});
                })""",
                server.port,
            ),
            120,
        )
        elapsed = asyncio.get_running_loop().time() - started
        page.check()
    assert result.get("usage") == 512 and result["finish"] == "length", result
    assert elapsed > 60  # past the idle timeout twice, and past a heartbeat
    # The text is the whole reply: the same request of the same engine at full speed, read by
    # the SDK in one piece (the synthetic engine's reply is a function of the conversation).
    fast = make_server([SyntheticEngine(name="llama3-70b")])
    async with connect(fast.url) as session:
        done = await session.complete("解释量子纠缠的基本原理", max_tokens=512, temperature=0.7)
    assert result["text"] == done.text


async def test_the_sdk_streams_cancels_and_measures_the_round_trip(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    server = make_server([slow_engine(tokens_per_s=100)])
    async with tab(browser, blank(server)) as page:
        result = await page.sdk(
            """
            const session = await sd.connect("", {sessionId: "js-1", heartbeatMs: 200});
            const seqs = [];
            const generation = session.generate("hello", {max_tokens: 20});
            for await (const chunk of generation) {
                for (let i = 0; i < chunk.n; i++) seqs.push(chunk.seq + i);
            }
            const second = session.generate("go on", {max_tokens: 1000});
            let got = 0;
            for await (const chunk of second) {
                got += chunk.n;
                if (got >= 5 && got - chunk.n < 5) second.cancel();
            }
            const rtt = await session.ping();
            await new Promise((r) => setTimeout(r, 500));
            return {
                seqs, usage: generation.done.usage.completion_tokens,
                finish: generation.done.finish_reason, text: generation.text.length,
                cancelled: second.done.finish_reason, cancelledUsage: second.done.usage.completion_tokens,
                got, rtt, smoothed: session.rtt, sessionId: session.sessionId,
                start: generation.start.request_id === generation.requestId,
            };
            """
        )
        page.check()
    assert result["seqs"] == list(range(20)) and result["usage"] == 20
    assert result["finish"] == "length" and result["text"] > 0 and result["start"]
    assert result["cancelled"] == "cancelled" and 5 <= result["got"] < 1000
    assert result["cancelledUsage"] == result["got"]
    assert 0 < result["rtt"] < 1000 and 0 < result["smoothed"] < 1000
    assert result["sessionId"] == "js-1"


@pytest.mark.model
async def test_the_sdk_embeds_and_reads_typed_output(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    """``embed()`` beside a text model, and a schema-bound reply with log probabilities, from
    the browser SDK in Chromium."""
    server = make_server(
        engine="llamacpp", parallel=2, n_ctx=2048, embedding_model="all-minilm-l6-v2"
    )
    async with tab(browser, blank(server)) as page:
        result = await page.sdk(
            """
            const session = await sd.connect("", {sessionId: "js-typed"});
            const vectors = await session.embed(["The sea is calm.", "Otters sleep."]);
            const tensor = await session.embed(["The sea is calm.", "Otters sleep."],
                                               {encoding_format: "tensor"});
            const e = tensor.arrays.embedding;
            const gap = Math.max(...vectors.data[1].map((x, i) => Math.abs(x - e.data[384 + i])));
            const ids = await session.embed(new Int32Array([101, 1996, 2712, 102, 101, 7592, 102, 102]),
                                            {encoding_format: "tensor", shape: [2, 4]});
            let refused = null;
            try { await session.embed(""); } catch (error) { refused = error.code; }
            const schema = {type: "object", properties: {ok: {type: "boolean"}},
                            required: ["ok"], additionalProperties: false};
            const reply = session.generate("Is the sky blue?", {schema, logprobs: 2, max_tokens: 20});
            const chunks = [];
            for await (const chunk of reply) chunks.push(chunk.logprobs.length === chunk.n);
            const counted = session.generate("Hi", {max_tokens: 8, ignore_eos: true,
                                                    tensors: ["token_ids"]});
            const sampled = [];
            const idChunks = [];
            for await (const chunk of counted) {
                const t = chunk.tensors.token_ids;
                idChunks.push([t.data.constructor.name, t.shape[0] === chunk.n]);
                sampled.push(...t.data);
            }
            // The ids it sampled, as a prompt of token ids: a tensor frame up, a reply down.
            const again = session.generate({prompt_ids: Int32Array.from(sampled)},
                                           {max_tokens: 4, temperature: 0, stream: false});
            const fromIds = await again.result();
            return {
                count: vectors.data.length, size: vectors.data[0].length, refused,
                tensor: [e.data.constructor.name, e.dtype, e.shape, tensor.data ?? null, gap],
                ids: [ids.arrays.embedding.shape, ids.usage.prompt_tokens],
                tokenIds: [idChunks.every(([type, n]) => type === "Int32Array" && n),
                           counted.tensors.token_ids.reduce((a, t) => a + t.shape[0], 0),
                           fromIds.usage.prompt_tokens === sampled.length,
                           fromIds.usage.completion_tokens],
                json: JSON.parse(reply.text), perChunk: chunks.every(Boolean),
                logprobs: reply.logprobs.length, tokens: reply.done.usage.completion_tokens,
                tops: reply.logprobs[0].top_logprobs.length,
            };
            """
        )
        page.check()
    assert result["count"] == 2 and result["size"] == 384
    assert result["tensor"] == ["Float32Array", "FP32", [2, 384], None, 0]  # the same floats
    assert result["ids"] == [[2, 384], 8]
    assert result["tokenIds"] == [True, 8, True, 4]
    assert result["refused"] == "invalid_request"
    assert isinstance(result["json"]["ok"], bool) and result["perChunk"]
    assert result["logprobs"] == result["tokens"] and result["tops"] == 2


async def test_tensor_frames_read_and_write_as_python_does(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    """The browser SDK's tensor frames (tensors.js) against the Python reference, both ways,
    every datatype: a TypedArray over the frame's own buffer, no copy."""
    frames = {
        name: encode_tensor(Tensor("r-7", "out", sample(name), seq=3)).hex() for name in DTYPES
    }
    async with tab(browser, blank(make_server())) as page:
        result = await page.sdk(
            """
            const hex = (h) => Uint8Array.from(h.match(/../g), (x) => parseInt(x, 16));
            const hexOf = (b) => Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
            const read = {}, written = {};
            for (const [name, frame] of Object.entries(arg)) {
                const bytes = hex(frame);
                const t = sd.decodeTensor(bytes.buffer);
                read[name] = [t.requestId, t.name, t.seq, t.dtype, t.shape,
                              Array.from(t.data, (x) => Number(x)), t.data.buffer === bytes.buffer];
                written[name] = hexOf(sd.encodeTensor({requestId: t.requestId, name: t.name,
                                      data: t.data, shape: t.shape, seq: t.seq, dtype: t.dtype}));
            }
            let refused = null;
            try { sd.decodeTensor(hex(arg.FP32).slice(0, -1)); } catch (e) { refused = e.message; }
            return {read, written, refused};
            """,
            frames,
        )
        page.check()
    for name in DTYPES:
        values = sample(name)
        assert result["read"][name] == [
            "r-7", "out", 3, name, list(values.shape), values.astype(float).ravel().tolist(), True
        ], name  # fmt: skip
        assert result["written"][name] == frames[name], name
    assert "cut" in result["refused"]


def sample(dtype: str) -> np.ndarray:
    """A 2 x 3 tensor of ``dtype`` with values that mean something in it."""
    if dtype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    values = np.array([[0, 1, 2], [3, 100, 7]])
    return values.astype(np.dtype(DTYPES[dtype].numpy))


async def test_the_sdk_raises_the_protocols_errors_as_their_classes(
    browser: Browser, make_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    path = tmp_path / "seedance.toml"
    key = add_key(path, "acme").key
    server = make_server(config_file=str(path), access=load_access(path))
    async with tab(browser, blank(server)) as page:
        result = await page.sdk(
            """
            const outcome = async (promise) => {
                try { await promise; return "no error"; }
                catch (e) { return [e.constructor.name, e.code, e.retryable, e instanceof sd.SeedanceError]; }
            };
            const noKey = await outcome(sd.connect(""));
            const badKey = await outcome(sd.connect("", {apiKey: "sk-wrong"}));
            const session = await sd.connect("", {apiKey: arg, qos: {class: "high", slatag: "js_tests"}});
            const badModel = await outcome(sd.connect("", {apiKey: arg, model: "nope"}));
            const badRequest = await outcome(session.generate("x", {max_tokens: 0}).result());
            const badQos = await outcome(session.generate("x", {qos: "urgent"}).result());
            let thrown = null;
            try { sd.formatQoS({class: "urgent"}); } catch (e) { thrown = e.code; }
            const done = await session.generate("x", {max_tokens: 3}).result();
            const closed = await outcome((async () => {
                session.end();
                await new Promise((r) => session.addEventListener("close", r));
                return session.generate("x").result();
            })());
            return {noKey, badKey, badModel, badRequest, badQos, thrown,
                    finish: done.finish_reason, closed};
            """,
            key,
        )
    assert result["noKey"] == ["Unauthorized", "unauthorized", False, True]
    assert result["badKey"][:2] == ["Unauthorized", "unauthorized"]
    assert result["badModel"][:2] == ["ModelNotFound", "model_not_found"]
    assert result["badRequest"][:2] == ["InvalidRequest", "invalid_request"]
    assert result["badQos"][:2] == ["InvalidRequest", "invalid_request"]
    assert result["thrown"] == "invalid_request" and result["finish"] == "length"
    assert result["closed"][:2] == ["ConnectionClosed", "connection_closed"]
    samples, _ = scrape(server)  # the session's QoS went with its requests
    ended = "seedance_slo_requests_total"
    assert value(samples, ended, slatag="js_tests", qos_class="high", outcome="length") == 1


async def test_the_sdk_reconnects_and_resumes_through_a_reset(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    server = make_server([slow_engine(tokens_per_s=150)])
    async with (
        FaultProxy(f"127.0.0.1:{server.port}") as proxy,
        tab(browser, blank(proxy)) as page,
    ):
        running = asyncio.ensure_future(
            page.sdk(
                """
                    const session = await sd.connect("", {sessionId: "js-resume"});
                    const events = [];
                    for (const name of ["reconnecting", "reconnected"]) {
                        session.addEventListener(name, (e) => events.push([name, e.detail]));
                    }
                    window.progress = 0;
                    const seqs = [];
                    const generation = session.generate("story", {max_tokens: 150, resumable: true});
                    for await (const chunk of generation) {
                        for (let i = 0; i < chunk.n; i++) seqs.push(chunk.seq + i);
                        window.progress = seqs.length;
                    }
                    const plain = session.generate("plain", {max_tokens: 3});
                    return {seqs, usage: generation.done.usage.completion_tokens, events,
                            reconnects: session.reconnects, resumes: generation.resumes,
                            after: (await plain.result()).finish_reason};
                    """
            )
        )
        await page.wait_until("window.progress >= 20")
        proxy.reset()  # both TCP connections aborted: the browser sees 1006
        result = await asyncio.wait_for(running, 30)
    assert result["seqs"] == list(range(150)) and result["usage"] == 150
    assert result["reconnects"] == 1 and result["resumes"] == 1 and result["after"] == "length"
    names = [name for name, _ in result["events"]]
    assert names == ["reconnecting", "reconnected"]
    assert result["events"][0][1]["code"] == 1006
    assert result["events"][1][1]["resumed"] and not result["events"][1][1]["epochChanged"]


# --------------------------------------------------------------------------- rendering

HOSTILE = (
    "Hello <script>window.__pwned = 'script'</script> and "
    '<img src=x onerror="window.__pwned = \'img\'"> and <svg onload="window.__pwned=1"></svg>\n'
    "[click me](javascript:window.__pwned='link') <a href=\"javascript:alert(1)\">a</a>\n"
    "**bold `code <b>` and an unclosed ** pair\n"
    "```js\n"
    "// a comment </code></pre><script>window.__pwned = 'escape'</script>\n"
    'const s = "</span><img src=x onerror=window.__pwned=2>";\n'
    "return 42;\n"
    "```\n"
    '```\nnever closed <iframe src="javascript:window.__pwned=3"></iframe>\n'
    "&lt;not an entity&gt; ' \" &amp;"
)


async def test_the_worker_renders_hostile_output_as_text(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    """The model's reply is the hostile text (the synthetic engine echoes the prompt); the
    playground renders it through the worker: nothing runs, no element comes from it, and the
    text reads as it was written."""
    server = make_server([SyntheticEngine(echo=True, tokens_per_s=400)])
    async with tab(browser, f"{server.http_url}/") as page:
        await page.page.evaluate(
            """() => { window.violations = [];
                document.addEventListener('securitypolicyviolation',
                    (e) => window.violations.push(e.violatedDirective)); }"""
        )
        await page.wait_until(CONNECTED)
        await page.page.fill("#prompt", HOSTILE)
        await page.page.click("#send")
        reply = page.page.locator(".msg.assistant[data-state=done]")
        await reply.wait_for(timeout=20_000)
        await asyncio.sleep(0.3)  # an image's onerror, had one been made, would have fired
        found = await reply.evaluate(
            """(el) => ({
                pwned: window.__pwned ?? null,
                violations: window.violations,
                tags: [...new Set([...el.querySelectorAll('*')].map((e) => e.tagName))].sort(),
                attributes: [...new Set([...el.querySelectorAll('*')].flatMap(
                    (e) => [...e.attributes].map((a) => a.name)))].sort(),
                text: el.textContent,
                langs: [...el.querySelectorAll('pre code')].map((c) => c.dataset.lang ?? ''),
                keywords: [...el.querySelectorAll('.sd-kw')].map((s) => s.textContent),
                comments: [...el.querySelectorAll('.sd-com')].map((s) => s.textContent).join(''),
                strongs: [...el.querySelectorAll('strong')].map((s) => s.textContent),
                finish: el.dataset.finish,
            })"""
        )
        page.check()
    assert found["pwned"] is None and found["violations"] == []
    assert set(found["tags"]) <= {"BR", "CODE", "DIV", "PRE", "SPAN", "STRONG"}, found["tags"]
    assert set(found["attributes"]) <= {"class", "data-lang"}, found["attributes"]
    for visible in (
        "<script>window.__pwned = 'script'</script>",
        "<img src=x onerror=\"window.__pwned = 'img'\">",
        "[click me](javascript:window.__pwned='link')",
        "</code></pre><script>window.__pwned = 'escape'</script>",
        '<iframe src="javascript:window.__pwned=3"></iframe>',
        "&lt;not an entity&gt; ' \" &amp;",
    ):
        assert visible in found["text"], visible
    assert found["langs"] == ["js", ""] and {"const", "return"} <= set(found["keywords"])
    assert (
        found["comments"] == "// a comment </code></pre><script>window.__pwned = 'escape'</script>"
    )
    # A bold run may be cut into several <strong> where a push of the stream ended.
    assert "".join(found["strongs"]) == "bold code <b> and an unclosed "
    assert found["finish"] == "stop"


@pytest.mark.parametrize(("added_ms", "expected"), [(50, 128), (150, (40, 100)), (250, 32)])
async def test_render_windows_follow_the_round_trip(
    browser: Browser,
    make_server: Callable[..., RunningServer],
    added_ms: int,
    expected: int | tuple[int, int],
) -> None:
    """Behind a proxy adding ``added_ms`` to the round trip, the worker cuts a fast reply into
    windows of the design's table: 128 tokens at 80 ms or less, 32 at 200 or more, linear
    between."""
    server = make_server([slow_engine(tokens_per_s=2000)])  # frames of a few tokens each
    async with FaultProxy(f"127.0.0.1:{server.port}") as proxy:
        proxy.delay_s = added_ms / 2000  # each way
        async with tab(browser, blank(proxy)) as page:
            result = await page.sdk(
                """
                const session = await sd.connect("", {heartbeatMs: 100});
                await new Promise((resolve) => {
                    let seen = 0;
                    session.addEventListener("rtt", () => { if (++seen === 5) resolve(); });
                });
                const container = document.createElement("div");
                document.body.append(container);
                const view = new sd.TokenView(container, {maxWaitMs: 60000});
                const generation = session.generate("x", {max_tokens: 1000});
                let low = Infinity, high = 0;  // the round trips the windows were cut for
                for await (const chunk of generation) {
                    low = Math.min(low, session.rtt);
                    high = Math.max(high, session.rtt);
                    view.push(chunk.text, chunk.n, session.rtt);
                }
                await view.end();
                view.terminate();
                return {rtt: session.rtt, expected: sd.windowFor(session.rtt), stats: view.stats,
                        span: [sd.windowFor(high), sd.windowFor(low)],
                        text: container.textContent === generation.text};
                """
            )
            page.check()
    window = result["expected"]  # for the smoothed round trip at the end
    # Each window is the one for the round trip measured as it was cut, which drifts during the
    # reply (more on a busy machine: a heartbeat late by the CPU reads as a longer trip).
    smallest, largest = result["span"]
    windows = {record["window"] for record in result["stats"]}
    assert all(smallest - 4 <= w <= largest + 4 for w in windows), (result["span"], windows)
    if isinstance(expected, int):
        assert window == expected
    else:
        assert expected[0] < window < expected[1]
    assert added_ms <= result["rtt"] < added_ms + 60
    *full, _last = result["stats"]
    assert full and all(record["tokens"] >= record["window"] for record in full)
    assert sum(record["tokens"] for record in result["stats"]) == 1000
    assert result["text"]


# --------------------------------------------------------------------------- the playground


@pytest.mark.model
async def test_the_playground_chats_with_the_embedded_model(browser: Browser) -> None:
    config = server_config(engine="llamacpp", parallel=1, n_ctx=2048)
    server = RunningServer(config, None).start()
    try:
        async with tab(browser, f"{server.http_url}/") as page:
            await page.wait_until(CONNECTED)
            await page.page.fill("#temperature", "0")
            await page.page.fill("#prompt", "What is the capital of France?")
            await page.page.press("#prompt", "Enter")
            reply = page.page.locator(".msg.assistant[data-state=done]")
            await reply.wait_for(timeout=60_000)
            found = await reply.evaluate("(el) => ({...el.dataset, text: el.textContent})")
            stats = {
                name: await page.page.text_content(f"#{name}")
                for name in ("model", "session-id", "ttft", "tps", "rtt", "window")
            }
            page.check()
    finally:
        server.stop()
    assert found["finish"] in ("stop", "length") and int(found["tokens"]) > 0
    assert found["text"].strip()
    assert stats["model"] == "smollm2-135m" and stats["session-id"].startswith("s-")
    assert re.fullmatch(r"\d+ ms", stats["ttft"] or "") and float(stats["tps"] or 0) > 0
    assert re.fullmatch(r"[\d.]+ ms", stats["rtt"] or "") and stats["window"] == "128 tokens"


async def test_the_playground_shows_a_resume_after_a_network_drop(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    server = make_server([slow_engine(tokens_per_s=100)])
    async with (
        FaultProxy(f"127.0.0.1:{server.port}") as proxy,
        tab(browser, f"http://127.0.0.1:{proxy.port}/") as page,
    ):
        p = page.page
        await page.wait_until(CONNECTED)
        await p.fill("#max-tokens", "200")
        await p.fill("#prompt", "tell me a story")
        await p.click("#send")
        await page.wait_until("document.querySelector('.msg.assistant')?.textContent.length > 60")
        proxy.reset()
        await page.wait_until("document.getElementById('banner').className === 'resumed'")
        banner = await p.text_content("#banner")
        reply = p.locator(".msg.assistant[data-state=done]")
        await reply.wait_for(timeout=30_000)
        found = await reply.evaluate("(el) => ({...el.dataset})")
        note = await p.text_content(".event")
        state = await p.text_content("#state")
    assert banner and re.fullmatch(r"Reconnected: resumed js-\w+ after token \d+", banner)
    assert note and "resumed" in note and state == "connected"
    assert found["finish"] == "length" and found["tokens"] == found["received"] == "200"
    assert found["resumes"] == "1"


async def test_the_playground_can_be_turned_off(make_server: Callable[..., RunningServer]) -> None:
    import httpx

    on, off = make_server(), make_server(no_playground=True)
    async with httpx.AsyncClient() as client:
        page = await client.get(f"{on.http_url}/")
        assert page.status_code == 200 and "Seedance playground" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        sdk = await client.get(f"{on.http_url}/sdk/index.js")
        assert sdk.headers["content-type"].startswith("text/javascript")
        assert (await client.get(f"{on.http_url}/sdk/../../config.py")).status_code == 404
        for path in ("/", "/sdk/index.js", "/playground/playground.js"):
            assert (await client.get(f"{off.http_url}{path}")).status_code == 404, path


# --------------------------------------------------------------------------- quality of service


async def test_the_health_score_and_breaker_follow_the_documented_rules(
    browser: Browser, server: RunningServer
) -> None:
    async with tab(browser, blank(server)) as page:
        result = await page.sdk(
            """
            const health = new sd.HealthScore(100);
            const fresh = health.value;
            for (const ttft of [50, 200, null]) health.record(ttft);  // scores 1, 0.5, 0
            const three = health.value;                                // (1*1 + 2*0.5 + 3*0) / 6
            for (let i = 0; i < 12; i++) health.record(10);
            const window = health.scores.length;

            let now = 0;
            const changes = [];
            const breaker = new sd.CircuitBreaker("primary", {}, (name, from, to, why) =>
                changes.push([from, to, why]), () => now);
            for (let i = 0; i < 19; i++) { now += 100; breaker.record(i % 2 === 0); }
            const after19 = breaker.state;                 // 19 samples: below the minimum
            now += 100; breaker.record(false);             // 20th: 10 of 20 failed
            const opened = breaker.state;
            const refused = breaker.allow();
            now += 5000;
            const probes = [breaker.allow(), breaker.allow(), breaker.allow(), breaker.allow()];
            breaker.record(true); breaker.record(true);
            const halfOpen = breaker.state;
            breaker.record(true);
            const closed = breaker.state;
            // Old outcomes leave the 5 s window: 20 failures spread over 10 s never open it.
            const slow = new sd.CircuitBreaker("slow", {}, null, () => now);
            for (let i = 0; i < 20; i++) { now += 500; slow.record(false); }
            const budget = new sd.RetryBudget(0.1);
            let retries = 0;
            for (let i = 0; i < 100; i++) { budget.called(); if (budget.available) { budget.spend(); retries++; } }
            return {fresh, three, window, after19, opened, refused, probes, halfOpen, closed,
                    changes, slow: slow.state, retries};
            """
        )
        page.check()
    assert result["fresh"] == 1 and result["three"] == pytest.approx(2 / 6)
    assert result["window"] == 10
    assert result["after19"] == "closed" and result["opened"] == "open" and not result["refused"]
    assert result["probes"] == [True, True, True, False]
    assert result["halfOpen"] == "half_open" and result["closed"] == "closed"
    assert [c[:2] for c in result["changes"]] == [
        ["closed", "open"],
        ["open", "half_open"],
        ["half_open", "closed"],
    ]
    assert result["changes"][0][2] == "10 of the last 20 calls in 5 s failed"
    assert result["slow"] == "closed" and result["retries"] == 10


async def test_the_resilient_client_falls_back_before_the_first_token_only(
    browser: Browser, make_server: Callable[..., RunningServer]
) -> None:
    """A blackholed primary: calls time out, the breaker opens, the secondary serves (spending
    retries only while the primary is still tried), then the primary recovers through probes.
    A reply that fails after its first token is an error, never replayed elsewhere."""
    primary, secondary = make_server([slow_engine(tokens_per_s=400)]), make_server()
    async with FaultProxy(f"127.0.0.1:{primary.port}") as proxy:
        proxied = proxy.url
        async with tab(browser, blank(secondary), bypass_csp=True) as page:
            run = asyncio.ensure_future(
                page.sdk(
                    """
                    const [primary, secondary] = arg;
                    window.phase = "up";
                    const changes = [];
                    const cache = new sd.ResponseCache();
                    const client = new sd.ResilientClient([primary, secondary], {
                        qos: {class: "high", slatag: "js_fallback"}, slaTtftMs: 1000,
                        firstTokenTimeoutMs: 150, cache,
                        breaker: {cooldownMs: 400, windowMs: 10000},
                        degradedReply: "busy", connectOptions: {heartbeatMs: 60000},
                        onBreaker: (name, from, to) => changes.push([name === primary ? "primary" : "secondary", from, to]),
                    });
                    const call = async (prompt, through = client) => {
                        const reply = through.generate(prompt, {max_tokens: 5});
                        await reply.collect();
                        return [reply.source, reply.endpoint === primary ? "primary" : reply.endpoint ? "secondary" : null, reply.reason];
                    };
                    const before = await call("warm");
                    window.phase = "blackhole";
                    while (window.phase !== "go") await new Promise((r) => setTimeout(r, 20));
                    const during = [];
                    for (let i = 0; i < 30; i++) during.push(await call(`q${i}`));
                    // The primary alone: an earlier reply from the cache, else the degraded one.
                    const solo = new sd.ResilientClient([primary], {cache, firstTokenTimeoutMs: 150, degradedReply: "busy"});
                    const cached = [await call("warm", solo), await call("new", solo)];
                    window.phase = "healed";
                    while (window.phase !== "go2") await new Promise((r) => setTimeout(r, 20));
                    await new Promise((r) => setTimeout(r, 500));  // past the cool-down
                    const after = [];
                    for (let i = 0; i < 4; i++) after.push(await call(`r${i}`));
                    // A failure after the first token: thrown, not replayed.
                    const long = client.generate("long", {max_tokens: 2000});
                    let midway = null;
                    try {
                        for await (const chunk of long) { if (chunk.seq === 0) window.phase = "cut"; }
                    } catch (error) { midway = [error.code, long.source, long.text.length > 0]; }
                    return {before, during, cached, after, midway, changes,
                            budget: [client.budget.calls, client.budget.retries],
                            health: client.health.value};
                    """,
                    [proxy.url, secondary.url],
                )
            )
            await page.wait_until("window.phase === 'blackhole'")
            proxy.blackhole = True
            await page.page.evaluate("() => { window.phase = 'go'; }")
            await page.wait_until("window.phase === 'healed'", timeout_s=60)
            proxy.blackhole = False
            proxy.drop()  # the blackholed connection is dead; a new one goes through
            await page.page.evaluate("() => { window.phase = 'go2'; }")
            await page.wait_until("window.phase === 'cut'", timeout_s=30)
            proxy.reset()
            result = await asyncio.wait_for(run, 60)
    assert result["before"][:2] == ["endpoint", "primary"]
    during = result["during"]
    timed_out = [d for d in during if d[2] and "no first token in time" in d[2]]
    skipped = [d for d in during if d[2] and "circuit open" in d[2]]
    # It opens at 20 samples in its window: the first call's success and 19 timeouts.
    assert len(timed_out) == 19 and len(skipped) == 11
    assert all(d[:2] == ["endpoint", "secondary"] for d in skipped)  # no retry spent on them
    assert {d[0] for d in timed_out} <= {"endpoint", "degraded"}  # secondary within the budget
    assert [c[0] for c in result["cached"]] == ["cache", "degraded"]
    assert result["cached"][0][2].startswith(proxied)
    assert result["after"][-1][:2] == ["endpoint", "primary"]
    assert ["primary", "closed", "open"] in result["changes"]
    assert ["primary", "half_open", "closed"] in result["changes"]
    calls, retries = result["budget"]
    assert retries <= 0.1 * calls + 1
    assert result["midway"] == ["connection_closed", "endpoint", True]
