"""OpenAI's Responses API over HTTP, text only: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``.

The same request lifecycle as every other request (:func:`seedance.server.requests.admit`):
a response is a generation whose request id is the response id, and whose stream log keeps
its frames; its events are rendered from the log (:mod:`seedance.protocol.responses`), so a
live reader and one that comes back with ``starting_after`` see the same events, each once.

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
from collections.abc import Awaitable, Mapping
from typing import Any, Final, cast

import msgspec
from starlette.datastructures import QueryParams
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from seedance.observability.logs import bind_request
from seedance.protocol.codec import FrameLimits, validate_session_id
from seedance.protocol.errors import (
    HistoryLost,
    InvalidJSON,
    InvalidRequest,
    NotFound,
    SeedanceError,
    SessionBusy,
)
from seedance.protocol.messages import ChatMessage, RequestId, SessionId, TenantId
from seedance.protocol.openai import error_object
from seedance.protocol.qos import qos_from_headers
from seedance.protocol.responses import (
    FIRST_DELTA,
    Rendered,
    ResponsesRequest,
    decode_responses,
    deleted,
)
from seedance.server.openai_api import (
    JSON_HEADERS,
    SSE_HEADERS,
    HttpCall,
    HttpFollower,
    Receive,
    Scope,
    Send,
    authenticate_http,
)
from seedance.server.requests import Generation, Requester, admit, session_prompt
from seedance.server.state import ApiSocket, ServerState
from seedance.sessions.session import Session, Turn
from seedance.streams.log import StreamLog
from seedance.tenants.policy import check_model

logger = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode
API: Final = "responses"  # the log meta's "api": which renderer its frames are for


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
    )


class ResponsesEndpoint:
    """``POST /v1/responses``."""

    kind = API
    operation = "responses"
    path = "/v1/responses"

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.limits = FrameLimits(
            max_frame_bytes=state.config.max_frame_bytes,
            max_tokens=max(m.limits.max_tokens for m in state.models.values()),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response_id = RequestId("resp_" + secrets.token_hex(24))
        call = ResponseCall(self.state, response_id, scope, send, self)
        await call.answer(receive, lambda body: call.create(body, self.limits))


class ResponseEndpoint:
    """``GET /v1/responses/{id}`` (``?stream=true&starting_after=N``: its events),
    ``DELETE /v1/responses/{id}``, and ``POST /v1/responses/{id}/cancel``."""

    kind = API
    operation = "responses"
    path = "/v1/responses/{response_id}"

    def __init__(self, state: ServerState, action: str = "read") -> None:
        self.state = state
        self.action = action

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response_id = RequestId(scope.get("path_params", {}).get("response_id", ""))
        call = ResponseCall(self.state, response_id, scope, send, self)
        try:
            call.principal = authenticate_http(self.state, scope)
            call.authenticated = True
        except SeedanceError as exc:
            await call.fail(exc)
            call.ended()
            return
        if self.action == "cancel":
            work = call.cancel()
        elif scope.get("method") == "DELETE":
            work = call.delete()
        else:
            work = call.read(QueryParams(scope.get("query_string", b"")))
        await call.serve(call.guarded(work), receive)


class ResponseCall(HttpCall):
    """One request of the Responses API, from its body to the last byte of its answer."""

    async def guarded(self, work: Awaitable[None]) -> None:
        """``work``, its refusal answered as an error (an ``error`` event once streaming)."""
        try:
            await work
        except SeedanceError as exc:
            if not self.started:
                await self.fail(exc)
                return
            self.outcome = exc.code
            await self._sse({"type": "error", "code": exc.code, "message": exc.message})
            await self._end_stream()

    async def create(self, body: bytes, limits: FrameLimits) -> None:
        try:
            generation, request = await self._admit_response(body, limits)
        except Exception as exc:
            await self.fail(exc)
            return
        log = generation.log
        if request.stream:
            await self.events(log, generation, after=-1)
        elif request.background:  # answered at once; it runs on without a reader
            await self._json(rendered(log).response())
        else:
            await self.whole(log, generation)

    async def read(self, query: Mapping[str, str]) -> None:
        log = await self._find()
        self.outcome = "retrieved"
        if query.get("stream", "false").lower() in ("true", "1"):
            after = query.get("starting_after", "-1")
            if not after.lstrip("-").isdigit():
                raise InvalidRequest("starting_after: an integer (a sequence_number)")
            await self.events(log, self.state.generations.get(log.request_id), int(after))
        else:
            await self._json(rendered(log).response())

    async def delete(self) -> None:
        """The response's conversation and its log go; a running one is stopped first."""
        state = self.state
        tenant = self.principal.name
        generation = state.generations.get(self.request_id)
        if generation is not None:
            generation.cancel(silent=True)
        try:
            session_id = SessionId(validate_session_id(self.request_id))
        except InvalidRequest:
            raise self._not_found() from None
        session, created = await state.sessions.attach(TenantId(tenant), session_id)
        await state.sessions.delete(session)
        log = await _logged(state, tenant, self.request_id)
        state.streams.forget(tenant, self.request_id)
        if created and log is None:
            raise self._not_found()
        self.outcome = "deleted"
        await self._json(deleted(self.request_id))

    async def cancel(self) -> None:
        """Stop a background response; answers the response as it ended."""
        log = await self._find()
        generation = self.state.generations.get(self.request_id)
        if log.running:
            assert log.meta is not None
            if not log.meta.get("background"):
                raise InvalidRequest(
                    f"response {self.request_id} is not a background response: only those can "
                    "be cancelled (a foreground one stops when its client disconnects)"
                )
            if generation is None:
                raise InvalidRequest(
                    f"response {self.request_id} runs on another node; cancel it there"
                )
            generation.cancel(silent=False)
            await self.whole(log, None)
            self.outcome = "cancelled"
            return
        await self._json(rendered(log).response())

    # ---------------------------------------------------------------- answers

    async def whole(self, log: StreamLog, generation: Generation | None) -> None:
        """Wait for the end, then answer the Response object."""
        follower = HttpFollower(log, log.next_seq - 1)
        log.attach(follower, log.next_seq - 1)
        if generation is not None:
            generation.reader_joined()
        try:
            while not follower.ended:
                await follower.wait()
                follower.take()  # the text is in the log
        finally:
            log.detach(follower)
            follower.caught_up()
            if generation is not None:
                generation.reader_left()
        await self._json(rendered(log).response())

    async def events(self, log: StreamLog, generation: Generation | None, after: int) -> None:
        """The response's events numbered above ``after``, to its end, as Server-Sent Events."""
        cursor = max(-1, after - FIRST_DELTA)  # the last token the client holds
        if not log.running:
            cursor = min(cursor, log.next_seq - 1)
        follower = HttpFollower(log, cursor)
        log.attach(follower, cursor)  # cursor_ahead, or inside a frame: refused
        if generation is not None:
            generation.reader_joined()
        view = rendered(log)
        try:
            await self._start(200, SSE_HEADERS)
            for event in view.opening(after):
                await self._sse(event)
            while True:
                await follower.wait()
                text, last_seq = follower.take()
                if text:
                    await self._sse(view.delta(text, last_seq))
                if follower.ended:
                    break
        finally:
            log.detach(follower)
            follower.caught_up()
            if generation is not None:
                generation.reader_left()
        for event in rendered(log).closing(after):
            await self._sse(event)
        await self._end_stream()

    # ---------------------------------------------------------------- the transport's

    async def _sse(self, event: dict[str, Any]) -> None:
        """One event of a stream (a Server-Sent Event here)."""
        data = b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def _end_stream(self) -> None:
        await self.send({"type": "http.response.body", "body": b""})

    async def _json(self, body: dict[str, Any]) -> None:
        await self._respond(200, JSON_HEADERS, _encode(body))

    # ---------------------------------------------------------------- admission

    async def _admit_response(
        self, body: bytes, limits: FrameLimits
    ) -> tuple[Generation, ResponsesRequest]:
        state = self.state
        principal = self.principal
        quotas = principal.tenant.quotas
        request = decode_responses(body, limits.capped(quotas.max_tokens))
        # A canary's share: by the conversation it continues, else by the response.
        sticky = request.previous_response_id or self.request_id
        self.model = model = state.resolve_model(request.model, sticky)
        check_model(principal, model.name, state.models)
        message = request.generate
        if model.limits.max_tokens < message.max_tokens:
            raise InvalidRequest(
                f"max_output_tokens must be between 1 and {model.limits.max_tokens}"
            )
        history = []
        if request.previous_response_id is not None:
            history = await self._conversation(request.previous_response_id)
        tenant = TenantId(principal.name)
        session_id = SessionId(self.request_id)
        session: Session | None = None
        if request.store:
            session, _ = await state.sessions.attach(tenant, session_id, quotas.sessions)
        try:
            holder = session or Session((tenant, session_id), time.monotonic())
            if history:
                holder.commit(history, reset=True, max_tokens=model.engine.info.context_length)
            instructions = request.instructions
            preamble = (ChatMessage("system", instructions),) if instructions else ()
            prompt = session_prompt(model, holder, message, preamble)
            prompt.unset = request.unset
            qos = qos_from_headers(self.scope.get("headers", ()))
            requester = Requester(principal, model, "http", session=session, qos=qos)
            self.generation = generation = admit(
                state,
                requester,
                message,
                self.request_id,
                self.received,
                prompt=prompt,
                operation="responses",
                trace=self.trace,
                without_readers="finish" if request.background else "abort",
            )
        except BaseException:
            if session is not None:  # a refused response is not stored
                await state.sessions.delete(session)
            raise
        if session is not None:  # busy while it runs; its TTL counts from its end
            await state.sessions.detach(session)
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
        }
        return generation, request

    async def _conversation(self, previous: str) -> list[Turn]:
        """The stored conversation of response ``previous``."""
        sessions = self.state.sessions
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

    async def _find(self) -> StreamLog:
        log = await _logged(self.state, self.principal.name, self.request_id)
        if log is None:
            raise self._not_found()
        return log

    def _not_found(self) -> NotFound:
        return NotFound(
            f"no response {self.request_id}: it was not stored, was deleted, or ended more than "
            f"{self.state.config.resume_window_s:g} s ago"
        )


