"""The cross-region relay (``--engine relay`` at the edge, ``POST /v2/relay`` at the far end):
a relayed reply is the far gateway's own, token for token; relay tokens that are not for this
node, expired, replayed, unsigned or for a tenant it lacks are refused with their reason; one
QUIC connection carries every request; a link cut mid-reply is opened again and the reply
resumed whole. On loopback here; across network namespaces with delay and loss in
tests/test_relay_netns.py."""

from __future__ import annotations

import json
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from seedance.client import connect
from seedance.config_loader import load_access
from tests.support.redis import RedisServer
from tests.support.servers import SEEDANCE, RunningServer, ServerProcess, one_process_only
from tests.support.ws import open_session
from tests.test_resume import Reading, read, resume

pytest.importorskip("aioquic", reason="the relay needs aioquic, which needs Python 3.11")

from seedance.relay.copies import Repeating
from seedance.relay.tokens import RelayRefused, Verifier, mint
from tests.support.relay import Region


@pytest.fixture
def region(tmp_path: Path) -> Region:
    return Region(tmp_path)


@one_process_only("reads (or cuts) the edge's relay link in its process")
async def test_a_relayed_reply_is_the_far_gateways_own_over_one_quic_connection(
    make_server: Callable[..., RunningServer], region: Region
) -> None:
    far = region.far(make_server)
    edge = region.edge(make_server, far)
    ca = str(region.authority.pem)
    async with connect(f"wss://127.0.0.1:{far.port}", ca_file=ca) as direct:
        expected = [await direct.complete(p, max_tokens=20) for p in ("first", "second")]
    async with connect(edge.url, session_id="relayed") as session:
        got = [await session.complete(p, max_tokens=20) for p in ("first", "second")]
    assert [g.text for g in got] == [e.text for e in expected]
    assert all(g.finish_reason == "length" for g in got)
    (peer,) = edge.engine.peers
    assert peer.link.connects == 1  # one connection, a stream per request


@one_process_only("reads (or cuts) the edge's relay link in its process")
async def test_a_link_cut_mid_reply_is_opened_again_and_the_reply_resumed_whole(
    make_server: Callable[..., RunningServer], region: Region
) -> None:
    far = region.far(make_server, tokens_per_s=100)
    edge = region.edge(make_server, far)
    (peer,) = edge.engine.peers
    async with connect(edge.url) as session:
        reply = session.generate("a long one", max_tokens=80)
        pieces = []
        async for chunk in reply:
            pieces.append(chunk.text)
            if len(pieces) == 10:
                peer.link.cut()
        done = reply.done
    assert done is not None and done.finish_reason == "length"
    assert done.usage.completion_tokens == 80
    async with connect(f"wss://127.0.0.1:{far.port}", ca_file=str(region.authority.pem)) as d:
        direct = await d.complete("a long one", max_tokens=80)
    assert "".join(pieces) == direct.text  # no token lost, none twice
    assert peer.link.connects == 2
    link = peer.link._link
    assert link is not None and link.resumed and link.early_data  # the resume went as 0-RTT


@pytest.mark.parametrize(
    ("claims", "reason"),
    [
        ({"audience": "far-2"}, "wrong_audience"),
        ({"now": time.time() - 200}, "expired"),
        ({"issuer": "edge-9"}, "unknown_issuer"),
    ],
)
async def test_a_token_not_for_this_node_is_refused_with_its_reason(
    make_server: Callable[..., RunningServer],
    region: Region,
    claims: dict[str, Any],
    reason: str,
) -> None:
    far = region.far(make_server)
    refused = await post(far, region, region.token(**claims))
    assert refused.status_code == 401
    assert f"({reason})" in refused.json()["error"]["message"]


async def test_a_replayed_an_unsigned_and_a_long_lived_token_are_refused(
    make_server: Callable[..., RunningServer], region: Region
) -> None:
    far = region.far(make_server)
    token = region.token()
    assert (await post(far, region, token)).status_code == 200
    replayed = await post(far, region, token)
    assert replayed.status_code == 401 and "(replayed)" in replayed.json()["error"]["message"]
    now = int(time.time())
    claims = {"iss": "edge-1", "aud": "far-1", "iat": now, "exp": now + 60, "jti": "x"}
    unsigned = jwt.encode({**claims, "tenant": "default"}, key=None, algorithm="none")
    answer = await post(far, region, unsigned)
    assert answer.status_code == 401 and "(unsigned)" in answer.json()["error"]["message"]
    hs = jwt.encode({**claims, "jti": "y", "tenant": "default"}, "s" * 32, algorithm="HS256")
    answer = await post(far, region, hs)
    assert answer.status_code == 401 and "(unsigned)" in answer.json()["error"]["message"]
    forged = mint(
        Ed25519PrivateKey.generate(), issuer="edge-1", audience="far-1", tenant="t", session=None
    )
    answer = await post(far, region, forged)
    assert answer.status_code == 401 and "(bad_signature)" in answer.json()["error"]["message"]


async def test_a_token_taken_by_one_node_of_a_cluster_is_refused_by_another(
    make_server: Callable[..., RunningServer], region: Region, redis_server: RedisServer
) -> None:
    """Two far gateways behind one address share Redis: a replayed token is refused by
    whichever node it reaches, as by the node that took it."""
    first, second = (region.far(make_server, redis_url=redis_server.url) for _ in range(2))
    token = region.token()
    assert (await post(first, region, token)).status_code == 200
    replayed = await post(second, region, token)
    assert replayed.status_code == 401 and "(replayed)" in replayed.json()["error"]["message"]
    assert (await post(second, region, region.token())).status_code == 200


