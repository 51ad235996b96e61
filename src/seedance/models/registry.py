"""The model registry: ``ROOT/NAME/VERSION/`` holding a model's files, its manifest and the
manifest's signature, and which version of each name is promoted.

The manifest (``manifest.json``) is an in-toto Statement, as the OpenSSF model-signing format
has it: one subject per file of the model (its path in the directory, its SHA-256, its size),
and Seedance's predicate: the model's name, its semantic version, the git commit it was built
from, the engine and its options, and the limits a request must meet (context length,
``max_tokens``, sampling ranges). ``manifest.sig`` is a DSSE envelope of the manifest's exact
bytes signed with Ed25519 (:mod:`seedance.models.signing`).

:func:`verify` checks a version before any engine reads a byte of it, and refuses, with the
reason: a signature that does not verify (``bad_signature``), a key that is not trusted
(``unknown_key``), a file the manifest does not list (``extra_file``), one it lists that is
missing (``missing_file``) or differs from what was signed (``changed_file``), a symlink that
leads out of the directory (``symlink_escape``), a version lower than the one served
(``rollback``), and a manifest that is not one (``bad_manifest``).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec

from seedance.keyfiles import load_private
from seedance.models import openssf
from seedance.models.signing import SignatureError, TrustedKey, sign
from seedance.models.signing import verify as verify_envelope

MANIFEST: Final = "manifest.json"
SIGNATURE: Final = "manifest.sig"
#: How a version may be signed: Seedance's ``manifest.sig``, OpenSSF model-signing's ``model.sig``.
SIGNATURE_FORMATS: Final = ("seedance", "openssf")
PROMOTED: Final = "PROMOTED"  # ROOT/NAME/PROMOTED: the version served by default
CANARY: Final = "CANARY"  # ROOT/NAME/CANARY: "VERSION SHARE", a version for a share of sessions
STATEMENT_TYPE: Final = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE: Final = "https://seedance.dev/model-manifest/v1"
_SEMVER: Final = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?"
)
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HASH_CHUNK: Final = 1 << 20


class Digest(msgspec.Struct):
    sha256: str


class Subject(msgspec.Struct):
    name: str  # the file's path in the version's directory, with "/"
    digest: Digest
    annotations: dict[str, int] = {}  # {"size": bytes}


class Limits(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a request to this model must meet (beyond what the engine allows)."""

    context_length: int | None = None
    max_tokens: int | None = None
    temperature: tuple[float, float] | None = None
    top_p: tuple[float, float] | None = None


class Predicate(msgspec.Struct):
    name: str
    version: str
    git_commit: str
    engine: str
    engine_options: dict[str, str | int | float | bool] = {}
    limits: Limits = Limits()
    created_at: str = ""


class Statement(msgspec.Struct):
    _type: str = msgspec.field(name="_type")
    subject: list[Subject] = []
    predicateType: str = PREDICATE_TYPE
    predicate: Predicate | None = None


class ModelRefused(Exception):
    """A model version that must not be loaded; ``reason`` names the rule it broke."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class VerifiedModel:
    """A version that passed :func:`verify`: what the engine may now read."""

    path: Path
    manifest: Predicate
    files: tuple[Subject, ...]
    key: TrustedKey
    manifest_sha256: str

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version

    def file(self, suffix: str) -> Path | None:
        """The first listed file whose name ends with ``suffix`` (``.gguf``, say)."""
        for subject in self.files:
            if subject.name.endswith(suffix):
                return self.path / subject.name
        return None


def semver(text: str) -> tuple[int, int, int, tuple[Any, ...]]:
    """A semantic version's order key (a pre-release sorts before its release)."""
    match = _SEMVER.fullmatch(text)
    if match is None:
        raise ValueError(f"not a semantic version (MAJOR.MINOR.PATCH): {text!r}")
    major, minor, patch, pre = match.groups()
    pre_key: tuple[Any, ...] = (1,)
    if pre:
        pre_key = (0, *((0, int(p)) if p.isdigit() else (1, p) for p in pre.split(".")))
    return int(major), int(minor), int(patch), pre_key


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- signing (CI)


