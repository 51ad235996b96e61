"""Every HTTP error the server answers, rendered in one place, in the OpenAI API's shape.

- :func:`error_headers` (``Retry-After``, ``WWW-Authenticate``, ``Upgrade``), with the body
  from :func:`~seedance.protocol.openai.error_body`, serves the plain-ASGI endpoints that write
  their own responses (the OpenAI API's streaming calls);
- :func:`error_response` is the same as a Starlette response;
- :data:`EXCEPTION_HANDLERS` make the app answer a :class:`SeedanceError` raised by any route,
  and the router's own refusals (404, 405), the same way.

Configuration errors are not among them: they stop the server before it serves
(:class:`~seedance.config.ConfigError`), and a route that writes configuration (the admin API)
says what a failure means for its caller.
"""

from __future__ import annotations

import math

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from seedance.protocol.errors import (
    InvalidRequest,
    NotFound,
    SeedanceError,
    Unauthorized,
    UpgradeRequired,
)
from seedance.protocol.openai import error_body


def error_headers(error: SeedanceError) -> list[tuple[bytes, bytes]]:
    """``Retry-After`` for retryable errors that say when; ``WWW-Authenticate`` for 401;
    ``Upgrade`` for 426."""
    headers = []
    if error.retry_after_s is not None:
        headers.append((b"retry-after", str(max(1, math.ceil(error.retry_after_s))).encode()))
    if isinstance(error, Unauthorized):
        headers.append((b"www-authenticate", b'Bearer realm="seedance"'))
    if isinstance(error, UpgradeRequired):
        headers.append((b"upgrade", b"websocket"))
    return headers


def error_response(error: SeedanceError) -> Response:
    headers = {k.decode(): v.decode() for k, v in error_headers(error)}
    return Response(error_body(error), error.http_status, headers, "application/json")


async def _seedance_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SeedanceError)
    return error_response(exc)


async def _router_error(request: Request, exc: Exception) -> Response:
    """404 and 405 (and any other refusal of the router)."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    error: SeedanceError
    if exc.status_code == 404:
        error = NotFound(f"{where}: no such endpoint")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        error = InvalidRequest(f"{where}: method not allowed; allowed: {allowed}")
    else:
        error = InvalidRequest(f"{where}: {exc.detail}")
    return Response(error_body(error), exc.status_code, exc.headers, "application/json")


EXCEPTION_HANDLERS = {HTTPException: _router_error, SeedanceError: _seedance_error}
