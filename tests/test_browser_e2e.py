"""End-to-end encryption in the browser SDK (``clients/js/e2e.js``; docs/protocol.md, section 9):
WebCrypto in a real headless Chromium against real servers with ``--e2e-key``, and its
primitives against the Python reference (:mod:`seedance.protocol.e2e`), byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import websockets
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from playwright.async_api import Browser

from seedance.protocol import e2e
from seedance.testing.faults import FaultProxy
from tests.support.browser import chromium, tab
from tests.support.servers import RunningServer, one_process_only, slow_engine
from tests.support.waits import eventually

pytestmark = pytest.mark.subprocess  # Chromium runs as a process of its own

HEX = "const hex = (h) => Uint8Array.from(h.match(/../g) ?? [], (x) => parseInt(x, 16));"
OUTCOME = """const outcome = async (promise) => {
    try { await promise; return "no error"; }
    catch (e) { return [e.constructor.name, e.code, e.reason, e instanceof sd.SeedanceError]; }
};"""


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as running:
        yield running


class Identity:
    """A server identity: its private key's PEM file (``--e2e-key``) and what a client pins."""

    def __init__(self, directory: Path, name: str = "identity") -> None:
        self.key = Ed25519PrivateKey.generate()
        self.path = directory / f"{name}.pem"
        self.path.write_bytes(
            self.key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        self.public = e2e.b64url(e2e.raw_public(self.key.public_key()))
        self.pem = (
            self.key.public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            .decode()
        )


@pytest.fixture
def identity(tmp_path: Path) -> Identity:
    return Identity(tmp_path)


def page_of(server: RunningServer) -> str:
    """A page of the server's origin (its CSP allows the SDK and sockets to that origin)."""
    return f"http://127.0.0.1:{server.port}/sdk/package.json"


def audit_keys(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r.get("kind") == "stream_key"]


class Relay:
    """A WebSocket relay between the browser and a server that sees what goes through (every
    frame, as bytes or text) and alters one byte of the ``tamper``-th sealed frame from the
    server (counting from 1; 0: none), as something in between could."""

    def __init__(self, target_port: int, tamper: int = 0) -> None:
        self.target_port = target_port
        self.tamper = tamper
        self.from_client: list[str | bytes] = []
        self.from_server: list[str | bytes] = []
        self.tampered_seq: int | None = None  # the seq in the altered frame's header
        self.client_close: int | None = None  # how the browser closed its side
        self._sealed = 0

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Relay]:
        async with websockets.serve(
            self._relay, "127.0.0.1", 0, subprotocols=[websockets.Subprotocol("seedance.v2")]
        ) as server:
            self.port = next(iter(server.sockets)).getsockname()[1]
            yield self

    async def _relay(self, client: websockets.ServerConnection) -> None:
        assert client.request is not None
        url = f"ws://127.0.0.1:{self.target_port}{client.request.path}"
        async with websockets.connect(
            url, subprotocols=[websockets.Subprotocol("seedance.v2")]
        ) as server:

            async def upstream() -> None:
                async for data in client:
                    self.from_client.append(data)
                    await server.send(data)

            async def downstream() -> None:
                async for data in server:
                    self.from_server.append(data)
                    if isinstance(data, bytes) and data[:1] == bytes((e2e.SEALED,)):
                        self._sealed += 1
                        if self._sealed == self.tamper:
                            self.tampered_seq = int.from_bytes(data[13:21], "big", signed=True)
                            data = data[:-1] + bytes((data[-1] ^ 0x01,))  # its tag's last bit
                    await client.send(data)

            tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
            with contextlib.suppress(websockets.ConnectionClosed):
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
            self.client_close = client.close_code


# --------------------------------------------------------------------------- streams


