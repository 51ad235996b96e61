"""The audit log's transparency endpoints. ``GET /v1/lineage/{request_id}`` (a tenant's own
requests, any for an admin): what served a request and its record's inclusion proof under a
checkpoint every trusted witness cosigned. For witnesses and auditors, with no credential
(hashes and signed checkpoints, never a record):

- ``GET /v1/audit/checkpoint``: the latest signed checkpoint (a C2SP note, ``text/plain``)
  with the cosignatures kept for it; ``?cosigned=K``: the latest that K witnesses cosigned
  (503 while there is none);
- ``GET /v1/audit/consistency?old=M[&new=N]``: the consistency proof from the tree of M
  records to the checkpoint of N (the latest by default), as ``seedance audit consistency``;
- ``POST /v1/audit/cosignatures``: a witness gives back a checkpoint it cosigned.

They need ``--audit-file`` and ``--audit-signing-key`` (404 otherwise). See
:mod:`seedance.observability.audit.witness` and docs/audit.md.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from seedance import __version__
from seedance.config import ConfigError
from seedance.keyfiles import load_public
from seedance.observability.audit import note, proofs
from seedance.observability.audit.verify import log_files
from seedance.observability.audit.witness import Cosignatures
from seedance.protocol.errors import InvalidRequest, NotFound, Overloaded
from seedance.server.confidential import build_digest, config_digest
from seedance.server.http_call import authenticate_call

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from seedance.server.state import ServerState


def transparency_routes(state: ServerState) -> list[Route]:
    log = state.audit.log if state.audit is not None else None
    key = log.settings.signing_key if log is not None else None
    witnesses = []
    for path in state.config.audit.witnesses:
        try:
            witnesses.append(load_public(Path(path)))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--audit-witness-key: {exc}") from None

    def served() -> tuple[Path, Ed25519PublicKey, Cosignatures]:
        if log is None or key is None:
            raise NotFound("this server keeps no signed audit log (--audit-signing-key)")
        path = log.settings.path
        return path, key.public_key(), Cosignatures(path, witnesses)

    async def checkpoint(request: Request) -> Response:
        path, public, cosigned = served()
        wanted = _count(request, "cosigned", 0)
        notes = await asyncio.to_thread(proofs.signed_notes, path)
        if not notes:
            raise Overloaded("the audit log has no signed checkpoint yet", retry_after_s=1)
        if wanted:
            text = await asyncio.to_thread(cosigned.latest, notes, public, wanted)
            if text is None:
                raise Overloaded(
                    f"no checkpoint of the audit log carries {wanted} witnesses' cosignatures yet",
                    retry_after_s=5,
                )
        else:
            size = max(notes)
            text = await asyncio.to_thread(cosigned.latest, {size: notes[size]}, public, 0)
        return PlainTextResponse(text)

    async def consistency(request: Request) -> Response:
        path, _, _ = served()
        old = _count(request, "old", None)
        new = _count(request, "new", None) if "new" in request.query_params else None
        try:
            proof = await asyncio.to_thread(proofs.consistency, path, old, new)
        except proofs.ProofError as exc:
            raise InvalidRequest(str(exc)) from None
        return Response(msgspec.json.encode(proof), media_type="application/json")

    async def add_cosignature(request: Request) -> Response:
        path, public, cosigned = served()
        body = (await request.body()).decode(errors="replace")
        notes = await asyncio.to_thread(proofs.signed_notes, path)
        try:
            names = cosigned.add(body, public, notes)
        except ValueError as exc:
            raise InvalidRequest(f"cosignature refused: {exc}") from None
        return Response(msgspec.json.encode({"kept": names}), media_type="application/json")

    async def lineage(request: Request) -> Response:
        """What served a request and the proof that its record is in the log (the tenant's
        own requests, or any for an admin)."""
        path, public, cosigned = served()
        principal = authenticate_call(state.services, request.scope, "lineage")
        request_id = request.path_params["request_id"]
        found = await asyncio.to_thread(_find, path, request_id)
        admin = principal.role == "admin" and not state.access.open
        if found is None or not (admin or found[0].get("tenant") == principal.name):
            raise NotFound(f"no audit record of request {request_id} of yours")
        record, loaded = found
        log = await asyncio.to_thread(proofs.read, path, frozenset({record["seq"]}))
        text = await asyncio.to_thread(cosigned.latest, log.notes, public, len(witnesses))
        if text is None:
            raise Overloaded(
                f"no checkpoint carries the cosignatures of the {len(witnesses)} witnesses yet",
                retry_after_s=5,
            )
        size = note.parse(text)[0].size
        if size <= record["seq"]:
            raise Overloaded(
                f"no cosigned checkpoint covers request {request_id}'s record yet",
                retry_after_s=5,
            )
        proof = await asyncio.to_thread(proofs.prove_in, log, record["seq"], size)
        proof["checkpoint"] = text  # with the witnesses' cosignatures
        body = {
            "request_id": request_id,
            "model": loaded,
            "server": {
                "seedance": __version__,
                "build_sha256": build_digest(),
                "configuration_sha256": config_digest(state.config),
                "measurement": (
                    state.confidential.measurement() if state.confidential is not None else None
                ),
            },
            # How it was admitted: at what priority and QoS, and by which access policies
            # (None: by the tenants table's rules; docs/policy.md).
            "admission": {
                "priority": record.get("priority"),
                "qos": record.get("qos"),
                "slatag": record.get("slatag"),
                "policies": record.get("policies"),
            },
            "proof": proof,
        }
        return Response(msgspec.json.encode(body), media_type="application/json")

    return [
        Route("/v1/lineage/{request_id}", lineage, methods=["GET"]),
        Route("/v1/audit/checkpoint", checkpoint, methods=["GET"]),
        Route("/v1/audit/consistency", consistency, methods=["GET"]),
        Route("/v1/audit/cosignatures", add_cosignature, methods=["POST"]),
    ]


def _find(path: Path, request_id: str) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """The ``request`` record of ``request_id`` in the log, and the ``model`` record that
    loaded the version it names (a registry's: its manifest hash and signer)."""
    found: dict[str, Any] | None = None
    loaded: dict[tuple[Any, Any], dict[str, Any]] = {}
    for file in log_files(path):
        for line in file.read_bytes().splitlines():
            if request_id.encode() not in line and b'"loaded"' not in line:
                continue  # most lines: no need to parse them
            record = msgspec.json.decode(line)
            if record.get("kind") == "model" and record.get("action") == "loaded":
                loaded[(record.get("model"), record.get("version"))] = record
            elif record.get("kind") == "request" and record.get("request_id") == request_id:
                found = record
                break
        if found is not None:
            break
    if found is None:
        return None
    model = loaded.get((found.get("model"), found.get("model_version")))
    return found, None if model is None else {
        "name": model["model"],
        "version": model["version"],
        "manifest_sha256": model.get("manifest_sha256"),
        "signer": model.get("key"),
        "loaded_seq": model["seq"],
    }


def _count(request: Request, name: str, default: int | None) -> int:
    text = request.query_params.get(name)
    if text is None:
        if default is None:
            raise InvalidRequest(f"{name}: required (a number of records)")
        return default
    if not text.isdigit():
        raise InvalidRequest(f"{name}: a number of records, got {text!r}")
    return int(text)