def place(source: Path, folder: Path) -> Path:
    """``source`` into a version's directory: a hard link where the filesystem allows (no
    second copy of the weights on disk), else a copy."""
    target = folder / source.name
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
    return target


def sign_version(
    directory: Path,
    key: Path,
    *,
    name: str,
    version: str,
    git_commit: str,
    engine: str,
    engine_options: dict[str, str | int | float | bool] | None = None,
    limits: Limits | None = None,
    signature_format: str = "seedance",
) -> Path:
    """Write ``manifest.json`` (every file of ``directory``, hashed) and sign it with the
    private key at ``key``: ``manifest.sig`` (``signature_format`` ``seedance``, an Ed25519
    key), or OpenSSF model-signing's ``model.sig`` over every file, the manifest included
    (``openssf``, an EC key). The other format's signature file goes. Returns the
    manifest's path."""
    if signature_format not in SIGNATURE_FORMATS:
        raise ValueError(f"format: one of {', '.join(SIGNATURE_FORMATS)}, got {signature_format!r}")
    if not _NAME.fullmatch(name):
        raise ValueError(f"name: 1-64 letters, digits, '_.-', got {name!r}")
    semver(version)
    subjects = []
    for path in sorted(_files(directory)):
        relative = path.relative_to(directory).as_posix()
        if relative in (MANIFEST, SIGNATURE, openssf.BUNDLE):
            continue
        subjects.append(Subject(relative, Digest(file_sha256(path)), {"size": path.stat().st_size}))
    if not subjects:
        raise ValueError(f"{directory}: no file to sign")
    statement = Statement(
        _type=STATEMENT_TYPE,
        subject=subjects,
        predicate=Predicate(
            name=name,
            version=version,
            git_commit=git_commit,
            engine=engine,
            engine_options=engine_options or {},
            limits=limits or Limits(),
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        ),
    )
    payload = msgspec.json.format(msgspec.json.encode(statement), indent=2) + b"\n"
    manifest = directory / MANIFEST
    if signature_format == "openssf":
        openssf.check_private(key)
        manifest.write_bytes(payload)
        openssf.sign(directory, key)
        (directory / SIGNATURE).unlink(missing_ok=True)
    else:
        private = load_private(key)
        manifest.write_bytes(payload)
        partial = directory / f".{SIGNATURE}.partial"  # renamed once whole: never read half
        partial.write_bytes(sign(payload, private))
        partial.replace(directory / SIGNATURE)
        (directory / openssf.BUNDLE).unlink(missing_ok=True)
    return manifest


def _files(directory: Path) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        dirs.sort()
        base = Path(root)
        found += [base / name for name in files]
        found += [base / name for name in dirs if (base / name).is_symlink()]
    return found


# --------------------------------------------------------------------------- verifying


def verify(
    directory: Path,
    trusted: dict[str, TrustedKey],
    *,
    served: str | None = None,
    expected: tuple[str, str] | None = None,
) -> VerifiedModel:
    """Check a version (see the module); ``served``: the version served now, which a new one
    may not be lower than; ``expected``: the name and version the registry's directories say
    (an older signed manifest put in a newer version's place is a ``rollback``). A version
    with OpenSSF model-signing's ``model.sig`` and no ``manifest.sig`` is checked in that
    format (:func:`_openssf`)."""
    root = directory.resolve()
    if (root / openssf.BUNDLE).exists() and not (root / SIGNATURE).exists():
        statement, payload, key = _openssf(root, trusted, expected)
        files_checked = True
    else:
        statement, payload, key = _seedance(root, trusted)
        files_checked = False
    predicate = statement.predicate
    if predicate is None:
        raise ModelRefused("bad_manifest", f"{MANIFEST}: not a Seedance model statement")
    try:
        order = semver(predicate.version)
    except ValueError as exc:
        raise ModelRefused("bad_manifest", f"{MANIFEST}: version: {exc}") from None
    if expected is not None:
        name, version = expected
        if predicate.name != name:
            raise ModelRefused(
                "bad_manifest", f"the manifest names {predicate.name!r}, its directory {name!r}"
            )
        if predicate.version != version:
            why = "rollback" if order < semver(version) else "bad_manifest"
            raise ModelRefused(
                why,
                f"the manifest says version {predicate.version}, its directory {version}: an "
                "older signed manifest in a newer version's place"
                if why == "rollback"
                else f"the manifest says version {predicate.version}, its directory {version}",
            )
    if served is not None and order < semver(served):
        raise ModelRefused(
            "rollback",
            f"{predicate.name} {predicate.version} is older than the version served "
            f"({served}); a rollback is a promote of that version, not a new manifest",
        )
    _check_files(root, statement.subject, hashed=not files_checked)
    return VerifiedModel(
        path=root,
        manifest=predicate,
        files=tuple(statement.subject),
        key=key,
        manifest_sha256=hashlib.sha256(payload).hexdigest(),
    )