@one_process_only("reads the server's state in its process")
async def test_an_encrypted_stream_is_the_plain_stream_and_nothing_of_it_is_in_the_clear(
    browser: Browser, make_server: Callable[..., RunningServer], identity: Identity
) -> None:
    server = make_server(e2e_key=str(identity.path))
    secret = "the launch code is swordfish-4711"
    async with (
        Relay(server.port).running() as relay,
        tab(browser, page_of(server), bypass_csp=True) as page,
    ):
        result = await page.sdk(
            """
            const [relay, identity, prompt] = arg;
            const fields = {max_tokens: 300, seed: 7, temperature: 0.8};
            const plain = await sd.connect("");
            const reference = plain.generate(prompt, fields);
            await reference.result();
            plain.close();
            const session = await sd.connect(`ws://127.0.0.1:${relay}`, {e2e: {identity}});
            const seqs = [];
            const reply = session.generate(prompt, fields);
            for await (const chunk of reply) {
                for (let i = 0; i < chunk.n; i++) seqs.push(chunk.seq + i);
            }
            const e = session.e2e;
            const out = {seqs, text: reply.text, plain: reference.text,
                         finish: reply.done.finish_reason, identity: e.identity,
                         measurement: e.measurement, epochs: [e.sendEpoch, e.receiveEpoch],
                         param: new URL(session._ws.url).searchParams.get("e2e")};
            session.close();
            return out;
            """,
            [relay.port, identity.public, secret],
        )
        page.check()
    assert result["seqs"] == list(range(300)) and result["finish"] == "length"
    assert result["text"] == result["plain"] and len(result["text"]) > 300
    assert result["identity"] == identity.public
    assert server.state.confidential is not None
    assert result["measurement"] == server.state.confidential.measurement()
    assert result["epochs"] == [0, 0] and len(e2e.unb64url(result["param"])) == 32
    # Between the browser and the server: the session frame in the clear, then sealed frames
    # and heartbeats only, and neither the prompt nor a word of the reply.
    sent = [f for f in relay.from_client if isinstance(f, bytes)]
    assert sent and len(sent) == len(relay.from_client)
    assert {f[:1] for f in sent} <= {b"\x05", b"\x01", b"\x02"}
    texts = [f for f in relay.from_server if isinstance(f, str)]
    assert len(texts) == 1 and json.loads(texts[0])["type"] == "session"
    wire = b"".join(sent) + b"".join(f for f in relay.from_server if isinstance(f, bytes))
    assert secret.encode() not in wire and b"swordfish" not in wire
    words = [w for w in result["text"].split() if len(w) >= 6]
    assert words and not any(w.encode() in wire for w in words)


async def test_keys_rotate_mid_stream_and_the_browser_follows_the_server(
    browser: Browser,
    make_server: Callable[..., RunningServer],
    identity: Identity,
    tmp_path: Path,
) -> None:
    """Every 2,000 bytes a direction's key moves on: the server's keys (its audit records)
    and the browser's are the same, epoch by epoch, both ways."""
    log = tmp_path / "audit.jsonl"
    server = make_server(
        e2e_key=str(identity.path),
        e2e_rotate_bytes=2000,
        merge_window_ms=0,  # a frame per token: keys rotate between frames
        audit_file=str(log),
    )
    async with tab(browser, page_of(server)) as page:
        result = await page.sdk(
            """
            const keys = [];
            const session = await sd.connect("", {e2e: {identity: arg}});
            session.addEventListener("key", (e) => keys.push(e.detail));  // from the next on
            const agreed = [session.e2e.sendKeyHash, session.e2e.receiveKeyHash];
            const seqs = [];
            // A prompt of 2,500 bytes: the next frame the browser seals is under its epoch 1.
            const first = session.generate("x".repeat(2500), {max_tokens: 3000, seed: 1});
            for await (const chunk of first) {
                for (let i = 0; i < chunk.n; i++) seqs.push(chunk.seq + i);
            }
            const second = await session.generate("and again", {max_tokens: 5}).result();
            const e = session.e2e;
            const out = {seqs, keys, agreed, send: e.sendEpoch, receive: e.receiveEpoch,
                         sendHash: e.sendKeyHash, receiveHash: e.receiveKeyHash,
                         second: second.finish_reason, bytes: first.text.length};
            session.close();
            return out;
            """,
            identity.public,
        )
        page.check()
    assert result["seqs"] == list(range(3000)) and result["second"] == "length"
    # Each token's frame is some 80 bytes of JSON: a key every 25 frames or so.
    assert result["send"] == 1 and result["receive"] >= 3000 // 30
    await eventually(
        lambda: len(audit_keys(log)) == 2 + result["send"] + result["receive"], what="audit"
    )
    server_keys = {
        (r["direction"], r["epoch_id"]): (r["old_key_hash"], r["new_key_hash"])
        for r in audit_keys(log)
    }
    sent, received = result["agreed"]
    browser_keys = {
        ("client_to_server", 0): (None, sent),
        ("server_to_client", 0): (None, received),
        **{(k["direction"], k["epoch"]): (k["oldHash"], k["newHash"]) for k in result["keys"]},
    }
    assert browser_keys == server_keys  # the same keys, each chained to the one before
    assert server_keys[("client_to_server", 1)][1] == result["sendHash"]
    assert server_keys[("server_to_client", result["receive"])][1] == result["receiveHash"]


