"""The audit log: one hash-chained record per connection, request and administrative action."""

from __future__ import annotations

from pathlib import Path

from seedance.config import ConfigError, ServerConfig
from seedance.keyfiles import load_private
from seedance.observability.audit.writer import AuditLog, AuditSettings, DamagedLog, last_record

__all__ = ["AuditLog", "AuditSettings", "audit_log"]


def audit_log(config: ServerConfig) -> AuditLog | None:
    """The log ``config`` asks for (None without ``audit_file``)."""
    if not config.audit_file:
        return None
    key = None
    if config.audit_signing_key:
        path = Path(config.audit_signing_key).expanduser()
        try:
            key = load_private(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--audit-signing-key: cannot load {path}: {exc}") from None
    settings = AuditSettings(
        path=Path(config.audit_file).expanduser(),
        fsync=config.audit_fsync,
        fsync_interval_s=config.audit_fsync_interval_s,
        signing_key=key,
        checkpoint_interval_s=config.audit_checkpoint_interval_s,
        rotate_bytes=config.audit_rotate_bytes or None,
        rotate_interval_s=config.audit_rotate_interval_s or None,
        required=config.audit_required,
    )
    try:  # a chain that cannot be continued stops the server now, with one line
        last_record(settings.path)
    except DamagedLog as exc:
        raise ConfigError(str(exc)) from None
    except OSError:
        pass  # unreadable now: the writer reports it, and retries
    return AuditLog(settings)
