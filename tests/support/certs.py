"""Certificates and keys made on the spot: a CA, the server and client certificates it signs,
and key pairs as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID

_DAY = datetime.timedelta(days=1)


def write_key_pair(key: PrivateKeyTypes, private: Path, public: Path) -> None:
    """``key`` in PKCS #8 PEM at ``private``, its public half at ``public``."""
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


@dataclass
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path
    subject: str  # RFC 4514, as cryptography writes it
    serial: int


class Authority:
    """A self-signed CA that issues server and client certificates into ``directory``."""

    def __init__(self, directory: Path, name: str = "Test CA") -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = directory / f"{name.replace(' ', '-').lower()}.pem"
        self.pem.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))

    def server(
        self, file: str, common_name: str = "seedance-test", addresses: tuple[str, ...] = ()
    ) -> Issued:
        """A server certificate for 127.0.0.1, localhost and ``addresses``."""
        names: list[x509.GeneralName] = [x509.DNSName("localhost")]
        for address in ("127.0.0.1", *addresses):
            names.append(x509.IPAddress(ipaddress.ip_address(address)))
        return self._issue(file, common_name, ExtendedKeyUsageOID.SERVER_AUTH, names)

    def client(self, file: str, common_name: str, organization: str = "Acme Bank") -> Issued:
        return self._issue(file, common_name, ExtendedKeyUsageOID.CLIENT_AUTH, [], organization)

    def _issue(
        self,
        file: str,
        common_name: str,
        usage: x509.ObjectIdentifier,
        names: list[x509.GeneralName],
        organization: str | None = None,
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        # The usual order, most general first: RFC 4514 writes it reversed (CN=...,O=...).
        attributes = [x509.NameAttribute(x509.NameOID.COMMON_NAME, common_name)]
        if organization is not None:
            attributes.insert(0, x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, organization))
        subject = x509.Name(attributes)
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 10 * _DAY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        certificate = builder.sign(self.key, hashes.SHA256())
        cert, key_file = self.directory / f"{file}.pem", self.directory / f"{file}.key"
        cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return Issued(cert, key_file, subject.rfc4514_string(), certificate.serial_number)
