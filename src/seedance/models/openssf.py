"""OpenSSF model-signing's format (``model.sig``), through its own package, ``model_signing``.

A version signed with ``model_signing sign key`` (an EC key: P-256, P-384 or P-521) holds a
Sigstore bundle, ``model.sig``: a DSSE envelope of an in-toto statement that lists every file
of the directory with its SHA-256, signed over DSSE's pre-authentication encoding. The bundle
names its key by a hint (the SHA-256 of the public key's PEM), so a version is checked against
the trusted key that hint names, with the package's own verifier: the signature, then every
file, none missing and none added. What the package finds wrong comes back as one of the
registry's reasons (:class:`~seedance.models.signing.SignatureError`).

``seedance models sign --format openssf`` writes this format: Seedance's manifest first (a
plain file then, covered like the weights), then the bundle over the whole directory, so that
``model_signing verify key`` accepts the version unchanged.

The package is an extra (``pip install 'seedance[openssf]'``): it brings Sigstore's client,
which only this format needs.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from seedance.models.signing import EC_CURVES, SignatureError, TrustedKey, pem_sha256

if TYPE_CHECKING:
    from types import ModuleType

#: The bundle's file name in a version's directory (``model_signing``'s default).
BUNDLE: Final = "model.sig"


def _package() -> ModuleType:
    try:
        import model_signing
    except ImportError:
        raise SignatureError(
            "bad_signature",
            f"{BUNDLE} is in OpenSSF model-signing's format, which needs the model-signing "
            "package: pip install 'seedance[openssf]'",
        ) from None
    return model_signing


def check_private(key: Path) -> None:
    """``ValueError`` (one line) unless ``key`` is a PEM private key on a curve this format
    takes (before anything is written)."""
    try:
        private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: not an unencrypted PEM private key") from None
    if not isinstance(private, ec.EllipticCurvePrivateKey) or private.curve.name not in EC_CURVES:
        raise ValueError(f"{key}: OpenSSF model-signing signs with an EC P-256, P-384 or P-521 key")


def sign(directory: Path, key: Path, ignored: tuple[str, ...] = ()) -> Path:
    """Sign every file of ``directory`` (but ``ignored``, names in it) with the EC private
    key at ``key``, as ``model_signing sign key`` does; the bundle's path."""
    model_signing = _package()
    bundle = directory / BUNDLE
    partial = bundle.with_name(f".{BUNDLE}.partial")  # renamed once whole: never read half
    hashing = model_signing.hashing.Config().set_ignored_paths(
        paths=[BUNDLE, partial.name, *ignored], ignore_git_paths=True
    )
    signer = model_signing.signing.Config().use_elliptic_key_signer(private_key=key)
    signer.set_hashing_config(hashing).sign(directory, partial)
    partial.replace(bundle)
    return bundle


def verify(directory: Path, trusted: dict[str, TrustedKey]) -> tuple[bytes, TrustedKey]:
    """The statement ``directory``'s bundle signed (every file checked against it) and the
    trusted key that signed it; :class:`SignatureError` with the reason otherwise."""
    bundle_path = directory / BUNDLE
    try:
        bundle = json.loads(bundle_path.read_bytes())
        hint = bundle["verificationMaterial"]["publicKey"].get("hint", "")
        statement = base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = f"{BUNDLE} is not a model-signing bundle: {exc}"
        raise SignatureError("bad_signature", why) from None
    keys = [
        k
        for k in trusted.values()
        if isinstance(k.key, ec.EllipticCurvePublicKey) and hint in ("", pem_sha256(k.key))
    ]
    if not keys:
        raise SignatureError(
            "unknown_key",
            f"{BUNDLE} is signed by key {hint[:16] or '(unnamed)'}, which is not trusted "
            "(--model-trust: its EC public key)",
        )
    model_signing = _package()
    for key in keys:
        checker = model_signing.verifying.Config().use_elliptic_key_verifier(public_key=key.path)
        try:
            checker.verify(directory, bundle_path)
        except InvalidSignature:
            continue  # no hint in an older bundle: the next trusted key, maybe
        except ValueError as exc:
            raise SignatureError(*_reason(str(exc))) from None
        return statement, key
    raise SignatureError(
        "bad_signature",
        f"the signature in {BUNDLE} does not verify with key {keys[0].id}: the statement or "
        "the signature was changed after signing",
    )


def _reason(message: str) -> tuple[str, str]:
    """The registry's reason for what ``model_signing`` 1.1's verifier said: after
    ``Signature mismatch:``, the repr of a list of the files' differences (added, missing,
    changed), its quotes escaped when a digest's bytes hold one."""
    quote = r"\\*'"
    files = r"([^'\"\]\\]*)"
    for pattern, reason, says in (
        (rf"Extra files found in model {quote}.*?{quote}: {files}", "extra_file", "not signed"),
        (rf"Missing files in model {quote}.*?{quote}: {files}", "missing_file", "not on disk"),
        (rf"Hash mismatch for {quote}([^'\\]*)", "changed_file", "not the file signed"),
    ):
        if found := re.search(pattern, message):
            return reason, f"{found[1]}: {says} ({BUNDLE})"
    return "bad_signature", f"model_signing refused {BUNDLE}: {' '.join(message.split())[:300]}"
