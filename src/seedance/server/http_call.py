"""One HTTP call of the OpenAI APIs as a plain ASGI exchange: who calls, its body, its
response, the client leaving, and its report when it is not admitted.

An :class:`HttpCall` is an :class:`~seedance.server.lifecycle.refusals.Arrival` from the moment
its request is read (its span opens then, parented by its ``traceparent`` header, which the
response echoes), a :class:`~seedance.server.lifecycle.peers.Peer` while it is answered (a
revoked credential ends it, a shutdown waits for it), and the reader of a generation's log when
one is admitted; what it writes goes through its :class:`HttpResponse`. A refusal is answered in
the OpenAI API's error shape, with the HTTP status each Seedance error names, and reported by
the one reporter of refusals; a generation reports the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from seedance.observability.logs import bind_request
from seedance.protocol.errors import (
    InternalError,
    Overloaded,
    PayloadTooLarge,
    SeedanceError,
    Unauthorized,
)
from seedance.protocol.openai import error_body
from seedance.server.errors import error_headers
from seedance.tenants.auth import OPEN_PRINCIPAL, Principal

if TYPE_CHECKING:
    from seedance.observability.tracing import RequestTrace
    from seedance.server.lifecycle.generation import Generation
    from seedance.server.lifecycle.peers import Kind
    from seedance.server.lifecycle.refusals import Arrival
    from seedance.server.lifecycle.services import Services

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON_HEADERS: Final = [(b"content-type", b"application/json")]
SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Disconnected(Exception):
    """The client went away."""


class HttpResponse:
    """What an HTTP call writes: a status and headers once (with the call's ``traceparent``),
    then its body, whole or in pieces; an error in its API's shape (``errors``: the body of an
    error; OpenAI's by default)."""

    def __init__(
        self, send: Send, traceparent: str, errors: Callable[[SeedanceError], bytes] = error_body
    ) -> None:
        self._send = send
        self._trace_header = (b"traceparent", traceparent.encode())
        self._errors = errors
        self.started = False  # the status line and headers are sent

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        headers = [*headers, self._trace_header]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, data: bytes, *, more: bool = True) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def event(
        self, data: bytes, event_id: str | None = None, name: str | None = None
    ) -> None:
        """One Server-Sent Event."""
        head = b"id: " + event_id.encode() + b"\n" if event_id is not None else b""
        if name is not None:
            head += b"event: " + name.encode() + b"\n"
        await self.write(head + b"data: " + data + b"\n\n")

    async def respond(self, status: int, headers: Headers, body: bytes) -> None:
        """A whole response."""
        await self.start(status, [*headers, (b"content-length", str(len(body)).encode())])
        await self.write(body, more=False)

    async def refuse(self, error: SeedanceError) -> None:
        """An error response, in the API's shape, with the status it names."""
        headers = [*JSON_HEADERS, *error_headers(error)]
        await self.respond(error.http_status, headers, self._errors(error))


