"""TLS built into ``seedance serve``: wss:// and https:// on one port, modern defaults only,
certificates reloaded from disk, and client certificates that stand for a tenant.

Over real sockets, with certificates made on the spot (tests/support/certs.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import ssl
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from websockets.exceptions import InvalidHandshake

from seedance.client import ConnectionClosed, Unauthorized, connect
from seedance.config import ConfigError
from seedance.config_loader import load_access, load_config
from seedance.server.tls import ServerTls, TlsFiles, server_context
from seedance.tenants.auth import Authenticator, ClientCertificate
from seedance.tenants.keys import add_key
from tests.support.certs import Authority, Issued
from tests.support.servers import (
    SEEDANCE,
    RunningServer,
    ServerProcess,
    one_process_only,
    serve_fails,
)
from tests.support.waits import eventually
from tests.support.ws import raw_connect, recv_json, wait_closed

CHAT = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Pki:
    """A CA, the server's certificate, two client certificates of that CA and one of another."""

    def __init__(self, directory: Path) -> None:
        self.ca = Authority(directory)
        self.server = self.ca.server("server")
        self.desk = self.ca.client("desk-1", "desk-1")  # listed by tenant acme
        self.stranger = self.ca.client("desk-9", "desk-9")  # valid, listed by nobody
        self.forged = Authority(directory, "Other CA").client("forged", "desk-1")

    def client(self, cert: Issued | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca.pem))
        if cert is not None:
            context.load_cert_chain(cert.cert, cert.key)
        return context


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def tls_server(
    make_server: Callable[..., RunningServer], pki: Pki, **fields: Any
) -> tuple[RunningServer, str, str]:
    """A TLS server; its wss:// and https:// base URLs."""
    server = make_server(tls_cert=str(pki.server.cert), tls_key=str(pki.server.key), **fields)
    return server, f"wss://127.0.0.1:{server.port}", f"https://127.0.0.1:{server.port}"


async def handshake(port: int, context: ssl.SSLContext) -> dict[str, Any]:
    """A TLS handshake with the server: its certificate and the cipher agreed."""
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="localhost"
    )
    try:
        cert = writer.get_extra_info("peercert")
        cipher = writer.get_extra_info("cipher")
        subject = dict(pair for rdn in cert["subject"] for pair in rdn)
        return {
            "cn": subject["commonName"],
            "serial": int(cert["serialNumber"], 16),
            "cipher": cipher,
        }
    finally:
        writer.close()


# --------------------------------------------------------------------------- serving


