"""End-to-end encryption of ``/v2/infer`` frames (docs/protocol.md, section 9), sans-I/O.

A client asks for it with ``e2e=<its X25519 public key>`` in the connection URL; the server
answers in its ``session`` frame with its own ephemeral X25519 key, signed with its long-term
Ed25519 identity (which the client pins). Both sides then derive one AES-256-GCM key per
direction and every later text frame travels as a binary *sealed frame*::

    offset  size  field
    0       1     0x05 (a sealed frame)
    1       4     key epoch, the key's id (big-endian; 0 for the agreed key, +1 per rotation)
    5       8     counter: the direction's frame number (0, 1, 2, ... for the connection)
    13      8     seq of the frame's first token (signed; -1: the frame has none)
    21      2     L, the request id's length in bytes (0: the frame has none)
    23      L     the request id (UTF-8)
    23+L          AES-256-GCM of the frame's JSON text, its 16-byte tag last

The nonce is the epoch and the counter (12 bytes); the additional data is the label, the
session id and the header, so a frame replayed, reordered, moved to another stream or session,
or with any byte changed fails (:class:`EncryptionFailed` with its reason), and the receiver
checks that the header's request id and seq are the frame's own.

Keys rotate by a ratchet step (``next = HKDF(key, "ratchet")``) after ``rotate_bytes`` sealed or
``rotate_s`` of use, whichever comes first: the sender moves on and drops the old key at once;
the receiver follows when the first frame of the next epoch arrives (a WebSocket delivers in
order, so that frame is the acknowledgement that the old key's last frame came) and drops its
copy. No round trip, no pause. Binary heartbeats (``01 00`` / ``02 00``) carry no data and stay
as they are.

Everything here is `cryptography`'s X25519, Ed25519, HKDF-SHA256 and AES-GCM; nothing
hand-written.
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
import time
from collections.abc import Callable
from typing import Final, Literal

import msgspec
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from seedance.keyfiles import load_public, public_key
from seedance.protocol.errors import EncryptionFailed
from seedance.protocol.tensors import TENSOR, tensor_meta

VERSION: Final = 1
SUITE: Final = "x25519-ed25519-hkdf-sha256-aes-256-gcm"
SEALED: Final = 0x05
LABEL: Final = b"seedance-e2e/1"
TAG_BYTES: Final = 16
DEFAULT_ROTATE_BYTES: Final = 50 * 1024 * 1024
DEFAULT_ROTATE_S: Final = 1800.0

Direction = Literal["client_to_server", "server_to_client"]
#: Told of every key a channel starts using: direction, epoch, the old key's hash (None for the
#: agreed key) and the new key's.
OnKey = Callable[[Direction, int, str | None, str], None]

_HEADER = struct.Struct("!BIQqH")  # type, epoch, counter, seq, request id length
_NONCE = struct.Struct("!IQ")


class Offer(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """The server's half of the agreement: the ``e2e`` field of its ``session`` frame."""

    version: int
    suite: str
    server_key: str  # X25519, raw, base64url
    identity: str  # Ed25519, raw, base64url
    signature: str  # Ed25519 over transcript(...), base64url
    measurement: str  # hex: what the server runs (docs/security.md)
    rotate_bytes: int
    rotate_s: float


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def key_hash(key: bytes) -> str:
    """A key's fingerprint for the audit log (SHA-256, hex): names it without revealing it."""
    return hashlib.sha256(key).hexdigest()