async def test_a_server_that_is_not_the_pinned_one_is_refused(
    browser: Browser, make_server: Callable[..., RunningServer], identity: Identity, tmp_path: Path
) -> None:
    other = Identity(tmp_path, "other")
    server, plain = make_server(e2e_key=str(identity.path)), make_server()
    async with tab(browser, page_of(server), bypass_csp=True) as page:
        result = await page.sdk(
            OUTCOME
            + """
            const [right, wrong, pem, plainPort] = arg;
            const ok = async (identity) => {
                const session = await sd.connect("", {e2e: {identity}, reconnect: false});
                const text = (await session.generate("hi", {max_tokens: 3}).result()).finish_reason;
                session.close();
                return text;
            };
            return {
                wrong: await outcome(sd.connect("", {e2e: {identity: wrong}})),
                rotation: await ok([wrong, right]),
                pem: await ok(pem),
                none: await outcome(sd.connect("", {e2e: {identity: []}})),
                garbage: await outcome(sd.connect("", {e2e: {identity: "not a key"}})),
                plainServer: await outcome(sd.connect(`ws://127.0.0.1:${plainPort}`,
                                                      {e2e: {identity: right}})),
            };
            """,
            [identity.public, other.public, identity.pem, plain.port],
        )
        page.check()
    assert result["wrong"] == ["EncryptionFailed", "encryption_failed", "handshake", True]
    assert result["rotation"] == "length" and result["pem"] == "length"
    assert result["none"][:2] == ["InvalidRequest", "invalid_request"]
    assert result["garbage"][:2] == ["InvalidRequest", "invalid_request"]
    assert result["plainServer"][:2] == ["InvalidRequest", "invalid_request"]


# --------------------------------------------------------------------------- the primitives