def _seedance(root: Path, trusted: dict[str, TrustedKey]) -> tuple[Statement, bytes, TrustedKey]:
    """Seedance's own format: ``manifest.json`` and its envelope, ``manifest.sig``."""
    try:
        envelope = (root / SIGNATURE).read_bytes()
        manifest_bytes = (root / MANIFEST).read_bytes()
    except OSError as exc:
        raise ModelRefused(
            "bad_signature", f"{root}: no manifest or signature ({exc.strerror})"
        ) from None
    try:
        payload, key = verify_envelope(envelope, trusted)
    except SignatureError as exc:
        raise ModelRefused(exc.reason, exc.message) from None
    if payload != manifest_bytes:
        raise ModelRefused(
            "bad_signature", f"{MANIFEST} differs from what {SIGNATURE} signed: it was changed"
        )
    return _statement(payload), payload, key


def _openssf(
    root: Path, trusted: dict[str, TrustedKey], expected: tuple[str, str] | None
) -> tuple[Statement, bytes, TrustedKey]:
    """OpenSSF model-signing's format: ``model.sig`` over every file (checked by the
    ``model_signing`` package). Seedance's ``manifest.json``, when there, must be one of the
    files it signed; without one, the name and version are the directories' (``NAME/VERSION``,
    or ``expected``) and the engine is ``llamacpp`` for a ``.gguf`` file, else
    ``transformers``. The payload is the bundle's signed statement."""
    try:
        signed, key = openssf.verify(root, trusted)
    except SignatureError as exc:
        raise ModelRefused(exc.reason, exc.message) from None
    try:
        resources = msgspec.json.decode(signed, type=_SignedStatement).predicate.resources
    except msgspec.DecodeError as exc:
        raise ModelRefused("bad_manifest", f"{openssf.BUNDLE}'s statement: {exc}") from None
    subjects = [Subject(r.name, Digest(r.digest)) for r in resources if r.algorithm == "sha256"]
    if (root / MANIFEST).exists():
        digests = {s.name: s.digest.sha256 for s in subjects}
        if MANIFEST not in digests:
            raise ModelRefused(
                "bad_manifest", f"{MANIFEST} is not among the files {openssf.BUNDLE} signed"
            )
        statement = _statement((root / MANIFEST).read_bytes())
        for subject in statement.subject:  # the files the engine reads: every one signed
            if digests.get(subject.name) != subject.digest.sha256:
                raise ModelRefused(
                    "bad_manifest",
                    f"{MANIFEST} lists {subject.name}, which {openssf.BUNDLE} signed otherwise "
                    "or not at all",
                )
        return statement, signed, key
    name, version = expected or (root.parent.name, root.name)
    engine = "llamacpp" if any(s.name.endswith(".gguf") for s in subjects) else "transformers"
    predicate = Predicate(name=name, version=version, git_commit="", engine=engine)
    return Statement(_type=STATEMENT_TYPE, subject=subjects, predicate=predicate), signed, key


class _Resource(msgspec.Struct):
    name: str
    algorithm: str
    digest: str


class _SignedPredicate(msgspec.Struct):
    resources: list[_Resource] = []


class _SignedStatement(msgspec.Struct):
    """What a model-signing bundle signs: the files and their digests."""

    predicate: _SignedPredicate


