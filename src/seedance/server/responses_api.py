"""OpenAI's Responses API, text only: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, and its WebSocket mode.

The same request lifecycle as every other request (:mod:`seedance.server.lifecycle`): a
response is a generation whose request id is the response id, and whose stream log keeps its
frames; its events are rendered from the log (:mod:`seedance.protocol.responses`), so a live
reader and one that comes back with ``starting_after`` see the same events, each once. A
:class:`ResponseCall` is one call of the API whichever transport carries it: its events go to
an :class:`Events` sink, Server-Sent Events over HTTP (:class:`SseEvents`) or JSON frames over
the WebSocket mode (:class:`SocketEvents`).

**Stored responses** (``store``, the default) are sessions: response ``resp_X`` is the session
``resp_X`` of its tenant, holding the conversation up to and including its reply, so
``previous_response_id`` continues it on any node that shares the session store (the cluster
mode's Redis). The conversation lives as long as a session (``--session-ttl``, from its last
use); the response object and its events as long as the stream log (``--resume-window`` after
the response ended). A response that is not stored is neither.

**Background** responses (``background: true``) run to their end without a reader; ``GET
/v1/responses/{id}?stream=true&starting_after=N`` reads their events from the log, and
``POST .../cancel`` stops them. A foreground response stops when its client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, Protocol, cast

import msgspec
from starlette.datastructures import QueryParams
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from seedance.observability.logs import bind_request
from seedance.observability.tracing import request_attributes
from seedance.protocol.codec import FrameLimits, validate_session_id
from seedance.protocol.errors import (
    CLOSE_GOING_AWAY,
    HistoryLost,
    InternalError,
    InvalidJSON,
    InvalidRequest,
    NotFound,
    SeedanceError,
    SessionBusy,
    Unauthorized,
)
from seedance.protocol.messages import ChatMessage, RequestId, SessionId, TenantId
from seedance.protocol.openai import error_object
from seedance.protocol.qos import qos_from_headers
from seedance.protocol.responses import (
    FIRST_DELTA,
    CallEvents,
    Rendered,
    ResponsesRequest,
    decode_responses,
    deleted,
)
from seedance.protocol.tools import Tools, kept
from seedance.server.http_call import (
    JSON_HEADERS,
    SSE_HEADERS,
    HttpCall,
    HttpResponse,
    Receive,
    Scope,
    Send,
)
from seedance.server.lifecycle.admit import Requester, admit, prepare, session_prompt
from seedance.server.lifecycle.generation import Generation
from seedance.server.lifecycle.peers import Kind
from seedance.server.lifecycle.reader import Reading
from seedance.server.lifecycle.refusals import Arrival
from seedance.server.lifecycle.services import Services
from seedance.sessions.session import Session, Turn
from seedance.streams.log import StreamLog
from seedance.tenants.auth import Principal

logger = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
API: Final = "responses"  # the log meta's "api": which renderer its frames are for
PATH: Final = "/v1/responses"


def rendered(log: StreamLog) -> Rendered:
    """The response as ``log`` holds it now."""
    assert log.meta is not None
    return Rendered(
        id=log.request_id,
        meta=log.meta,
        text="".join(log.texts[: log.entries]),
        tokens=log.next_seq,
        started=log.start is not None,
        end=log.end,
        ended=not log.running,
        logprobs=log.logprobs,
    )


def new_response_id() -> RequestId:
    return RequestId("resp_" + secrets.token_hex(24))


# --------------------------------------------------------------------------- where events go


class Events(Protocol):
    """Where a call's answer goes."""

    @property
    def started(self) -> bool:
        """Whether a stream of events has begun (an error is then an event of it)."""

    async def open(self) -> None:
        """A stream of events begins."""

    async def event(self, event: dict[str, Any]) -> None: ...

    async def end(self) -> None:
        """The stream of events is over."""

    async def whole(self, body: dict[str, Any]) -> None:
        """A whole answer, not a stream."""

    async def error(self, error: SeedanceError) -> None:
        """An error: the answer, or an event of the stream once it has begun."""


class SseEvents:
    """Events as Server-Sent Events of an HTTP response."""

    def __init__(self, response: HttpResponse) -> None:
        self.response = response

    @property
    def started(self) -> bool:
        return self.response.started

    async def open(self) -> None:
        await self.response.start(200, SSE_HEADERS)

    async def event(self, event: dict[str, Any]) -> None:
        await self.response.event(_encode(event), name=event["type"])

    async def end(self) -> None:
        await self.response.write(b"", more=False)

    async def whole(self, body: dict[str, Any]) -> None:
        await self.response.respond(200, JSON_HEADERS, _encode(body))

    async def error(self, error: SeedanceError) -> None:
        if not self.started:
            await self.response.refuse(error)
            return
        await self.event({"type": "error", "code": error.code, "message": error.message})
        await self.end()


