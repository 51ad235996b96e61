"""Witnesses of the audit log (``seedance audit witness``, a process of its own with its own
key) against real servers: they cosign what extends what they cosigned, and a history
rewritten, or shown differently to two of them, is refused and reported."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from seedance.keyfiles import load_public
from seedance.tenants.keys import add_key
from tests.support.servers import SEEDANCE, ServerProcess
from tests.test_audit import signing_key
from tests.test_audit_tree import entry, note_checkpoint, root_from_path, sha256

pytestmark = pytest.mark.subprocess


class Witness:
    def __init__(self, folder: Path, name: str) -> None:
        folder.mkdir()
        self.key, self.name, self.state = signing_key(folder), name, folder / "state"

    def round(self, server: ServerProcess, log_key: Path) -> subprocess.CompletedProcess[str]:
        argv = [SEEDANCE, "audit", "witness", http(server), "--log-key", str(log_key)]
        argv += ["--key", str(self.key), "--name", self.name, "--state", str(self.state)]
        return subprocess.run([*argv, "--once"], capture_output=True, text=True, timeout=60)

    def cosigned(self) -> int:
        return int(json.loads((self.state / "state.json").read_text())["size"])


def http(server: ServerProcess) -> str:
    return server.url.replace("ws://", "http://")


def requests(server: ServerProcess, n: int, words: str) -> None:
    for i in range(n):
        body = {"model": "synthetic", "messages": [{"role": "user", "content": f"{words} {i}"}]}
        assert httpx.post(f"{http(server)}/v1/chat/completions", json=body).status_code == 200


def start(
    server_process: Callable[..., ServerProcess], log: Path, key: Path, *witnesses: Witness
) -> ServerProcess:
    trusted = ",".join(str(w.key) for w in witnesses)  # the private key's file: its public half
    return server_process(
        *("--audit-file", str(log), "--audit-signing-key", str(key)),
        *("--audit-witness-key", trusted),
    )


def stop(server: ServerProcess) -> None:
    server.signal(signal.SIGTERM)
    assert server.wait() in (0, -signal.SIGTERM)


def test_witnesses_cosign_a_growing_log_and_catch_a_rewrite(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    log, key = tmp_path / "audit.log", signing_key(tmp_path)
    one, two = (
        Witness(tmp_path / "w1", "witness.test/1"),
        Witness(tmp_path / "w2", "witness.test/2"),
    )
    server = start(server_process, log, key, one, two)
    for words in ("first", "second", "third"):
        requests(server, 3, words)
        for witness in (one, two):
            done = witness.round(server, key)
            assert done.returncode == 0 and "cosigned the checkpoint of" in done.stdout, done
    assert one.cosigned() == two.cosigned() > 9
    answer = httpx.get(f"{http(server)}/v1/audit/checkpoint", params={"cosigned": 2})
    assert answer.status_code == 200
    _, size, _ = note_checkpoint(answer.text, load_public(key))
    assert size == one.cosigned()
    for witness in (one, two):  # each cosignature verifies with that witness's key alone
        note_checkpoint(answer.text, load_public(witness.key), witness.name)
    # A cosignature by a key the server does not trust is refused.
    stranger = Witness(tmp_path / "w3", "witness.test/3")
    refused = stranger.round(server, key)
    assert refused.returncode == 0  # it cosigned; the server did not keep it
    assert (
        httpx.get(f"{http(server)}/v1/audit/checkpoint", params={"cosigned": 3}).status_code == 503
    )
    stop(server)

    # The operator rewrites history: the log cut back to its first records, then new ones.
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:4]))
    server = start(server_process, log, key, one, two)
    requests(server, 12, "rewritten")
    before = one.cosigned()
    refused = one.round(server, key)
    assert refused.returncode == 1 and "FORK" in refused.stderr, refused
    assert "does not extend the tree of" in refused.stderr
    assert one.cosigned() == before  # it stays on what it cosigned
    (report,) = (one.state).glob("fork-*.json")
    reported = json.loads(report.read_text())
    assert reported["cosigned"] and reported["shown"] and reported["proof"]["path"]
    assert (
        httpx.get(f"{http(server)}/v1/audit/checkpoint", params={"cosigned": 1}).status_code == 503
    )
    stop(server)


def test_two_witnesses_shown_different_histories_both_refuse_the_other(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    # A split view: one log, then two servers on copies of it that diverge; each witness
    # follows one. Shown the other's history, both refuse, and no checkpoint after the split
    # carries both cosignatures.
    key = signing_key(tmp_path)
    one, two = (
        Witness(tmp_path / "w1", "witness.test/1"),
        Witness(tmp_path / "w2", "witness.test/2"),
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    log_a, log_b = tmp_path / "a" / "audit.log", tmp_path / "b" / "audit.log"
    server = start(server_process, log_a, key, one, two)
    requests(server, 4, "common")
    assert one.round(server, key).returncode == two.round(server, key).returncode == 0
    common = one.cosigned()
    stop(server)
    shutil.copy(log_a, log_b)
    shutil.copy(log_a.with_name(".audit.log.cosigned"), log_b.with_name(".audit.log.cosigned"))

    server_a = start(server_process, log_a, key, one, two)
    server_b = start(server_process, log_b, key, one, two)
    requests(server_a, 4, "told to one")
    requests(server_b, 4, "told to the other")
    assert one.round(server_a, key).returncode == 0
    assert two.round(server_b, key).returncode == 0
    assert one.cosigned() > common and two.cosigned() > common
    for witness, other in ((one, server_b), (two, server_a)):
        refused = witness.round(other, key)
        assert refused.returncode == 1 and "FORK" in refused.stderr, refused
    for server in (server_a, server_b):
        both = httpx.get(f"{http(server)}/v1/audit/checkpoint", params={"cosigned": 2})
        _, size, _ = note_checkpoint(both.text, load_public(key))
        assert size == common  # the last checkpoint both witnesses cosigned: before the split
        stop(server)


def test_a_tenant_gets_its_requests_lineage_with_a_cosigned_proof(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    from websockets.sync.client import connect

    log, key = tmp_path / "audit.log", signing_key(tmp_path)
    witness = Witness(tmp_path / "w1", "witness.test/1")
    config = tmp_path / "seedance.toml"
    acme, other = add_key(config, "acme").key, add_key(config, "globex").key
    server = server_process(
        *("--config", str(config), "--audit-file", str(log), "--audit-signing-key", str(key)),
        *("--audit-witness-key", str(witness.key)),
    )
    headers = {"Authorization": f"Bearer {acme}"}
    with connect(f"{server.url}/v2/infer", additional_headers=headers) as ws:
        ws.recv()
        ws.send(json.dumps({"prompt": "hello", "max_tokens": 3, "request_id": "lin-1"}))
        while (done := json.loads(ws.recv(timeout=10)))["type"] != "done":
            pass
    seq = done["audit_seq"]  # the record's index in the tree, on the done frame
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]}
    chat = httpx.post(f"{http(server)}/v1/chat/completions", json=body, headers=headers)
    assert int(chat.headers["x-seedance-audit-seq"]) > seq  # and on an OpenAI response

    url = f"{http(server)}/v1/lineage/lin-1"
    waiting = httpx.get(url, headers=headers)  # no witness has cosigned a checkpoint yet
    assert waiting.status_code == 503 and "witnesses" in waiting.text
    assert witness.round(server, key).returncode == 0
    assert httpx.get(url, headers={"Authorization": f"Bearer {other}"}).status_code == 404
    answer = httpx.get(url, headers=headers)
    assert answer.status_code == 200, answer.text
    lineage = answer.json()
    proof = lineage["proof"]
    assert proof["index"] == seq and proof["record"]["request_id"] == "lin-1"
    assert proof["record"]["tenant"] == "acme" and lineage["server"]["configuration_sha256"]
    # Admitted at priority 0, no QoS class, by the tenants table's rules (no --policy).
    assert lineage["admission"] == {"priority": 0, "qos": None, "slatag": None, "policies": None}

    # Checked here from the RFC and the note format, and by seedance audit verify-lineage.
    _, size, root = note_checkpoint(proof["checkpoint"], load_public(key))
    note_checkpoint(proof["checkpoint"], load_public(witness.key), witness.name)
    leaf = sha256(b"\x00" + entry(proof["record"]))
    path = [base64.b64decode(h) for h in proof["path"]]
    assert root_from_path(seq, size, leaf, path) == root
    saved = tmp_path / "lineage.json"
    saved.write_text(answer.text)
    argv = [SEEDANCE, "audit", "verify-lineage", str(saved), "--public-key", str(key)]
    checked = subprocess.run(
        [*argv, "--witness-key", str(witness.key)], capture_output=True, text=True
    )
    assert checked.returncode == 0 and "cosigned by 1 witness" in checked.stdout, checked
    lineage["proof"]["record"]["outcome"] = "stop"  # what the client would like it to say
    saved.write_text(json.dumps(lineage))
    forged = subprocess.run(
        [*argv, "--witness-key", str(witness.key)], capture_output=True, text=True
    )
    assert forged.returncode == 1 and "is not in the tree" in forged.stdout, forged
    lineage = answer.json()
    lineage["admission"]["policies"] = ["vip"]  # a decision the record does not hold
    saved.write_text(json.dumps(lineage))
    forged = subprocess.run([*argv], capture_output=True, text=True)
    assert forged.returncode == 1 and "admission (policies) is not the record's" in forged.stdout, (
        forged
    )
    stop(server)


def test_a_server_that_cannot_answer_now_is_asked_again_not_reported_as_a_fork(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    """A 503 (or any 5xx, or 429) where the consistency proof should be is the server's
    trouble, not its lie: the witness cosigns nothing, reports no fork, and cosigns at the next
    round. The answer is made unavailable between the witness and a real server."""
    from seedance.keyfiles import load_private
    from seedance.observability.audit.witness import Witness as Process

    log, key = tmp_path / "audit.log", signing_key(tmp_path)
    one = Witness(tmp_path / "w1", "witness.test/1")
    server = start(server_process, log, key, one)
    unavailable = True

    def relay(request: httpx.Request) -> httpx.Response:
        if unavailable and request.url.path == "/v1/audit/consistency":
            return httpx.Response(503, json={"error": {"code": "overloaded"}})
        with httpx.Client() as client:
            answer = client.send(client.build_request(request.method, request.url,
                                                      content=request.content,
                                                      headers=request.headers))  # fmt: skip
            return httpx.Response(answer.status_code, content=answer.content)

    witness = Process(
        http(server), load_public(key), load_private(one.key), one.name, one.state,
        httpx.Client(transport=httpx.MockTransport(relay)),
    )  # fmt: skip
    requests(server, 3, "first")
    assert "cosigned the checkpoint of" in witness.round()
    first = one.cosigned()
    requests(server, 3, "second")
    with pytest.raises(httpx.HTTPStatusError, match="503"):
        witness.round()
    assert one.cosigned() == first and not list(one.state.glob("fork-*.json"))
    unavailable = False
    assert "cosigned the checkpoint of" in witness.round() and one.cosigned() > first
    stop(server)