async def _logged(state: ServerState, tenant: str, response_id: str) -> StreamLog | None:
    """The log of a Responses API response of ``tenant``, if it is kept."""
    try:
        log = await state.streams.find(tenant, response_id, response_id, None)
    except HistoryLost:
        return None
    if log.meta is None or log.meta.get("api") != API:
        return None
    return log


# --------------------------------------------------------------------------- WebSocket mode


class ResponsesSocket:
    """The Responses API's WebSocket mode (``client.responses.connect()``): ``ws://.../v1/
    responses``; each ``response.create`` event (a ``POST /v1/responses`` body, flat, with an
    optional ``stream_id``) streams its events back as JSON frames, one response at a time per
    socket. Errors are OpenAI's nested ``error`` event; the socket stays open."""

    kind = API
    operation = "responses"
    path = "/v1/responses"

    def __init__(self, state: ServerState, endpoint: ResponsesEndpoint) -> None:
        self.state = state
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ws = WebSocket(scope, receive, cast(Any, send))
        state = self.state
        await ws.accept()
        try:
            principal = authenticate_http(state, scope)
        except SeedanceError as exc:
            await ws.send_text(_encode(socket_error(exc)).decode())
            await ws.close(exc.connect_close_code)
            return
        running: asyncio.Task[None] | None = None
        shutting: list[asyncio.Task[None]] = []

        def shut_out(error: SeedanceError) -> None:
            """Its credential stopped passing: the response under way is cancelled, then the
            error event, and the socket closes."""
            if running is not None:
                running.cancel()
            if not shutting:
                shutting.append(asyncio.create_task(_shut(ws, error), name="responses-shut-out"))

        socket = ApiSocket("responses socket", principal, scope, shut_out)
        state.api_sockets.add(socket)
        try:
            while True:
                text = await ws.receive_text()
                try:
                    event = _socket_event(text)
                    if running is not None and not running.done():
                        raise InvalidRequest(
                            "a response is in progress on this socket: one at a time (wait "
                            "for its last event, or open another socket)"
                        )
                except SeedanceError as exc:
                    await ws.send_text(_encode(socket_error(exc)).decode())
                    continue
                call = SocketResponseCall(
                    state, RequestId("resp_" + secrets.token_hex(24)), scope, ws, self.endpoint
                )
                call.principal, call.authenticated = principal, True
                call.stream_id = event.pop("stream_id", None)
                body = _encode({**event, "stream": True})
                running = asyncio.create_task(call.respond(body, self.endpoint.limits))
        except (WebSocketDisconnect, WebSocketDisconnected):  # its client left, or shut out
            pass
        finally:
            state.api_sockets.discard(socket)
            if running is not None and not running.done():
                running.cancel()  # a foreground response stops when its client leaves
            tasks = [t for t in (running, *shutting) if t is not None]
            await asyncio.gather(*tasks, return_exceptions=True)