class SocketEvents:
    """Events as JSON frames of the WebSocket mode (each with the call's ``stream_id``)."""

    def __init__(self, ws: WebSocket, stream_id: str | None) -> None:
        self.ws = ws
        self.stream_id = stream_id
        self.started = False

    async def open(self) -> None:
        self.started = True

    async def event(self, event: dict[str, Any]) -> None:
        if self.stream_id is not None:
            event = {**event, "stream_id": self.stream_id}
        await self.ws.send_text(_encode(event).decode())

    async def end(self) -> None:
        pass

    async def whole(self, body: dict[str, Any]) -> None:
        raise AssertionError("the WebSocket mode streams every response")

    async def error(self, error: SeedanceError) -> None:
        await self.ws.send_text(_encode(socket_error(error, self.stream_id)).decode())


# --------------------------------------------------------------------------- one call


class ResponseCall:
    """One call of the Responses API (see the module): ``arrival`` names it, ``events``
    carries its answer."""

    def __init__(
        self, services: Services, arrival: Arrival, events: Events, scope: Mapping[str, Any]
    ) -> None:
        assert arrival.request_id is not None and arrival.principal is not None
        self.services = services
        self.arrival = arrival
        self.events = events
        self.scope = scope  # its X-QoS-Priority header
        self.response_id = RequestId(arrival.request_id)
        self.principal: Principal = arrival.principal
        self.generation: Generation | None = None
        self.outcome = ""

    async def create(self, body: bytes) -> None:
        generation, request = await self._admit(body)
        log = generation.log
        if request.stream:
            await self.stream(log, generation, after=-1)
        elif request.background:  # answered at once; it runs on without a reader
            await self.events.whole(rendered(log).response())
        else:
            await self.whole(log, None)

    async def read(self, query: Mapping[str, str]) -> None:
        log = await self._find()
        self.outcome = "retrieved"
        if query.get("stream", "false").lower() in ("true", "1"):
            after = query.get("starting_after", "-1")
            if not after.lstrip("-").isdigit():
                raise InvalidRequest("starting_after: an integer (a sequence_number)")
            await self.stream(log, self._running(), int(after))
        else:
            await self.events.whole(rendered(log).response())

    async def delete(self) -> None:
        """The response's conversation and its log go; a running one is stopped first."""
        services = self.services
        tenant = self.principal.name
        generation = self._running()
        if generation is not None:
            generation.cancel(silent=True)
        try:
            session_id = SessionId(validate_session_id(self.response_id))
        except InvalidRequest:
            raise self._not_found() from None
        session, created = await services.sessions.attach(TenantId(tenant), session_id)
        await services.sessions.delete(session)
        log = await _logged(services, tenant, self.response_id)
        await services.streams.forget(tenant, self.response_id)
        if created and log is None:
            raise self._not_found()
        self.outcome = "deleted"
        await self.events.whole(deleted(self.response_id))

    async def cancel(self) -> None:
        """Stop a background response; answers the response as it ended."""
        log = await self._find()
        if log.running:
            assert log.meta is not None
            if not log.meta.get("background"):
                raise InvalidRequest(
                    f"response {self.response_id} is not a background response: only those "
                    "can be cancelled (a foreground one stops when its client disconnects)"
                )
            tenant, response_id = self.principal.name, self.response_id
            self.services.generations.cancel(tenant, response_id, response_id)
            await self.whole(log, None)
            self.outcome = "cancelled"
            return
        await self.events.whole(rendered(log).response())

    # ---------------------------------------------------------------- answers

    async def whole(self, log: StreamLog, generation: Generation | None) -> None:
        """Wait for the end, then answer the Response object."""
        with Reading(log, generation, log.next_seq - 1) as reading:
            async for _ in reading:
                pass  # the text is in the log
        await self.events.whole(rendered(log).response())

    async def stream(self, log: StreamLog, generation: Generation | None, after: int) -> None:
        """The response's events numbered above ``after``, to its end."""
        view = rendered(log)
        tools = view.tools
        if tools is not None and (view.calls or not view.kind_known):
            await self._stream_tools(log, generation, after, tools)
            return
        cursor = max(-1, after - FIRST_DELTA)  # the last token the client holds
        if not log.running:
            cursor = min(cursor, log.next_seq - 1)
        events = self.events
        with Reading(log, generation, cursor) as reading:  # cursor_ahead, inside a frame: refused
            view = rendered(log)
            await events.open()
            for event in view.opening(after):
                await events.event(event)
            first = cursor + 1
            async for text, last_seq in reading:
                await events.event(view.delta(text, last_seq, first))
                first = last_seq + 1
        await self._close(log, after)

    async def _stream_tools(
        self, log: StreamLog, generation: Generation | None, after: int, tools: Tools
    ) -> None:
        """A response that may call tools whose reply is a call, or has not begun: its
        events are read from the start of the reply (they are numbered by where in it they
        end), and the first text says whether the reply is a message after all."""
        events = self.events
        calls: CallEvents | None = None
        message = False
        with Reading(log, generation, -1) as reading:
            view = rendered(log)
            await events.open()
            for event in view.opening(after):
                await events.event(event)
            first = 0  # the first token not yet sent (a message's)
            async for text, last_seq in reading:
                if calls is None and not message:
                    if not text:
                        continue
                    message = not tools.is_call(text)
                    if message:
                        for event in view.message_opening(after):
                            await events.event(event)
                    else:
                        calls = CallEvents(log.request_id, tools, after)
                if calls is not None:
                    for event in calls.feed(text):
                        await events.event(event)
                else:
                    await events.event(view.delta(text, last_seq, first))
                    first = last_seq + 1
        view = rendered(log)
        if not view.text:  # an empty reply: a message, not opened yet
            for event in view.message_opening(after):
                await events.event(event)
        await self._close(log, after)

    async def _close(self, log: StreamLog, after: int) -> None:
        events = self.events
        for event in rendered(log).closing(after):
            await events.event(event)
        await events.end()

    # ---------------------------------------------------------------- admission

    async def _admit(self, body: bytes) -> tuple[Generation, ResponsesRequest]:
        services = self.services
        principal = self.principal
        quotas = principal.tenant.quotas
        limits = FrameLimits(services.config.max_frame_bytes, services.models.max_tokens)
        request = decode_responses(body, limits.capped(quotas.max_tokens))
        self.arrival.attributes = dict(request_attributes(request.generate))
        # A canary's share: by the conversation it continues, else by the response.
        sticky = request.previous_response_id or self.response_id
        model, message = prepare(
            services,
            self.arrival,
            request.model,
            sticky,
            request.generate,
            unset=request.unset | ({"max_tokens"} if not request.max_tokens_given else set()),
            field="max_output_tokens",
            schema_field="text.format",
        )
        history = []
        if request.previous_response_id is not None:
            history = await self._conversation(request.previous_response_id)
        tenant = TenantId(principal.name)
        session_id = SessionId(self.response_id)
        session: Session | None = None
        if request.store:
            session, _ = await services.sessions.attach(tenant, session_id, quotas.sessions)
        try:
            holder = session or Session((tenant, session_id), time.monotonic())
            if history:
                holder.commit(history, reset=True, max_tokens=model.context_length)
            instructions = request.instructions
            preamble = (ChatMessage("system", instructions),) if instructions else ()
            prompt = session_prompt(model, holder, message, preamble)
            prompt.unset = request.unset
            qos = qos_from_headers(self.scope.get("headers", ()))
            requester = Requester(principal, model, "http", session=session, qos=qos)
            self.generation = generation = admit(
                services,
                self.arrival,
                requester,
                message,
                prompt=prompt,
                without_readers="finish" if request.background else "abort",
            )
        except BaseException:
            if session is not None:  # a refused response is not stored
                await services.sessions.delete(session)
            raise
        if session is not None:  # busy while it runs; its TTL counts from its end
            await services.sessions.detach(session)
        generation.log.meta = {
            "api": API,
            "created_at": int(time.time()),
            "model": model.name,
            "instructions": request.instructions,
            "max_output_tokens": message.max_tokens,
            "temperature": message.temperature,
            "top_p": message.top_p,
            "previous_response_id": request.previous_response_id,
            "store": request.store,
            "background": request.background,
            "metadata": request.metadata,
            "text_format": request.text_format,
        }
        if message.tools:  # the reply is read for calls
            generation.log.meta["tools"] = kept(message, model.engine.call_format)
        return generation, request

    async def _conversation(self, previous: str) -> list[Turn]:
        """The stored conversation of response ``previous``."""
        sessions = self.services.sessions
        try:
            session_id = SessionId(validate_session_id(previous))
        except InvalidRequest:
            raise InvalidRequest(f"previous_response_id: not a response id: {previous!r}") from None
        session, created = await sessions.attach(TenantId(self.principal.name), session_id)
        try:
            if created:
                raise InvalidRequest(
                    f"previous_response_id: no stored response {previous} (it was not stored, "
                    f"was deleted, or was last used more than {sessions.ttl_s:g} s ago)"
                )
            if session.busy:
                raise SessionBusy(
                    f"previous_response_id: response {previous} is still in progress; wait "
                    "for it to end"
                )
            return list(session.turns)
        finally:
            if created:
                await sessions.delete(session)
            else:
                await sessions.detach(session)

    def _running(self) -> Generation | None:
        return self.services.generations.get(self.principal.name, self.response_id)

    async def _find(self) -> StreamLog:
        log = await _logged(self.services, self.principal.name, self.response_id)
        if log is None:
            raise self._not_found()
        return log

    def _not_found(self) -> NotFound:
        return NotFound(
            f"no response {self.response_id}: it was not stored, was deleted, or ended more "
            f"than {self.services.config.resume.window_s:g} s ago"
        )