def test_a_token_longer_than_90_s_is_refused() -> None:
    key = Ed25519PrivateKey.generate()
    verifier = Verifier("far-1", {"edge-1": key.public_key()})
    now = int(time.time())
    claims = {"iss": "edge-1", "aud": "far-1", "iat": now, "exp": now + 120, "jti": "z"}
    with pytest.raises(RelayRefused) as refused:
        verifier.verify(jwt.encode({**claims, "tenant": "t"}, key, algorithm="EdDSA"))
    assert refused.value.reason == "too_long"


async def test_a_token_for_a_tenant_the_far_node_lacks_is_refused(
    make_server: Callable[..., RunningServer], region: Region, tmp_path: Path
) -> None:
    config = tmp_path / "tenants.toml"
    config.write_text("[tenants.acme]\nkeys = []\n")
    far = region.far(make_server, config_file=str(config), access=load_access(config))
    answer = await post(far, region, region.token(tenant="globex"))
    assert answer.status_code == 403 and "globex" in answer.json()["error"]["message"]


async def post(far: RunningServer, region: Region, token: str) -> httpx.Response:
    """A relayed request over HTTP/1.1 with ``token``; the whole answer."""
    body = {"generate": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}
    context = ssl.create_default_context(cafile=str(region.authority.pem))
    async with httpx.AsyncClient(verify=context) as http:
        return await http.post(
            f"https://127.0.0.1:{far.port}/v2/relay",
            headers={"authorization": f"Bearer {token}"},
            content=json.dumps(body),
        )


async def test_a_client_that_drops_from_the_edge_resumes_the_relayed_reply_without_a_gap(
    make_server: Callable[..., RunningServer], region: Region
) -> None:
    """The edge's stream log holds every relayed token: a client that loses its connection to
    the edge mid-reply resumes there, each token once."""
    far = region.far(make_server, tokens_per_s=200)
    edge = region.edge(make_server, far)
    ws, _ = await open_session(edge.url, "session_id=roaming")
    request = {"prompt": "relay me", "max_tokens": 80, "resumable": True, "request_id": "r1"}
    await ws.send(json.dumps(request))
    reading = Reading("r1")
    await read(ws, reading, until_seq=15)
    ws.transport.abort()  # the client's network goes away
    ws, hello = await resume(edge, "roaming", reading)
    assert hello["active"]["request_id"] == "r1"
    await read(ws, reading)
    await ws.close()
    assert reading.end is not None and reading.end["finish_reason"] == "length"
    assert reading.last_seq + 1 == 80
    ca = str(region.authority.pem)
    async with connect(f"wss://127.0.0.1:{far.port}", ca_file=ca) as direct:
        assert reading.text == (await direct.complete("relay me", max_tokens=80)).text


async def test_a_refused_relay_token_is_audited_with_its_reason(
    make_server: Callable[..., RunningServer], region: Region, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.log"
    far = region.far(make_server, audit_file=str(audit))
    await post(far, region, region.token(audience="far-2"))
    far.stop()
    records = [json.loads(line) for line in audit.read_text().splitlines() if line.strip()]
    refused = [r for r in records if "wrong_audience" in json.dumps(r)]
    assert refused, records[-3:]


def test_seedance_relay_is_serve_with_the_relay_engine() -> None:
    done = subprocess.run(
        [SEEDANCE, "relay", "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "seedance relay: error: the relay engine needs --relay-key EDGE.pem "
        "(seedance models keygen)"
    )


@one_process_only("reads (or cuts) the edge's relay link in its process")
async def test_a_link_of_two_copies_sends_every_packet_twice_both_ways(
    make_server: Callable[..., RunningServer], region: Region
) -> None:
    """``--relay-copies 2``: the edge's packets and, asked by a header, the far end's answers
    go out twice on the link (the receiving QUIC stack drops the copy), the reply unchanged."""
    far = region.far(make_server)
    edge = region.edge(make_server, far, copies=2)
    async with connect(edge.url) as session:
        relayed = await session.complete("twice over", max_tokens=20)
    async with connect(f"wss://127.0.0.1:{far.port}", ca_file=str(region.authority.pem)) as d:
        assert relayed.text == (await d.complete("twice over", max_tokens=20)).text
    (peer,) = edge.engine.peers
    link = peer.link._link
    assert link is not None and isinstance(link._transport, Repeating)
    listener = far.server.http3
    assert listener is not None
    assert any(isinstance(c._transport, Repeating) for c in listener.connections)


@one_process_only("reads (or cuts) the edge's relay link in its process")
async def test_a_far_gateway_restarted_behind_a_kept_link_is_reached_again(
    make_server: Callable[..., RunningServer],
    server_process: Callable[..., ServerProcess],
    region: Region,
) -> None:
    """The far gateway restarts (killed, then served again on its port): the edge's kept link
    answers nothing; the next request waits for it a bounded while, then goes on a new
    connection and is served."""
    far = server_process(*region.far_flags())
    await far.logged("HTTP/3 and WebTransport on UDP port")
    edge = region.edge(make_server, far)
    async with connect(edge.url) as session:
        assert (await session.complete("before", max_tokens=4)).finish_reason == "length"
    far.proc.kill()
    far.proc.wait()
    again = server_process(*region.far_flags(), "--port", str(far.port))
    await again.logged("HTTP/3 and WebTransport on UDP port")
    started = time.monotonic()
    async with connect(edge.url) as session:
        assert (await session.complete("after", max_tokens=4)).finish_reason == "length"
    assert time.monotonic() - started < 10  # the stale link given up after 5 s
    (peer,) = edge.engine.peers
    assert peer.link.connects == 2
