"""End-to-end encryption of /v2/infer streams (docs/protocol.md, section 9): the channel on its
own, then real servers and clients over sockets: the SDK, refusals of every altered frame in
both directions, rotation and its audit records, a million frames across rotations and a
resume."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed as WsConnectionClosed

from seedance.client import connect
from seedance.netutil import free_port
from seedance.observability.audit.records import GENESIS, seal
from seedance.observability.audit.verify import verify
from seedance.protocol import e2e
from seedance.protocol.errors import EncryptionFailed, Forbidden, InvalidRequest, PayloadTooLarge
from seedance.protocol.tensors import Tensor, encode_tensor
from tests.support.certs import Authority
from tests.support.redis import RedisServer
from tests.support.servers import SEEDANCE, RunningServer, one_process_only, slow_engine
from tests.support.tools import tool, wait_listening
from tests.support.ws import raw_connect
from tests.support.wsrelay import Relay
from tests.test_cluster import nodes

SESSION = "s-e2e"
FRAME = '{"type":"token","token":" hi","seq":7,"request_id":"r1"}'


# ---------------------------------------------------------------------------- the channel


def pair(**options: Any) -> tuple[e2e.Channel, e2e.Channel]:
    """(server, client) channels that agreed over a signed offer."""
    identity = Ed25519PrivateKey.generate()
    client = e2e.ClientHandshake(identity.public_key())
    server, offer = e2e.accept(
        identity, e2e.parse_client_key(client.param), SESSION, "ab" * 32, **options
    )
    return server, client.finish(offer, SESSION, clock=options.get("clock", time.monotonic))


def refused(channel: e2e.Channel, data: bytes) -> str:
    with pytest.raises(EncryptionFailed) as caught:
        channel.open(data)
    return caught.value.reason or ""


def test_frames_open_in_order_both_ways() -> None:
    server, client = pair()
    for seq in range(3):
        text = FRAME.replace('"seq":7', f'"seq":{seq}')
        assert client.open(server.seal_frame(text)) == text
    assert server.open(client.seal_frame('{"type":"cancel"}')) == '{"type":"cancel"}'
    assert server.seal_frame(b"\x01\x00") == b"\x01\x00"  # heartbeats stay as they are


def test_tensor_frames_are_sealed_whole_and_open_as_bytes() -> None:
    server, client = pair()
    frame = encode_tensor(Tensor("r1", "embedding", np.ones((2, 3), dtype="<f4"), seq=4))
    sealed = server.seal_frame(frame)
    assert isinstance(sealed, bytes) and sealed[0] == e2e.SEALED and frame[48:] not in sealed
    assert sealed[13:21] == (4).to_bytes(8, "big", signed=True)  # the header names its seq
    assert client.open(sealed) == frame
    assert server.open(client.seal_frame(frame)) == frame
    forged = bytearray(server.seal_frame(frame))
    forged[22] ^= 1  # another request id in the header
    assert refused(client, bytes(forged)) == "bad_tag"


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes((data[at] ^ 1,)) + data[at + 1 :]


@pytest.mark.parametrize(
    ("name", "alter", "reason"),
    [
        ("ciphertext", lambda f: flip(f, 30), "bad_tag"),
        ("tag", lambda f: flip(f, len(f) - 1), "bad_tag"),
        ("seq in the additional data", lambda f: flip(f, 20), "bad_tag"),
        ("request id in the additional data", lambda f: flip(f, 23), "bad_tag"),
        ("key id: unknown", lambda f: f[:1] + struct.pack("!I", 7) + f[5:], "unknown_key"),
        ("key id: the next", lambda f: f[:1] + struct.pack("!I", 1) + f[5:], "bad_tag"),
        ("counter ahead", lambda f: f[:5] + struct.pack("!Q", 1) + f[13:], "reordered"),
        ("cut short", lambda f: f[:30], "malformed"),
    ],
)
def test_an_altered_frame_is_refused(
    name: str, alter: Callable[[bytes], bytes], reason: str
) -> None:
    server, client = pair()
    assert refused(client, alter(server.seal_frame(FRAME))) == reason, name


def test_replayed_reordered_and_moved_frames_are_refused() -> None:
    server, client = pair()
    first, second = server.seal_frame(FRAME), server.seal_frame(FRAME)
    client.open(first)
    assert refused(client, first) == "replayed"
    # Nothing opens after a refusal, not even the frame that was due.
    assert refused(client, second) == "replayed"

    server, client = pair()
    first, second = server.seal_frame(FRAME), server.seal_frame(FRAME)
    assert refused(client, second) == "reordered"

    other_server, _ = pair()  # another connection (another session's keys)
    _, client = pair()
    assert refused(client, other_server.seal_frame(FRAME)) == "bad_tag"


def test_a_header_that_names_another_request_is_refused() -> None:
    server, client = pair()
    sealed = server.seal(FRAME, "r2", 7)  # authentic, but the header lies about the frame
    assert refused(client, sealed) == "mismatch"


def test_keys_rotate_by_bytes_and_by_time_without_a_pause() -> None:
    now = [0.0]
    keys: list[tuple[str, int, str | None, str]] = []
    server, client = pair(
        rotate_bytes=1000, rotate_s=60.0, clock=lambda: now[0], on_key=lambda *k: keys.append(k)
    )
    keys = [k for k in keys if k[0] == "server_to_client"]
    keys.clear()  # the agreed keys; the rotations follow
    for _ in range(40):  # 40 x 55 bytes: two rotations by bytes
        client.open(server.seal_frame(FRAME))
    assert (server.send_epoch, client.receive_epoch) == (2, 2)
    now[0] = 61.0  # and one by time
    client.open(server.seal_frame(FRAME))
    assert client.receive_epoch == 3
    rotated = [k for k in keys if k[0] == "server_to_client"]
    assert [k[1] for k in rotated] == [1, 2, 3]
    assert all(old == before[3] for before, (_, _, old, _) in itertools.pairwise(rotated))


def test_the_handshake_refuses_an_unpinned_or_forged_server() -> None:
    identity, impostor = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    client = e2e.ClientHandshake(identity.public_key())
    _, offer = e2e.accept(impostor, e2e.parse_client_key(client.param), SESSION, "00")
    with pytest.raises(EncryptionFailed, match="not one of the pinned keys"):
        client.finish(offer, SESSION)
    _, offer = e2e.accept(identity, e2e.parse_client_key(client.param), SESSION, "00")
    with pytest.raises(EncryptionFailed, match="not signed"):
        client.finish(offer, "another-session")  # the signature covers the session
    with pytest.raises(EncryptionFailed):
        e2e.parse_client_key("not-a-key")
    with pytest.raises(EncryptionFailed, match="full order"):  # agrees on zero with anyone
        e2e.parse_client_key(e2e.b64url(bytes(32)))


def test_a_pin_is_a_key_file_by_any_name_or_base64url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = Ed25519PrivateKey.generate()
    (tmp_path / "identity.pem.pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    monkeypatch.chdir(tmp_path)
    raw = e2e.raw_public(key.public_key())
    assert e2e.raw_public(e2e.load_pinned("identity.pem.pub")) == raw
    assert e2e.raw_public(e2e.load_pinned(e2e.b64url(raw))) == raw
    with pytest.raises(ValueError, match="neither a key file"):
        e2e.load_pinned("missing.pub")


# ---------------------------------------------------------------------------- over sockets


async def scrape(server: RunningServer) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{server.http_url}/metrics")).text


class Encrypted:
    """A raw encrypted client: it seals and opens frames itself, so a test sees (and may
    alter) each one, and records every (key, nonce) pair it met."""

    def __init__(self, ws: ClientConnection, hello: dict[str, Any], channel: e2e.Channel):
        self.ws, self.hello, self.channel = ws, hello, channel
        self.pairs: list[tuple[str, bytes]] = []

    @classmethod
    async def open(cls, url: str, public: str, query: str = "") -> Encrypted:
        handshake = e2e.ClientHandshake(e2e.load_pinned(public))
        ws = await raw_connect(url, f"{query}&e2e={handshake.param}".lstrip("&"), max_size=None)
        hello = json.loads(await ws.recv())
        offer = e2e.Offer(**hello["e2e"])
        return cls(ws, hello, handshake.finish(offer, hello["session_id"]))

    async def send(self, **fields: Any) -> None:
        sealed = self.channel.seal(json.dumps(fields), fields.get("request_id"))
        self.pairs.append(("sent " + self.channel.send_key_hash, sealed[1:13]))
        await self.ws.send(sealed)

    async def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        while True:
            data = await asyncio.wait_for(self.ws.recv(), timeout)
            assert isinstance(data, bytes), f"a text frame on an encrypted connection: {data}"
            if data == b"\x01\x00":
                await self.ws.send(b"\x02\x00")
                continue
            text = self.channel.open(data)
            self.pairs.append((self.channel.receive_key_hash, data[1:13]))
            frame: dict[str, Any] = json.loads(text)
            return frame


async def test_the_sdk_streams_encrypted_and_a_plain_client_still_works(
    make_server: Callable[..., RunningServer], identity: tuple[str, str]
) -> None:
    server = make_server(e2e_key=identity[0])
    async with connect(server.url, e2e=identity[1]) as session:
        assert session.channel is not None and session.info.e2e is not None
        stream = session.generate("hello", max_tokens=40, seed=3)
        chunks = [chunk async for chunk in stream]
        assert sum(c.n for c in chunks) == 40 and stream.done is not None
        assert await session.ping() > 0 and await session.ping_json() > 0
        encrypted_text = stream.text
    async with connect(server.url) as session:  # no e2e asked: plain frames, same reply
        assert session.channel is None
        assert (await session.complete("hello", max_tokens=40, seed=3)).text == encrypted_text


async def test_the_sdk_resumes_a_dropped_stream_under_new_keys(
    make_server: Callable[..., RunningServer], identity: tuple[str, str]
) -> None:
    server = make_server(e2e_key=identity[0], tokens_per_s=1000.0)
    async with connect(server.url, e2e=identity[1]) as session:
        expected = (await session.complete("story", max_tokens=300, seed=5, reset=True)).text
        first_keys = session.channel and session.channel.receive_key_hash
        stream = session.generate("story", max_tokens=300, seed=5, reset=True, resumable=True)
        seqs: list[int] = []
        async for chunk in stream:
            seqs.extend(range(chunk.seq, chunk.seq + chunk.n))
            if len(seqs) >= 100 and session.reconnects == 0:
                session._ws.transport.abort()  # the network goes away: no close frame
        assert seqs == list(range(300)) and stream.text == expected
        assert session.reconnects == 1
        assert session.channel is not None and session.channel.receive_key_hash != first_keys


async def test_servers_refuse_what_they_do_not_offer_or_require(
    make_server: Callable[..., RunningServer], identity: tuple[str, str]
) -> None:
    plain = make_server()
    with pytest.raises(InvalidRequest, match="does not offer end-to-end encryption"):
        await connect(plain.url, e2e=identity[1], reconnect=None)
    strict = make_server(e2e_key=identity[0], e2e_required=True)
    with pytest.raises(Forbidden, match="requires end-to-end encryption"):
        await connect(strict.url, reconnect=None)
    ws = await raw_connect(strict.url, "e2e=" + e2e.b64url(bytes(32)))  # a low-order key
    refusal = json.loads(await ws.recv())
    assert refusal["error"]["code"] == "encryption_failed", refusal
    with pytest.raises(WsConnectionClosed):
        await ws.recv()
    assert ws.close_code == 4400
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(EncryptionFailed, match="pinned") as caught:
        await connect(strict.url, e2e=other, reconnect=None)
    assert caught.value.reason == "handshake"


async def test_a_frame_over_the_limit_is_refused_sealed(
    make_server: Callable[..., RunningServer], identity: tuple[str, str]
) -> None:
    # The WebSocket layer refuses it before the app sees it, and still seals its error.
    server = make_server(e2e_key=identity[0], max_frame_bytes=4096)
    client = await Encrypted.open(server.url, identity[1])
    await client.send(type="ping", id=1)
    assert await client.recv() == {"type": "pong", "id": 1}
    await client.send(prompt="x" * 5000, max_tokens=1)
    error = await client.recv()
    assert error["error"]["code"] == "payload_too_large", error
    with pytest.raises(WsConnectionClosed):
        await client.recv()
    assert client.ws.close_code == 1009
    async with connect(server.url, e2e=identity[1], reconnect=None) as session:
        with pytest.raises(PayloadTooLarge, match="limit of 4096 bytes"):
            await session.complete("x" * 5000, max_tokens=1)


def seal_and(alter: Callable[[bytes], bytes]) -> Callable[[Encrypted], list[bytes]]:
    def frames(client: Encrypted) -> list[bytes]:
        return [alter(client.channel.seal_frame(json.dumps({"prompt": "secret", "max_tokens": 5})))]

    return frames


def replayed(client: Encrypted) -> list[bytes]:
    ping = client.channel.seal_frame('{"type":"ping","id":1}')
    return [ping, ping]


def reordered(client: Encrypted) -> list[bytes]:
    first = client.channel.seal_frame('{"type":"ping","id":1}')
    return [client.channel.seal_frame('{"prompt":"secret","max_tokens":5}'), first]


def moved(client: Encrypted) -> list[bytes]:
    other, _ = pair()  # a frame sealed for another session, with the right counter
    return [other.seal_frame('{"prompt":"secret","max_tokens":5}')]


@pytest.mark.parametrize(
    ("case", "frames", "reason"),
    [
        ("ciphertext", seal_and(lambda f: flip(f, 40)), "bad_tag"),
        ("tag", seal_and(lambda f: flip(f, len(f) - 1)), "bad_tag"),
        ("additional data", seal_and(lambda f: flip(f, 20)), "bad_tag"),
        ("key id", seal_and(lambda f: f[:1] + struct.pack("!I", 5) + f[5:]), "unknown_key"),
        ("replayed", replayed, "replayed"),
        ("reordered", reordered, "reordered"),
        ("moved from another session", moved, "bad_tag"),
        ("plaintext", lambda c: ['{"prompt":"secret","max_tokens":5}'], "plaintext"),
    ],
)
@one_process_only("reads the server's state in its process")
async def test_the_server_refuses_altered_frames_and_runs_nothing_of_them(
    make_server: Callable[..., RunningServer],
    identity: tuple[str, str],
    case: str,
    frames: Callable[[Encrypted], list[Any]],
    reason: str,
) -> None:
    server = make_server(e2e_key=identity[0])
    client = await Encrypted.open(server.url, identity[1], "session_id=tampered")
    for frame in frames(client):
        await client.ws.send(frame)
    seen = []
    with pytest.raises(WsConnectionClosed):
        while True:
            seen.append(await client.recv(10))
    errors = [f for f in seen if f["type"] == "error"]
    assert [f["type"] for f in seen if f["type"] != "pong"] == ["error"], (case, seen)
    assert errors[0]["error"]["code"] == "encryption_failed"
    assert errors[0]["error"]["reason"] == reason, (case, errors)
    assert client.ws.close_code == 4400
    metrics = await scrape(server)
    assert f'seedance_encryption_failures_total{{reason="{reason}"}} 1.0' in metrics
    # Nothing of it ran: no generation, the session's context untouched.
    assert len(server.state.generations) == 0
    async with connect(server.url, session_id="tampered", e2e=identity[1]) as again:
        assert again.info.context_turns == 0 and again.info.active is None


async def test_a_frame_altered_on_its_way_to_the_client_is_refused(
    make_server: Callable[..., RunningServer], identity: tuple[str, str]
) -> None:
    server = make_server(e2e_key=identity[0], merge_window_ms=0)
    sealed_seen = [0]

    def tamper(direction: str, opcode: int, payload: bytes) -> bytes | None:
        if direction == "to_client" and payload[:1] == b"\x05":
            sealed_seen[0] += 1
            if sealed_seen[0] == 6:  # start, then tokens 0..3 pass: the fifth token is altered
                return flip(payload, len(payload) - 3)
        return None

    relay = Relay(("127.0.0.1", server.port), tamper)
    async with relay.running():
        session = await connect(f"ws://127.0.0.1:{relay.port}", e2e=identity[1], reconnect=None)
        stream = session.generate("hello", max_tokens=50)
        received = []
        with pytest.raises(EncryptionFailed) as caught:
            async for chunk in stream:
                received.append(chunk.seq)
        assert caught.value.reason == "bad_tag"
        assert received == [0, 1, 2, 3]  # nothing of the altered frame, nothing after it
        await session.close()


async def test_rotations_are_audited_and_verified(
    make_server: Callable[..., RunningServer], identity: tuple[str, str], tmp_path: Path
) -> None:
    audit = tmp_path / "audit.log"
    server = make_server(
        e2e_key=identity[0], e2e_rotate_bytes=4000, merge_window_ms=0, audit_file=str(audit)
    )
    async with connect(server.url, e2e=identity[1]) as session:
        await session.generate("hello", max_tokens=400).collect()
        assert session.channel is not None and session.channel.receive_epoch >= 2
        rotations = session.channel.receive_epoch
    metrics = await scrape(server)
    assert "seedance_encrypted_connections_total 1.0" in metrics
    assert f'rotations_total{{direction="server_to_client"}} {rotations}.0' in metrics
    server.stop()
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    keys = [r for r in records if r["kind"] == "stream_key"]
    to_client = [r for r in keys if r["direction"] == "server_to_client"]
    assert [r["epoch_id"] for r in to_client] == list(range(rotations + 1))
    assert to_client[0]["action"] == "agreed" and to_client[0]["old_key_hash"] is None
    for before, after in itertools.pairwise(to_client):
        assert after["old_key_hash"] == before["new_key_hash"] != after["new_key_hash"]
    assert len({r["measurement"] for r in keys}) == 1 and len(keys[0]["measurement"]) == 64
    verdict = verify(audit)
    assert verdict.ok and f"{rotations} rotation(s) chained" in verdict.message, verdict.message

    # A forger who drops a rotation and rebuilds the hash chain is caught by the key chain.
    forged = [r for r in records if r is not to_client[1]]
    prev = GENESIS
    lines = []
    for seq, record in enumerate(forged):
        record = {k: v for k, v in record.items() if k not in ("seq", "prev", "hash")}
        lines.append(seal(record, seq, prev))
        prev = json.loads(lines[-1])["hash"]
    audit.write_bytes(b"".join(lines))
    verdict = verify(audit)
    assert not verdict.ok and "epoch 2: follows epoch 0: a rotation is missing" in verdict.message


@pytest.mark.slow
@pytest.mark.timeout(600)  # about 30 s on 2 cores
@one_process_only("reads the server's key channel in its process")
async def test_a_million_frames_across_rotations_and_a_resume(
    make_server: Callable[..., RunningServer], identity: tuple[str, str]
) -> None:
    """1,000,000 frames from the server, one token each, keys rotating every 16 MiB, the
    connection dropped halfway and the stream resumed on a new one: every frame opens, in
    order, and no (key, nonce) pair comes twice."""
    server = make_server(e2e_key=identity[0], e2e_rotate_bytes=16 * 1024 * 1024, merge_window_ms=0)
    per_request = server.engine.info.max_output_tokens
    target, dropped = 1_000_000, False
    frames = 0
    pairs: set[tuple[str, bytes]] = set()
    epochs: list[int] = []
    client = await Encrypted.open(server.url, identity[1], "session_id=million")
    request = 0
    while frames < target:
        request += 1
        rid = f"m{request}"
        await client.send(
            prompt="go", max_tokens=per_request, resumable=True, request_id=rid, reset=True
        )
        next_seq = 0
        while True:
            frame = await client.recv()
            frames += 1
            if frame["type"] == "token":
                assert frame["seq"] == next_seq, (rid, frame, next_seq)
                next_seq += frame.get("n", 1)
            elif frame["type"] == "done":
                assert frame["usage"]["completion_tokens"] == next_seq
                break
            if not dropped and frames >= target // 2 and frame["type"] == "token":
                dropped = True  # drop the connection mid-stream, resume on a new one
                epochs.append(client.channel.receive_epoch)
                pairs.update(client.pairs)
                client.ws.transport.abort()
                client = await Encrypted.open(server.url, identity[1], "session_id=million")
                await client.send(type="resume", request_id=rid, after_seq=next_seq - 1)
    epochs.append(client.channel.receive_epoch)
    pairs.update(client.pairs)
    await client.ws.close()
    received = [p for p in pairs if not p[0].startswith("sent ")]
    assert frames >= target and dropped
    assert len(received) == frames  # each (key, nonce) once: a repeat would have merged
    assert len(pairs) - len(received) == request + 1  # the generates and the resume
    assert sum(epochs) >= 2, epochs  # rotations on both sides of the resume


@pytest.mark.subprocess
def test_seedance_chat_with_an_identity_made_by_keygen(
    make_server: Callable[..., RunningServer], tmp_path: Path
) -> None:
    key = tmp_path / "identity.pem"
    made = subprocess.run([SEEDANCE, "models", "keygen", str(key)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    server = make_server(e2e_key=str(key), e2e_required=True)
    chat = [SEEDANCE, "chat", "--url", server.url, "--once", "hi", "--max-tokens", "8", "-v"]
    result = subprocess.run([*chat, "--e2e", f"{key}.pub"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "end-to-end encrypted, server measurement" in result.stderr
    assert result.stdout.strip()
    refused = subprocess.run(chat, capture_output=True, text=True)  # no --e2e: refused
    assert refused.returncode == 1 and "requires end-to-end encryption" in refused.stderr


# ---------------------------------------------------------------------------- in a cluster


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop(kill=True)


@pytest.mark.subprocess
async def test_a_stream_resumes_encrypted_on_another_node_and_redis_holds_no_text(
    redis: RedisServer, make_server: Callable[..., RunningServer], identity: tuple[str, str]
) -> None:
    """Two nodes on one Redis, one identity, --encrypt-at-rest: a reply dropped on the first
    node resumes on the second under new keys at the right seq, the same text as an undisturbed
    one; and nothing Redis holds (conversation, stream log, the request) shows the text."""
    first, second = nodes(
        make_server,
        2,
        redis,
        engines=lambda: slow_engine(tokens_per_s=300),
        e2e_key=identity[0],
        encrypt_at_rest=True,
    )
    prompt = "a confidential prompt about the merger"
    async with connect(first.url, e2e=identity[1]) as session:
        expected = (await session.complete(prompt, seed=7, max_tokens=120)).text

    client = await Encrypted.open(first.url, identity[1], "session_id=vault")
    request = {"prompt": prompt, "seed": 7, "max_tokens": 120, "resumable": True}
    await client.send(**request, request_id="r1")
    texts, next_seq = [], 0
    while next_seq < 30:
        frame = await client.recv()
        if frame["type"] == "token":
            assert frame["seq"] == next_seq
            texts.append(frame["token"])
            next_seq += frame.get("n", 1)
    first_keys = client.channel.receive_key_hash
    client.ws.transport.abort()

    client = await Encrypted.open(second.url, identity[1], "session_id=vault")
    assert client.hello["active"]["request_id"] == "r1"
    assert client.channel.receive_key_hash != first_keys  # new keys for the new connection
    await client.send(type="resume", request_id="r1", after_seq=next_seq - 1)
    while True:
        frame = await client.recv()
        if frame["type"] == "token":
            assert frame["seq"] == next_seq, (frame, next_seq)
            texts.append(frame["token"])
            next_seq += frame.get("n", 1)
        elif frame["type"] == "done":
            break
    await client.ws.close()
    assert "".join(texts) == expected and next_seq == 120

    stored = redis_values(redis.url)
    assert len(stored) > 3000  # the log, the conversation and the request are there
    for secret in [prompt, *(expected[i : i + 16] for i in range(0, len(expected) - 16, 8))]:
        assert secret.encode() not in stored, secret


def redis_values(url: str) -> bytes:
    """Every value Redis holds, strings, hashes and streams, in one byte string."""
    import redis as redis_py

    client = redis_py.Redis.from_url(url)
    values = []
    try:
        for key in client.scan_iter("*"):
            kind = client.type(key)
            if kind == b"string":
                values.append(client.get(key) or b"")
            elif kind == b"hash":
                values += list(client.hgetall(key).values())
            elif kind == b"stream":
                values += [v for _, fields in client.xrange(key) for v in fields.values()]
    finally:
        client.close()
    return b"\n".join(values)


# ---------------------------------------------------------------------------- behind a proxy


@contextlib.contextmanager
def tls_haproxy(tmp_path: Path, upstream_port: int) -> Iterator[tuple[str, str]]:
    """HAProxy terminating TLS with its own certificate, forwarding plain HTTP/WebSocket to
    ``upstream_port``; yields its wss:// URL and the CA file that signed its certificate."""
    binary = tool("haproxy", "haproxy")
    authority = Authority(tmp_path, "Proxy CA")
    issued = authority.server("proxy")
    bundle = tmp_path / "proxy-bundle.pem"
    bundle.write_bytes(issued.cert.read_bytes() + issued.key.read_bytes())
    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        "defaults\n  mode http\n  timeout connect 5s\n  timeout client 60s\n"
        "  timeout server 60s\n  timeout tunnel 1h\n"
        f"frontend tls\n  bind 127.0.0.1:{port} ssl crt {bundle}\n  default_backend seedance\n"
        f"backend seedance\n  server node 127.0.0.1:{upstream_port}\n"
    )
    proc = subprocess.Popen(
        [binary, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_listening(proc, port, "haproxy")
        yield f"wss://127.0.0.1:{port}", str(authority.pem)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.subprocess
async def test_a_tls_terminating_haproxy_forwards_only_ciphertext(
    make_server: Callable[..., RunningServer], identity: tuple[str, str], tmp_path: Path
) -> None:
    """What HAProxy forwards after terminating TLS, captured between it and Seedance: with
    end-to-end encryption no prompt and no reply appears in any WebSocket payload, either way;
    without it (the control) both do."""
    server = make_server(e2e_key=identity[0])
    prompt = "patient 4471: the biopsy results are"
    relay = Relay(("127.0.0.1", server.port))
    async with relay.running():
        with tls_haproxy(tmp_path, relay.port) as (url, ca):
            async with connect(url, ca_file=ca, e2e=identity[1], reconnect=None) as session:
                stream = session.generate(prompt, seed=5, max_tokens=80)
                encrypted = await stream.collect()
                text = stream.text
            sealed = list(relay.frames)
            relay.frames.clear()
            async with connect(url, ca_file=ca, reconnect=None) as session:
                plain_text = (await session.complete(prompt, seed=5, max_tokens=80)).text
            plain = list(relay.frames)
    assert encrypted.finish_reason == "length" and text == plain_text

    def payloads(frames: list[Any], direction: str) -> bytes:
        return b"\n".join(
            f.payload for f in frames if f.direction == direction and f.opcode in (1, 2)
        )

    secrets = [prompt, *(text[i : i + 12] for i in range(0, len(text) - 12, 6))]
    for direction in ("to_server", "to_client"):
        seen = payloads(sealed, direction)
        assert seen and not [s for s in secrets if s.encode() in seen], direction
    # Every data frame after the session frame was sealed (binary, 0x05) or a heartbeat.
    data = [f for f in sealed if f.opcode in (1, 2)]
    assert data[0].opcode == 1 and json.loads(data[0].payload)["type"] == "session"
    assert all(f.opcode == 2 and f.payload[:1] in (b"\x05", b"\x01", b"\x02") for f in data[1:])
    # The control: the same capture point sees the text of a plain stream.
    assert prompt.encode() in payloads(plain, "to_server")
    assert plain_text[:24].encode() in payloads(plain, "to_client")
