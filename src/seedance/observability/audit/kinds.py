"""Every record of the audit log, one struct per kind (docs/audit.md lists them).

The server builds these and hands them to the writer, which numbers and chains them
(:func:`~seedance.observability.audit.records.seal`). A field that does not apply to a record
is left out of its line (``UNSET``); a field that applies but has no value is ``null``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from seedance.observability.audit.records import utc_now


class AuditRecord(msgspec.Struct, kw_only=True):
    time: str = msgspec.field(default_factory=utc_now)


class Request(AuditRecord, kw_only=True):
    """A request ended (an HTTP call answered without a generation, a response read say:
    only the first fields)."""

    kind: Literal["request"] = "request"
    api: Literal["websocket", "http"]
    tenant: str
    credential: str
    request_id: str
    model: str | None
    outcome: str  # a finish reason, cancelled, aborted, or an error code
    connection: str | UnsetType = UNSET  # websocket only
    session: str | UnsetType = UNSET  # websocket only
    trace_id: str | UnsetType = UNSET
    model_version: str | UnsetType | None = UNSET
    engine: str | UnsetType | None = UNSET
    prompt_tokens: int | UnsetType = UNSET
    completion_tokens: int | UnsetType = UNSET
    prompt_sha256: str | UnsetType | None = UNSET  # of the messages, as canonical JSON
    completion_sha256: str | UnsetType = UNSET
    #: Of the JSON Schema the reply was bound to, as the engine received it (compact JSON).
    schema_sha256: str | UnsetType = UNSET
    #: Calls the reply made, when the request offered tools.
    tool_calls: int | UnsetType = UNSET
    #: The tenant WebAssembly modules it ran through (``name@version``), and why one failed.
    modules: list[str] | UnsetType = UNSET
    module_error: str | UnsetType = UNSET
    #: The Cedar policies that allowed it (``--policy``).
    policies: list[str] | UnsetType = UNSET
    #: Its priority, and the QoS class (and SLA tag) it was admitted with.
    priority: int | UnsetType = UNSET
    qos: str | UnsetType = UNSET
    slatag: str | UnsetType = UNSET
    queue_ms: float | UnsetType | None = UNSET
    ttft_ms: float | UnsetType | None = UNSET
    total_ms: float | UnsetType | None = UNSET


class Connection(AuditRecord, kw_only=True):
    """A WebSocket connection ended."""

    kind: Literal["connection"] = "connection"
    tenant: str
    credential: str
    connection: str
    peer: str
    session: str
    model: str
    duration_ms: float
    close_code: int
    requests: int


class Refused(AuditRecord, kw_only=True):
    """A connection, a request or an API call refused before it started: one shape for every
    API (what was known of it when it was refused; the rest left out)."""

    kind: Literal["refused"] = "refused"
    api: str
    peer: str
    path: str
    tenant: str | None
    credential: str | None
    outcome: str  # the error code
    message: str
    request_id: str | UnsetType = UNSET
    model: str | UnsetType = UNSET
    connection: str | UnsetType = UNSET
    session: str | UnsetType = UNSET
    trace_id: str | UnsetType = UNSET
    #: The Cedar policies that denied it (``--policy``).
    policies: list[str] | UnsetType = UNSET


class Admin(AuditRecord, kw_only=True):
    """An administrative action."""

    kind: Literal["admin"] = "admin"
    action: Literal["revoke_key", "end_session"]
    actor_tenant: str
    actor_credential: str
    tenant: str
    key: str | UnsetType = UNSET
    session: str | UnsetType = UNSET


class KeysRevoked(AuditRecord, kw_only=True):
    """Keys stopped passing (an admin's revoke, or the config file changed)."""

    kind: Literal["keys_revoked"] = "keys_revoked"
    keys: list[str]


class SubjectsDropped(AuditRecord, kw_only=True):
    """Client certificate subjects stopped standing for their tenant (the config file
    changed); the connections they opened were closed."""

    kind: Literal["subjects_dropped"] = "subjects_dropped"
    subjects: list[str]


class ModelEvent(AuditRecord, kw_only=True):
    """A model version of the registry loaded, refused (with the reason), or retired."""

    kind: Literal["model"] = "model"
    action: Literal["loaded", "refused", "retired"]
    model: str
    version: str
    reason: str | UnsetType = UNSET
    key: str | UnsetType = UNSET  # the id of the key that signed it
    manifest_sha256: str | UnsetType = UNSET


class ModuleEvent(AuditRecord, kw_only=True):
    """A tenant WebAssembly module's version loaded, refused (with the reason) or no longer
    served, at a reload of the module registry."""

    kind: Literal["module"] = "module"
    action: Literal["loaded", "refused", "removed"]
    module: str
    version: str
    reason: str | UnsetType = UNSET
    key: str | UnsetType = UNSET  # the id of the key that signed it
    manifest_sha256: str | UnsetType = UNSET


class StreamKey(AuditRecord, kw_only=True):
    """A key of an end-to-end encrypted connection: agreed at its start (epoch 0, no old key)
    or rotated to (the next epoch, the old key's hash). Keys are named by their SHA-256."""

    kind: Literal["stream_key"] = "stream_key"
    action: Literal["agreed", "rotated"]
    tenant: str
    connection: str
    session: str
    direction: Literal["client_to_server", "server_to_client"]
    epoch_id: int
    old_key_hash: str | None
    new_key_hash: str
    measurement: str  # what served the stream (seedance.server.confidential)
    identity: str  # the id of the server identity that signed the agreement


class Start(AuditRecord, kw_only=True):
    """The server opened the log."""

    kind: Literal["start"] = "start"
    server: str
    previous_end: Literal["sealed", "unsealed"] | UnsetType = UNSET
    discarded_partial_bytes: int | UnsetType = UNSET


class Checkpoint(AuditRecord, kw_only=True):
    """A signature of the chain's head: periodically, before a new file, at the end."""

    kind: Literal["checkpoint", "rotate", "seal"]
    records: int
    signature: str | None
    next_file: str | UnsetType = UNSET  # rotate
    #: The Merkle tree of the ``records`` before it: its root (hex), and with a key, the
    #: checkpoint as a C2SP signed note (records.py, merkle.py, note.py).
    root: str | UnsetType = UNSET
    note: str | UnsetType = UNSET


class Continue(AuditRecord, kw_only=True):
    """The first record of a rotated-to file."""

    kind: Literal["continue"] = "continue"
    previous_file: str
    #: The Merkle tree's frontier before this record (hex; merkle.Frontier), so that this
    #: file and the next ones prove their records without the files before.
    frontier: list[str] | UnsetType = UNSET


class WriterRecovered(AuditRecord, kw_only=True):
    """The log is writable again after a failure."""

    kind: Literal["writer_recovered"] = "writer_recovered"
    error: str | None


def as_dict(record: AuditRecord) -> dict[str, Any]:
    """The record's fields as the line will hold them (``kind`` included)."""
    fields: dict[str, Any] = msgspec.to_builtins(record)
    return fields
