"""Tenants over real sockets: credentials, isolation, quotas, fairness, policy, admin endpoints.

Keys are made with the same code as ``seedance keys add``, into a config file of the test's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from seedance.config_loader import load_access, load_config
from seedance.tenants.keys import add_key
from tests.support.servers import (
    SEEDANCE,
    RunningServer,
    ServerProcess,
    one_process_only,
    serve_fails,
    slow_engine,
)
from tests.support.waits import eventually
from tests.support.ws import collect, generate, open_session, raw_connect, recv_json, wait_closed

CHAT = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def tenant_server(
    make_server: Callable[..., RunningServer], path: Path, engines: Any = None, **fields: Any
) -> RunningServer:
    """A server on the tenants of config file ``path`` (which it watches for changes)."""
    return make_server(engines, config_file=str(path), access=load_access(path), **fields)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def refused(url: str, query: str = "", **kwargs: Any) -> tuple[int | None, dict[str, Any]]:
    """Connect expecting a refusal: the close code and the error body."""
    async with raw_connect(url, query, **kwargs) as ws:
        code, frames = await wait_closed(ws)
    assert frames and frames[0]["type"] == "error", frames
    return code, frames[0]["error"]


@pytest.fixture
def two_tenants(tmp_path: Path) -> tuple[Path, str, str]:
    """A config file with tenants acme and globex, one user key each."""
    path = tmp_path / "seedance.toml"
    acme = add_key(path, "acme").key
    globex = add_key(path, "globex").key
    return path, acme, globex


# --------------------------------------------------------------------------- keys command


@pytest.mark.subprocess
def test_keys_command_adds_lists_and_revokes(tmp_path: Path) -> None:
    path = tmp_path / "seedance.toml"
    path.write_text("# our server\nport = 9000\n\n[tenants.acme]\ntier = 2\n")

    def keys(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [SEEDANCE, "keys", *args, "--config", str(path)], capture_output=True, text=True
        )

    added = keys("add", "acme", "--role", "admin")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip().splitlines()[-1]
    assert key.startswith("sd_")
    text = path.read_text()
    assert key not in text and "# our server" in text and "tier = 2" in text  # kept as it was
    key_id = key.split("_")[1]
    assert f'id = "{key_id}"' in text and 'role = "admin"' in text
    other = keys("add", "initech").stdout.strip().splitlines()[-1]  # a new tenant
    listing = keys("list").stdout
    assert f"acme\t{key_id}\tadmin" in listing and "initech" in listing and other not in listing
    assert keys("revoke", key_id).returncode == 0
    assert f"{key_id}\tadmin" in keys("list").stdout and "revoked" in keys("list").stdout
    again = keys("revoke", key_id)
    assert again.returncode == 1 and "already revoked" in again.stderr
    bad = keys("add", "no spaces")
    assert bad.returncode == 1 and "tenant" in bad.stderr
    good = path.read_text()
    path.write_text(good + "\n[tenants.broken]\nkeys = 5\n")  # refused with a line, as read
    broken = keys("add", "acme")
    assert broken.returncode == 1 and "tenants.broken.keys" in broken.stderr
    assert "Traceback" not in broken.stderr
    path.write_text(good)
    config = load_config({"config": str(path)}, {})
    assert config.port == 9000 and config.access is not None
    assert set(config.access.tenants) == {"acme", "initech"}


def test_bad_tenant_tables_name_the_key(tmp_path: Path) -> None:
    from seedance.config import ConfigError

    path = write_config(tmp_path / "s.toml", "[tenants.acme.quotas]\nconnections = 0\n")
    with pytest.raises(ConfigError, match=r"tenants\.acme\.quotas\.connections"):
        load_config({"config": str(path)}, {})
    write_config(path, "[tenants.acme]\ncolour = 'red'\n")
    with pytest.raises(ConfigError, match="colour"):
        load_config({"config": str(path)}, {})


# --------------------------------------------------------------------------- authentication


@pytest.mark.subprocess
async def test_an_open_server_says_so(server_process: Callable[..., ServerProcess]) -> None:
    proc = server_process()
    await proc.logged("no tenants configured: the server is open")  # after the address line


async def test_credentials_from_header_query_and_subprotocol(
    make_server: Callable[..., RunningServer], two_tenants: tuple[Path, str, str]
) -> None:
    path, acme, _ = two_tenants
    server = tenant_server(make_server, path)
    for kwargs in (
        {"additional_headers": auth(acme)},
        {"query": f"api_key={acme}"},
        {"subprotocols": ["seedance.v2", f"bearer.{acme}"]},
    ):
        query = kwargs.pop("query", "")
        ws, hello = await open_session(server.url, query, **kwargs)  # type: ignore[arg-type]
        async with ws:
            assert hello["type"] == "session"
            if "subprotocols" in kwargs:
                assert ws.subprotocol == "seedance.v2"  # the key is never echoed
            frames = await generate(ws, prompt="x", max_tokens=2)
            assert frames[-1]["type"] == "done"
    code, error = await refused(server.url)
    assert code == 4401 and error["code"] == "unauthorized"
    assert "Authorization: Bearer" in error["message"]
    code, error = await refused(server.url, additional_headers=auth(acme[:-2] + "xx"))
    assert code == 4401 and error["message"] == "invalid API key"
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        missing = await client.post("/v1/chat/completions", json=CHAT)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"].startswith("Bearer")
        assert missing.json()["error"]["code"] == "unauthorized"
        assert (await client.get("/v1/models")).status_code == 401
        ok = await client.post("/v1/chat/completions", json=CHAT, headers=auth(acme))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert (await client.get("/v1/models", headers=auth(acme))).status_code == 200
        # /healthz and /metrics stay open: they are for the operator's network.
        assert (await client.get("/healthz")).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert 'seedance_refused_total{api="websocket",code="unauthorized"} 2.0' in metrics
    assert 'seedance_refused_total{api="http",code="unauthorized"} 2.0' in metrics
    assert 'tenant="acme"' in metrics


@one_process_only("each worker has its own admission queue and failed-credential counts")
async def test_failed_credentials_are_rate_limited_per_address(
    make_server: Callable[..., RunningServer], two_tenants: tuple[Path, str, str]
) -> None:
    path, acme, _ = two_tenants
    server = tenant_server(make_server, path)
    for _ in range(10):
        code, _ = await refused(server.url, additional_headers=auth("sd_00000000_guess"))
        assert code == 4401
    # Now even the right key is not looked at from this address.
    code, error = await refused(server.url, additional_headers=auth(acme))
    assert code == 4429 and error["code"] == "quota_exceeded" and error["retryable"]
    assert 1 <= error["retry_after"] <= 6
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        reply = await client.post("/v1/chat/completions", json=CHAT, headers=auth(acme))
    assert reply.status_code == 429 and 1 <= int(reply.headers["retry-after"]) <= 6


async def test_jwt_credentials(tmp_path: Path, make_server: Callable[..., RunningServer]) -> None:
    import jwt
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp_path / "jwt.pem").write_bytes(pem)
    path = write_config(
        tmp_path / "s.toml",
        '[tenants.acme]\n[auth.jwt]\npublic_key = "jwt.pem"\nleeway_s = 30\n',
    )
    server = tenant_server(make_server, path)
    now = int(time.time())

    def token(**claims: Any) -> str:
        return jwt.encode({"tenant": "acme", "exp": now + 60, **claims}, private, "EdDSA")

    ws, _hello = await open_session(server.url, additional_headers=auth(token(sub="svc-1")))
    await ws.close()
    # Expired, but within the 30 s clock-skew allowance: still good.
    ws, _ = await open_session(server.url, additional_headers=auth(token(exp=now - 10)))
    await ws.close()
    code, error = await refused(server.url, additional_headers=auth(token(exp=now - 120)))
    assert code == 4401 and error["message"] == "token expired"
    code, error = await refused(server.url, additional_headers=auth(token(tenant="evil")))
    assert code == 4401 and "unknown tenant" in error["message"]
    forged = jwt.encode({"tenant": "acme", "exp": now + 60}, Ed25519PrivateKey.generate(), "EdDSA")
    code, error = await refused(server.url, additional_headers=auth(forged))
    assert code == 4401 and "invalid token" in error["message"]
    no_exp = jwt.encode({"tenant": "acme"}, private, "EdDSA")
    code, error = await refused(server.url, additional_headers=auth(no_exp))
    assert code == 4401 and "exp" in error["message"]


async def test_rs256_jwt(tmp_path: Path, make_server: Callable[..., RunningServer]) -> None:
    import jwt
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp_path / "rsa.pem").write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    path = write_config(
        tmp_path / "s.toml",
        '[tenants.acme]\n[tenants.globex]\n[auth.jwt]\npublic_key = "rsa.pem"\n'
        'admin_tenants = ["acme"]\n',
    )
    server = tenant_server(make_server, path)
    claims = {"tenant": "acme", "exp": int(time.time()) + 60, "role": "admin", "jti": "t-1"}
    token = jwt.encode(claims, private, "RS256")
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        listing = await client.get("/admin/tenants", headers=auth(token))  # role from the token
        assert listing.status_code == 200
        hs = jwt.encode(claims, "not the key, and HS256 is not accepted here", "HS256")
        assert (await client.get("/v1/models", headers=auth(hs))).status_code == 401
        # A valid token of a tenant the configuration does not let grant admin: refused.
        usurper = jwt.encode({**claims, "tenant": "globex"}, private, "RS256")
        refused_admin = await client.get("/admin/tenants", headers=auth(usurper))
        assert refused_admin.status_code == 401
        assert "may not grant role admin" in refused_admin.json()["error"]["message"]
        plain = jwt.encode({**claims, "tenant": "globex", "role": "user"}, private, "RS256")
        assert (await client.get("/v1/models", headers=auth(plain))).status_code == 200


@pytest.mark.subprocess
def test_algorithms_that_do_not_fit_the_key_stop_the_server(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    public = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    (tmp_path / "rsa.pem").write_bytes(
        public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    path = write_config(
        tmp_path / "s.toml",
        '[tenants.acme]\n[auth.jwt]\npublic_key = "rsa.pem"\nalgorithms = ["RS256", "HS256"]\n',
    )
    output = serve_fails("--config", str(path))
    assert (
        "auth.jwt.algorithms: HS256 cannot be used with an RSA public key; use RS256, RS384"
        in output
    )
    assert "Traceback" not in output
    path.write_text('[tenants.acme]\n[auth.jwt]\nsecret = "s" \nadmin_tenants = ["nobody"]\n')
    assert "auth.jwt.admin_tenants: no tenant 'nobody'" in serve_fails("--config", str(path))


async def test_hs256_jwt(tmp_path: Path, make_server: Callable[..., RunningServer]) -> None:
    import jwt

    secret = "s3cret-s3cret-s3cret-s3cret-s3cret!"
    path = write_config(tmp_path / "s.toml", f'[tenants.acme]\n[auth.jwt]\nsecret = "{secret}"\n')
    server = tenant_server(make_server, path)
    good = jwt.encode({"tenant": "acme", "exp": int(time.time()) + 60}, secret, "HS256")
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        assert (await client.get("/v1/models", headers=auth(good))).status_code == 200
        bad = jwt.encode({"tenant": "acme", "exp": int(time.time()) + 60}, "wrong" * 8, "HS256")
        assert (await client.get("/v1/models", headers=auth(bad))).status_code == 401


async def test_origin_allow_list(
    make_server: Callable[..., RunningServer], two_tenants: tuple[Path, str, str]
) -> None:
    path, acme, _ = two_tenants
    server = tenant_server(make_server, path, allowed_origins=("https://app.example.com",))
    ws, _ = await open_session(
        server.url, additional_headers={**auth(acme), "Origin": "https://app.example.com"}
    )
    await ws.close()
    ws, _ = await open_session(server.url, additional_headers=auth(acme))  # not a browser
    await ws.close()
    code, error = await refused(
        server.url, additional_headers={**auth(acme), "Origin": "https://evil.example"}
    )
    assert code == 4403 and error["code"] == "forbidden" and "evil.example" in error["message"]


# --------------------------------------------------------------------------- isolation


@one_process_only("reads the server's sessions and admission in its process")
async def test_a_tenant_never_sees_another_tenants_session(
    make_server: Callable[..., RunningServer], two_tenants: tuple[Path, str, str]
) -> None:
    path, acme, globex = two_tenants
    server = tenant_server(make_server, path)
    ws, hello = await open_session(server.url, "session_id=shared", additional_headers=auth(acme))
    async with ws:
        assert hello["created"]
        await generate(ws, prompt="acme's secret", max_tokens=3)
    ws, hello = await open_session(server.url, "session_id=shared", additional_headers=auth(globex))
    async with ws:
        assert hello["created"] and hello["context_turns"] == 0  # a session of its own
        await generate(ws, prompt="globex", max_tokens=3)
    ws, hello = await open_session(server.url, "session_id=shared", additional_headers=auth(acme))
    async with ws:
        assert not hello["created"] and hello["context_turns"] == 2  # acme's, untouched
    assert len(server.state.sessions) == 2


# --------------------------------------------------------------------------- quotas


@pytest.mark.slow
async def test_concurrency_quotas_refuse_then_recover(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    path = write_config(
        tmp_path / "s.toml",
        "[tenants.acme.quotas]\nconnections = 2\ngenerations = 1\nsessions = 2\n",
    )
    key = add_key(path, "acme").key
    server = tenant_server(make_server, path, [slow_engine(tokens_per_s=100)])
    first, _ = await open_session(server.url, "session_id=a", additional_headers=auth(key))
    second, _ = await open_session(server.url, "session_id=b", additional_headers=auth(key))
    code, error = await refused(server.url, "session_id=c", additional_headers=auth(key))
    assert code == 4429 and error["code"] == "quota_exceeded" and error["retry_after"] == 1
    assert "2 connections" in error["message"]
    async with first, second:
        await first.send(json.dumps({"prompt": "long", "max_tokens": 30}))
        assert (await recv_json(first))["type"] == "start"
        busy = await generate(second, prompt="x", max_tokens=2)
        assert busy[-1]["error"]["code"] == "quota_exceeded"
        assert "1 generations" in busy[-1]["error"]["message"]
        assert (await collect(first))[-1]["finish_reason"] == "length"
        again = await generate(second, prompt="x", max_tokens=2)  # recovered: one ended
        assert again[-1]["type"] == "done"
    # Two live sessions (a, b): a third is refused even with connections free; b comes back.
    code, error = await refused(server.url, "session_id=c", additional_headers=auth(key))
    assert code == 4429 and "2 live sessions" in error["message"]
    ws, hello = await open_session(server.url, "session_id=b", additional_headers=auth(key))
    await ws.close()
    assert not hello["created"]


async def test_rate_and_size_quotas(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    path = write_config(
        tmp_path / "s.toml",
        "[tenants.acme.quotas]\nrequests_per_minute = 3\nmax_tokens = 8\n"
        "[tenants.globex.quotas]\ntokens_per_minute = 60\n",
    )
    acme = add_key(path, "acme").key
    globex = add_key(path, "globex").key
    server = tenant_server(make_server, path)
    ws, _ = await open_session(server.url, additional_headers=auth(acme))
    async with ws:
        unset = await generate(ws, prompt="x")  # max_tokens absent: the tenant's cap
        assert unset[-1]["usage"]["completion_tokens"] == 8
        over = await generate(ws, prompt="x", max_tokens=9)
        assert over[-1]["error"]["code"] == "quota_exceeded" and "limit of 8" in str(over)
        for _ in range(2):
            assert (await generate(ws, prompt="x", max_tokens=2))[-1]["type"] == "done"
        limited = (await generate(ws, prompt="x", max_tokens=2))[-1]["error"]
        assert limited["code"] == "quota_exceeded" and limited["retryable"]
        assert "3 requests per minute" in limited["message"] and 50 <= limited["retry_after"] <= 60
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        reply = await client.post("/v1/chat/completions", json=CHAT, headers=auth(acme))
        assert reply.status_code == 429 and 50 <= int(reply.headers["retry-after"]) <= 60
        # globex: 60 tokens a minute, prompt and reply; its own count, untouched by acme's.
        used, prompt = 0, 0
        while True:
            reply = await client.post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": 10}, headers=auth(globex)
            )
            if reply.status_code != 200:
                break
            used += reply.json()["usage"]["total_tokens"]
            prompt = reply.json()["usage"]["prompt_tokens"]
        assert reply.status_code == 429 and "60 tokens per minute" in reply.text
        assert used <= 60 < used + prompt  # refused: its prompt no longer fits the window


async def flood_of(
    server: RunningServer, key: str, count: int, max_tokens: int, pause: float = 0.0
) -> list[Any]:
    """``count`` connections of the key's tenant, each sending one request."""
    sockets = [
        (await open_session(server.url, additional_headers=auth(key)))[0] for _ in range(count)
    ]
    for ws in sockets:
        await ws.send(json.dumps({"prompt": "flood", "max_tokens": max_tokens}))
        await asyncio.sleep(pause)
    return sockets


