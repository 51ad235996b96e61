"""Suite 25 of ``make bench``: what lineage and access policies cost a request, no server.

- **The audit log** (a Merkle tree with signed checkpoints, docs/audit.md): its writer driven
  directly with realistic request records, signed by an Ed25519 key: records/s and bytes per
  record with ``fsync = "interval"`` (every record queued at once) and with ``fsync =
  "record"`` (8 requests at a time, each waiting for its record on disk, as 8 concurrent
  replies do).
- **Access decisions** (docs/policy.md): the tenants table's rules in Python against Cedar,
  the default policy and a larger one, each decided by Cedar every time and with decisions
  kept (:mod:`benchmarks.policy_cost`). Goal: a decision by Cedar under 50 µs at p99 (the
  default policy).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks import policy_cost
from benchmarks.harness import fmt, machine_lines
from seedance.observability.audit import AuditLog, AuditSettings
from seedance.observability.audit.kinds import Request

if TYPE_CHECKING:
    from benchmarks.harness import Report

CONCURRENT = 8  # replies waiting for their records at once, with fsync = "record"


def record(index: int) -> Request:
    """A request's record as a server writes it (hashes, timings, a model version)."""
    return Request(
        api="websocket",
        tenant="acme",
        credential="0a1b2c3d",
        request_id=f"req-{index:08d}",
        connection=f"conn-{index // 10:06d}",
        session=f"sess-{index // 10:06d}",
        trace_id=f"{index:032x}",
        model="smollm2-135m",
        model_version="1.2.0",
        engine="llamacpp",
        prompt_tokens=412,
        completion_tokens=96,
        prompt_sha256="ab" * 32,
        completion_sha256="cd" * 32,
        outcome="stop",
        queue_ms=0.4,
        ttft_ms=38.2,
        total_ms=910.5,
    )


def audit_cost(folder: Path, fsync: str, count: int) -> tuple[float, float]:
    """Records/s and bytes per record of ``count`` records written with ``fsync``."""
    path = folder / f"audit-{fsync}.log"
    log = AuditLog(AuditSettings(path=path, fsync=fsync, signing_key=Ed25519PrivateKey.generate()))
    log.start()
    started = time.perf_counter()
    if fsync == "interval":
        for index in range(count):
            log.submit(record(index))
    else:
        for first in range(0, count, CONCURRENT):
            waiting = [log.submit(record(i)) for i in range(first, min(count, first + CONCURRENT))]
            for future in waiting:
                assert future is not None
                future.result(timeout=30)
    log.close()
    elapsed = time.perf_counter() - started
    return count / elapsed, path.stat().st_size / count


def lineage_suite(report: Report) -> None:
    records = 5_000 if report.quick else 20_000
    decisions = 5_000 if report.quick else 20_000
    report.log(f"[25 lineage] the audit log: {records} records, fsync interval and record")
    with tempfile.TemporaryDirectory(prefix="seedance-lineage-") as folder:
        writes = {
            fsync: audit_cost(Path(folder), fsync, records) for fsync in ("interval", "record")
        }
    report.log(f"[25 lineage] access decisions: {decisions} each way")
    decided = policy_cost.measure(decisions)
    by_cedar = decided["cedar-default, each by Cedar"]["p99"]
    report.goals.append(
        (
            "25. An access decision by Cedar (the default policy) under 50 µs at p99",
            f"{fmt(by_cedar, 1)} µs",
            by_cedar < 50,
        )
    )
    report.sections.append(
        "\n".join(
            [
                "## 25. Lineage and access policies: what they cost",
                "",
                "No server: the audit log's writer driven directly (docs/audit.md), and the "
                "access decisions of a generation request (docs/policy.md), in one process.",
                "",
                *machine_lines(),
                "",
                f"The audit log, {records:,} request records, a Merkle tree and Ed25519-signed "
                "checkpoints; with `record`, 8 replies wait for their records at once:",
                "",
                "| fsync | records/s | bytes per record |",
                "|---|---|---|",
                *(
                    f"| `{fsync}` | {fmt(rate, 0)} | {fmt(size, 0)} |"
                    for fsync, (rate, size) in writes.items()
                ),
                "",
                f"Access decisions, {decisions:,} each, one caller (its entities built once); "
                "`each by Cedar`: every decision asked of Cedar, the cost of a caller, model or "
                "context not seen before; `kept`: the server's way, a decision already made "
                "answered from memory:",
                "",
                "| policies | p50 µs | p99 µs | p99.9 µs |",
                "|---|---|---|---|",
                *(
                    f"| {mode} | {fmt(p['p50'], 1)} | {fmt(p['p99'], 1)} | {fmt(p['p99.9'], 1)} |"
                    for mode, p in decided.items()
                ),
                "",
                "```",
                "python -m benchmarks.policy_cost",
                "```",
                "",
            ]
        )
    )