def _statement(payload: bytes) -> Statement:
    try:
        statement = msgspec.json.decode(payload, type=Statement)
    except msgspec.DecodeError as exc:
        raise ModelRefused("bad_manifest", f"{MANIFEST}: {exc}") from None
    if (
        statement._type != STATEMENT_TYPE
        or statement.predicateType != PREDICATE_TYPE
        or statement.predicate is None
    ):
        raise ModelRefused("bad_manifest", f"{MANIFEST}: not a Seedance model statement")
    return statement


def _check_files(root: Path, subjects: list[Subject], *, hashed: bool) -> None:
    """No symlink out of ``root``; with ``hashed``, every file listed, there and the one
    signed, and none other (a model-signing bundle's check did that part already)."""
    listed = {subject.name: subject for subject in subjects}
    for path in _files(root):
        relative = path.relative_to(root).as_posix()
        if path.is_symlink():
            target = path.resolve()
            if root not in target.parents:
                raise ModelRefused(
                    "symlink_escape", f"{relative} links out of the directory (to {target})"
                )
        if hashed and relative not in listed and relative not in (MANIFEST, SIGNATURE):
            raise ModelRefused("extra_file", f"{relative} is not in the signed manifest")
    if not hashed:
        return
    for name, subject in listed.items():
        path = root / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise ModelRefused("bad_manifest", f"{MANIFEST}: subject {name!r} is not inside")
        if not path.is_file():
            raise ModelRefused("missing_file", f"{name} is in the manifest but not on disk")
        size = subject.annotations.get("size")
        if size is not None and path.stat().st_size != size:
            raise ModelRefused("changed_file", f"{name} is not the file that was signed (size)")
        if file_sha256(path) != subject.digest.sha256:
            raise ModelRefused("changed_file", f"{name} is not the file that was signed (SHA-256)")


# --------------------------------------------------------------------------- the registry


class Registry:
    """A directory of models: ``NAME/VERSION/`` and ``NAME/PROMOTED``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _NAME.fullmatch(p.name))

    def versions(self, name: str) -> list[str]:
        """The versions of ``name`` on disk, oldest first (directories named by a semver)."""
        folder = self.root / name
        if not folder.is_dir():
            return []
        found = [p.name for p in folder.iterdir() if p.is_dir() and _SEMVER.fullmatch(p.name)]
        return sorted(found, key=semver)

    def promoted(self, name: str) -> str | None:
        """The promoted version of ``name``, else its newest."""
        pointer = self.root / name / PROMOTED
        if pointer.is_file():
            return pointer.read_text().strip() or None
        versions = self.versions(name)
        return versions[-1] if versions else None

    def promote(self, name: str, version: str) -> None:
        """Serve ``version`` of ``name`` by default (promote a canary, or roll back); a canary
        of that version is one no more."""
        if version not in self.versions(name):
            raise ValueError(f"no version {version} of {name} in {self.root}")
        canary = self.canary(name)
        if canary is not None and canary[0] == version:
            (self.root / name / CANARY).unlink()
        self._write(name, PROMOTED, version)

    def canary(self, name: str) -> tuple[str, float] | None:
        """The canary of ``name``: its version and the share of sessions it takes."""
        pointer = self.root / name / CANARY
        if not pointer.is_file():
            return None
        version, _, share = pointer.read_text().strip().partition(" ")
        try:
            return version, float(share)
        except ValueError:
            return None

    def set_canary(self, name: str, version: str | None, share: float = 0.0) -> None:
        """Give ``version`` ``share`` of the sessions (0 < share < 1); None: no canary."""
        if version is None:
            (self.root / name / CANARY).unlink(missing_ok=True)
            return
        if version not in self.versions(name):
            raise ValueError(f"no version {version} of {name} in {self.root}")
        if not 0 < share < 1:
            raise ValueError(f"share: between 0 and 1 (exclusive), got {share}")
        self._write(name, CANARY, f"{version} {share:g}")

    def _write(self, name: str, pointer: str, text: str) -> None:
        path = self.root / name / pointer
        temporary = path.with_suffix(".tmp")
        temporary.write_text(text + "\n")
        temporary.replace(path)  # atomically: a reader sees the old or the new

    def path(self, name: str, version: str) -> Path:
        return self.root / name / version