async def test_the_primitives_make_and_open_the_same_bytes_as_python(
    browser: Browser, server: RunningServer
) -> None:
    """Keys fixed: the ratchet (Python's HKDF without a salt is WebCrypto's with 32 zero bytes),
    the key hashes, frames sealed by Python through a rotation opened by the browser, frames
    sealed by the browser opened by Python, and the strict checks, reason by reason."""
    c2s, s2c = bytes(range(32)), bytes(range(100, 132))
    texts = [
        json.dumps(
            {"type": "token", "request_id": "r-1", "seq": i, "token": "é€" * 20}, ensure_ascii=False
        )
        for i in range(5)
    ] + [json.dumps({"type": "done", "request_id": "r-1"})]
    # A key seals two token frames, counted in UTF-8 bytes (in UTF-16 units it would be four).
    rotate = 2 * len(texts[0].encode())
    python = e2e.Channel(
        "s-vec", send_key=s2c, receive_key=c2s, sending="server_to_client", rotate_bytes=rotate
    )
    sealed = [python.seal_frame(text) for text in texts]
    assert python.send_epoch == 2
    # For the refusals: a frame whose header names another request than its JSON.
    other = e2e.Channel("s-vec", send_key=s2c, receive_key=c2s, sending="server_to_client")
    mismatched = other.seal(texts[0], "r-2", 0)
    async with tab(browser, page_of(server)) as page:
        result = await page.sdk(
            HEX
            + """
            const v = arg;
            const hexOf = (b) => Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
            const channel = (sessionId = "s-vec") => sd.Channel.create(sessionId,
                {sendKey: hex(v.c2s), receiveKey: hex(v.s2c), rotateBytes: v.rotate});
            const ratchets = [await sd.ratchet(hex(v.c2s))];
            ratchets.push(await sd.ratchet(ratchets[0]));
            const js = await channel();
            const hashes = [js.sendKeyHash, js.receiveKeyHash];
            const opened = [];
            for (const frame of v.sealed) opened.push([await js.open(hex(frame)), js.receiveEpoch]);
            const mine = [];
            for (const text of v.texts) mine.push(hexOf(await js.seal(text)));
            const refusal = async (frames, sessionId) => {
                const c = await channel(sessionId);
                try { for (const f of frames) await c.open(f); return "opened"; }
                catch (e) { return [e.name, e.reason]; }
            };
            const f = v.sealed.map(hex);
            const flip = (bytes, at) => { const b = bytes.slice(); b[at] ^= 1; return b; };
            const refusals = {
                replayed: await refusal([f[0], f[0]]),
                reordered: await refusal([f[0], f[2]]),
                unknownKey: await refusal([f[0], f[1], f[4]]),  // epoch 2 after epoch 0
                header: await refusal([flip(f[0], 20)]),          // its seq
                ciphertext: await refusal([flip(f[0], 40)]),
                tag: await refusal([flip(f[0], f[0].length - 1)]),
                otherSession: await refusal([f[0]], "s-other"),
                short: await refusal([f[0].slice(0, 30)]),
                notSealed: await refusal([new Uint8Array(40)]),
                mismatch: await refusal([hex(v.mismatched)]),
            };
            const sticky = await channel();
            await sticky.open(f[0]).catch(() => null);
            let after = null;
            try { await sticky.open(f[0]); } catch (e) {}
            try { await sticky.open(f[1]); } catch (e) { after = [e.reason, e.message]; }
            return {ratchets: ratchets.map(hexOf), hashes, opened, mine, refusals, after,
                    send: js.sendEpoch};
            """,
            {
                "c2s": c2s.hex(),
                "s2c": s2c.hex(),
                "sealed": [s.hex() for s in sealed],  # type: ignore[union-attr]
                "texts": texts,
                "mismatched": mismatched.hex(),
                "rotate": rotate,
            },
        )
        page.check()
    assert result["ratchets"] == [e2e.ratchet(c2s).hex(), e2e.ratchet(e2e.ratchet(c2s)).hex()]
    assert result["hashes"] == [e2e.key_hash(c2s), e2e.key_hash(s2c)]
    assert result["opened"] == [[t, e] for t, e in zip(texts, [0, 0, 1, 1, 2, 2], strict=True)]
    receiver = e2e.Channel("s-vec", send_key=s2c, receive_key=c2s, sending="server_to_client")
    assert [receiver.open(bytes.fromhex(h)) for h in result["mine"]] == texts
    assert result["send"] == receiver.receive_epoch == 2
    assert result["refusals"] == {
        "replayed": ["EncryptionFailed", "replayed"],
        "reordered": ["EncryptionFailed", "reordered"],
        "unknownKey": ["EncryptionFailed", "unknown_key"],
        "header": ["EncryptionFailed", "bad_tag"],
        "ciphertext": ["EncryptionFailed", "bad_tag"],
        "tag": ["EncryptionFailed", "bad_tag"],
        "otherSession": ["EncryptionFailed", "bad_tag"],
        "short": ["EncryptionFailed", "malformed"],
        "notSealed": ["EncryptionFailed", "malformed"],
        "mismatch": ["EncryptionFailed", "mismatch"],
    }
    assert result["after"][0] == "replayed"
    assert result["after"][1].startswith("refused earlier")


async def test_the_agreement_is_the_one_python_makes(
    browser: Browser, server: RunningServer
) -> None:
    """The browser's ephemeral key and Python's ``accept``: the offer verifies in WebCrypto, both
    derive the same keys (a frame sealed on either side opens on the other), and an offer with
    any field changed is refused."""
    identity = Ed25519PrivateKey.generate()
    pinned = e2e.b64url(e2e.raw_public(identity.public_key()))
    async with tab(browser, page_of(server)) as page:
        param = await page.sdk(
            "window.handshakes = await Promise.all([0, 1, 2, 3, 4].map(() => "
            "sd.Handshake.create(arg))); return window.handshakes.map((h) => h.param);",
            pinned,
        )
        offers, channels = [], []
        for key in param:
            channel, offer = e2e.accept(
                identity, e2e.parse_client_key(key), "s-agree", "ab" * 32, rotate_bytes=1000
            )
            channels.append(channel)
            offers.append(msgspec.to_builtins(offer))
        offers[1]["measurement"] = "cd" * 32  # not what was signed
        offers[2]["server_key"] = offers[3]["server_key"]  # another connection's key
        offers[3]["version"] = 2
        offers[4]["signature"] = offers[0]["signature"]
        sealed = channels[0].seal(json.dumps({"type": "start", "request_id": "r"}), "r")
        result = await page.sdk(
            HEX
            + """
            const [offers, sealed] = arg;
            const hexOf = (b) => Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
            const results = [];
            for (const [i, offer] of offers.entries()) {
                try {
                    const channel = await window.handshakes[i].finish(offer, "s-agree");
                    results.push(["ok", await channel.open(hex(sealed)),
                                  hexOf(await channel.seal('{"type":"cancel","request_id":"r"}')),
                                  channel.rotateBytes, channel.measurement]);
                } catch (e) { results.push([e.name, e.reason, e.message]); }
            }
            return results;
            """,
            [offers, sealed.hex()],
        )
        page.check()
    ok, *refused = result
    assert ok[:2] == ["ok", '{"type": "start", "request_id": "r"}']
    assert channels[0].open(bytes.fromhex(ok[2])) == '{"type":"cancel","request_id":"r"}'
    assert ok[3:] == [1000, "ab" * 32]
    assert [r[:2] for r in refused] == [["EncryptionFailed", "handshake"]] * 4
    assert "not signed" in refused[0][2] and "unsupported" in refused[2][2]