@one_process_only("reads the server's log records in the test's process")
async def test_wss_and_https_are_served_on_one_port(
    make_server: Callable[..., RunningServer], pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "seedance")
    server, wss, https = tls_server(make_server, pki)
    started = next(r.getMessage() for r in caplog.records if "connect to" in r.getMessage())
    assert f"wss://127.0.0.1:{server.port}/v2/infer" in started
    assert f"https://127.0.0.1:{server.port}/healthz" in started

    async with connect(wss, ca_file=str(pki.ca.pem)) as session:
        done = await session.complete("hi", max_tokens=4)
        assert done.finish_reason == "length" and done.text
    async with httpx.AsyncClient(verify=pki.client()) as http:
        assert (await http.get(f"{https}/healthz")).json() == {"status": "ok"}
        reply = await http.post(f"{https}/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["message"]["content"]


@pytest.mark.subprocess
def test_seedance_serve_and_chat_over_tls(pki: Pki) -> None:
    server = ServerProcess("--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key))
    try:
        assert server.url.startswith("wss://"), server.output
        args = ["--url", server.url, "--ca-file", str(pki.ca.pem), "--once", "hi", "--max-tokens"]
        result = subprocess.run(
            [SEEDANCE, "chat", *args, "3"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
        server.signal()
        assert server.wait() in (0, -signal.SIGTERM), server.output  # uvicorn re-raises it
        assert "Traceback" not in server.output
    finally:
        server.stop()


def allow_legacy(context: ssl.SSLContext, maximum: ssl.TLSVersion, ciphers: str) -> None:
    """Allow what OpenSSL's defaults forbid: TLS 1.0 and 1.1, suites without forward secrecy
    or AEAD (security level 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLS 1.0 and 1.1 are deprecated
        context.minimum_version = ssl.TLSVersion.TLSv1
        context.maximum_version = maximum
    context.set_ciphers(f"{ciphers}:@SECLEVEL=0")


async def test_old_versions_and_weak_ciphers_are_refused(
    make_server: Callable[..., RunningServer], pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    server, _, _ = tls_server(make_server, pki)
    caplog.clear()
    # Clients that only offer TLS 1.1 or less, or TLS 1.2 with CBC suites (one without ECDHE).
    tls_11, cbc = pki.client(), pki.client()
    allow_legacy(tls_11, ssl.TLSVersion.TLSv1_1, "ALL")
    allow_legacy(cbc, ssl.TLSVersion.TLSv1_2, "AES128-SHA:ECDHE-ECDSA-AES128-SHA")
    # ... which a server that allows anything accepts,
    anything = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    anything.load_cert_chain(pki.server.cert, pki.server.key)
    allow_legacy(anything, ssl.TLSVersion.TLSv1_3, "ALL")
    lax = await asyncio.start_server(lambda _, writer: writer.close(), "127.0.0.1", 0, ssl=anything)
    async with lax:
        lax_port = lax.sockets[0].getsockname()[1]
        assert (await handshake(lax_port, tls_11))["cipher"][1] in ("TLSv1.0", "TLSv1.1")
        assert (await handshake(lax_port, cbc))["cipher"][0] == "ECDHE-ECDSA-AES128-SHA"
    # ... and Seedance refuses.
    for client in (tls_11, cbc):
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await handshake(server.port, client)
    tls_12 = pki.client()
    tls_12.maximum_version = ssl.TLSVersion.TLSv1_2
    name, version, _ = (await handshake(server.port, tls_12))["cipher"]
    assert version == "TLSv1.2" and name.startswith("ECDHE-") and "GCM" in name
    assert (await handshake(server.port, pki.client()))["cipher"][1] == "TLSv1.3"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no noise


def test_only_forward_secret_aead_suites_are_offered(pki: Pki) -> None:
    context, _ = server_context(TlsFiles(str(pki.server.cert), str(pki.server.key)))
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.options & ssl.OP_NO_COMPRESSION and context.options & ssl.OP_NO_RENEGOTIATION
    assert context.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    for suite in context.get_ciphers():
        assert suite["aead"], suite["name"]
        assert suite["protocol"] == "TLSv1.3" or suite["kea"] == "kx-ecdhe", suite["name"]


async def test_a_plain_connection_to_the_tls_port_fails_and_the_server_serves_on(
    make_server: Callable[..., RunningServer], pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    server, wss, _ = tls_server(make_server, pki)
    caplog.clear()
    with pytest.raises(InvalidHandshake, match="did not receive a valid HTTP response"):
        async with raw_connect(f"ws://127.0.0.1:{server.port}", open_timeout=5):
            pass
    async with connect(wss, ca_file=str(pki.ca.pem)) as session:
        assert (await session.complete("still", max_tokens=2)).finish_reason == "length"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- reloads


def replace(target: Path, source: Path) -> None:
    """Put ``source``'s content at ``target`` in one step, as a deployment would."""
    staged = target.with_suffix(".new")
    staged.write_bytes(source.read_bytes())
    os.replace(staged, target)


async def tls_metrics(https: str, pki: Pki) -> dict[str, float]:
    """The ``seedance_tls_*`` samples of the server's /metrics."""
    async with httpx.AsyncClient(verify=pki.client()) as http:
        text = (await http.get(f"{https}/metrics")).text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("seedance_tls"))
    return {name: float(value) for name, value in samples}


def expiry(issued: Issued) -> float:
    certificate = x509.load_pem_x509_certificate(issued.cert.read_bytes())
    return certificate.not_valid_after_utc.timestamp()


@one_process_only("reads the server's log records in the test's process")
async def test_a_certificate_replaced_on_disk_is_served_without_a_restart(
    make_server: Callable[..., RunningServer], pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "seedance")
    server, wss, https = tls_server(make_server, pki, tls_watch_s=0.05)
    assert (await handshake(server.port, pki.client()))["cn"] == "seedance-test"
    expires = "seedance_tls_certificate_expiry_timestamp_seconds"
    assert (await tls_metrics(https, pki))[expires] == expiry(pki.server)
    async with connect(wss, ca_file=str(pki.ca.pem)) as session:
        renewed = pki.ca.server("renewed", "seedance-renewed")
        replace(pki.server.key, renewed.key)
        replace(pki.server.cert, renewed.cert)

        async def served() -> dict[str, Any]:
            return await handshake(server.port, pki.client())

        seen: dict[str, Any] = {}

        async def poll() -> None:
            while (await served())["serial"] != renewed.serial:  # noqa: ASYNC110 - polls
                await asyncio.sleep(0.02)
            seen.update(await served())

        await asyncio.wait_for(poll(), 10)
        assert seen["cn"] == "seedance-renewed"
        assert any("reloaded: CN=seedance-renewed" in r.getMessage() for r in caplog.records)
        # The connection opened before goes on with the certificate it was made with.
        assert (await session.complete("on", max_tokens=2)).finish_reason == "length"
        metrics = await tls_metrics(https, pki)
        assert metrics[expires] == expiry(renewed)
        assert metrics['seedance_tls_certificate_reloads_total{outcome="loaded"}'] == 1

    # A certificate whose key is not on disk: a warning, and the renewed one stays.
    caplog.clear()
    mismatched = pki.ca.server("mismatched", "seedance-mismatched")
    replace(pki.server.cert, mismatched.cert)

    def warned() -> list[str]:
        tls = [r for r in caplog.records if r.name == "seedance.server.tls"]
        return [r.getMessage() for r in tls if r.levelno == logging.WARNING]

    await eventually(warned, 10, "a warning")
    warning = warned()[0]
    assert "not reloaded" in warning and "the key does not match the certificate" in warning
    assert (await handshake(server.port, pki.client()))["serial"] == renewed.serial
    metrics = await tls_metrics(https, pki)
    assert metrics[expires] == expiry(renewed)
    assert metrics['seedance_tls_certificate_reloads_total{outcome="failed"}'] == 1


def test_a_failed_reload_is_not_retried_until_the_files_change_again(
    pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    tls = ServerTls(TlsFiles(str(pki.server.cert), str(pki.server.key)))
    first = tls.current
    assert not tls.check()  # nothing changed
    pki.server.cert.write_text("-----BEGIN CERTIFICATE-----\nhalf wri")
    assert not tls.check() and not tls.check()
    assert tls.current is first
    warnings_ = [r.getMessage() for r in caplog.records if r.name == "seedance.server.tls"]
    assert len(warnings_) == 1 and "no PEM certificate" in warnings_[0]
    renewed = pki.ca.server("renewed", "seedance-renewed")
    replace(pki.server.key, renewed.key)
    replace(pki.server.cert, renewed.cert)
    assert tls.check() and tls.current is not first
    assert tls.certificate.serial_number == renewed.serial


# --------------------------------------------------------------------------- client certificates


def tenants_file(path: Path) -> tuple[Path, str]:
    """Tenant acme, with a key and the subject of desk-1's certificate."""
    path.write_text('[tenants.acme]\ntls_subjects = ["CN=desk-1,O=Acme Bank"]\n\n')
    return path, add_key(path, "acme").key


def tenant_tls_server(
    make_server: Callable[..., RunningServer], pki: Pki, directory: Path, **fields: Any
) -> tuple[Path, str, str, str]:
    """A TLS server asking for client certificates, on tenant acme's file (which it watches):
    the file, acme's key, the wss:// and https:// base URLs."""
    path, key = tenants_file(directory / "seedance.toml")
    _, wss, https = tls_server(
        make_server,
        pki,
        tls_client_ca=str(pki.ca.pem),
        config_file=str(path),
        access=load_access(path),
        **fields,
    )
    return path, key, wss, https


@one_process_only("reads the server's log records in the test's process")
async def test_a_client_certificate_listed_by_a_tenant_stands_for_it(
    make_server: Callable[..., RunningServer],
    pki: Pki,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "seedance")
    assert pki.desk.subject == "CN=desk-1,O=Acme Bank"
    _, key, wss, https = tenant_tls_server(make_server, pki, tmp_path)
    # Listed: no key needed, over WebSocket and HTTP.
    async with connect(wss, ssl=pki.client(pki.desk)) as session:
        assert (await session.complete("hi", max_tokens=2)).finish_reason == "length"
    opened = [r.getMessage() for r in caplog.records if " open peer=" in r.getMessage()]
    assert "tenant=acme credential=cert:" in opened[-1]
    async with httpx.AsyncClient(verify=pki.client(pki.desk)) as http:
        assert (await http.post(f"{https}/v1/chat/completions", json=CHAT)).status_code == 200

    # Valid but listed by no tenant: a key is still needed.
    async with raw_connect(wss, ssl=pki.client(pki.stranger)) as ws:
        code, frames = await wait_closed(ws)
    assert code == 4401 and frames[0]["error"]["code"] == "unauthorized"
    assert "CN=desk-9,O=Acme Bank" in frames[0]["error"]["message"]
    async with httpx.AsyncClient(verify=pki.client(pki.stranger)) as http:
        url = f"{https}/v1/chat/completions"
        assert (await http.post(url, json=CHAT)).status_code == 401
        headers = {"Authorization": f"Bearer {key}"}
        assert (await http.post(url, json=CHAT, headers=headers)).status_code == 200
    with pytest.raises(Unauthorized):
        async with connect(wss, ssl=pki.client(pki.stranger)):
            pass

    # Another CA's certificate (the same subject): the TLS handshake fails.
    with pytest.raises(ConnectionClosed, match="the WebSocket handshake failed"):
        async with connect(wss, ssl=pki.client(pki.forged), reconnect=None):
            pass
    # And without a certificate, as before: a key.
    async with connect(wss, ca_file=str(pki.ca.pem), api_key=key) as session:
        assert (await session.complete("hi", max_tokens=2)).finish_reason == "length"


async def test_a_subject_taken_from_its_tenant_closes_its_connections(
    make_server: Callable[..., RunningServer], pki: Pki, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    path, key, wss, _ = tenant_tls_server(make_server, pki, tmp_path, audit_file=str(audit))
    async with (
        raw_connect(wss, ssl=pki.client(pki.desk)) as by_certificate,
        raw_connect(wss, f"api_key={key}", ssl=pki.client(pki.desk)) as by_key,
    ):
        assert (await recv_json(by_certificate))["type"] == "session"
        assert (await recv_json(by_key))["type"] == "session"
        # The subject is taken off the tenant (its key stays): the file is reloaded by itself.
        text = path.read_text().replace('tls_subjects = ["CN=desk-1,O=Acme Bank"]', "")
        path.write_text(text)
        code, frames = await asyncio.wait_for(wait_closed(by_certificate), 10)
        assert code == 4401 and frames[0]["error"]["code"] == "unauthorized"
        assert "CN=desk-1,O=Acme Bank no longer stands for tenant acme" in str(frames[0])
        await by_key.send('{"type": "ping", "id": 1}')  # a key counts first: still open
        assert await recv_json(by_key) == {"type": "pong", "id": 1}
    async with raw_connect(wss, ssl=pki.client(pki.desk)) as again:
        code, _ = await wait_closed(again)
    assert code == 4401

    def dropped() -> list[dict[str, Any]]:
        records = [json.loads(line) for line in audit.read_text().splitlines()]
        return [r for r in records if r["kind"] == "subjects_dropped"]

    await eventually(dropped, 5, "the audit record")
    assert dropped()[0]["subjects"] == ["CN=desk-1,O=Acme Bank"]


def test_a_credential_counts_before_a_certificate(tmp_path: Path) -> None:
    path, key = tenants_file(tmp_path / "seedance.toml")
    access = load_access(path)
    assert access is not None
    authenticator = Authenticator(access)
    desk = ClientCertificate("CN=desk-1,O=Acme Bank", "ab" * 32)
    principal = authenticator.authenticate(None, "10.0.0.1", desk)
    assert (principal.name, principal.credential, principal.role) == (
        "acme",
        "cert:" + "ab" * 8,
        "user",
    )
    assert authenticator.authenticate(key, "10.0.0.1", desk).credential == key.split("_")[1]
    with pytest.raises(Unauthorized, match="invalid API key"):
        authenticator.authenticate("sd_00000000_x", "10.0.0.1", desk)
    stranger = ClientCertificate("CN=desk-9,O=Acme Bank", "cd" * 32)
    with pytest.raises(Unauthorized, match="CN=desk-9,O=Acme Bank is no tenant's"):
        authenticator.authenticate(None, "10.0.0.1", stranger)


# --------------------------------------------------------------------------- configuration


def test_tls_settings_are_checked_before_serving(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--tls-cert needs --tls-key"):
        load_config({"tls_cert": str(pki.server.cert)}, {})
    with pytest.raises(ConfigError, match="--tls-client-ca needs --tls-cert"):
        load_config({"tls_client_ca": str(pki.ca.pem)}, {})

    def refused(**files: Any) -> str:
        paths = {"cert": str(pki.server.cert), "key": str(pki.server.key), **files}
        with pytest.raises(ConfigError) as error:
            server_context(TlsFiles(**paths))
        return error.value.message

    missing = tmp_path / "missing.pem"
    assert (
        refused(cert=str(missing))
        == f"--tls-cert: cannot read {missing}: No such file or directory"
    )
    assert (
        refused(cert=str(pki.server.key)) == f"--tls-cert: no PEM certificate in {pki.server.key}"
    )
    assert (
        refused(key=str(pki.server.cert)) == f"--tls-key: {pki.server.cert}: not a PEM private key"
    )
    assert "the key does not match the certificate" in refused(key=str(pki.desk.key))
    key = serialization.load_pem_private_key(pki.server.key.read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encryption = serialization.BestAvailableEncryption(b"secret")
    pem = serialization.Encoding.PEM
    encrypted.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, encryption))
    assert refused(key=str(encrypted)) == f"--tls-key: {encrypted}: it is encrypted"
    assert "--tls-client-ca: no PEM certificate" in refused(client_ca=str(pki.server.key))


@pytest.mark.subprocess
def test_serve_stops_with_one_line_when_the_certificate_cannot_be_read(tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    stderr = serve_fails("--tls-cert", str(missing), "--tls-key", str(missing))
    assert stderr.strip() == (
        f"seedance serve: error: --tls-cert: cannot read {missing}: No such file or directory"
    )
    assert "--tls-cert needs --tls-key" in serve_fails("--tls-cert", str(missing))


def test_a_subject_is_one_tenants_and_written_as_rfc_4514(tmp_path: Path) -> None:
    path = tmp_path / "seedance.toml"
    path.write_text(
        '[tenants.acme]\ntls_subjects = ["CN=desk-1,O=Acme Bank"]\n'
        '[tenants.globex]\ntls_subjects = ["CN=desk-1,O=Acme Bank"]\n'
    )
    with pytest.raises(ConfigError, match="listed by tenants acme and globex"):
        load_access(path)
    path.write_text('[tenants.acme]\ntls_subjects = ["CN=desk-1, O=Acme Bank"]\n')
    with pytest.raises(ConfigError, match=r"tenants\.acme\.tls_subjects: 'CN=desk-1, O=Acme Bank'"):
        load_access(path)
