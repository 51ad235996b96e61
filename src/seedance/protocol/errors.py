"""The one error hierarchy of Seedance, shared by the server and the client.

Every error knows its protocol code (``../shared/PROTOCOL.md`` section 5), whether a client
may retry it, the WebSocket close code used when it ends a connection, and its HTTP status on
the OpenAI-compatible API::

    SeedanceError                       internal_error                          HTTP 500
    ├── InvalidJSON                     invalid_json                            HTTP 400
    ├── InvalidRequest                  invalid_request                         HTTP 400
    ├── UnsupportedFrame                unsupported_frame                       HTTP 400
    ├── SessionBusy                     session_busy        (retryable)         HTTP 409
    ├── ContextOverflow                 context_overflow                        HTTP 400
    ├── ModelNotFound                   model_not_found     closes 4404         HTTP 404
    ├── Unauthorized                    unauthorized        closes 4401         HTTP 401
    ├── Forbidden                       forbidden           closes 4403         HTTP 403
    ├── QuotaExceeded                   quota_exceeded      (retryable) 4429 at connect, HTTP 429
    ├── Overloaded                      overloaded          (retryable) 1013 at connect, HTTP 503
    ├── PayloadTooLarge                 payload_too_large   closes 1009         HTTP 413
    ├── EngineError                     engine_error        (retryable)         HTTP 503
    ├── InternalError                   internal_error                          HTTP 500
    ├── HistoryLost                     history_lost        (with a reason)     HTTP 410
    ├── EncryptionFailed                encryption_failed   closes 4400 (with a reason)
    ├── ModuleError                     module_error        (with a reason)     HTTP 500
    ├── NotFound                        not_found           (admin API only)    HTTP 404
    ├── Conflict                        conflict            (admin API only)    HTTP 409
    ├── UpgradeRequired                 upgrade_required    (HTTP only)         HTTP 426
    └── ConnectionClosed                (client side only: the socket closed)

Messages are written for the client: they name the field and the rule, never internal detail.
"""

from __future__ import annotations

from typing import ClassVar

# WebSocket close codes used by the protocol.
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY_VIOLATION = 1008
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_NOT_FOUND = 4404
CLOSE_IDLE_TIMEOUT = 4408
CLOSE_ENCRYPTION_FAILED = 4400
CLOSE_QUOTA_EXCEEDED = 4429


class SeedanceError(Exception):
    """Base class: an error with a protocol code, safe to show to a client."""

    code: ClassVar[str] = "internal_error"
    retryable: ClassVar[bool] = False
    #: Close code when this error ends the connection at any time (``None``: stays open).
    close_code: ClassVar[int | None] = None
    #: Close code when this error happens while connecting.
    connect_close_code: ClassVar[int] = CLOSE_POLICY_VIOLATION
    #: HTTP status on the OpenAI-compatible API.
    http_status: ClassVar[int] = 500

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        retry_after_s: float | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.retry_after_s = retry_after_s
        #: The request field at fault, where one is (the OpenAI API's ``param``).
        self.param = param
        #: Why, in one word, for errors that have several causes (``history_lost``).
        self.reason: str | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class InvalidJSON(SeedanceError):
    code = "invalid_json"
    http_status = 400


class InvalidRequest(SeedanceError):
    code = "invalid_request"
    http_status = 400


class UnsupportedFrame(SeedanceError):
    code = "unsupported_frame"
    http_status = 400


class SessionBusy(SeedanceError):
    code = "session_busy"
    retryable = True
    http_status = 409


class HistoryLost(SeedanceError):
    """A stream cannot be resumed: what the client lacks is gone. ``reason`` says why:
    ``epoch_changed`` (the server lost its stream log), ``expired`` (the stream ended longer
    than the resume window ago, or never was), ``trimmed`` (dropped to keep the tenant's log
    under its byte cap) or ``cursor_ahead`` (the client claims tokens the server never sent)."""

    code = "history_lost"
    http_status = 410
    REASONS: ClassVar[tuple[str, ...]] = ("epoch_changed", "expired", "trimmed", "cursor_ahead")

    def __init__(self, reason: str, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message, request_id=request_id)
        self.reason = reason


class ContextOverflow(SeedanceError):
    code = "context_overflow"
    http_status = 400


