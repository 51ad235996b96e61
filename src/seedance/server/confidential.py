"""The server's side of confidential streams: its identity, its measurement, and a channel per
connection that asks for end-to-end encryption (the protocol is :mod:`seedance.protocol.e2e`).

The *measurement* names what serves a stream: the SHA-256 of the Seedance build (every file of
the installed package), of the configuration and of each served model (its signed manifest's
hash; for a model outside a registry, its path and size). It is what a TEE's quote would attest:
it is signed into each connection's key agreement and written in every key's audit record.
On a machine with a TEE, the quote of this value goes in the offer (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from seedance.config import ConfigError, ServerConfig
from seedance.keyfiles import key_id, load_private
from seedance.observability.audit import kinds as audit
from seedance.protocol import e2e

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    from seedance.observability.metrics import Metrics
    from seedance.server.lifecycle.models import ServedModel

logger = logging.getLogger(__name__)


@functools.cache
def build_digest() -> str:
    """SHA-256 over the installed ``seedance`` package: each file's path and bytes."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def config_digest(config: ServerConfig) -> str:
    """SHA-256 of the settings, as canonical JSON (values the JSON cannot hold by their repr)."""
    fields = dataclasses.asdict(config)
    text = json.dumps(fields, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def model_digest(model: ServedModel) -> str:
    """A served model's part of the measurement: its signed manifest's hash (which covers every
    byte of its files), else what names it (engine, name, file; ``--model-path`` is in the
    configuration's part)."""
    if model.manifest_sha256:
        return model.manifest_sha256
    info = model.engine.info
    return hashlib.sha256(f"{info.engine}\0{info.name}\0{info.version}".encode()).hexdigest()


def load_identity(config: ServerConfig) -> Ed25519PrivateKey | None:
    """The server's identity (``--e2e-key``; None without it), which signs each key agreement
    and from which ``--encrypt-at-rest`` derives its key; :class:`ConfigError` if it does not
    load."""
    if config.e2e.key is None:
        return None
    try:
        return load_private(config.e2e.key)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--e2e-key: cannot use {config.e2e.key}: {exc}") from None


class Confidential:
    """End-to-end encryption as this server offers it (``--e2e-key``)."""

    def __init__(
        self,
        config: ServerConfig,
        identity: Ed25519PrivateKey,
        models: Callable[[], list[ServedModel]],
        audit_submit: Callable[[Callable[[], audit.AuditRecord]], object],
        metrics: Metrics,
    ) -> None:
        self.identity = identity
        self.identity_id = key_id(identity.public_key())
        logger.info(
            "end-to-end encryption offered%s: identity %s (clients pin %s)",
            " and required" if config.e2e.required else "",
            self.identity_id,
            e2e.b64url(e2e.raw_public(self.identity.public_key())),
        )
        self.required = config.e2e.required
        self.rotate_bytes = config.e2e.rotate_bytes
        self.rotate_s = config.e2e.rotate_s
        self._base = hashlib.sha256(
            f"seedance build {build_digest()}\0config {config_digest(config)}".encode()
        )
        self._models = models
        self._audit_submit = audit_submit
        self._metrics = metrics

    def measurement(self) -> str:
        """The measurement now (a model reload changes it)."""
        digest = self._base.copy()
        for model in sorted(self._models(), key=lambda m: (m.name, m.version)):
            digest.update(f"\0model {model.name} {model.version} {model_digest(model)}".encode())
        return digest.hexdigest()

    def accept(
        self, client_key: X25519PublicKey, session_id: str, tenant: str, connection_id: str
    ) -> tuple[e2e.Channel, e2e.Offer]:
        """The channel and signed offer for a connection that sent ``client_key`` (its ``e2e``
        parameter, parsed by :func:`~seedance.protocol.e2e.parse_client_key`); every
        key it uses is audited (:class:`~seedance.observability.audit.kinds.StreamKey`)."""
        measurement = self.measurement()  # the agreement's; a rotation's is taken when it comes

        def on_key(direction: e2e.Direction, epoch: int, old: str | None, new: str) -> None:
            record = audit.StreamKey(
                action="agreed" if old is None else "rotated",
                tenant=tenant,
                connection=connection_id,
                session=session_id,
                direction=direction,
                epoch_id=epoch,
                old_key_hash=old,
                new_key_hash=new,
                measurement=measurement if old is None else self.measurement(),
                identity=self.identity_id,
            )
            self._audit_submit(lambda: record)
            if old is not None:
                self._metrics.stream_key_rotations.labels(direction).inc()
                logger.info("conn %s: %s key rotated to epoch %d", connection_id, direction, epoch)

        self._metrics.encrypted_connections.inc()
        return e2e.accept(
            self.identity,
            client_key,
            session_id,
            measurement,
            rotate_bytes=self.rotate_bytes,
            rotate_s=self.rotate_s,
            on_key=on_key,
        )
