"""The audit log: one hash-chained record per connection, request and administrative action."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from seedance.keyfiles import load_private
from seedance.observability.audit.writer import AuditLog, AuditSettings, DamagedLog, last_record
from seedance.settings import ConfigError

if TYPE_CHECKING:
    from seedance.config import AuditConfig

__all__ = ["AuditLog", "AuditSettings", "audit_log"]


def audit_log(config: AuditConfig, *, shared: bool = False) -> AuditLog | None:
    """The log the ``[audit]`` section asks for (None without ``--audit-file``); ``shared``:
    written by several processes (the workers of ``--workers N``)."""
    if not config.file:
        return None
    key = None
    if config.signing_key:
        path = Path(config.signing_key).expanduser()
        try:
            key = load_private(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--audit-signing-key: cannot load {path}: {exc}") from None
    settings = AuditSettings(
        path=Path(config.file).expanduser(),
        fsync=config.fsync,
        fsync_interval_s=config.fsync_interval_s,
        signing_key=key,
        checkpoint_interval_s=config.checkpoint_interval_s,
        rotate_bytes=config.rotate_bytes or None,
        rotate_interval_s=config.rotate_interval_s or None,
        required=config.required,
        shared=shared,
    )
    try:  # a chain that cannot be continued stops the server now, with one line
        last_record(settings.path)
    except DamagedLog as exc:
        raise ConfigError(str(exc)) from None
    except OSError:
        pass  # unreadable now: the writer reports it, and retries
    return AuditLog(settings)
