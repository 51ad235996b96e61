"""The audit log: what it records, and that every kind of tampering is found."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from seedance.config_loader import load_access
from seedance.keyfiles import load_public
from seedance.observability.audit import AuditLog, AuditSettings
from seedance.observability.audit.kinds import Request
from seedance.observability.audit.merkle import Frontier, leaf_hash
from seedance.observability.audit.records import digest, entry
from seedance.observability.audit.verify import verify
from seedance.tenants.keys import add_key
from tests.support.servers import (
    SEEDANCE,
    RunningServer,
    ServerProcess,
    serve_fails,
)
from tests.support.ws import generate, open_session, raw_connect, tokens_text, wait_closed


def request_record(request_id: str) -> Request:
    return Request(
        api="http", tenant="t", credential="k", request_id=request_id, model="m", outcome="stop"
    )


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def signing_key(tmp_path: Path) -> Path:
    path = tmp_path / "audit-key.pem"
    path.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def run_verify(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SEEDANCE, "audit", "verify", str(path), *args], capture_output=True, text=True
    )


# --------------------------------------------------------------------------- what is recorded


async def test_requests_connections_refusals_and_admin_actions_are_recorded(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    config = tmp_path / "seedance.toml"
    user = add_key(config, "acme")
    admin = add_key(config, "ops", role="admin").key
    log = tmp_path / "audit.log"
    key = signing_key(tmp_path)
    server = make_server(
        config_file=str(config),
        access=load_access(config),
        audit_file=str(log),
        audit_signing_key=str(key),
    )
    headers = {"Authorization": f"Bearer {user.key}"}
    ws, _ = await open_session(server.url, "session_id=s1", additional_headers=headers)
    async with ws:
        frames = await generate(ws, prompt="the secret plan", max_tokens=5)
    async with raw_connect(server.url) as bad:  # no credential
        await wait_closed(bad)
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        body = {"model": "synthetic", "messages": [{"role": "user", "content": "hello"}]}
        reply = await client.post("/v1/chat/completions", json=body, headers=headers)
        await client.post(
            f"/admin/keys/{user.id}/revoke", headers={"Authorization": f"Bearer {admin}"}
        )
    server.stop()  # seals the log

    verdict = verify(log, load_public(key))
    assert verdict.ok and "sealed" in verdict.message and "signature(s) verified" in verdict.message
    text = log.read_text()
    assert "the secret plan" not in text and user.key not in text  # hashes, never text
    kinds = [r["kind"] for r in records(log)]
    assert kinds[0] == "start" and kinds[-1] == "seal"
    ws_request = next(r for r in records(log) if r["kind"] == "request" and r["api"] == "websocket")
    done = frames[-1]
    assert ws_request["tenant"] == "acme" and ws_request["credential"] == user.id
    assert ws_request["session"] == "s1" and ws_request["request_id"] == done["request_id"]
    assert ws_request["trace_id"] == done["trace_id"] and ws_request["outcome"] == "length"
    assert ws_request["prompt_tokens"] == frames[0]["prompt_tokens"]
    assert ws_request["completion_tokens"] == 5
    reply_text = tokens_text(frames)
    assert ws_request["completion_sha256"] == hashlib.sha256(reply_text.encode()).hexdigest()
    messages = [{"content": "the secret plan", "role": "user"}]
    prompt_json = json.dumps(messages, separators=(",", ":"), sort_keys=True)
    assert ws_request["prompt_sha256"] == hashlib.sha256(prompt_json.encode()).hexdigest()
    assert ws_request["model"] == "synthetic" and ws_request["total_ms"] > 0
    http = next(r for r in records(log) if r["kind"] == "request" and r["api"] == "http")
    assert http["request_id"] == reply.json()["id"] and http["outcome"] == "length"
    connection = next(r for r in records(log) if r["kind"] == "connection")
    assert connection["close_code"] == 1000 and connection["requests"] == 1
    refused = next(r for r in records(log) if r["kind"] == "refused")
    assert refused["outcome"] == "unauthorized" and refused["api"] == "websocket"
    action = next(r for r in records(log) if r["kind"] == "admin")
    assert action["action"] == "revoke_key" and action["key"] == user.id
    assert action["actor_credential"] == admin.split("_")[1]


# --------------------------------------------------------------------------- tampering


@pytest.fixture
def sealed_log(tmp_path: Path) -> tuple[Path, Path]:
    """A sealed, signed log of 20 request records (and its key)."""
    key = signing_key(tmp_path)
    from seedance.keyfiles import load_private

    log = AuditLog(
        AuditSettings(
            path=tmp_path / "audit.log",
            signing_key=load_private(key),
            checkpoint_records=5,
        )
    )
    log.start()
    for i in range(20):
        log.submit(request_record(f"r{i}"))
    log.close()
    return tmp_path / "audit.log", key


def rewrite(path: Path, change: Callable[[list[str]], list[str]]) -> None:
    lines = path.read_text().splitlines()
    path.write_text("\n".join(change(lines)) + "\n")


@pytest.mark.subprocess
def test_an_untouched_log_verifies(sealed_log: tuple[Path, Path]) -> None:
    log, key = sealed_log
    result = run_verify(log, "--public-key", str(key))
    assert result.returncode == 0 and result.stdout.startswith("ok: ")
    count = len(log.read_text().splitlines())
    assert f"{count} records in 1 file(s)" in result.stdout


@pytest.mark.subprocess
def test_an_edited_record_is_found(sealed_log: tuple[Path, Path]) -> None:
    log, _ = sealed_log

    def edit(lines: list[str]) -> list[str]:
        lines[5] = lines[5].replace('"outcome":"stop"', '"outcome":"length"')
        return lines

    rewrite(log, edit)
    result = run_verify(log)
    assert result.returncode == 1 and "audit.log:6: seq 5 was altered" in result.stdout


def test_a_removed_record_is_found(sealed_log: tuple[Path, Path]) -> None:
    log, _ = sealed_log
    rewrite(log, lambda lines: lines[:7] + lines[8:])
    verdict = verify(log)
    assert not verdict.ok and verdict.message == "audit.log:8: records seq 7 are missing"


def test_a_reordered_pair_is_found(sealed_log: tuple[Path, Path]) -> None:
    log, _ = sealed_log
    rewrite(log, lambda lines: [*lines[:3], lines[4], lines[3], *lines[5:]])
    verdict = verify(log)
    assert verdict.message == "audit.log:4: seq 4 comes before seq 3: records are out of order"
    rewrite(log, lambda lines: [*lines[:3], lines[4], lines[3], *lines[5:]])  # put back
    assert verify(log).ok


def test_a_truncated_tail_is_found(sealed_log: tuple[Path, Path]) -> None:
    log, _ = sealed_log
    data = log.read_bytes()
    log.write_bytes(data[:-30])  # inside the seal
    assert "cut off" in verify(log).message
    rewrite(log, lambda lines: lines[:-3])  # whole records gone from the end
    verdict = verify(log)
    assert not verdict.ok and "without a seal" in verdict.message


def rechain(records: list[dict[str, Any]], start: int) -> None:
    """What a rewriter without the key can do after editing ``records[start]``: recompute
    every hash from there on, and each checkpoint's Merkle root (not its signed note)."""
    tree = Frontier()
    for record in records[:start]:
        tree.append(leaf_hash(entry(record)))
    prev = records[start - 1]["hash"]
    for record in records[start:]:
        record["prev"] = prev
        if "root" in record:
            record["root"] = tree.root().hex()
        record["hash"] = digest(record)
        prev = record["hash"]
        tree.append(leaf_hash(entry(record)))