class EncryptionFailed(SeedanceError):
    """End-to-end encryption failed (docs/protocol.md, section 9); ``reason`` says why. The
    connection closes (4400) and nothing of the frame reaches the application.

    - ``plaintext``: a text frame on a connection that agreed to encrypt everything;
    - ``malformed``: not a sealed frame (too short, a bad length);
    - ``unknown_key``: its key epoch is neither the current one nor the next;
    - ``replayed``: its counter was seen before; ``reordered``: a frame before it is missing;
    - ``bad_tag``: authentication failed (the ciphertext, the tag, the header or the additional
      data changed, or it was sealed for another session or connection);
    - ``mismatch``: the header's request id or seq is not the frame's own;
    - ``handshake``: the server's offer did not verify (identity not pinned, bad signature).
    """

    code = "encryption_failed"
    close_code = CLOSE_ENCRYPTION_FAILED
    connect_close_code = CLOSE_ENCRYPTION_FAILED
    http_status = 400
    REASONS: ClassVar[tuple[str, ...]] = (
        "plaintext",
        "malformed",
        "unknown_key",
        "replayed",
        "reordered",
        "bad_tag",
        "mismatch",
        "handshake",
    )

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ModelNotFound(SeedanceError):
    code = "model_not_found"
    close_code = CLOSE_NOT_FOUND
    connect_close_code = CLOSE_NOT_FOUND
    http_status = 404


class Unauthorized(SeedanceError):
    code = "unauthorized"
    close_code = CLOSE_UNAUTHORIZED
    connect_close_code = CLOSE_UNAUTHORIZED
    http_status = 401


class Forbidden(SeedanceError):
    code = "forbidden"
    close_code = CLOSE_FORBIDDEN
    connect_close_code = CLOSE_FORBIDDEN
    http_status = 403


class QuotaExceeded(SeedanceError):
    code = "quota_exceeded"
    retryable = True
    connect_close_code = CLOSE_QUOTA_EXCEEDED
    http_status = 429


class Overloaded(SeedanceError):
    code = "overloaded"
    retryable = True
    connect_close_code = CLOSE_TRY_AGAIN_LATER
    http_status = 503


class PayloadTooLarge(SeedanceError):
    code = "payload_too_large"
    close_code = CLOSE_MESSAGE_TOO_BIG
    connect_close_code = CLOSE_MESSAGE_TOO_BIG
    http_status = 413


class EngineError(SeedanceError):
    code = "engine_error"
    retryable = True
    http_status = 503


class InternalError(SeedanceError):
    code = "internal_error"
    connect_close_code = CLOSE_INTERNAL_ERROR


class NotFound(SeedanceError):
    """An administrative endpoint's target (a key, a session) does not exist."""

    code = "not_found"
    http_status = 404


class Conflict(SeedanceError):
    """An administrative action that was already done (a key already revoked)."""

    code = "conflict"
    http_status = 409


class UpgradeRequired(SeedanceError):
    """A plain HTTP request to the WebSocket endpoint."""

    code = "upgrade_required"
    http_status = 426


class ConnectionClosed(SeedanceError):
    """Client side: the connection closed; ``received_code`` and ``reason`` say how."""

    code = "connection_closed"
    retryable = True

    def __init__(self, received_code: int, reason: str = "") -> None:
        super().__init__(f"connection closed with code {received_code}: {reason or 'no reason'}")
        self.received_code = received_code
        self.reason = reason


class ModuleError(SeedanceError):
    """A tenant's WebAssembly module failed the request it ran for (docs/modules.md);
    ``reason`` says how: ``trap``, ``fuel`` (it ran past its instructions), ``timeout`` (past
    its wall-clock bound), ``memory``, ``output_too_large``, ``bad_output``, ``bad_abi``,
    ``forbidden_import``, or ``refused`` (it declined the input, on purpose)."""

    code = "module_error"
    http_status = 500

    def __init__(self, reason: str, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message, request_id=request_id)
        self.reason = reason


ERRORS_BY_CODE: dict[str, type[SeedanceError]] = {
    cls.code: cls
    for cls in (
        InvalidJSON,
        InvalidRequest,
        UnsupportedFrame,
        SessionBusy,
        ContextOverflow,
        HistoryLost,
        EncryptionFailed,
        ModuleError,
        ModelNotFound,
        Unauthorized,
        Forbidden,
        QuotaExceeded,
        Overloaded,
        PayloadTooLarge,
        EngineError,
        InternalError,
    )
}


def error_from_wire(
    code: str,
    message: str,
    *,
    request_id: str | None = None,
    retry_after_s: float | None = None,
    reason: str | None = None,
) -> SeedanceError:
    """Rebuild the typed error of a received ``error`` frame (unknown codes: the base class)."""
    cls = ERRORS_BY_CODE.get(code, SeedanceError)
    if cls is HistoryLost:
        return HistoryLost(reason or "", message, request_id=request_id)
    if cls is EncryptionFailed:
        return EncryptionFailed(reason or "", message)
    if cls is ModuleError:
        return ModuleError(reason or "", message, request_id=request_id)
    err = cls(message, request_id=request_id, retry_after_s=retry_after_s)
    if cls is SeedanceError:
        err.code = code  # type: ignore[misc]  # keep the server's code visible to the caller
    return err