class HttpCall:
    """One HTTP request, from its body to the last byte of its response (see the module)."""

    kind: Kind = "http"
    idle = False  # always answering something
    movable = False

    def __init__(
        self,
        services: Services,
        scope: Scope,
        send: Send,
        operation: str,
        request_id: str,
        *,
        path: str | None = None,
        errors: Callable[[SeedanceError], bytes] = error_body,
    ) -> None:
        self.services = services
        self.scope = scope
        self.request_id = request_id
        self.name = f"http {request_id}"
        self.arrival: Arrival = services.refusals.arrive(
            "http", scope, operation, request_id=request_id, path=path
        )
        self.response = HttpResponse(send, self.arrival.trace.traceparent, errors)
        self.principal: Principal = OPEN_PRINCIPAL
        #: The generation it admitted (None: none; its report is then the call's own).
        self.generation: Generation | None = None
        self.outcome = ""
        #: Tokens a call answered without a generation read (embeddings): counted, audited.
        self.prompt_tokens = 0
        self._reported = False
        self._work: asyncio.Future[None] | None = None
        self._shut_out: SeedanceError | None = None

    @property
    def trace(self) -> RequestTrace:
        return self.arrival.trace

    def authenticate(self) -> Principal:
        """The caller (``unauthorized`` and its kin refuse it)."""
        self.principal = self.arrival.principal = self.services.access.authenticate(self.scope)
        return self.principal

    async def answer(
        self,
        receive: Receive,
        run: Callable[[bytes], Awaitable[None]],
        authenticate: Callable[[], Principal] | None = None,
    ) -> None:
        """A POST: the caller checked (by its credential, or by ``authenticate``, which sets
        :attr:`principal`), its body read, then ``run(body)`` served (:meth:`serve`); a refusal
        or a client gone before is answered and reported here."""
        bind_request(self.request_id, self.trace.trace_id)  # for this task and those it starts
        try:
            # The door first: a caller that is not let in costs no body read and no parse.
            (authenticate or self.authenticate)()
            body = await read_body(receive, self.services.config.max_frame_bytes)
        except Disconnected:
            self.ended()
            return
        except SeedanceError as exc:
            await self.fail(exc)
            self.ended()
            return
        await self.serve(run(body), receive)

    async def serve(self, work: Awaitable[None], receive: Receive) -> None:
        """Run ``work`` (the response) while watching for the client leaving, which stops it;
        a peer of the server meanwhile."""
        task = self._work = asyncio.ensure_future(work)
        watcher = asyncio.create_task(_wait_disconnect(receive))
        peers = self.services.peers
        peers.add(self)
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:  # the client left: stop reading the log (see reader_left)
                task.cancel()
                self.outcome = self.outcome or "aborted"
            else:
                watcher.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
            if self._shut_out is not None and task.cancelled():
                await self._render_shut_out(self._shut_out)
        finally:
            peers.discard(self)
        self.ended()

    async def fail(self, error: BaseException) -> None:
        """Refused before a generation started: reported (:meth:`refuse`), then answered."""
        await self.render_error(await self.refuse(error))

    async def refuse(self, error: BaseException) -> SeedanceError:
        """Report a refusal (the record on disk before the answer goes out, where the log
        syncs each record); the error to answer with. Anything but a :class:`SeedanceError`
        is a fault of ours: logged with its traceback, answered as ``internal_error``."""
        if not isinstance(error, SeedanceError):
            logger.error("request %s failed", self.request_id, exc_info=error)
            error = InternalError(f"internal error on request {self.request_id}")
        self.outcome = error.code
        self._reported = True
        record = self.services.refusals.refuse(self.arrival, error)
        with contextlib.suppress(Overloaded):  # an error goes out audited or not
            await self.services.audit.wait(record, f"request {self.request_id}")
        return error

    async def render_error(self, error: SeedanceError) -> None:
        """An error before the response began: the error response; after (a stream): the
        API's own error event, by default OpenAI's ``data: {error}`` and ``[DONE]``."""
        if not self.response.started:
            await self.response.refuse(error)
            return
        body = b"data: " + error_body(error) + b"\n\ndata: [DONE]\n\n"
        await self.response.write(body, more=False)

    def ended(self) -> None:
        """The response is over. A call that admitted no generation and was not refused (a
        response read, a stream resumed, a client that left before its request was read) is
        reported here; an admitted request's generation reported it."""
        if self.generation is not None or self._reported:
            return
        self._reported = True
        self.services.refusals.answered(self.arrival, self.outcome or "aborted", self.prompt_tokens)

    # ---------------------------------------------------------------- as a peer

    def shut_out(self, error: Unauthorized) -> None:
        """Its credential stopped passing: the response stops (the generation it reads is
        left as a disconnect leaves it) and ends with ``error``."""
        if self._work is not None and not self._work.done():
            self._shut_out = error
            self._work.cancel()

    async def _render_shut_out(self, error: SeedanceError) -> None:
        self.outcome = error.code
        with contextlib.suppress(Exception):  # the client may be gone too
            await self.render_error(error)

    def going_away(self) -> None:
        """Nothing to close: a shutdown ends the call through the generation it reads."""

    async def shutdown(self) -> None:
        """As :meth:`going_away`: the drain waits for the call to end."""


def authenticate_call(services: Services, scope: Mapping[str, Any], operation: str) -> Principal:
    """The caller of an HTTP route that writes its own answers (``/v1/models``, ``/admin``);
    a refusal is reported, then raised for the app's error handlers to answer."""
    try:
        return services.access.authenticate(scope)
    except SeedanceError as exc:
        services.refusals.refuse(services.refusals.arrive("http", scope, operation), exc)
        raise


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body is over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