async def _logged(services: Services, tenant: str, response_id: str) -> StreamLog | None:
    """The log of a Responses API response of ``tenant``, if it is kept."""
    try:
        log = await services.streams.find(tenant, response_id, response_id, None)
    except HistoryLost:
        return None
    if log.meta is None or log.meta.get("api") != API:
        return None
    if not log.running and not log.meta.get("store", True):
        return None  # ended and not stored (a cluster's Redis keeps its log a while longer)
    return log


# --------------------------------------------------------------------------- over HTTP


class ResponsesEndpoint:
    """``POST /v1/responses``."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = HttpCall(self.services, scope, send, "responses", new_response_id())
        await call.answer(receive, lambda body: _answered(call, lambda rc: rc.create(body)))


class ResponseEndpoint:
    """``GET /v1/responses/{id}`` (``?stream=true&starting_after=N``: its events),
    ``DELETE /v1/responses/{id}``, and ``POST /v1/responses/{id}/cancel``."""

    def __init__(self, services: Services, action: str = "read") -> None:
        self.services = services
        self.action = action

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response_id = scope.get("path_params", {}).get("response_id", "")
        call = HttpCall(
            self.services, scope, send, "responses", response_id, path=PATH + "/{response_id}"
        )
        try:
            call.authenticate()
        except SeedanceError as exc:
            await call.fail(exc)
            call.ended()
            return
        if self.action == "cancel":
            await call.serve(_answered(call, ResponseCall.cancel), receive)
        elif scope.get("method") == "DELETE":
            await call.serve(_answered(call, ResponseCall.delete), receive)
        else:
            query = QueryParams(scope.get("query_string", b""))
            await call.serve(_answered(call, lambda rc: rc.read(query)), receive)


async def _answered(call: HttpCall, work: Callable[[ResponseCall], Awaitable[None]]) -> None:
    """``work(response call)`` over HTTP; a refusal reported, and answered as an error (an
    ``error`` event once streaming)."""
    events = SseEvents(call.response)
    responses = ResponseCall(call.services, call.arrival, events, call.scope)
    try:
        await work(responses)
    except Exception as exc:
        error = await call.refuse(exc) if responses.generation is None else _as_error(exc)
        call.outcome = error.code
        await events.error(error)
    finally:
        call.generation = responses.generation
        call.outcome = call.outcome or responses.outcome


def _as_error(exc: Exception) -> SeedanceError:
    """``exc`` as the error a client is sent: a fault of ours is logged with its traceback."""
    if isinstance(exc, SeedanceError):
        return exc
    logger.error("a response failed", exc_info=exc)
    return InternalError("internal error")


# --------------------------------------------------------------------------- WebSocket mode


class ResponsesSocket:
    """The Responses API's WebSocket mode (``client.responses.connect()``): ``ws://.../v1/
    responses``; each ``response.create`` event (a ``POST /v1/responses`` body, flat, with an
    optional ``stream_id``) streams its events back as JSON frames, one response at a time per
    socket. Errors are OpenAI's nested ``error`` event; the socket stays open. A peer of the
    server while it is open."""

    kind: Kind = "responses"

    def __init__(self, services: Services, ws: WebSocket, principal: Principal) -> None:
        self.services = services
        self.ws = ws
        self.principal = principal
        self.name = "responses socket"
        self.running: asyncio.Task[None] | None = None
        self._shutting: list[asyncio.Task[None]] = []

    @property
    def scope(self) -> Mapping[str, Any]:
        return self.ws.scope

    @property
    def idle(self) -> bool:
        return self.running is None or self.running.done()

    movable = False

    @classmethod
    async def serve(cls, services: Services, scope: Scope, receive: Receive, send: Send) -> None:
        """The socket, from its handshake to its close."""
        ws = WebSocket(scope, receive, cast(Any, send))
        await ws.accept()
        try:
            principal = services.access.authenticate(scope)
        except SeedanceError as exc:
            arrival = services.refusals.arrive("websocket", scope, "responses", path=PATH)
            services.refusals.refuse(arrival, exc)
            with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected, RuntimeError):
                await ws.send_text(_encode(socket_error(exc)).decode())
                await ws.close(exc.connect_close_code)
            return
        socket = cls(services, ws, principal)
        services.peers.add(socket)
        try:
            await socket.run()
        finally:
            services.peers.discard(socket)

    async def run(self) -> None:
        services = self.services
        try:
            while True:
                text = await self.ws.receive_text()
                arrival = services.refusals.arrive(
                    "websocket", self.scope, "responses", request_id=new_response_id(), path=PATH
                )
                arrival.principal = self.principal
                try:
                    event = _socket_event(text)
                    stream_id = event.pop("stream_id", None)
                    if not self.idle:
                        raise InvalidRequest(
                            "a response is in progress on this socket: one at a time (wait "
                            "for its last event, or open another socket)"
                        )
                except SeedanceError as exc:
                    services.refusals.refuse(arrival, exc)
                    await self.ws.send_text(_encode(socket_error(exc)).decode())
                    continue
                body = _encode({**event, "stream": True})
                self.running = asyncio.create_task(self._respond(arrival, stream_id, body))
        except (WebSocketDisconnect, WebSocketDisconnected):  # its client left, or shut out
            pass
        finally:
            running = self.running
            if running is not None and not running.done():
                running.cancel()  # a foreground response stops when its client leaves
            tasks = [t for t in (running, *self._shutting) if t is not None]
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _respond(self, arrival: Arrival, stream_id: str | None, body: bytes) -> None:
        """One ``response.create``: a refusal is reported and sent as the error event."""
        bind_request(arrival.request_id or "-", arrival.trace.trace_id)
        events = SocketEvents(self.ws, stream_id)
        call = ResponseCall(self.services, arrival, events, self.scope)
        try:
            await call.create(body)
        except Exception as exc:
            error = _as_error(exc)
            if call.generation is None:
                self.services.refusals.refuse(arrival, error)
            with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected):
                await events.error(error)

    def shut_out(self, error: Unauthorized) -> None:
        """Its credential stopped passing: the response under way is cancelled, then the
        error event, and the socket closes."""
        if self.running is not None:
            self.running.cancel()
        if not self._shutting:
            self._shutting.append(
                asyncio.create_task(self._close(error, error.connect_close_code, error.code))
            )

    def going_away(self) -> None:
        if not self._shutting:
            self._shutting.append(
                asyncio.create_task(self._close(None, CLOSE_GOING_AWAY, "server shutting down"))
            )

    async def shutdown(self) -> None:
        """What runs has had its final event (the drain cancelled its generation): close."""
        if self.running is not None:
            await asyncio.gather(self.running, return_exceptions=True)
        self.going_away()

    async def _close(self, error: SeedanceError | None, code: int, reason: str) -> None:
        with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected, RuntimeError):
            if error is not None:
                await self.ws.send_text(_encode(socket_error(error)).decode())
            await self.ws.close(code, reason)


class ResponsesSocketEndpoint:
    """``ws:// /v1/responses``, a plain ASGI app."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await ResponsesSocket.serve(self.services, scope, receive, send)


def _socket_event(text: str) -> dict[str, Any]:
    try:
        event = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise InvalidJSON(f"not a JSON event: {exc}") from None
    if not isinstance(event, dict):
        raise InvalidJSON("an event is a JSON object")
    kind = event.pop("type", None)
    if kind != "response.create":
        raise InvalidRequest(f"type: {kind!r} is not supported here (response.create)")
    if event.get("background"):
        raise InvalidRequest("background: not over a WebSocket (use POST /v1/responses)")
    event.pop("stream", None)  # implied
    event.pop("generate", None)
    return event


def socket_error(error: SeedanceError, stream_id: str | None = None) -> dict[str, Any]:
    """An error as the Responses API's WebSocket mode sends it (nested, with the status)."""
    body = error_object(error)
    return {
        "type": "error",
        "status": error.http_status,
        "error": body,
        "sequence_number": None,
        "stream_id": stream_id,
    }
