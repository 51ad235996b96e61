"""An edge and a far gateway's keys and certificates, and how to start them: in this process
(``make_server``) or as ``seedance serve`` processes (their flags)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from seedance.relay.tokens import mint
from tests.support.certs import Authority, Issued
from tests.support.servers import RunningServer, ServerProcess


class Region:
    """The keys and certificates of an edge and a far gateway."""

    def __init__(self, directory: Path, far_addresses: tuple[str, ...] = ()) -> None:
        self.authority = Authority(directory)
        self.far_cert: Issued = self.authority.server("far", addresses=far_addresses)
        self.edge_key = Ed25519PrivateKey.generate()
        self.edge_key_file = directory / "edge.pem"
        self.edge_key_file.write_bytes(
            self.edge_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        self.edge_public = directory / "edge.pub.pem"
        self.edge_public.write_bytes(
            self.edge_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def far(self, make_server: Callable[..., RunningServer], **fields: Any) -> RunningServer:
        return make_server(
            tls_cert=str(self.far_cert.cert),
            tls_key=str(self.far_cert.key),
            http3=True,
            node_id="far-1",
            relay_trust=(("edge-1", str(self.edge_public)),),
            **fields,
        )

    def edge(
        self,
        make_server: Callable[..., RunningServer],
        far: RunningServer | ServerProcess,
        **fields: Any,
    ) -> RunningServer:
        return make_server(
            engine="relay",
            peer=(("far-1", f"https://127.0.0.1:{far.port}"),),
            key=str(self.edge_key_file),
            ca=str(self.authority.pem),
            model="synthetic",
            node_id="edge-1",
            **fields,
        )

    def token(self, **claims: Any) -> str:
        fields: dict[str, Any] = {
            "issuer": "edge-1",
            "audience": "far-1",
            "tenant": "default",
            "session": "s1",
        }
        fields.update(claims)
        return mint(self.edge_key, **fields)

    def far_flags(self) -> list[str]:
        """``seedance serve`` flags of the far gateway (its engine and address aside)."""
        return [
            "--tls-cert", str(self.far_cert.cert), "--tls-key", str(self.far_cert.key),
            "--http3", "--node-id", "far-1", "--relay-trust", f"edge-1={self.edge_public}",
        ]  # fmt: skip

    def edge_flags(self, far_url: str) -> list[str]:
        """``seedance serve`` flags of an edge relaying to the far gateway at ``far_url``."""
        return [
            "--engine", "relay", "--node-id", "edge-1", "--relay-peer", f"far-1={far_url}",
            "--relay-key", str(self.edge_key_file), "--relay-ca", str(self.authority.pem),
            "--relay-model", "synthetic",
        ]  # fmt: skip