def raw_public(key: X25519PublicKey | Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def transcript(
    client_key: bytes, server_key: bytes, identity: bytes, session_id: str, measurement: str
) -> bytes:
    """What the identity signs and the key derivation is salted with: both ephemeral keys, the
    identity, the session and the measurement, each length-prefixed."""
    parts = [client_key, server_key, identity, session_id.encode(), measurement.encode()]
    return LABEL + b"".join(struct.pack("!H", len(p)) + p for p in parts)


def _hkdf(secret: bytes, salt: bytes | None, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=LABEL + info).derive(secret)


def ratchet(key: bytes) -> bytes:
    """The key after ``key``: one-way, so a later key does not give an earlier one."""
    return _hkdf(key, None, b" ratchet")


def _direction_keys(shared: bytes, salt: bytes) -> tuple[bytes, bytes]:
    """(client to server, server to client)."""
    return _hkdf(shared, salt, b" client_to_server"), _hkdf(shared, salt, b" server_to_client")


def parse_client_key(text: str) -> X25519PublicKey:
    """The ``e2e`` query parameter: the client's ephemeral X25519 key, base64url."""
    try:
        raw = unb64url(text)
        if len(raw) != 32:
            raise ValueError(len(raw))
        key = X25519PublicKey.from_public_bytes(raw)
        X25519PrivateKey.generate().exchange(key)  # a low-order key agrees on zero: refused
    except ValueError:
        raise EncryptionFailed(
            "handshake", "e2e must be a 32-byte X25519 public key (base64url) of full order"
        ) from None
    return key


def accept(
    identity: Ed25519PrivateKey,
    client_key: X25519PublicKey,
    session_id: str,
    measurement: str,
    *,
    rotate_bytes: int = DEFAULT_ROTATE_BYTES,
    rotate_s: float = DEFAULT_ROTATE_S,
    on_key: OnKey | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[Channel, Offer]:
    """The server's side: a fresh ephemeral key, the agreement, the signed offer."""
    ephemeral = X25519PrivateKey.generate()
    server_key = raw_public(ephemeral.public_key())
    identity_raw = raw_public(identity.public_key())
    salt = transcript(raw_public(client_key), server_key, identity_raw, session_id, measurement)
    c2s, s2c = _direction_keys(ephemeral.exchange(client_key), salt)
    offer = Offer(
        version=VERSION,
        suite=SUITE,
        server_key=b64url(server_key),
        identity=b64url(identity_raw),
        signature=b64url(identity.sign(salt)),
        measurement=measurement,
        rotate_bytes=rotate_bytes,
        rotate_s=rotate_s,
    )
    channel = Channel(
        session_id,
        send_key=s2c,
        receive_key=c2s,
        sending="server_to_client",
        rotate_bytes=rotate_bytes,
        rotate_s=rotate_s,
        on_key=on_key,
        clock=clock,
    )
    return channel, offer


class ClientHandshake:
    """The client's side: an ephemeral key for the URL, then :meth:`finish` with the offer."""

    def __init__(self, pinned: Ed25519PublicKey | list[Ed25519PublicKey]) -> None:
        self.pinned = [pinned] if isinstance(pinned, Ed25519PublicKey) else list(pinned)
        if not self.pinned:
            raise ValueError("pin at least one server identity")
        self._private = X25519PrivateKey.generate()
        self.public = raw_public(self._private.public_key())

    @property
    def param(self) -> str:
        """The ``e2e`` query parameter."""
        return b64url(self.public)

    def url(self, url: str) -> str:
        """``url`` with the ``e2e`` query parameter added."""
        return f"{url}{'&' if '?' in url else '?'}e2e={self.param}"

    def finish(
        self,
        offer: Offer | None,
        session_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_key: OnKey | None = None,
    ) -> Channel:
        if offer is None:
            raise EncryptionFailed("handshake", "the server did not agree to encrypt the stream")
        if offer.version != VERSION or offer.suite != SUITE:
            raise EncryptionFailed(
                "handshake", f"unsupported encryption: version {offer.version}, {offer.suite}"
            )
        try:
            identity_raw = unb64url(offer.identity)
            server_key = unb64url(offer.server_key)
            signature = unb64url(offer.signature)
            server_public = X25519PublicKey.from_public_bytes(server_key)
        except ValueError:
            raise EncryptionFailed("handshake", "the server's offer is malformed") from None
        identity = next((k for k in self.pinned if raw_public(k) == identity_raw), None)
        if identity is None:
            raise EncryptionFailed(
                "handshake",
                f"the server's identity {offer.identity[:16]}... is not one of the pinned keys",
            )
        salt = transcript(self.public, server_key, identity_raw, session_id, offer.measurement)
        try:
            identity.verify(signature, salt)
        except InvalidSignature:
            raise EncryptionFailed(
                "handshake", "the server's key agreement is not signed by its identity"
            ) from None
        try:
            shared = self._private.exchange(server_public)
        except ValueError:  # a low-order key: the agreement would be zero
            raise EncryptionFailed("handshake", "the server's key is not usable") from None
        c2s, s2c = _direction_keys(shared, salt)
        return Channel(
            session_id,
            send_key=c2s,
            receive_key=s2c,
            sending="client_to_server",
            rotate_bytes=offer.rotate_bytes,
            rotate_s=offer.rotate_s,
            on_key=on_key,
            clock=clock,
        )


class _Key:
    """One direction's key in use: its epoch, its cipher, what it has sealed, since when."""

    __slots__ = ("aead", "epoch", "hash", "key", "since", "used")

    def __init__(self, key: bytes, epoch: int, since: float) -> None:
        self.key = key
        self.epoch = epoch
        self.aead = AESGCM(key)
        self.hash = key_hash(key)
        self.used = 0
        self.since = since

    def next(self, since: float) -> _Key:
        return _Key(ratchet(self.key), self.epoch + 1, since)


class _Meta(msgspec.Struct):
    """The fields of a frame's JSON text that its header repeats."""

    request_id: str | None = None
    seq: int | None = None


_meta = msgspec.json.Decoder(_Meta)


def frame_meta(text: str | bytes) -> tuple[str | None, int | None]:
    """The request id and seq a frame's JSON text carries (None: not there, or not JSON)."""
    try:
        meta = _meta.decode(text)
    except msgspec.DecodeError:
        return None, None
    return meta.request_id, meta.seq


class Channel:
    """One connection's encryption, both directions: :meth:`seal` what goes out, :meth:`open`
    what comes in. Not thread-safe; frames must be sealed in the order they are sent."""

    def __init__(
        self,
        session_id: str,
        *,
        send_key: bytes,
        receive_key: bytes,
        sending: Direction,
        rotate_bytes: int = DEFAULT_ROTATE_BYTES,
        rotate_s: float = DEFAULT_ROTATE_S,
        on_key: OnKey | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session_id = session_id
        self._session = session_id.encode()
        self._ad_prefix = LABEL + struct.pack("!H", len(self._session)) + self._session
        self.sending: Direction = sending
        self.receiving: Direction = (
            "server_to_client" if sending == "client_to_server" else "client_to_server"
        )
        self.rotate_bytes = rotate_bytes
        self.rotate_s = rotate_s
        self._clock = clock
        self._on_key = on_key
        now = clock()
        self._send = _Key(send_key, 0, now)
        self._receive = _Key(receive_key, 0, now)
        self._sent = 0  # frames sealed (the next counter)
        self._received = 0  # frames opened (the next counter expected)
        self.failed: EncryptionFailed | None = None  # the first refusal: nothing opens after it
        if on_key is not None:
            on_key(self.sending, 0, None, self._send.hash)
            on_key(self.receiving, 0, None, self._receive.hash)

    @property
    def send_epoch(self) -> int:
        return self._send.epoch

    @property
    def receive_epoch(self) -> int:
        return self._receive.epoch

    @property
    def send_key_hash(self) -> str:
        """The hash of the key the next frame is sealed with (unless a rotation is due)."""
        return self._send.hash

    @property
    def receive_key_hash(self) -> str:
        """The hash of the key the last frame opened with."""
        return self._receive.hash

    def seal_frame(self, frame: str | bytes) -> str | bytes:
        """Seal a frame as it goes out: JSON text and tensor frames are sealed (their request
        id and seq read from them for the header); heartbeats go as they are."""
        if isinstance(frame, bytes):
            if frame[:1] != bytes((TENSOR,)):
                return frame
            request_id, seq = tensor_meta(frame)
            return self.seal(frame, request_id, seq)
        request_id, seq = frame_meta(frame)
        return self.seal(frame, request_id, seq)

    def seal(
        self, text: str | bytes, request_id: str | None = None, seq: int | None = None
    ) -> bytes:
        """The sealed frame of ``text`` (JSON text, or a tensor frame's bytes); rotates the
        key first when it is due."""
        key = self._send
        if key.used >= self.rotate_bytes or self._clock() - key.since >= self.rotate_s:
            key = self._rotate_send()
        rid = request_id.encode() if request_id else b""
        header = _HEADER.pack(SEALED, key.epoch, self._sent, -1 if seq is None else seq, len(rid))
        header += rid
        plaintext = text.encode() if isinstance(text, str) else text
        sealed = key.aead.encrypt(
            _NONCE.pack(key.epoch, self._sent), plaintext, self._ad_prefix + header
        )
        self._sent += 1
        key.used += len(plaintext)
        return header + sealed

    def _rotate_send(self) -> _Key:
        old = self._send
        self._send = new = old.next(self._clock())
        if self._on_key is not None:
            self._on_key(self.sending, new.epoch, old.hash, new.hash)
        return new

    def open(self, data: bytes) -> str | bytes:
        """The JSON text of a sealed frame, or the tensor frame it carries (bytes);
        :class:`EncryptionFailed` if it is not exactly the next frame of this connection,
        sealed by the other side. After a refusal every frame is refused: the connection is
        over."""
        if self.failed is not None:
            raise EncryptionFailed(
                self.failed.reason or "", f"refused earlier: {self.failed.message}"
            )
        try:
            return self._open(data)
        except EncryptionFailed as exc:
            self.failed = exc
            raise

    def _open(self, data: bytes) -> str | bytes:
        if len(data) < _HEADER.size + TAG_BYTES or data[0] != SEALED:
            raise EncryptionFailed("malformed", "not a sealed frame")
        _, epoch, counter, seq, rid_len = _HEADER.unpack_from(data)
        body = _HEADER.size + rid_len
        if len(data) < body + TAG_BYTES:
            raise EncryptionFailed("malformed", "a sealed frame cut short")
        key = self._receive
        if epoch == key.epoch + 1:
            key = key.next(self._clock())
        elif epoch != key.epoch:
            raise EncryptionFailed(
                "unknown_key", f"frame {counter}: key {epoch} is not in use (expected {key.epoch})"
            )
        if counter != self._received:
            reason = "replayed" if counter < self._received else "reordered"
            raise EncryptionFailed(
                reason, f"frame {counter} {reason}: expected frame {self._received}"
            )
        header = data[:body]
        try:
            plaintext = key.aead.decrypt(
                _NONCE.pack(epoch, counter), data[body:], self._ad_prefix + header
            )
        except InvalidTag:
            raise EncryptionFailed(
                "bad_tag", f"frame {counter} failed authentication (altered or not ours)"
            ) from None
        tensor = plaintext[:1] == bytes((TENSOR,))
        request_id, inner_seq = tensor_meta(plaintext) if tensor else frame_meta(plaintext)
        if (request_id or "").encode() != data[_HEADER.size : body] or (
            -1 if inner_seq is None else inner_seq
        ) != seq:
            raise EncryptionFailed(
                "mismatch", f"frame {counter}: its header names another request or seq"
            )
        self._received += 1
        if key is not self._receive:  # the first frame of the next key: the old one goes
            old, self._receive = self._receive, key
            if self._on_key is not None:
                self._on_key(self.receiving, key.epoch, old.hash, key.hash)
        key.used += len(plaintext)
        return plaintext if tensor else plaintext.decode()


def load_pinned(source: str | bytes | Ed25519PublicKey) -> Ed25519PublicKey:
    """A pinned server identity: a key, PEM bytes, a PEM file's path (``KEYFILE.pub`` of
    ``seedance models keygen``), or base64url (the offer's ``identity``, as the server logs it
    at start)."""
    if isinstance(source, Ed25519PublicKey):
        return source
    if isinstance(source, str) and not source.startswith("-----"):
        if os.path.exists(source):
            return load_public(source)
        try:
            return Ed25519PublicKey.from_public_bytes(unb64url(source))
        except ValueError:
            raise ValueError(
                f"{source!r} is neither a key file nor a base64url Ed25519 key"
            ) from None
    return public_key(source.encode() if isinstance(source, str) else source, "the pinned PEM")