@pytest.mark.slow
@one_process_only("reads the server's sessions and admission in its process")
async def test_one_tenants_flood_does_not_starve_another(
    make_server: Callable[..., RunningServer], two_tenants: tuple[Path, str, str]
) -> None:
    path, acme, globex = two_tenants
    server = tenant_server(
        make_server, path, [slow_engine(tokens_per_s=100)], max_running=2, max_waiting=64
    )
    flood = await flood_of(server, acme, 16, max_tokens=20)
    models = server.state.models.values()
    await eventually(lambda: sum(m.admission.waiting for m in models) >= 12, what="flood queued")
    ws, _ = await open_session(server.url, additional_headers=auth(globex))
    async with ws:
        done = (await generate(ws, prompt="me", max_tokens=20))[-1]
    flood_done = [(await collect(f))[-1] for f in flood]
    for f in flood:
        await f.close()
    waits = [d["timing"]["queue_ms"] for d in flood_done]
    # Served in turn: globex waits for one slot (200 ms at most), not for the acme requests
    # queued before it (their median wait is about 700 ms).
    assert done["timing"]["queue_ms"] < statistics.median(waits) / 2, (done, waits)


@pytest.mark.slow
@one_process_only("each worker has its own admission queue and failed-credential counts")
async def test_the_queue_is_shared_fairly_when_full(
    make_server: Callable[..., RunningServer], two_tenants: tuple[Path, str, str]
) -> None:
    path, acme, globex = two_tenants
    server = tenant_server(
        make_server, path, [slow_engine(tokens_per_s=200)], max_running=1, max_waiting=3
    )
    # Half a second each, sent in this order: the queue stays full while globex comes.
    flood = await flood_of(server, acme, 5, max_tokens=100, pause=0.02)
    ends = [(await collect(f))[-1] for f in flood[-1:]]  # 1 running + 3 waiting: the 5th out
    assert ends[0]["error"]["code"] == "overloaded"
    ws, _ = await open_session(server.url, additional_headers=auth(globex))
    async with ws:
        # The queue is full of acme's: globex pushes acme's newest out, and is served.
        mine = await generate(ws, prompt="me", max_tokens=2)
    assert mine[-1]["type"] == "done"
    outcomes = [(await collect(f))[-1] for f in flood[:-1]]
    for f in flood:
        await f.close()
    assert sum(o.get("error", {}).get("code") == "overloaded" for o in outcomes) == 1


