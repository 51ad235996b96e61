"""The audit log as an RFC 9162 Merkle tree: its roots and proofs checked by an implementation
written here from the RFC's definitions (recursive, where Seedance's verifier is the RFC's
iterative algorithm), its checkpoints as C2SP signed notes checked with ``cryptography``
alone, and a rewritten or forked log caught."""

from __future__ import annotations

import base64
import hashlib
import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from seedance.keyfiles import load_private, load_public
from seedance.observability.audit import AuditSettings
from seedance.observability.audit.merkle import (
    Frontier,
    Tree,
    leaf_hash,
    verify_consistency,
    verify_inclusion,
)
from seedance.observability.audit.verify import verify
from tests.support.servers import SEEDANCE, RunningServer, ServerProcess
from tests.test_audit import signing_key, write_records

# --------------------------------------------------------------------------- RFC 9162, here


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def split(n: int) -> int:
    k = 1
    while 2 * k < n:
        k *= 2
    return k


def mth(entries: list[bytes]) -> bytes:
    """RFC 9162 2.1.1: the Merkle Tree Hash of a list of entries."""
    if not entries:
        return sha256(b"")
    if len(entries) == 1:
        return sha256(b"\x00" + entries[0])
    k = split(len(entries))
    return sha256(b"\x01" + mth(entries[:k]) + mth(entries[k:]))


def root_from_path(m: int, n: int, leaf: bytes, path: list[bytes]) -> bytes:
    """The root an inclusion path gives, by PATH(m, D[n])'s recursion (2.1.3.1) run
    backwards: its last hash is the sibling of the top split."""
    if n == 1:
        assert not path
        return leaf
    k = split(n)
    if m < k:
        return sha256(b"\x01" + root_from_path(m, k, leaf, path[:-1]) + path[-1])
    return sha256(b"\x01" + path[-1] + root_from_path(m - k, n - k, leaf, path[:-1]))


def roots_from_proof(m: int, n: int, proof: list[bytes], old: bytes) -> tuple[bytes, bytes]:
    """The (old, new) roots a consistency proof gives, by SUBPROOF's recursion (2.1.4.1):
    ``old`` is the old root, which the proof leaves out when the old tree is a whole
    subtree."""

    def walk(m: int, n: int, proof: list[bytes], whole: bool) -> tuple[bytes, bytes]:
        if m == n:
            node = old if whole else proof[0]
            assert len(proof) == (0 if whole else 1)
            return node, node
        k = split(n)
        sibling = proof[-1]
        if m <= k:
            first, second = walk(m, k, proof[:-1], whole)
            return first, sha256(b"\x01" + second + sibling)
        first, second = walk(m - k, n - k, proof[:-1], False)
        return sha256(b"\x01" + sibling + first), sha256(b"\x01" + sibling + second)

    return walk(m, n, proof, True)


def note_checkpoint(
    text: str, key: Ed25519PublicKey, name: str | None = None
) -> tuple[str, int, bytes]:
    """c2sp.org/signed-note by hand: the origin, size and root of a checkpoint whose
    signature by ``name`` (its origin by default) verifies with ``key`` (``cryptography``
    raises otherwise)."""
    body, _, signatures = text.partition("\n\n")
    origin, size, root = body.split("\n")[:3]
    name = name or origin
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    key_hash = sha256(name.encode() + b"\n\x01" + raw)[:4]
    line = next(s for s in signatures.splitlines() if s.startswith(f"\u2014 {name} "))
    blob = base64.b64decode(line.rsplit(" ", 1)[1])
    assert blob[:4] == key_hash
    key.verify(blob[4:], (body + "\n").encode())
    return origin, int(size), base64.b64decode(root)