def test_a_rewritten_chain_fails_its_signatures(sealed_log: tuple[Path, Path]) -> None:
    log, key = sealed_log
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    lines[2]["outcome"] = "forged"
    rechain(lines, 2)  # the chain and the roots are consistent again
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert verify(log).ok  # without the key, a consistent rewrite passes the chain check
    verdict = verify(log, load_public(key))
    assert not verdict.ok and "bad signature" in verdict.message


def write_records(
    settings: AuditSettings, count: int, pause_s: float = 0.0, prefix: str = ""
) -> None:
    """``count`` records, each on disk before the next, then a clean close."""
    log = AuditLog(settings)
    log.start()
    for i in range(count):
        written = log.submit(request_record(f"{prefix}r{i}"))
        assert written is not None
        written.result(timeout=5)
        time.sleep(pause_s)
    log.close()


def test_rotation_keeps_one_chain(tmp_path: Path) -> None:
    write_records(AuditSettings(path=tmp_path / "audit.log", rotate_bytes=1500), 40)
    files = sorted(tmp_path.glob("audit.log*"))
    assert len(files) >= 3
    verdict = verify(tmp_path / "audit.log")
    assert verdict.ok and f"in {len(files)} file(s)" in verdict.message
    middle = [f for f in files if f.name != "audit.log"][1]
    middle.unlink()
    assert "missing" in verify(tmp_path / "audit.log").message