async def _shut(ws: WebSocket, error: SeedanceError) -> None:
    with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected):
        await ws.send_text(_encode(socket_error(error)).decode())
        await ws.close(error.connect_close_code, error.code)


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


class SocketResponseCall(ResponseCall):
    """One ``response.create`` of a socket: a :class:`ResponseCall` whose events go out as
    WebSocket frames."""

    def __init__(
        self,
        state: ServerState,
        request_id: RequestId,
        scope: Scope,
        ws: WebSocket,
        endpoint: ResponsesEndpoint,
    ) -> None:
        super().__init__(state, request_id, scope, _no_http, endpoint)
        self.ws = ws
        self.stream_id: str | None = None

    async def respond(self, body: bytes, limits: FrameLimits) -> None:
        bind_request(self.request_id, self.trace.trace_id)
        try:
            await self.create(body, limits)
        finally:
            self.ended()

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True

    async def _sse(self, event: dict[str, Any]) -> None:
        if self.stream_id is not None:
            event = {**event, "stream_id": self.stream_id}
        await self.ws.send_text(_encode(event).decode())

    async def _end_stream(self) -> None:
        pass

    async def _render_error(self, error: SeedanceError) -> None:
        await self.ws.send_text(_encode(socket_error(error, self.stream_id)).decode())


async def _no_http(message: dict[str, Any]) -> None:
    raise AssertionError("a socket's response call writes frames, not HTTP")