# --------------------------------------------------------------------------- policy


async def test_policy_models_priorities_and_labels(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    path = write_config(
        tmp_path / "s.toml",
        '[tenants.acme]\nmodels = ["other-*"]\n[tenants.globex]\nmax_priority = 2\n'
        'labels = { region = ["eu-west", "eu-north"] }\n[tenants.initech]\n'
        'labels = { region = "us-east" }\n',
    )
    acme, globex, initech = (add_key(path, t).key for t in ("acme", "globex", "initech"))
    server = tenant_server(make_server, path, labels=(("region", "eu-west"),))
    code, error = await refused(server.url, additional_headers=auth(acme))
    assert code == 4403 and error["code"] == "forbidden" and "synthetic" in error["message"]
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        listed = (await client.get("/v1/models", headers=auth(acme))).json()["data"]
        assert listed == []
        denied = await client.post("/v1/chat/completions", json=CHAT, headers=auth(acme))
        assert denied.status_code == 403
        high = await client.post(
            "/v1/chat/completions", json={**CHAT, "priority": 3}, headers=auth(globex)
        )
        assert high.status_code == 403 and "highest, 2" in high.text
    ws, _ = await open_session(server.url, additional_headers=auth(globex))
    async with ws:
        assert (await generate(ws, prompt="x", max_tokens=2, priority=2))[-1]["type"] == "done"
        await ws.send(json.dumps({"prompt": "x", "priority": 5}))
        code, frames = await wait_closed(ws)
    assert code == 4403 and frames[0]["error"]["code"] == "forbidden"
    code, error = await refused(server.url, additional_headers=auth(initech))
    assert code == 4403 and "region us-east" in error["message"]


# --------------------------------------------------------------------------- administration


async def test_admin_endpoints(tmp_path: Path, make_server: Callable[..., RunningServer]) -> None:
    path = tmp_path / "s.toml"
    admin = add_key(path, "ops", role="admin").key
    user = add_key(path, "acme")
    server = tenant_server(make_server, path, [slow_engine(tokens_per_s=50)])
    ws, _hello = await open_session(server.url, "session_id=s1", additional_headers=auth(user.key))
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        assert (await client.get("/admin/tenants")).status_code == 401
        assert (await client.get("/admin/tenants", headers=auth(user.key))).status_code == 403
        listing = (await client.get("/admin/tenants", headers=auth(admin))).json()["tenants"]
        acme = next(t for t in listing if t["name"] == "acme")
        assert acme["usage"]["connections"] == 1 and acme["usage"]["sessions"] == 1
        assert acme["keys"] == [{"id": user.id, "role": "user", "revoked": False}]
        assert "sha256" not in json.dumps(listing)
        assert (await client.get("/admin/runtime", headers=auth(user.key))).status_code == 403
        runtime = (await client.get("/admin/runtime", headers=auth(admin))).json()
        assert runtime["connections"] == 1 and runtime["sessions"] == 1
        assert runtime["event_loop_tasks"] > 0 and runtime["generations"] == 0

        # Ending the session cancels its reply and closes its connection.
        await ws.send(json.dumps({"prompt": "long", "max_tokens": 200}))
        assert (await recv_json(ws))["type"] == "start"
        ended = await client.delete("/admin/sessions/acme/s1", headers=auth(admin))
        assert ended.status_code == 200 and ended.json()["connections"] == 1
        code, frames = await wait_closed(ws)
        assert code == 1000
        assert [f for f in frames if isinstance(f, dict)][-1]["finish_reason"] == "cancelled"
        gone = await client.delete("/admin/sessions/acme/s1", headers=auth(admin))
        assert gone.status_code == 404

        # Revoking a key closes its connections at once and refuses it from then on.
        ws, _ = await open_session(server.url, additional_headers=auth(user.key))
        revoked = await client.post(f"/admin/keys/{user.id}/revoke", headers=auth(admin))
        assert revoked.json() == {"revoked": user.id, "tenant": "acme"}
        code, frames = await wait_closed(ws)
        assert code == 4401 and "revoked" in frames[0]["error"]["message"]
        code, error = await refused(server.url, additional_headers=auth(user.key))
        assert code == 4401 and "revoked" in error["message"]
        assert "revoked = true" in path.read_text()  # it stays revoked after a restart
        again = await client.post(f"/admin/keys/{user.id}/revoke", headers=auth(admin))
        assert again.status_code == 409
        unknown = await client.post("/admin/keys/ffffffff/revoke", headers=auth(admin))
        assert unknown.status_code == 404


async def test_admin_revoke_says_what_went_wrong(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    """404 for a key that is not there (in memory or in the file), 409 for one revoked
    already, 500 when the tenants file cannot be updated (and the key stays usable)."""
    path = tmp_path / "s.toml"
    admin = add_key(path, "ops", role="admin").key
    user = add_key(path, "acme")
    server = tenant_server(make_server, path)
    async with httpx.AsyncClient(base_url=server.http_url) as client:

        async def revoke(key_id: str) -> httpx.Response:
            return await client.post(f"/admin/keys/{key_id}/revoke", headers=auth(admin))

        good = path.read_text()
        path.write_text(good + "this is not TOML\n")  # the server keeps its tables
        broken = await revoke(user.id)
        assert broken.status_code == 500, broken.text
        error = broken.json()["error"]
        assert error["code"] == "internal_error" and "tenants file" in error["message"]
        ws, _ = await open_session(server.url, additional_headers=auth(user.key))
        await ws.close()  # still usable
        path.write_text(good)
        assert (await revoke(user.id)).status_code == 200
        again = await revoke(user.id)
        assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
        missing = await revoke("ffffffff")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


@pytest.mark.subprocess
async def test_a_key_revoked_in_the_file_is_refused_within_a_second(
    make_server: Callable[..., RunningServer], two_tenants: tuple[Path, str, str]
) -> None:
    path, acme, _ = two_tenants
    server = tenant_server(make_server, path)
    ws, _ = await open_session(server.url, additional_headers=auth(acme))
    key_id = acme.split("_")[1]
    result = await asyncio.to_thread(
        subprocess.run,
        [SEEDANCE, "keys", "revoke", key_id, "--config", str(path)],
        capture_output=True,
    )
    assert result.returncode == 0
    started = time.monotonic()
    code, _ = await wait_closed(ws, timeout=5)
    assert code == 4401 and time.monotonic() - started < 3
    code, _ = await refused(server.url, additional_headers=auth(acme))
    assert code == 4401


async def test_admin_endpoints_are_closed_without_tenants(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        reply = await client.get("/admin/tenants")
    assert reply.status_code == 403 and "no tenants" in reply.text


@pytest.mark.subprocess
async def test_the_python_client_and_chat_command_send_their_key(
    make_server: Callable[..., RunningServer], two_tenants: tuple[Path, str, str]
) -> None:
    from seedance.client import connect
    from seedance.protocol.errors import Unauthorized

    path, acme, _ = two_tenants
    server = tenant_server(make_server, path)
    async with connect(server.url, api_key=acme) as session:
        done = await session.complete("hello", max_tokens=3)
    assert done.usage.completion_tokens == 3
    with pytest.raises(Unauthorized):
        async with connect(server.url, api_key="sd_00000000_nope"):
            pass
    chat = await asyncio.to_thread(
        subprocess.run,
        [SEEDANCE, "chat", "--url", server.url, "--once", "hi", "--max-tokens", "3"],
        capture_output=True,
        text=True,
        env={**os.environ, "SEEDANCE_API_KEY": acme},
    )
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr
