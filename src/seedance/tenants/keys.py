"""API keys: made here, shown once, stored only as a SHA-256 hash in the config file.

A key reads ``sd_<id>_<secret>``: the id (8 hex digits) names the key in logs, audit records
and ``seedance keys revoke``; the secret is 32 random bytes. The config file keeps the id and
the hash of the whole key. A key carries 256 bits of randomness, so one SHA-256 is as strong a
store as a slow password hash would be, and checking a key costs the server a microsecond.

``add_key`` and ``revoke_key`` edit the TOML file with tomlkit, which keeps its comments and
layout, and replace it atomically; a running server reloads its keys when the file changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

import tomlkit
from tomlkit.items import AoT

from seedance.config import ConfigError
from seedance.tenants.config import ROLES, TENANT_NAME, AccessConfig, parse_access

PREFIX: Final = "sd_"


@dataclass(frozen=True)
class NewKey:
    key: str
    id: str
    tenant: str
    role: str


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str | None:
    """The id part of something shaped like a key, or None."""
    if not key.startswith(PREFIX):
        return None
    key_id, sep, secret = key[len(PREFIX) :].partition("_")
    return key_id if sep and secret and key_id else None


def new_key() -> tuple[str, str]:
    """A fresh (key id, key)."""
    key_id = secrets.token_hex(4)
    return key_id, f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def add_key(path: Path, tenant: str, role: str = "user") -> NewKey:
    """Add a key for ``tenant`` (created if needed) to the config file ``path`` (created if
    needed); the key is returned, and stored nowhere."""
    if not TENANT_NAME.fullmatch(tenant):
        raise ConfigError(f"tenant {tenant!r}: 1-64 characters of A-Z a-z 0-9 _ . -")
    if role not in ROLES:
        raise ConfigError(f"role {role!r}: one of {', '.join(ROLES)}")
    doc, _ = _read(path)
    tenants = doc.get("tenants")
    if tenants is None:
        tenants = tomlkit.table(is_super_table=True)
        doc["tenants"] = tenants
    table = tenants.get(tenant)
    if table is None:
        table = tomlkit.table()
        tenants[tenant] = table
    keys = table.get("keys")
    if keys is None:
        keys = tomlkit.aot()
        table["keys"] = keys
    taken = _key_ids(doc)
    key_id, key = new_key()
    while key_id in taken:
        key_id, key = new_key()
    entry = tomlkit.table()
    entry["id"] = key_id
    entry["sha256"] = key_digest(key)
    entry["role"] = role
    entry["created"] = _now()
    keys.append(entry)
    _write(path, doc)
    return NewKey(key=key, id=key_id, tenant=tenant, role=role)


class KeyNotFound(ConfigError):
    """No key with that id in the file."""


class KeyAlreadyRevoked(ConfigError):
    """The key is revoked in the file already."""


def revoke_key(path: Path, key_id: str) -> str:
    """Mark key ``key_id`` revoked in ``path``; returns its tenant."""
    doc, _ = _read(path)
    for tenant, table in (doc.get("tenants") or {}).items():
        for entry in table.get("keys") or ():
            if entry.get("id") == key_id:
                if entry.get("revoked"):
                    raise KeyAlreadyRevoked(f"key {key_id} is already revoked")
                entry["revoked"] = True
                entry["revoked_at"] = _now()
                _write(path, doc)
                return str(tenant)
    raise KeyNotFound(f"no key {key_id} in {path}")


def list_keys(path: Path) -> list[dict[str, Any]]:
    """Every key in ``path``: tenant, id, role, created, revoked."""
    _, access = _read(path)
    return [
        {
            "tenant": tenant.name,
            "id": key.id,
            "role": key.role,
            "created": key.created.isoformat() if key.created else "-",
            "revoked": key.revoked,
        }
        for tenant in access.tenants.values()
        for key in tenant.keys
    ]


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def _key_ids(doc: tomlkit.TOMLDocument) -> set[str]:
    return {
        str(entry.get("id"))
        for table in (doc.get("tenants") or {}).values()
        for entry in (table.get("keys") or ())
    }


def _read(path: Path) -> tuple[tomlkit.TOMLDocument, AccessConfig]:
    """The file as tomlkit edits it, once it is known to be a valid config."""
    try:
        doc = tomlkit.parse(path.read_text())
    except FileNotFoundError:
        doc = tomlkit.document()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except tomlkit.exceptions.ParseError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    return doc, _check(path, doc)


def _check(path: Path, doc: tomlkit.TOMLDocument) -> AccessConfig:
    """The document's access tables; its keys must be arrays of tables (which tomlkit can
    extend), not inline arrays."""
    access = parse_access(doc.unwrap(), str(path), path.parent)
    for name, table in (doc.get("tenants") or {}).items():
        if not isinstance(table.get("keys", AoT([])), AoT):
            raise ConfigError(
                f"{path}: tenants.{name}.keys: write each key as [[tenants.{name}.keys]]"
            )
    return access


def _write(path: Path, doc: tomlkit.TOMLDocument) -> None:
    """Check the result, then replace ``path`` atomically (new files are private: 0600)."""
    _check(path, doc)
    text = tomlkit.dumps(doc)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o600
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
