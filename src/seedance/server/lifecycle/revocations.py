"""Credentials that stop passing: audited, told to the rest of the cluster, and every peer they
opened shut out (``unauthorized``; a WebSocket closes 4401)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from seedance.observability.audit import kinds as audit
from seedance.tenants.auth import Principal, certificate_of

if TYPE_CHECKING:
    from seedance.cluster.revocations import Revocations as ClusterRevocations
    from seedance.server.lifecycle.audit import AuditGate
    from seedance.server.lifecycle.peers import Peers
    from seedance.tenants.access import Access

logger = logging.getLogger(__name__)


class Revocations:
    """What a revocation does here; wired to the access control's reloads and the cluster's
    announcements by the server state."""

    def __init__(
        self,
        access: Access,
        peers: Peers,
        audit_gate: AuditGate,
        cluster: ClusterRevocations | None,
    ) -> None:
        self.access = access
        self.peers = peers
        self.audit = audit_gate
        self.cluster = cluster

    def revoked(self, key_ids: set[str]) -> None:
        """Keys that no longer pass (revoked here, or gone from the file)."""
        self.audit.submit(lambda: audit.KeysRevoked(keys=sorted(key_ids)))
        if self.cluster is not None:  # the other nodes (and workers) first
            self.cluster.announce(key_ids, then=lambda: self._shut_out_keys(key_ids))
        else:
            self._shut_out_keys(key_ids)

    def revoked_elsewhere(self, key_ids: set[str]) -> None:
        """Another node revoked these keys: refused here too."""
        passing = self.access.revoke_elsewhere(key_ids)
        if passing:
            logger.info("keys %s revoked on another node", ", ".join(sorted(passing)))
            self._shut_out_keys(passing)

    def subjects_dropped(self, subjects: set[str]) -> None:
        """Client certificate subjects a reload took from their tenant: audited, and what they
        opened shut out, as a revoked key's is."""
        self.audit.submit(lambda: audit.SubjectsDropped(subjects=sorted(subjects)))

        def reason(principal: Principal, scope: Mapping[str, Any]) -> str | None:
            if not principal.credential.startswith("cert:"):
                return None  # a credential counts before a certificate
            certificate = certificate_of(scope)
            if certificate is None or certificate.subject not in subjects:
                return None
            return (
                f"the client certificate {certificate.subject[:200]} no longer stands for "
                f"tenant {principal.name}"
            )

        self.peers.shut_out(reason)

    def _shut_out_keys(self, key_ids: set[str]) -> None:
        self.peers.shut_out(
            lambda principal, _: (
                f"credential {principal.credential} has been revoked"
                if principal.credential in key_ids
                else None
            )
        )
