"""Ed25519 keys and detached signatures of model manifests, with the ``cryptography`` package.

A signature is a DSSE envelope, as the OpenSSF model-signing format uses: the signed payload
is the manifest file's bytes exactly (an in-toto Statement, :mod:`seedance.models.registry`),
its type ``application/vnd.in-toto+json``, and each signature covers DSSE's pre-authentication
encoding of the two (``DSSEv1 <len> <type> <len> <payload>``), so that neither can be swapped
for another. A key is named by its id: the first 16 hex digits of the SHA-256 of its raw
public bytes. Several trusted keys may be given (a rotation: old and new at once).
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from seedance.keyfiles import key_id

PAYLOAD_TYPE: Final = "application/vnd.in-toto+json"


class Signature(msgspec.Struct):
    keyid: str
    sig: str  # base64


class Envelope(msgspec.Struct):
    """A DSSE envelope (``manifest.sig``)."""

    payloadType: str
    payload: str  # base64 of the manifest's bytes
    signatures: list[Signature]


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what a signature covers."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def keygen(path: Path) -> tuple[Path, str]:
    """A new key pair: the private key at ``path`` (PEM, readable by its owner only), the
    public one at ``path.pub``; returns the public key's path and the key id."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(pem)
    public_path = path.with_name(path.name + ".pub")
    public = private.public_key()
    public_path.write_bytes(
        public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return public_path, key_id(public)


#: The curves of the EC keys a trusted key may be (OpenSSF model-signing's).
EC_CURVES: Final = ("secp256r1", "secp384r1", "secp521r1")


@dataclass(frozen=True, slots=True)
class TrustedKey:
    id: str
    key: Ed25519PublicKey | ec.EllipticCurvePublicKey
    path: str


def load_trusted(paths: list[Path]) -> dict[str, TrustedKey]:
    """The public keys signatures are checked against, by id (PEM files, one key each):
    Ed25519 keys, which sign Seedance's ``manifest.sig``, and EC keys, which sign OpenSSF
    model-signing's ``model.sig`` (:mod:`seedance.models.openssf`). ``ValueError``, one line,
    for any other file."""
    trusted: dict[str, TrustedKey] = {}
    for path in paths:
        try:
            key = serialization.load_pem_public_key(path.read_bytes())
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror}") from None
        except ValueError:
            raise ValueError(f"{path}: not a PEM public key") from None
        if isinstance(key, Ed25519PublicKey):
            trusted[key_id(key)] = TrustedKey(key_id(key), key, str(path))
        elif isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name in EC_CURVES:
            trusted[pem_id(key)] = TrustedKey(pem_id(key), key, str(path))
        else:
            kind = type(key).__name__.removesuffix("PublicKey").lstrip("_")
            if isinstance(key, ec.EllipticCurvePublicKey):
                kind = f"EC on {key.curve.name}"
            raise ValueError(
                f"{path}: the key is {kind}; trusted keys are Ed25519 (Seedance's "
                "manifest.sig) or EC P-256, P-384 or P-521 (OpenSSF model-signing's model.sig)"
            )
    return trusted


def pem_sha256(key: ec.EllipticCurvePublicKey) -> str:
    """The SHA-256 of an EC key's PEM: the hint a model-signing bundle names its key by."""
    pem = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(pem).hexdigest()


def pem_id(key: ec.EllipticCurvePublicKey) -> str:
    """An EC key's id: the first 16 hex digits of its hint (:func:`pem_sha256`)."""
    return pem_sha256(key)[:16]


def sign(payload: bytes, private: Ed25519PrivateKey) -> bytes:
    """The envelope (JSON) of ``payload`` signed by ``private``."""
    signature = private.sign(pae(PAYLOAD_TYPE, payload))
    envelope = Envelope(
        payloadType=PAYLOAD_TYPE,
        payload=base64.b64encode(payload).decode(),
        signatures=[Signature(key_id(private.public_key()), base64.b64encode(signature).decode())],
    )
    return msgspec.json.format(msgspec.json.encode(envelope), indent=2) + b"\n"


class SignatureError(Exception):
    """Why an envelope is not trusted: ``reason`` is ``unknown_key`` or ``bad_signature``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def verify(envelope_bytes: bytes, trusted: dict[str, TrustedKey]) -> tuple[bytes, TrustedKey]:
    """The payload of an envelope one of ``trusted`` signed, and that key."""
    try:
        envelope = msgspec.json.decode(envelope_bytes, type=Envelope)
        payload = base64.b64decode(envelope.payload, validate=True)
    except (msgspec.DecodeError, ValueError) as exc:
        raise SignatureError(
            "bad_signature", f"the signature file is not a DSSE envelope: {exc}"
        ) from None
    if envelope.payloadType != PAYLOAD_TYPE:
        raise SignatureError(
            "bad_signature", f"payloadType {envelope.payloadType!r}, expected {PAYLOAD_TYPE}"
        )
    known = [s for s in envelope.signatures if s.keyid in trusted]
    if not known:
        ids = ", ".join(s.keyid for s in envelope.signatures) or "none"
        raise SignatureError(
            "unknown_key", f"signed by key(s) {ids}, none of them trusted (--model-trust)"
        )
    message = pae(envelope.payloadType, payload)
    for signature in known:
        key = trusted[signature.keyid]
        if not isinstance(key.key, Ed25519PublicKey):  # an EC key signs model.sig, not this
            continue
        try:
            key.key.verify(base64.b64decode(signature.sig), message)
        except (InvalidSignature, ValueError):
            continue
        return payload, key
    raise SignatureError(
        "bad_signature",
        f"the signature by key {known[0].keyid} does not verify: the manifest or the signature "
        "was changed after signing",
    )