# --------------------------------------------------------------------------- faults


async def test_an_altered_frame_fails_the_stream_and_nothing_of_it_is_delivered(
    browser: Browser, make_server: Callable[..., RunningServer], identity: Identity
) -> None:
    server = make_server([slow_engine(tokens_per_s=200)], e2e_key=str(identity.path))
    async with (
        Relay(server.port, tamper=8).running() as relay,
        tab(browser, page_of(server), bypass_csp=True) as page,
    ):
        result = await page.sdk(
            """
            const [port, identity] = arg;
            const session = await sd.connect(`ws://127.0.0.1:${port}`, {e2e: {identity}});
            const closed = new Promise(
                (r) => session.addEventListener("close", (e) => r(e.detail.code)));
            const seqs = [];
            const reply = session.generate("x", {max_tokens: 100, resumable: true});
            let error = null;
            try {
                for await (const chunk of reply) {
                    for (let i = 0; i < chunk.n; i++) seqs.push(chunk.seq + i);
                }
            } catch (e) { error = [e.name, e.code, e.reason, e instanceof sd.EncryptionFailed]; }
            return {seqs, error, code: await closed, closed: session.closed,
                    reconnects: session.reconnects, text: reply.text.length};
            """,
            [relay.port, identity.public],
        )
        page.check()
        await eventually(lambda: relay.client_close is not None, what="the relay's close")
    assert result["error"] == ["EncryptionFailed", "encryption_failed", "bad_tag", True]
    assert relay.tampered_seq is not None and relay.tampered_seq > 0
    assert result["seqs"] == list(range(relay.tampered_seq))  # all before it, nothing of it
    assert result["code"] == 4400 and relay.client_close == 4400
    assert result["closed"] and result["reconnects"] == 0


async def test_a_resume_after_a_drop_agrees_new_keys_and_goes_on_at_the_right_seq(
    browser: Browser, make_server: Callable[..., RunningServer], identity: Identity
) -> None:
    server = make_server([slow_engine(tokens_per_s=150)], e2e_key=str(identity.path))
    async with (
        FaultProxy(f"127.0.0.1:{server.port}") as proxy,
        tab(browser, f"http://127.0.0.1:{proxy.port}/sdk/package.json") as page,
    ):
        running = asyncio.ensure_future(
            page.sdk(
                """
                const session = await sd.connect(
                    "", {sessionId: "js-e2e-resume", e2e: {identity: arg}});
                const first = session.e2e;
                const keys = [];
                session.addEventListener("key", (e) => keys.push(e.detail));
                window.progress = 0;
                const seqs = [];
                const generation = session.generate("story", {max_tokens: 150, resumable: true});
                for await (const chunk of generation) {
                    for (let i = 0; i < chunk.n; i++) seqs.push(chunk.seq + i);
                    window.progress = seqs.length;
                }
                const plain = await session.generate("plain", {max_tokens: 3}).result();
                return {seqs, usage: generation.done.usage.completion_tokens, keys,
                        reconnects: session.reconnects, resumes: generation.resumes,
                        after: plain.finish_reason, newChannel: session.e2e !== first,
                        firstHashes: [first.sendKeyHash, first.receiveKeyHash]};
                """,
                identity.public,
            )
        )
        await page.wait_until("window.progress >= 20")
        proxy.reset()  # both TCP connections aborted: the browser sees 1006
        result = await asyncio.wait_for(running, 30)
        page.check()
    assert result["seqs"] == list(range(150)) and result["usage"] == 150
    assert result["reconnects"] == 1 and result["resumes"] == 1 and result["after"] == "length"
    agreed = [k for k in result["keys"] if k["oldHash"] is None]
    assert sorted(k["direction"] for k in agreed) == ["client_to_server", "server_to_client"]
    assert result["newChannel"]
    assert not {k["newHash"] for k in agreed} & set(result["firstHashes"])
