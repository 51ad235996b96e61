"""TLS for ``seedance serve``: the server's context, its certificates reloaded from disk, and the
client's certificate in the ASGI scope.

``--tls-cert`` and ``--tls-key`` serve ``wss://`` and ``https://`` on ``--port``. What a client
may negotiate:

- TLS 1.2 or 1.3 (1.0 and 1.1 are refused);
- TLS 1.2: ECDHE key agreement with an AEAD cipher only (AES-GCM, ChaCha20-Poly1305), the
  server's order preferred; TLS 1.3's suites are all of that kind (OpenSSL's defaults);
- no compression (CRIME), no renegotiation.

With ``--tls-client-ca`` a client is asked for a certificate (``CERT_OPTIONAL``): one that does
not verify against those CAs fails the handshake; one that does is named in the scope of every
request on its connection as the ASGI TLS extension says (``scope["extensions"]["tls"]``, its
``client_cert_name`` in RFC 4514) and may stand for a tenant (``tls_subjects``).

Every ``--tls-watch-s`` the certificate, key and client CA files are looked at (modification
time and size); after a change a new context is built from them, and new connections get it
while open ones keep theirs. A change that does not load (a file half written, a key that does
not match) is logged as a warning and the context in use stays. A context is never reloaded in
place: OpenSSL's ``load_cert_chain`` that fails half-way (a new certificate, a key that does not
match it) leaves the context with a certificate and no key, and every later handshake fails
(``NO_SHARED_CIPHER``, tried with OpenSSL 3.0). So the context uvicorn serves stays as it is, and
its server-name callback (which OpenSSL calls for every ClientHello, with SNI or without) moves
each new connection onto the newest context.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from prometheus_client.core import CounterMetricFamily, Metric

from seedance.config import ConfigError, TlsConfig
from seedance.observability.metrics import gauge

logger = logging.getLogger(__name__)

#: TLS 1.2's suites: ECDHE (forward secrecy) with AES-GCM or ChaCha20-Poly1305, authenticated.
CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL"
#: The ASGI TLS extension's ``tls_version`` (the protocol's own numbers).
_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}

Stamp = tuple[tuple[int, int] | None, ...]


@dataclass(frozen=True)
class TlsFiles:
    """The files a context is built from (PEM): the certificate chain, its key, and the CAs of
    client certificates (None: none asked for)."""

    cert: str
    key: str
    client_ca: str | None = None

    @classmethod
    def of(cls, config: TlsConfig) -> TlsFiles:
        assert config.cert is not None and config.key is not None
        return cls(config.cert, config.key, config.client_ca)

    def stamp(self) -> Stamp:
        """Each file's modification time and size (None: cannot be read now)."""
        stamps = []
        for path in (self.cert, self.key, self.client_ca):
            try:
                stat = os.stat(path) if path is not None else None
            except OSError:
                stat = None
            stamps.append(None if stat is None else (stat.st_mtime_ns, stat.st_size))
        return tuple(stamps)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None


def server_context(files: TlsFiles) -> tuple[ssl.SSLContext, x509.Certificate]:
    """A server context for ``files``, and the certificate it presents. :class:`ConfigError`
    names what does not load: a file that cannot be read, one without a certificate or an
    unencrypted key, or a key that does not match the certificate."""
    try:
        chain = x509.load_pem_x509_certificates(_read(files.cert, "--tls-cert"))
    except ValueError:
        raise ConfigError(f"--tls-cert: no PEM certificate in {files.cert}") from None
    try:
        load_pem_private_key(_read(files.key, "--tls-key"), password=None)
    except (ValueError, TypeError) as exc:  # TypeError: encrypted
        reason = "it is encrypted" if isinstance(exc, TypeError) else "not a PEM private key"
        raise ConfigError(f"--tls-key: {files.key}: {reason}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(CIPHERS)
    context.options |= (
        ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION | ssl.OP_CIPHER_SERVER_PREFERENCE
    )
    try:
        context.load_cert_chain(files.cert, files.key, password=_no_password)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"--tls-cert {files.cert} and --tls-key {files.key} do not load together: "
            f"{_reason(exc)}"
        ) from None
    if files.client_ca is not None:
        _read(files.client_ca, "--tls-client-ca")
        try:
            context.load_verify_locations(cafile=files.client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"--tls-client-ca: no PEM certificate in {files.client_ca} ({_reason(exc)})"
            ) from None
        context.verify_mode = ssl.CERT_OPTIONAL
    return context, chain[0]


def _no_password() -> str:
    """OpenSSL's own prompt would wait on the terminal for an encrypted key's password."""
    raise ssl.SSLError("the key is encrypted")


def _reason(exc: Exception) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason == "KEY_VALUES_MISMATCH":
        return "the key does not match the certificate"
    return str(getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc)