def test_processes_sharing_a_log_keep_one_chain_across_rotations(tmp_path: Path) -> None:
    # Three writers (as three workers' would be: each its own descriptors, so the lock file
    # excludes them from each other) append at once while the file rotates by size.
    settings = AuditSettings(path=tmp_path / "audit.log", rotate_bytes=4000, shared=True)
    writers = [
        threading.Thread(target=write_records, args=(settings, 40), kwargs={"prefix": f"w{n}-"})
        for n in range(3)
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    files = [f for f in tmp_path.glob("audit.log*")]
    assert len(files) >= 4
    verdict = verify(tmp_path / "audit.log")
    assert verdict.ok and verdict.message.endswith("sealed"), verdict.message
    assert "Merkle root(s) recomputed" in verdict.message  # one tree across writers and files
    written = [r for f in files for r in records(f) if r["kind"] == "request"]
    assert sorted(r["request_id"] for r in written) == sorted(
        f"w{n}-r{i}" for n in range(3) for i in range(40)
    )


# --------------------------------------------------------------------------- durability


@pytest.mark.subprocess
def test_no_acknowledged_record_is_lost_on_sigkill(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    from websockets.sync.client import connect

    log = tmp_path / "audit.log"
    proc = server_process("--audit-file", str(log), "--audit-fsync", "record")
    acknowledged = []
    with connect(f"{proc.url}/v2/infer") as ws:
        ws.recv()
        for i in range(12):
            ws.send(json.dumps({"prompt": f"p{i}", "max_tokens": 3}))
            while True:
                frame = json.loads(ws.recv(timeout=10))
                if frame["type"] == "done":
                    acknowledged.append(frame["request_id"])
                    break
        proc.signal(signal.SIGKILL)
    proc.wait()
    written = {r["request_id"] for r in records(log) if r["kind"] == "request"}
    assert set(acknowledged) <= written
    assert not verify(log).ok  # killed: no seal ...
    assert verify(log, allow_unsealed=True).ok  # ... but every record chained

    # A restart continues the chain, noting the unsealed end; a clean stop seals it.
    again = server_process("--audit-file", str(log))
    again.signal(signal.SIGTERM)
    again.wait()
    starts = [r for r in records(log) if r["kind"] == "start"]
    assert starts[-1]["previous_end"] == "unsealed"
    assert verify(log).ok


@pytest.mark.subprocess
def test_every_acknowledged_record_is_signed_before_a_sigkill(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    # A signed checkpoint ends every group commit, before the done frame goes out: after a
    # kill -9, an acknowledged record cannot be edited and re-hashed unseen.
    from websockets.sync.client import connect

    log, key = tmp_path / "audit.log", signing_key(tmp_path)
    proc = server_process("--audit-file", str(log), "--audit-signing-key", str(key))
    with connect(f"{proc.url}/v2/infer") as ws:
        ws.recv()
        for i in range(5):
            ws.send(json.dumps({"prompt": f"p{i}", "max_tokens": 3, "request_id": f"r{i}"}))
            while json.loads(ws.recv(timeout=10))["type"] != "done":
                pass
        proc.signal(signal.SIGKILL)
    proc.wait()
    public = load_public(key)
    verdict = verify(log, public, allow_unsealed=True)
    assert verdict.ok and "after the last signature" not in verdict.message
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[-1]["kind"] == "checkpoint"
    last = max(i for i, r in enumerate(lines) if r.get("request_id") == "r4")
    lines[last]["outcome"] = "forged"
    rechain(lines, last)  # a consistent rewrite of the tail
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    verdict = verify(log, public, allow_unsealed=True)
    assert not verdict.ok and "bad signature" in verdict.message
    # Removing the signatures at the end leaves records no signature vouches for: said so.
    log.write_text("".join(json.dumps(r) + "\n" for r in lines[: last + 1]))
    verdict = verify(log, public, allow_unsealed=True)
    assert "come after the last signature" in verdict.message


@pytest.mark.subprocess
def test_an_empty_log_holds_no_record(tmp_path: Path) -> None:
    (tmp_path / "audit.log").write_bytes(b"")
    verdict = verify(tmp_path / "audit.log", allow_unsealed=True)
    assert (
        not verdict.ok and verdict.message == "audit.log: the log holds no record (an empty file)"
    )
    assert "seq -1" not in run_verify(tmp_path / "audit.log").stdout


@pytest.mark.subprocess
def test_a_log_whose_last_line_is_not_a_record_stops_the_server_with_one_line(
    tmp_path: Path,
) -> None:
    log = tmp_path / "audit.log"
    write_records(AuditSettings(path=log), 3)
    with log.open("ab") as fh:
        fh.write(b"this line was typed in by someone\n")
    output = serve_fails("--engine", "synthetic", "--audit-file", str(log))
    assert "its last line is not an audit record" in output
    assert "move it aside" in output and "Traceback" not in output


# --------------------------------------------------------------------------- failures


async def test_an_unwritable_log_refuses_requests(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server(audit_file="/dev/full")  # every write: no space left on device
    async with httpx.AsyncClient(base_url=server.http_url) as client:
        health = await client.get("/healthz")
        assert health.status_code == 503 and "audit log /dev/full" in health.json()["detail"]
        body = {"model": "synthetic", "messages": [{"role": "user", "content": "x"}]}
        reply = await client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 503 and "audit log" in reply.text
    ws, _ = await open_session(server.url)
    async with ws:
        frames = await generate(ws, prompt="x", max_tokens=2)
    assert frames[-1]["error"]["code"] == "overloaded" and "audit" in frames[-1]["error"]["message"]


async def test_an_optional_log_does_not_stop_requests(
    make_server: Callable[..., RunningServer],
) -> None:
    server = make_server(audit_file="/dev/full", audit_required=False)
    ws, _ = await open_session(server.url)
    async with ws:
        frames = await generate(ws, prompt="x", max_tokens=2)
    assert frames[-1]["type"] == "done"


async def test_interval_fsync(tmp_path: Path, make_server: Callable[..., RunningServer]) -> None:
    log = tmp_path / "audit.log"
    server = make_server(audit_file=str(log), audit_fsync="interval")
    ws, _ = await open_session(server.url)
    async with ws:
        for _ in range(3):
            await generate(ws, prompt="x", max_tokens=2)
    server.stop()
    assert sum(r["kind"] == "request" for r in records(log)) == 3
    assert verify(log).ok


@pytest.mark.slow
def test_rotation_by_age(tmp_path: Path) -> None:
    write_records(AuditSettings(path=tmp_path / "audit.log", rotate_interval_s=0.3), 3, 0.4)
    assert len(list(tmp_path.glob("audit.log.*"))) >= 2
    assert verify(tmp_path / "audit.log").ok