def entry(record: dict[str, Any]) -> bytes:
    """A record as the leaf holds it: JSON, keys sorted, no spaces (docs/audit.md)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# --------------------------------------------------------------------------- the tree


def test_the_tree_its_proofs_and_their_checks_agree_with_the_rfc() -> None:
    entries = [f"record {i}".encode() for i in range(70)]
    leaves = [leaf_hash(e) for e in entries]
    for n in range(1, len(entries) + 1):
        tree, frontier = Tree(leaves[:n]), Frontier()
        for leaf in leaves[:n]:
            frontier.append(leaf)
        root = mth(entries[:n])
        assert tree.root() == frontier.root() == root
        for m in range(n):
            path = tree.inclusion(m, n)
            assert root_from_path(m, n, leaves[m], path) == root
            assert verify_inclusion(leaves[m], m, n, path, root)
            assert not verify_inclusion(leaves[m - 1 if m else 1 % n], m, n, path, root) or n == 1
        for m in range(1, n + 1):
            proof = tree.consistency(m, n)
            assert roots_from_proof(m, n, proof, mth(entries[:m])) == (mth(entries[:m]), root)
            assert verify_consistency(m, n, proof, mth(entries[:m]), root)
            if m < n:  # a fork: the old tree's last entry different
                forked = mth([*entries[: m - 1], b"forged"])
                assert not verify_consistency(m, n, proof, forked, root)
        # From a frontier (a rotated-to file), the same proofs of its records.
        base = Frontier()
        for leaf in leaves[: n // 2]:
            base.append(leaf)
        later = Tree(leaves[n // 2 : n], base)
        assert later.root() == root
        assert all(later.inclusion(m, n) == tree.inclusion(m, n) for m in range(n // 2, n))


# --------------------------------------------------------------------------- a server's log


def audit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SEEDANCE, "audit", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.subprocess
def test_a_servers_records_are_proven_in_its_signed_checkpoints_across_files_and_restarts(
    tmp_path: Path, server_process: Callable[..., ServerProcess]
) -> None:
    log, key = tmp_path / "audit.log", signing_key(tmp_path)
    public = load_public(key)
    flags = ("--audit-file", str(log), "--audit-signing-key", str(key))
    for run in range(2):  # the tree goes on after a restart
        proc = server_process(*flags, "--audit-rotate-bytes", "4000")
        http_url = proc.url.replace("ws://", "http://")
        for i in range(6):
            body = {"model": "synthetic", "messages": [{"role": "user", "content": f"{run} {i}"}]}
            answer = httpx.post(f"{http_url}/v1/chat/completions", json=body, timeout=10)
            assert answer.status_code == 200
        proc.signal(signal.SIGTERM)  # sealed, then started again
        assert proc.wait() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    assert len(list(tmp_path.glob("audit.log.*"))) >= 2  # rotated
    verdict = verify(log, public)
    assert verdict.ok and "Merkle root(s) recomputed" in verdict.message, verdict.message
    records = [json.loads(line) for f in sorted(tmp_path.glob("audit.log*")) for line in f.open()]
    records.sort(key=lambda r: r["seq"])

    # Every checkpoint's note states the tree of the records before it.
    checkpoints = [r for r in records if "note" in r]
    assert len(checkpoints) >= 4
    for checkpoint in checkpoints:
        origin, size, root = note_checkpoint(checkpoint["note"], public)
        assert size == checkpoint["seq"] and root == mth([entry(r) for r in records[:size]])
        assert root.hex() == checkpoint["root"] and origin.startswith("seedance/audit/")

    # An inclusion proof of each request, checked here and by seedance audit verify.
    for record in (r for r in records if r["kind"] == "request"):
        made = audit("prove", str(log), str(record["seq"]))
        assert made.returncode == 0, made.stderr
        proof = json.loads(made.stdout)
        _, size, root = note_checkpoint(proof["checkpoint"], public)
        assert proof["record"] == record and size > record["seq"]
        leaf = sha256(b"\x00" + entry(proof["record"]))
        path = [base64.b64decode(h) for h in proof["path"]]
        assert root_from_path(record["seq"], size, leaf, path) == root
    proof_file = tmp_path / "proof.json"
    proof_file.write_text(made.stdout)
    checked = audit("verify", str(proof_file), "--public-key", f"{key}")
    assert checked.returncode == 0 and checked.stdout.startswith("ok: record"), checked

    # A consistency proof from the first signed checkpoint to the last.
    first, last = checkpoints[0], checkpoints[-1]
    made = audit("consistency", str(log), str(first["seq"]))
    assert made.returncode == 0, made.stderr
    proof = json.loads(made.stdout)
    _, m, old = note_checkpoint(proof["old"], public)
    _, n, new = note_checkpoint(proof["new"], public)
    assert (m, n) == (first["seq"], last["seq"])
    path = [base64.b64decode(h) for h in proof["path"]]
    assert roots_from_proof(m, n, path, old) == (old, new)
    proof_file.write_text(made.stdout)
    assert audit("verify", str(proof_file), "--public-key", str(key)).returncode == 0


def test_a_forked_log_fails_the_consistency_proof_against_a_checkpoint_seen_before(
    tmp_path: Path,
) -> None:
    # The operator shows an auditor a checkpoint, then rewrites history from before it and
    # goes on: the new log's consistency proof from the auditor's checkpoint does not hold.
    key = signing_key(tmp_path)
    settings = AuditSettings(
        path=tmp_path / "audit.log", signing_key=load_private(key), checkpoint_records=4
    )
    write_records(settings, 10)
    records = [json.loads(line) for line in settings.path.open()]
    seen = next(r for r in records if "note" in r and r["seq"] >= 8)  # the auditor's

    # The rewrite: the history up to a request before that checkpoint, then new records.
    fork = next(i for i, r in enumerate(records) if r.get("request_id") == "r3")
    settings.path.write_text("".join(json.dumps(r) + "\n" for r in records[:fork]))
    write_records(settings, 10, prefix="forged")
    assert verify(settings.path, load_public(key)).ok  # the fork alone is a valid log

    made = audit("consistency", str(settings.path), str(seen["seq"]))
    assert made.returncode == 0, made.stderr
    proof = json.loads(made.stdout)
    assert proof["old"] != seen["note"]  # the fork has no such checkpoint, or another
    proof["old"] = seen["note"]  # the auditor checks against what it was shown
    (tmp_path / "proof.json").write_text(json.dumps(proof))
    checked = audit("verify", str(tmp_path / "proof.json"), "--public-key", str(key))
    assert checked.returncode == 1 and "(a fork)" in checked.stdout, checked


def test_a_tampered_proof_or_an_unknown_key_is_refused(tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    key, other = signing_key(tmp_path), signing_key(tmp_path / "other")
    settings = AuditSettings(path=tmp_path / "audit.log", signing_key=load_private(key))
    write_records(settings, 5)
    made = audit("prove", str(settings.path), "1")
    proof = json.loads(made.stdout)
    for change, words in (
        (lambda p: p["record"].update(outcome="forged"), "is not in the tree"),
        (lambda p: p.update(index=2), "sizes do not match"),
        (lambda p: p.update(checkpoint=p["checkpoint"].replace("\n", "\n1", 1)), "signature"),
    ):
        changed = json.loads(made.stdout)
        change(changed)
        (tmp_path / "p.json").write_text(json.dumps(changed))
        checked = audit("verify", str(tmp_path / "p.json"), "--public-key", str(key))
        assert checked.returncode == 1 and words in checked.stdout, (words, checked)
    (tmp_path / "p.json").write_text(json.dumps(proof))
    checked = audit("verify", str(tmp_path / "p.json"), "--public-key", str(other))
    assert checked.returncode == 1 and "no signature by" in checked.stdout
    missing = audit("prove", str(settings.path), "99")
    assert missing.returncode == 1 and "no record 99" in missing.stderr


async def test_every_openai_reply_names_its_audit_record(
    tmp_path: Path, make_server: Callable[..., RunningServer]
) -> None:
    """The index of a reply's audit record (GET /v1/lineage/{id} proves it), as the unchanged
    openai SDK hands it over: a streamed chat's last chunk, a response, a Realtime
    response.done; each the index of that request's record in the log."""
    from tests.test_realtime import clients, until_done, user

    log = tmp_path / "audit.jsonl"
    server = make_server(audit_file=str(log))
    ga, _ = clients(server)
    seqs: dict[str, int] = {}
    stream = await ga.chat.completions.create(
        model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert all((c.model_extra or {}).get("audit_seq") is None for c in chunks[:-1])
    seqs[chunks[-1].id] = chunks[-1].model_extra["audit_seq"]  # type: ignore[index]
    response = await ga.responses.create(model="synthetic", input="hi", max_output_tokens=3)
    seqs[response.id] = response.model_extra["audit_seq"]  # type: ignore[index]
    async with ga.realtime.connect(model="synthetic") as connection:
        await connection.conversation.item.create(item=user("hi"))  # type: ignore[arg-type]
        await connection.response.create(response={"max_output_tokens": 3})  # type: ignore[arg-type]
        done = await until_done(connection)
    seqs[done.id] = done.model_extra["audit_seq"]
    server.stop()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    by_seq = {r["seq"]: r for r in records}
    assert len(set(seqs.values())) == 3
    for reply, seq in seqs.items():
        assert by_seq[seq]["kind"] == "request" and by_seq[seq]["outcome"] == "length", reply