def describe(certificate: x509.Certificate) -> str:
    """The certificate's subject and expiry, for the log."""
    expires = certificate.not_valid_after_utc.strftime("%Y-%m-%d %H:%M UTC")
    return f"{certificate.subject.rfc4514_string()} (expires {expires})"


class ServerTls:
    """The TLS context ``seedance serve`` listens with, and its certificates' reloads.

    :attr:`context` is what uvicorn serves; :attr:`current` the newest context that loaded.
    :meth:`check` reloads after a change of the files (the watcher calls it every
    ``tls_watch_s``); tests may call it themselves.
    """

    def __init__(self, files: TlsFiles, watch_s: float = 5.0) -> None:
        self.files = files
        self.watch_s = watch_s
        self._stamp = files.stamp()
        self.context, self.certificate = server_context(files)
        self.current = self.context
        self.context.sni_callback = self._select
        self._watcher: asyncio.Task[None] | None = None
        #: Reloads after a change of the files: ``loaded``, or ``failed`` (the old one stays).
        self.reloads = {"loaded": 0, "failed": 0}
        #: Called after each reload that loaded (the HTTP/3 listener takes the files too).
        self.on_reload: list[Callable[[TlsFiles], None]] = []

    @classmethod
    def of(cls, config: TlsConfig) -> ServerTls | None:
        """The TLS of ``config`` (None without ``--tls-cert``); :class:`ConfigError` when its
        files do not load."""
        if config.cert is None:
            return None
        return cls(TlsFiles.of(config), config.watch_s)

    def describe(self) -> str:
        """One line for the startup log."""
        clients = (
            f"client certificates of {self.files.client_ca} asked for"
            if self.files.client_ca is not None
            else "no client certificate asked for"
        )
        watch = f"files checked every {self.watch_s:g} s" if self.watch_s > 0 else "not reloaded"
        return f"certificate {describe(self.certificate)}; {clients}; {watch}"

    def _select(self, ssl_object: ssl.SSLObject, server_name: str | None, _: Any) -> None:
        current = self.current
        if current is not self.context:
            ssl_object.context = current

    def check(self) -> bool:
        """Reload after the files changed; true when a new context is in use."""
        stamp = self.files.stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp  # a change that fails is not tried again until the next one
        try:
            context, certificate = server_context(self.files)
        except ConfigError as exc:
            logger.warning("TLS certificate not reloaded, the old one stays: %s", exc.message)
            self.reloads["failed"] += 1
            return False
        self.current, self.certificate = context, certificate
        self.reloads["loaded"] += 1
        logger.info("TLS certificate reloaded: %s", describe(certificate))
        for listener in self.on_reload:
            listener(self.files)
        return True

    def collect(self) -> Iterator[Metric]:
        """Its figures, read when Prometheus scrapes: when the certificate served expires (to
        alert on well before), and the reloads."""
        expiry = gauge(
            "seedance_tls_certificate_expiry_timestamp_seconds",
            "When the TLS certificate served now expires (Unix time).",
        )
        expiry.add_metric([], self.certificate.not_valid_after_utc.timestamp())
        reloads = CounterMetricFamily(
            "seedance_tls_certificate_reloads",
            "Reloads of the TLS files after a change (failed: the old certificate stays).",
            labels=["outcome"],
        )
        for outcome, count in self.reloads.items():
            reloads.add_metric([outcome], count)
        yield from (expiry, reloads)

    def start(self) -> None:
        if self.watch_s > 0 and self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name="tls-watch")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.watch_s)
            try:
                self.check()
            except Exception:
                logger.exception("the TLS certificates' watch failed; it tries again")


# ---------------------------------------------------------------------- the client's certificate

App = Callable[[Any, Any, Any], Awaitable[None]]


def tls_extension(ssl_object: ssl.SSLObject) -> dict[str, Any]:
    """The ASGI TLS extension of a connection: its version and the client's certificate (its
    name in RFC 4514, as ``x509.Name.rfc4514_string`` writes it), verified by the handshake."""
    der = ssl_object.getpeercert(binary_form=True)
    name = x509.load_der_x509_certificate(der).subject.rfc4514_string() if der else None
    return {
        "server_cert": None,
        "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
        "client_cert_name": name,
        "client_cert_error": None,
        "tls_version": _VERSIONS.get(ssl_object.version() or ""),
        "cipher_suite": None,
    }


def with_tls(app: App, transport: asyncio.BaseTransport) -> App:
    """``app``, given the connection's TLS extension in every scope (``app`` itself on a plain
    connection). The HTTP and the WebSocket protocols call it when a connection is made: the
    TLS handshake is over by then."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return app
    extension = tls_extension(ssl_object)

    async def tls_app(scope: Any, receive: Any, send: Any) -> None:
        extensions = scope.get("extensions")
        if extensions is None:
            scope["extensions"] = extensions = {}
        extensions["tls"] = extension
        await app(scope, receive, send)

    return tls_app
